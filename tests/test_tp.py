"""Tensor parallel (DeepSpeed AutoTP, gloo on CPU): each rank keeps and evicts its own KV heads, no collective
is added by eviction, and the results equal a single process."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import assert_kept_equal, assert_logits_close, assert_tokens_equal, requires_deepspeed
from multiproc import (
    FAMILIES,
    assert_matches_single,
    assert_rank1_killed_and_nobody_finished,
    make_model,
    prompt_batch,
    run_child,
    run_tp,
    single_process,
)
from reference import reference_generate, rule_string

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.method import Method

pytestmark = requires_deepspeed  # every test here runs tensor-parallel ranks

QUESTION = dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2)
WINDOW = {**QUESTION, "recall": "window", "window": 12}  # (window 8: a near tie in the reference's choice here)
# Every method, as the engine spells it and as the reference does (``reference_generate``'s arguments; the padded
# batch's rows, kv_max 16, p 4): FKV paged, ED, BM under the paper's rule and ``question`` (and in wide passes), heads
# sharing a budget, budgets across layers, snap. ``groups``: the heads of the 9/3 Llama sharing one budget, in one
# process and on each of AutoTP's two ranks (2 + 1 heads: rank 1's head keeps its own).
MATRIX = {
    "fkv-paged": (Method("fkv", block=8), dict(method_name="fkv")),
    "ed": (Method("ed", kv_max=2), dict(method_name="ed", kv_max=2)),
    "bm-paper": (Method("bm", kv_max=16, p=4), dict(method_name="bm", kv_max=16, p=4)),
    "bm-question": (
        Method("bm", kv_max=16, p=4, rule=rule_string("question", QUESTION)),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params=QUESTION),
    ),
    "bm-decode-probe": (  # decode evictions ranked by the stored question probe too (issue 68), rank-local
        Method("bm", kv_max=16, p=4, rule=rule_string("question", {**QUESTION, "decode": "probe"})),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params={**QUESTION, "decode": "probe"}),
    ),
    "bm-recall": (  # a recall tier per rank, ranked with the held pairs before the last block (issue 68), rank-local
        Method("bm", kv_max=16, p=4, rule=rule_string("question", {**QUESTION, "recall": "tier"})),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params={**QUESTION, "recall": "tier"}),
    ),
    "bm-recall-wide": (  # the recall inside each layer's attention, a wide pass's blocks one after another
        Method("bm", kv_max=16, p=4, rule=rule_string("question", {**QUESTION, "recall": "tier"}), chunk=24),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params={**QUESTION, "recall": "tier"}),
    ),
    "bm-recall-window": (  # the tier chosen from by the window's queries after the last block (issue 68), rank-local
        Method("bm", kv_max=16, p=4, rule=rule_string("question", WINDOW)),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params=WINDOW),
    ),
    "bm-recall-window-wide": (  # ... inside each layer's attention, after a wide pass's last block
        Method("bm", kv_max=16, p=4, rule=rule_string("question", WINDOW), chunk=24),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params=WINDOW),
    ),
    "bm-wide": (  # wide passes (two blocks and their probes a pass), each rank evicting its own heads per layer
        Method("bm", kv_max=16, p=4, rule=rule_string("question", QUESTION), chunk=24),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params=QUESTION),
    ),
    "share": (  # (kernel 5: no near tie in the reference on one process's three heads)
        Method("bm", kv_max=16, p=4, rule=rule_string("question", {**QUESTION, "kernel": 5, "share": 0})),
        dict(method_name="bm", kv_max=16, p=4, rule="question", rule_params={**QUESTION, "kernel": 5}),
    ),
    "taper": (  # the 2-layer model's budgets at kv_max 16, taper 50: 24 and 8 (PyramidKV's line, stated here)
        Method("bm", kv_max=16, p=4, rule="paper:taper=50"),
        dict(method_name="bm", kv_max=16, p=4, layer_kv_max=(24, 8)),
    ),
    "snap": (
        Method("snap", kv_max=16, p=4, window=6, kernel=3),
        dict(method_name="snap", kv_max=16, p=4, snap={"window": 6, "kernel": 3}),
    ),
}
GROUPS = {1: [[0, 1, 2]], 2: [[0, 1], [2]]}  # "share": the heads sharing one budget, by the run's tp size


@functools.cache
def matrix_reference(name: str, tp_size: int):
    """The naive reference of ``MATRIX[name]`` on the tp tests' padded batch, 12 new tokens, as ``tp_size`` ranks
    run it (heads sharing a budget: each rank's own)."""
    _, kwargs = MATRIX[name]
    ids, mask = prompt_batch(False)
    if name == "share":
        kwargs = {**kwargs, "groups": GROUPS[tp_size]}
    return reference_generate(make_model(False), ids, mask, max_new_tokens=12, **kwargs)


def assert_ranks_are_the_reference(ranks: list[dict], ref) -> None:
    """Each rank's logits (1e-4) and tokens are the reference's, and its kept positions are the reference's for the
    rank's own KV heads, in order; the ranks' heads are all of the model's."""
    offset = 0
    for r, got in enumerate(ranks):
        assert_logits_close(list(got["logits"]), ref.logits, 1e-4, what=f"rank {r}'s logits")
        assert_tokens_equal(got["tokens"], ref.tokens, what=f"rank {r}'s tokens")
        h = len(got["kept"][0][0])
        assert_kept_equal(got["kept"], [[heads[offset : offset + h] for heads in layer] for layer in ref.kept])
        offset += h
    assert offset == len(ref.kept[0][0])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_method_equals_the_reference_at_tp(tmp_path, tp_size):
    """Every method (``MATRIX``) at tp 1 (one process) and tp 2 (AutoTP, gloo, heads split 2 + 1): logits, tokens and
    each rank's kept positions per (layer, KV head) equal the naive reference's, through prefill and decode
    evictions; a budget shared by heads is shared among each rank's own heads (on two ranks its kept sets are not
    one process's)."""
    methods = [method for method, _ in MATRIX.values()]
    if tp_size == 1:
        model, (ids, mask) = make_model(False), prompt_batch(False)
        outs = {m.label(): generate(model, ids, mask, m, 12, ignore_eos=True, return_logits=True) for m in methods}
        ranks = [
            {k: dict(logits=torch.stack(o.logits), tokens=o.tokens, kept=o.kept_positions()) for k, o in outs.items()}
        ]
    else:
        ranks = run_tp(tmp_path, 2, 2, methods)
    for name, (method, _) in MATRIX.items():
        ref = matrix_reference(name, tp_size)
        assert ref.min_margin > 1e-4, f"{name}: a near tie in the reference ({ref.min_margin})"
        if method.name != "fkv":
            assert ref.evictions > 0, f"{name}: nothing evicted"
        got = [rank[method.label()] for rank in ranks]
        assert_ranks_are_the_reference(got, ref)
    if tp_size == 2:  # AutoTP's uneven split, the planner's weights on the largest rank, what sharing costs the split
        from batchmax_tp.plan.planner import ModelShape

        assert [len(rank[MATRIX["bm-paper"][0].label()]["kept"][0][0]) for rank in ranks] == [2, 1]
        shape = ModelShape.from_config(make_model(False).config)
        assert ModelShape.weights_per_rank(shape, 2) == max(rank["bm"]["params"] for rank in ranks)
        assert matrix_reference("share", 1).kept != matrix_reference("share", 2).kept


@pytest.mark.parametrize("tp_size", [3])  # tp 2: ``test_every_method_equals_the_reference_at_tp``
def test_tp_matches_single_process_through_evictions(tmp_path, tp_size):
    methods = [Method("bm", kv_max=16, p=4), Method("ed", kv_max=2)]
    ranks = run_tp(tmp_path, tp_size, tp_size, methods)
    single = single_process(methods)
    for m in methods:
        assert_matches_single(ranks, single, m.name, tp_size)
    # Evictions really happened (prefill and decode), one KV head per rank.
    kept = single["bm"]["kept"]
    assert all(len(h) < 16 + 1 for layer in kept for sample in layer for h in sample)
    assert [r["bm"]["local_kv_heads"] for r in ranks] == [1, 1, 1]
    # The planner's weights on the largest rank: what AutoTP really left there.
    from batchmax_tp.plan.planner import ModelShape

    shape = ModelShape.from_config(make_model(False).config)
    assert ModelShape.weights_per_rank(shape, tp_size) == max(r["bm"]["params"] for r in ranks)


def test_fused_prefill_under_tp2_matches_the_unfused_single_process(tmp_path, monkeypatch):
    """Each rank's fused prefill attention (its own heads) against one process running the unfused one
    (``tests/unfused.py``): logits, tokens and each rank's kept sets, through prefill and decode evictions."""
    import unfused

    from batchmax_tp.core import attention

    methods = [Method("bm", kv_max=16, p=4)]
    ranks = run_tp(tmp_path, 2, 2, methods)
    monkeypatch.setattr(attention, "_rows_block", unfused.rows_block)
    assert_matches_single(ranks, single_process(methods), "bm", 2)


@pytest.mark.parametrize("family, tp_size", [("phi3", 2), ("phi3", 3), ("qwen2", 2), ("mistral", 2)])
def test_every_family_under_tp_matches_single_process(tmp_path, family, tp_size):
    """Phi-3's fused qkv_proj is split at the rank's own query width (tp.localise_head_counts); every family's
    logits, tokens and per-rank kept sets equal one process, through prefill and decode evictions."""
    methods = [Method("bm", kv_max=16, p=4), Method("ed", kv_max=2), Method("fkv")]
    ranks = run_tp(tmp_path, tp_size, tp_size, methods, embedded=family)
    single = single_process(methods, embedded=family)
    for m in methods:
        assert_matches_single(ranks, single, m.name, tp_size)
    heads = FAMILIES[family]["num_key_value_heads"]
    assert sum(r["bm"]["local_kv_heads"] for r in ranks) == heads


def test_architecture_model_loads_half_per_rank_under_tp2(tmp_path):
    """An architecture-only model (random weights, no checkpoint) split over 2 ranks: each rank's parameters
    outside the embeddings are half the model's, exactly as the planner predicts; peak host memory is reported."""
    spec = tmp_path / "small-llama.json"
    spec.write_text(
        json.dumps(
            dict(
                model_type="llama",
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=768,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=32,
                max_position_embeddings=512,
                tie_word_embeddings=False,
            )
        )
    )
    arch = f"arch:{spec}"
    methods = [Method("bm", kv_max=16, p=4)]
    ranks = run_tp(tmp_path, 2, 2, methods, new=4, embedded=arch)
    from batchmax_tp.models import architecture_config
    from batchmax_tp.plan.planner import ModelShape

    shape = ModelShape.from_config(architecture_config(arch))
    embed = shape.vocab * shape.hidden  # the input embedding stays whole on every rank
    per_rank = [r["bm"]["params"] for r in ranks]
    assert all(abs((p - embed) - (shape.params - embed) / 2) <= 0.01 * shape.params for p in per_rank), (
        per_rank,
        shape.params,
        embed,
    )
    assert max(per_rank) == shape.weights_per_rank(2)
    assert all(r["bm"]["host_peak"] > 0 for r in ranks)


def test_eviction_adds_no_collectives(tmp_path):
    methods = [Method("fkv"), Method("bm", kv_max=16, p=4)]
    ranks = run_tp(tmp_path, 2, 2, methods, count_collectives=True)
    for res in ranks:
        fkv, bm = res["fkv"], res["bm"]
        assert fkv["collectives"].get("all_reduce", 0) > 0, "the wrapper saw no all-reduce: it cannot count"
        per_fwd_fkv = {k: v / fkv["forwards"] for k, v in fkv["collectives"].items()}
        per_fwd_bm = {k: v / bm["forwards"] for k, v in bm["collectives"].items()}
        assert per_fwd_bm == per_fwd_fkv


def test_dp2_tp2_each_replica_matches_single_process(tmp_path):
    methods = [Method("bm", kv_max=16, p=4)]
    ranks = run_tp(tmp_path, 4, 2, methods)
    for replica in range(2):
        single = single_process(methods, replica=replica)
        assert_matches_single(ranks[2 * replica : 2 * replica + 2], single, "bm", 2)
    assert not torch.equal(ranks[0]["bm"]["tokens"], ranks[2]["bm"]["tokens"]), "replicas got the same data"


def test_killed_rank_ends_the_job():
    """A rank that dies mid-run (tp=2): the launcher returns non-zero, nobody hangs (the call's timeout guards)."""
    assert_rank1_killed_and_nobody_finished(run_child("killed_rank_mid_generation"), "generated 8 tokens")
