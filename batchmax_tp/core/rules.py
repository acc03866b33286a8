"""Eviction rules for Batch-Max: which ``p`` pairs of a full (sample, KV head) go, under Algorithm 1's schedule.

Every rule runs under the same schedule and the same ``kv_max`` pairs per (sample, KV head) as the paper; only
the ranking differs. A rule is a small frozen, validated dataclass whose ``score()`` turns one cache layer's slot
state into a priority per slot (kvpress style: ``score -> sort -> the lowest p are evicted``). Ties evict the
older pair first (``cache.slots_to_evict``); empty, evicted and pad slots always score ``-inf``.

Slot state handed to ``score``, all ``[B, H, C]`` (H: the rank's local KV heads, C: slots):

- ``attn``: the attention weight each slot received (summed over the query group and the queries since it
  was written; the paper's sum);
- ``pos``: the slot's padded-sequence position, ``-1`` for empty/evicted/pad slots;
- ``curr_id``: the last position already processed (host int);
- ``probe``: for rules with ``window > 0``, the look-ahead attention (below) of the last prefill pass, or
  ``None`` during decoding (decode evictions then rank by the rule's other terms).

Rules (``rule_names()``):

- ``paper``: the paper's average attention ``attn / (curr_id + 1 - pos)`` -- exact and the default.
- ``pooled``: average attention pooled (``max`` or ``avg``) over the kept pairs whose positions lie within
  ``kernel // 2`` of the slot's own (SnapKV's pooling; a fact's span is kept or dropped together). Neighbours
  are found in position space, never in slot order (slots are unordered); evicted positions simply are absent.
- ``sinks``: average attention, but the sample's first ``sinks`` real tokens (StreamingLLM's attention sinks)
  and the ``recent`` newest positions (``pos > curr_id - recent``) are never evicted.
- ``probe``: look-ahead probe. The whole prompt is known before prefill, so its last ``window`` tokens (the question
  and the assistant header in a chat prompt) are run as queries after every prefill block but the last
  (``schedule.Phase`` kind ``probe``, run in the block's own pass as more columns of its row): after block ``[a, b)``
  of a prompt of padded length ``s``, the prompt's tokens at padded positions ``[max(b, s - window), s)``, at their
  own RoPE positions (the sample's real position ids, as if the prompt between ``b`` and the probe were already
  evicted). Each probe query attends to every kept slot (the block just written included: all of them precede it) and
  causally to the probe tokens up to itself; pad probe tokens are neither queries nor keys. The probe's keys/values
  are never written to the cache. A slot's ``probe`` value is the attention it got from the probe queries of the last
  probe, summed over the query group and averaged over the sample's real probe queries (the same scale as average
  attention); the priority is ``average attention + weight * probe`` at prefill evictions and plain average attention
  at decode evictions. Under tensor parallelism a probe adds ``window`` columns to a pass, and no collective; eviction
  stays rank-local. ``every`` (all probe rules; default 1, ``question`` 4): a probe follows only every ``every``-th
  prefill block (the first always); the prefill evictions after an unprobed block re-score the slots held then with
  the last probe's queries and the log-sum-exp over its own keys, kept aside (``core.probe``): the same formula, fresh
  keys, about ``1 / every`` of the probe's forward cost. The probe's values and stored queries live during prefill
  only.
- ``snapkv``: ``probe`` and ``pooled`` together (SnapKV's observation window and pooling at every eviction):
  ``pool(average attention + weight * probe)``.
- ``question``: SnapKV's own ranking under Algorithm 1. Prefill evictions rank by the look-ahead attention
  alone (``probe`` above, no average-attention term), max- or avg-pooled over ``kernel`` neighbouring positions
  so a fact's whole span stays; decode evictions (no probe) rank by the pooled average attention. The sample's
  first ``sinks`` real tokens and the ``recent`` newest positions are never evicted (as in ``sinks``). The
  defaults (window 32, kernel 15, sinks 4, recent 60, and the probe on every 4th block: ``every`` 4) are the ones
  measured in the README's retention section. ``decode=probe`` (default ``attention``): decode evictions rank by the
  last probe's stored queries too, re-scored over the slots held then, pooled and protected as at prefill (issue 68:
  a prefill-wide average attention ranks the facts the question chose lowest, docs/retention.md). ``recall=tier``
  (default ``none``): the pairs the prefill evicts wait in a slower tier (``core.tier``: a file on disk on the CPU,
  host memory beside a GPU) and the eviction before the prompt's last block ranks them and the held pairs together
  by the stored probe (the question), so a fact an early probe ranked low comes back (issue 68); ``recall=window``: the
  same tier, chosen from after the last block by its own last ``window`` queries, as snap's window chooses.

Every rule takes ``share`` (default 1, the paper's per-head budget): with ``share=G`` (0: all of a layer's KV heads
on a rank) each group of G heads of a layer holds one budget of ``G x kv_max`` pairs per sample in storage sized to
it (``core.pool``), and each eviction of Algorithm 1 frees the group's ``G x p`` pairs of lowest priority whichever
head holds them (Ada-KV's allocation, decided at every prefill and decode eviction). Pooling and protection act
within each head; ties order by position, then head. E.g. ``question:share=0``.

Every rule takes ``taper`` (percent, default 0: every layer ``kv_max``): budgets across layers in PyramidKV's shape,
about ``(1 + taper/100) x kv_max`` at the first layer down to ``(1 - taper/100) x kv_max`` at the last, all of them
together the paper's ``layers x kv_max`` (``method.BatchMax.layer_capacities``), each layer evicting ``p`` when its own
budget is full (``layered.LayeredPool``). E.g. ``question:taper=50``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # tensors arrive as arguments: the rules import no torch, so config validation stays instant
    from torch import Tensor

__all__ = [
    "RULES",
    "Rule",
    "PaperRule",
    "PooledRule",
    "SinksRule",
    "ProbeRule",
    "SnapKVRule",
    "QuestionRule",
    "get_rule",
    "rule_names",
    "average_attention",
    "pool_by_position",
    "protect",
]

DECODE_RANKS = ("attention", "probe")  #: what ``question``'s decode evictions rank by
#: whether ``question`` keeps its prefill's evicted pairs in a tier, and what recalls them: the stored probe before the
#: prompt's last block (``tier``) or the last block's own window queries after it (``window``)
RECALLS = ("none", "tier", "window")
POOLS = ("max", "avg")
#: Larger than any position (slot positions are int64): what an empty slot holds when the smallest is wanted.
_NO_POSITION = 2**62
#: Positions of the heads sharing one budget are told apart as ``position + head * _HEAD_STRIDE`` (far apart).
_HEAD_STRIDE = 2**40
#: The most KV heads one budget is shared by (``slots_to_evict`` orders ties by ``position * MAX_SHARE + head``).
MAX_SHARE = 128


# ---------------------------------------------------------------------------------------------- building blocks
def average_attention(attn: Tensor, pos: Tensor, curr_id: int) -> Tensor:
    """The paper's eviction score: attention received / number of queries that could attend to the pair.

    attn: [B, H, C] float32 summed attention weights; pos: [B, H, C] padded-sequence positions, -1 for empty
    or pad slots; curr_id: the last position already processed. Returns [B, H, C], ``-inf`` for empty slots.
    """
    valid = pos >= 0
    count = (curr_id + 1 - pos).clamp(min=1).to(attn.dtype)
    return (attn / count).masked_fill(~valid, float("-inf"))


def pool_by_position(
    x: Tensor, pos: Tensor, kernel: int, pool: str, curr_id: int | Tensor, head: Tensor | None = None
) -> Tensor:
    """Pool ``x`` [B, H, C] over the valid slots whose positions are within ``kernel // 2`` of each slot's (and, in a
    budget shared by several heads, whose head ``head`` [B, H, C] is the slot's own).

    Slots are unordered and evicted positions are absent, so neighbours are found in position space: each row's
    slots are sorted by position (a row holds each position once), and a slot's neighbours within ``r = kernel //
    2`` positions lie within ``r`` places of it in that order; ``max`` takes the largest present, ``avg`` the mean
    over those present. Invalid slots stay ``-inf``. Shapes are fixed by ``x``'s and nothing is read back to the
    host (``curr_id``, an int or a tensor of each row's, is not needed: it bounds the positions only)."""
    r = kernel // 2
    valid = pos >= 0
    if r == 0:
        return x.masked_fill(~valid, float("-inf"))
    far = 1 << 62  # invalid slots sort last and are never anyone's neighbour
    key = pos if head is None else pos + head.long() * _HEAD_STRIDE  # [B, H, C]: another head's slots are far
    key = key.masked_fill(~valid, far)  # [B, H, C]
    order = key.argsort(dim=-1)  # [B, H, C]
    spos, sx = key.gather(-1, order), x.gather(-1, order)  # [B, H, C] each, by position
    B, H, C = x.shape
    padded_pos = key.new_full((B, H, C + 2 * r), far)  # [B, H, C + 2r]: r pads either side, never a neighbour
    padded_pos[..., :r] = -(far >> 1)  # before every position (and no overflow against an invalid slot's far)
    padded_pos[..., r : r + C] = spos
    padded_x = x.new_full((B, H, C + 2 * r), float("-inf"))  # the pads' values are never read (never near)
    padded_x[..., r : r + C] = sx
    if pool == "max":
        # One shifted slice per distance d (contiguous, [B, H, C] each; no [B, H, C, 2r + 1] window): positions are
        # unique and sorted in each row, so the slot d places on is a neighbour exactly when its position is within
        # r of the slot's. The max is exact whatever the order.
        pooled = sx.clone()  # d = 0: the slot itself
        for d in range(1, r + 1):
            for side, lo in ((-1, r - d), (1, r + d)):  # the slot d places before it, then d places after
                near = (padded_pos[..., lo : lo + C] - spos).mul_(side) <= r  # [B, H, C]
                pooled = pooled.maximum(padded_x[..., lo : lo + C].masked_fill(~near, float("-inf")))
    else:
        win_pos = padded_pos.unfold(-1, 2 * r + 1, 1)  # [B, H, C, 2r + 1]: each slot's r neighbours either side
        win_x = padded_x.unfold(-1, 2 * r + 1, 1)  # [B, H, C, 2r + 1]
        near = (win_pos - spos[..., None]).abs() <= r  # [B, H, C, 2r + 1]
        # Summed in float64: two slots with the same neighbours (in math an exact tie, broken by position) must get
        # the same bits whatever their window offsets, or float32 rounding would break the tie at random.
        total = win_x.masked_fill(~near, 0.0).double().sum(-1)  # [B, H, C]
        pooled = (total / near.sum(-1).clamp(min=1)).to(x.dtype)
    out = pooled.scatter(-1, order, pooled)  # back to slot order (``order`` is a permutation)
    return out.masked_fill(~valid, float("-inf"))  # [B, H, C]


def protect(priority: Tensor, pos: Tensor, curr_id: int, sinks: int, recent: int) -> Tensor:
    """``+inf`` for the first ``sinks`` real positions held and the ``recent`` newest positions (<= curr_id).

    The sample's first real token is the smallest position held: sinks are protected from the first eviction
    on (``Method`` checks ``sinks + recent <= kv_max - p``), so it is never evicted.
    """
    valid = pos >= 0
    keep = valid & (pos > curr_id - recent)  # [B, H, C]
    if sinks:
        first = pos.masked_fill(~valid, _NO_POSITION).amin(dim=-1, keepdim=True)  # [B, H, 1]
        keep |= valid & (pos < first + sinks)
    return priority.masked_fill(keep, float("inf"))


#: Lowest value of each integer parameter; a parameter means the same in every rule that has it.
_LOWEST = {"window": 1, "kernel": 1, "sinks": 0, "recent": 0, "every": 1, "share": 0, "taper": -99}
#: Highest value of the integer parameters that have one.
_HIGHEST = {"share": MAX_SHARE, "taper": 99}


def _check(rule: str, name: str, value: object) -> None:
    """One-line ValueError for a bad parameter value (every rule's parameters are checked here, by name)."""
    if name in _LOWEST:
        if isinstance(value, bool) or not isinstance(value, int) or value < _LOWEST[name]:
            raise ValueError(f"rule {rule!r}: {name} must be an integer >= {_LOWEST[name]}, got {value!r}")
        if name == "kernel" and value % 2 == 0:
            raise ValueError(f"rule {rule!r}: kernel must be odd (centred on the slot), got {value}")
        if name in _HIGHEST and value > _HIGHEST[name]:
            raise ValueError(f"rule {rule!r}: {name} must be <= {_HIGHEST[name]}, got {value}")
    elif name == "pool" and value not in POOLS:
        raise ValueError(f"rule {rule!r}: pool must be one of {', '.join(POOLS)}, got {value!r}")
    elif name == "decode" and value not in DECODE_RANKS:
        raise ValueError(f"rule {rule!r}: decode must be one of {', '.join(DECODE_RANKS)}, got {value!r}")
    elif name == "recall" and value not in RECALLS:
        raise ValueError(f"rule {rule!r}: recall must be one of {', '.join(RECALLS)}, got {value!r}")
    elif name == "weight" and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf")
    ):
        raise ValueError(f"rule {rule!r}: weight must be a finite number >= 0, got {value!r}")


# ------------------------------------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """Base of all rules: ``score(attn, pos, curr_id, probe, head) -> priority [B, H, C]`` (lower evicted first).

    ``share`` (every rule): how many of a layer's KV heads share one budget of ``share x kv_max`` pairs per slot
    (1: the paper's ``kv_max`` per head; 0: all of the layer's heads on a rank). Each eviction then frees
    ``share x p`` pairs of the group, the lowest priorities whichever head holds them, so a head whose attention is
    spread keeps more pairs than one whose attention is focused (Ada-KV's allocation, decided at every eviction of
    Algorithm 1, prefill and decoding); the priorities are compared as the rule computes them (every head's
    attention sums to one per query). ``head`` [B, H, C]: each slot's head within its group (None: unshared).

    ``taper`` (every rule; percent, -99..99, default 0: every layer ``kv_max``): budgets across layers, PyramidKV's
    shape. The first layer holds about ``(1 + taper/100) x kv_max`` slots per head, the last about ``(1 - taper/100) x
    kv_max``, linearly between, each a whole number of ``p`` from the smallest, and the layers together exactly
    ``layers x kv_max`` (``taper_steps``); a negative taper gives the later layers more. Each layer evicts ``p`` pairs
    before a block or decode step that does not fit its own budget (``method.BatchMax``)."""

    name: ClassVar[str] = ""
    #: Settings of the rule that cost less than its defaults (``key=value`` each), measured as accuracy/cost points
    #: and offered to the tuner as candidates of their own (:func:`rule_candidates`); never the default.
    cheaper: ClassVar[tuple[str, ...]] = ()
    share: int = 1
    taper: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(self.name, f.name, getattr(self, f.name))

    def score(
        self, attn: Tensor, pos: Tensor, curr_id: int, probe: Tensor | None = None, head: Tensor | None = None
    ) -> Tensor:
        raise NotImplementedError

    def group(self, kv_heads: int) -> int:
        """How many of ``kv_heads`` (a layer's KV heads on one rank) share each budget; ValueError when ``share``
        does not divide them."""
        g = kv_heads if self.share == 0 else self.share
        if kv_heads % g:
            raise ValueError(
                f"rule {self.name!r}: share={self.share} does not divide the {kv_heads} KV heads of a layer on a rank"
            )
        return g

    def lookahead(self) -> int:
        """Look-ahead probe tokens run after each prefill block but the last: the rule's ``window`` (0: none)."""
        return getattr(self, "window", 0)

    def probe_every(self) -> int:
        """A probe pass follows every ``every``-th prefill block (1: each one); the prefill evictions between re-score
        the slots with the last probed pass's stored queries (``core.probe``)."""
        return getattr(self, "every", 1)

    def probe_decodes(self) -> bool:
        """Whether decode evictions rank as the prefill's do, by the stored probe re-scored over the slots held (the
        rule's ``decode`` is ``probe``), rather than by the rule's decode ranking."""
        return getattr(self, "decode", "attention") == "probe"

    def recalls(self) -> bool:
        """Whether the pairs a prefill evicts are kept in a slower tier and ranked again with the pairs held (the
        rule's ``recall`` is ``tier`` or ``window``)."""
        return getattr(self, "recall", "none") != "none"

    def recall_window(self) -> int:
        """Under ``recall=window``: the prompt's last queries (the rule's ``window``) whose attention, after the
        prompt's last block, chooses the pairs held from the held and the tier's together; 0 otherwise."""
        return getattr(self, "window", 0) if getattr(self, "recall", "none") == "window" else 0

    def protected(self) -> int:
        """Most pairs per (sample, head) the rule never evicts, its ``sinks + recent`` (``Method`` checks it against
        kv_max - p)."""
        return getattr(self, "sinks", 0) + getattr(self, "recent", 0)

    def parameters(self) -> str:
        """Every parameter with its value, ``key=value`` separated by spaces (what ``--list-rules`` prints)."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def describe(self) -> str:
        """``name`` or ``name(k=v, ...)`` with the parameters that differ from the defaults."""
        cls = type(self)
        diff = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(cls, f.name, None)
        ]
        return f"{self.name}({', '.join(diff)})" if diff else self.name


@dataclass(frozen=True)
class PaperRule(Rule):
    """The paper's average attention (exact; the default)."""

    name: ClassVar[str] = "paper"

    def score(self, attn, pos, curr_id, probe=None, head=None):
        return average_attention(attn, pos, curr_id)


@dataclass(frozen=True)
class PooledRule(Rule):
    """Average attention pooled over neighbouring positions (``kernel`` odd, ``pool`` max or avg)."""

    name: ClassVar[str] = "pooled"
    kernel: int = 7
    pool: str = "max"

    def score(self, attn, pos, curr_id, probe=None, head=None):
        return pool_by_position(average_attention(attn, pos, curr_id), pos, self.kernel, self.pool, curr_id, head)


@dataclass(frozen=True)
class SinksRule(Rule):
    """Average attention with the first ``sinks`` real tokens (StreamingLLM's attention sinks) and the ``recent``
    newest positions protected."""

    name: ClassVar[str] = "sinks"
    sinks: int = 4
    recent: int = 32

    def score(self, attn, pos, curr_id, probe=None, head=None):
        return protect(average_attention(attn, pos, curr_id), pos, curr_id, self.sinks, self.recent)


@dataclass(frozen=True)
class ProbeRule(Rule):
    """Average attention + ``weight`` x the look-ahead attention of the prompt's last ``window`` tokens.

    Decode evictions (no probe) rank by average attention alone."""

    name: ClassVar[str] = "probe"
    window: int = 32
    every: int = 1
    weight: float = 1.0

    def score(self, attn, pos, curr_id, probe=None, head=None):
        ave = average_attention(attn, pos, curr_id)
        return ave if probe is None else ave + self.weight * probe


@dataclass(frozen=True)
class SnapKVRule(Rule):
    """SnapKV at every eviction: ``pool(average attention + weight x look-ahead attention)``."""

    name: ClassVar[str] = "snapkv"
    window: int = 32
    every: int = 1
    weight: float = 1.0
    kernel: int = 7
    pool: str = "max"

    def score(self, attn, pos, curr_id, probe=None, head=None):
        ave = average_attention(attn, pos, curr_id)
        if probe is not None:
            ave = ave + self.weight * probe
        return pool_by_position(ave, pos, self.kernel, self.pool, curr_id, head)


@dataclass(frozen=True)
class QuestionRule(Rule):
    """SnapKV's own ranking: the pooled look-ahead attention alone at prefill evictions (the paper's average
    attention, pooled, at decode evictions), with the first ``sinks`` and the ``recent`` newest positions kept; the
    probe runs after every ``every``-th prefill block (the evictions between re-score with its stored queries).
    ``decode=probe``: decode evictions rank as prefill evictions do, by the last probe's queries (the question)
    re-scored over the slots held then (a row whose prefill never probed: by the pooled average attention).
    ``recall=tier``: every pair a prefill eviction frees is kept in a slower tier (``core.tier``), and the eviction
    before the prompt's last block ranks the held pairs and the tier's together by the question's stored queries, the
    best of them held from then on (per budget of one head, every layer at ``kv_max``: ``share=1``, ``taper=0``).
    ``recall=window``: the same tier, and after the prompt's last block its last ``window`` queries (as computed in
    the run) choose, as snap's window does (``core.snap``), the pairs held from the held and the tier's together
    (the rule's ``kernel``/``pool`` pooling; as many pairs as were held)."""

    name: ClassVar[str] = "question"
    cheaper: ClassVar[tuple[str, ...]] = ("every=8", "window=16")  # docs/retention.md: ~0.95x the time at 2k
    window: int = 32
    every: int = 4
    kernel: int = 15
    pool: str = "max"
    sinks: int = 4
    recent: int = 60
    decode: str = "attention"
    recall: str = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recall != "none" and (self.share != 1 or self.taper):
            raise ValueError(
                f"rule {self.name!r}: recall={self.recall} ranks each head's own budget at kv_max: share must be 1 and "
                f"taper 0, got share={self.share} taper={self.taper}"
            )

    def score(self, attn, pos, curr_id, probe=None, head=None):
        x = average_attention(attn, pos, curr_id) if probe is None else probe.masked_fill(pos < 0, float("-inf"))
        pooled = pool_by_position(x, pos, self.kernel, self.pool, curr_id, head)
        return protect(pooled, pos, curr_id, self.sinks, self.recent)


RULES: dict[str, type] = {
    cls.name: cls for cls in (PaperRule, PooledRule, SinksRule, ProbeRule, SnapKVRule, QuestionRule)
}


def rule_names() -> list[str]:
    """The registered rule names, the paper's first."""
    return list(RULES)


def rule_candidates(spec: str) -> list[str]:
    """``spec`` first, then each of its rule's ``cheaper`` settings set on top of it (a key ``spec`` sets itself is
    left as given), each distinct rule once: what the tuner tries for a method that takes a rule."""
    rule, (base, _, params) = get_rule(spec), spec.partition(":")
    given = {item.partition("=")[0].strip() for item in params.split(",") if item.strip()}
    found, out = [rule], [spec]
    for setting in type(rule).cheaper:
        if setting.partition("=")[0] in given:
            continue
        candidate = f"{spec},{setting}" if given else f"{base.strip()}:{setting}"
        if get_rule(candidate) not in found:
            found.append(get_rule(candidate))
            out.append(candidate)
    return out


@functools.cache
def get_rule(name: str) -> Rule:
    """The rule ``name`` with its default parameters, or ``name:key=value,...`` with some set, e.g.
    ``snapkv:window=64,kernel=5``. Unknown names, keys or bad values: a one-line ValueError."""
    if not isinstance(name, str):
        raise ValueError(f"rule must be a string, got {name!r}")
    base, _, params = name.partition(":")
    base = base.strip()
    if base not in RULES:
        raise ValueError(f"unknown rule {base!r}: choose one of {', '.join(RULES)}")
    cls = RULES[base]
    types = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, object] = {}
    for item in filter(None, (x.strip() for x in params.split(","))):
        key, eq, text = (x.strip() for x in item.partition("="))
        if key not in types or not eq:
            known = ", ".join(types) or "none"
            raise ValueError(f"rule {base!r}: cannot read {item!r}; parameters are key=value with keys: {known}")
        kind = types[key] if isinstance(types[key], str) else types[key].__name__
        try:
            kwargs[key] = int(text) if kind == "int" else float(text) if kind == "float" else text
        except ValueError:
            raise ValueError(f"rule {base!r}: {key} must be {kind}, got {text!r}") from None
    return cls(**kwargs)
