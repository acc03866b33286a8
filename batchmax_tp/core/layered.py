"""Budgets across layers (a rule's ``taper``, PyramidKV's shape): ``LayeredPool``, a Batch-Max pool per run of layers
of one budget, all running the same passes (``RowsPass.parts``)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from .bounded import BoundedPool, PoolLayer
from .method import Method
from .schedule import Phase
from .slots import KVLayout, RowState
from .step import Change, PoolState, RowsPass, SlotWork


class _LayerGroup(BoundedPool):
    """A run of layers of one budget in a ``LayeredPool``: BM's pool over those layers (the model's layers
    ``first_layer`` on), whose rows evict for its own ``capacity``: the schedule's phases are stated for the smallest
    layer's budget (``Method.schedule_capacity``), and a larger one starts evicting later, ``p`` at a time as well."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, static: bool, first_layer: int):
        super().__init__(method, num_layers, slots, capacity, static)
        self.first_layer = first_layer

    def evicts(self, st: RowState, phase: Phase) -> int:
        """Algorithm 1 on this group's budget: ``p`` pairs before a block or decode step that does not fit it."""
        return self.method.num_to_evict(st.filled, phase.size, self.capacity, first_decode=False)


class LayeredPool:
    """BM's pool with budgets across layers (a rule's ``taper``: ``BatchMax.layer_capacities``, PyramidKV's shape): a
    ``_LayerGroup`` per run of layers of one budget, each in storage sized to it (the layers' slots together are
    those of every layer at ``kv_max``), all running the same passes. The schedule's blocks are stated for the
    smallest budget (its first block is the first block of every group); each group evicts for its own. A pass is
    every group's description of it (``RowsPass.parts``; the first's fields stand for the columns and rows they all
    share), and each layer's attention reads its group's (``RowsPass.at``). Evictions stay within a layer, so nothing
    changes under tensor parallelism: every rank runs the same groups."""

    mixes = False  # BM: no mixed passes

    num_blocks = 0  # rows hold their own slots

    def __init__(self, method: Method, capacities: tuple[int, ...], slots: int, static: bool = False):
        self.method, self.slots, self.static = method, slots, static
        self.parts: list[_LayerGroup] = []
        for capacity, run in itertools.groupby(capacities):
            first = sum(len(part.layers) for part in self.parts)
            self.parts.append(_LayerGroup(method, len(list(run)), slots, capacity, static, first))

    @property
    def layers(self) -> list[PoolLayer]:
        return [layer for part in self.parts for layer in part.layers]

    @property
    def allocated(self) -> bool:
        return self.parts[0].allocated

    def allocate(self, layout: KVLayout) -> None:
        for part in self.parts:
            part.allocate(layout)

    def initial(self) -> PoolState:
        """Each group's rows, empty."""
        return PoolState(parts=tuple(part.initial() for part in self.parts))

    def admitted(
        self, state: PoolState, rows: range, offsets: list[int], lengths: list[int], max_new: list[int]
    ) -> Change:
        parts = zip(self.parts, state.parts)
        return Change(parts=tuple(part.admitted(own, rows, offsets, lengths, max_new) for part, own in parts))

    def graduated(self, state: PoolState, rows: range, decodes: list[bool]) -> Change:
        return Change(parts=tuple(part.graduated(own, rows, decodes) for part, own in zip(self.parts, state.parts)))

    def finished(self, state: PoolState, row: int) -> Change:
        """Nothing to free: every row holds its own slots."""
        return Change()

    def apply(self, change: Change) -> None:
        """Each group's pool executes its part of the change."""
        for part, own in zip(self.parts, change.parts):
            part.apply(own)

    def prefill_pass(
        self, state: PoolState, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """Every group's description of the pass of ``work`` (``BoundedPool.prefill_pass``) and its input ids."""
        described = [part.prefill_pass(own, work, prompts, device) for part, own in zip(self.parts, state.parts)]
        return _joined([step for step, _ in described]), described[0][1]

    def wide_pass(
        self, state: PoolState, subs: tuple[tuple[SlotWork, ...], ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """Every group's description of the wide pass of ``subs`` (``BoundedPool.wide_pass``) and its input ids."""
        described = [part.wide_pass(own, subs, prompts, device) for part, own in zip(self.parts, state.parts)]
        return _joined([step for step, _ in described]), described[0][1]

    def decode_pass(self, state: PoolState, work: tuple[SlotWork, ...], device) -> RowsPass:
        return _joined([part.decode_pass(own, work, device) for part, own in zip(self.parts, state.parts)])

    def ready(self, step: RowsPass) -> RowsPass:
        """Every group runs its part's host part (``BoundedPool.ready``); returns what the model call reads."""
        return _joined([part.pool.ready(part) for part in step.parts])

    def kv_bytes(self) -> int:
        return sum(part.kv_bytes() for part in self.parts)

    def meta_bytes(self) -> int:
        return sum(part.meta_bytes() for part in self.parts)

    def note(self) -> None:
        for part in self.parts:
            part.note()

    @property
    def peak_kv_bytes(self) -> int:
        return sum(part.peak_kv_bytes for part in self.parts)  # held together, from the allocation on

    @property
    def peak_meta_bytes(self) -> int:
        return sum(part.peak_meta_bytes for part in self.parts)

    @property
    def peak_workspace_bytes(self) -> int:
        return max(part.peak_workspace_bytes for part in self.parts)  # one layer's attention call at a time

    def release(self) -> None:
        for part in self.parts:
            part.release()

    def kept_positions(self, state: PoolState, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the sorted positions row ``row`` holds (host copy; for tests)."""
        return [kept for part, own in zip(self.parts, state.parts) for kept in part.kept_positions(own, row)]


def _joined(steps: list[RowsPass]) -> RowsPass:
    """One pass of every layer group (``LayeredPool``): the first group's, carrying each group's as ``parts``."""
    return replace(steps[0], parts=tuple(steps))
