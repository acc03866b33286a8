"""Tensor parallel (DeepSpeed AutoTP, gloo on CPU): each rank keeps and evicts its own KV heads, no collective
is added by eviction, and the results equal a single process."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from conftest import requires_deepspeed
from tiny import tiny_random_model

from batchmax_tp.core.method import Method

pytestmark = requires_deepspeed  # every test here runs tensor-parallel ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 9 query / 3 KV heads, like the embedded model: AutoTP splits them unevenly on tp=2 (6/2 and 3/1).
GQA_9_3 = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16, initializer_range=0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 60), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :23] = 0
    mask[1, :8] = 0
    return ids.masked_fill(mask == 0, 0), mask


# Every family of the paper and two more: Phi-3 has a fused qkv_proj / gate_up_proj and no GQA (6 heads, 6 KV
# heads); Qwen2 has q/k/v biases; Mistral is Llama-like with its own classes. 6 heads allow tp 2 and 3.
FAMILIES = {
    "llama": dict(family="llama", **GQA_9_3),
    "phi3": dict(
        family="phi3", hidden_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=16, initializer_range=0.2
    ),
    "qwen2": dict(
        family="qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, initializer_range=0.2
    ),
    "mistral": dict(
        family="mistral",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.2,
    ),
}


def make_model(embedded: bool | str):
    """``False``: the 9/3 GQA Llama (the embedded model's heads); a family name: that tiny model; ``arch:NAME``: that
    architecture with random weights."""
    if isinstance(embedded, str) and embedded.startswith("arch:"):
        from batchmax_tp.models import load_model

        return load_model(embedded, dtype="float32", device="cpu")[0]
    return tiny_random_model(seed=0, **FAMILIES[embedded or "llama"])


def prompt_batch(embedded: bool | str, replica: int = 0):
    return batch(seed=replica)


def count_collectives() -> dict[str, int]:
    """Wrap torch.distributed's collectives in this process; returns the live call counts by name."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "barrier"):
        orig = getattr(dist, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _orig(*a, **k)

        setattr(dist, name, wrapped)
    return counts


def _worker(rank, world, tp_size, port, outdir, method, new, embedded, count_collectives_):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from batchmax_tp import parallel as tp
    from batchmax_tp.core.engine import generate

    layout = tp.init_distributed(tp_size)
    model = tp.apply_tensor_parallel(make_model(embedded), layout, torch.float32)
    ids, mask = prompt_batch(embedded, layout.replica)
    counts = count_collectives() if count_collectives_ else {}
    results = {}
    for m in method:
        counts.clear()
        out = generate(model, ids, mask, m, new, ignore_eos=True, return_logits=True)
        results[m.name] = dict(
            tokens=out.tokens,
            logits=torch.stack(out.logits),
            kept=out.kept_positions(),
            local_kv_heads=len(out.kept_positions()[0][0]),
            collectives=dict(counts),
            forwards=out.served.passes,
            params=sum(p.numel() for p in model.parameters()),
            host_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_tp(tmp_path, world, tp_size, methods, new=12, embedded=False, count_collectives=False):
    mp.spawn(
        _worker,
        args=(world, tp_size, free_port(), str(tmp_path), methods, new, embedded, count_collectives),
        nprocs=world,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def single_process(methods, new=12, embedded=False, replica=0):
    from batchmax_tp.core.engine import generate

    model = make_model(embedded)
    ids, mask = prompt_batch(embedded, replica)
    out = {}
    for m in methods:
        o = generate(model, ids, mask, m, new, ignore_eos=True, return_logits=True)
        out[m.name] = dict(tokens=o.tokens, logits=torch.stack(o.logits), kept=o.kept_positions())
    return out


def assert_matches_single(ranks, single, method: str, tp_size: int):
    """Logits and tokens equal on every rank; rank r's kept sets equal the single run's for r's KV heads."""
    offset = 0
    for r, res in enumerate(ranks[:tp_size]):
        got = res[method]
        torch.testing.assert_close(got["logits"], single[method]["logits"], atol=1e-4, rtol=0)
        assert torch.equal(got["tokens"], single[method]["tokens"])
        h = got["local_kv_heads"]
        want = [[heads[offset : offset + h] for heads in layer] for layer in single[method]["kept"]]
        assert got["kept"] == want, f"rank {r}: kept positions differ from heads {offset}..{offset + h - 1}"
        offset += h
    total_heads = len(single[method]["kept"][0][0])
    assert offset == total_heads


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


def run_child(name: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """``tests/children.py NAME`` on 2 ranks under torchrun; ``timeout`` guards the test, never asserted."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # kept: the GPU package set's wheels
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    return subprocess.run(
        [*command, str(free_port()), os.path.join(ROOT, "tests", "children.py"), name],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_rank1_killed_and_nobody_finished(proc: subprocess.CompletedProcess, reached: str) -> None:
    """Both ranks reached ``reached`` (the child ran), rank 1 was killed there, rank 0 ended without finishing. (The
    ranks share one pipe: a line of one may land inside another's, so the text is searched, not its lines.)"""
    out = proc.stdout
    assert proc.returncode != 0, out
    for rank in range(2):
        assert f"rank {rank}: {reached}" in out, (out, proc.stderr[-3000:])
    assert "rank 1: killed" in out and "generated again" not in out and "served every request" not in out, out
    assert "Signal 9 (SIGKILL)" in proc.stderr or "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]


def test_killed_rank_ends_the_job():
    """A rank that dies mid-run (tp=2): the launcher returns non-zero, nobody hangs (the call's timeout guards)."""
    assert_rank1_killed_and_nobody_finished(run_child("killed_rank_mid_generation"), "generated 8 tokens")
