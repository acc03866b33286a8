"""The baselines' pools (FKV, ED): per layer keys/values [S, H, C + 1, D] holding slots ``[0, length)`` of each row;
C = ``kv_max`` for ED, the longest prompt + generation for FKV (each slot reserves a whole request, so admission never
needs more); FKV paged (``PagedPool``) holds its rows' positions in blocks shared by the rows instead. A prefill pass
attends over its own pairs (SDPA, causal) and writes what the row keeps: FKV the prompt, ED its newest pair alone, into
slot 0 (Algorithm 3's first eviction). A group admitted with ``shared=True`` holds one prompt several times: its
prefill runs on the first row alone and its ``graduated`` change copies that row into the others.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .method import FullCache, Method
from .slots import (
    RowState,
    SlotLayer,
    SlotPool,
    chunk_pass,
    chunk_workspace,
    group_pass,
    prompt_workspace,
    to_device,
    write_blocks,
)
from .step import Change, Eviction, PoolState, RowsPass, SlotWork
from .workspace import paged_decode_workspace_bytes


class DensePoolLayer(SlotLayer):
    """One decoder layer of the baselines' pool: keys/values [S, H, C + 1, D]; row r holds slots [0, length)."""

    score = None  # no score sums

    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Each row's columns [R, H, n, D] at its slots ``step.write`` [R, n] (masked columns, idle rows and the
        prompt pairs ED does not keep: the scratch column); the rows are adjacent (``step.span``)."""
        R, H, n, _ = key_states.shape
        idx = step.write[:, None, :, None]  # [R, 1, n, 1]
        for dst, src in ((self.keys, key_states), (self.values, value_states)):
            dst[step.span].scatter_(2, idx.expand(R, H, n, dst.shape[-1]), src)


class DensePool(SlotPool):
    """The baselines' pools: prefill on the model's SDPA over a pass's own pairs, decode on ``core.attention``'s fused
    grouped product, no score sums. Slots [0, length) of a row hold its last ``length`` positions, in order."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, static: bool = False):
        super().__init__(method, num_layers, slots, capacity, DensePoolLayer, static)

    def kept_slots(self, s: int) -> list[int]:
        """Where each of a prompt's s pairs goes (the scratch column C: not kept)."""
        raise NotImplementedError

    def held_after_prompt(self, s: int, decodes: bool) -> int:
        """Pairs a row holds once its s-token prompt is prefilled (``decodes``: a decode step follows)."""
        return s

    def prefill_pass(
        self, state: PoolState, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """One group's prompts (one length s: a single block) and their ids [k, s]; each row keeps what
        ``kept_slots`` says. A padded batch's rows hold no pad: their positions are the padded batch's, their tokens
        their own. FKV prefilled in chunks: each row's chunk (``slots.chunk_pass``), its slots in its row (a block of
        C + 1 positions)."""
        if self.chunked:
            tables = tuple((r,) for r in range(self.slots))
            return chunk_pass(self, state, work, prompts, device, tables, self.chunk_block, self.capacity)
        return group_pass(self, state, work, prompts, device, "prefill", self.kept_slots)

    @property
    def chunked(self) -> bool:
        """Whether the method prefills in chunks (FKV's ``chunk`` > 0; ``slots.chunk_pass``)."""
        return self.method.pass_tokens(self.slots) is not None

    @property
    def chunk_block(self) -> int:
        """Positions per block of a chunked prefill's storage (a row's C + 1 slots)."""
        return self.capacity + 1

    @property
    def mixes(self) -> bool:
        """Whether a prefill pass can take the decoding rows' next step along (``mixed_pass``): FKV prefilled in
        chunks."""
        return self.chunked

    def mixed_pass(
        self,
        state: PoolState,
        chunks: tuple[SlotWork, ...],
        decoding: tuple[SlotWork, ...],
        prompts: list[torch.Tensor],
        device,
    ) -> tuple[RowsPass, torch.Tensor]:
        """A chunked prefill pass of ``chunks`` (``prefill_pass``) and a decode step of ``decoding`` (``decode_pass``)
        in one model call (vLLM's chunked prefill: the weights are read once for both), and the chunks' ids [R, n].
        The model's columns are the chunks' rows flattened, then one per pool row: positions [1, R x n + S]; each part
        keeps its own description (``RowsPass.mixed``), the rows of the two disjoint."""
        chunked, ids = self.prefill_pass(state, chunks, prompts, device)
        step = self.decode_pass(state, decoding, device)
        positions = torch.cat([chunked.positions.reshape(1, -1), step.positions.reshape(1, -1)], dim=1)
        mixed = replace(
            chunked,
            kind="mixed",
            positions=positions,
            mixed=(chunked, step),
            after=chunked.after + step.after,
            paging=step.paging,
        )
        return mixed, ids

    def pass_workspace(self, step: RowsPass) -> int:
        """A group's prompts on SDPA (``prompt_workspace``); a chunked pass's (``slots.chunk_workspace``); a decode
        pass's fused product (``SlotPool``)."""
        if step.mixed is not None:  # its parts, one after the other in each layer
            return max(self.pass_workspace(part) for part in step.mixed)
        if step.kind == "decode":
            return super().pass_workspace(step)
        if step.mask is not None:
            return chunk_workspace(self, step, self.chunk_block)
        return prompt_workspace(self, *step.qpos.shape)

    def graduated(self, state: PoolState, rows: range, decodes: list[bool]) -> Change:
        """The group's prompt is held (each row what ``held_after_prompt`` says); a shared group's first row, the one
        its prefill ran on, becomes every row."""
        first = state.rows[rows.start]
        s = first.seen - first.offset
        after = tuple(
            (row, RowState(seen=first.seen, length=self.held_after_prompt(s, more), offset=first.offset))
            for row, more in zip(rows, decodes)
        )
        return replace(super().graduated(state, rows, decodes), after=after)

    def decode_pass(self, state: PoolState, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: ED's keep-newest where a row's step evicts, each row's write slot, and the
        additive mask [S, span] of the slots each row holds (idle rows: slot 0 alone, finite and never used)."""
        S, C = self.slots, self.capacity
        write, seen, lengths, evicting = [C] * S, [-1] * S, [1] * S, []
        after = {w.row: state.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for w in work:
            st = after[w.row]
            if w.phase.evict:  # ED (Algorithm 3): only the newest pair stays, moved to slot 0
                evicting.append((w.row, st.length - 1, st.seen - 1, None, None))
                st.length = 1
            write[w.row], seen[w.row] = st.length, st.seen
            st.length, st.seen = st.length + 1, st.seen + 1
            lengths[w.row] = st.length
        hi = C if self.static else max(lengths[w.row] for w in work)
        return self._decode_pass(work, write, seen, hi, evicting, device, lengths, after=after)

    def kept_positions(self, state: PoolState, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the positions row ``row`` holds in ``state`` (slots [0, length) hold the last
        ``length`` positions, in order)."""
        st = state.rows[row]
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
        write_blocks(self.keys, self.values, step.write, key_states, value_states)


@dataclass(frozen=True)
class Paging:
    """FKV paged's blocks as host state (a value: each change makes a new one): each row's table of blocks
    (``tables``), the free blocks (``free``, ascending: the lowest is taken first), each block's decoding row
    (``owner``; the pool's row count: none) and its filled positions (``fill``), the scratch block's last."""

    tables: tuple[tuple[int, ...], ...]
    free: tuple[int, ...]
    owner: tuple[int, ...]
    fill: tuple[int, ...]

    @classmethod
    def empty(cls, slots: int, blocks: int) -> Paging:
        return cls(((),) * slots, tuple(range(blocks)), (slots,) * (blocks + 1), (0,) * (blocks + 1))

    def reserved(self, row: int, need: int) -> Paging:
        """Row ``row`` takes the ``need`` lowest free blocks."""
        if need > len(self.free):
            raise RuntimeError(f"row {row}: {need} blocks needed, {len(self.free)} free (the scheduler admits by them)")
        tables = self.tables[:row] + (self.free[:need],) + self.tables[row + 1 :]
        return replace(self, tables=tables, free=self.free[need:])

    def released(self, row: int) -> Paging:
        """Row ``row``'s blocks go back (free, no owner, empty)."""
        owner, fill, mine = list(self.owner), list(self.fill), self.tables[row]
        for b in mine:
            owner[b], fill[b] = len(self.tables), 0
        tables = self.tables[:row] + ((),) + self.tables[row + 1 :]
        return Paging(tables, tuple(sorted(self.free + mine)), tuple(owner), tuple(fill))

    def held(self, row: int, length: int, block: int) -> Paging:
        """Row ``row``'s blocks, held by it, with the positions its ``length`` fills in each."""
        owner, fill = list(self.owner), list(self.fill)
        for j, b in enumerate(self.tables[row]):
            owner[b], fill[b] = row, max(0, min(block, length - j * block))
        return replace(self, owner=tuple(owner), fill=tuple(fill))


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
        SlotPool.__init__(self, method, num_layers, slots, blocks * method.block, PagedLayer, static)

    def kv_dims(self, heads: int, slots: int) -> tuple[int, ...]:
        return (self.num_blocks + 1, heads, self.block)

    def initial(self) -> PoolState:
        """Every row empty, every block free."""
        return replace(super().initial(), paging=Paging.empty(self.slots, self.num_blocks))

    def admitted(
        self, state: PoolState, rows: range, offsets: list[int], lengths: list[int], max_new: list[int]
    ) -> Change:
        """Each request's blocks (``FullCache.blocks``), taken now."""
        paging = state.paging
        for row, s, t in zip(rows, lengths, max_new):
            paging = paging.reserved(row, self.method.blocks(s, t))
        return replace(super().admitted(state, rows, offsets, lengths, max_new), paging=paging)

    def graduated(self, state: PoolState, rows: range, decodes: list[bool]) -> Change:
        """``DensePool``'s, each row's blocks then held by it with their filled positions; a shared group's fork copies
        the blocks holding its first row's prompt into the other rows' first blocks (each request holds as many
        blocks as its own generation needs: at least the prompt's)."""
        change, paging = super().graduated(state, rows, decodes), state.paging
        for row, st in change.after:
            paging = paging.held(row, st.length, self.block)
        if change.fork is not None:
            st = state.rows[rows.start]
            n = -(-(st.seen - st.offset) // self.block)  # the prompt's blocks
            first = paging.tables[rows.start][:n]
            change = replace(change, blocks=tuple((first, paging.tables[row][:n]) for row in rows[1:]))
        return replace(change, paging=paging)

    def finished(self, state: PoolState, row: int) -> Change:
        return Change(paging=state.paging.released(row))

    def _where(self, tables: tuple[tuple[int, ...], ...], row: int, j: int) -> int:
        """Where row ``row``'s slot j lives: block ``tables[row][j // Bs]``, position j % Bs (block x Bs + offset)."""
        return tables[row][j // self.block] * self.block + j % self.block

    @property
    def chunk_block(self) -> int:
        return self.block

    def prefill_pass(
        self, state: PoolState, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor]:
        """One group's prompts (one length s, one block) and their ids [k, s]; row r writes its slots [0, s). Prefilled
        in chunks: each row's chunk into its blocks (``slots.chunk_pass``)."""
        if self.chunked:
            return chunk_pass(self, state, work, prompts, device, state.paging.tables, self.block, self.capacity)
        step, ids = group_pass(self, state, work, prompts, device, "prefill")
        s, tables = ids.shape[1], state.paging.tables
        write = to_device([[self._where(tables, w.row, j) for j in range(s)] for w in work], device)
        return replace(step, write=write), ids

    def fork(self, change: Change) -> None:
        """Copy each (source, destination) pair of block lists of a shared prefill's fork (``change.blocks``)."""
        for first, own in change.blocks:
            src, dst = (torch.tensor(t, device=self.layers[0].keys.device) for t in (first, own))
            for layer in self.layers:
                for t in (layer.keys, layer.values):
                    t[dst] = t[src]

    def decode_pass(self, state: PoolState, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: each decoding row writes its next slot; the blocks of the decoding rows
        (each with its filled positions after the pass) enter the attention, up to the highest one held."""
        S, C, paging = self.slots, self.capacity, state.paging
        tables = paging.tables
        hi = self.num_blocks + 1 if self.static else 1 + max(max(tables[w.row]) for w in work)
        write, seen, fill = [C] * S, [-1] * S, list(paging.fill)  # the blocks' fill after the pass
        after = {w.row: state.rows[w.row].copy() for w in work}  # each row's state after the pass (a copy)
        for w in work:
            st = after[w.row]
            write[w.row], seen[w.row] = self._where(tables, w.row, st.length), st.seen
            st.length, st.seen = st.length + 1, st.seen + 1
            fill[tables[w.row][(st.length - 1) // self.block]] += 1
        first = work[0].row  # a block no decoding row holds goes to it, masked whole (it adds exp(-inf) = 0)
        owner = [first if r == S else r for r in paging.owner[:hi]]
        step = self._decode_pass(work, write, seen, hi, [], device, blocks=(owner, fill[:hi]), after=after)
        return replace(step, paging=replace(paging, fill=tuple(fill)))

    def pass_workspace(self, step: RowsPass) -> int:
        """A decode pass block by block (``attention._paged_decode``); a prompt as ``DensePool``'s."""
        if step.kind != "decode":
            return super().pass_workspace(step)
        keys = self.layers[0].keys  # [N + 1, H, Bs, D]
        H, D, Hq = keys.shape[1], keys.shape[-1], self.layout.query_heads
        return paged_decode_workspace_bytes(step.qpos.shape[0], Hq, H, step.hi, self.block, D, keys.element_size())
