"""The per-pass description handed to the attention function: what one model call computes, stated explicitly.

The engine builds one ``ForwardPass`` per model call and passes it as the model's ``batchmax=`` keyword; transformers
forwards unknown keywords through the decoder layers to the attention function (every supported family, under
DeepSpeed AutoTP too, which replaces linear layers only). The attention function finds its cache layer as
``batchmax.cache.layers[module.layer_idx]``: no thread-local state, no global. (HF's ``model.generate`` drop-in,
which passes no description, keeps the cache's own hand-off as a fallback.)

A pass is a prefill block, a look-ahead probe or a decode step. ``work`` lists, per cache row it touches, the row
and that row's own schedule phase (``core.schedule.Phase``: its tokens' range, its eviction count, its step): a
static batch has one entry for every row (``ALL_ROWS``); a pool's prefill pass one slot; a pool's decode pass every
decoding slot, each at its own step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .schedule import Phase

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

ALL_ROWS = -1  # a static batch's pass: every row of the cache runs the same phase


@dataclass(frozen=True)
class SlotWork:
    """One cache row's part of a pass: ``row`` (a pool slot, or ``ALL_ROWS``) runs ``phase`` of its own schedule."""

    row: int
    phase: Phase


@dataclass(frozen=True)
class ForwardPass:
    """One model call: its kind, the cache it reads and writes, and each row's phase."""

    kind: Literal["prefill", "probe", "decode"]
    cache: Cache
    work: tuple[SlotWork, ...]

    @classmethod
    def static(cls, cache: Cache, phase: Phase) -> ForwardPass:
        """A static batch's pass: every row runs ``phase``."""
        return cls(phase.kind, cache, (SlotWork(ALL_ROWS, phase),))

    def layer(self, module):
        """The cache layer of the attention module being run (``module.layer_idx``, set by every HF family)."""
        return self.cache.layers[module.layer_idx]
