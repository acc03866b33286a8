"""Continuous batching over a fixed pool of slots: which pass runs next, as a pure function of host state.

Every slot is a bounded cache: under BM a request never holds more than ``kv_max`` pairs per KV head from its first
token on, so a slot fits any request and admission needs no guess about the future (no reservation, no
preemption). A request runs its own schedule (``core.schedule.plan`` of its unpadded prompt and its own
``max_new_tokens``), so its tokens do not depend on which requests share its passes.

Two policies. ``continuous`` (the default): when a slot frees (EOS, a stop, or its ``max_new_tokens``), the next
queued request enters it (queue order, lowest free slot first). ``static``, the paper's padded batch: the next
``slots`` requests enter together once every slot is free; each row then runs the schedule of the batch's
left-padded prompt (Algorithm 1 for BM, at padded positions: its pads are counted as held and go first at the first
evictions, as in the paper), so its kept positions and tokens are the padded batch's. FKV and ED keep no pad and
evict nothing by score: their rows run the padded schedule on their own tokens (``dense.DensePool``).

Prefill passes run before the decode pass of the slots already decoding, up to ``prefill_budget`` prompt tokens between
two decode passes (None: no limit, so a new request is prefilled whole before the next decode pass). Under BM a pass
takes the next chunk of many rows, each at its own phase (and the look-ahead probe that follows a chunk, folded into the
same pass), up to ``pass_tokens`` rows x columns; with BM's ``chunk`` (wide passes) several consecutive blocks of each
of those rows, one sub-pass per block (``Step.subs``). The baselines prefill a group per pass: requests admitted
together into adjacent slots with prompts of one length (up to the longest prompt's tokens in all); with ``keys``,
adjacent requests of one key form a group instead (``Batching(share_prompts=True)`` keys identical prompts, whose
prefill then runs once for the whole group).
FKV's paged pool (``dense.PagedPool``) adds a second condition to admission: the request at the head of the queue
enters a free slot only when the pool's free blocks cover its prompt and generation (``need``), which it holds until
it ends; no request is passed over, none is preempted. Snap prefilled in chunks holds its prompt's full pairs in blocks
the same way, from its admission until its prefill ends (``transient``). FKV and snap prefilled in chunks take the
batched passes as BM's do: every prefilling request's next chunk, in admission order, up to ``pass_tokens`` (their
``chunk``) rows x columns a pass.
Every input is a host integer or the set of slots that finished, which every tensor-parallel rank knows alike: all
ranks schedule the same passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .method import Method
from .schedule import Phase, plan
from .step import SlotWork


@dataclass
class SlotRun:
    """A request in a slot: its phases and the next one to run."""

    request: int
    phases: list[Phase]
    admitted: int  # admission order (0, 1, ...)
    group: range  # the adjacent slots prefilled with it in one pass (its own slot alone, or more)
    cursor: int = 0

    @property
    def phase(self) -> Phase:
        return self.phases[self.cursor]

    @property
    def prefilling(self) -> bool:
        return self.phase.kind != "decode"

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.phases)

    def probe_after(self, k: int) -> Phase | None:
        """The look-ahead probe that follows phase ``k`` in the schedule, or None."""
        return self.phases[k + 1] if k + 1 < len(self.phases) and self.phases[k + 1].kind == "probe" else None


@dataclass(frozen=True)
class Step:
    """The next pass: ``kind`` and each slot's part (a group's slots for a prefill block; every decoding
    slot for a decode step; a mixed pass: the chunks' slots, then every decoding slot). ``admitted``: the groups that
    entered their slots just before this pass."""

    kind: str
    work: tuple[SlotWork, ...]
    admitted: tuple[tuple[range, tuple[int, ...]], ...] = ()  # (slots, their requests) per group admitted
    subs: tuple[tuple[SlotWork, ...], ...] = ()  # a wide pass (BM ``chunk``): its blocks, one work tuple each, in order


@dataclass
class Scheduler:
    """The pass-by-pass schedule of ``lengths[i]``-token prompts generating ``max_new[i]`` tokens each in ``slots``
    slots. Call ``next_step()``, run it, then ``complete(step, finished)`` with the slots whose request ended early
    (EOS or a stop string); a request that reached its ``max_new_tokens`` ends by itself. ``keys``: what adjacent
    requests admitted together must share to form one group (None: their prompt length; equal keys must mean equal
    lengths)."""

    method: Method
    lengths: list[int]
    max_new: list[int]
    slots: int
    prefill_budget: int | None = None
    keys: list | None = None
    pass_tokens: int | None = None  # BM: most prompt tokens per prefill pass (None: ``Method.pass_tokens(slots)``)
    static: bool = False  # the paper's padded batches instead of continuous refills
    pad_to: int = 0  # static: the padded length, when longer than a batch's longest prompt
    blocks: int = 0  # FKV paged: the pool's K/V blocks (0: every slot fits any request)
    need: list[int] | None = None  # FKV paged: the blocks each request holds from admission to its end
    transient: bool = False  # the blocks go back when a request's prefill ends (snap prefilled in chunks), not its end
    mixed: bool = False  # continuous FKV in chunks: a prefill pass takes every decoding row's next step along
    pads: list[int] = field(init=False)  # per request: the left pads it runs with (static BM), else 0
    free_blocks: int = field(init=False)  # FKV paged: blocks no running request holds
    queue: deque = field(init=False)
    running: list[SlotRun | None] = field(init=False)
    log: list[tuple[int, int, int]] = field(init=False, default_factory=list)  # (pass, slot, request) admissions
    passes: int = field(init=False, default=0)
    _since_decode: int = field(init=False, default=0)  # prompt tokens prefilled since the last decode step

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if len(self.lengths) != len(self.max_new) or (self.keys is not None and len(self.keys) != len(self.lengths)):
            raise ValueError("lengths, max_new and keys must have one entry per request")
        if self.pass_tokens is None:
            self.pass_tokens = self.method.pass_tokens(self.slots)
        elif self.method.pass_tokens(self.slots) is None or self.pass_tokens < 1:
            raise ValueError(f"pass_tokens: a positive number of tokens for a BM pool, got {self.pass_tokens}")
        if self.need is not None and (len(self.need) != len(self.lengths) or max(self.need, default=0) > self.blocks):
            raise ValueError(f"need: one entry per request, each at most the pool's {self.blocks} blocks")
        self.free_blocks = self.blocks
        self.queue = deque(range(len(self.lengths)))
        self.pads = [0] * len(self.lengths)
        self.running = [None] * self.slots

    def _admit(self) -> tuple[tuple[range, tuple[int, ...]], ...]:
        if self.static and any(run is not None for run in self.running):
            return ()  # a padded batch is refilled only once all of it has finished
        entered = []  # (slot, request) in slot order
        for slot in range(self.slots):
            if self.running[slot] is None and self.queue:
                if self.need is not None:  # paged: queue order, admitted once the free blocks cover it
                    if self.need[self.queue[0]] > self.free_blocks:
                        break
                    self.free_blocks -= self.need[self.queue[0]]
                entered.append((slot, self.queue.popleft()))
        groups: list[list[tuple[int, int]]] = []
        key = self.lengths if self.keys is None else self.keys
        # A group of one length computes all its rows in one pass: at most the longest prompt's tokens, the one
        # prefill the planner counts (predict_pool). A shared prompt's group computes one row.
        room = max(self.lengths, default=0)
        for slot, i in entered:  # adjacent slots, one key (by default: prompts of one length)
            last = groups[-1][-1] if groups else None
            batched_alone = self.batched and self.keys is None  # batched prefill needs no groups of one length
            fits = groups and (self.keys is not None or (len(groups[-1]) + 1) * self.lengths[i] <= room)
            if fits and last[0] == slot - 1 and key[last[1]] == key[i] and not batched_alone:
                groups[-1].append((slot, i))
            else:
                groups.append([(slot, i)])
        padded = max([self.pad_to] + [self.lengths[i] for _, i in entered])  # the padded batch's length (static)
        admitted = []
        for group in groups:
            rows = range(group[0][0], group[-1][0] + 1)
            for slot, i in group:
                # BM: the first block in passes of p, beside other rows (FKV and snap in chunks: their blocks are)
                chunk = self.method.first_block_chunk if self.batched else None
                if self.static:
                    self.pads[i] = padded - self.lengths[i]
                length = self.lengths[i] + self.pads[i]
                self.running[slot] = SlotRun(i, plan(self.method, length, self.max_new[i], chunk), len(self.log), rows)
                self.log.append((self.passes, slot, i))
            admitted.append((rows, tuple(i for _, i in group)))
        return tuple(admitted)

    def next_step(self) -> Step | None:
        """The next pass, or None when every request has finished."""
        admitted = self._admit()
        active = [(s, run) for s, run in enumerate(self.running) if run is not None]
        if not active:
            return None
        prefilling = sorted(((run.admitted, s) for s, run in active if run.prefilling))
        decoding = tuple(SlotWork(s, run.phase) for s, run in active if not run.prefilling)
        budget_left = self.prefill_budget is None or self._since_decode < self.prefill_budget
        if prefilling and self.mixed and decoding and not self.static:  # one pass for both (vLLM's chunked prefill)
            chunks = self._batched_prefill([self.running[s] for _, s in prefilling], admitted)
            return Step("mixed", chunks.work + decoding, admitted)
        if prefilling and (budget_left or not decoding):
            if self.batched:
                return self._batched_prefill([self.running[s] for _, s in prefilling], admitted)
            run = self.running[prefilling[0][1]]
            phase = run.phase  # the whole group is at this phase: its rows advance together
            return Step(phase.kind, tuple(SlotWork(s, phase) for s in run.group), admitted)
        return Step("decode", decoding, admitted)

    @property
    def batched(self) -> bool:
        """Whether prefill passes take many rows at their own positions (BM's pool; the dense pools prefill one
        group of one prompt length at a time)."""
        return self.pass_tokens is not None

    def _batched_prefill(self, runs: list[SlotRun], admitted) -> Step:
        """The next prefill pass of many groups, each at its own phase (a prefill chunk), in admission order, while
        the pass's rows x columns fit ``pass_tokens`` (at least one group; ``_pass_groups``). Each row feeds as many
        columns as the pass's longest chunk. A chunk that a look-ahead probe follows takes its probe along
        (``SlotWork.probe``): every row of the pass then feeds the rule's window more columns. BM's ``chunk``: a wide
        pass of those groups (``_wide_prefill``)."""
        chosen, others = self._pass_groups(runs)
        if self.method.wide:
            return self._wide_prefill(chosen, admitted)
        if not others:  # a lone group: its first block in as few passes as fit
            work = self._first_block(chosen[0], self.method.lookahead)
        else:
            work = [SlotWork(s, run.phase, run.probe_after(run.cursor)) for run in chosen for s in run.group]
        return Step("prefill", tuple(work), admitted)

    def _pass_groups(self, runs: list[SlotRun]) -> tuple[list[SlotRun], bool]:
        """The prefilling groups (each group's first run) a pass takes, in admission order, while their next chunks
        (and the probes some take: the rule's window more columns for every row) fit ``pass_tokens``, at least one;
        and whether any other group is prefilling."""
        chosen, seen, width, probing = [], set(), 0, False
        window = self.method.lookahead
        for run in runs:
            if run.group.start in seen:
                continue
            seen.add(run.group.start)
            probe = run.probe_after(run.cursor) is not None
            size = max(width, run.phase.size)
            if chosen and len(seen) * (size + (window if probing or probe else 0)) > self.pass_tokens:
                break
            width, probing = size, probing or probe
            chosen.append(run)
        return chosen, len(seen) > 1

    def _wide_prefill(self, chosen: list[SlotRun], admitted) -> Step:
        """A wide pass (BM with ``chunk``) of the groups ``chosen`` (``_pass_groups``): as many consecutive blocks of
        all of them as fit ``pass_tokens`` in all (at least one), each block of the rows one sub-pass (``Step.subs``),
        stopping before any row's prefill ends or its next phase is not a prefill block. ``work``: each row's blocks
        as one phase, ``phases`` the phases they consume (probes included), for ``complete`` and the engine."""
        window = self.method.lookahead
        cursors, subs, used = [run.cursor for run in chosen], [], 0
        while all(c < len(run.phases) and run.phases[c].kind == "prefill" for run, c in zip(chosen, cursors)):
            units = [(run.phases[c], run.probe_after(c)) for run, c in zip(chosen, cursors)]
            n = max(phase.size for phase, _ in units)
            cost = len(chosen) * (n + (window if any(probe for _, probe in units) else 0))
            if subs and used + cost > self.pass_tokens:
                break
            used += cost
            subs.append(
                tuple(SlotWork(s, phase, probe) for run, (phase, probe) in zip(chosen, units) for s in run.group)
            )
            cursors = [c + 1 + (probe is not None) for c, (_, probe) in zip(cursors, units)]
        work = []
        for run, c in zip(chosen, cursors):
            first, last = run.phase, run.phases[c - 1 if run.phases[c - 1].kind == "prefill" else c - 2]
            merged = Phase("prefill", first.start, last.end, first.evict)
            work.extend(SlotWork(s, merged, None, c - run.cursor) for s in run.group)
        return Step("prefill", tuple(work), admitted, tuple(subs))

    def _first_block(self, run: SlotRun, window: int) -> list[SlotWork]:
        """A group alone in its pass runs its first block's next chunks as one (nothing is evicted inside the first
        block, so this is Algorithm 1 still), as many as its rows x columns fit ``pass_tokens``, and the probe that
        follows the block's last chunk, if any."""
        rows, phases, k, merged = len(run.group), run.phases, run.cursor, run.phase
        while k + 1 < len(phases) and phases[k + 1].kind == "prefill" and phases[k + 1].evict == 0:
            grown = Phase("prefill", merged.start, phases[k + 1].end, 0)
            if rows * (grown.size + (window if run.probe_after(k + 1) else 0)) > self.pass_tokens:
                break
            merged, k = grown, k + 1
        return [SlotWork(s, merged, run.probe_after(k), k - run.cursor + 1) for s in run.group]

    def complete(self, step: Step, finished: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """Advance the slots ``step`` ran; free those whose request ended. Returns the (slot, request) pairs freed."""
        self.passes += 1
        if step.kind in ("decode", "mixed"):
            self._since_decode = 0
        elif step.kind == "prefill":
            self._since_decode += sum(w.phase.size for w in step.work)
        freed = []
        for work in step.work:
            run = self.running[work.row]
            prefilled = run.prefilling
            run.cursor += work.phases + (work.probe is not None)  # its chunks, and the probe that ran beside them
            over = prefilled and (run.done or not run.prefilling)  # its prefill is over
            if self.transient and self.need is not None and over:
                self.free_blocks += self.need[run.request]
            if run.done or work.row in finished:
                freed.append((work.row, run.request))
                self.running[work.row] = None
                if self.need is not None and not self.transient:
                    self.free_blocks += self.need[run.request]
        return freed
