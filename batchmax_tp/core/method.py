"""Eviction methods: Batch-Max (BM), extreme decoding-only (ED) and the full cache (FKV).

A method is a small validated dataclass. Scoring is pure tensor math on one cache layer's slot state:
``score() -> sort (cache.slots_to_evict) -> the first n slots are evicted``. Lower scores are evicted first;
empty and pad slots score ``-inf``; exact score ties evict the older pair (smaller position) first, so the kept set
is deterministic and identical on every tensor-parallel rank that holds the same head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from .rules import Rule, get_rule

if TYPE_CHECKING:  # tensors arrive as arguments: this module imports no torch (config validation stays instant)
    from torch import Tensor

METHODS = ("bm", "ed", "fkv")


def min_kv_max(p: int, rule: str = "paper") -> int:
    """The smallest kv_max BM runs with under ``p`` and ``rule``: above ``p``, and ``p`` more than the pairs the
    rule never evicts (its sinks + recent window)."""
    return p + max(1, get_rule(rule).protected())


@dataclass(frozen=True)
class Method:
    """What to keep in a bounded KV cache.

    - ``bm``: Batch-Max (paper, Algorithm 1 + average attention). The cache never holds more than ``kv_max``
      pairs per (sample, KV head), during prefill too; ``p`` pairs are evicted whenever a block does not fit.
    - ``ed``: extreme decoding-only eviction (Algorithm 3): the whole prompt is prefilled at once, then only
      the newest pair is kept, and again whenever the cache reaches ``kv_max`` pairs.
    - ``fkv``: full cache, never evicts (``kv_max`` is ignored).

    ``rule`` names BM's eviction rule (``core.rules``; default the paper's average attention); ED and FKV
    take only the default.
    """

    name: str
    kv_max: int | None = None
    p: int = 64
    rule: str = "paper"

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"unknown method {self.name!r}: choose one of {', '.join(METHODS)}")
        if not isinstance(self.p, int) or self.p < 1:
            raise ValueError(f"p must be an integer >= 1, got {self.p!r}")
        rule = get_rule(self.rule)  # ValueError naming the rules for an unknown one
        if self.name != "bm" and self.rule != "paper":
            raise ValueError(f"rule {self.rule!r} applies to method 'bm' only, not {self.name!r}")
        if self.name == "fkv":
            return
        if not isinstance(self.kv_max, int):
            raise ValueError(f"kv_max must be an integer for method {self.name!r}, got {self.kv_max!r}")
        if self.name == "bm" and self.kv_max <= self.p:
            raise ValueError(f"kv_max must be > p for method 'bm', got kv_max={self.kv_max} p={self.p}")
        if self.name == "bm" and self.kv_max < min_kv_max(self.p, self.rule):
            raise ValueError(
                f"rule {self.rule!r} protects {rule.protected()} pairs: kv_max must be >= p + "
                f"{rule.protected()}, got kv_max={self.kv_max} p={self.p}"
            )
        if self.name == "ed" and self.kv_max < 2:
            raise ValueError(f"kv_max must be >= 2 for method 'ed', got {self.kv_max}")

    @property
    def bounded(self) -> bool:
        """Whether the prefill itself is bounded by ``kv_max`` (only BM)."""
        return self.name == "bm"

    @cached_property
    def scorer(self) -> Rule:
        """The eviction rule's dataclass (``rules.get_rule(self.rule)``), parsed once per Method."""
        return get_rule(self.rule)

    @property
    def lookahead(self) -> int:
        """Look-ahead probe tokens of BM's probe passes (0 for rules without a probe)."""
        return self.scorer.lookahead() if self.name == "bm" else 0

    @property
    def probe_every(self) -> int:
        """A probe pass follows every this many prefill blocks (``Rule.probe_every``; 1 without a probe)."""
        return self.scorer.probe_every() if self.lookahead else 1

    def label(self) -> str:
        if self.name == "fkv":
            return self.name
        rule = "" if self.rule == "paper" else f", rule={self.rule}"
        return f"{self.name}(kv_max={self.kv_max}, p={self.p}{rule})"

    def num_to_evict(self, filled: int, incoming: int, capacity: int, first_decode: bool) -> int:
        """How many pairs to evict before writing ``incoming`` new pairs into a cache holding ``filled``.

        This is the one place where the schedule's eviction decision is made (the cache calls it per layer,
        the schedule calls it to state each phase): it depends only on host integers shared by every layer and
        every rank, so all of them evict at the same steps.
        """
        if self.name == "fkv":
            return 0
        if self.name == "ed":
            # Algorithm 3: the prompt is prefilled whole, then (before each single-token decode pass) the newest
            # pair alone is kept after the prompt and whenever |kv| reached kv_max. A multi-token block is prefill
            # (HF generate's chunked prefill feeds several), which never evicts.
            decode = incoming == 1
            return filled - 1 if decode and (first_decode or filled >= self.kv_max) and filled > 1 else 0
        # Algorithm 1: remove p pairs before a block or decode step that does not fit.
        if filled + incoming > capacity:
            if incoming > self.p:
                raise ValueError(
                    f"a block of {incoming} tokens does not fit in a Batch-Max cache of kv_max={capacity} even "
                    f"after evicting p={self.p}: feed prompts in blocks of at most p tokens after the first "
                    f"(batchmax_tp.core.engine.generate does; with HF generate pass prefill_chunk_size=p)"
                )
            return min(self.p, filled)
        return 0


def newest_first(score: Tensor, pos: Tensor, curr_id: int) -> Tensor:
    """ED's rule: keep the most recent pair; the score is the position itself (empty slots -1)."""
    return pos.float()


def eviction_priority(method: Method, score: Tensor, pos: Tensor, curr_id: int, probe: Tensor | None = None) -> Tensor:
    """Priority [B, H, C] of each slot (lower evicted first): ED newest-first, BM its rule (``probe``: the
    look-ahead attention of the last prefill pass, or None)."""
    if method.name == "ed":
        return newest_first(score, pos, curr_id)
    return method.scorer.score(score, pos, curr_id, probe)
