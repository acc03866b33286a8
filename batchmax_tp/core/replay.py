"""How a slot pool's decode passes run: eager, compiled with ``torch.compile``, or captured once as a CUDA graph.

A static pool (``pool.static``) gives every decode pass one shape for the whole run: all S rows (idle ones write
the scratch slot and add nothing), every slot [0, C) attended, and the per-pass inputs are device tensors of fixed
shape in the pass description (``step.RowsPass``: positions, write indices, the active rows or the held lengths).
The pass's evictions run before the model call, in every layer at once (``BoundedPool.evict``/``DensePool.evict``),
so the model call itself never changes kernels. That call is what this module runs:

- ``none``: eager (a pool that is not static keeps the attended width to the slots written so far).
- ``default``: ``torch.compile(..., fullgraph=True)``: one graph for the whole run.
- ``cudagraphs`` (CUDA): the call captured once as a ``torch.cuda.CUDAGraph`` and replayed every pass; before each
  replay the pass's inputs are copied into the captured ones (a few small device copies, no host sync). On a GPU a
  decode pass is launch-bound (~1,600 kernel launches for a 7B model), so replaying it is what makes it fast.
- ``auto`` (the default): ``cudagraphs`` on CUDA, ``none`` elsewhere (``resolve``). Measured 2026-11-26 on an
  H200 (Llama-2-7B float16, 1,536 + 512 tokens, 40 GiB): decode steps 1.2x (FKV) to 2.0x (BM, ED) faster
  captured, 0.12-0.16 s to capture; on a 2-core CPU ``default`` makes BM's steps 1.19x faster but FKV's 0.75x,
  after minutes of compiling, so the CPU stays eager.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import torch

from .step import COMPILE_MODES, RowsPass

logger = logging.getLogger(__name__)

WARMUP_PASSES = 2  # eager passes on a side stream before a capture (lazy initialisation: cuBLAS handles, ...)


def resolve(mode: str, device: torch.device, tensor_parallel: bool = False) -> str:
    """The concrete mode for ``device`` (``auto``: ``cudagraphs`` on CUDA without tensor parallelism, whose
    collectives were never captured here; else ``none``); ValueError for an unknown mode or ``cudagraphs`` off
    CUDA."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "auto":
        return "cudagraphs" if device.type == "cuda" and not tensor_parallel else "none"
    if mode == "cudagraphs" and device.type != "cuda":
        raise ValueError(f"compile 'cudagraphs' captures CUDA graphs: it needs a CUDA device, not {device.type!r}")
    return mode


@torch.no_grad()
def forward_pass(
    model: torch.nn.Module, step: RowsPass, ids: torch.Tensor, mask: torch.Tensor, keep: int | torch.Tensor = 1
):
    """One model call described by ``step`` (ids [R, n]; ``mask`` [R, n] all true: the attention reads the
    description, but without a mask HF's mask builder looks for packed sequences in the position ids, a host sync in
    every pass); the description goes to every attention call, which writes the pool itself (no cache is handed to
    the model). A prefill pass or decode step returns the last position's logits (a prefill pass's look-ahead
    probes, if any, are its first columns: the last is a chunk's); ``keep`` [k]: those columns' instead (a mixed
    pass's)."""
    kw = dict(attention_mask=mask, position_ids=step.positions, use_cache=False, batchmax=step)
    return model(input_ids=ids, logits_to_keep=keep, **kw)


def eager_decode(model: torch.nn.Module, step: RowsPass, ids: torch.Tensor, mask: torch.Tensor):
    """One decode pass: ids [S, 1], ``mask`` [S, 1] all true."""
    return forward_pass(model, step, ids, mask)


@functools.cache
def compiled_decode():
    """``eager_decode`` compiled once per process (``fullgraph``: a graph break is an error)."""
    return torch.compile(eager_decode, fullgraph=True)


def idle_pass(step: RowsPass) -> RowsPass:
    """A decode pass of ``step``'s shape in which every row is idle: it writes the scratch slot, adds to no sums and
    (the dense pools) sees finite slots, so running it changes nothing a later pass reads (its inputs are new
    tensors: a capture's); with budgets across layers, every group's part."""
    if step.parts:
        parts = tuple(idle_pass(part) for part in step.parts)
        return replace(parts[0], parts=parts)
    return RowsPass(
        kind="decode",
        pool=step.pool,
        method=step.method,
        share=step.share,
        rows=step.rows,
        span=step.span,
        qpos=torch.full_like(step.qpos, -1),  # no position
        positions=torch.zeros_like(step.positions),
        real=None,
        write=torch.full_like(step.write, step.pool.capacity),  # the scratch slot
        hi=step.hi,
        active=None if step.active is None else torch.zeros_like(step.active),  # no sums
        bias=None if step.bias is None else torch.zeros_like(step.bias),  # finite: no NaN in idle rows
        owner=None if step.owner is None else torch.zeros_like(step.owner),  # every block row 0's, unmasked
        written=None if step.written is None else _scratch(step),  # BM: every pair to its row's scratch slot
    )


def _scratch(step: RowsPass) -> torch.Tensor:
    """``step.written`` [L, S*H] moved to the scratch slot (the last) of the same row and head."""
    T1 = step.pool.layers[0].keys.shape[2]  # slots per row and head, the scratch slot last
    return step.written - step.written % T1 + (T1 - 1)


class CapturedDecode:
    """A pool's decode pass captured as a CUDA graph on its first call and replayed on every later one.

    The capture runs on an idle pass (every row writes the scratch slot, no row's sums change, the dense pools'
    rows see finite slots), so the warm-up passes before it change nothing a later pass reads. ``capture_s``: the
    seconds the warm-up and capture took. The model output it returns is the graph's own: read it before the next
    call."""

    def __init__(self):
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: RowsPass | None = None  # the captured pass: its tensors are the graph's inputs
        self.ids = self.mask = self.output = None
        self.capture_s = 0.0

    def __call__(self, model: torch.nn.Module, step: RowsPass, ids: torch.Tensor, mask: torch.Tensor):
        if self.graph is None:
            self._capture(model, step, ids, mask)
        captured = self.inputs
        if _shape(step) != _shape(captured):
            raise RuntimeError("a captured decode pass needs one shape for the whole run (a static pool)")
        self.ids.copy_(ids)
        for mine, theirs in zip(captured.each(), step.each()):  # every layer group's part (budgets across layers)
            for name in ("qpos", "positions", "write", "active", "bias", "owner", "written"):
                if (value := getattr(theirs, name)) is not None:
                    getattr(mine, name).copy_(value)
        self.graph.replay()
        return self.output

    def _capture(self, model: torch.nn.Module, step: RowsPass, ids: torch.Tensor, mask: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.inputs = idle_pass(step)
        self.ids, self.mask = torch.zeros_like(ids), mask.clone()
        side = _warmup_stream(ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                eager_decode(model, self.inputs, self.ids, self.mask)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = eager_decode(model, self.inputs, self.ids, self.mask)
        torch.cuda.synchronize(ids.device)
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "decode pass captured as a CUDA graph in %.2fs (%d rows x %d slots)", self.capture_s, len(ids), step.hi
        )


def _shape(step: RowsPass) -> tuple:
    """What a captured pass fixes: each part's slots, columns and which optional inputs it has."""
    return tuple(
        (p.hi, p.qpos.shape, p.active is None, p.bias is None, p.written is None, p.owner is None) for p in step.each()
    )


@functools.cache
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture's warm-up: cuBLAS keeps a workspace (32 MiB on Hopper) per
    stream it ran on, so a new stream per run would add one each time."""
    return torch.cuda.Stream(device=device)


def decode_runner(mode: str):
    """The callable ``(model, step, ids, mask) -> model output`` of a concrete mode (``resolve``)."""
    if mode == "none":
        return eager_decode
    if mode == "default":
        return compiled_decode()
    return CapturedDecode()
