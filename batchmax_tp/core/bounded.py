"""Batch-Max's pool (``BoundedPool``): per layer keys/values [S, H, C + 1, D], and per slot ``pos``/``score``/``bias``
and a free list ``free`` [S, H, C + 1] with C = ``kv_max``; and ``snap``'s (``SnapPool``), the same rows filled by one
compress pass per prompt.

Column C is a scratch slot: a masked column or a row that is not decoding writes its (unused) pair there, so nothing
else is touched; the free lists end in C and no attention or eviction ever reads it. A row's prefill chunks run in
passes with the other prefilling rows (each row's next chunk at its own position, with its own evictions, on its
unpadded prompt), then its decode steps in passes over the whole pool. A row of the paper's padded batch
(``scheduler``'s static policy) runs the batch's shared schedule at padded positions: its pads are counted as held
(``RowState.filled``) but never written, so they go first at an eviction, as the padded batch's pad slots do, and its
kept positions are the padded batch's.

A rule with ``share=G`` (``core.rules``) groups a layer's local KV heads by G: each group's storage head holds
T = G x ``kv_max`` slots, any of its heads' pairs (``head`` [S, Hs, T + 1]: each slot's head in its group), each
written column takes G free-list entries (one per head, in order) and each eviction frees G x the count.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from . import probe as lookahead
from . import snap
from .dense import Paging
from .method import BLOCK, Method
from .rules import MAX_SHARE
from .schedule import Phase
from .slots import (
    RowState,
    SlotLayer,
    SlotPool,
    chunk_pass,
    chunk_workspace,
    columns,
    evictions_of,
    group_pass,
    nbytes,
    prompt_workspace,
    span_of,
    to_device,
)
from .step import Change, Eviction, PoolState, RowsPass, SlotWork
from .tier import Tier
from .workspace import (
    choice_workspace_bytes,
    eviction_layers,
    eviction_workspace_bytes,
    probe_workspace_bytes,
    rows_workspace_bytes,
    snap_workspace_bytes,
)


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


def _from_tier(layer, row: int, li: int, h: int, into, tier, back, t_pos, t_score) -> None:
    """A recall's tier pairs ``back`` [k] of layer ``li``, KV head ``h`` (positions and sums ``t_pos``/``t_score``
    [Hs, m], on the device) into row ``row``'s slots ``into`` [k] of ``layer``: keys, values, positions, sums, an
    open mask."""
    at = back.cpu()
    layer.keys[row, h, into] = tier.keys[li, h, at].to(layer.keys.device)
    layer.values[row, h, into] = tier.values[li, h, at].to(layer.values.device)
    layer.pos[row, h, into], layer.score[row, h, into] = t_pos[h, back], t_score[h, back]
    layer.bias[row, h, into] = 0.0


class PoolLayer(SlotLayer):
    """One decoder layer of the BM pool: keys/values [S, H, C + 1, D]; pos, score, bias, free [S, H, C + 1]; for a
    rule with a look-ahead probe, ``probe`` [S, H, C + 1] and (a rule probing every few blocks) the last probe's
    stored queries of every row (``probe_q``, ``probe_lse``, ``probe_w``), allocated by the pool before the first probe
    pass (``BoundedPool.ready``)."""

    def __init__(self, cache: BoundedPool, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.pos = self.score = self.bias = self.free = self.probe = self.head = None
        self.probe_q = self.probe_lse = self.probe_w = None
        self.window_q = None  # ``recall=window``: each row's last ``w`` prompt queries so far [S, Hq, w, D]
        self.full_keys = self.full_values = None  # snap prefilled in chunks: its prompts' full pairs (``SnapPool``)

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        stored = (self.probe, self.head, self.probe_q, self.probe_lse, self.probe_w, self.window_q)
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
        stored = (self.probe, self.head, self.probe_q, self.probe_lse, self.probe_w, self.window_q)
        return self.pos, self.score, self.bias, self.free, *stored

    def other_heads(self, take, G: int) -> torch.Tensor | None:
        """In a budget shared by G > 1 heads (the pass's ``share``): which slots each query head's group must not
        see, bool [R, Hs, G, T + 1] (True: the slot holds another head's pair) of the pass's rows (``take``:
        ``RowsPass.take``); else None."""
        if G == 1:
            return None
        own = torch.arange(G, dtype=self.head.dtype, device=self.device)[:, None]  # [G, 1]
        return take(self.head)[:, :, None, :] != own  # [R, Hs, G, T + 1]

    # -- a pass's writes: the new pairs (evictions: ``BoundedPool.evict``, before the pass) ----------------------
    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """Write each row's columns [R, H, n, D] at the slots its free list gives (masked columns: the scratch slot).
        In a shared budget (G heads per storage head, T = G x C slots) column j's pairs take the free-list entries
        [G j, G j + G), one per head in order, and each slot records its head. Returns the slots written
        [R, Hs, n*G] (column j's head k at j*G + k). (A decode pass's pairs go where the pool recorded them for every
        layer at once, ``RowsPass.written``: the attention copies them there.)"""
        R, H, n, _ = key_states.shape
        G, T1 = step.share, self.keys.shape[2]
        C = (T1 - 1) // G  # kv_max: the index of a masked column's write (the scratch slot)
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

    def keep(self, rows, key_states: torch.Tensor, value_states: torch.Tensor, kept: torch.Tensor, sums, first):
        """Snap's choice: of the pool rows ``rows``' prompt pairs [R, H, s, D] the columns ``kept`` [R, H, K]
        (ascending) go to slots [0, K), with their positions (column + ``first``: each row's first position, an int
        or [R, 1, 1]) and attention sums ``sums`` [R, H, K]; the rows' other slots stay empty, as their admission left
        them (``BoundedPool.admitted``)."""
        R, H, K = kept.shape
        at = kept[..., None].expand(R, H, K, key_states.shape[-1])  # [R, H, K, D]
        self.keys[:, :, :K].index_copy_(0, rows, key_states.gather(2, at))
        self.values[:, :, :K].index_copy_(0, rows, value_states.gather(2, at))
        self.pos[:, :, :K].index_copy_(0, rows, kept + first)
        self.score[:, :, :K].index_copy_(0, rows, sums)
        self.bias[:, :, :K].index_fill_(0, rows, 0.0)

    def chunk_storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Snap prefilled in chunks: its prompts' full pairs, in blocks [N + 1, H, Bs, D], until each compresses."""
        return self.full_keys, self.full_values

    def store_probe(self, rows: torch.Tensor, q: torch.Tensor, own_lse: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep the rows' probe queries [R, Hs, G*g*w, D], log-sum-exp [R, Hs, G*g*w, 1] and weights [R, w] for
        re-scoring (``probe.ProbeState``) in the layer's store (``BoundedPool.ready`` allocates it before the first
        probe pass)."""
        for dst, src in ((self.probe_q, q), (self.probe_lse, own_lse), (self.probe_w, weights)):
            dst.index_copy_(0, rows, src)


class BoundedPool(SlotPool):
    """BM's pool: ``slots`` rows of ``kv_max`` slots (+ the scratch column) per layer and local KV head. A row's
    prefill chunks run in passes with other rows' chunks (each row at its own position, its own evictions), then
    its decode steps in passes over the whole pool; ``prefill_pass``/``decode_pass`` describe each pass
    (``step.RowsPass``, the rows' states after it inside) from the rows' host state handed in (``step.PoolState``)."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, static: bool = False):
        super().__init__(method, num_layers, slots, capacity, PoolLayer, static)
        self.tier: Tier | None = None  # the rows' recall tiers (``question:recall=tier``), made at the first eviction

    def apply(self, change: Change) -> None:
        """``SlotPool``'s, and a row emptied for a new request drops what its tier still holds."""
        if self.tier is not None:
            for row in change.reset:
                self.tier.drop(row)
        super().apply(change)

    def release(self) -> None:
        if self.tier is not None:
            self.tier.close()
        super().release()

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
        return sum(nbytes(*layer.meta_tensors()) for layer in self.layers)

    def pass_workspace(self, step: RowsPass) -> int:
        """A prefill pass's chunks (``attention._rows_block``: gathered first when the rows are not adjacent) or, when
        it carries look-ahead probes, the larger of that and theirs; a probe pass's (``attention._rows_probe``); a
        decode pass's fused product (``SlotPool``)."""
        if step.kind == "decode":
            return super().pass_workspace(step)
        keys = self.layers[0].keys  # [S, Hs, T + 1, D]
        if step.subs:  # a wide pass: its blocks one at a time, their outputs held until joined, an eviction's
            R, N = step.positions.shape
            outputs = 2 * R * N * self.layout.query_heads * keys.shape[-1] * keys.element_size()
            E, Hs, T = step.rows.numel(), keys.shape[1], self.share * self.capacity
            evicting = eviction_workspace_bytes(1, E, Hs, T, self.layers[0].bias.element_size(), self.share)
            return max(self.pass_workspace(sub) for sub in step.subs) + outputs + evicting
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

    def _allocate_window_store(self) -> None:
        """``recall=window``: every layer's and row's last ``w`` prompt queries [L, S, Hq, w, D] (model dtype),
        allocated before the first prefill pass; each layer holds its view."""
        keys = self.layers[0].keys  # [S, Hs, T + 1, D]
        L, S, w = len(self.layers), self.slots, self.method.recall_window
        store = torch.zeros(L, S, self.layout.query_heads, w, keys.shape[-1], dtype=keys.dtype, device=keys.device)
        self.stacks["window_q"] = store
        for i, layer in enumerate(self.layers):
            layer.window_q = store[i]

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
        if ev.probe == "recall":
            self.note_workspace(self.recall_workspace(ev))

    def recall_workspace(self, ev: Eviction) -> int:
        """The most a recall (``_recall``: one row, layer and head at a time) holds beside the pool: a kv_max of the
        tier's keys on the device, the stored queries' logits over them (float32, twice: the probabilities), and the
        held and tier pairs' positions, sums, look-ahead attention and ranking keys (int64 and float32)."""
        keys, q = self.layers[0].keys, self.layers[0].probe_q  # [S, Hs, T + 1, D], [S, Hs, g*w, D]
        Hs, D, e, T = keys.shape[1], keys.shape[-1], keys.element_size(), self.capacity
        m = max(fill for _, fill, _ in ev.tier)
        return Hs * (T * D * e + 2 * q.shape[2] * T * 4 + (T + m) * (8 + 4 + 4 + 4 + 8 + 8))

    def _evict_layers(self, ev: Eviction, layers: slice) -> None:
        if ev.probe == "recall":
            self._recall(ev, layers)
            return
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
        before = (pos.clone(), score.clone()) if ev.tier else None  # the freed pairs' state, for their tiers
        freed = free_slots(priority, pos, score, bias, ev.count * G, head)  # [n*E, Hs, G*count]
        if before is not None:  # the freed pairs wait in their rows' tiers (``question:recall=tier``)
            self._to_tier(ev, layers, *(t.unflatten(0, (n, -1)) for t in (freed, *before)))
        for name, src in zip(("pos", "score", "bias"), (pos, score, bias)):
            state[name].index_copy_(1, e, src.unflatten(0, (n, -1)))
        free = self.stacks["free"]
        free[layers, ..., : ev.count * G].index_copy_(1, e, freed.unflatten(0, (n, -1)).to(free.dtype))

    def _to_tier(
        self, ev: Eviction, layers: slice, freed: torch.Tensor, pos: torch.Tensor, score: torch.Tensor
    ) -> None:
        """The pairs an eviction frees, ``freed`` [n, E, Hs, k] of the layers ``layers`` (``pos``/``score`` [n, E, Hs,
        T]: their slot state before it), into each row's recall tier at its place (``Eviction.tier``)."""
        T = self.capacity
        if self.tier is None:
            keys = self.layers[0].keys  # [S, Hs, T + 1, D]
            self.tier = Tier(len(self.layers), keys.shape[1], keys.shape[-1], keys.dtype, keys.device)
        for k, entry in enumerate(ev.tier):
            if entry is None:
                continue
            row, offset, capacity = entry
            idx = freed[:, k, ..., None].expand(-1, -1, -1, self.layers[0].keys.shape[-1])  # [n, Hs, c, D]
            keys, values = (
                torch.stack([getattr(lay, name)[row, :, :T].gather(1, i) for lay, i in zip(self.layers[layers], idx)])
                for name in ("keys", "values")
            )  # [n, Hs, c, D] each: only the freed pairs copied
            at = freed[:, k]  # [n, Hs, c]
            self.tier.store(
                row, capacity, offset, layers, keys, values, pos[:, k].gather(2, at), score[:, k].gather(2, at)
            )

    def _recall(self, ev: Eviction, layers: slice) -> None:
        """A row's eviction before its prompt's last block, its tier's pairs among the candidates (``Eviction``'s
        "recall"): per layer of ``layers`` and local KV head, the slots held and the tier's pairs are ranked together
        by the rule, their look-ahead attention re-scored from the stored probe over all of them (``probe.
        rescore_parts``: a kv_max of the tier's keys in fast memory at a time); the ``count`` lowest slots are freed
        (the head of the free list, as an eviction's), and every tier pair that ranks above the lowest slots kept
        takes the place of one of the slots that rank below it. The row's tier is then dropped."""
        for k, (row, fill, _) in enumerate(ev.tier):
            for li in range(*layers.indices(len(self.layers))):
                self._recall_layer(li, row, self.tier.rows[row], fill, ev.count, ev.curr_id[k : k + 1])
            if layers.stop >= len(self.layers):
                self.tier.drop(row)

    def _recall_layer(self, li: int, row: int, tier, fill: int, count: int, curr: torch.Tensor) -> None:
        """``_recall`` of row ``row`` in layer ``li``: its ``fill`` tier pairs a head with its held slots, ``count``
        slots freed, ranked at ``curr`` [1, 1, 1]."""
        T, lay = self.capacity, self.layers[li]
        device = lay.keys.device
        keys = lay.keys[row, :, :T]  # [Hs, T, D] (a view)
        pos, score, bias = lay.pos[row, :, :T], lay.score[row, :, :T], lay.bias[row, :, :T]  # [Hs, T] views
        t_pos, t_score = tier.pos[li, :, :fill].to(device), tier.score[li, :, :fill].to(device)  # [Hs, m] each

        def parts():  # the held slots, then the tier a kv_max of pairs at a time
            yield keys[None], pos[None]
            for a in range(0, fill, T):
                b = min(a + T, fill)
                yield tier.keys[li, :, a:b].to(device)[None], t_pos[None, :, a:b]

        state = lookahead.ProbeState(*(t[row : row + 1] for t in (lay.probe_q, lay.probe_lse, lay.probe_w)))
        probe = torch.cat(lookahead.rescore_parts(state, parts), dim=-1)  # [1, Hs, T + m]
        u_pos = torch.cat([pos, t_pos], dim=-1)[None]  # [1, Hs, T + m]
        u_score = torch.cat([score, t_score], dim=-1)[None]
        priority = self.method.priority(u_score, u_pos, curr, probe, None)  # [1, Hs, T + m]
        drop = slots_to_evict(priority, u_pos, fill + count)[0]  # [Hs, m + count], lowest first
        for h in range(drop.shape[0]):
            d = drop[h]
            gone = d[d < T]  # this head's slots ranked below the rest, lowest first: count + (pairs recalled)
            back = torch.ones(fill, dtype=torch.bool, device=device)
            back[d[d >= T] - T] = False
            back = back.nonzero().view(-1)  # the tier's pairs ranked above the lowest slots kept
            freed, into = gone[:count], gone[count:]
            _from_tier(lay, row, li, h, into, tier, back, t_pos, t_score)
            pos[h, freed], score[h, freed], bias[h, freed] = -1, 0.0, float("-inf")
            lay.free[row, h, :count] = freed.to(lay.free.dtype)

    def choose_by_window(self, layer: PoolLayer, step: RowsPass, query: torch.Tensor, scaling: float) -> None:
        """``recall=window``, in ``layer`` once a prefill pass's blocks have attended (their queries [R, Hq, n, D],
        RoPE applied): the rows whose block holds some of their window keep its queries (``RowsPass.window_rows``),
        then each row whose prompt's last block this was (``RowsPass.final``) chooses its pairs (``_choose_layer``);
        after the last layer its tier is dropped."""
        rows = step.rows.index_select(0, step.window_rows)  # [Rw] pool rows
        w = layer.window_q.shape[2]
        tail = query[:, :, -min(w, query.shape[2]) :].index_select(0, step.window_rows)  # [Rw, Hq, m, D]
        joined = torch.cat([layer.window_q.index_select(0, rows), tail], dim=2)  # [Rw, Hq, w + m, D]
        at = step.window_index[:, None, :, None].expand(-1, joined.shape[1], -1, joined.shape[-1])  # [Rw, Hq, w, D]
        layer.window_q.index_copy_(0, rows, joined.gather(2, at))  # the last w real queries
        for _, row, fill, first, length in step.final:
            self._choose_layer(layer, row, fill, first, length, scaling)
            if layer.layer_idx == len(self.layers) - 1:
                self.tier.drop(row)

    def _choose_layer(self, layer: PoolLayer, row: int, fill: int, first: int, length: int, scaling: float) -> None:
        """Row ``row``'s choice in ``layer`` after its prompt's last block: its prompt's pairs, each held or in its
        tier (``fill`` pairs a head; real positions ``[first, length)``), are scored by its window's queries (the
        prompt's last w, as computed in the run: ``snap.window_scores_parts``, a kv_max of the tier's keys in fast
        memory at a time) and chosen as snap chooses (``snap.choose``: the window and the pairs the rule protects, its
        first ``sinks`` and ``recent`` newest, then the best pooled by its ``kernel``/``pool``), as many as the row
        holds; each chosen tier pair takes the slot of a held pair not chosen."""
        T, li, rule = self.capacity, layer.layer_idx, self.method.scorer
        keys, pos = layer.keys[row, :, :T], layer.pos[row, :, :T]  # [Hs, T, D], [Hs, T] (views)
        tier, device = self.tier.rows[row], keys.device
        (Hs, _, D), s = keys.shape, length - first
        held = int((pos[0] >= 0).sum())  # pairs a head (every head holds as many)
        w = min(self.method.recall_window, s, held)
        g = layer.window_q.shape[1] // Hs
        query = layer.window_q[row, :, -w:].reshape(Hs, g, w, D)  # [Hs, g, w, D]: query heads by KV head
        t_pos, t_score = tier.pos[li, :, :fill].to(device), tier.score[li, :, :fill].to(device)  # [Hs, m] each

        def parts():  # the held slots, then the tier a kv_max of pairs at a time
            yield keys, pos
            for a in range(0, fill, T):
                yield tier.keys[li, :, a : min(a + T, fill)].to(device), t_pos[:, a : a + T]

        qpos = torch.arange(length - w, length, device=device)  # [w]
        sums = torch.cat(snap.window_scores_parts(query, qpos, scaling, parts), dim=-1)  # [Hs, T + m]
        u_pos = torch.cat([pos, t_pos], dim=-1)  # [Hs, T + m]: a held slot j, tier pair i at T + i
        at = torch.where(u_pos >= 0, u_pos - first, s)  # [Hs, T + m]: each pair's place in the prompt (none: s)
        dense = sums.new_zeros(Hs, s + 1).scatter_(1, at, sums)[:, :s]  # [Hs, s]: by position
        source = torch.full((Hs, s + 1), -1, dtype=torch.long, device=device)
        source.scatter_(1, at, torch.arange(T + fill, device=device).expand(Hs, -1))  # [Hs, s + 1]
        protect = (rule.sinks, rule.recent)  # never evicted by the rule: kept first
        kept = snap.choose(dense[None], held, w, rule.kernel, rule.pool, protect)[0]  # [Hs, held] places, ascending
        chosen = source.gather(1, kept)  # [Hs, held]: held slots (< T) and tier pairs (>= T)
        self.note_workspace(Hs * (T * D * keys.element_size() + 2 * g * w * T * 4 + (T + fill) * 36 + s * 12))
        for h in range(Hs):
            c = chosen[h]
            back = c[c >= T] - T  # the tier's pairs chosen
            stays = torch.zeros(T, dtype=torch.bool, device=device)
            stays[c[c < T]] = True
            into = ((pos[h] >= 0) & ~stays).nonzero().view(-1)  # the held pairs not chosen: their slots
            if into.numel() != back.numel():
                raise RuntimeError(f"recall=window: {back.numel()} tier pairs chosen for {into.numel()} slots")
            _from_tier(layer, row, li, h, into, tier, back, t_pos, t_score)

    def _rescored(self, layer: PoolLayer, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s look-ahead attention [E, Hs, T] over the slots ``pos`` [E, Hs, T] of ``rows``, from the
        queries its last probe pass stored."""
        state = lookahead.ProbeState(
            *(t.index_select(0, rows) for t in (layer.probe_q, layer.probe_lse, layer.probe_w))
        )
        T = pos.shape[-1]
        other = layer.other_heads(lambda t: t.index_select(0, rows), self.share)  # [E, Hs, G, T + 1] or None
        keys = layer.keys[:, :, :T].index_select(0, rows)
        return lookahead.rescore(state, keys, pos, None if other is None else other[..., :T])

    def admitted(
        self, state: PoolState, rows: range, offsets: list[int], lengths: list[int], max_new: list[int]
    ) -> Change:
        """Requests enter the slots ``rows``: their rows start empty, and so do their slots (once allocated)."""
        change = super().admitted(state, rows, offsets, lengths, max_new)
        return replace(change, reset=tuple(rows) if self.allocated else ())

    def evicts(self, st: RowState, phase: Phase) -> int:
        """Pairs a row in state ``st`` evicts before ``phase``: the schedule's count (``Phase.evict``)."""
        return phase.evict

    def _evict_row(
        self, row: int, st: RowState, evict: int, prefill: bool, tier: tuple[int, bool] | None = None
    ) -> tuple:
        """A row's eviction of ``evict`` pairs (count: its empty slots too), its state ``st`` (the pass's copy)
        advanced. ``tier`` (a prefill eviction under ``question:recall=tier``): (the row's padded prompt length,
        whether the block after it is the prompt's last): its freed pairs go to the row's tier, or before the last
        block (``recall=tier``) the recall ranks the tier's with the held ones (``Eviction.tier``)."""
        C = self.capacity
        probe, entry = None, None
        count = C - st.filled + evict
        if prefill and self.method.lookahead:
            probe = "fresh" if st.probed or self.method.probe_every == 1 else "rescore"
            if tier is not None and self.method.recalls:
                length, last = tier
                entry = (row, st.tiered, length)
                if last and not self.method.recall_window:  # recall=tier: the recall is this eviction
                    probe = "recall"
                else:
                    st.tiered += count
        elif self.method.probe_decodes and st.asked:  # ``decode=probe``: the question's stored queries rank it
            probe = "rescore"
        st.filled -= evict
        st.ptr, st.contiguous, st.high = 0, False, C
        return row, count, st.seen - 1, probe, entry

    def prefill_pass(
        self,
        state: PoolState,
        work: tuple[SlotWork, ...],
        prompts: list[torch.Tensor] | None,
        device,
        offsets: list[int] | None = None,
    ) -> tuple[RowsPass, torch.Tensor | None]:
        """The pass of ``work`` (each row's prefill chunk, and the look-ahead probes some chunks take along) and its
        input ids [R, w + n]: a probe's columns first (the rule's window ``w``, when some row probes; masked for a
        row that does not), then the chunk's; each part's real tokens right-aligned, masked columns in front (a
        padded row's pads among them: counted as held, never written). ``prompts`` None (the HF drop-in, whose
        caller feeds the ids): the pass alone; ``offsets``: each row's left pads as of this pass (the drop-in learns
        them block by block from HF's mask), part of the rows' states after it."""
        n = max(w.phase.size for w in work)
        window = self.method.lookahead if any(w.probe is not None for w in work) else 0
        rows = [w.row for w in work]
        qpos, rope, write, evicting, ids, among, probe_qpos, probe_rope = [], [], [], [], [], [], [], []
        windowed, window_index, final = [], [], []  # recall=window (``RowsPass.window_rows``)
        blind = False  # a row whose pass is pads alone and that holds nothing yet: its queries see no slot
        after = {w.row: state.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for j, w in enumerate(work):
            ph, st, prompt = w.phase, after[w.row], None if prompts is None else prompts[j]
            if offsets is not None:
                st.offset = offsets[j]
            q, r, i = columns(ph, st, prompt, n)
            blind |= q[-1] < 0 and st.high == 0  # (real tokens are right-aligned)
            if window:
                pq, pr, pi = columns(w.probe, st, prompt, window) if w.probe else ([-1] * window, [0] * window, None)
                if w.probe:
                    among.append(j)
                    probe_qpos.append(pq)
                    probe_rope.append(pr)
                r, i = pr + r, torch.cat([pi if pi is not None else i.new_zeros(window), i])
            qpos.append(q)
            rope.append(r)
            ids.append(i)
            if evict := self.evicts(st, ph):
                tier = None
                if self.method.recalls:  # (padded prompt length, the block is its last)
                    if prompt is None:
                        recall = self.method.scorer.recall
                        raise ValueError(f"question:recall={recall} needs the prompts' ids (the engine's passes)")
                    tier = (prompt.numel() + st.offset, ph.end - st.offset == prompt.numel())
                evicting.append(self._evict_row(w.row, st, evict, prefill=True, tier=tier))
            real = sum(x >= 0 for x in q)
            if (w_recall := self.method.recall_window) and prompt is not None:
                length = prompt.numel() + st.offset  # the padded prompt's
                if ph.end > length - w_recall:  # the block holds some of the window's queries: kept as they come
                    m, r = min(n, w_recall), min(real, n, w_recall)  # the block's last m columns join the kept w
                    windowed.append(j)
                    window_index.append([r + i if r + i < w_recall else m + i for i in range(w_recall)])
                if ph.end == length and st.tiered:  # its last block: the window then chooses the pairs held
                    final.append((j, w.row, st.tiered, st.offset, length))
            write.append([self.capacity] * (n - real) + list(range(st.ptr, st.ptr + real)))
            st.ptr, st.filled, st.seen = st.ptr + real, st.filled + ph.size, ph.end
            st.probed = w.probe is not None  # its next eviction ranks with this probe
            st.asked |= st.probed
            if st.contiguous:
                st.high = max(st.high, st.ptr)
        R, hi = len(rows), max(1, *(after[r].high for r in rows))  # at least one slot: a pass of pads alone
        flat = [x for part in (qpos, rope, write, probe_qpos, probe_rope) for row in part for x in row]
        packed = to_device(flat, device)  # one host-to-device copy, split below
        sizes = [R * n, R * (window + n), R * n, len(among) * window, len(among) * window]
        qpos_t, rope_t, write_t, probe_t, probe_rope_t = packed.split(sizes)
        qpos_t = qpos_t.view(R, n)
        later = (qpos_t[:, None, :] > qpos_t[:, :, None]) & (qpos_t[:, None, :] >= 0)  # [R, n, n]: keys after queries
        step = RowsPass(
            kind="prefill",
            pool=self,
            method=self.method,
            share=self.share,
            rows=to_device(rows, device),
            span=span_of(rows),
            qpos=qpos_t,
            positions=rope_t.view(R, window + n),
            real=None if all(q[0] >= 0 for q in qpos) else qpos_t >= 0,
            write=write_t.view(R, n),
            hi=hi,
            evictions=evictions_of(evicting, device),
            causal=torch.zeros(later.shape, device=device).masked_fill_(later, torch.finfo(torch.float32).min),
            blind=blind,
            after=tuple(after.items()),
        )
        if windowed:
            step = replace(
                step,
                window_rows=to_device(windowed, device),
                window_index=to_device([x for row in window_index for x in row], device).view(len(windowed), -1),
                final=tuple(final),
            )
        if among:  # the probes folded into the pass: the probing rows' first ``window`` columns
            probe_t = probe_t.view(len(among), window)
            probing = [rows[j] for j in among]
            probe = RowsPass(
                kind="probe",
                pool=self,
                method=self.method,
                share=self.share,
                rows=to_device(probing, device),
                span=span_of(probing),
                qpos=probe_t,
                positions=probe_rope_t.view(len(among), window),
                real=None if all(q[0] >= 0 for q in probe_qpos) else probe_t >= 0,
                write=None,
                hi=hi,
            )
            step = replace(step, probe=probe, among=None if len(among) == R else to_device(among, device))
        return step, None if prompts is None else torch.stack(ids)

    def wide_pass(
        self,
        state: PoolState,
        subs: tuple[tuple[SlotWork, ...], ...],
        prompts: list[torch.Tensor],
        device,
    ) -> tuple[RowsPass, torch.Tensor]:
        """A wide pass (``Method.wide``) and its ids [R, sum of the blocks' columns]: each block of ``subs`` (the same
        rows in the same order, ``prompts`` theirs) described as ``prefill_pass`` describes it from the rows' states
        after the block before; the model's columns are the blocks' one after another. Its evictions run inside each
        layer's attention, before each block's (``evict_layer``)."""
        passes, ids = [], []
        for work in subs:
            step, block_ids = self.prefill_pass(state, work, prompts, device)
            state = state.changed(step.change())
            passes.append(step)
            ids.append(block_ids)
        first, last = passes[0], passes[-1]
        positions = torch.cat([step.positions for step in passes], dim=1)  # [R, N]
        wide = replace(
            first,
            positions=positions,
            evictions=(),
            probe=None,
            among=None,
            subs=tuple(passes),
            window_rows=None,
            window_index=None,
            final=(),
        )  # (each block's evictions, probes and window in its own pass)
        return replace(wide, after=last.after), torch.cat(ids, dim=1)

    def evict_layer(self, ev: Eviction, layer: int) -> None:
        """``ev`` in the pool's layer ``layer`` alone (a wide pass's evictions, inside that layer's attention)."""
        if ev.probe == "recall" and layer == 0:
            self.note_workspace(self.recall_workspace(ev))
        self._evict_layers(ev, slice(layer, layer + 1))

    def decode_pass(self, state: PoolState, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: each decoding row's eviction (its own step's count) and write slot."""
        S, C = self.slots, self.capacity
        ptr, seen, evicting = [C] * S, [-1] * S, []
        after = {w.row: state.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for w in work:
            st = after[w.row]
            if evict := self.evicts(st, w.phase):  # Algorithm 1: p pairs (and the empty slots) go before a step
                evicting.append(self._evict_row(w.row, st, evict, prefill=False))  # that does not fit
            ptr[w.row], seen[w.row] = st.ptr, st.seen
            if st.contiguous:
                st.high = max(st.high, st.ptr + 1)
            st.ptr, st.filled, st.seen, st.decoding = st.ptr + 1, st.filled + 1, st.seen + 1, True
        hi = C if self.static else max(after[w.row].high for w in work)
        return self._decode_pass(work, ptr, seen, hi, evicting, device, after=after)

    def ready(self, step: RowsPass) -> RowsPass:
        """Run a described pass's evictions (every layer at once); a decode pass then records each row's new slot in
        every layer at once (the head of its free list, as ``PoolLayer.write`` takes it): its position, a zero sum,
        an open mask (and in a shared budget its head), and hands the model call where each layer's pairs go
        (``RowsPass.written``), so that inside the model call a layer only copies its pairs. The first pass that
        probes, under a rule probing every few blocks, allocates the stored probes first."""
        probing = any(sub.probe is not None for sub in (*step.subs, step))
        if probing and self.method.stores_probe and self.layers[0].probe_q is None:
            self._allocate_probe_store()
        windowed = any(sub.window_rows is not None for sub in (*step.subs, step))
        if windowed and self.layers[0].window_q is None:
            self._allocate_window_store()
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

    def kept_positions(self, state: PoolState, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the sorted positions row ``row`` holds (host copy, read from its storage; for
        tests)."""
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
    each row keeps what the window's attention chooses. Prefilled in chunks (``Snap.chunk`` > 0): a request's prompt
    pairs are held in full, in ``blocks`` blocks of ``BLOCK`` positions shared by the prefilling rows (taken at its
    admission, the scheduler admitting by them; given back when its prefill ends), each chunk's queries over them
    (``slots.chunk_pass``, as FKV's), and its last chunk's pass makes the same choice over all of them."""

    def __init__(
        self, method: Method, num_layers: int, slots: int, capacity: int, static: bool = False, blocks: int = 0
    ):
        super().__init__(method, num_layers, slots, capacity, static)
        self.num_blocks = blocks

    @property
    def chunked(self) -> bool:
        return self.method.pass_tokens(self.slots) is not None

    def allocate(self, layout) -> None:
        """BM's rows and, prefilled in chunks, the full pairs' blocks [N + 1, H, Bs, D] per layer (the last: the
        scratch block, masked columns' writes)."""
        fresh = not self.allocated
        super().allocate(layout)
        if fresh and self.chunked:
            H, D = layout.kv_heads, layout.k_dim
            for layer in self.layers:
                for name in ("full_keys", "full_values"):
                    t = torch.zeros(self.num_blocks + 1, H, BLOCK, D, dtype=layout.dtype, device=layout.device)
                    setattr(layer, name, t)
            self.note()

    def kv_bytes(self) -> int:
        """The rows' K/V and, prefilled in chunks, the full pairs' blocks."""
        return super().kv_bytes() + sum(nbytes(layer.full_keys, layer.full_values) for layer in self.layers)

    def initial(self) -> PoolState:
        state = super().initial()
        return replace(state, paging=Paging.empty(self.slots, self.num_blocks)) if self.chunked else state

    def admitted(
        self, state: PoolState, rows: range, offsets: list[int], lengths: list[int], max_new: list[int]
    ) -> Change:
        """BM's, and prefilled in chunks each request's blocks for its prompt's full pairs (``Snap.blocks``)."""
        change = super().admitted(state, rows, offsets, lengths, max_new)
        if not self.chunked:
            return change
        paging = state.paging
        for row, s, t in zip(rows, lengths, max_new):
            paging = paging.reserved(row, self.method.blocks(s, t))
        return replace(change, paging=paging)

    def graduated(self, state: PoolState, rows: range, decodes: list[bool]) -> Change:
        """BM's (a shared group's kept pairs copied), and prefilled in chunks the group's blocks given back."""
        change = super().graduated(state, rows, decodes)
        if not self.chunked:
            return change
        paging = state.paging
        for row in rows:
            paging = paging.released(row)
        return replace(change, paging=paging)

    def prefill_pass(
        self, state: PoolState, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """One group's prompts (one length s: a single block) and their ids [R, s]; each row then holds
        min(s, ``kv_max``) pairs in slots [0, K) (a padded batch's rows: at their padded positions, no pad held).
        Prefilled in chunks: each row's chunk into its blocks (``slots.chunk_pass``); a row whose prompt ends in the
        pass then holds its choice (``compress``)."""
        if not self.chunked:
            return group_pass(self, state, work, prompts, device, "compress", kept=self.capacity)
        scratch = self.num_blocks * BLOCK
        step, ids = chunk_pass(self, state, work, prompts, device, state.paging.tables, BLOCK, scratch)
        compress, after = [], []
        for j, (w, (row, st)) in enumerate(zip(work, step.after)):
            s = w.phase.end - st.offset  # the prompt's pairs so far
            if s == prompts[j].numel():  # its prompt's last chunk
                compress.append((j, s, st.offset))
                held = min(s, self.capacity)
                st = replace(st, filled=held, ptr=held, high=held)
            after.append((row, st))
        return replace(step, compress=tuple(compress), after=tuple(after)), ids

    def pass_workspace(self, step: RowsPass) -> int:
        """A compress pass: the larger of the prompts' SDPA (``prompt_workspace``) and the window's choice
        (``attention._compress``); a chunked pass's (``slots.chunk_workspace``) and its compressing rows' choice, one
        at a time; a decode pass as BM's."""
        lay, m = self.layout, self.method
        if step.mask is not None:
            e = lay.dtype.itemsize
            chunk = chunk_workspace(self, step, BLOCK)
            heads = (lay.query_heads, lay.kv_heads, lay.k_dim)
            kept = [(s, min(s, m.kv_max)) for _, s, _ in step.compress]
            choice = max((choice_workspace_bytes(1, *heads, s, m.window, k, e) for s, k in kept), default=0)
            return chunk + choice
        if step.kind != "compress":
            return super().pass_workspace(step)
        (R, s) = step.qpos.shape
        choice = snap_workspace_bytes(
            R, lay.query_heads, lay.kv_heads, lay.k_dim, s, m.window, min(s, m.kv_max), lay.dtype.itemsize
        )
        return max(prompt_workspace(self, R, s), choice)
