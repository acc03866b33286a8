"""The one run path: a run (method, rule, batch size, kv_max) over a task's samples -- resumable, crash-safe,
multi-process. Its parts: ``context`` (what a run is given and holds), ``batches`` (this replica's batches, static
or continuous), ``generation`` (encoding, generating a batch, the warm-up), ``collectives`` (the ranks' meetings),
``oom`` (out-of-memory errors) and ``summary`` (settings and memory fields, ``config.yaml``).

:func:`evaluate_run` generates batch by batch and appends each finished batch to the run's folder
(``OUT/<run>/samples.jsonl`` and ``batches.jsonl``: :class:`batchmax_tp.eval.results.RunLog`); when every batch is
done it writes ``summary.json``. Run again with the same configuration it skips what is already done.

Batches are cut in sample order (``batch_size`` each); batch ``i`` samples with seed ``seed + i`` and runs on
data-parallel replica ``i % dp_size``. With several replicas each one appends its finished batches to its own
shard (``OUT/<run>/replica<R>/``, written by its tensor-parallel rank 0) at its own pace, and the last replica to
finish merges the shards into the run's files and summary (``results.merge_run``): no replica waits for another
before the end of a run, and none waits for a dead one (``eval.replicas``). A progress bar (rank 0) counts
replica 0's samples and shows the session's tokens/s.

Memory: before a run starts, the planner predicts its peak per rank (``plan.budget.predict_spec``: the run's batch
size, the longest prompt of its samples); every summary records it (``predicted_peak_bytes``) next to what was
measured (``peak_kv_bytes``, ``peak_workspace_bytes``, on CUDA ``cuda_max_memory_allocated``). A run whose
prediction exceeds ``memory_budget`` (or that has batch size 0: not even one sample fits) is not run: its summary is
an OOM row (``oom_cause: "predicted"``). A batch that raises an out-of-memory error ends the run with ``status:
"oom"`` (``oom_cause: "runtime"``; the paper's OOM rows); the caching allocator is emptied once the exception is
gone, and the sweep goes on with the next run. In a multi-process run the rank that runs out of memory cannot tell
its peers (they may be waiting inside the model's all-reduce): it writes ``oom-rank<R>.json`` into the run's folder,
reports the failure through the store (every rank's watchdog then ends it) and raises ``oom.RankOutOfMemory``,
which ends the job at once. Running the same command again turns the marker into the run's OOM row, clears it,
and goes on with the next run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ..plan.budget import RunSpec, over_budget_message, predict_spec, prompts_held
from ..plan.planner import MemoryEstimate
from . import results
from .batches import run_batches, serve_replica
from .context import OpenRun, RunContext
from .files import atomic_write_text, utc_now
from .generation import batched
from .summary import model_shape
from .tasks import Sample

if TYPE_CHECKING:  # only the configuration's type is named here (config/ sits below eval/)
    from ..config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["evaluate_run"]


def evaluate_run(
    ctx: RunContext, samples: Sequence[Sample], spec: RunSpec, cfg: RunConfig, *, extra: dict[str, Any] | None = None
) -> results.RunSummary | None:
    """Run (or finish, or skip) one run into ``OUT/<spec.name>``; its summary on rank 0.

    Collective when ``ctx.layout.world > 1``: every rank calls it with the same arguments and the job's
    :class:`Collectives`. Each replica writes its own shard as its batches finish; the last replica to finish
    merges the shards into the run's files and summary (``results.merge_run``). Returns the run's summary
    (``summary.json``, typed: ``results.RunSummary``) on rank 0, None elsewhere. A model without a config gets no
    prediction (and no budget check). ``extra``: more fields for the summary (the same-memory run's budget).
    """
    run = _open_run(ctx, samples, spec, cfg, extra)
    state = ctx.comm.broadcast(_run_state(run.folder) if ctx.is_main else None)  # rank 0 reads what is finished
    if "finished" in state:
        if ctx.is_main:
            logger.info("%s: finished earlier (%s), skipped", spec.name, state["finished"].status)
        return state["finished"] if ctx.is_main else None
    run.estimate = _predict(ctx, run)
    held = lambda budget: _held(ctx, run, budget)  # noqa: E731
    refusal = _refusal(spec, run.estimate, cfg.memory.budget_bytes(), state, held)  # the same verdict on every rank
    if refusal is not None:
        return _record_refusal(ctx, run, *refusal) if ctx.is_main else None
    part = _generate_share(ctx, run, samples)
    summary = ctx.comm.last_decides(part, lambda parts: _merge(run.folder, parts, cfg))
    return summary if ctx.is_main else None


def _open_run(
    ctx: RunContext, samples: Sequence[Sample], spec: RunSpec, cfg: RunConfig, extra: dict[str, Any] | None
) -> OpenRun:
    folder = Path(cfg.output.dir) / spec.name
    continuous = cfg.scheduler == "continuous"
    batches = [[s] for s in samples] if continuous else list(batched(list(samples), max(spec.batch_size, 1)))
    shard = results.RunLog(results.shard_folder(folder, ctx.replica, ctx.dp))
    return OpenRun(spec, cfg, folder, shard, batches, continuous, extra or {})


def _run_state(folder: Path) -> dict[str, Any]:
    """What rank 0 finds of a run: its summary when it has finished, else the out-of-memory marker a rank of the
    last multi-process run left (or None)."""
    finished = results.read_summary(folder)
    return {"finished": finished} if finished is not None else {"oom": results.read_oom_marker(folder)}


def _refusal(
    spec: RunSpec,
    estimate: MemoryEstimate | None,
    budget: int | None,
    state: dict[str, Any],
    held: Callable[[int], str | None] = lambda budget: None,
) -> tuple[str, str] | None:
    """(message, oom_cause) of a run that is recorded as an OOM row without running, or None: over the budget on
    paper ("predicted": the bytes needed and available, and ``held(budget)``: the longest prompt the method fits in
    it), or out of memory in the last run ("runtime": the marker it left)."""
    if spec.batch_size < 1:
        why = "" if budget is None or (text := held(budget)) is None else f" ({text})"
        return f"not even one sample fits the memory budget{why}; not run", "predicted"
    if estimate is not None and budget is not None and estimate.total > budget:
        return over_budget_message(estimate, budget, held(budget)), "predicted"
    marker = state["oom"]
    if marker is not None:
        return (
            f"rank {marker['rank']}, batch {marker['batch']}: {marker['error']} (out of memory in the last run; "
            "recorded as an OOM row)"
        ), "runtime"
    return None


def _record_refusal(ctx: RunContext, run: OpenRun, message: str, cause: str) -> results.RunSummary:
    """Rank 0: the OOM row of a run that does not run (with the batches a runtime OOM left, if any)."""
    logger.warning("%s: %s", run.spec.name, message)
    parts = results.read_parts(run.folder) if cause == "runtime" else []
    metric = run.cfg.data.metric_for_task()
    return results.merge_run(run.folder, run.head(ctx), parts, metric, error=message, cause=cause)


def _generate_share(ctx: RunContext, run: OpenRun, samples: Sequence[Sample]) -> dict[str, Any] | None:
    """This replica's unfinished batches, each appended to its shard as it ends. Returns the replica's part for
    the merge (on its lead rank; None elsewhere)."""
    shard, dp = run.shard, ctx.dp
    done = ctx.comm.replica_share(sorted(b.batch for b in shard.load(run.batch_ids)[1]) if ctx.lead else None)
    share = [i for i in range(len(run.batches)) if i % dp == ctx.replica]
    mine = [i for i in share if i not in done]
    if ctx.lead and dp > 1:
        atomic_write_text(shard.folder / results.HEAD_FILE, _json(run.head(ctx)))
    if ctx.is_main:
        resuming = f", resuming after {len(done)} finished batches" if done else ""
        logger.info(
            "%s: %s, %d samples in %d batches%s",
            run.spec.name,
            run.spec.method.label(),
            len(samples),
            len(run.batches),
            resuming,
        )
    bar = _progress_bar(ctx, run, share, done)
    started_at, start = utc_now(), time.perf_counter()
    try:
        stop = serve_replica(ctx, run, samples, mine, bar) if run.continuous else run_batches(ctx, run, mine, bar)
    finally:
        bar.close()
    if not ctx.lead:
        return None
    part = {"replica": ctx.replica, "started_at": started_at, "wall_s": time.perf_counter() - start, "stop": stop}
    if dp > 1:
        atomic_write_text(shard.folder / results.DONE_FILE, _json(part))
    part["head"] = run.head(ctx)
    part["samples"], part["batches"] = shard.load(run.batch_ids)
    return part


def _progress_bar(ctx: RunContext, run: OpenRun, share: list[int], done: list[int]) -> tqdm:
    """Rank 0's bar over replica 0's samples (``ctx.progress`` False: none)."""
    name = run.spec.name
    return tqdm(
        total=sum(len(run.batches[i]) for i in share),
        initial=sum(len(run.batches[i]) for i in done),
        desc=name if ctx.dp == 1 else f"{name} (replica {ctx.replica} of {ctx.dp})",
        unit="sample",
        dynamic_ncols=True,
        disable=(not ctx.is_main) if ctx.progress is None else not (ctx.progress and ctx.is_main),
    )


def _merge(folder: Path, parts: list[dict[str, Any] | None], cfg: RunConfig) -> results.RunSummary:
    """The last rank to finish a run: the replicas' shards into the run's files and summary."""
    parts = [p for p in parts if p is not None]
    stops = [p["stop"] for p in parts if p.get("stop")]
    metric = cfg.data.metric_for_task()
    summary = results.merge_run(
        folder, parts[0]["head"], parts, metric, error=stops[0] if stops else None, cause="runtime"
    )
    if summary.oom:
        logger.warning("%s: out of memory (%s); run marked OOM", summary.run, stops[0])
    else:
        logger.info(
            "%s: %d samples, %s %.4f, %.2f tokens/s",
            summary.run,
            summary.num_samples,
            summary.metric,
            summary.score or 0.0,
            summary.tokens_per_s or 0.0,
        )
    return summary


def _predict(ctx: RunContext, run: OpenRun) -> MemoryEstimate | None:
    """The planner's peak per rank of this run (None for a model without a config, e.g. a test double)."""
    shape = ctx.shape if ctx.shape is not None else model_shape(ctx.model)
    if shape is None or not run.batches:
        return None
    prompt_len = ctx.prompt_len
    if prompt_len is None:  # every batch is padded to its longest prompt
        encode = ctx.encode
        prompt_len = max(int(encode(ctx.tokenizer, [s.prompt for s in b])[0].shape[-1]) for b in run.batches)
    spec, cfg = run.spec, run.cfg
    new_tokens, batch = cfg.generation.max_new_tokens, max(spec.batch_size, 1)
    return predict_spec(shape, spec.method, batch, prompt_len, new_tokens, cfg.model.dtype, ctx.tp)


def _held(ctx: RunContext, run: OpenRun, budget: int) -> str | None:
    """The longest prompt this run's method fits in ``budget`` at the run's batch, in words (None without a shape)."""
    shape = ctx.shape if ctx.shape is not None else model_shape(ctx.model)
    if shape is None:
        return None
    cfg = run.cfg
    slots = max(run.spec.batch_size, 1)
    return prompts_held(
        shape, run.spec.method, budget, cfg.generation.max_new_tokens, slots=slots, dtype=cfg.model.dtype, tp=ctx.tp
    )


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
