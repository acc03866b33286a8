"""The CUDA path (run by scripts/gpu_check.sh on a GPU machine; skipped elsewhere): the engine on the GPU equals
the CPU for every method, in float32 and within float16's precision, and the peak the planner predicts bounds what
the allocator measured."""

from __future__ import annotations

import pytest
import torch
from conftest import PEAKED, left_padded_batch, tiny_llama

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method
from batchmax_tp.core.requests import Record, Request, Sampling
from batchmax_tp.plan.planner import ModelShape, predict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

METHODS = [Method("bm", kv_max=16, p=4), Method("ed", kv_max=2), Method("ed", kv_max=5), Method("fkv")]
# The pool's methods at the continuous tests' sizes (a probe rule protects 64 pairs: kv_max >= p + 64).
SERVED = [
    Method("bm", 96, 16),
    Method("bm", 96, 16, rule="question"),
    Method("snap", kv_max=96, p=16, window=8, kernel=5),
    Method("ed", kv_max=2),
    Method("fkv"),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_cuda_equals_cpu(method):
    model = tiny_llama(**PEAKED)
    ids, mask = left_padded_batch([37, 52, 60], seed=0)
    cpu = generate(model, ids, mask, method, 12, ignore_eos=True, return_logits=True)
    gpu = generate(model.cuda(), ids.cuda(), mask.cuda(), method, 12, ignore_eos=True, return_logits=True)
    torch.testing.assert_close(torch.stack(gpu.logits).cpu(), torch.stack(cpu.logits), atol=1e-3, rtol=0)
    assert torch.equal(gpu.tokens.cpu(), cpu.tokens)
    if method.evicts:
        assert gpu.kept_positions() == cpu.kept_positions()


@pytest.mark.parametrize("method", METHODS[:2] + METHODS[3:], ids=lambda m: m.label())
def test_planner_bounds_cuda_max_memory_allocated(method):
    """Peak of one generate above the weights (K/V, score blocks, activations) <= the planner's prediction."""
    model = tiny_llama(**PEAKED, num_hidden_layers=4).cuda().half()
    ids, mask = left_padded_batch([200, 256, 256, 240], seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    generate(model, ids, mask, method, 16, ignore_eos=True)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    est = predict(ModelShape.from_config(model.config), method, 4, ids.shape[1], 16, dtype="float16")
    assert measured <= est.total - est.weights, (measured, est)


@pytest.mark.parametrize("method", SERVED, ids=lambda m: m.label())
@pytest.mark.parametrize("slots", [2, 5])
def test_continuous_serving_on_cuda_equals_cpu(method, slots):
    """The default engine (slots, batched unpadded prefill, described passes): every request's tokens, logits and
    kept positions on the GPU equal the CPU's, with EOS honoured so slots free and refill."""
    model = tiny_llama(**PEAKED)
    g = torch.Generator().manual_seed(3)
    lengths, new = [5, 16, 95, 96, 97, 150, 250, 40], [9, 3, 12, 20, 1, 10, 18, 8]
    requests = [Request(torch.randint(3, 128, (n,), generator=g).tolist(), k) for n, k in zip(lengths, new)]
    sampling, record = Sampling(eos_token_id=2), Record(logits=True, positions=True)
    cpu = Engine(model, method, slots).run(requests, sampling, record=record)
    gpu = Engine(model.cuda(), method, slots).run(requests, sampling, record=record)
    for i, (a, b) in enumerate(zip(gpu.outputs, cpu.outputs)):
        assert a.tokens == b.tokens, f"request {i}"
        torch.testing.assert_close(torch.stack(a.logits).cpu(), torch.stack(b.logits), atol=1e-3, rtol=0)
        assert a.kept_positions == b.kept_positions, f"request {i}"


@pytest.mark.parametrize("method", SERVED, ids=lambda m: m.label())
def test_continuous_serving_in_float16_on_a_gqa_model(method):
    """Half precision on the GPU (what users run): the pool serves every request to its length, and the tokens
    match float32's for the first steps on a peaked model (fp16 rounding may flip a late near-tie)."""
    model = tiny_llama(**PEAKED).cuda()
    g = torch.Generator().manual_seed(5)
    requests = [Request(torch.randint(3, 128, (n,), generator=g).tolist(), 8) for n in (12, 100, 200, 30)]
    want = Engine(model, method, 3).run(requests, Sampling(ignore_eos=True))
    got = Engine(model.half(), method, 3).run(requests, Sampling(ignore_eos=True))
    assert [o.num_generated for o in got.outputs] == [8] * 4
    assert [o.tokens[:2] for o in got.outputs] == [o.tokens[:2] for o in want.outputs]


@pytest.mark.parametrize(
    "method, mode",
    [(m, "cudagraphs") for m in SERVED] + [(SERVED[0], "default")],  # inductor: about a minute a method
    ids=lambda x: x.label() if isinstance(x, Method) else x,
)
def test_captured_and_compiled_decode_passes_equal_eager_on_cuda(method, mode):
    """``compile="cudagraphs"``: the decode pass captured once as a CUDA graph and replayed for every later pass
    (``core.replay.CapturedDecode``); ``"default"``: compiled by inductor. Over a run with EOS honoured, slots freed
    and refilled and evictions in many passes, every request's tokens, logits (1e-3) and kept positions equal the
    eager run's on the same GPU."""
    model = tiny_llama(**PEAKED).cuda()
    g = torch.Generator().manual_seed(7)
    lengths, new = [5, 16, 95, 96, 97, 150, 250, 40, 12, 70], [40, 3, 120, 60, 1, 90, 140, 8, 100, 30]
    requests = [Request(torch.randint(3, 128, (n,), generator=g).tolist(), k) for n, k in zip(lengths, new)]
    sampling, record = Sampling(eos_token_id=2), Record(logits=True, positions=True)
    eager = Engine(model, method, 3).run(requests, sampling, record=record)
    got = Engine(model, method, 3, compile=mode).run(requests, sampling, record=record)
    assert got.compile_s > 0
    for i, (a, b) in enumerate(zip(got.outputs, eager.outputs)):
        assert a.tokens == b.tokens, f"request {i}"
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-3, rtol=0)
        assert a.kept_positions == b.kept_positions, f"request {i}"


def test_captured_decode_pass_replays_one_graph_in_float16():
    """The captured pass on a half-precision GQA model: one capture for the whole run (the replay raises if a pass
    changes shape), the first tokens as eager's."""
    from batchmax_tp.core import replay

    captures = []
    real = replay.CapturedDecode._capture

    def counted(self, *a):
        captures.append(1)
        return real(self, *a)

    model = tiny_llama(**PEAKED).cuda().half()
    g = torch.Generator().manual_seed(9)
    requests = [Request(torch.randint(3, 128, (n,), generator=g).tolist(), 64) for n in (12, 100, 200, 30, 90)]
    want = Engine(model, SERVED[0], 3).run(requests, Sampling(ignore_eos=True))
    replay.CapturedDecode._capture = counted
    try:
        got = Engine(model, SERVED[0], 3, compile="auto").run(requests, Sampling(ignore_eos=True))
    finally:
        replay.CapturedDecode._capture = real
    assert captures == [1]
    assert [o.tokens[:4] for o in got.outputs] == [o.tokens[:4] for o in want.outputs]
