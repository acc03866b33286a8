"""Eviction methods: Batch-Max (BM), extreme decoding-only (ED), the full cache (FKV) and snap (SnapKV's compression
once after an unchunked prefill, the peer users run instead).

A method is a small validated dataclass, one class per method (``FullCache``, ``ExtremeDecoding``, ``BatchMax``,
``Snap``) registered by name in ``METHODS``; nothing outside this module compares method names. Scoring is pure
tensor math on one cache layer's slot state: ``priority() -> sort (cache.slots_to_evict) -> the first n slots are
evicted``.
Lower scores are evicted first; empty and pad slots score ``-inf``; exact score ties evict the older pair (smaller
position) first, so the kept set is deterministic and identical on every tensor-parallel rank that holds the same
head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

from .rules import Rule, get_rule
from .workspace import snap_workspace_bytes

if TYPE_CHECKING:  # tensors arrive as arguments: this module imports no torch (config validation stays instant)
    from torch import Tensor


def min_kv_max(p: int, rule: str = "paper") -> int:
    """The smallest kv_max BM runs with under ``p`` and ``rule``: above ``p``, and ``p`` more than the pairs the
    rule never evicts (its sinks + recent window)."""
    return p + max(1, get_rule(rule).protected())


#: The fields every method has (``Method``'s own); a subclass's further fields are its own parameters.
_COMMON = ("name", "kv_max", "p", "rule")


@dataclass(frozen=True)
class Method:
    """What to keep in a KV cache: one subclass per method, registered by its ``name`` (``METHODS``).

    ``Method("bm", kv_max=512)`` parses a name into its class (``BatchMax(kv_max=512)``); each class owns what
    differs between methods: its validation, schedule (``capacity``, ``prefill_blocks``, ``num_to_evict``), its
    eviction priority and its label. ``rule`` names BM's eviction rule (``core.rules``; default the paper's
    average attention); ED and FKV take only the default.
    """

    name: str
    kv_max: int | None = None
    p: int = 64
    rule: str = "paper"

    #: Whether the method ever evicts (``kv_max`` applies).
    evicts: ClassVar[bool] = True
    #: The kv_max a run gets when none is given.
    default_kv_max: ClassVar[int | None] = None
    #: The smallest kv_max the method runs with.
    least_kv_max: ClassVar[int] = 1
    #: Whether ``rule`` chooses anything (only BM's eviction has rules); a class attribute, so that a method's
    #: name tells it before any instance exists (``method_type(name).takes_rule``).
    takes_rule: ClassVar[bool] = False
    #: The kv_max a run serving text (lm-eval's ``batchmax`` model, the serving bench) gets; None: ``default_kv_max``.
    serving_kv_max: ClassVar[int | None] = None
    #: Whether the prompt is prefilled in blocks (Algorithm 1: kv_max, then p at a time) within kv_max slots.
    bounded_prefill: ClassVar[bool] = False
    #: Whether an eviction keeps the newest pair alone (Algorithm 3): 1 to kv_max pairs, no prompt pair but its last.
    keeps_newest: ClassVar[bool] = False
    #: Whether a request's blocks (``blocks``) go back when its prefill ends (snap prefilled in chunks: its prompt's
    #: full pairs, held until it compresses them) instead of when it ends (FKV paged).
    transient_blocks: ClassVar[bool] = False
    #: The method in tables, plots and labels.
    short_name: ClassVar[str]
    #: Where reports list the method: the paper's tables' order (ED, FKV, BM), then snap (``METHODS``: the runs').
    report_order: ClassVar[int]
    #: The pool a run of the method holds its slots in (``core.pool.make_pool``): ``bounded`` (Batch-Max's ranked
    #: slots), ``full`` (FKV's rows, or its blocks when paged), ``newest`` (ED's keep-newest rows), ``snap``.
    pool_kind: ClassVar[str]
    #: The method in a plot's legend, its colour and its marker (matplotlib's names).
    legend: ClassVar[str]
    colour: ClassVar[str]
    marker: ClassVar[str]

    def __new__(cls, name: str | None = None, *args, **kwargs):
        if cls is Method:  # the registry: a name parses into its class
            cls = method_type(name)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if type(self) is not METHODS.get(self.name):
            raise ValueError(f"{type(self).__name__} is method {type(self).name!r}, not {self.name!r}")
        if not isinstance(self.p, int) or self.p < 1:
            raise ValueError(f"p must be an integer >= 1, got {self.p!r}")
        get_rule(self.rule)  # ValueError naming the rules for an unknown one
        if self.rule != "paper" and not self.takes_rule:
            raise ValueError(f"rule {self.rule!r} applies to method 'bm' only, not {self.name!r}")
        if self.evicts:
            if not isinstance(self.kv_max, int):
                raise ValueError(f"kv_max must be an integer for method {self.name!r}, got {self.kv_max!r}")
            self.validate_kv_max()

    def validate_kv_max(self) -> None:
        """ValueError when ``kv_max`` is too small for the method."""
        if self.kv_max < self.least_kv_max:
            raise ValueError(f"kv_max must be >= {self.least_kv_max} for method {self.name!r}, got {self.kv_max}")

    # -- identity --------------------------------------------------------------------------------------------
    @cached_property
    def scorer(self) -> Rule:
        """The eviction rule's dataclass (``rules.get_rule(self.rule)``), parsed once per Method."""
        return get_rule(self.rule)

    @property
    def lookahead(self) -> int:
        """Look-ahead probe tokens of BM's probe passes (0 for rules without a probe)."""
        return 0

    @property
    def probe_every(self) -> int:
        """A probe pass follows every this many prefill blocks (``Rule.probe_every``; 1 without a probe)."""
        return self.scorer.probe_every() if self.lookahead else 1

    @property
    def probe_decodes(self) -> bool:
        """Whether decode evictions rank by the stored probe re-scored over the slots held (``Rule.probe_decodes``)."""
        return bool(self.lookahead) and self.scorer.probe_decodes()

    @property
    def recalls(self) -> bool:
        """Whether a prefill's evicted pairs wait in a slower tier for a recall (before the last block, or after it by
        the window: ``Rule.recalls``)."""
        return bool(self.lookahead) and self.scorer.recalls()

    @property
    def recall_window(self) -> int:
        """``recall=window``: the prompt's last queries that choose, after its last block, the pairs held from the held
        and the tier's (``Rule.recall_window``); 0: none (``recall=tier`` recalls before the last block instead)."""
        return self.scorer.recall_window() if self.lookahead else 0

    @property
    def stores_probe(self) -> bool:
        """Whether each row keeps its last probe's queries (``core.probe``): to re-score the slots at evictions after
        a block without a probe (``probe_every`` > 1), at decode evictions (``probe_decodes``) or over the slots and
        the tier at ``recall=tier``'s recall."""
        recall = self.recalls and not self.recall_window  # recall=tier re-scores with the stored probe
        return bool(self.lookahead) and (self.probe_every > 1 or self.probe_decodes or recall)

    @property
    def paged(self) -> bool:
        """Whether the method's K/V lives in blocks shared by the rows (FKV by real length, ``dense.PagedPool``)."""
        return False

    @property
    def wide(self) -> bool:
        """Whether a prefill pass runs several consecutive blocks of a row, evicting between them inside each layer
        (BM with ``chunk`` > 0)."""
        return False

    @property
    def held_kv_max(self) -> int | None:
        """``kv_max`` where it bounds the cache, None for the full cache."""
        return self.kv_max if self.evicts else None

    def label(self) -> str:
        rule = "" if self.rule == "paper" else f", rule={self.rule}"
        return f"{self.name}(kv_max={self.kv_max}, p={self.p}{rule})"

    @classmethod
    def own_parameters(cls) -> dict[str, int]:
        """The method's own parameters (``snap``'s window and kernel) with their defaults: what ``name:key=value``
        sets (:func:`make_method`)."""
        return {f.name: f.default for f in fields(cls) if f.name not in _COMMON}

    def slug(self) -> str:
        """The method in a run's folder name: its name, then its own parameters that differ from the defaults
        (``snap-window16``)."""
        changed = [f"{k}{getattr(self, k)}" for k, v in self.own_parameters().items() if getattr(self, k) != v]
        return "-".join([self.name, *changed])

    # -- schedule ----------------------------------------------------------------------------------------------
    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots each (sample, KV head) needs at its largest."""
        raise NotImplementedError

    def schedule_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """The capacity the schedule's phases evict for (``schedule.plan``): ``capacity``, but with budgets across
        layers (``BatchMax``, a rule's ``taper``) the smallest layer's, which evicts at every step any layer does."""
        return self.capacity(prompt_len, max_new_tokens)

    def layer_capacities(self, num_layers: int) -> tuple[int, ...] | None:
        """Each layer's slots per (sample, KV head) when they differ (a rule's ``taper``), else None."""
        return None

    def decode_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots each (sample, KV head) needs once its prompt is prefilled (a continuous-batching pool's row)."""
        return self.capacity(prompt_len, max_new_tokens)

    def prefill_blocks(self, prompt_len: int) -> list[tuple[int, int]]:
        """The prompt's prefill blocks ``[start, end)``: one block unless the method bounds the prefill."""
        return [(0, prompt_len)]

    def pass_tokens(self, slots: int) -> int | None:
        """Prompt tokens one prefill pass of a pool of ``slots`` slots takes at most, from several rows at their own
        positions (BM: chunks of ``p``; FKV and snap prefilled in chunks: ``chunk``), or None: the whole prompt of one
        group of one length per pass (ED; FKV and snap with ``chunk=0``)."""
        return None

    @property
    def first_block_chunk(self) -> int | None:
        """The schedule feeds the first prefill block in passes of this many tokens (``schedule.plan``'s ``chunk``) when
        prefill passes take many rows (BM: ``p``); None: its blocks as ``prefill_blocks`` states them."""
        return None

    def blocks(self, prompt_len: int, max_new_tokens: int) -> int:
        """K/V blocks of ``BLOCK`` positions a request holds from its admission (FKV paged: to its end; snap prefilled
        in chunks: its prompt's, until its prefill ends, ``transient_blocks``); 0: none."""
        return 0

    def slot_state_bytes(self, elem: int, group: int = 1) -> int:
        """Bookkeeping bytes per slot of a pool row (``elem``: bytes per element of the model dtype; ``group``: KV
        heads sharing one budget, ``group``); none for a method that never ranks by attention."""
        return 0

    def group(self, kv_heads: int) -> int:
        """How many of a layer's ``kv_heads`` (on one rank) share one budget of slots (``Rule.share``; 1 unless the
        method's rule shares)."""
        return 1

    def prefill_workspace_bytes(self, q_heads: int, kv_heads: int, head_dim: int, prompt: int, elem: int) -> int:
        """Workspace one layer's call of a prefill pass of one ``prompt``-token row holds beyond the dense prefill's
        (``workspace.dense_workspace_bytes``), for the methods that prefill a group per pass (0: none)."""
        return 0

    def num_to_evict(self, filled: int, incoming: int, capacity: int, first_decode: bool) -> int:
        """How many pairs to evict before writing ``incoming`` new pairs into a cache holding ``filled``.

        This is the one place where the schedule's eviction decision is made (the cache calls it per layer,
        the schedule calls it to state each phase): it depends only on host integers shared by every layer and
        every rank, so all of them evict at the same steps.
        """
        return 0

    def priority(
        self, score: Tensor, pos: Tensor, curr_id: int, probe: Tensor | None = None, head: Tensor | None = None
    ) -> Tensor:
        """Priority [B, H, C] of each slot (lower evicted first; ``head``: each slot's head in a shared budget)."""
        raise NotImplementedError(f"method {self.name!r} never evicts")


#: FKV's block size by default: a request holds ceil((prompt + new - 1) / BLOCK) blocks of K/V (``dense.PagedPool``).
#: 64 on the CPU: at 16 the decode attention's many tiny products cost 2x those of 64 (2026-11-27, this machine).
BLOCK = 64
#: FKV's and snap's prefill chunk by default: a prompt is prefilled ``CHUNK`` tokens a pass (and a pass takes at most
#: that many prompt tokens, several requests' chunks when they are shorter), as vLLM and SGLang prefill. 2,048: the
#: fastest per prompt token measured on this CPU (docs/performance.md, "Chunked prefill"); ``chunk=0``: the whole
#: prompt in one pass.
CHUNK = 2048


def _check_chunk(method: str, chunk) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(
            f"chunk must be a non-negative integer (prompt tokens a prefill pass takes; 0: the whole prompt in one "
            f"pass) for method {method!r}, got {chunk!r}"
        )


def chunk_blocks(prompt_len: int, chunk: int, least_last: int = 1) -> list[tuple[int, int]]:
    """A prompt's prefill chunks ``[start, end)`` of ``chunk`` tokens (0: one block), the last holding at least
    ``least_last`` tokens (merged with the one before it when shorter)."""
    if not chunk:
        return [(0, prompt_len)]
    blocks = [(a, min(a + chunk, prompt_len)) for a in range(0, prompt_len, chunk)]
    if len(blocks) > 1 and blocks[-1][1] - blocks[-1][0] < least_last:
        blocks[-2:] = [(blocks[-2][0], prompt_len)]
    return blocks


@dataclass(frozen=True)
class FullCache(Method):
    """``fkv``: the full cache; never evicts (``kv_max`` is ignored). ``block`` > 0: K/V in blocks of that many
    positions, a request admitted when the free blocks cover its prompt and generation and holding only those
    (``dense.PagedPool``, vLLM's PagedAttention layout); ``block=0``: a fixed-capacity slot per request, sized for the
    longest (``dense.FullPool``, the paper's padded batch and the engine before 2026-11-27). ``chunk`` > 0: the prompt
    prefilled ``chunk`` tokens a pass (each chunk's queries over the pairs the request holds and its own, causal), a
    pass taking the chunks of several requests up to ``chunk`` tokens in all; ``chunk=0``: the whole prompt in one pass
    of its group (its activations grow with the prompt)."""

    name: str = "fkv"
    block: int = BLOCK
    chunk: int = CHUNK
    evicts: ClassVar[bool] = False
    pool_kind: ClassVar[str] = "full"
    short_name: ClassVar[str] = "FKV"
    report_order: ClassVar[int] = 1
    legend: ClassVar[str] = "FKV (full KV cache)"
    colour: ClassVar[str] = "tab:blue"
    marker: ClassVar[str] = "o"

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0:
            raise ValueError(
                f"block must be a positive integer (positions per K/V block; 0: fixed-capacity slots) for method "
                f"'fkv', got {self.block!r}"
            )
        _check_chunk(self.name, self.chunk)
        super().__post_init__()

    @property
    def paged(self) -> bool:
        return self.block > 0

    def label(self) -> str:
        parts = ([] if self.paged else ["slots"]) + ([] if self.chunk else ["one-pass"])
        return f"{self.name}({', '.join(parts)})" if parts else self.name

    def prefill_blocks(self, prompt_len: int) -> list[tuple[int, int]]:
        """Chunks of ``chunk`` tokens (one block with ``chunk=0``)."""
        return chunk_blocks(prompt_len, self.chunk)

    def pass_tokens(self, slots: int) -> int | None:
        """``chunk`` prompt tokens a pass (several requests' chunks when they are shorter); None with ``chunk=0``."""
        return self.chunk or None

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max(max_new_tokens - 1, 0)

    def blocks(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request holds from admission to its end (paged; 0 in fixed slots)."""
        return -(-self.capacity(prompt_len, max_new_tokens) // self.block) if self.paged else 0


@dataclass(frozen=True)
class ExtremeDecoding(Method):
    """``ed``: extreme decoding-only eviction (Algorithm 3): the whole prompt is prefilled at once, then only the
    newest pair is kept, and again whenever the cache reaches ``kv_max`` pairs."""

    name: str = "ed"
    default_kv_max: ClassVar[int] = 2
    least_kv_max: ClassVar[int] = 2
    #: The paper's other ED setting (it runs 2 and 65, docs/memory-planning.md), lm-eval's default (docs/lm-eval.md).
    serving_kv_max: ClassVar[int] = 65
    keeps_newest: ClassVar[bool] = True
    pool_kind: ClassVar[str] = "newest"
    short_name: ClassVar[str] = "ED"
    report_order: ClassVar[int] = 0
    legend: ClassVar[str] = "ED (decoding-only eviction)"
    colour: ClassVar[str] = "tab:orange"
    marker: ClassVar[str] = "s"

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return max(self.kv_max, prompt_len)

    def decode_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.kv_max  # after the first eviction: never more than kv_max pairs

    def num_to_evict(self, filled: int, incoming: int, capacity: int, first_decode: bool) -> int:
        # Before each single-token decode pass the newest pair alone is kept after the prompt and whenever |kv|
        # reached kv_max. A multi-token block is prefill (HF generate's chunked prefill feeds several): no eviction.
        decode = incoming == 1
        return filled - 1 if decode and (first_decode or filled >= self.kv_max) and filled > 1 else 0

    def priority(self, score, pos, curr_id, probe=None, head=None) -> Tensor:
        """Newest first: the score is the position itself (empty slots -1)."""
        return pos.float()


@dataclass(frozen=True)
class BatchMax(Method):
    """``bm``: Batch-Max (paper, Algorithm 1 + its rule). The cache never holds more than ``kv_max`` pairs per
    (sample, KV head), during prefill too; ``p`` pairs are evicted whenever a block does not fit. ``chunk`` > 0 (wide
    passes; 0 by default): a prefill pass runs up to ``chunk`` columns, several consecutive blocks of each of its
    rows, the model's linear layers over all of them at once and each layer's attention over the blocks one after
    another, evicting before each (the same kept pairs; ``attention._wide``); ``chunk=0``: a pass runs one block of
    each of its rows (the paper's passes, whose activations stay at a block a row; measured on this CPU in
    docs/performance.md, "Wide passes")."""

    name: str = "bm"
    chunk: int = 0
    takes_rule: ClassVar[bool] = True
    default_kv_max: ClassVar[int] = 512
    bounded_prefill: ClassVar[bool] = True
    pool_kind: ClassVar[str] = "bounded"
    short_name: ClassVar[str] = "BM"
    report_order: ClassVar[int] = 2
    legend: ClassVar[str] = "BM (Batch-Max)"
    colour: ClassVar[str] = "tab:green"
    marker: ClassVar[str] = "^"

    def __post_init__(self) -> None:
        _check_chunk(self.name, self.chunk)
        super().__post_init__()
        if self.chunk and self.chunk < self.p + self.lookahead:
            raise ValueError(
                f"chunk must be 0 or at least p + the rule's probe window ({self.p + self.lookahead}: a pass holds "
                f"at least one block and its probe) for method 'bm', got {self.chunk}"
            )

    def validate_kv_max(self) -> None:
        if self.kv_max <= self.p:
            raise ValueError(f"kv_max must be > p for method 'bm', got kv_max={self.kv_max} p={self.p}")
        if self.kv_max < min_kv_max(self.p, self.rule):
            protected = self.scorer.protected()
            raise ValueError(
                f"rule {self.rule!r} protects {protected} pairs: kv_max must be >= p + "
                f"{protected}, got kv_max={self.kv_max} p={self.p}"
            )
        if self.scorer.taper and not self.taper_steps:
            least = math.ceil(50 * self.p / self.kv_max)
            raise ValueError(
                f"rule {self.rule!r}: taper={self.scorer.taper} moves no layer's budget by a whole p={self.p} at "
                f"kv_max={self.kv_max} (|taper| >= {least} does)"
            )
        if self.least_kv_max_of_layers < min_kv_max(self.p, self.rule):
            least, need = self.least_kv_max_of_layers, min_kv_max(self.p, self.rule)
            raise ValueError(
                f"rule {self.rule!r}: taper={self.scorer.taper} leaves its smallest layer {least} slots, below p + "
                f"the pairs it protects ({need}) at kv_max={self.kv_max} p={self.p}"
            )

    def label(self) -> str:
        label = super().label()
        return f"{label[:-1]}, chunk={self.chunk})" if self.chunk else label

    @property
    def lookahead(self) -> int:
        return self.scorer.lookahead()

    @property
    def taper_steps(self) -> int:
        """m: the smallest layer's budget is ``kv_max - m p`` and the mean layer's ``kv_max`` (the rule's ``taper``
        percent of ``kv_max``, in whole blocks of ``p``; 0 without a taper)."""
        return math.floor(self.kv_max * abs(self.scorer.taper) / 100 / self.p + 0.5)  # half up, never to even

    @property
    def least_kv_max_of_layers(self) -> int:
        """The smallest layer's budget: its first prefill block, and the capacity the schedule evicts for."""
        return self.kv_max - self.taper_steps * self.p

    def layer_capacities(self, num_layers: int) -> tuple[int, ...] | None:
        """PyramidKV's shape (``Rule.taper``): layer l holds ``kv_max - m p + k_l p`` slots, k_l the linear ramp
        ``2 m (1 - l / (L - 1))`` rounded so that the k_l sum to ``L m`` exactly (then in order, reversed for a negative
        taper): the layers hold ``L x kv_max`` slots in all, what every layer at ``kv_max`` holds. None without a
        taper."""
        m = self.taper_steps
        if not m:
            return None
        L = num_layers
        ramp = [2 * m * (1 - i / (L - 1)) if L > 1 else m for i in range(L)]  # the ideal k_l, summing to L m
        cumulative = [round(sum(ramp[:i])) for i in range(L + 1)]  # rounded running sums: the total stays L m
        steps = sorted((b - a for a, b in zip(cumulative, cumulative[1:])), reverse=self.scorer.taper > 0)
        return tuple(self.least_kv_max_of_layers + k * self.p for k in steps)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.kv_max

    def schedule_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.least_kv_max_of_layers

    def prefill_blocks(self, prompt_len: int) -> list[tuple[int, int]]:
        """Algorithm 1: first block ``min(s, kv_max)`` tokens, then blocks of ``p`` (with budgets across layers the
        first block is the smallest layer's budget: every layer runs the same blocks, each evicting for its own)."""
        t1 = min(prompt_len, self.least_kv_max_of_layers)
        blocks = [(0, t1)]
        while t1 < prompt_len:
            t0, t1 = t1, min(prompt_len, t1 + self.p)
            blocks.append((t0, t1))
        return blocks

    def slot_state_bytes(self, elem: int, group: int = 1) -> int:
        """A position (int64), an attention sum (float32), an additive mask (model dtype) and a free-list entry
        (int64) per slot; a rule with a look-ahead probe adds its probe value (float32); a budget shared by several
        heads stores its free list as int32 and adds each slot's head (int8), 3 bytes less in all."""
        free = 8 if group == 1 else 4 + 1
        return 8 + 4 + elem + free + (4 if self.lookahead else 0)

    def group(self, kv_heads: int) -> int:
        return self.scorer.group(kv_heads)

    @property
    def first_block_chunk(self) -> int:
        return self.p

    @property
    def wide(self) -> bool:
        """Whether a prefill pass runs several consecutive blocks of each of its rows (``chunk`` > 0): the linear
        layers see all of the pass's columns at once, and each layer's attention runs the blocks one after another,
        evicting before each as Algorithm 1 does (``attention._wide``): the same kept pairs as passes of one block."""
        return self.chunk > 0

    def pass_tokens(self, slots: int) -> int:
        """``chunk`` > 0: at most ``chunk`` columns a pass (rows x their blocks and probes). Else every row's next
        chunk of ``p`` in one pass (and the look-ahead probe a rule folds into it), and never less than Algorithm 1's
        first block and its probe (a lone row's run in one pass): measured 2026-11-26, kv_max-token passes of many
        rows made a pool's prefill 2.2x slower than this on an H200 (Llama-2-7B, 98 slots), and no faster on the
        2-core CPU (16 slots, within run-to-run noise); docs/performance.md."""
        if self.chunk:
            return self.chunk
        return max(self.kv_max + self.lookahead, slots * (self.p + self.lookahead))

    def num_to_evict(self, filled: int, incoming: int, capacity: int, first_decode: bool) -> int:
        # Algorithm 1: remove p pairs before a block or decode step that does not fit.
        if filled + incoming <= capacity:
            return 0
        if incoming > self.p:
            raise ValueError(
                f"a block of {incoming} tokens does not fit in a Batch-Max cache of kv_max={capacity} even "
                f"after evicting p={self.p}: feed prompts in blocks of at most p tokens after the first "
                f"(batchmax_tp.bench.padded.generate does; with HF generate pass prefill_chunk_size=p)"
            )
        return min(self.p, filled)

    def priority(self, score, pos, curr_id, probe=None, head=None) -> Tensor:
        """The rule's priority (``probe``: the look-ahead attention of the last prefill pass, or None)."""
        return self.scorer.score(score, pos, curr_id, probe, head)


@dataclass(frozen=True)
class Snap(Method):
    """``snap``: SnapKV's compression once after an unchunked prefill (``core.snap``). The prompt runs in one pass on
    the model's SDPA, as FKV's; each (row, KV head) then keeps ``kv_max`` of its pairs: the last ``window``
    positions and the ``kv_max - window`` others the window's queries attended to most (pooled over ``kernel``
    positions), and decodes in a bounded slot with the paper's decode-time eviction (``p`` pairs of smallest
    average attention when a step finds the slot full). A slot holds ``kv_max`` pairs, as BM's; its prompt is held
    in full only inside its own prefill pass."""

    name: str = "snap"
    window: int = 32
    kernel: int = 7
    chunk: int = CHUNK
    prefills: int = 1
    transient_blocks: ClassVar[bool] = True
    default_kv_max: ClassVar[int] = 512
    pool_kind: ClassVar[str] = "snap"
    short_name: ClassVar[str] = "snap"
    report_order: ClassVar[int] = 3
    legend: ClassVar[str] = "snap (SnapKV after the prompt)"
    colour: ClassVar[str] = "tab:red"
    marker: ClassVar[str] = "v"

    def __post_init__(self) -> None:
        for what in ("window", "kernel"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive integer for method 'snap', got {value!r}")
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd for method 'snap' (centred on the pair), got {self.kernel}")
        _check_chunk(self.name, self.chunk)
        if isinstance(self.prefills, bool) or not isinstance(self.prefills, int) or self.prefills < 1:
            raise ValueError(
                f"prefills must be a positive integer (requests holding their whole prompt at once while they "
                f"prefill in chunks) for method 'snap', got {self.prefills!r}"
            )
        super().__post_init__()

    def validate_kv_max(self) -> None:
        if self.kv_max <= max(self.window, self.p):
            raise ValueError(
                f"kv_max must be > window and > p for method 'snap', got kv_max={self.kv_max} window={self.window} "
                f"p={self.p}"
            )

    def label(self) -> str:
        how = f"chunk={self.chunk}, prefills={self.prefills}" if self.chunk else "one-pass"
        return f"snap(kv_max={self.kv_max}, p={self.p}, window={self.window}, kernel={self.kernel}, {how})"

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.kv_max

    def prefill_blocks(self, prompt_len: int) -> list[tuple[int, int]]:
        """Chunks of ``chunk`` tokens, the last holding the whole observation window (its queries choose, in the
        last chunk's pass); one block with ``chunk=0``."""
        return chunk_blocks(prompt_len, self.chunk, least_last=self.window)

    def pass_tokens(self, slots: int) -> int | None:
        """``chunk`` prompt tokens a pass (several requests' chunks when they are shorter); None with ``chunk=0``."""
        return self.chunk or None

    def blocks(self, prompt_len: int, max_new_tokens: int) -> int:
        """Prefilled in chunks: the blocks of ``BLOCK`` positions holding the prompt's full pairs until its last chunk
        compresses them (given back then, ``transient_blocks``); 0 in one pass."""
        return -(-prompt_len // BLOCK) if self.chunk else 0

    def slot_state_bytes(self, elem: int, group: int = 1) -> int:
        """BM's slot state without a probe: a position (int64), an attention sum (float32), an additive mask (model
        dtype) and a free-list entry (int64) per slot."""
        return 8 + 4 + elem + 8

    def prefill_workspace_bytes(self, q_heads: int, kv_heads: int, head_dim: int, prompt: int, elem: int) -> int:
        """The one-pass compress pass's (``workspace.snap_workspace_bytes``; prefilled in chunks the planner counts the
        chunks and the choice itself, ``planner._chunked_prefill``)."""
        kept = min(prompt, self.kv_max)
        return snap_workspace_bytes(1, q_heads, kv_heads, head_dim, prompt, self.window, kept, elem)

    def num_to_evict(self, filled: int, incoming: int, capacity: int, first_decode: bool) -> int:
        if incoming > 1:  # the prompt: kept pairs are chosen in its (last) pass (it "evicts" the rest)
            return max(0, filled + incoming - capacity)
        return min(self.p, filled) if filled + incoming > capacity else 0  # decoding: Algorithm 1's step

    def priority(self, score, pos, curr_id, probe=None, head=None) -> Tensor:
        """Decode-time eviction: the paper's average attention."""
        return self.scorer.score(score, pos, curr_id)


#: The registry: every method by its name, in the order runs and reports list them.
METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (FullCache, ExtremeDecoding, BatchMax, Snap)}


def method_type(name: str) -> type[Method]:
    """The class of the method called ``name`` (or spelled ``name:key=value,...``, :func:`make_method`); ValueError
    naming the methods for an unknown one."""
    name = name.partition(":")[0]
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]


def wide_parameters(name: str, bm_chunk: int) -> dict[str, int]:
    """The own parameters that give the method called ``name`` BM's wide passes of ``bm_chunk`` columns (the main job's
    ``bm_chunk``): its ``chunk`` where it bounds its prefill (BM); none for the others, or with ``bm_chunk`` 0."""
    return {"chunk": bm_chunk} if bm_chunk and method_type(name).bounded_prefill else {}


def make_method(spec: str, **common) -> Method:
    """A method from ``name`` or ``name:key=value,...`` (its own parameters, e.g. ``snap:window=16,kernel=5``)
    and the ``common`` fields (kv_max, p, rule); ValueError in one line for an unknown key or a value that is not
    an integer."""
    name, _, text = spec.partition(":")
    cls = method_type(name)
    own, values = cls.own_parameters(), {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in own:
            known = ", ".join(own) or "none"
            raise ValueError(f"method {name!r}: cannot read {item!r}; its parameters are key=value with keys: {known}")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"method {name!r}: {key} must be an integer, got {value!r}") from None
    return cls(**common, **values)


def ed_settings(p: int = 64) -> list[Method]:
    """The paper's two ED runs: kv_max 2 (``default_kv_max``: the newest pair and the one being written) and 65
    (``serving_kv_max``), each a fact of ``ExtremeDecoding`` written once."""
    kind = METHODS["ed"]
    return [kind(kv_max=kind.default_kv_max, p=p), kind(kv_max=kind.serving_kv_max, p=p)]


def is_full_cache(method: str | Method) -> bool:
    """Whether ``method`` (an instance or a name) never evicts: the full cache, the accuracy reference, whose
    ``kv_max`` holds nothing back."""
    return not (method if isinstance(method, Method) else method_type(method)).evicts


def takes_rule(method: str | Method) -> bool:
    """Whether ``method`` (an instance or a name) has eviction rules to choose from (BM)."""
    return (method if isinstance(method, Method) else method_type(method)).takes_rule


def serving_kv_max(method: str | Method) -> int | None:
    """The kv_max a run serving text gives ``method`` (an instance or a name) when none is given (lm-eval's
    ``batchmax`` model, the serving bench): its ``serving_kv_max``, else its ``default_kv_max`` (None: FKV)."""
    kind = method if isinstance(method, Method) else method_type(method)
    return kind.default_kv_max if kind.serving_kv_max is None else kind.serving_kv_max


def ranks_by_attention(kind: Method | type[Method]) -> bool:
    """Whether the method (an instance or its class) evicts pairs ranked by the attention they received, ``p`` at a
    time, from a bounded slot that keeps part of the prompt (BM, snap); FKV never evicts, ED keeps its newest pair."""
    return kind.evicts and not kind.keeps_newest


def has(name: str, fact: Callable[[type[Method]], bool]) -> bool:
    """Whether the method a run's record names has ``fact`` (a predicate on its class); a name this version does
    not know: no."""
    kind = METHODS.get(name)
    return kind is not None and fact(kind)
