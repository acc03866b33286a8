"""The baselines' pools (FKV, ED): per layer keys/values [S, H, C + 1, D] holding slots ``[0, length)`` of each row;
C = ``kv_max`` for ED, the longest prompt + generation for FKV (each slot reserves a whole request, so admission never
needs more); FKV paged (``PagedPool``) holds its rows' positions in blocks shared by the rows instead. A prefill pass
attends over its own pairs (SDPA, causal) and writes what the row keeps: FKV the prompt, ED its newest pair alone, into
slot 0 (Algorithm 3's first eviction). A group admitted with ``shared=True`` holds one prompt several times: its
prefill runs on the first row alone and ``graduate`` copies that row into the others.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import torch

from .method import FullCache, Method
from .slots import RowState, SlotLayer, SlotPool, group_pass, prompt_workspace, to_device
from .step import Eviction, RowsPass, SlotWork
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
        return group_pass(self, work, prompts, device, "prefill", self.kept_slots)

    def pass_workspace(self, step: RowsPass) -> int:
        """A group's prompts on SDPA (``prompt_workspace``); a decode pass's fused product (``SlotPool``)."""
        if step.kind == "decode":
            return super().pass_workspace(step)
        return prompt_workspace(self, *step.qpos.shape)

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
        SlotPool.__init__(self, method, num_layers, slots, blocks * method.block, PagedLayer, static)
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
        step, ids = group_pass(self, work, prompts, device, "prefill")
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
        """``SlotPool.ready``; a decode pass also counts each decoding row's new position in its block."""
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
