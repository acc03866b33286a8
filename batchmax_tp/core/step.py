"""The per-pass description handed to the attention function: what one model call computes, stated explicitly.

The engine (``core.engine.Engine``) builds one ``RowsPass`` per model call and passes it as the model's ``batchmax=``
keyword; transformers forwards unknown keywords through the decoder layers to the attention function (every
supported family, under DeepSpeed AutoTP too, which replaces linear layers only). The attention function finds its
pool layer as ``batchmax.pool.layers[module.layer_idx]``: no thread-local state, no global, nothing set on a pool or
layer between passes. (HF's ``model.generate`` drop-in, ``core.hf_cache``, describes each of HF's forwards as such
a pass over its own pool, and its attention function hands it to the same attention.)

Describe, then execute: the host state of a pool between passes is a value (``PoolState``: each row's integers, FKV
paged's blocks) its holder keeps, the engine (or the HF drop-in's cache); a pool's ``prefill_pass``/``decode_pass``
describes a pass from the state it is handed and changes nothing (the rows' states after the pass ride in the
description, ``RowsPass.after``); the holder takes them (``PoolState.changed``, the only place the state is
replaced), the pool's ``ready`` executes the pass's storage part (the evictions and bookkeeping, every layer at once)
and the model call the rest. What changes a pool between passes (a request admitted, a prefill over, a request
ended) is described the same way, as a ``Change`` a pure function of the state returns, which the holder takes and
whose storage part (slots emptied, a shared prompt copied) the pool's ``apply`` executes.

A pass is a prefill chunk, a look-ahead probe, a compress pass (``snap``: a group's whole prompts on the model's
SDPA, each row then keeping what its window's attention chooses, ``core.snap``) or a decode step. ``SlotWork``
lists, per pool row it touches, the row and that row's own schedule phase (``core.schedule.Phase``: its tokens'
range, its eviction count, its step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from .schedule import Phase

if TYPE_CHECKING:
    import torch

    from .method import Method


@dataclass(frozen=True)
class SlotWork:
    """One pool row's part of a pass: ``row`` runs ``phase`` of its own schedule (``phases`` of them merged into
    one: a lone row's first-block chunks); ``probe``: the look-ahead probe that follows that prefill chunk in the
    schedule, run in the same pass (its queries as more columns of the row, which write nothing), or None."""

    row: int
    phase: Phase
    probe: Phase | None = None
    phases: int = 1


#: How a slot pool's decode passes run (``Engine(compile=...)``, the ``compile`` setting; ``core.replay``): ``none``
#: eager; ``default`` through ``torch.compile(..., fullgraph=True)``; ``cudagraphs`` (CUDA only) captured once as a
#: CUDA graph and replayed; ``auto``: ``cudagraphs`` on CUDA, ``none`` elsewhere (what measured fastest on each).
COMPILE_MODES = ("auto", "none", "default", "cudagraphs")


@dataclass(frozen=True)
class Eviction:
    """Rows of a pool that evict before a pass, all the same way: ``count`` slots each (their empty slots first),
    ranked at ``curr_id`` [E, 1, 1] (each row's last position processed); ``probe``: ``"fresh"`` (the look-ahead
    attention of the probe pass just run), ``"rescore"`` (the last probe's stored queries over the slots held now)
    or None (a decode eviction, or a rule without a probe); ``"recall"`` (``question:recall=tier``, before a prompt's
    last block): the stored queries over the slots held and the row's tier together, the best of them held. ``tier``
    (a rule with ``recall=tier`` or ``window``; else empty): per row, (the row, its tier's pairs a head before this
    eviction, the pairs a head its tier is made for), or None for a row whose freed pairs are not kept (a decode
    eviction)."""

    rows: torch.Tensor  # [E] pool rows
    curr_id: torch.Tensor  # [E, 1, 1]
    count: int
    probe: Literal["fresh", "rescore", "recall"] | None = None
    tier: tuple[tuple[int, int, int] | None, ...] = ()


@dataclass(frozen=True)
class Change:
    """A change of a pool's host state, described by a pure function of that state: its holder takes the state after
    it (``PoolState.changed``) and the pool's ``apply`` executes its storage part. A pass's (``RowsPass.change``), or
    one between passes: a request admitted (``admitted``: its row's state emptied, its slots too; FKV paged: its
    blocks taken), a prefill over (``graduated``: a shared prefill's row copied into its group's other rows; the
    dense pools: what each row holds now), a request ended (``finished``: FKV paged's blocks given back)."""

    after: tuple = ()  # (row, core.slots.RowState): each row's host state after the change
    reset: tuple[int, ...] = ()  # rows whose slots are emptied (storage: positions, sums, masks, free lists)
    fork: range | None = None  # row ``fork.start``'s storage copied into the other rows of ``fork``
    blocks: tuple = ()  # FKV paged's fork: (source blocks, destination blocks) per other row of ``fork``
    order: tuple[int, ...] | None = None  # the HF drop-in's beam reorder: row r's storage becomes row ``order[r]``'s
    paging: object = None  # FKV paged: the blocks' state after the change (``dense.Paging``); None: unchanged
    parts: tuple[Change, ...] = ()  # budgets across layers: each layer group's pool's change


@dataclass(frozen=True)
class PoolState:
    """A pool's host state between passes, as a value: each row's (``rows``: ``core.slots.RowState`` per slot), FKV
    paged's blocks (``paging``: ``dense.Paging``), or with budgets across layers each layer group's (``parts``). Its
    holder (the engine, the HF drop-in's cache) replaces it whole by ``changed``, from the changes a pool's pure
    functions describe; a pool holds storage only and reads the state it is handed."""

    rows: tuple = ()
    paging: object = None
    parts: tuple[PoolState, ...] = ()

    def changed(self, change: Change) -> PoolState:
        """The state after ``change`` (the rows it names replaced, FKV paged's blocks, each layer group's part)."""
        if change.parts:
            return replace(self, parts=tuple(s.changed(c) for s, c in zip(self.parts, change.parts)))
        rows = self.rows
        if change.after:
            rows = list(rows)
            for row, st in change.after:
                rows[row] = st
            rows = tuple(rows)
        return PoolState(rows, self.paging if change.paging is None else change.paging, self.parts)


@dataclass(frozen=True)
class RowsPass:
    """One pass over some rows of a slot pool, every per-pass input stated: built once per pass by the pool
    (``BoundedPool.prefill_pass``/``decode_pass``) and read by the attention; nothing is set on the pool.

    Each row feeds ``n`` columns, its real tokens right-aligned (so the last column is every row's last token):
    ``qpos`` [R, n] is each column's position (-1: a masked column, never written or scored; a padded batch's row:
    its padded position), ``positions`` [R, n] its RoPE position (the model's ``position_ids``), ``real`` [R, n]
    ``qpos >= 0`` as a mask (None when every column is real). ``write`` [R, n]: each column's index into the row's free
    list (BM; the dense pools: the slot itself; the scratch slot C for masked columns and idle rows); a probe pass
    writes nothing (None); FKV's paged pool: the position block x Bs + offset (the scratch block N for idle rows).
    ``hi``: slots [0, hi) enter the products (a budget shared by G heads: its slots [0, G x hi); FKV paged: blocks
    [0, hi)). ``active`` [R, 1, 1] (BM's decode passes over every row): 1 for the rows decoding, whose attention
    joins their slots' sums. ``bias`` [R, hi] (the dense pools' decode passes): each row's held slots; FKV paged:
    ``owner`` [hi] the row of each block and ``bias`` [hi x Hkv, 1, Bs] each block's held positions. ``causal``
    [R, n, n] (BM's prefill passes): the additive causal mask of the pass's own columns, query by key (finfo.min
    where the key's position is after the query's; 0 for masked keys), built once per pass and added at each
    layer's own slots; ``blind``: some row's queries see no slot at all (its columns all masked, nothing held), so
    the attention keeps their softmax finite. ``probe`` (BM's prefill passes of a rule with a look-ahead probe):
    the probes that follow some rows' chunks, folded into the pass. Each row's first ``w`` columns (the rule's
    window) are then its probe's queries (masked for a row that does not probe), and ``qpos``, ``real``, ``write``
    and ``causal`` describe the chunk's columns after them (``positions``: every column's); ``probe`` describes the
    probing rows' ``w`` columns (kind "probe", rows ``among`` the pass's). The attention writes the chunks' pairs,
    attends the chunks, then the probes over the slots held then: exactly the pass of its own a probe was.
    ``evictions``: BM's rows that free slots first, or ED's rows that keep only their newest pair. ``decoding``
    (decode passes): the rows that decode, in work order, for the caller
    (it arrives in the description's one host-to-device copy). ``written`` (BM's decode passes, set by the pool's
    ``ready`` once the evictions ran): where each layer's new pairs go, as indices into the layer's K/V rows
    flattened [S*Hs*(C + 1)], row by row and local KV head in order; the pool has recorded those slots' positions,
    sums and masks in every layer at once, so a layer only copies its pairs there. A chunked prefill pass (FKV, snap
    with ``chunk`` > 0; ``slots.chunk_pass``) holds each row's chunk of its prompt: its pairs written at ``write``
    (block x block size + offset) into the row's blocks ``table``, its queries over the row's slots [0, hi) under
    ``mask`` (``own``: every chunk its prompt's first, over the pass's own pairs, gathering nothing); snap's rows
    whose prompt ends in the pass (``compress``) then keep their window's choice. A mixed pass (``mixed``: FKV's
    continuous batching, vLLM's chunked prefill) runs a chunked prefill pass and a decode step in one model call: the
    model's columns [1, R x n + S] are the chunks' rows flattened, then one per pool row (the decode step's), and the
    attention runs each part on its own columns. A wide pass (``subs``: BM with ``chunk``) runs several consecutive
    blocks of its rows in one model call: the model's columns are each block's pass's (``subs``, each described as a
    pass of its own would be, from the rows' states after the one before), one after another (``positions``: all of
    them), and each layer's attention runs the blocks in order, each block's evictions in that layer first
    (``attention._wide``); ``after`` is the last block's. Under ``recall=window`` a prefill pass keeps the last queries
    of the rows whose block holds their window (``window_rows``), and its rows whose prompt ends in it (``final``)
    choose their pairs by them once the block has attended (``BoundedPool.choose_by_window``)."""

    kind: Literal["prefill", "probe", "compress", "decode", "mixed"]
    pool: object  # the storage its layers write and read (``core.bounded.BoundedPool``, ``core.dense.DensePool``, ...)
    method: Method  # what the attention reads of the method: snap's window and kernel, how often a rule probes
    share: int  # KV heads sharing one budget of slots (a rule's ``share``, as the pool's storage holds them)
    rows: torch.Tensor  # [R] pool rows, in batch order
    span: slice | None  # the same rows as a slice when they are adjacent (views instead of gathers)
    qpos: torch.Tensor  # [R, n]
    positions: torch.Tensor  # [R, n]
    real: torch.Tensor | None  # [R, n] bool
    write: torch.Tensor | None  # [R, n]
    hi: int
    evictions: tuple[Eviction, ...] = ()
    active: torch.Tensor | None = None  # [R, 1, 1] float
    bias: torch.Tensor | None = None  # [R, hi] additive mask of the dense pools' rows (0: held, -inf: not)
    decoding: torch.Tensor | None = None  # [k] a decode pass's decoding rows (whose logits the caller reads)
    owner: torch.Tensor | None = None  # [hi] FKV's paged decode passes: each block's row
    causal: torch.Tensor | None = None  # [R, n, n] float32 (BM's prefill passes): 0, or min where a key is later
    probe: RowsPass | None = None  # the look-ahead probes a prefill pass runs beside its chunks (its first columns)
    among: torch.Tensor | None = None  # a folded probe's rows among its pass's rows [Rp] (None: every row probes)
    blind: bool = False  # BM's prefill passes: some row's queries see no slot (pads alone, nothing held yet)
    written: torch.Tensor | None = None  # [L, R*Hkv] BM's decode passes: each layer's K/V index of each row's pair
    mask: torch.Tensor | None = None  # [R, 1, n, hi] chunked prefill (FKV, snap): additive, slots after each query's
    table: torch.Tensor | None = None  # [R, nb] chunked prefill: each row's K/V blocks, in order (``slots.chunk_pass``)
    compress: tuple = ()  # chunked snap: (j, prompt length, offset) of each row of the pass whose prompt ends in it
    own: bool = False  # chunked prefill: the rows hold nothing before it (keys: its own pairs; ``mask`` None: causal)
    after: tuple = ()  # (row, core.slots.RowState) per row the pass advances: its host state once the pass has run
    paging: object = None  # FKV paged's decode passes: its blocks' state once the pass has run (``dense.Paging``)
    parts: tuple[RowsPass, ...] = ()  # budgets across layers: the pass of each layer group's pool (the first's is it)
    mixed: tuple[RowsPass, RowsPass] | None = None  # a mixed pass (FKV continuous): its chunks' and its decode step's
    subs: tuple[RowsPass, ...] = ()  # a wide pass (BM ``chunk``): each block's pass of the rows, its columns in order
    # ``recall=window`` (BM's prefill passes): the rows [Rw] (indices into ``rows``) whose block holds some of their
    # prompt's last ``w`` queries, and where each of the w it keeps sits in [its kept w | the block's last m columns]
    # (m = min(n, w))
    # (``window_index`` [Rw, w]); ``final``: (index into ``rows``, pool row, tier pairs a head, first real position,
    # padded prompt length) of each row whose prompt's last block this is, whose pairs its window then chooses
    window_rows: torch.Tensor | None = None
    window_index: torch.Tensor | None = None
    final: tuple = ()

    def layer(self, module):
        return self.pool.layers[module.layer_idx - self.pool.first_layer]

    def at(self, layer_idx: int) -> RowsPass:
        """The pass as the pool of layer ``layer_idx`` describes it: this one, or with budgets across layers
        (``layered.LayeredPool``) its layer group's part (the same columns; its own writes, slots and evictions)."""
        for part in self.parts:
            if layer_idx < part.pool.first_layer + len(part.pool.layers):
                return part
        return self

    def each(self) -> tuple[RowsPass, ...]:
        """Every pool's pass: the layer groups' parts, or this one alone."""
        return self.parts or (self,)

    def for_model(self) -> RowsPass:
        """What the model call reads: the pass less its host part (the rows' new states and the evictions, which the
        pool's ``ready`` executes first) and the caller's ``decoding`` rows, so that every decode pass of a static
        pool has one shape."""
        if self.parts:
            parts = tuple(part.for_model() for part in self.parts)
            return replace(parts[0], parts=parts)
        mixed = None if self.mixed is None else tuple(part.for_model() for part in self.mixed)
        subs = tuple(replace(sub, after=()) for sub in self.subs)  # their evictions run inside each layer
        return replace(self, evictions=(), decoding=None, after=(), paging=None, mixed=mixed, subs=subs)

    def change(self) -> Change:
        """The pass's change of its pool's host state (its rows' states after it; FKV paged's blocks; with budgets
        across layers each group's)."""
        if self.parts:
            return Change(parts=tuple(part.change() for part in self.parts))
        return Change(after=self.after, paging=self.paging)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The pass's rows of a pool tensor [S, ...]: a view when they are adjacent, else a gathered copy."""
        return t[self.span] if self.span is not None else t.index_select(0, self.rows)
