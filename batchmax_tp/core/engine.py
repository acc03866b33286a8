"""The one engine: generation over a fixed pool of bounded slots, one pass per ``Engine.step``.

``Engine(model, method, slots)`` holds what every run shares (the model, the method, how many slots, the
tensor-parallel group, how decode passes run, how requests share passes). ``engine.run(requests)`` serves a list of
requests (``core.requests``) and returns one output per request; it is ``start``, then ``step`` until every request
has ended, then ``finish``. A run owns its pool (``core.pool``: storage, allocated at ``start`` from the model's shape
and the run's longest request, freed at ``finish``), the pool's host state (``state``: a ``step.PoolState`` value,
each row's integers and FKV paged's blocks) and its scheduler (``core.scheduler``), and each ``step`` is one pass, in
one direction:

    schedule (``Scheduler.next_step``; the requests that enter: the pool's ``admitted`` change) -> describe (the
    pool's ``prefill_pass``/``decode_pass`` of the state: the pass and the rows' states after it) -> run the model
    (the pool's ``ready``: the pass's evictions and bookkeeping; ``core.replay.forward_pass``: the attention reads
    the description and the pool's storage) -> sample (``_Sampler``, agreed across ranks) -> retire
    (``Scheduler.complete``; the pool's ``finished`` change).

Every change of the state is described by a pure function of it (a pass, ``admitted``, ``graduated``, ``finished``:
``step.Change``); the engine takes the state after it (``PoolState.changed``) and the pool executes the change's
storage part (``apply``); nothing else assigns either.

Under the default ``continuous`` policy, when a request ends (its EOS, a stop, or its ``max_new_tokens``) the next
one enters its slot at once; each request runs its own schedule on its unpadded prompt, so its tokens equal the naive
reference (``tests/reference.py``) on that prompt alone (up to the float rounding of a wider pass) and do not depend
on which requests shared its passes. Under the ``static`` policy the requests run as the paper's padded batches
(``bench.padded.generate``, the paper's procedure): every row runs Algorithm 1 (BM) or 3 (ED) on the batch's padded
prompt, at padded positions.

Memory is fixed before the first pass: the pool's K/V and bookkeeping (``planner.predict_pool``) plus the largest
pass's workspace. Under BM every slot is bounded by ``kv_max`` from its first token, so admission is exact: no
reservation, no preemption.

The host reads a pass's tokens only when it needs them: when finishing depends on the tokens (EOS, stops) or a
continuation is scored, at once; otherwise one pass late, after the next pass is launched (``lag``), so that on a GPU
the host describes pass t + 1 while pass t runs instead of waiting for it. A request that ends is then handed to
``on_finish`` once its last token has been read.

Tensor parallelism: the schedule is a pure function of host state every rank has (the queue, the pass count and
which slots finished). When finishing depends on tokens (EOS or stops), each pass's tokens are broadcast from the
group's first rank, and every ``AGREE_EVERY`` passes the ranks compare a digest of their admission logs: a
divergence stops the job with an error instead of a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from transformers.generation.logits_process import LogitsProcessorList

from . import replay
from .attention import use_batchmax_attention
from .method import Method
from .pool import make_pool
from .products import float32_products
from .replay import forward_pass
from .requests import Batching, Record, Request, RequestOutput, Sampling, ServeOutput, check_requests
from .scheduler import Scheduler, Step
from .slots import kv_layout, to_device
from .step import Change, RowsPass, SlotWork

logger = logging.getLogger(__name__)

AGREE_EVERY = 64  # passes between two checks that the tensor-parallel ranks still run the same schedule


def _pool(
    model: torch.nn.Module,
    method: Method,
    slots: int,
    lengths: list[int],
    max_new: list[int],
    static: bool,
    padded: bool = False,
):
    """The method's pool (``static``: one decode-pass shape for the whole run, ``core.replay``), its rows as large
    as the longest request needs (BM and ED ``kv_max``, FKV its prompt + generation; no request: a replica whose
    share is done, the pool is never written), and the blocks each request holds (None: none). FKV paged: the memory
    of ``slots`` such rows in blocks, and as many rows as the requests can hold at once (their smallest first). Snap
    prefilled in chunks: blocks for ``Snap.prefills`` of the longest prompts' full pairs (``padded``, the paper's
    padded batches: for every slot, so that a batch enters whole)."""
    cap = max((method.decode_capacity(s, t) for s, t in zip(lengths, max_new)), default=1)
    layers = model.config.num_hidden_layers
    need = [method.blocks(s, t) for s, t in zip(lengths, max_new)]
    if not any(need):
        return make_pool(method, layers, slots, cap, static), None
    if method.transient_blocks:
        at_once = slots if padded else method.prefills
        return make_pool(method, layers, slots, cap, static, at_once * max(need)), need
    blocks = slots * max(need, default=1)  # the longest request's blocks per slot
    rows = len(list(itertools.takewhile(lambda held: held <= blocks, itertools.accumulate(sorted(need)))))
    return make_pool(method, layers, max(slots, rows), cap, static, blocks), need


def _to_host(tokens: torch.Tensor):
    """Start copying ``tokens`` [k] to the host without waiting: (the host tensor, the event that marks the copy done;
    None off CUDA, where the copy is done on return)."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _read(host: torch.Tensor, event) -> list[int]:
    """The tokens a ``_to_host`` copy brought, once it is done (waits for that copy alone, not for later work)."""
    if event is not None:
        event.synchronize()
    return host.tolist()


def _tensor_parallel(group):
    """The tensor-parallel group, when it has more than one rank (else None)."""
    return group if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1 else None


def _digest(log: list[tuple[int, int, int]], passes: int) -> int:
    return zlib.crc32(repr((passes, log)).encode()) & 0x7FFFFFFF


def _agree(group, value: int, device: torch.device) -> None:
    """Raise on every rank of ``group`` unless all of them hold the same ``value``."""
    t = torch.tensor([value, -value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != value or -int(t[1]) != value:
        raise RuntimeError(
            "tensor-parallel ranks diverged: their continuous-batching schedules differ (the "
            "requests, the settings or the tokens each rank saw are not the same)"
        )


class _Sampler:
    """How each row's next token is chosen: greedy (no ``warpers``), or sampled through the warpers with the row's own
    generator, seeded when its request is admitted."""

    def __init__(self, warpers: LogitsProcessorList | None, slots: int, device: torch.device):
        self.warpers, self.device = warpers, device
        self.gens: list[torch.Generator | None] = [None] * slots

    def seed(self, row: int, seed: int | None) -> None:
        if self.warpers is not None:
            self.gens[row] = torch.Generator(device=self.device)
            self.gens[row].manual_seed(0 if seed is None else seed)

    def choose(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Tokens [k] from logits [k, V] of ``rows``."""
        if self.warpers is None:
            return logits.argmax(dim=-1)
        picks = [
            torch.multinomial(
                torch.softmax(self.warpers(None, logits[j : j + 1].float()), dim=-1), 1, generator=self.gens[r]
            ).view(1)
            for j, r in enumerate(rows)
        ]
        return torch.cat(picks)


class _Agreement:
    """What tensor-parallel ranks agree on (nothing without a group of several ranks): the tokens every rank feeds
    (the group's first rank's, when finishing depends on them) and, every few passes, that all ran one schedule."""

    def __init__(self, tp_group, token_bound: bool, device: torch.device):
        """``token_bound``: whether a request's end depends on its tokens (EOS or stops)."""
        self.group, self.token_bound, self.device = _tensor_parallel(tp_group), token_bound, device

    def tokens(self, tokens: torch.Tensor) -> list[int]:
        """Host tokens; under TP, when finishing depends on them, the group's first rank's."""
        if self.group is not None and self.token_bound:
            dist.broadcast(tokens, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tokens.tolist()

    def schedule(self, sched: Scheduler, every: int = 1) -> None:
        """Once every ``every`` passes: raise unless all ranks ran the same schedule."""
        if self.group is not None and sched.passes % every == 0:
            _agree(self.group, _digest(sched.log, sched.passes), self.device)


class _Metrics:
    """A run's clock and memory: seconds spent in each kind of pass (prefill, decode, and the first compiled or
    captured decode pass's compilation) and the smallest and largest K/V held after a prefill pass."""

    def __init__(self, compiles: bool):
        self.times = {"prefill": 0.0, "decode": 0.0, "compile": 0.0}
        self.compiles = compiles  # True until the first decode pass compiles or captures (timed as "compile")
        self.kv_low: int | None = None
        self.kv_high = 0
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def passed(self, kind: str, seconds: float, pool) -> None:
        """A pass of ``kind`` ("prefill" or "decode") took ``seconds``; a prefill pass may change what is allocated."""
        if kind == "decode" and self.compiles:  # the first compiled pass: its time is the compilation's
            kind, self.compiles = "compile", False
        self.times[kind] += seconds
        if kind == "prefill":
            kv = pool.kv_bytes()
            self.kv_low = min(kv, self.kv_low if self.kv_low is not None else kv)
            self.kv_high = max(self.kv_high, kv)


def _prompt_keys(requests: Sequence[Request]) -> list[int]:
    """Per request, the index of the first request with the same prompt (one key per distinct prompt)."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(r.input_ids), i) for i, r in enumerate(requests)]


class Engine:
    """``slots`` bounded slots of ``method`` over ``model`` (an unchanged Hugging Face causal LM). ``tp_group``: the
    tensor-parallel group, when there is one (every rank runs the same requests). ``compile``: how decode passes run
    (``core.replay``: ``"none"`` eager, ``"default"`` compiled, ``"cudagraphs"`` captured once and replayed,
    ``"auto"`` the fastest measured on the model's device type; the same tokens in every mode). ``batching``:
    continuous (the default) or the paper's static batches, and how prompts share passes.

    ``run(requests)`` serves a list of requests. Step by step: ``start(requests)``, then ``step()`` (one pass; False
    once every request has ended), then ``finish()`` (the run's outputs; the pool is freed). Between ``start`` and
    ``finish`` the engine holds the run: its pool (storage) and the pool's host state (``state``), its scheduler,
    which request each slot holds, each row's next input, the outputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        method: Method,
        slots: int,
        tp_group=None,
        compile: str = "auto",
        batching: Batching = Batching(),
    ):
        self.model, self.method, self.slots = model, method, slots
        self.tp_group, self.compile, self.batching = tp_group, compile, batching
        self.pool = self.sched = self.state = None
        self._hold: contextlib.ExitStack | None = None

    def __repr__(self) -> str:
        return f"Engine({self.method.label()}, slots={self.slots}, compile={self.compile!r}, {self.batching})"

    def run(
        self,
        requests: Sequence[Request],
        sampling: Sampling = Sampling(),
        on_finish: Callable[[int, RequestOutput], None] | None = None,
        record: Record = Record(),
    ) -> ServeOutput:
        """Every request's output (``outputs``, in request order) and the run's measurements; ``on_finish(i,
        output)`` is called as each request ends (once its last token is read)."""
        self.start(requests, sampling, on_finish, record)
        try:
            while self.step():
                pass
            return self.finish()
        finally:
            self.close()

    # -- a run: start, step, finish ---------------------------------------------------------------------------------
    @torch.no_grad()
    def start(
        self,
        requests: Sequence[Request],
        sampling: Sampling = Sampling(),
        on_finish: Callable[[int, RequestOutput], None] | None = None,
        record: Record = Record(),
    ) -> None:
        """Begin a run of ``requests``: check them (one ``ValueError`` line), allocate the pool, queue them. The
        model's attention is the engine's until ``finish`` or ``close``; a run that cannot start holds nothing."""
        if self.pool is not None:
            raise RuntimeError("the engine is already running a run: finish or close it first")
        try:
            self._start(requests, sampling, on_finish, record)
        except BaseException:
            self.close()
            raise

    def _start(self, requests, sampling: Sampling, on_finish, record: Record) -> None:
        model, method = self.model, self.method
        check_requests(requests, self.slots, getattr(model.config, "max_position_embeddings", None))
        self.requests, self.sampling, self.record, self.on_finish = requests, sampling, record, on_finish
        self.eos, self.pad = sampling.eos(), sampling.pad()
        self.device = device = next(model.parameters()).device
        mode = replay.resolve(self.compile, device, tensor_parallel=_tensor_parallel(self.tp_group) is not None)
        self.prompts = [torch.as_tensor(list(r.input_ids), dtype=torch.long, device=device) for r in requests]  # [s_i]
        self.lengths = [int(p.numel()) for p in self.prompts]
        self.ends = list(self.lengths)  # where each prompt ends: its length, plus its pads in a padded batch
        self.max_new = [r.max_new_tokens for r in requests]
        padded = self.batching.policy == "static"
        self.pool, need = _pool(model, method, self.slots, self.lengths, self.max_new, mode != "none", padded)
        self.state = self.pool.initial()  # the pool's host state: replaced whole by ``_change``, never edited
        rows = self.pool.slots  # FKV paged: more rows than ``slots`` where the requests are shorter than the longest
        if requests:  # (none: a replica whose share is done; its pool is never written)
            self.pool.allocate(kv_layout(model))
        self.sampler, self.metrics = _Sampler(sampling.warpers(), rows, device), _Metrics(compiles=mode != "none")
        # finishing hangs on the tokens (EOS or stops)?
        self.agreement = _Agreement(self.tp_group, bool(self.eos) or sampling.stop is not None, device)
        self.forcing = any(r.continuation is not None for r in requests)
        # read each pass's tokens one pass late (after the next pass is launched) when nothing needs them sooner
        self.lag = not self.agreement.token_bound and not self.forcing
        self.pending: list[tuple[list[int], torch.Tensor, object]] = []  # lag: (requests, host tokens, event) unread
        self.unread = [0] * len(requests)  # per request: its tokens chosen but not read yet
        self.ended: list[tuple[int, RequestOutput]] = []  # retired, waiting for their last tokens
        self.outputs: list[RequestOutput | None] = [None] * len(requests)
        self.request_of: list[int] = [-1] * rows
        self.shared: set[int] = set()  # first slot of each group prefilled once for all its rows
        self.group_of: list[range] = [range(r, r + 1) for r in range(rows)]  # each row's admission group
        self.next_ids = torch.full((rows,), self.pad, dtype=torch.long, device=device)  # [S] each row's next input
        self.no_logits = torch.empty(0, dtype=torch.long, device=device)  # ``logits_to_keep``: no column
        # [S, 1] all true, a decode pass's mask: the attention reads the description, not a mask, but without one
        # HF's mask builder looks for packed sequences in the position ids, a host sync in every pass
        self.all_true = torch.ones(rows, 1, dtype=torch.bool, device=device)
        self.decode_forward = replay.decode_runner(mode)  # eager, compiled or captured
        b = self.batching
        self.sched = Scheduler(
            method,
            self.lengths,
            self.max_new,
            rows,
            b.prefill_budget,
            _prompt_keys(requests) if b.share_prompts else None,
            b.pass_tokens,
            b.policy == "static",
            b.pad_to,
            blocks=self.pool.num_blocks,
            need=need,
            transient=method.transient_blocks,
            mixed=b.mixed and self.pool.mixes,
        )
        self._hold = contextlib.ExitStack()
        self._hold.enter_context(use_batchmax_attention(model))
        if mode == "none":  # eager: a half model's products on an AVX2 CPU run in float32 (``core.products``)
            dtype = next(model.parameters()).dtype
            self._hold.enter_context(float32_products(dtype, device, weights=model.parameters()))

    @torch.no_grad()
    def step(self) -> bool:
        """One pass of the run: schedule it, admit the requests that enter, describe it and run the model on it,
        sample each row's next token, retire the requests that ended. False once every request has ended (no pass
        ran)."""
        step = self.sched.next_step()  # schedule
        if step is None:
            return False
        for rows, group in step.admitted:
            self._admit(rows, group, self.batching.share_prompts and len(group) > 1)
        kind = "decode" if step.kind == "decode" else "prefill"  # a mixed pass's time: the prefill's
        t0 = time.perf_counter()
        run = {"decode": self._decode, "mixed": self._mixed}.get(step.kind, self._prefill)
        finished = run(step)  # describe, run, sample
        self.metrics.passed(kind, time.perf_counter() - t0, self.pool)
        for row, i in self.sched.complete(step, finished):  # retire
            self._retire(row, i)
            self._change(self.pool.finished(self.state, row))
        self._hand_on()
        self.agreement.schedule(self.sched, every=AGREE_EVERY)
        return True

    def finish(self) -> ServeOutput:
        """The run's outputs, schedule and measurements once ``step`` has returned False; the pool is freed."""
        self._read_all()
        self._hand_on()
        self.agreement.schedule(self.sched)
        pool, sched, m = self.pool, self.sched, self.metrics
        pool.note()
        logger.debug(
            "%s: %d requests in %d slots, %d passes", self.method.label(), len(self.requests), self.slots, sched.passes
        )
        out = ServeOutput(
            self.outputs,
            list(sched.log),
            sched.passes,
            m.times["prefill"],
            m.times["decode"],
            pool.peak_kv_bytes,
            (m.kv_low or 0, m.kv_high),
            pool.peak_meta_bytes,
            pool.peak_workspace_bytes,
            m.times["compile"],
            getattr(getattr(pool, "tier", None), "peak_row_bytes", 0),  # BM's recall tier (``core.tier``)
        )
        if out.tier_bytes:
            logger.info("%s: recall tier %.1f MiB a request at most", self.method.label(), out.tier_bytes / 2**20)
        self.close()
        return out

    def close(self) -> None:
        """End the run, finished or not: the pool's memory goes now (not at the next garbage collection: its layers
        refer to it) and the model's attention is its own again."""
        if self._hold is not None:
            self._hold.close()
            self._hold = None
        if self.pool is not None:
            self.pool.release()
        self.pool = self.sched = self.state = None

    # -- the parts of a pass ----------------------------------------------------------------------------------------
    def _change(self, change: Change) -> None:
        """Take a described change: the pool's host state after it (the only assignment of ``state``), then its
        storage part, executed by the pool (slots emptied, a shared prompt copied)."""
        self.state = self.state.changed(change)
        self.pool.apply(change)

    def _ready(self, described: RowsPass) -> RowsPass:
        """Take a described pass: its rows' states after it, then its storage part before the model call (the pool's
        ``ready``: evictions, bookkeeping); returns what the model call reads."""
        self.state = self.state.changed(described.change())
        return self.pool.ready(described)

    def _admit(self, rows: range, group: tuple[int, ...], shared: bool) -> None:
        pool, pads = self.pool, self.sched.pads
        lengths, max_new = [self.lengths[i] for i in group], [self.max_new[i] for i in group]
        self._change(pool.admitted(self.state, rows, [pads[i] for i in group], lengths, max_new))
        for i in group:
            self.ends[i] = self.lengths[i] + pads[i]
        if shared:
            self.shared.add(rows.start)
        for row, i in zip(rows, group):
            self.group_of[row] = rows
            self.request_of[row] = i
            self.outputs[i] = RequestOutput(
                [],
                row,
                self.sched.passes,
                logits=[] if self.record.logits else None,
                logprobs=[] if self.requests[i].continuation is not None else None,
            )
            self.sampler.seed(row, self.requests[i].seed)

    def _prefill(self, step: Step) -> set[int]:
        """One prefill pass of many rows' chunks (and the look-ahead probes folded in), each at its own position (a
        shared group: its first row alone), or a wide pass of several blocks of each (``Step.subs``, BM's ``chunk``);
        the rows whose prompt ends here (and the rest of their shared group) emit their first token."""
        pool = self.pool
        work = self._chunks(step.work)
        prompts = [self.prompts[self.request_of[w.row]] for w in work]
        if step.subs:  # a wide pass: several blocks of each row, their evictions inside each layer
            subs = tuple(self._chunks(sub) for sub in step.subs)
            described, ids = pool.wide_pass(self.state, subs, prompts, self.device)
        else:
            described, ids = pool.prefill_pass(self.state, work, prompts, self.device)
        keep = 1 if self._ending(work) else self.no_logits  # a pass no prompt ends in computes no logits
        out = forward_pass(self.model, self._ready(described), ids, torch.ones_like(ids, dtype=torch.bool), keep)
        pool.note()
        rows, index = self._graduate(work)
        if not rows:
            return set()
        logits = out.logits[:, -1].index_select(0, to_device(index, self.device))  # [k, V]
        return self._emit(rows, to_device(rows, self.device), logits, first_from=0)

    def _mixed(self, step: Step) -> set[int]:
        """One mixed pass (FKV in chunks, continuous): the prefill chunks of some rows and the next step of every
        decoding row in one model call (``DensePool.mixed_pass``); both kinds of row emit their tokens, in one emit
        (one read of the tokens under ``lag``)."""
        pool = self.pool
        work = self._chunks(tuple(w for w in step.work if w.phase.kind == "prefill"))
        decoding = tuple(w for w in step.work if w.phase.kind == "decode")
        prompts = [self.prompts[self.request_of[w.row]] for w in work]
        described, ids = pool.mixed_pass(self.state, work, decoding, prompts, self.device)
        R, n = ids.shape
        S = len(self.next_ids)
        ids = torch.cat([ids.reshape(-1), self.next_ids])[None]  # [1, R*n + S]: the chunks, then each row's step
        ending = self._ending(work)  # the chunks whose prompt ends here: their last columns' logits, then every step's
        keep = to_device([j * n + n - 1 for j in ending] + list(range(R * n, R * n + S)), self.device)  # [e + S]
        out = forward_pass(self.model, self._ready(described), ids, torch.ones_like(ids, dtype=torch.bool), keep)
        pool.note()
        logits = out.logits[0]  # [e + S, V]
        e = len(ending)
        steps = logits[e:].index_select(0, described.mixed[1].decoding)  # [k, V] the decoding rows'
        rows, index = self._graduate(work)
        if index:  # the graduating rows' first tokens, after the decoding rows' next
            first = to_device([ending.index(j) for j in index], self.device)
            steps = torch.cat([steps, logits[:e].index_select(0, first)])
        rows = [w.row for w in decoding] + rows
        return self._emit(rows, to_device(rows, self.device), steps, first_from=len(decoding))

    def _ending(self, work: tuple[SlotWork, ...]) -> list[int]:
        """The indices in ``work`` of the rows whose prompt ends in this pass (their last column gives a token)."""
        return [j for j, w in enumerate(work) if w.phase.end >= self.ends[self.request_of[w.row]]]

    def _chunks(self, work: tuple[SlotWork, ...]) -> tuple[SlotWork, ...]:
        """A prefill pass's rows: a shared group's first row alone."""
        return tuple(w for w in work if self.group_of[w.row].start not in self.shared or w.row in self.shared)

    def _graduate(self, work: tuple[SlotWork, ...]) -> tuple[list[int], list[int]]:
        """After a prefill pass of ``work``: the rows whose prompt ended in it (and the rest of their shared group)
        graduate (``pool.graduated``). Returns those rows and, for each, its work index (whose last column's logits
        give its first token)."""
        pool = self.pool
        rows, index = [], []
        for j in self._ending(work):
            w = work[j]
            group = self.group_of[w.row] if w.row in self.shared else range(w.row, w.row + 1)
            self.shared.discard(w.row)
            self._change(pool.graduated(self.state, group, [self.max_new[self.request_of[r]] > 1 for r in group]))
            rows.extend(group)
            index.extend([j] * len(group))
        return rows, index

    def _decode(self, step: Step) -> set[int]:
        """One decode step of every decoding slot, in one pass over the pool."""
        rows = [w.row for w in step.work]
        described = self.pool.decode_pass(self.state, step.work, self.device)
        model_step = self._ready(described)  # its evictions and its slots' bookkeeping, in every layer at once
        out = self.decode_forward(self.model, model_step, self.next_ids[:, None], self.all_true)
        index = described.decoding  # [k] the decoding rows
        return self._emit(rows, index, out.logits[:, -1].index_select(0, index), first_from=len(rows))  # [k, V]

    def _teach(self, rows: list[int], logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The next inputs [k] of ``rows``: the chosen ``tokens``, or, for a request with a continuation, its next
        continuation token, whose log-probability under ``logits`` [k, V] is recorded (kept on the device)."""
        if not self.forcing:
            return tokens
        targets = []
        for r in rows:
            i = self.request_of[r]
            cont, t = self.requests[i].continuation, len(self.outputs[i].tokens)
            targets.append(cont[t] if cont is not None and t < len(cont) else -1)
        target = torch.tensor(targets, device=self.device)  # [k]; -1: not forced
        logprob = torch.log_softmax(logits.float(), dim=-1).gather(1, target.clamp(min=0)[:, None])[:, 0]  # [k]
        for j, r in enumerate(rows):
            out = self.outputs[self.request_of[r]]
            if out.logprobs is not None and targets[j] >= 0:
                out.logprobs.append(logprob[j])
        return torch.where(target >= 0, target, tokens)

    def _emit(self, rows: list[int], index: torch.Tensor, logits: torch.Tensor, first_from: int) -> set[int]:
        """Choose, record and feed the next token of each of ``rows`` (``index``: the same rows on the device) from
        their logits [k, V] (``rows[first_from:]``: their first tokens, a prefill pass's); returns the rows whose
        request ended early (EOS or a stop). Under ``lag`` the tokens are read at the next emit (this pass is
        launched by then) or at ``finish``, and nothing ends early."""
        tokens = self.sampler.choose(logits, rows)  # [k]
        feed = self._teach(rows, logits, tokens)  # [k]
        self.next_ids.index_copy_(0, index, feed)
        now, requests = self.metrics.now(), [self.request_of[row] for row in rows]
        for j, i in enumerate(requests):
            out = self.outputs[i]
            if j >= first_from:
                out.first_token_s = now
            if self.record.logits:
                out.logits.append(logits[j].float())
            self.unread[i] += 1
        if self.lag:
            self._read_all()  # the earlier passes' tokens: their copies are done or nearly, this pass runs on
            self.pending.append((requests, *_to_host(tokens)))
            return set()
        self._land(requests, self.agreement.tokens(tokens))
        ended, stop = set(), self.sampling.stop
        for row, i in zip(rows, requests):
            tokens = self.outputs[i].tokens
            if tokens[-1] in self.eos or (stop is not None and stop(i, tokens)):
                ended.add(row)
        return ended

    def _land(self, requests: list[int], tokens: list[int]) -> None:
        """One pass's host tokens into their requests' outputs."""
        for i, token in zip(requests, tokens):
            self.outputs[i].tokens.append(token)
            self.unread[i] -= 1

    def _read_all(self) -> None:
        """Read every pass's tokens not read yet (``lag``), in order, into their requests' outputs."""
        for requests, host, event in self.pending:
            self._land(requests, _read(host, event))
        self.pending.clear()

    def _retire(self, row: int, i: int) -> None:
        """Close request ``i``, which ended in ``row``: its timings, the run's memory so far, host log-probabilities
        and (``Record.positions``) the positions its slot held; it is handed on once its tokens are read
        (``_hand_on``)."""
        out, m = self.outputs[i], self.metrics
        out.finished_s = m.now()
        out.run_prefill_s, out.run_decode_s, out.kv_bytes = m.times["prefill"], m.times["decode"], m.kv_high
        out.workspace_bytes = self.pool.peak_workspace_bytes
        if out.logprobs is not None:
            out.logprobs = torch.stack(out.logprobs).tolist() if out.logprobs else []
        if self.record.positions:
            out.kept_positions = self.pool.kept_positions(self.state, row)
        self.ended.append((i, out))

    def _hand_on(self) -> None:
        """Hand every retired request whose tokens have all been read to ``on_finish`` (in retirement order)."""
        waiting = []
        for i, out in self.ended:
            if self.unread[i]:
                waiting.append((i, out))
            elif self.on_finish is not None:
                self.on_finish(i, out)
        self.ended = waiting
