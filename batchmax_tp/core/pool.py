"""A fixed pool of slots: ``slots`` cache rows allocated once, constant for the whole run; the one engine's storage.

Each slot holds one request at a time. Its prefill runs in passes with the other prefilling rows (BM: each row's
next chunk at its own position, with its own evictions, on its unpadded prompt; FKV/ED: a group of one prompt
length, one block), then the slot joins the decode passes, where every decoding slot writes its token and attends
in one pass over the pool, each at its own position and eviction step.

- ``BoundedPool`` (BM): per layer keys/values [S, H, C + 1, D], and per slot ``pos``/``score``/``bias`` and a free
  list ``free`` [S, H, C + 1] with C = ``kv_max``. Column C is a scratch slot: a masked column or a row that is not
  decoding writes its (unused) pair there, so nothing else is touched; the free lists end in C and no attention or
  eviction ever reads it. A row of the paper's padded batch (``scheduler``'s static policy) runs the batch's shared
  schedule at padded positions: its pads are counted as held (``RowState.filled``) but never written, so they go
  first at an eviction, as the padded batch's pad slots do, and its kept positions are the padded batch's.
  A rule with ``share=G`` (``core.rules``) groups a layer's local KV heads by G: each group's storage head holds
  T = G x ``kv_max`` slots, any of its heads' pairs (``head`` [S, Hs, T + 1]: each slot's head in its group), each
  written column takes G free-list entries (one per head, in order) and each eviction frees G x the count.
- ``DensePool`` (FKV, ED): per layer keys/values [S, H, C + 1, D] holding slots ``[0, length)`` of each row; C =
  ``kv_max`` for ED, the longest prompt + generation for FKV (each slot reserves a whole request, so admission
  never needs more). A prefill pass attends over its own pairs (SDPA, causal) and writes what the row keeps: FKV
  the prompt, ED its newest pair alone, into slot 0 (Algorithm 3's first eviction).

A group admitted with ``shared=True`` holds one prompt several times (the choices of a multiple-choice question,
scored from one context): its prefill runs on the first row alone and ``graduate`` copies that row into the others,
which is exact, since a slot's state after its prompt depends on the prompt only.

Per-slot state between passes is host integers (``RowState``). Each pool describes its passes from them
(``prefill_pass``, ``decode_pass``: a ``step.RowsPass``, its tensors built once per pass in one host-to-device copy,
handed to the attention) and advances them; nothing per pass is set on a pool or layer.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from . import probe as lookahead
from .method import BatchMax, ExtremeDecoding, FullCache, Method, Snap
from .rules import MAX_SHARE
from .schedule import Phase
from .step import Eviction, RowsPass, SlotWork
from .workspace import (
    decode_workspace_bytes,
    dense_impl,
    dense_workspace_bytes,
    eviction_layers,
    paged_decode_workspace_bytes,
    probe_workspace_bytes,
    rows_workspace_bytes,
    snap_workspace_bytes,
)


class KVLayout(NamedTuple):
    """The model's attention as this rank holds it (``serve.kv_layout``): what a pool is allocated from and what
    its passes' workspace is counted with. ``kv_heads``/``query_heads``: this rank's (AutoTP's share, which may differ
    between ranks); ``k_dim``/``v_dim``: a key's and a value's size."""

    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    query_heads: int


def slots_to_evict(priority: torch.Tensor, pos: torch.Tensor, n: int, head: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [B, H, n] of the ``n`` slots with the smallest ``(priority, position, head, slot)``, in that order.

    Exact priority ties evict the older pair first (in a shared budget, ``head`` [B, H, C]: at one position the
    lower head first), and empty slots (position -1) in slot order, so the result does not depend on the slot
    layout. One sort of an int64 key: the float32 priority's bits made order-preserving in the high half, the
    position (and head; empty slots: their index, below every position) in the low.
    """
    C = pos.shape[-1]
    bits = priority.float().contiguous().view(torch.int32)  # [B, H, C]
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # negative floats: reversed order fixed
    order = pos if head is None else pos * MAX_SHARE + head.long()  # [B, H, C]
    low = torch.where(pos >= 0, order + C, torch.arange(C, device=pos.device))  # [B, H, C], in [0, 2**32)
    return (bits * 2**32 + low).topk(n, dim=-1, largest=False, sorted=True).indices  # [B, H, n]


def free_slots(
    priority: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """Free the ``n`` slots of lowest ``priority`` (``slots_to_evict``) in the slot state ``pos``/``score``/``bias``
    [B, H, C] (views are written through) and return their indices [B, H, n]."""
    freed = slots_to_evict(priority, pos, n, head)  # [B, H, n]
    pos.scatter_(2, freed, -1)
    score.scatter_(2, freed, 0.0)
    bias.scatter_(2, freed, float("-inf"))
    return freed


@dataclass
class RowState:
    """One slot's host state: pairs held (``filled``), next position (``seen``), write pointer into its free list
    (``ptr``), slots ever written (``high``), whether its free list is still the identity (``contiguous``), whether
    its last pass carried its look-ahead probe (``probed``: its next prefill eviction ranks with it); the dense
    pools' ``length`` (slots [0, length) held). A padded row's ``filled`` counts its pads (Algorithm 1 on the padded
    batch)."""

    filled: int = 0
    seen: int = 0
    ptr: int = 0
    high: int = 0
    contiguous: bool = True
    probed: bool = False
    length: int = 0
    offset: int = 0  # a padded row's left pads: its positions are the padded batch's, its RoPE positions offset less

    def copy(self) -> RowState:
        """A copy to advance in a pass's description (every decode pass copies its rows' states: 0.4 us a row,
        ``dataclasses.replace`` 1.4, this CPU, 2026-11-28)."""
        new = object.__new__(RowState)
        new.__dict__.update(self.__dict__)
        return new


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Pool:
    """What every pool shares: rows, peaks, the shared prefill's fork."""

    stacked_kv = False  # K/V stacked over the layers too (ED's eviction reads every layer's newest pair)
    num_blocks = 0  # K/V blocks shared by the rows (FKV paged; 0: each row holds its own slots)
    share = 1  # KV heads sharing one budget of slots (BM under a rule's ``share``; set once by ``allocate``)
    first_layer = 0  # the model's layer its first layer is (a layer group of ``LayeredPool``: its first)

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, layer_class, static: bool):
        self.layers = [layer_class(self, i) for i in range(num_layers)]
        self.method, self.slots, self.capacity = method, slots, capacity
        # static: every decode pass attends over all C slots (one shape for the whole run: compiled or captured
        # once); else over the slots written so far
        self.static = static
        self.stacks: dict[str, torch.Tensor] = {}
        self.rows = [RowState() for _ in range(slots)]
        self.peak_kv_bytes = self.peak_meta_bytes = self.peak_workspace_bytes = 0
        self.layout: KVLayout | None = None  # the model's attention shapes on this rank (``allocate``)
        self.dense_impl = None  # how a prompt runs on SDPA here (``workspace.dense_impl``; ``allocate``)

    def allocate(self, layout: KVLayout) -> None:
        """Allocate the pool, once, before its first pass, from the model's local shapes (``KVLayout``). What an
        eviction reads is stacked over the layers [L, S, ...] (``stacks``: one call frees slots in every layer), each
        layer holding its views [S, ...]: BM's slot state, ED's few slots of K/V. BM's and FKV's K/V are one tensor
        per layer: a compiled pass writes those in place only when they are not views into a larger buffer (inductor
        copied each layer's whole K/V every pass otherwise, 138 against 100 ms a BM pass on the CPU)."""
        if self.allocated:
            return
        kv_heads, k_dim, v_dim, dtype, device, q_heads = layout
        self.layout = layout
        self.dense_impl = dense_impl(q_heads, kv_heads, dtype.itemsize, torch.device(device))
        H, C1 = self.storage(kv_heads)
        L = len(self.layers)
        kv = {"keys": (L, *self.kv_dims(H, C1), k_dim), "values": (L, *self.kv_dims(H, C1), v_dim)}
        stacked = self.stacked_kv
        self.stacks = {
            **({name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in kv.items()} if stacked else {}),
            **self.meta_stacks(L, H, dtype, device),
        }
        for i, layer in enumerate(self.layers):
            own = {} if stacked else {n: torch.zeros(shape[1:], dtype=dtype, device=device) for n, shape in kv.items()}
            layer.bind_storage({**own, **{name: t[i] for name, t in self.stacks.items()}}, dtype, device)
        self.note()

    def storage(self, kv_heads: int) -> tuple[int, int]:
        """(heads, slots) of a row's storage per layer for the model's ``kv_heads`` local KV heads: one row of
        ``capacity`` slots + the scratch slot per head."""
        return kv_heads, self.capacity + 1

    def kv_dims(self, heads: int, slots: int) -> tuple[int, ...]:
        """One layer's K/V dimensions before the head dimension: a row per slot of the pool, each of ``slots``
        slots per head."""
        return (self.slots, heads, slots)

    def meta_stacks(self, L: int, H: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The pool's per-slot bookkeeping, stacked over the layers (none for the dense pools)."""
        return {}

    def reserve(self, row: int, prompt_len: int, max_new_tokens: int) -> None:
        """Row ``row``'s request, just admitted, holds what its prompt and generation need (FKV paged: its blocks)."""

    def finish(self, row: int) -> None:
        """Row ``row``'s request has ended (its slot is free until the next ``admit``)."""

    @property
    def allocated(self) -> bool:
        return self.layers[0].is_initialized

    def kv_bytes(self) -> int:
        return sum(_bytes(layer.keys, layer.values) for layer in self.layers)

    def meta_bytes(self) -> int:
        return 0

    def note(self) -> None:
        """Record the peaks now (K/V, bookkeeping)."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        self.peak_meta_bytes = max(self.peak_meta_bytes, self.meta_bytes())

    def note_workspace(self, nbytes: int) -> None:
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, nbytes)

    def release(self) -> None:
        """Drop every buffer (the run is over): the layers refer to their pool, so without this the memory would
        wait for a garbage collection."""
        self.stacks = {}
        self.layers.clear()

    def pass_workspace(self, step: RowsPass) -> int:
        """The most one attention call of ``step`` allocates (``core.workspace``; each layer's call the same),
        counted on the host from the description: here a decode pass's fused product (``attention.decode_attention``);
        the pools' other passes in theirs."""
        keys = self.layers[0].keys  # [S, Hs, T + 1, D]
        H, D, G = keys.shape[1], keys.shape[-1], self.share
        return decode_workspace_bytes(
            step.qpos.shape[0], self.layout.query_heads, H, step.hi * G, D, keys.element_size(), G
        )

    def _decode_pass(
        self,
        work: tuple[SlotWork, ...],
        write: list[int],
        seen: list[int],
        hi: int,
        evicting: list,
        device,
        lengths: list[int] | None = None,
        blocks: tuple[list[int], list[int]] | None = None,
        after: dict[int, RowState] | None = None,
    ) -> RowsPass:
        """A decode pass over every row from per-row host lists (one host-to-device copy): ``write`` (BM: the index
        into the row's free list; the dense pools: the slot), ``seen`` (the position fed; -1 for idle rows) and, for
        the dense pools, ``lengths`` (the slots each row holds after the pass: the additive mask of its row); the
        decoding rows of ``work`` and each row's RoPE position ride in the same copy, and FKV paged's ``blocks``:
        (owner, filled positions) of each of the first ``hi`` blocks; ``after``: the decoding rows' states after the
        pass."""
        S, k = self.slots, len(work)
        decoding = [w.row for w in work] + [-1] * (S - k)
        rope = [max(0, p - st.offset) for p, st in zip(seen, self.rows)]  # (an offset never changes in a pass)
        lists = [write, seen, decoding, rope, *([lengths] if lengths is not None else [])]
        flat = to_device([x for values in [*lists, *(blocks or ())] for x in values], device)  # one copy
        packed = flat[: len(lists) * S].view(len(lists), S)
        qpos = packed[1].view(S, 1)  # [S, 1]; -1 for idle rows
        bias = active = None
        owner = None
        if blocks is not None:  # FKV paged: each block's row, and [hi x H, 1, Bs] its held positions
            owner, fill = flat[len(lists) * S :].view(2, hi)
            H, Bs = self.layers[0].keys.shape[1], self.layers[0].keys.shape[2]
            empty = (torch.arange(Bs, device=device) >= fill[:, None]).view(hi, 1, 1, Bs)
            bias = torch.zeros(hi, H, 1, Bs, dtype=self.layers[0].dtype, device=device)
            bias = bias.masked_fill_(empty, float("-inf")).view(hi * H, 1, Bs)
        elif lengths is not None:  # [S, hi]: 0 for each row's held slots, -inf after
            bias = torch.zeros(S, hi, dtype=self.layers[0].dtype, device=device)
            bias.masked_fill_(torch.arange(hi, device=device) >= packed[4][:, None], float("-inf"))
        else:  # [S, 1, 1] (BM): the rows whose attention joins their slots' sums
            active = (qpos >= 0).to(torch.float32).view(S, 1, 1)
        return RowsPass(
            kind="decode",
            pool=self,
            rows=torch.arange(S, device=device),
            span=slice(0, S),
            qpos=qpos,
            positions=packed[3].view(S, 1),
            real=None,
            write=packed[0].view(S, 1),
            hi=hi,
            evictions=_evictions(evicting, device),
            active=active,
            bias=bias,
            decoding=packed[2, :k],
            owner=owner,
            after=tuple((after or {}).items()),
        )

    def ready(self, step: RowsPass) -> RowsPass:
        """Execute a described pass's host part: its rows' new states (``RowsPass.after``), then its evictions (every
        layer at once), and note the workspace its attention calls will take (``pass_workspace``: counted here, on
        the host, so the attention notes nothing); returns what the model call reads (``RowsPass.for_model``)."""
        for row, st in step.after:
            self.rows[row] = st
        for eviction in step.evictions:
            self.evict(eviction)
        self.note_workspace(self.pass_workspace(step))
        return step.for_model()

    def fork(self, rows: range) -> None:
        """Copy row ``rows.start`` (a shared prefill's result) into the other rows of ``rows``, in every layer."""
        for layer in self.layers:
            for t in layer.row_tensors():
                t[rows.start + 1 : rows.stop] = t[rows.start : rows.start + 1]


class _PoolLayer:
    """One decoder layer of a pool: keys/values [S, H, C + 1, D] (and what an eviction reads: views of the pool's
    stacks, ``_Pool.allocate``). Storage only: the attention writes and reads it as each pass's description says."""

    def __init__(self, cache: _Pool, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx
        self.keys = self.values = None
        self.is_initialized = False

    def bind_storage(self, views: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        for name, view in views.items():
            setattr(self, name, view)
        self.dtype, self.device, self.is_initialized = dtype, device, True

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor with one row per slot (what ``_Pool.fork`` copies)."""
        return self.keys, self.values


# -- Batch-Max ------------------------------------------------------------------------------------------------------
class PoolLayer(_PoolLayer):
    """One decoder layer of the BM pool: keys/values [S, H, C + 1, D]; pos, score, bias, free [S, H, C + 1]; for a
    rule with a look-ahead probe, ``probe`` [S, H, C + 1] and (a rule probing every few blocks) the last probe's
    stored queries of every row (``probe_q``, ``probe_lse``, ``probe_w``), allocated by the pool before the first probe
    pass (``BoundedPool.ready``)."""

    def __init__(self, cache: BoundedPool, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.pos = self.score = self.bias = self.free = self.probe = self.head = None
        self.probe_q = self.probe_lse = self.probe_w = None

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        stored = (self.probe, self.head, self.probe_q, self.probe_lse, self.probe_w)
        return (
            self.keys,
            self.values,
            self.pos,
            self.score,
            self.bias,
            self.free,
            *(t for t in stored if t is not None),
        )

    def reset_row(self, row: int) -> None:
        self.pos[row] = -1
        self.score[row] = 0.0
        self.bias[row] = float("-inf")
        self.free[row] = torch.arange(self.free.shape[-1], device=self.device)

    def meta_tensors(self) -> tuple[torch.Tensor | None, ...]:
        stored = (self.probe, self.head, self.probe_q, self.probe_lse, self.probe_w)
        return self.pos, self.score, self.bias, self.free, *stored

    def other_heads(self, take) -> torch.Tensor | None:
        """In a shared budget (``share`` G > 1): which slots each query head's group must not see, bool [R, Hs, G,
        T + 1] (True: the slot holds another head's pair) of the pass's rows (``take``: ``RowsPass.take``); else
        None."""
        G = self.cache.share
        if G == 1:
            return None
        own = torch.arange(G, dtype=self.head.dtype, device=self.device)[:, None]  # [G, 1]
        return take(self.head)[:, :, None, :] != own  # [R, Hs, G, T + 1]

    # -- a pass's writes: the new pairs (evictions: ``BoundedPool.evict``, before the pass) ----------------------
    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor | None:
        """Write each row's columns [R, H, n, D] at the slots its free list gives (masked columns: the scratch slot).
        In a shared budget (G heads per storage head, T = G x C slots) column j's pairs take the free-list entries
        [G j, G j + G), one per head in order, and each slot records its head. Returns the slots written
        [R, Hs, n*G] (column j's head k at j*G + k); a decode pass whose slots the pool recorded for every layer at
        once (``step.written``, ``BoundedPool.ready``) copies the pairs alone and returns None."""
        if step.written is not None:  # [S, H, 1, D] -> [S*H, D]: row by row, heads in order (storage head, own head)
            flat = step.written[self.layer_idx]  # [S*H]
            self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, key_states.reshape(-1, key_states.shape[-1]))
            self.values.view(-1, self.values.shape[-1]).index_copy_(
                0, flat, value_states.reshape(-1, value_states.shape[-1])
            )
            return None
        R, H, n, _ = key_states.shape
        G, C, T1 = self.cache.share, self.cache.capacity, self.keys.shape[2]
        Hs = H // G
        index, qpos = step.write, step.qpos  # [R, n] each
        if G > 1:  # the pairs of (column, head) in free-list order: [R, H, n, D] -> [R, Hs, n*G, D], [R, n*G]
            key_states, value_states = (
                t.view(R, Hs, G, n, t.shape[-1]).transpose(2, 3).reshape(R, Hs, n * G, t.shape[-1])
                for t in (key_states, value_states)
            )
            own = torch.arange(G, device=self.device)  # column j's G entries; masked columns at the scratch slot T
            index = torch.where(index[..., None] == C, T1 - 1, index[..., None] * G + own).view(R, n * G)
            qpos = qpos.repeat_interleave(G, dim=1)
        slots = step.take(self.free).gather(2, index[:, None, :].expand(R, Hs, n * G))  # [R, Hs, n*G]
        heads = torch.arange(Hs, device=self.device)[None, :, None]  # [1, Hs, 1]
        flat = ((step.rows[:, None, None] * Hs + heads) * T1 + slots).view(-1)  # [R*Hs*n*G] into the flattened rows
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, key_states.reshape(-1, key_states.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(
            0, flat, value_states.reshape(-1, value_states.shape[-1])
        )
        qpos = qpos[:, None, :].expand(R, Hs, n * G)  # [R, Hs, n*G]
        if G > 1:
            heads = own.to(self.head.dtype).repeat(n)  # [n*G]: each entry's head
            self.head.view(-1).index_copy_(0, flat, heads.expand(R, Hs, n * G).reshape(-1))
        self.pos.view(-1).index_copy_(0, flat, qpos.reshape(-1))
        self.score.view(-1).index_fill_(0, flat, 0.0)
        bias = torch.zeros(qpos.shape, dtype=self.bias.dtype, device=self.device).masked_fill_(qpos < 0, float("-inf"))
        self.bias.view(-1).index_copy_(0, flat, bias.view(-1))
        return slots

    def keep(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor, kept: torch.Tensor, sums):
        """A compress pass's choice (``snap``): of each row's prompt pairs [R, H, s, D] the columns ``kept``
        [R, H, K] (ascending) go to slots [0, K), with their positions and attention sums ``sums`` [R, H, K]; the
        rows' other slots stay empty, as ``BoundedPool.admit`` left them."""
        R, H, K = kept.shape
        at = kept[..., None].expand(R, H, K, key_states.shape[-1])  # [R, H, K, D]
        self.keys[:, :, :K].index_copy_(0, step.rows, key_states.gather(2, at))
        self.values[:, :, :K].index_copy_(0, step.rows, value_states.gather(2, at))
        self.pos[:, :, :K].index_copy_(0, step.rows, step.qpos[:, None, :].expand(R, H, -1).gather(2, kept))
        self.score[:, :, :K].index_copy_(0, step.rows, sums)
        self.bias[:, :, :K].index_fill_(0, step.rows, 0.0)

    def store_probe(self, rows: torch.Tensor, q: torch.Tensor, own_lse: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep the rows' probe queries [R, Hs, G*g*w, D], log-sum-exp [R, Hs, G*g*w, 1] and weights [R, w] for
        re-scoring (``probe.ProbeState``) in the layer's store (``BoundedPool.ready`` allocates it before the first
        probe pass)."""
        for dst, src in ((self.probe_q, q), (self.probe_lse, own_lse), (self.probe_w, weights)):
            dst.index_copy_(0, rows, src)


class BoundedPool(_Pool):
    """BM's pool: ``slots`` rows of ``kv_max`` slots (+ the scratch column) per layer and local KV head. A row's
    prefill chunks run in passes with other rows' chunks (each row at its own position, its own evictions), then
    its decode steps in passes over the whole pool; ``prefill_pass``/``decode_pass`` describe each pass
    (``step.RowsPass``) from the rows' host state (``RowState``), which they advance."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, static: bool = False):
        super().__init__(method, num_layers, slots, capacity, PoolLayer, static)

    @property
    def free_dtype(self) -> torch.dtype:
        return torch.long if self.share == 1 else torch.int32

    def storage(self, kv_heads: int) -> tuple[int, int]:
        """A rule sharing budgets among G heads (``Method.group``): per layer and row, each group of G local KV heads
        stores T = G x ``kv_max`` slots (+ the scratch slot) that any of its heads may hold."""
        self.share = self.method.group(kv_heads)
        return kv_heads // self.share, self.share * self.capacity + 1

    def meta_stacks(self, L: int, H: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """pos (-1: empty), score, bias (-inf: empty), the free lists (identity, ending in the scratch slot T) and,
        for a rule with a look-ahead probe, probe; in a shared budget each slot's head (int8): each [L, S, Hs,
        T + 1] (Hs = H, T = C unless shared)."""
        shape = (L, self.slots, H, self.share * self.capacity + 1)
        stacks = {
            "pos": torch.full(shape, -1, dtype=torch.long, device=device),
            "score": torch.zeros(shape, dtype=torch.float32, device=device),
            "bias": torch.full(shape, float("-inf"), dtype=dtype, device=device),
            # slot indices; a shared budget stores them as int32 (its head tags' byte and more comes back)
            "free": torch.arange(shape[-1], dtype=self.free_dtype, device=device).repeat(*shape[:-1], 1),
        }
        if self.method.lookahead:
            stacks["probe"] = torch.zeros(shape, dtype=torch.float32, device=device)
        if self.share > 1:
            stacks["head"] = torch.zeros(shape, dtype=torch.int8, device=device)
        return stacks

    def meta_bytes(self) -> int:
        return sum(_bytes(*layer.meta_tensors()) for layer in self.layers)

    def pass_workspace(self, step: RowsPass) -> int:
        """A prefill pass's chunks (``attention._rows_block``: gathered first when the rows are not adjacent) or, when
        it carries look-ahead probes, the larger of that and theirs; a probe pass's (``attention._rows_probe``); a
        decode pass's fused product (``_Pool``)."""
        if step.kind == "decode":
            return super().pass_workspace(step)
        keys = self.layers[0].keys  # [S, Hs, T + 1, D]
        Hs, D, e, G, Hq = keys.shape[1], keys.shape[-1], keys.element_size(), self.share, self.layout.query_heads
        (R, n), hi = step.qpos.shape, step.hi * G  # a probe pass: n is the rule's window
        if step.kind == "probe":
            return probe_workspace_bytes(R, Hq, Hs, n, hi, D, e, G)
        gathered = 0 if step.span is not None else R * Hs * hi * (2 * D * e + 4 + e)
        ws = gathered + rows_workspace_bytes(R, Hq, Hs, n, hi, D, padded=step.real is not None, elem=e, share=G)
        return ws if step.probe is None else max(ws, self.pass_workspace(step.probe))

    def _allocate_probe_store(self) -> None:
        """Every layer's and row's stored probe (a rule probing every few blocks re-scores with it), allocated on the
        host before the first probe pass: scaled queries [L, S, Hs, Hq/Hs*w, D] (model dtype), their log-sum-exp
        [L, S, Hs, Hq/Hs*w, 1] and query weights [L, S, w] (float32); each layer holds its views."""
        keys = self.layers[0].keys  # [S, Hs, T + 1, D]
        L, S, Hs, D, w = len(self.layers), self.slots, keys.shape[1], keys.shape[-1], self.method.lookahead
        rows = self.layout.query_heads // Hs * w  # each storage head's query rows (G*g, w)
        kw = dict(dtype=torch.float32, device=keys.device)
        store = {
            "probe_q": torch.zeros(L, S, Hs, rows, D, dtype=keys.dtype, device=keys.device),
            "probe_lse": torch.zeros(L, S, Hs, rows, 1, **kw),
            "probe_w": torch.zeros(L, S, w, **kw),
        }
        self.stacks.update(store)
        for i, layer in enumerate(self.layers):
            for name, t in store.items():
                setattr(layer, name, t[i])

    def evict(self, ev: Eviction) -> None:
        """Free ``ev.count`` slots in each of the rows ``ev.rows``, in as many layers at once as
        ``workspace.EVICT_CHUNK_BYTES`` allows (usually all: ``cache.free_slots`` on their slot state gathered from
        the stacks, [n*E, H, C]), and make the freed slots the head of each row's free list. A "rescore" eviction
        first ranks each layer's slots with that layer's stored probe queries."""
        bias = self.stacks["bias"]  # [L, S, Hs, T + 1]
        L, E, H, T = bias.shape[0], ev.rows.numel(), bias.shape[2], bias.shape[3] - 1
        step = eviction_layers(L, E, H, T, bias.element_size(), self.share)
        for first in range(0, L, step):
            self._evict_layers(ev, slice(first, min(first + step, L)))

    def _evict_layers(self, ev: Eviction, layers: slice) -> None:
        e, T, G = ev.rows, self.share * self.capacity, self.share
        names = ("pos", "score", "bias") + (("head",) if G > 1 else ())
        state = {n: self.stacks[n][layers, ..., :T] for n in names}  # [n, S, Hs, T] views
        pos, score, bias, *head = (t.index_select(1, e).flatten(0, 1) for t in state.values())  # [n*E, Hs, T]
        head = head[0] if head else None
        n = state["pos"].shape[0]
        probe = None  # [n*E, Hs, T]
        if ev.probe == "fresh":
            probe = self.stacks["probe"][layers, ..., :T].index_select(1, e).flatten(0, 1)
        elif ev.probe == "rescore":  # each layer's last probe pass's queries, over the slots it holds now
            probe = torch.cat([self._rescored(lay, e, p) for lay, p in zip(self.layers[layers], pos.chunk(n))])
        priority = self.method.priority(score, pos, ev.curr_id.repeat(n, 1, 1), probe, head)  # [n*E, Hs, T]
        freed = free_slots(priority, pos, score, bias, ev.count * G, head)  # [n*E, Hs, G*count]
        for name, src in zip(("pos", "score", "bias"), (pos, score, bias)):
            state[name].index_copy_(1, e, src.unflatten(0, (n, -1)))
        free = self.stacks["free"]
        free[layers, ..., : ev.count * G].index_copy_(1, e, freed.unflatten(0, (n, -1)).to(free.dtype))

    def _rescored(self, layer: PoolLayer, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s look-ahead attention [E, Hs, T] over the slots ``pos`` [E, Hs, T] of ``rows``, from the
        queries its last probe pass stored."""
        state = lookahead.ProbeState(
            *(t.index_select(0, rows) for t in (layer.probe_q, layer.probe_lse, layer.probe_w))
        )
        T = pos.shape[-1]
        other = layer.other_heads(lambda t: t.index_select(0, rows))  # [E, Hs, G, T + 1] or None
        keys = layer.keys[:, :, :T].index_select(0, rows)
        return lookahead.rescore(state, keys, pos, None if other is None else other[..., :T])

    def admit(self, rows: range, offsets: list[int]) -> None:
        """Requests enter the slots ``rows``: their slots are emptied; ``offsets``: each one's left pads (0 but for
        the rows of a padded batch)."""
        for row, offset in zip(rows, offsets):
            if self.allocated:
                for layer in self.layers:
                    layer.reset_row(row)
            self.rows[row] = RowState(offset=offset)

    def graduate(self, rows: range, decodes: list[bool]) -> None:
        """A group's prefill is over; a shared group's ran on its first row alone (the others have seen nothing),
        which then becomes every row of the group (snap's groups of one length ran every row: nothing to copy)."""
        if len(rows) > 1 and self.rows[rows.start + 1].seen == 0:
            self.fork(rows)
            for row in rows[1:]:
                self.rows[row] = RowState(**vars(self.rows[rows.start]))
        self.note()

    def evicts(self, st: RowState, phase: Phase) -> int:
        """Pairs a row in state ``st`` evicts before ``phase``: the schedule's count (``Phase.evict``)."""
        return phase.evict

    def _evict_row(self, row: int, st: RowState, evict: int, prefill: bool) -> tuple[int, int, int, str | None]:
        """A row's eviction of ``evict`` pairs (count: its empty slots too), its state ``st`` (the pass's copy)
        advanced."""
        C = self.capacity
        probe = None
        if prefill and self.method.lookahead:
            probe = "fresh" if st.probed or self.method.probe_every == 1 else "rescore"
        count = C - st.filled + evict
        st.filled -= evict
        st.ptr, st.contiguous, st.high = 0, False, C
        return row, count, st.seen - 1, probe

    def prefill_pass(
        self, work: tuple[SlotWork, ...], prompts: list[torch.Tensor] | None, device
    ) -> tuple[RowsPass, torch.Tensor | None]:
        """The pass of ``work`` (each row's prefill chunk, and the look-ahead probes some chunks take along) and its
        input ids [R, w + n]: a probe's columns first (the rule's window ``w``, when some row probes; masked for a
        row that does not), then the chunk's; each part's real tokens right-aligned, masked columns in front (a
        padded row's pads among them: counted as held, never written). ``prompts`` None (the HF drop-in, whose
        caller feeds the ids): the pass alone."""
        n = max(w.phase.size for w in work)
        window = self.method.lookahead if any(w.probe is not None for w in work) else 0
        rows = [w.row for w in work]
        qpos, rope, write, evicting, ids, among, probe_qpos, probe_rope = [], [], [], [], [], [], [], []
        blind = False  # a row whose pass is pads alone and that holds nothing yet: its queries see no slot
        after = {w.row: self.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for j, w in enumerate(work):
            ph, st, prompt = w.phase, after[w.row], None if prompts is None else prompts[j]
            q, r, i = _columns(ph, st, prompt, n)
            blind |= q[-1] < 0 and st.high == 0  # (real tokens are right-aligned)
            if window:
                pq, pr, pi = _columns(w.probe, st, prompt, window) if w.probe else ([-1] * window, [0] * window, None)
                if w.probe:
                    among.append(j)
                    probe_qpos.append(pq)
                    probe_rope.append(pr)
                r, i = pr + r, torch.cat([pi if pi is not None else i.new_zeros(window), i])
            qpos.append(q)
            rope.append(r)
            ids.append(i)
            if evict := self.evicts(st, ph):
                evicting.append(self._evict_row(w.row, st, evict, prefill=True))
            real = sum(x >= 0 for x in q)
            write.append([self.capacity] * (n - real) + list(range(st.ptr, st.ptr + real)))
            st.ptr, st.filled, st.seen = st.ptr + real, st.filled + ph.size, ph.end
            st.probed = w.probe is not None  # its next eviction ranks with this probe
            if st.contiguous:
                st.high = max(st.high, st.ptr)
        R, hi = len(rows), max(1, *(after[r].high for r in rows))  # at least one slot: a pass of pads alone
        flat = [x for part in (qpos, rope, write, probe_qpos, probe_rope) for row in part for x in row]
        columns = to_device(flat, device)  # one host-to-device copy, split below
        sizes = [R * n, R * (window + n), R * n, len(among) * window, len(among) * window]
        qpos_t, rope_t, write_t, probe_t, probe_rope_t = columns.split(sizes)
        qpos_t = qpos_t.view(R, n)
        later = (qpos_t[:, None, :] > qpos_t[:, :, None]) & (qpos_t[:, None, :] >= 0)  # [R, n, n]: keys after queries
        step = RowsPass(
            kind="prefill",
            pool=self,
            rows=to_device(rows, device),
            span=_span(rows),
            qpos=qpos_t,
            positions=rope_t.view(R, window + n),
            real=None if all(q[0] >= 0 for q in qpos) else qpos_t >= 0,
            write=write_t.view(R, n),
            hi=hi,
            evictions=_evictions(evicting, device),
            causal=torch.zeros(later.shape, device=device).masked_fill_(later, torch.finfo(torch.float32).min),
            blind=blind,
            after=tuple(after.items()),
        )
        if among:  # the probes folded into the pass: the probing rows' first ``window`` columns
            probe_t = probe_t.view(len(among), window)
            probing = [rows[j] for j in among]
            probe = RowsPass(
                kind="probe",
                pool=self,
                rows=to_device(probing, device),
                span=_span(probing),
                qpos=probe_t,
                positions=probe_rope_t.view(len(among), window),
                real=None if all(q[0] >= 0 for q in probe_qpos) else probe_t >= 0,
                write=None,
                hi=hi,
            )
            step = replace(step, probe=probe, among=None if len(among) == R else to_device(among, device))
        return step, None if prompts is None else torch.stack(ids)

    def decode_pass(self, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: each decoding row's eviction (its own step's count) and write slot."""
        S, C = self.slots, self.capacity
        ptr, seen, evicting = [C] * S, [-1] * S, []
        after = {w.row: self.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for w in work:
            st = after[w.row]
            if evict := self.evicts(st, w.phase):  # Algorithm 1: p pairs (and the empty slots) go before a step
                evicting.append(self._evict_row(w.row, st, evict, prefill=False))  # that does not fit
            ptr[w.row], seen[w.row] = st.ptr, st.seen
            if st.contiguous:
                st.high = max(st.high, st.ptr + 1)
            st.ptr, st.filled, st.seen = st.ptr + 1, st.filled + 1, st.seen + 1
        hi = C if self.static else max(after[w.row].high for w in work)
        return self._decode_pass(work, ptr, seen, hi, evicting, device, after=after)

    def ready(self, step: RowsPass) -> RowsPass:
        """Run a described pass's evictions (every layer at once); a decode pass then records each row's new slot in
        every layer at once (the head of its free list, as ``PoolLayer.write`` takes it): its position, a zero sum,
        an open mask (and in a shared budget its head), and hands the model call where each layer's pairs go
        (``RowsPass.written``), so that inside the model call a layer only copies its pairs. The first pass that
        probes, under a rule probing every few blocks, allocates the stored probes first."""
        if step.probe is not None and self.method.probe_every > 1 and self.layers[0].probe_q is None:
            self._allocate_probe_store()
        model_step = super().ready(step)
        if step.kind != "decode":
            return model_step
        free = self.stacks["free"]  # [L, S, Hs, T + 1]
        L, S, Hs, T1 = free.shape
        G, C, device = self.share, self.capacity, free.device
        index, qpos = step.write, step.qpos  # [S, 1] each
        own = torch.arange(G, device=device)  # [G]: a pair per head of the group, in order
        if G > 1:  # [S, G]: the free-list entries [G j, G j + G) of the row's pairs; idle rows the scratch slot
            index, qpos = torch.where(index == C, T1 - 1, index * G + own), qpos.expand(S, G)
        slots = free.gather(3, index[None, :, None, :].expand(L, S, Hs, G))  # [L, S, Hs, G]
        rows = step.rows.view(1, S, 1, 1) * Hs + torch.arange(Hs, device=device).view(1, 1, Hs, 1)  # [1, S, Hs, 1]
        written = (rows * T1 + slots).view(L, S * Hs * G)  # [L, S*H] within each layer's K/V
        stacked = (written + torch.arange(L, device=device)[:, None] * (S * Hs * T1)).view(-1)  # [L*S*H] in the stacks
        qpos = qpos[None, :, None, :].expand(L, S, Hs, G).reshape(-1)  # [L*S*H]
        self.stacks["pos"].view(-1).index_copy_(0, stacked, qpos)
        self.stacks["score"].view(-1).index_fill_(0, stacked, 0.0)
        bias = self.stacks["bias"]
        bias.view(-1).index_copy_(
            0, stacked, torch.zeros_like(qpos, dtype=bias.dtype).masked_fill_(qpos < 0, -math.inf)
        )
        if G > 1:
            head = self.stacks["head"]
            head.view(-1).index_copy_(0, stacked, own.to(head.dtype).repeat(L * S * Hs))
        return replace(model_step, written=written)

    def kept_positions(self, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the sorted positions row ``row`` holds (host copy; for tests)."""
        T, G = self.share * self.capacity, self.share
        out = []
        for layer in self.layers:
            pos = layer.pos[row, :, :T].cpu()  # [Hs, T]
            head = layer.head[row, :, :T].cpu() if G > 1 else torch.zeros_like(pos)
            out.append(
                [
                    sorted(p for p, h in zip(pos[hs].tolist(), head[hs].tolist()) if p >= 0 and h == k)
                    for hs in range(pos.shape[0])
                    for k in range(G)
                ]
            )
        return out


class SnapPool(BoundedPool):
    """``snap``'s pool: BM's bounded rows (``kv_max`` slots per head, the paper's decode-time eviction), filled by a
    compress pass per group of one prompt length (``core.snap``): the prompt runs on the model's SDPA, as FKV's, and
    each row keeps what the window's attention chooses."""

    def prefill_pass(
        self, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """One group's prompts (one length s: a single block) and their ids [R, s]; each row then holds
        min(s, ``kv_max``) pairs in slots [0, K) (a padded batch's rows: at their padded positions, no pad held)."""
        step, ids = _group_pass(self, work, prompts, device, "compress")
        kept = min(step.hi, self.capacity)
        for _, st in step.after:
            st.filled, st.ptr, st.high = kept, kept, kept
        return step, ids

    def pass_workspace(self, step: RowsPass) -> int:
        """A compress pass: the larger of the prompts' SDPA (``_prompt_workspace``) and the window's choice
        (``attention._compress``); a decode pass as BM's."""
        if step.kind != "compress":
            return super().pass_workspace(step)
        (R, s), lay, m = step.qpos.shape, self.layout, self.method
        choice = snap_workspace_bytes(
            R, lay.query_heads, lay.kv_heads, lay.k_dim, s, m.window, min(s, m.kv_max), lay.dtype.itemsize
        )
        return max(_prompt_workspace(self, R, s), choice)


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

    def admit(self, rows: range, offsets: list[int]) -> None:
        for part in self.parts:
            part.admit(rows, offsets)

    def reserve(self, row: int, prompt_len: int, max_new_tokens: int) -> None:
        """Nothing to reserve: every row holds its own slots."""

    def finish(self, row: int) -> None:
        """Nothing to free: every row holds its own slots."""

    def graduate(self, rows: range, decodes: list[bool]) -> None:
        for part in self.parts:
            part.graduate(rows, decodes)

    def prefill_pass(
        self, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """Every group's description of the pass of ``work`` (``BoundedPool.prefill_pass``) and its input ids."""
        described = [part.prefill_pass(work, prompts, device) for part in self.parts]
        return _joined([step for step, _ in described]), described[0][1]

    def decode_pass(self, work: tuple[SlotWork, ...], device) -> RowsPass:
        return _joined([part.decode_pass(work, device) for part in self.parts])

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

    def kept_positions(self, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the sorted positions row ``row`` holds (host copy; for tests)."""
        return [kept for part in self.parts for kept in part.kept_positions(row)]


def _joined(steps: list[RowsPass]) -> RowsPass:
    """One pass of every layer group (``LayeredPool``): the first group's, carrying each group's as ``parts``."""
    return replace(steps[0], parts=tuple(steps))


def _prompt_workspace(pool: _Pool, R: int, s: int) -> int:
    """R prompts of s tokens on the model's SDPA over their own pairs (``attention._dense_prefill``)."""
    lay = pool.layout
    return dense_workspace_bytes(
        R,
        lay.query_heads,
        lay.kv_heads,
        lay.k_dim,
        s,
        s,
        lay.dtype.itemsize,
        padded=False,
        impl=pool.dense_impl,
        align=torch.device(lay.device).type == "cuda",
    )


def _group_pass(pool: _Pool, work, prompts, device, kind: str, slots=None) -> tuple[RowsPass, torch.Tensor]:
    """The pass of one group's prompts (one length s, a single block; a padded batch's rows at its positions, no pad)
    and their ids [R, s], the rows' ``seen`` advanced in its ``after``; ``slots(s)``: where each of the s pairs is
    written (None: the pass writes none itself, a compress pass keeps its own choice)."""
    rows, end, offset = [w.row for w in work], work[0].phase.end, pool.rows[work[0].row].offset
    s = end - offset
    columns = to_device([list(range(offset, end)), list(range(s)), *([slots(s)] if slots else [])], device)  # [2|3, s]
    R = len(rows)
    after = tuple((row, replace(pool.rows[row], seen=end)) for row in rows)  # each row's state after the pass
    step = RowsPass(
        kind=kind,
        pool=pool,
        rows=to_device(rows, device),
        span=_span(rows),
        qpos=columns[0].expand(R, s),
        positions=columns[1].expand(R, s),
        real=None,
        write=columns[2].expand(R, s) if slots else None,
        hi=s,
        after=after,
    )
    return step, torch.stack(prompts)


def to_device(data: list, device) -> torch.Tensor:
    """Host lists (of ints) as one tensor on ``device``. On CUDA through pinned memory, asynchronously: a copy from
    pageable memory would wait for the device to finish its queued work, so the host could not run ahead."""
    if torch.device(device).type == "cuda":
        return torch.tensor(data, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, device=device)


def _evictions(evicting: list[tuple[int, int, int, str | None]], device) -> tuple[Eviction, ...]:
    """(row, count, curr_id, probe) per evicting row -> one ``Eviction`` per (count, probe) kind."""
    kinds: dict[tuple[int, str | None], list[tuple[int, int]]] = {}
    for row, count, curr_id, probe in evicting:
        kinds.setdefault((count, probe), []).append((row, curr_id))
    out = []
    for (count, probe), members in kinds.items():
        t = to_device(members, device)  # [E, 2]: one copy per kind
        out.append(Eviction(t[:, 0], t[:, 1].view(-1, 1, 1), count, probe))
    return tuple(out)


def _columns(
    phase: Phase, st: RowState, prompt: torch.Tensor | None, n: int
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """A row's ``n`` columns of ``phase`` (a prefill chunk or a look-ahead probe): each column's position (-1:
    masked), RoPE position and token id (None without a prompt), real tokens right-aligned (a padded row's pads are
    masked columns)."""
    a = min(max(phase.start, st.offset), phase.end)  # the phase's first real position (end: all pads)
    pad = n - (phase.end - a)
    qpos = [-1] * pad + list(range(a, phase.end))
    rope = [0] * pad + list(range(a - st.offset, phase.end - st.offset))
    if prompt is None:
        return qpos, rope, None
    return qpos, rope, torch.nn.functional.pad(prompt[a - st.offset : phase.end - st.offset], (pad, 0))


def _span(rows: list[int]) -> slice | None:
    """``rows`` as a slice when they are adjacent and ascending, else None."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None


# -- the baselines --------------------------------------------------------------------------------------------------
class DensePoolLayer(_PoolLayer):
    """One decoder layer of the baselines' pool: keys/values [S, H, C + 1, D]; row r holds slots [0, length)."""

    score = None  # no score sums

    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Each row's columns [R, H, n, D] at its slots ``step.write`` [R, n] (masked columns, idle rows and the
        prompt pairs ED does not keep: the scratch column); the rows are adjacent (``step.span``)."""
        R, H, n, _ = key_states.shape
        idx = step.write[:, None, :, None]  # [R, 1, n, 1]
        for dst, src in ((self.keys, key_states), (self.values, value_states)):
            dst[step.span].scatter_(2, idx.expand(R, H, n, dst.shape[-1]), src)


class DensePool(_Pool):
    """The baselines' pools: prefill on the model's SDPA over a pass's own pairs, decode on ``core.attention``'s fused
    grouped product, no score sums. Slots [0, length) of a row hold its last ``length`` positions, in order."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, static: bool = False):
        super().__init__(method, num_layers, slots, capacity, DensePoolLayer, static)

    def admit(self, rows: range, offsets: list[int]) -> None:
        for row, offset in zip(rows, offsets):
            self.rows[row] = RowState(offset=offset)

    def kept_slots(self, s: int) -> list[int]:
        """Where each of a prompt's s pairs goes (the scratch column C: not kept)."""
        raise NotImplementedError

    def held_after_prompt(self, s: int, decodes: bool) -> int:
        """Pairs a row holds once its s-token prompt is prefilled (``decodes``: a decode step follows)."""
        return s

    def prefill_pass(
        self, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """One group's prompts (one length s: a single block) and their ids [k, s]; each row keeps what
        ``kept_slots`` says. A padded batch's rows hold no pad: their positions are the padded batch's, their tokens
        their own."""
        return _group_pass(self, work, prompts, device, "prefill", self.kept_slots)

    def pass_workspace(self, step: RowsPass) -> int:
        """A group's prompts on SDPA (``_prompt_workspace``); a decode pass's fused product (``_Pool``)."""
        if step.kind == "decode":
            return super().pass_workspace(step)
        return _prompt_workspace(self, *step.qpos.shape)

    def graduate(self, rows: range, decodes: list[bool]) -> None:
        """The group's prompt is held; a shared group's first row, the one its prefill ran on, becomes every row."""
        first = self.rows[rows.start]
        if len(rows) > 1 and self.rows[rows.start + 1].seen == 0:
            self.fork(rows)
        s = first.seen - first.offset
        for row, more in zip(rows, decodes):
            self.rows[row] = RowState(seen=first.seen, length=self.held_after_prompt(s, more), offset=first.offset)
        self.note()

    def decode_pass(self, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: ED's keep-newest where a row's step evicts, each row's write slot, and the
        additive mask [S, span] of the slots each row holds (idle rows: slot 0 alone, finite and never used)."""
        S, C = self.slots, self.capacity
        write, seen, lengths, evicting = [C] * S, [-1] * S, [1] * S, []
        after = {w.row: self.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for w in work:
            st = after[w.row]
            if w.phase.evict:  # ED (Algorithm 3): only the newest pair stays, moved to slot 0
                evicting.append((w.row, st.length - 1, st.seen - 1, None))
                st.length = 1
            write[w.row], seen[w.row] = st.length, st.seen
            st.length, st.seen = st.length + 1, st.seen + 1
            lengths[w.row] = st.length
        hi = C if self.static else max(lengths[w.row] for w in work)
        return self._decode_pass(work, write, seen, hi, evicting, device, lengths, after=after)

    def kept_positions(self, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the positions row ``row`` holds (slots [0, length) hold the last ``length``
        positions, in order)."""
        st = self.rows[row]
        held = list(range(st.seen - st.length, st.seen))
        return [[held] * layer.keys.shape[1] for layer in self.layers]


class FullPool(DensePool):
    """FKV's pool: a row holds its whole prompt and every token after it (C: the longest request)."""

    def kept_slots(self, s: int) -> list[int]:
        if s > self.capacity:
            raise ValueError(f"a {s}-token prompt does not fit FKV slots of {self.capacity}")
        return list(range(s))


class NewestPool(DensePool):
    """ED's pool (Algorithm 3): after the prompt and whenever a row holds ``kv_max`` pairs, only the newest pair
    stays, moved to slot 0 (``evict``); the prompt's pairs never enter a row but its newest."""

    stacked_kv = True

    def kept_slots(self, s: int) -> list[int]:
        return [self.capacity] * (s - 1) + [0]

    def held_after_prompt(self, s: int, decodes: bool) -> int:
        return 1 if decodes else s  # no decode step: its whole prompt, as far as ``kept_positions`` tells

    def evict(self, ev: Eviction) -> None:
        """In the rows ``ev.rows``, in every layer at once: each keeps its newest pair, at slot ``ev.count`` (its
        pairs before the pass, less one), moved to slot 0. Only that slot is gathered ([L, E, H, D])."""
        for name in ("keys", "values"):
            stack = self.stacks[name]  # [L, S, H, C + 1, D]
            stack[:, :, :, 0].index_copy_(1, ev.rows, stack[:, :, :, ev.count].index_select(1, ev.rows))


class PagedLayer(DensePoolLayer):
    """One decoder layer of FKV's paged pool: keys/values [N + 1, H, Bs, D], N blocks of Bs positions (block N: the
    scratch block, idle rows' writes)."""

    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Each row's columns [R, H, n, D] at the positions ``step.write`` [R, n] (block x Bs + offset)."""
        R, H, n, _ = key_states.shape
        Bs = self.keys.shape[2]
        flat = step.write.reshape(R * n)  # [R*n]
        block, offset = flat // Bs, flat % Bs
        for dst, src in ((self.keys, key_states), (self.values, value_states)):
            dst[block, :, offset] = src.transpose(1, 2).reshape(R * n, H, src.shape[-1])  # [R*n, H, D]


class PagedPool(DensePool):
    """FKV sized by real length (vLLM's PagedAttention layout, ``FullCache.block`` > 0): the K/V of N blocks of Bs
    positions, shared by the rows. A request is admitted when the free blocks cover its prompt and generation
    (``Scheduler``'s count, exact: it never grows past them, nothing is preempted); its blocks (lowest free first)
    form its row's table, and go back at its end (``finish``). Slot j of a row (its j-th held position, as in
    ``DensePool``) lives at position j % Bs of block ``table[j // Bs]``. A decode pass attends block by block
    (``attention._paged_decode``): each block with its row (``RowsPass.owner``) and its filled positions
    (``RowsPass.bias`` [N' x H, 1, Bs]), N' the blocks up to the highest one held (all N + 1 in a static pool: one
    shape for the run)."""

    def __init__(self, method: FullCache, num_layers: int, slots: int, blocks: int, static: bool = False):
        self.block, self.num_blocks = method.block, blocks
        # capacity: the scratch block's first position, where ``idle_pass`` and idle rows write
        _Pool.__init__(self, method, num_layers, slots, blocks * method.block, PagedLayer, static)
        self.free = list(range(blocks))  # a heap: the lowest free block first
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.owner = [slots] * (blocks + 1)  # per block: its decoding row (``slots``: none)
        self.fill = [0] * (blocks + 1)  # per block: positions held

    def kv_dims(self, heads: int, slots: int) -> tuple[int, ...]:
        return (self.num_blocks + 1, heads, self.block)

    def reserve(self, row: int, prompt_len: int, max_new_tokens: int) -> None:
        """Row ``row``'s request's blocks (``FullCache.blocks``), taken now."""
        need = self.method.blocks(prompt_len, max_new_tokens)
        if need > len(self.free):
            raise RuntimeError(f"row {row}: {need} blocks needed, {len(self.free)} free (the scheduler admits by them)")
        self.tables[row] = [heapq.heappop(self.free) for _ in range(need)]

    def finish(self, row: int) -> None:
        for b in self.tables[row]:
            heapq.heappush(self.free, b)
            self.owner[b], self.fill[b] = self.slots, 0
        self.tables[row] = []

    def _where(self, row: int, j: int) -> int:
        """Where row ``row``'s slot j lives: block ``table[j // Bs]``, position j % Bs (as block x Bs + offset)."""
        return self.tables[row][j // self.block] * self.block + j % self.block

    def prefill_pass(
        self, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """One group's prompts (one length s, one block) and their ids [k, s]; row r writes its slots [0, s)."""
        step, ids = _group_pass(self, work, prompts, device, "prefill")
        s = ids.shape[1]
        return replace(step, write=to_device([[self._where(w.row, j) for j in range(s)] for w in work], device)), ids

    def graduate(self, rows: range, decodes: list[bool]) -> None:
        super().graduate(rows, decodes)
        for row in rows:
            self._held(row)

    def _held(self, row: int) -> None:
        """Note row ``row``'s blocks as held by it, each with its filled positions."""
        length, Bs = self.rows[row].length, self.block
        for j, b in enumerate(self.tables[row]):
            self.owner[b], self.fill[b] = row, max(0, min(Bs, length - j * Bs))

    def fork(self, rows: range) -> None:
        """Copy row ``rows.start``'s blocks (a shared prefill's result) into the other rows' blocks."""
        first = self.tables[rows.start]
        for row in rows[1:]:
            src, dst = (torch.tensor(t, device=self.layers[0].keys.device) for t in (first, self.tables[row]))
            for layer in self.layers:
                for t in (layer.keys, layer.values):
                    t[dst] = t[src]

    def decode_pass(self, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: each decoding row writes its next slot; the blocks of the decoding rows
        (each with its filled positions) enter the attention, up to the highest one held."""
        S, C = self.slots, self.capacity
        hi = self.num_blocks + 1 if self.static else 1 + max(max(self.tables[w.row]) for w in work)
        write, seen, fill = [C] * S, [-1] * S, self.fill[:hi]  # the blocks' fill after the pass (``ready`` records it)
        after = {w.row: self.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for w in work:
            st = after[w.row]
            write[w.row], seen[w.row] = self._where(w.row, st.length), st.seen
            st.length, st.seen = st.length + 1, st.seen + 1
            fill[self.tables[w.row][(st.length - 1) // self.block]] += 1
        first = work[0].row  # a block no decoding row holds goes to it, masked whole (it adds exp(-inf) = 0)
        owner = [first if r == S else r for r in self.owner[:hi]]
        return self._decode_pass(work, write, seen, hi, [], device, blocks=(owner, fill), after=after)

    def ready(self, step: RowsPass) -> RowsPass:
        """``_Pool.ready``; a decode pass also counts each decoding row's new position in its block."""
        model_step = super().ready(step)
        if step.kind == "decode":
            for row, st in step.after:
                self.fill[self.tables[row][(st.length - 1) // self.block]] += 1
        return model_step

    def pass_workspace(self, step: RowsPass) -> int:
        """A decode pass block by block (``attention._paged_decode``); a prompt as ``DensePool``'s."""
        if step.kind != "decode":
            return super().pass_workspace(step)
        keys = self.layers[0].keys  # [N + 1, H, Bs, D]
        H, D, Hq = keys.shape[1], keys.shape[-1], self.layout.query_heads
        return paged_decode_workspace_bytes(step.qpos.shape[0], Hq, H, step.hi, self.block, D, keys.element_size())


def make_pool(method: Method, num_layers: int, slots: int, capacity: int, static: bool, blocks: int = 0) -> _Pool:
    """The method's pool: ``capacity`` slots per row (``Method.decode_capacity`` of the longest request); FKV paged:
    ``blocks`` blocks shared by ``slots`` rows."""
    if method.paged:
        return PagedPool(method, num_layers, slots, blocks, static)
    if (capacities := method.layer_capacities(num_layers)) is not None:
        return LayeredPool(method, capacities, slots, static)
    kinds = {BatchMax: BoundedPool, FullCache: FullPool, ExtremeDecoding: NewestPool, Snap: SnapPool}
    return kinds[type(method)](method, num_layers, slots, capacity, static)
