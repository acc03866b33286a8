"""One evaluation run (method, batch size, kv_max) over a task's samples: resumable, crash-safe, multi-process.

:func:`evaluate_run` generates batch by batch and appends each finished batch to ``OUT/<run>/samples.jsonl``
(:class:`batchmax_tp.results.SampleLog`); when every batch is done it writes ``summary.json``. Run again with
the same configuration it skips what is already done (see :mod:`batchmax_tp.results`).

Batches are cut in sample order (``batch_size`` each); batch ``i`` samples with seed ``seed + i`` and runs on
data-parallel replica ``i % dp_size``. With several processes the replicas advance in rounds (round r: each
replica's r-th unfinished batch); after each round rank 0 gathers the round's records and appends them, so a
multi-process run is as crash-safe as a single process and only rank 0 touches the files.

Memory: before a run starts, the planner predicts its peak per rank (``batchmax_tp.budget.predict_spec``: the
run's batch size, the longest prompt of its samples); every summary records it (``predicted_peak_bytes``) next to
what was measured (``peak_kv_bytes``, ``peak_workspace_bytes``, on CUDA ``cuda_max_memory_allocated``). With a
``memory_budget`` a run whose prediction exceeds it is not run: its summary is an OOM row
(``oom_cause: "predicted"``). A batch that raises an out-of-memory error ends the run with ``status: "oom"``
(``oom_cause: "runtime"``; the paper's OOM rows); the caching allocator is emptied once the exception is gone,
and the sweep goes on with the next run. In a multi-process run the rank that runs out of memory cannot tell its
peers (they may be waiting inside the model's all-reduce): it writes ``oom-rank<R>.json`` into the run's folder and
raises :class:`RankOutOfMemory`, which ends the job at once (``launch/run.py``; peers stuck in a collective time
out within ``tp.GENERATION_TIMEOUT_S`` if the launcher does not stop them first). Running the same command again
turns the marker into the run's OOM row and goes on with the next run.
"""

from __future__ import annotations

import gc
import importlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import metrics, results
from .runner import atomic_write_text, batched, generate_batch, utc_now

logger = logging.getLogger(__name__)

__all__ = ["RankOutOfMemory", "RunSpec", "evaluate_run", "is_oom"]


class RankOutOfMemory(RuntimeError):
    """One rank of a multi-process run ran out of memory; its marker is written and the job must end."""


@dataclass(frozen=True)
class RunSpec:
    """One entry of a sweep: ``method`` is a ``policy.Method`` (which holds kv_max and p)."""

    method: Any
    batch_size: int

    @property
    def kv_max(self) -> int | None:
        return None if self.method.name == "fkv" else self.method.kv_max

    @property
    def name(self) -> str:
        """The run's folder: ``fkv-b4``, ``bm-b32-kv1024``, ``bm-snapkv-b32-kv1024`` (a rule other than the paper's)."""
        return results.run_dir_name(self.method.name, self.batch_size, self.kv_max, self.rule)

    @property
    def rule(self) -> str:
        return getattr(self.method, "rule", "paper")


def is_oom(err: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory."""
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err))


def _free_memory(device: Any) -> None:
    import torch

    gc.collect()
    if getattr(device, "type", None) == "cuda":
        torch.cuda.empty_cache()


def _reference(sample: Any) -> Any:
    ref = sample.reference
    return list(ref) if isinstance(ref, tuple) else ref


def run_settings(cfg: Any, spec: RunSpec, *, tp_size: int = 1, dp_size: int = 1) -> dict[str, Any]:
    """The settings part of a run's ``summary.json`` (everything but the measurements)."""
    return {
        "run": spec.name,
        "method": spec.method.name,
        "rule": spec.rule,
        "batch_size": spec.batch_size,
        "kv_max": spec.kv_max,
        "p": spec.method.p,
        "model": cfg.model,
        "task": cfg.task,
        "data": cfg.data,
        "num_shots": cfg.shots_for_task(),
        "metric": cfg.metric_for_task(),
        "max_input_tokens": cfg.max_input_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "ignore_eos": cfg.ignore_eos,
        "do_sample": cfg.do_sample,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "tp_size": tp_size,
        "dp_size": dp_size,
    }


class _Comm:
    """The collectives of a multi-process run (rank 0 decides, everyone follows); no-ops in one process."""

    def __init__(self, layout: Any, group: Any):
        self.layout, self.group = layout, group
        self.world = 1 if layout is None else layout.world

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.layout.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


def evaluate_run(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Any],
    spec: RunSpec,
    cfg: Any,
    *,
    layout: Any = None,
    group: Any = None,
    generate_fn: Callable[..., Any] | None = None,
    encode_fn: Callable[..., Any] | None = None,
    progress: bool | None = None,
    prompt_len: int | None = None,
    shape: Any = None,
) -> dict[str, Any] | None:
    """Run (or finish, or skip) one run of a sweep into ``cfg.out/<spec.name>``; its summary on rank 0.

    Collective when ``layout.world > 1``: every rank calls it with the same arguments (``group``: a gloo group
    with a long timeout for the result traffic). Returns the ``summary.json`` object on rank 0, None elsewhere.
    ``prompt_len`` (the longest encoded prompt of ``samples``) and ``shape`` (``planner.ModelShape``) are
    computed when not given; a model without a config gets no prediction (and no budget check).
    """
    from tqdm.auto import tqdm

    tasks = importlib.import_module("batchmax_tp.tasks")
    generate_fn = generate_fn or importlib.import_module("batchmax_tp.engine").generate
    encode_fn = encode_fn or tasks.encode_prompts
    comm = _Comm(layout, group)
    is_main = layout is None or layout.is_main
    dp, tp = (1, 1) if layout is None else (layout.dp, layout.tp)
    replica, tp_rank = (0, 0) if layout is None else (layout.replica, layout.tp_rank)

    folder = Path(cfg.out) / spec.name
    log = results.SampleLog(folder / results.SAMPLES_FILE)
    batches = list(batched(list(samples), spec.batch_size))
    batch_ids = [[s.id for s in batch] for batch in batches]

    # Rank 0 reads what is done; every rank learns it.
    state = None
    if is_main:
        finished = results.read_summary(folder)
        if finished is not None:
            state = {"finished": finished}
        else:
            state = {"done": sorted({r["batch"] for r in log.load(batch_ids)}), "oom": results.read_oom_marker(folder)}
    state = comm.broadcast(state)
    if "finished" in state:
        if is_main:
            logger.info("%s: finished earlier (%s), skipped", spec.name, state["finished"].get("status"))
        return state["finished"] if is_main else None
    done = set(state["done"])

    budget_mod = importlib.import_module("batchmax_tp.budget")
    estimate = _predict(model, tokenizer, batches, spec, cfg, tp, prompt_len, shape, encode_fn, budget_mod)
    budget = budget_mod._budget(cfg)
    if estimate is not None and budget is not None and estimate.total > budget:
        # Over the budget on paper: an OOM row, as if the run had failed in its first batch (the same verdict on
        # every rank: the prediction depends only on the config and the samples).
        message = budget_mod.over_budget_message(estimate, budget)
        if not is_main:
            return None
        logger.warning("%s: %s", spec.name, message)
        return _write_oom_row(folder, cfg, spec, tp, dp, estimate, model, [], message, "predicted", time.perf_counter())
    if state["oom"] is not None:  # a rank of the last multi-process run ran out of memory here
        if not is_main:
            return None
        marker = state["oom"]
        message = f"rank {marker['rank']}, batch {marker['batch']}: {marker['error']}"
        logger.warning("%s: out of memory in the last run (%s); recorded as an OOM row", spec.name, message)
        return _write_oom_row(folder, cfg, spec, tp, dp, estimate, model, log.load(batch_ids), message, "runtime",
                              time.perf_counter())

    todo = {r: [i for i in range(len(batches)) if i % dp == r and i not in done] for r in range(dp)}
    mine = todo[replica]
    rounds = max((len(v) for v in todo.values()), default=0)
    metric = cfg.metric_for_task()
    eos_token_id = getattr(tokenizer, "eos_token_id", None)
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos_token_id if isinstance(eos_token_id, int) else None
    device = getattr(model, "device", None)

    done_samples = sum(len(batches[i]) for i in done)
    if is_main:
        logger.info("%s: %s, %d samples in %d batches%s", spec.name,
                    spec.method.label() if hasattr(spec.method, "label") else spec.method.name, len(samples),
                    len(batches), f", resuming after {len(done)} finished batches" if done else "")
    bar = tqdm(total=len(samples), initial=done_samples, desc=spec.name, unit="sample", dynamic_ncols=True,
               disable=(not is_main) if progress is None else not (progress and is_main))
    session_tokens, session_s = 0, 0.0
    started_at, start = utc_now(), time.perf_counter()
    status, stop = "done", None
    try:
        for r in range(rounds):
            index = mine[r] if r < len(mine) else None
            message: dict[str, Any] = {"replica": replica, "tp_rank": tp_rank, "records": None, "peak": 0, "oom": None}
            if index is not None:
                batch = batches[index]
                try:
                    message.update(_run_batch(model, tokenizer, batch, index, spec, cfg, generate_fn, encode_fn,
                                              metric, eos_token_id, pad_token_id, device, replica))
                except Exception as err:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
                    if not is_oom(err):
                        raise
                    message["oom"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                    if comm.world > 1:
                        # Peers may wait inside the model's collectives: nothing can be gathered. Leave the marker
                        # for the next run and end the job.
                        path = results.write_oom_marker(folder, layout.rank, message["oom"], index)
                        raise RankOutOfMemory(
                            f"{spec.name}: rank {layout.rank} ran out of memory in batch {index} ({message['oom']}); "
                            f"recorded in {path}: run the same command again to record the OOM row and go on"
                        ) from None
                if message["oom"]:
                    # Outside the handler: the exception (and the frames holding the batch's tensors) is gone,
                    # so the caching allocator can actually hand their memory back.
                    _free_memory(device)
                if tp_rank != 0:
                    message["records"] = None  # the replica's tp rank 0 reports its (identical) records
            gathered = comm.gather(message)
            if is_main:
                stop, written = _write_round(log, gathered, tp)
                # Progress: this session's tokens/s; the replicas of a round run side by side.
                session_tokens += sum(rec["generated_tokens"] for rec in written)
                session_s += max((rec["batch_prefill_s"] + rec["batch_decode_s"] for rec in written), default=0.0)
                bar.update(len(written))
                if session_s > 0:
                    bar.set_postfix_str(f"{session_tokens / session_s:.1f} tokens/s", refresh=False)
            stop = comm.broadcast(stop)
            if stop is not None:
                status = "oom"
                logger.warning("%s: out of memory (%s); run marked OOM", spec.name, stop)
                break
    finally:
        bar.close()

    if not is_main:
        return None
    records = log.load(batch_ids)
    if status == "oom":
        return _write_oom_row(folder, cfg, spec, tp, dp, estimate, model, records, stop, "runtime", start, started_at)
    summary = run_settings(cfg, spec, tp_size=tp, dp_size=dp)
    summary["status"] = status
    summary.update(results.summarise(records))
    summary.update(budget_mod.budget_fields(cfg, estimate, model))
    summary.update({"started_at": started_at, "finished_at": utc_now(), "wall_s": time.perf_counter() - start})
    atomic_write_text(folder / results.SUMMARY_FILE, _json(summary))
    logger.info("%s: %d samples, %s %.4f, %.2f tokens/s", spec.name, summary["num_samples"], metric,
                    summary["score"] or 0.0, summary["tokens_per_s"] or 0.0)
    return summary


def _write_oom_row(folder: Path, cfg: Any, spec: RunSpec, tp: int, dp: int, estimate: Any, model: Any,
                   records: list, error: str, cause: str, start: float, started_at: str | None = None) -> dict[str, Any]:
    """Rank 0: the run's summary as an OOM row (``cause``: predicted or runtime), written atomically."""
    summary = run_settings(cfg, spec, tp_size=tp, dp_size=dp)
    summary["status"] = "oom"
    summary.update(results.summarise(records))
    summary.update(importlib.import_module("batchmax_tp.budget").budget_fields(cfg, estimate, model))
    summary.update({"error": error, "oom_cause": cause, "started_at": started_at or utc_now(),
                    "finished_at": utc_now(), "wall_s": time.perf_counter() - start})
    atomic_write_text(folder / results.SUMMARY_FILE, _json(summary))
    return summary


def _predict(model, tokenizer, batches, spec, cfg, tp, prompt_len, shape, encode_fn, budget_mod) -> Any:
    """The planner's peak per rank of this run (None for a model without a config, e.g. a test double)."""
    if shape is None:
        shape = budget_mod.model_shape(model)
    if shape is None or not batches:
        return None
    if prompt_len is None:  # every batch is padded to its longest prompt
        prompt_len = max(int(encode_fn(tokenizer, [s.prompt for s in batch])[0].shape[-1]) for batch in batches)
    return budget_mod.predict_spec(shape, spec.method, spec.batch_size, prompt_len, cfg, tp)


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _write_round(
    log: results.SampleLog, gathered: list[dict[str, Any]], tp: int
) -> tuple[str | None, list[dict[str, Any]]]:
    """Rank 0: append one round's records (in batch order, each batch's peak KV summed over its tp ranks).
    Returns ``(out-of-memory message or None, records written)``; nothing is written when a rank ran out of
    memory."""
    ooms = [m["oom"] for m in gathered if m["oom"]]
    if ooms:
        return ooms[0], []
    peaks: dict[int, int] = {}
    for m in gathered:
        peaks[m["replica"]] = peaks.get(m["replica"], 0) + int(m["peak"])
    round_records = []
    for m in sorted((m for m in gathered if m["records"]), key=lambda m: m["records"][0]["batch"]):
        for rec in m["records"]:
            rec["batch_peak_kv_bytes"] = peaks[m["replica"]] if tp > 1 else rec["batch_peak_kv_bytes"]
            round_records.append(rec)
    log.append(round_records)
    return None, round_records


def _run_batch(model, tokenizer, batch, index, spec, cfg, generate_fn, encode_fn, metric, eos_token_id,
               pad_token_id, device, replica) -> dict[str, Any]:
    """Generate one batch and turn it into its per-sample records."""
    out = generate_batch(
        model, tokenizer, [s.prompt for s in batch], spec.method, cfg, cfg.seed + index,
        generate_fn=generate_fn, encode_fn=encode_fn, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        device=device,
    )
    result = out.result
    workspace = int(getattr(result, "peak_workspace_bytes", 0) or 0)
    records = []
    for i, sample in enumerate(batch):
        output = out.outputs[i]
        score = metrics.score(metric, output, sample.reference)
        records.append({
            "id": sample.id,
            "batch": index,
            "replica": replica,
            "output": output,
            "reference": _reference(sample),
            "score": score,
            "correct": None if score is None or metric == "rouge2" else score == 1.0,
            "prompt_tokens": out.prompt_tokens[i],
            "generated_tokens": out.num_generated[i],
            "tokens_cut": int(getattr(sample, "tokens_cut", 0)),
            "batch_prefill_s": float(result.prefill_s),
            "batch_decode_s": float(result.decode_s),
            "batch_peak_kv_bytes": int(result.peak_kv_bytes),
            "batch_peak_workspace_bytes": workspace,
            "batch_cuda_max_memory_allocated": out.cuda_max_memory_allocated,
        })
    return {"records": records, "peak": int(result.peak_kv_bytes)}
