"""Measured CPU allocations for memory tests: every allocation and free the CPU allocator reports to the profiler.

``AllocationTracker`` runs ``torch.profiler`` with ``profile_memory=True`` and reads its allocation events (size,
sign, time): kernel-internal temporaries (a BLAS packing buffer, a ``contiguous`` copy inside ``matmul``) are seen
too, not only the tensors Python holds. Tensors that existed before the tracker started are the baseline (0);
``peak`` is the largest net total allocated above it. Freeing such an older tensor inside is not subtracted (the
profiler never saw its size), so the peak is then an upper bound; no code measured here frees its inputs. ``spans(label)`` gives the same peak inside each
``torch.profiler.record_function(label)`` region, relative to the bytes held when the region opened.

CPU only: on CUDA use ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import itertools

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


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
        self.events = sorted(_allocations(roots))  # [(time_ns, seq, signed bytes)], frees negative
        self.peak = _peak(size for *_, size in self.events)
        self.net = sum(size for *_, size in self.events)  # still held at exit

    def spans(self, label: str) -> list[int]:
        """Peak bytes above the region's entry for each ``record_function(label)`` region, in time order."""
        regions = sorted(_find(self._roots, label), key=lambda e: e.start_time_ns)
        return [_peak(size for *_, size in sorted(_allocations([r]))) for r in regions]


def _allocations(roots):
    stack, seq = list(roots), itertools.count()
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            yield e.start_time_ns, next(seq), int(e.extra_fields.alloc_size)
        stack.extend(e.children)


def _find(roots, label):
    stack = list(roots)
    while stack:
        e = stack.pop()
        if e.name == label:
            yield e
        else:
            stack.extend(e.children)
