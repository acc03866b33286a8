"""The engine: generation over a fixed pool of bounded slots (``core.pool``, scheduled by ``core.scheduler``).

``serve`` generates for a list of requests in ``slots`` slots. Under the default ``continuous`` policy, when a
request ends (its EOS, a stop, or its ``max_new_tokens``) the next one enters its slot at once; each request runs its
own schedule on its unpadded prompt, so its tokens equal the naive reference (``tests/reference.py``) on that prompt
alone (up to the float rounding of a wider pass) and do not depend on which requests shared its passes. Under the
``static`` policy the requests run as the paper's padded batches (``engine.generate``, the paper's procedure).

Memory is fixed before the first pass: the pool's K/V and bookkeeping (``planner.predict_pool``) plus the largest
pass's workspace. Under BM every slot is bounded by ``kv_max`` from its first token, so admission is exact: no
reservation, no preemption.

The host reads a pass's tokens only when it needs them: when finishing depends on the tokens (EOS, stops) or a
continuation is scored, at once; otherwise one pass late, after the next pass is launched (``_Run.lag``), so that on
a GPU the host describes pass t + 1 while pass t runs instead of waiting for it. A request that ends is then handed to
``on_finish`` once its last token has been read.

Tensor parallelism: the schedule is a pure function of host state every rank has (the queue, the pass count and
which slots finished). When finishing depends on tokens (EOS or stops), each pass's tokens are broadcast from the
group's first rank, and every ``AGREE_EVERY`` passes the ranks compare a digest of their admission logs: a
divergence stops the job with an error instead of a hang.
"""

from __future__ import annotations

import itertools
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from . import replay
from .attention import use_batchmax_attention
from .method import Method
from .pool import KVLayout, make_pool, to_device
from .replay import forward_pass
from .scheduler import Scheduler, Step

logger = logging.getLogger(__name__)

AGREE_EVERY = 64  # passes between two checks that the tensor-parallel ranks still run the same schedule
POLICIES = ("continuous", "static")  # ``Batching(policy=...)``: see ``core.scheduler``


@dataclass(frozen=True)
class Request:
    """One prompt (token ids, unpadded) and how many tokens to generate for it; ``seed`` for sampling.

    ``continuation``: teacher forcing, for scoring. After the prompt these tokens are fed instead of the chosen
    ones (at least ``max_new_tokens`` of them), the output's ``logprobs[t]`` is the float32 log-probability of
    ``continuation[t]`` given the prompt and ``continuation[:t]``, and ``tokens`` still records the model's own
    choices (greedy: whether the continuation is the greedy one)."""

    input_ids: Sequence[int]
    max_new_tokens: int
    seed: int | None = None
    continuation: Sequence[int] | None = None


@dataclass
class RequestOutput:
    """A request's generated ids (through its first EOS or stop when those are honoured), where and when it ran
    (seconds since the run started), and on request its logits and the positions its slot held at the end."""

    tokens: list[int]
    slot: int
    admitted_pass: int
    first_token_s: float = 0.0
    finished_s: float = 0.0
    run_prefill_s: float = 0.0  # the run's prefill and decode seconds so far when this request ended
    run_decode_s: float = 0.0
    kv_bytes: int = 0  # the pool's K/V bytes when it ended (constant for BM and FKV)
    workspace_bytes: int = 0  # the largest attention workspace of the run so far when it ended
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # per token, float32 [V]
    kept_positions: list[list[list[int]]] | None = field(default=None, repr=False)  # per layer, local KV head
    logprobs: list[float] | None = None  # with a ``continuation``: each of its tokens' log-probability

    @property
    def num_generated(self) -> int:
        return len(self.tokens)


@dataclass
class ServeOutput:
    outputs: list[RequestOutput]  # in request order
    admissions: list[tuple[int, int, int]]  # (pass, slot, request), in admission order
    passes: int
    prefill_s: float
    decode_s: float
    peak_kv_bytes: int
    kv_bytes_range: tuple[int, int]  # smallest and largest K/V bytes held after any pass
    peak_meta_bytes: int
    peak_workspace_bytes: int
    compile_s: float = 0.0  # the first decode pass when compiled or captured (compilation or capture and one pass)

    @property
    def generated_tokens(self) -> int:
        return sum(o.num_generated for o in self.outputs)


@dataclass(frozen=True)
class Sampling:
    """How each request's tokens are chosen and when it ends: greedy unless ``do_sample`` (each request samples from
    its own generator, seeded with its ``seed``, warped by ``temperature``, ``top_k`` and ``top_p``). A request ends at
    its ``max_new_tokens``, at an ``eos_token_id`` unless ``ignore_eos``, or when ``stop(i, tokens)`` says so (stop
    strings). ``pad_token_id``: the input of a row with nothing to feed (None: the smallest EOS id, else 0)."""

    eos_token_id: int | Sequence[int] | None = None
    ignore_eos: bool = False
    pad_token_id: int | None = None
    stop: Callable[[int, list[int]], bool] | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def eos(self) -> set[int]:
        """The token ids that end a request (none when ``ignore_eos``)."""
        if self.ignore_eos or self.eos_token_id is None:
            return set()
        return set([self.eos_token_id] if isinstance(self.eos_token_id, int) else self.eos_token_id)

    def pad(self) -> int:
        eos = self.eos()
        return self.pad_token_id if self.pad_token_id is not None else (min(eos) if eos else 0)

    def warpers(self) -> LogitsProcessorList | None:
        return sampling_warpers(self.temperature, self.top_k, self.top_p) if self.do_sample else None


@dataclass(frozen=True)
class Batching:
    """How requests share the passes. ``policy``: ``"continuous"`` refills a slot as soon as it frees; ``"static"``
    runs the paper's padded batches (``core.scheduler``), left-padded to their longest prompt or to ``pad_to``
    tokens. ``prefill_budget``: prompt tokens prefilled between two decode steps (None: a new request is prefilled
    whole first). ``pass_tokens``: BM's most prompt tokens (rows x columns) in one prefill pass (None:
    ``Method.pass_tokens(slots)``, every row's next chunk; the planner counts what is given:
    ``predict_pool(pass_tokens=...)``). ``share_prompts``: adjacent requests with identical prompts admitted
    together prefill once, on one row copied into the others (the choices of a multiple-choice question)."""

    policy: str = "continuous"
    prefill_budget: int | None = None
    pass_tokens: int | None = None
    share_prompts: bool = False
    pad_to: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class Record:
    """What each output keeps beyond its tokens: ``logits`` (per token, float32 [V]) and ``positions`` (the
    positions its slot held when it ended, per layer and local KV head)."""

    logits: bool = False
    positions: bool = False


def check_requests(requests: Sequence[Request], slots: int, context: int | None) -> None:
    """One ``ValueError`` line for input ``serve`` cannot run: no slot, an empty prompt, ``max_new_tokens`` < 1, or
    a prompt whose positions would run past the model's context."""
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    for i, r in enumerate(requests):
        n = len(r.input_ids)
        if n < 1:
            raise ValueError(f"request {i}: the prompt is empty")
        if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
            raise ValueError(f"request {i}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
        if context is not None and n + r.max_new_tokens - 1 > context:
            raise ValueError(
                f"request {i}: a {n}-token prompt + {r.max_new_tokens} new tokens run past the model's "
                f"context of {context} positions"
            )
        if r.continuation is not None and len(r.continuation) < r.max_new_tokens:
            raise ValueError(
                f"request {i}: a continuation of {len(r.continuation)} tokens cannot be scored over "
                f"{r.max_new_tokens} new tokens"
            )


def sampling_warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """Temperature, top-k and top-p warping, each only where it changes anything."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def _pool(model: torch.nn.Module, method: Method, slots: int, lengths: list[int], max_new: list[int], static: bool):
    """The method's pool (``static``: one decode-pass shape for the whole run, ``core.replay``), its rows as large
    as the longest request needs (BM and ED ``kv_max``, FKV its prompt + generation; no request: a replica whose
    share is done, the pool is never written). FKV paged: the memory of ``slots`` such rows in blocks, and as many
    rows as the requests can hold at once (their smallest first), and each request's blocks."""
    cap = max((method.decode_capacity(s, t) for s, t in zip(lengths, max_new)), default=1)
    layers = model.config.num_hidden_layers
    if not method.paged:
        return make_pool(method, layers, slots, cap, static), None
    need = [method.blocks(s, t) for s, t in zip(lengths, max_new)]
    blocks = slots * max(need, default=1)  # the longest request's blocks per slot
    rows = len(list(itertools.takewhile(lambda held: held <= blocks, itertools.accumulate(sorted(need)))))
    return make_pool(method, layers, max(slots, rows), cap, static, blocks), need


def kv_layout(model: torch.nn.Module) -> KVLayout:
    """The model's attention as this rank holds it (KV heads, key and value sizes, dtype, device, query heads), read
    from its first attention module's projections (under AutoTP a rank holds its share of the heads, and the ranks'
    shares may differ): what the pool is allocated from before the first pass."""
    attn = next(m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "head_dim"))
    D = attn.head_dim
    q_heads = attn.o_proj.weight.shape[1] // D  # o_proj [hidden, q_heads x D] on this rank
    if hasattr(attn, "k_proj"):  # llama, mistral, qwen2: [kv_heads x D, hidden] on this rank
        weight = attn.k_proj.weight
        heads = weight.shape[0] // D
    else:  # phi3's fused projection [(q_heads + 2 kv_heads) x D, hidden]
        weight = attn.qkv_proj.weight
        heads = (weight.shape[0] // D - q_heads) // 2
    return KVLayout(heads, D, D, weight.dtype, weight.device, q_heads)


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


class _Run:
    """One ``serve`` call's state between passes: which request each slot holds, the next input of every row, the
    outputs, and the named steps of a pass: admit a group, run the pass (a prefill block or probe, or a decode step),
    emit its tokens (chosen by ``sampler``, agreed across tensor-parallel ranks by ``agreement``, teacher-forced),
    retire the requests that ended, hand them on once their tokens are read (``lag``: a pass late); ``metrics``
    keeps the clock and the K/V held."""

    def __init__(
        self,
        model,
        requests: Sequence[Request],
        method: Method,
        slots: int,
        sampler: _Sampler,
        eos: set[int],
        pad: int,
        stop,
        return_logits: bool,
        agreement: _Agreement,
        metrics: _Metrics,
    ):
        self.model, self.requests, self.method, self.slots = model, requests, method, slots
        self.device = next(model.parameters()).device
        self.prompts = [
            torch.as_tensor(list(r.input_ids), dtype=torch.long, device=self.device) for r in requests
        ]  # [s_i]
        self.lengths = [int(p.numel()) for p in self.prompts]
        self.ends = list(self.lengths)  # where each prompt ends: its length, plus its pads in a padded batch
        self.max_new = [r.max_new_tokens for r in requests]
        self.sampler, self.agreement, self.metrics = sampler, agreement, metrics
        self.eos, self.stop, self.return_logits = eos, stop, return_logits
        self.token_bound = agreement.token_bound
        self.forcing = any(r.continuation is not None for r in requests)
        # read each pass's tokens one pass late (after the next pass is launched) when nothing needs them sooner
        self.lag = not self.token_bound and not self.forcing
        self.pending: list[tuple[list[int], torch.Tensor, object]] = []  # lag: (requests, host tokens, event) unread
        self.unread = [0] * len(requests)  # per request: its tokens chosen but not read yet
        self.ended: list[tuple[int, RequestOutput]] = []  # retired, waiting for their last tokens
        self.outputs: list[RequestOutput | None] = [None] * len(requests)
        self.request_of: list[int] = [-1] * slots
        self.shared: set[int] = set()  # first slot of each group prefilled once for all its rows
        self.group_of: list[range] = [range(r, r + 1) for r in range(slots)]  # each row's admission group
        self.next_ids = torch.full((slots,), pad, dtype=torch.long, device=self.device)  # [S] each row's next input
        # [S, 1] all true, a decode pass's mask: the attention reads the description, not a mask, but without one
        # HF's mask builder looks for packed sequences in the position ids, a host sync in every pass
        self.all_true = torch.ones(slots, 1, dtype=torch.bool, device=self.device)
        self.decode_forward = replay.eager_decode  # or compiled, or captured (serve's ``compile``)

    def admit(self, pool, rows: range, group: tuple[int, ...], passes: int, shared: bool, pads: list[int]) -> None:
        pool.admit(rows, [pads[i] for i in group])
        for row, i in zip(rows, group):
            pool.reserve(row, self.lengths[i], self.max_new[i])
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
                passes,
                logits=[] if self.return_logits else None,
                logprobs=[] if self.requests[i].continuation is not None else None,
            )
            self.sampler.seed(row, self.requests[i].seed)

    def teach(self, rows: list[int], logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
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

    def emit(self, rows: list[int], index: torch.Tensor, logits: torch.Tensor, first: bool) -> set[int]:
        """Choose, record and feed the next token of each of ``rows`` (``index``: the same rows on the device) from
        their logits [k, V] (``first``: the rows' first tokens, a prefill pass's); returns the rows whose request
        ended early (EOS or a stop). Under ``lag`` the tokens are read at the next emit (this pass is launched by
        then) or at ``read_all``, and nothing ends early."""
        tokens = self.sampler.choose(logits, rows)  # [k]
        feed = self.teach(rows, logits, tokens)  # [k]
        self.next_ids.index_copy_(0, index, feed)
        now, requests = self.metrics.now(), [self.request_of[row] for row in rows]
        for j, i in enumerate(requests):
            out = self.outputs[i]
            if first:
                out.first_token_s = now
            if self.return_logits:
                out.logits.append(logits[j].float())
            self.unread[i] += 1
        if self.lag:
            self.read_all()  # the earlier passes' tokens: their copies are done or nearly, this pass runs on
            self.pending.append((requests, *_to_host(tokens)))
            return set()
        self.land(requests, self.agreement.tokens(tokens))
        ended = set()
        for row, i in zip(rows, requests):
            tokens = self.outputs[i].tokens
            if tokens[-1] in self.eos or (self.stop is not None and self.stop(i, tokens)):
                ended.add(row)
        return ended

    def land(self, requests: list[int], tokens: list[int]) -> None:
        """One pass's host tokens into their requests' outputs."""
        for i, token in zip(requests, tokens):
            self.outputs[i].tokens.append(token)
            self.unread[i] -= 1

    def read_all(self) -> None:
        """Read every pass's tokens not read yet (``lag``), in order, into their requests' outputs."""
        for requests, host, event in self.pending:
            self.land(requests, _read(host, event))
        self.pending.clear()

    def hand_on(self, on_finish) -> None:
        """Hand every retired request whose tokens have all been read to ``on_finish`` (in retirement order)."""
        waiting = []
        for i, out in self.ended:
            if self.unread[i]:
                waiting.append((i, out))
            elif on_finish is not None:
                on_finish(i, out)
        self.ended = waiting

    def prefill(self, pool, step: Step) -> set[int]:
        """One prefill pass of many rows' chunks (and the look-ahead probes folded in), each at its own position (a
        shared group: its first row alone); the rows whose prompt ends here (and the rest of their shared group) emit
        their first token."""
        work = tuple(w for w in step.work if self.group_of[w.row].start not in self.shared or w.row in self.shared)
        prompts = [self.prompts[self.request_of[w.row]] for w in work]
        described, ids = pool.prefill_pass(work, prompts, self.device)
        out = forward_pass(self.model, pool.ready(described), ids, torch.ones_like(ids, dtype=torch.bool))
        pool.note()
        rows, index = [], []
        for j, w in enumerate(work):
            if w.phase.end < self.ends[self.request_of[w.row]]:
                continue
            group = self.group_of[w.row] if w.row in self.shared else range(w.row, w.row + 1)
            self.shared.discard(w.row)
            pool.graduate(group, [self.max_new[self.request_of[r]] > 1 for r in group])
            rows.extend(group)
            index.extend([j] * len(group))
        if not rows:
            return set()
        logits = out.logits[:, -1].index_select(0, to_device(index, self.device))  # [k, V]
        return self.emit(rows, to_device(rows, self.device), logits, first=True)

    def decode(self, pool, step: Step) -> set[int]:
        """One decode step of every decoding slot, in one pass over the pool."""
        rows = [w.row for w in step.work]
        described = pool.decode_pass(step.work, self.device)
        model_step = pool.ready(described)  # its evictions and its slots' bookkeeping, in every layer at once
        out = self.decode_forward(self.model, model_step, self.next_ids[:, None], self.all_true)
        index = described.decoding  # [k] the decoding rows
        return self.emit(rows, index, out.logits[:, -1].index_select(0, index), first=False)  # [k, V]

    def run_pass(self, pool, step: Step) -> set[int]:
        """Run one pass (every decoding slot's step, or one group's prefill block or probe), timed, and note the K/V
        held after it; returns the rows whose request ended early."""
        kind = "decode" if step.kind == "decode" else "prefill"
        t0 = time.perf_counter()
        finished = self.decode(pool, step) if kind == "decode" else self.prefill(pool, step)
        self.metrics.passed(kind, time.perf_counter() - t0, pool)
        return finished

    def retire(self, pool, row: int, i: int, keep_positions: bool) -> None:
        """Close request ``i``, which ended in ``row``: its timings, the run's memory so far, host log-probabilities
        and (``keep_positions``) the positions its slot held; it is handed on once its tokens are read
        (``hand_on``)."""
        out, m = self.outputs[i], self.metrics
        out.finished_s = m.now()
        out.run_prefill_s, out.run_decode_s, out.kv_bytes = m.times["prefill"], m.times["decode"], m.kv_high
        out.workspace_bytes = pool.peak_workspace_bytes
        if out.logprobs is not None:
            out.logprobs = torch.stack(out.logprobs).tolist() if out.logprobs else []
        if keep_positions:
            out.kept_positions = pool.kept_positions(row)
        self.ended.append((i, out))

    def served(self, pool, sched: Scheduler) -> ServeOutput:
        """The run's outputs, schedule and measurements once every request has ended."""
        m = self.metrics
        return ServeOutput(
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
        )


def _prompt_keys(requests: Sequence[Request]) -> list[int]:
    """Per request, the index of the first request with the same prompt (one key per distinct prompt)."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(r.input_ids), i) for i, r in enumerate(requests)]


@torch.no_grad()
def serve(
    model: torch.nn.Module,
    requests: Sequence[Request],
    method: Method,
    slots: int,
    *,
    sampling: Sampling = Sampling(),
    batching: Batching = Batching(),
    record: Record = Record(),
    on_finish: Callable[[int, RequestOutput], None] | None = None,
    tp_group=None,
    compile: str = "auto",
) -> ServeOutput:
    """Generate for every request in ``slots`` slots, as ``sampling`` chooses tokens and ends requests and
    ``batching`` shares the passes; ``on_finish(i, output)`` is called as each request ends (once its last token is
    read). ``tp_group``: the tensor-parallel group, when there is one. ``compile``: how decode passes run
    (``core.replay``): ``"none"`` eager, ``"default"`` compiled, ``"cudagraphs"`` captured once and replayed,
    ``"auto"`` (the default) the fastest measured on the model's device type; the same tokens in every mode. The
    users' entry is ``core.engine.Engine``, which holds the model, method, slots and how passes run."""
    check_requests(requests, slots, getattr(model.config, "max_position_embeddings", None))
    eos, pad, warpers = sampling.eos(), sampling.pad(), sampling.warpers()
    device = next(model.parameters()).device
    mode = replay.resolve(compile, device, tensor_parallel=_tensor_parallel(tp_group) is not None)
    lengths, max_new = [len(r.input_ids) for r in requests], [r.max_new_tokens for r in requests]
    pool, need = _pool(model, method, slots, lengths, max_new, static=mode != "none")
    rows = pool.slots  # FKV paged: more rows than ``slots`` where the requests are shorter than the longest
    if requests:  # (none: a replica whose share is done; its pool is never written)
        pool.allocate(kv_layout(model))
    sampler, metrics = _Sampler(warpers, rows, device), _Metrics(compiles=mode != "none")
    agreement = _Agreement(tp_group, bool(eos) or sampling.stop is not None, device)  # finishing hangs on tokens?
    run = _Run(model, requests, method, rows, sampler, eos, pad, sampling.stop, record.logits, agreement, metrics)
    run.decode_forward = replay.decode_runner(mode)
    share = batching.share_prompts
    keys = _prompt_keys(requests) if share else None
    sched = Scheduler(
        method,
        run.lengths,
        run.max_new,
        rows,
        batching.prefill_budget,
        keys,
        batching.pass_tokens,
        batching.policy == "static",
        batching.pad_to,
        blocks=pool.num_blocks,
        need=need,
    )
    try:
        with use_batchmax_attention(model):
            while (step := sched.next_step()) is not None:
                for rows, group in step.admitted:
                    run.admit(pool, rows, group, sched.passes, share and len(group) > 1, sched.pads)
                finished = run.run_pass(pool, step)
                for row, i in sched.complete(step, finished):
                    run.retire(pool, row, i, record.positions)
                    pool.finish(row)
                run.hand_on(on_finish)
                run.agreement.schedule(sched, every=AGREE_EVERY)
        run.read_all()
        run.hand_on(on_finish)
        run.agreement.schedule(sched)
        pool.note()
        logger.debug("%s: %d requests in %d slots, %d passes", method.label(), len(requests), slots, sched.passes)
        return run.served(pool, sched)
    finally:
        pool.release()  # its memory goes now, not at the next garbage collection (layers refer to their pool)
