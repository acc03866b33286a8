"""Measured CPU allocations for memory tests: every allocation and free the CPU allocator reports to the profiler.

``AllocationTracker`` runs ``torch.profiler`` with ``profile_memory=True`` and reads its allocation events (size,
sign, time): kernel-internal temporaries (a BLAS packing buffer, a ``contiguous`` copy inside ``matmul``) are seen
too, not only the tensors Python holds. Tensors that existed before the tracker started are the baseline (0);
``peak`` is the largest net total allocated above it. Freeing such an older tensor inside is not subtracted (the
profiler never saw its size), so the peak is then an upper bound; no code measured here frees its inputs.
``spans(label)`` gives the same peak inside each
``torch.profiler.record_function(label)`` region, relative to the bytes held when the region opened, and
``nets(label)`` what each region still holds when it closes. ``spans(label, scratch=ops)`` leaves out a fused
kernel's own scratch: blocks allocated and freed inside one call of an op named in ``ops`` (``KERNEL_SCRATCH``).

``AttentionPasses`` measures attention pass by pass, the baselines' as ``core.workspace.dense_workspace_bytes`` counts.

CPU only: on CUDA use ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

#: Fused attention kernels whose internal scratch is not part of the workspace counts: the CPU flash kernel's
#: per-thread blocks (their size follows the thread count).
KERNEL_SCRATCH = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


def _peak(sizes) -> int:
    """Largest prefix sum of signed allocation sizes (0 if nothing was allocated)."""
    return max(itertools.accumulate(sizes, initial=0))


class AllocationTracker:
    """with AllocationTracker() as t: ...  ->  t.peak (bytes above the baseline), t.spans(label) per region."""

    def __enter__(self) -> AllocationTracker:
        # Garbage from earlier code (a finished generation's cache and layers form a reference cycle) must not be
        # collected inside the measured span: its frees would be subtracted from what the span allocates.
        gc.collect()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        roots = self._prof.profiler.kineto_results.experimental_event_tree()
        self._roots = roots
        self.events = sorted(e[:3] for e in _allocations(roots))  # [(time_ns, seq, signed bytes)], frees negative
        self.peak = _peak(size for *_, size in self.events)
        self.net = sum(size for *_, size in self.events)  # still held at exit

    def _regions(self, label: str) -> list:
        return sorted(_find(self._roots, label), key=lambda e: e.start_time_ns)

    def spans(self, label: str, scratch: tuple[str, ...] = ()) -> list[int]:
        """Peak bytes above the region's entry for each ``record_function(label)`` region, in time order; blocks
        allocated and freed within one call of an op named in ``scratch`` are left out."""
        return [_peak(e[2] for e in _kept(_allocations([r], scratch))) for r in self._regions(label)]

    def nets(self, label: str) -> list[int]:
        """Bytes each ``record_function(label)`` region allocated and still held when it closed, in time order."""
        return [sum(e[2] for e in _allocations([r])) for r in self._regions(label)]


def _allocations(roots, scratch: tuple[str, ...] = ()):
    """(time_ns, seq, signed bytes, address, owner) of every CPU allocation event under ``roots``; ``owner``: the
    innermost enclosing op named in ``scratch`` (None outside them)."""
    stack, seq = [(r, None) for r in roots], itertools.count()
    while stack:
        e, owner = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                yield e.start_time_ns, next(seq), int(f.alloc_size), f.ptr, owner
            continue
        inner = e if e.name in scratch else owner
        stack.extend((c, inner) for c in e.children)


def _kept(events):
    """The events in time order without the blocks whose allocation and free have the same (non-None) owner."""
    events = sorted(events, key=lambda e: (e[0], e[1]))
    live, dropped = {}, set()
    for i, (_, _, size, ptr, owner) in enumerate(events):
        if size > 0:
            live[ptr] = (i, owner)
        elif ptr in live:
            j, alloc_owner = live.pop(ptr)
            if owner is not None and owner is alloc_owner:
                dropped.update((i, j))
    return [e for i, e in enumerate(events) if i not in dropped]


def _find(roots, label):
    stack = list(roots)
    while stack:
        e = stack.pop()
        if e.name == label:
            yield e
        else:
            stack.extend(e.children)


class AttentionPasses:
    """Measures the baselines' attention pass by pass: every call of HF's SDPA attention function and
    of the "batchmax" one runs inside a profiler region, and so does the model's mask
    construction (once per forward pass; llama-family models).

        passes = AttentionPasses(monkeypatch)
        with passes.measure() as measured:
            generate(...)

    ``measured`` (filled when the block ends): per forward pass, its largest attention call (kernel scratch left
    out) plus the mask the pass built and held through its layers, or the mask construction's own peak if larger:
    what ``core.workspace.dense_workspace_bytes`` counts. Only what runs inside ``measure`` is recorded."""

    CALL, MASK = "test::attention", "test::mask"

    def __init__(self, monkeypatch):
        from transformers import masking_utils
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama import modeling_llama

        from batchmax_tp.core import attention, hf_cache

        self.order: list[str] = []  # CALL / MASK, in call order
        self._on = False

        def region(fn, kind):
            def wrapped(*args, **kwargs):
                if not self._on:
                    return fn(*args, **kwargs)
                self.order.append(kind)
                with torch.profiler.record_function(kind):
                    return fn(*args, **kwargs)

            return wrapped

        for name in ("sdpa",):
            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, name, region(ALL_ATTENTION_FUNCTIONS[name], self.CALL))
        monkeypatch.setattr(attention, "batchmax_attention", region(attention.batchmax_attention, self.CALL))
        monkeypatch.setattr(hf_cache, "drop_in_attention", region(hf_cache.drop_in_attention, self.CALL))
        monkeypatch.setattr(modeling_llama, "create_causal_mask", region(masking_utils.create_causal_mask, self.MASK))

    @contextlib.contextmanager
    def measure(self):
        self.order, measured = [], []
        self._on = True
        try:
            with AllocationTracker() as tracker:
                yield measured
        finally:
            self._on = False
        measured.extend(self._workspace(tracker))

    def _workspace(self, tracker: AllocationTracker) -> list[int]:
        calls = iter(tracker.spans(self.CALL, scratch=KERNEL_SCRATCH))
        masks = iter(zip(tracker.spans(self.MASK), tracker.nets(self.MASK)))
        passes = []
        for kind in self.order:
            if kind == self.MASK:
                build, held = next(masks)
                passes.append([build, held, 0])
            else:
                passes[-1][2] = max(passes[-1][2], next(calls))
        return [max(build, held + call) for build, held, call in passes]
