"""The planner predicts, from shapes alone, the K/V the engine holds (exactly) and a bound on its attention peaks."""

from __future__ import annotations

import pytest
import torch
from memtrack import AttentionPasses

from batchmax_tp.bench.padded import generate
from batchmax_tp.core import workspace
from batchmax_tp.core.method import Method
from batchmax_tp.plan.planner import ModelShape, max_batch, parse_bytes, predict

CASES = [
    (Method("bm", kv_max=24, p=8), 3, 70, 12),
    (Method("bm", kv_max=24, p=8), 2, 20, 30),  # prompt shorter than kv_max, decode evictions
    (Method("ed", kv_max=2), 3, 48, 8),
    (Method("ed", kv_max=65), 2, 32, 8),  # prompt shorter than kv_max
    (Method("fkv", chunk=0), 2, 40, 9),  # in one pass (chunked passes' calls: test_memory, test_chunked)
]


@pytest.mark.parametrize("chunk_bytes", [workspace.SCORE_CHUNK_BYTES, 4096])
@pytest.mark.parametrize("method,batch,prompt,new", CASES)
def test_prediction_equals_measured_peaks(model, monkeypatch, chunk_bytes, method, batch, prompt, new):
    monkeypatch.setattr(workspace, "SCORE_CHUNK_BYTES", chunk_bytes)  # 4096: prefill runs in query chunks
    ids = torch.randint(3, 128, (batch, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a padded batch: the baselines' worst case (HF's prefill mask), the planner's assumption
    passes = AttentionPasses(monkeypatch)  # each forward pass's attention allocations, measured
    with passes.measure() as measured:
        out = generate(model, ids.masked_fill(mask == 0, 0), mask, method, new, ignore_eos=True)
    est = predict(ModelShape.from_config(model.config), method, batch, prompt, new)
    assert est.kv == out.peak_kv_bytes == out.served.kv_bytes_range[0]  # the pool's K/V, from the first pass on
    measured[0] -= est.kv + out.peak_meta_bytes  # the first attention call allocates the pool (K/V, slot state)
    assert out.peak_workspace_bytes == max(measured)
    assert est.workspace >= max(measured), f"planned {est.workspace} bytes, measured {max(measured)}"


def test_bm_peak_does_not_grow_with_the_prompt():
    shape = ModelShape(
        layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, params=134_515_008
    )
    bm = Method("bm", kv_max=512, p=64)
    peaks = [predict(shape, bm, 8, s, 256).total for s in (1024, 4096)]
    assert peaks[1] == peaks[0]
    fkv = [predict(shape, Method("fkv"), 8, s, 256).kv for s in (1024, 4096)]
    assert fkv[1] > 3 * fkv[0]


def test_param_count_matches_the_model(model):
    assert ModelShape.from_config(model.config).params == sum(p.numel() for p in model.parameters())


def test_tp_splits_heads_like_autotp():
    shape = ModelShape(layers=2, hidden=144, intermediate=128, heads=9, kv_heads=3, head_dim=16, vocab=128, params=0)
    assert shape.local_heads(1) == (9, 3)
    assert shape.local_heads(2) == (6, 2)  # rank 0 of 6/2 + 3/1
    assert shape.local_heads(3) == (3, 1)


def test_max_batch_is_the_boundary():
    shape = ModelShape(
        layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, params=134_515_008
    )
    for method in (Method("bm", kv_max=512, p=64), Method("ed", kv_max=2), Method("fkv")):
        budget = predict(shape, method, 7, 2000, 256).total + 1
        b = max_batch(budget, shape, method, 2000, 256)
        assert b == 7
        assert predict(shape, method, b + 1, 2000, 256).total > budget
    assert max_batch(10, shape, Method("fkv"), 2000, 256) == 0
    # At one budget BM fits a larger batch than FKV; ED's even larger: a slot never holds its prompt (the prompt's
    # pairs live only in its own prefill pass, one group of prompts at a time).
    budget = parse_bytes("2GiB")
    sizes = [
        max_batch(budget, shape, m, 3000, 512)
        for m in (Method("bm", kv_max=512, p=64), Method("ed", kv_max=2), Method("fkv"))
    ]
    assert sizes[1] > sizes[0] > sizes[2] > 0


@pytest.mark.parametrize(
    "text,value", [("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("123", 123), (77, 77)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "1.5.3GiB", "-2GiB", "GiB", "12 parsecs"])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)
