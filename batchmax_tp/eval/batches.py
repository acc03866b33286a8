"""This replica's share of a run: static batches generated one at a time (:func:`run_batches`, :func:`run_batch`)
or its samples served by continuous batching (:func:`serve_replica`, ``core.serve``). Each batch's (or request's)
records are appended to the replica's shard as it ends. Out of memory ends the share with a message (one process)
or, in a multi-process run, leaves the marker and ends the job (``oom.RankOutOfMemory``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..core.engine import Engine
from ..core.serve import Batching, Request, RequestOutput, Sampling
from . import results
from .context import OpenRun, RunContext
from .generation import cut_at_eos, generate_batch, special_ids
from .metrics import score as metric_score
from .oom import RankOutOfMemory, error_line, free_memory, is_oom
from .tasks import Sample

__all__ = ["run_batch", "run_batches", "serve_replica"]

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
        message, error = _oom_error(ctx, run, lambda index=index: run_batch(ctx, run, index), index)
        if error is not None:
            free_memory(getattr(ctx.model, "device", None))
            return error
        record = message["batch"]
        peaks = ctx.comm.replica_gather(int(record["peak_kv_bytes"]))
        if peaks is None:
            continue  # the replica's tensor-parallel rank 0 writes its (identical) records
        record["peak_kv_bytes"], record["peak_kv_bytes_per_rank"] = sum(peaks), peaks
        run.shard.append(message["samples"], [record])
        tokens += record["generated_tokens"]
        seconds += record["prefill_s"] + record["decode_s"]
        bar.update(len(record["ids"]))
        if seconds > 0:
            bar.set_postfix_str(f"{tokens / seconds:.1f} tokens/s", refresh=False)
    return None


def run_batch(ctx: RunContext, run: OpenRun, index: int) -> dict[str, Any]:
    """Generate one batch: its per-sample records (``results.SAMPLE_KEYS``) and its batch record."""
    batch, cfg = run.batches[index], run.cfg
    out = generate_batch(
        ctx.model,
        ctx.tokenizer,
        [s.prompt for s in batch],
        run.spec.method,
        cfg.generation,
        cfg.generation.seed + index,
        generate_fn=ctx.generate,
        encode_fn=ctx.encode,
        compile=cfg.sweep.compile,
        tp_group=getattr(ctx.model, "batchmax_tp_group", None),
    )
    result, metric = out.result, cfg.data.metric_for_task()
    samples = [
        _sample_record(s, out.prompt_tokens[i], out.outputs[i], out.num_generated[i], metric)
        for i, s in enumerate(batch)
    ]
    record = {
        "batch": index,
        "replica": ctx.replica,
        "ids": [s.id for s in batch],
        "tokens_cut": [int(s.tokens_cut) for s in batch],
        "generated_tokens": sum(out.num_generated),
        "prefill_s": float(result.prefill_s),
        "decode_s": float(result.decode_s),
        "peak_kv_bytes": int(result.peak_kv_bytes),
        "peak_kv_bytes_per_rank": [int(result.peak_kv_bytes)],  # this rank's; rank 0 lists the replica's ranks
        "peak_workspace_bytes": int(getattr(result, "peak_workspace_bytes", 0) or 0),
        "cuda_max_memory_allocated": out.cuda_max_memory_allocated,
    }
    return {"samples": samples, "batch": record}


def _sample_record(sample: Sample, prompt_tokens: int, output: str, generated: int, metric: str) -> dict[str, Any]:
    """One line of ``samples.jsonl`` (``results.SAMPLE_KEYS``), scored with ``metric``."""
    reference = list(sample.reference) if isinstance(sample.reference, tuple) else sample.reference
    score = metric_score(metric, output, reference)
    return {
        "id": sample.id,
        "prompt_tokens": prompt_tokens,
        "output": output,
        "reference": reference,
        "correct": None if score is None or metric == "rouge2" else score == 1.0,
        "generated_tokens": generated,
    }


def serve_replica(ctx: RunContext, run: OpenRun, samples: Sequence[Sample], mine: list[int], bar) -> str | None:
    """Continuous batching (``core.serve``) of this replica's samples ``mine`` in ``spec.batch_size`` slots.

    Each sample's records are appended to the replica's shard as it ends, its timing the run's prefill and decode
    seconds since the previous sample ended, so the sums are the run's. Each request samples with its own seed
    (``seed`` + its sample index). Returns an out-of-memory message (one process) or None.
    """
    cfg, tokenizer = run.cfg, ctx.tokenizer
    eos, pad = special_ids(tokenizer)
    new_tokens, seed = cfg.generation.max_new_tokens, cfg.generation.seed
    requests = [
        Request(ctx.encode(tokenizer, [samples[i].prompt])[0][0].tolist(), new_tokens, seed=seed + i) for i in mine
    ]
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
            batch["peak_kv_bytes"], batch["peak_kv_bytes_per_rank"] = sum(peaks), peaks
            run.shard.append([record], [batch])
            bar.update(1)

    def serve_all() -> None:
        engine = Engine(
            ctx.model,
            run.spec.method,
            run.spec.batch_size,
            tp_group=getattr(ctx.model, "batchmax_tp_group", None),
            compile=cfg.sweep.compile,
            batching=Batching(prefill_budget=cfg.sweep.prefill_budget),
        )
        sampling = Sampling(eos_token_id=eos, pad_token_id=pad, **cfg.generation.sampling())
        engine.run(requests, sampling, on_finish=finished)

    return _oom_error(ctx, run, serve_all, -1)[1]


def _served_batch_record(
    index: int, sample: Sample, out: RequestOutput, clock: list[float], replica: int
) -> dict[str, Any]:
    """One line of ``batches.jsonl`` for a request the continuous scheduler finished (``clock``: the run's prefill
    and decode seconds when the previous request finished)."""
    return {
        "batch": index,
        "replica": replica,
        "ids": [sample.id],
        "tokens_cut": [int(sample.tokens_cut)],
        "generated_tokens": out.num_generated,
        "prefill_s": out.run_prefill_s - clock[0],
        "decode_s": out.run_decode_s - clock[1],
        "peak_kv_bytes": out.kv_bytes,
        "peak_kv_bytes_per_rank": [out.kv_bytes],
        "peak_workspace_bytes": out.workspace_bytes,
        "cuda_max_memory_allocated": None,
        "slot": out.slot,
        "first_token_s": out.first_token_s,
        "latency_s": out.finished_s,
    }
