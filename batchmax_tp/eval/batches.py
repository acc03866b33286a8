"""This replica's share of a run, on the engine (``RunContext.engine``): static batches generated one at a time
(:func:`run_batches`, :func:`run_batch`: the paper's padded batches) or its samples served by continuous batching
(:func:`serve_replica`); and the untimed warm-up a job makes first (:func:`warm_up`). Each batch's (or request's)
records are appended to the replica's shard as it ends. Out of memory ends the share with a message (one process)
or, in a multi-process run, leaves the marker and ends the job (``oom.RankOutOfMemory``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from ..core.method import Method
from ..core.requests import Batching, Request, RequestOutput, Sampling
from . import results
from .context import OpenRun, RunContext
from .generation import cut_at_eos, special_ids
from .metrics import score as metric_score
from .oom import RankOutOfMemory, error_line, free_memory, is_oom
from .results import BatchRecord, SampleRecord
from .tasks import Sample

__all__ = ["run_batch", "run_batches", "serve_replica", "warm_up"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _end_on_oom(ctx: RunContext, run: OpenRun, error: str, batch: int) -> None:
    """A rank of a multi-process run out of memory: its peers may wait inside the model's collectives, so nothing
    can be gathered. Leave the marker for the next run, tell every rank, and end the job."""
    rank = ctx.layout.rank
    path = results.write_oom_marker(run.folder, rank, error, batch)
    ctx.comm.fail(f"out of memory in {run.spec.name}")
    where = f"batch {batch}" if batch >= 0 else "its requests"
    raise RankOutOfMemory(
        f"{run.spec.name}: rank {rank} ran out of memory in {where} ({error}); recorded in "
        f"{path}: run the same command again to record the OOM row and go on"
    )


def _oom_error(ctx: RunContext, run: OpenRun, step: Callable[[], T], batch: int) -> tuple[T | None, str | None]:
    """(``step()``, None), or (None, the error line) when it ran out of memory. Outside the handler the exception
    (and the frames holding the batch's tensors) is gone; a multi-process run then ends (:func:`_end_on_oom`)."""
    error = None
    try:
        return step(), None
    except Exception as err:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
        if not is_oom(err):
            raise
        error = error_line(err)
    if ctx.comm.world > 1:
        _end_on_oom(ctx, run, error, batch)
    return None, error


def run_batches(ctx: RunContext, run: OpenRun, mine: list[int], bar) -> str | None:
    """This replica's unfinished batches ``mine``, each appended to its shard as it ends (by its tensor-parallel rank
    0, with the K/V peak of every rank). Returns an out-of-memory message (one process) or None."""
    tokens, seconds = 0, 0.0
    for index in mine:
        done, error = _oom_error(ctx, run, lambda index=index: run_batch(ctx, run, index), index)
        if error is not None:
            free_memory(getattr(ctx.model, "device", None))
            return error
        samples, record = done
        peaks = ctx.comm.replica_gather(record.peak_kv_bytes)
        if peaks is None:
            continue  # the replica's tensor-parallel rank 0 writes its (identical) records
        record = replace(record, peak_kv_bytes=sum(peaks), peak_kv_bytes_per_rank=peaks)
        run.shard.append(samples, [record])
        tokens += record.generated_tokens
        seconds += record.seconds
        bar.update(len(record.ids))
        if seconds > 0:
            bar.set_postfix_str(f"{tokens / seconds:.1f} tokens/s", refresh=False)
    return None


def run_batch(ctx: RunContext, run: OpenRun, index: int) -> tuple[list[SampleRecord], BatchRecord]:
    """Generate one batch as the paper's padded batch (the engine's ``static`` policy, one slot per sample, padded
    to its longest prompt; sample ``b`` seeded ``seed + index + b``): its samples' records and its own."""
    batch, cfg, tokenizer = run.batches[index], run.cfg, ctx.tokenizer
    eos, pad = special_ids(tokenizer)
    seed, new_tokens = cfg.generation.seed + index, cfg.generation.max_new_tokens
    requests = [Request(_prompt_ids(ctx, s), new_tokens, seed=seed + b) for b, s in enumerate(batch)]
    engine = ctx.engine(run.spec.method, len(batch), cfg.sweep.compile, Batching(policy="static"))
    device = getattr(ctx.model, "device", None)
    cuda = getattr(device, "type", None) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    served = engine.run(requests, Sampling(eos_token_id=eos, pad_token_id=pad, **cfg.generation.sampling()))
    cuda_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    metric = cfg.data.metric_for_task()
    samples = []
    for s, request, out in zip(batch, requests, served.outputs):
        text = tokenizer.decode(cut_at_eos(out.tokens, out.num_generated, eos), skip_special_tokens=True)
        samples.append(_sample_record(s, len(request.input_ids), text, out.num_generated, metric))
    record = BatchRecord(
        batch=index,
        replica=ctx.replica,
        ids=[s.id for s in batch],
        tokens_cut=[int(s.tokens_cut) for s in batch],
        generated_tokens=sum(out.num_generated for out in served.outputs),
        prefill_s=float(served.prefill_s),
        decode_s=float(served.decode_s + served.compile_s),  # a captured or compiled pass's set-up included
        peak_kv_bytes=int(served.peak_kv_bytes),
        peak_kv_bytes_per_rank=[int(served.peak_kv_bytes)],  # this rank's; rank 0 lists the replica's ranks
        peak_workspace_bytes=int(served.peak_workspace_bytes),
        cuda_max_memory_allocated=cuda_peak,
    )
    return samples, record


def _prompt_ids(ctx: RunContext, sample: Sample) -> list[int]:
    """A sample's prompt as token ids (the chat template applied; no pads)."""
    return ctx.encode(ctx.tokenizer, [sample.prompt])[0][0].tolist()


def warm_up(
    ctx: RunContext, samples: Sequence[Sample], methods: Sequence[Method], seed: int, *, prompt_tokens: int = 8
) -> float:
    """One tiny untimed run per method (the last ``prompt_tokens`` tokens of the first prompt, 2 new tokens, one
    slot), so that the first timed run does not pay one-time costs (lazy imports, allocator and kernel warm-up).
    Every rank runs it on the same input, through the run's engine with its tensor-parallel group, so collectives
    stay in lock-step. Returns the seconds it took."""
    start = time.perf_counter()
    ids = _prompt_ids(ctx, samples[0])[-prompt_tokens:]
    eos, pad = special_ids(ctx.tokenizer)
    for method in methods:
        request = Request(ids, 2, seed=seed)
        ctx.engine(method, 1, "auto").run([request], Sampling(ignore_eos=True, eos_token_id=eos, pad_token_id=pad))
    elapsed = time.perf_counter() - start
    logger.info("warm-up (%d methods, %d prompt tokens, 2 new tokens): %.2f s", len(methods), len(ids), elapsed)
    return elapsed


def _sample_record(sample: Sample, prompt_tokens: int, output: str, generated: int, metric: str) -> SampleRecord:
    """A sample's line of ``samples.jsonl``, scored with ``metric``."""
    reference = list(sample.reference) if isinstance(sample.reference, tuple) else sample.reference
    score = metric_score(metric, output, reference)
    correct = None if score is None or metric == "rouge2" else score == 1.0
    return SampleRecord(sample.id, prompt_tokens, output, reference, correct, generated)


def serve_replica(ctx: RunContext, run: OpenRun, samples: Sequence[Sample], mine: list[int], bar) -> str | None:
    """Continuous batching (``core.engine``) of this replica's samples ``mine`` in ``spec.batch_size`` slots.

    Each sample's records are appended to the replica's shard as it ends, its timing the run's prefill and decode
    seconds since the previous sample ended, so the sums are the run's. Each request samples with its own seed
    (``seed`` + its sample index). Returns an out-of-memory message (one process) or None.
    """
    cfg, tokenizer = run.cfg, ctx.tokenizer
    eos, pad = special_ids(tokenizer)
    new_tokens, seed = cfg.generation.max_new_tokens, cfg.generation.seed
    requests = [Request(_prompt_ids(ctx, samples[i]), new_tokens, seed=seed + i) for i in mine]
    metric, clock = cfg.data.metric_for_task(), [0.0, 0.0]

    def finished(j: int, out: RequestOutput) -> None:
        i, sample = mine[j], samples[mine[j]]
        text = tokenizer.decode(cut_at_eos(out.tokens, out.num_generated, eos), skip_special_tokens=True)
        record = _sample_record(sample, len(requests[j].input_ids), text, out.num_generated, metric)
        batch = _served_batch_record(i, sample, out, clock, ctx.replica)
        clock[:] = [out.run_prefill_s, out.run_decode_s]
        # Every tensor-parallel rank ends request j in the same pass: its rank 0 lists each rank's K/V bytes (AutoTP
        # may give the ranks different numbers of KV heads), as a static batch's record does.
        peaks = ctx.comm.replica_gather(int(out.kv_bytes))
        if peaks is not None:
            batch = replace(batch, peak_kv_bytes=sum(peaks), peak_kv_bytes_per_rank=peaks)
            run.shard.append([record], [batch])
            bar.update(1)

    def serve_all() -> None:
        engine = ctx.engine(
            run.spec.method, run.spec.batch_size, cfg.sweep.compile, Batching(prefill_budget=cfg.sweep.prefill_budget)
        )
        sampling = Sampling(eos_token_id=eos, pad_token_id=pad, **cfg.generation.sampling())
        engine.run(requests, sampling, on_finish=finished)

    return _oom_error(ctx, run, serve_all, -1)[1]


def _served_batch_record(
    index: int, sample: Sample, out: RequestOutput, clock: list[float], replica: int
) -> BatchRecord:
    """The line of ``batches.jsonl`` for a request the continuous scheduler finished (``clock``: the run's prefill
    and decode seconds when the previous request finished)."""
    return BatchRecord(
        batch=index,
        replica=replica,
        ids=[sample.id],
        tokens_cut=[int(sample.tokens_cut)],
        generated_tokens=out.num_generated,
        prefill_s=out.run_prefill_s - clock[0],
        decode_s=out.run_decode_s - clock[1],
        peak_kv_bytes=out.kv_bytes,
        peak_kv_bytes_per_rank=[out.kv_bytes],
        peak_workspace_bytes=out.workspace_bytes,
        slot=out.slot,
        first_token_s=out.first_token_s,
        latency_s=out.finished_s,
    )
