"""Half-precision products in float32 on x86 CPUs whose torch kernels are AVX2 at best.

There torch's bfloat16 and float16 matrix products take a generic path: a 2,048 x 896 x 4,864 product runs at ~1
GFLOP/s in bfloat16 against float32's ~106 (torch 2.13, an AVX2-only AMD EPYC, docs/retention.md, 2026-12-03). The
generic path already multiplies in float32 and rounds the result to the half dtype once; ``float32_products`` does the
same through float32's fast kernels: each product's half inputs are widened (exactly), multiplied in float32 and the
result rounded to the half dtype once. Only the order of the float32 sums differs, as it does between any two CPUs'
kernels. Everything else (norms, softmax, the K/V storage, every tensor a layer hands on) stays in the half dtype.

The engine enters it for a run on such a CPU (``slow_half_products``); a GPU, an AVX-512 CPU, an ARM CPU or a float32
model never sees it.
"""

from __future__ import annotations

import contextlib
import logging
import platform

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

aten = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)
#: the products whose half kernels take the generic path (``linear`` and ``matmul`` decompose into these)
PRODUCTS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
    }
)
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default  # returns (output, logsumexp)


def slow_half_products(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """The CPU's torch kernel capability (``AVX2``, ``DEFAULT``) when ``dtype``'s products on ``device`` take torch's
    generic path, else None: a half dtype on an x86 CPU without AVX-512."""
    if dtype not in HALF or torch.device(device).type != "cpu":
        return None
    cpu = torch.backends.cpu.get_cpu_capability()
    if cpu in ("AVX2", "DEFAULT") and platform.machine().lower() in ("x86_64", "amd64"):
        return cpu
    return None


class Float32Products(TorchDispatchMode):
    """While entered, every half-precision CPU product (``PRODUCTS``, and CPU SDPA's flash kernel) runs in float32 and
    is rounded to its half dtype once. The products' operands that are views of ``weights`` are widened once and
    kept for as long as the mode is (float32 copies of the weights the products read: twice their half bytes),
    so a pass widens only its activations."""

    def __init__(self, weights=()):
        super().__init__()
        self.weights = {w.untyped_storage().data_ptr() for w in weights if w.dtype in HALF}
        self.widened: dict[tuple, torch.Tensor] = {}

    def _wide(self, x):
        if not (isinstance(x, torch.Tensor) and x.dtype in HALF):
            return x
        storage = x.untyped_storage().data_ptr()
        if storage not in self.weights:
            return x.float()
        key = (storage, x.storage_offset(), tuple(x.shape), x.stride())
        wide = self.widened.get(key)
        if wide is None:
            wide = self.widened[key] = x.float()
        return wide

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS:
            dtype = args[0].dtype
            if dtype in HALF and args[0].device.type == "cpu":
                return func(*map(self._wide, args), **kwargs).to(dtype)
        elif func is ATTENTION:
            dtype = args[0].dtype
            if dtype in HALF:
                out, lse = func(*map(self._wide, args), **{k: self._wide(v) for k, v in kwargs.items()})
                return out.to(dtype), lse
        return func(*args, **kwargs)


def float32_products(dtype: torch.dtype, device: torch.device | str, weights=()):
    """A context in which ``dtype``'s products on ``device`` run in float32 where torch's own half kernels are the
    generic ones (``slow_half_products``; logged once per run), else a context that does nothing. ``weights``: the
    model's parameters, widened once (``Float32Products``)."""
    cpu = slow_half_products(dtype, device)
    if cpu is None:
        return contextlib.nullcontext()
    name = str(dtype).removeprefix("torch.")
    logger.info("%s products run in float32, rounded to %s (this CPU's torch kernels: %s)", name, name, cpu)
    return Float32Products(weights)
