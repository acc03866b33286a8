"""This device's own rates, measured: the FLOP/s of a prefill-shaped product and of the fused attention kernel, and
the bytes/s a decode-shaped product streams its weights at, each run as the engine runs it (half products through
``core.products`` where that is how the engine runs them). ``this_device`` folds them into one card of
``regimes.Cards`` for the measured map's prediction and bench_ruler's time estimate."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..core.products import float32_products
from ..plan.planner import ModelShape
from .regimes import Cards


def this_device(device: str, dtype: str, shape: ModelShape, memory: int = 0) -> Cards:
    """This device as one card for a model of ``shape``: a prefill's linear layers at the FLOP/s of a product like
    theirs (:func:`measured_flops`) and its attention at that of the fused attention kernel
    (:func:`measured_attention_flops`), a decode step's bytes at the rate a decode-shaped product streams its
    weights (:func:`measured_bandwidth`), all measured here and reached in full (the measured map's prediction)."""
    flops = measured_flops(device, dtype, shape.hidden)
    attention = measured_attention_flops(device, dtype, shape.heads, shape.kv_heads, shape.head_dim)
    bandwidth = measured_bandwidth(device, dtype, shape.hidden)
    return Cards(
        f"this {device}", 1, memory, bandwidth, flops, prefill_efficiency=1.0, decode_efficiency=1.0,
        attention_flops=attention,
    )  # fmt: skip


def measured_attention_flops(
    device: str, dtype: str, heads: int, kv_heads: int, head_dim: int, length: int = 4096
) -> float:
    """FLOP/s of causal attention on this device (``scaled_dot_product_attention``, grouped heads, ``length``
    queries over as many keys: what an unchunked prefill runs): the best of 4 rounds."""
    kind = getattr(torch, dtype)
    q = torch.randn(1, heads, length, head_dim, dtype=kind, device=device)
    k = torch.randn(1, kv_heads, length, head_dim, dtype=kind, device=device)
    v = torch.randn(1, kv_heads, length, head_dim, dtype=kind, device=device)
    seconds = _best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device)
    return 4 * heads * head_dim * length * (length + 1) / 2 / seconds


def measured_flops(device: str, dtype: str, hidden: int) -> float:
    """FLOP/s of this device on a product like a prefill's (512 rows of ``hidden`` by 4 x ``hidden``): the best of 4
    rounds of 4 products (the first round also warms up), run as the engine runs them (``core.products``)."""
    a = torch.randn(512, hidden, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(hidden, 4 * hidden, dtype=getattr(torch, dtype), device=device)
    with float32_products(a.dtype, device):
        return 2 * 512 * hidden * 4 * hidden / _best_seconds(lambda: a @ b, device)


def measured_bandwidth(device: str, dtype: str, hidden: int, rows: int = 4) -> float:
    """Bytes/s at which a decode-shaped product streams its weights on this device: ``rows`` rows of ``hidden`` by
    a ``hidden`` x 4 ``hidden`` weight, ``2**28`` bytes of weights a round spread over enough matrices that no cache
    holds them (a decode step reads each weight once; on a CPU this is well below a plain copy's rate)."""
    kind = getattr(torch, dtype)
    x = torch.randn(rows, hidden, dtype=kind, device=device)
    each = hidden * 4 * hidden * x.element_size()
    weights = [torch.randn(hidden, 4 * hidden, dtype=kind, device=device) for _ in range(max(1, 2**28 // each))]

    def step():
        for w in weights:
            x @ w

    return len(weights) * each / _best_seconds(step, device)


def _best_seconds(work, device: str) -> float:
    best = float("inf")
    for _ in range(4):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            work()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 4)
    return best
