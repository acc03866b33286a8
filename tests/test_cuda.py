"""The CUDA path (run by scripts/gpu_check.sh on a GPU machine; skipped elsewhere): the engine on the GPU equals
the CPU for every method, in float32 and within float16's precision, and the peak the planner predicts bounds what
the allocator measured."""

from __future__ import annotations

import pytest
import torch
from conftest import PEAKED, left_padded_batch, tiny_llama

from batchmax_tp.core.engine import generate
from batchmax_tp.core.method import Method
from batchmax_tp.plan.planner import ModelShape, predict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

METHODS = [Method("bm", kv_max=16, p=4), Method("ed", kv_max=2), Method("ed", kv_max=5), Method("fkv")]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_cuda_equals_cpu(method):
    model = tiny_llama(**PEAKED)
    ids, mask = left_padded_batch([37, 52, 60], seed=0)
    cpu = generate(model, ids, mask, method, 12, ignore_eos=True, return_logits=True)
    gpu = generate(model.cuda(), ids.cuda(), mask.cuda(), method, 12, ignore_eos=True, return_logits=True)
    torch.testing.assert_close(torch.stack(gpu.logits).cpu(), torch.stack(cpu.logits), atol=1e-3, rtol=0)
    assert torch.equal(gpu.tokens.cpu(), cpu.tokens)
    if method.evicts:
        assert gpu.cache.kept_positions() == cpu.cache.kept_positions()


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
