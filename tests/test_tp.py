"""Tensor parallel (DeepSpeed AutoTP, gloo on CPU): each rank keeps and evicts its own KV heads, no collective
is added by eviction, and the results equal a single process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import requires_deepspeed
from multiproc import (
    FAMILIES,
    assert_matches_single,
    assert_rank1_killed_and_nobody_finished,
    make_model,
    run_child,
    run_tp,
    single_process,
)

from batchmax_tp.core.method import Method

pytestmark = requires_deepspeed  # every test here runs tensor-parallel ranks


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tp_matches_single_process_through_evictions(tmp_path, tp_size):
    methods = [Method("bm", kv_max=16, p=4), Method("ed", kv_max=2)]
    ranks = run_tp(tmp_path, tp_size, tp_size, methods)
    single = single_process(methods)
    for m in methods:
        assert_matches_single(ranks, single, m.name, tp_size)
    # Evictions really happened (prefill and decode), and the split is AutoTP's uneven one on tp=2.
    kept = single["bm"]["kept"]
    assert all(len(h) < 16 + 1 for layer in kept for sample in layer for h in sample)
    assert [r["bm"]["local_kv_heads"] for r in ranks] == ([2, 1] if tp_size == 2 else [1, 1, 1])
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
