"""Continuous batching over a fixed pool of bounded slots (``core.pool``, scheduled by ``core.scheduler``).

``serve`` generates for a list of requests in ``slots`` slots: when a request ends (its EOS, a stop, or its
``max_new_tokens``) the next one enters its slot at once; requests admitted together with prompts of one length
prefill in one pass. Each request runs its own schedule on its unpadded
prompt, so its tokens equal ``engine.generate`` of that prompt alone (up to the float rounding of a wider
decode pass) and do not depend on which requests shared its passes; nothing is padded, and no batch waits for
its slowest row.

Memory is fixed before the first pass: the pool's K/V and bookkeeping (``planner.predict_pool``) plus the largest
pass's workspace. Under BM every slot is bounded by ``kv_max`` from its first token, so admission is exact: no
reservation, no preemption.

Tensor parallelism: the schedule is a pure function of host state every rank has (the queue, the pass count and
which slots finished). When finishing depends on tokens (EOS or stops), each pass's tokens are broadcast from the
group's first rank, and every ``AGREE_EVERY`` passes the ranks compare a digest of their admission logs: a
divergence stops the job with an error instead of a hang.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .attention import use_batchmax_attention
from .engine import forward_pass, sampling_warpers
from .method import Method
from .pool import BoundedPool, DensePool
from .scheduler import Scheduler, Step
from .step import ForwardPass

logger = logging.getLogger(__name__)

AGREE_EVERY = 64  # passes between two checks that the tensor-parallel ranks still run the same schedule


@dataclass(frozen=True)
class Request:
    """One prompt (token ids, unpadded) and how many tokens to generate for it; ``seed`` for sampling."""

    input_ids: Sequence[int]
    max_new_tokens: int
    seed: int | None = None


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

    @property
    def generated_tokens(self) -> int:
        return sum(o.num_generated for o in self.outputs)


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
            raise ValueError(f"request {i}: a {n}-token prompt + {r.max_new_tokens} new tokens run past the model's "
                             f"context of {context} positions")


def _pool(model: torch.nn.Module, method: Method, slots: int, lengths: list[int], max_new: list[int]):
    """The method's pool. Every pool runs on the "batchmax" attention, which reads the pass description: BM's
    scoring attention; for the baselines, SDPA in a slot's (unpadded, causal) prefill and, in a decode pass, the
    fused grouped product with each row's held length as an additive mask (SDPA would need a mask there, and with
    a mask HF copies K/V for every query head)."""
    layers = model.config.num_hidden_layers
    if method.name == "bm":
        return BoundedPool(method, layers, slots)
    cap = method.kv_max if method.name == "ed" else max(s + t - 1 for s, t in zip(lengths, max_new))
    return DensePool(method, layers, slots, cap)


def _digest(log: list[tuple[int, int, int]], passes: int) -> int:
    return zlib.crc32(repr((passes, log)).encode()) & 0x7FFFFFFF


def _agree(group, value: int, device: torch.device) -> None:
    """Raise on every rank of ``group`` unless all of them hold the same ``value``."""
    t = torch.tensor([value, -value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != value or -int(t[1]) != value:
        raise RuntimeError("tensor-parallel ranks diverged: their continuous-batching schedules differ (the "
                           "requests, the settings or the tokens each rank saw are not the same)")


@torch.inference_mode()
def serve(
    model: torch.nn.Module,
    requests: Sequence[Request],
    method: Method,
    slots: int,
    *,
    ignore_eos: bool = False,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    prefill_budget: int | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
    on_finish: Callable[[int, RequestOutput], None] | None = None,
    return_logits: bool = False,
    keep_positions: bool = False,
    tp_group=None,
) -> ServeOutput:
    """Generate for every request in ``slots`` slots (continuous batching); greedy unless ``do_sample`` (each
    request samples from its own generator, seeded with its ``seed``). A request ends at its ``max_new_tokens``,
    at an EOS unless ``ignore_eos``, or when ``stop(i, tokens)`` says so (stop strings); ``on_finish(i, output)``
    is called as each one ends. ``prefill_budget``: prompt tokens prefilled between two decode steps (None: a new
    request is prefilled whole first). ``tp_group``: the tensor-parallel group, when there is one."""
    check_requests(requests, slots, getattr(model.config, "max_position_embeddings", None))
    device = next(model.parameters()).device
    prompts = [torch.as_tensor(list(r.input_ids), dtype=torch.long, device=device) for r in requests]  # [s_i]
    lengths = [int(p.numel()) for p in prompts]
    max_new = [r.max_new_tokens for r in requests]
    sched = Scheduler(method, lengths, max_new, slots, prefill_budget)
    pool = _pool(model, method, slots, lengths, max_new)
    dense = method.name != "bm"
    eos = set() if ignore_eos or eos_token_id is None else set(
        [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    warpers = sampling_warpers(temperature, top_k, top_p) if do_sample else None
    tp = tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1
    token_bound = bool(eos) or stop is not None  # whether finishing depends on the tokens
    gens: list[torch.Generator | None] = [None] * slots
    outputs: list[RequestOutput | None] = [None] * len(requests)
    request_of: list[int] = [-1] * slots
    next_ids = torch.full((slots,), pad, dtype=torch.long, device=device)  # [S] each row's next input
    kv_low, kv_high = None, 0
    times = {"prefill": 0.0, "decode": 0.0}

    def choose(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Tokens [k] from logits [k, V] of ``rows``: greedy, or sampled with each row's own generator."""
        if warpers is None:
            return logits.argmax(dim=-1)
        picks = [torch.multinomial(torch.softmax(warpers(None, logits[j : j + 1].float()), dim=-1), 1,
                                   generator=gens[r]).view(1) for j, r in enumerate(rows)]
        return torch.cat(picks)

    def agreed(tokens: torch.Tensor) -> list[int]:
        if tp and token_bound:
            dist.broadcast(tokens, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        return tokens.tolist()

    def emit(row: int, token: int, logits: torch.Tensor | None, now: float) -> bool:
        """Record ``token`` for the request in ``row``; True when it ends the request early (EOS or a stop)."""
        i = request_of[row]
        out = outputs[i]
        if not out.tokens:
            out.first_token_s = now
        out.tokens.append(token)
        if logits is not None:
            out.logits.append(logits.float())
        return token in eos or (stop is not None and stop(i, out.tokens))

    start = time.perf_counter()
    with use_batchmax_attention(model):
        while (step := sched.next_step()) is not None:
            for rows, group in step.admitted:
                pool.admit(rows, lengths[group[0]])
                for row, i in zip(rows, group):
                    request_of[row] = i
                    outputs[i] = RequestOutput([], row, sched.passes, logits=[] if return_logits else None)
                    if do_sample:
                        gens[row] = torch.Generator(device=device)
                        gens[row].manual_seed(0 if requests[i].seed is None else requests[i].seed)
            t0 = time.perf_counter()
            finished = _run_step(model, step, pool, prompts, lengths, max_new, request_of, next_ids, device, dense,
                                 choose, agreed, emit, return_logits, start)
            times["decode" if step.kind == "decode" else "prefill"] += time.perf_counter() - t0
            if pool.allocated and step.kind != "decode":  # a decode pass never changes what is allocated
                kv = pool.kv_bytes()
                kv_low, kv_high = min(kv, kv_low if kv_low is not None else kv), max(kv_high, kv)
            for row, i in sched.complete(step, finished):
                out = outputs[i]
                out.finished_s = time.perf_counter() - start
                out.run_prefill_s, out.run_decode_s, out.kv_bytes = times["prefill"], times["decode"], kv_high
                out.workspace_bytes = pool.peak_workspace_bytes
                if keep_positions:
                    out.kept_positions = pool.kept_positions(row)
                if on_finish is not None:
                    on_finish(i, out)
            if tp and sched.passes % AGREE_EVERY == 0:
                _agree(tp_group, _digest(sched.log, sched.passes), device)
    if tp:
        _agree(tp_group, _digest(sched.log, sched.passes), device)
    pool.note()
    logger.debug("%s: %d requests in %d slots, %d passes", method.label(), len(requests), slots, sched.passes)
    return ServeOutput(outputs, list(sched.log), sched.passes, times["prefill"], times["decode"], pool.peak_kv_bytes,
                       (kv_low or 0, kv_high), pool.peak_meta_bytes, pool.peak_workspace_bytes)


def _run_step(model, step: Step, pool, prompts, lengths, max_new, request_of, next_ids, device, dense, choose, agreed, emit,
              return_logits: bool, start: float) -> set[int]:
    """Run one pass; returns the slots whose request ended early (EOS or a stop)."""
    finished: set[int] = set()
    if step.kind != "decode":  # one group's prefill block or look-ahead probe, on its rows' cache
        rows = range(step.work[0].row, step.work[-1].row + 1)  # adjacent slots, one prompt length
        phase, group = step.work[0].phase, [request_of[r] for r in rows]
        cache = pool.row_caches[rows.start]
        cache.begin(phase)
        ids = torch.stack([prompts[i][phase.start : phase.end] for i in group])  # [k, n]
        pos = torch.arange(phase.start, phase.end, device=device).expand(len(group), -1)  # [k, n]
        out = forward_pass(model, ForwardPass(phase.kind, cache, step.work), ids,
                           cache.attention_mask() if dense else None, pos)
        if phase.kind == "probe":
            cache.note_meta()
            pool.note()
            return finished
        if phase.end < lengths[group[0]]:
            return finished
        if dense:
            cache.note_workspace(model.config)
        cache.begin(None)
        pool.graduate(rows, [max_new[i] > 1 for i in group])
        logits = out.logits[:, -1]  # [k, V]
        tokens = choose(logits, list(rows))  # [k]
        next_ids[rows.start : rows.stop] = tokens
        now = time.perf_counter() - start
        for j, (row, token) in enumerate(zip(rows, agreed(tokens))):
            if emit(row, token, logits[j] if return_logits else None, now):
                finished.add(row)
        return finished
    rows = [w.row for w in step.work]
    pool.begin_decode(step.work, device)
    out = forward_pass(model, ForwardPass("decode", pool, step.work), next_ids[:, None], pool.attention_mask(),
                       pool.positions)
    logits = out.logits[:, -1]  # [S, V]
    index = torch.tensor(rows, device=device)  # [k] the decoding rows
    tokens = choose(logits.index_select(0, index), rows)  # [k]
    next_ids.index_copy_(0, index, tokens)
    host = agreed(tokens)
    now = time.perf_counter() - start
    for j, row in enumerate(rows):
        if emit(row, host[j], logits[row] if return_logits else None, now):
            finished.add(row)
    return finished
