"""A memory budget per rank for the main job: predicted peaks, the paper's batch-size procedure and the auto-tuner.

The glue between :mod:`batchmax_tp.planner` / :mod:`batchmax_tp.tuner` (pure functions of shapes) and the
resumable harness :func:`batchmax_tp.evaluate.evaluate_run` (real runs):

- :func:`predict_spec`: the planner's peak per rank of one run (method, b, kv_max) of a sweep, with the run's
  batch size and the longest prompt of its samples (every batch is padded to its longest prompt, so no batch of
  the run needs more). ``evaluate_run`` records it in every summary and, when it exceeds ``memory_budget``,
  writes an OOM row without running anything.
- :func:`paper_specs`: the runs of the paper's procedure (section 4.1; ``tuner.paper_plan``): ED (kv_max 2) at
  b0, the smallest batch that does not fit (an OOM row), ED 2 and 65 and FKV at b0 - 1, BM at each kv_max's
  largest fitting batch that divides the number of samples.
- :func:`run_tuner`: ``tuner.tune`` over real runs (``OUT/tune/<run>/``, resumable), the chosen config written
  as ``OUT/tuned.yaml`` (usable with ``launch/run.py --config``) and every trial in ``OUT/tune.json``.

On a CPU the budget is an accounting device: nothing stops a run from using more memory than the budget, and the
OOM rows are the planner's verdicts. On CUDA a real ``torch.OutOfMemoryError`` is also an OOM row
(``evaluate_run``), and ``cuda_max_memory_allocated`` is recorded next to the prediction.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "budget_fields",
    "fmt_bytes",
    "longest_prompt",
    "model_shape",
    "over_budget_message",
    "ed_trials",
    "paper_specs",
    "predict_spec",
    "run_tuner",
    "tuned_config",
    "warm_up_methods",
    "weights_bytes",
    "write_tune_results",
]


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def model_shape(model: Any) -> Any:
    """``planner.ModelShape`` of a loaded model (its text config), or None when it has no usable config."""
    from .planner import ModelShape

    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    try:
        return ModelShape.from_config(config)
    except (AttributeError, TypeError):
        return None


def longest_prompt(tokenizer: Any, samples: Sequence[Any]) -> int:
    """Tokens of the longest encoded prompt (chat template applied; after ``max_input_tokens`` cutting): the
    padded length of the batch that holds it, and so the prompt length every run is planned for."""
    from .tasks import prompt_ids

    return max(len(prompt_ids(tokenizer, s.prompt)) for s in samples)


def planned_dtype(cfg: Any) -> str:
    """The dtype a run is planned for: ``launch/run.py`` resolves ``auto`` before planning (the checkpoint's dtype on
    CUDA); a config used directly with ``auto`` plans float32, what ``auto`` means on a CPU."""
    return "float32" if cfg.dtype == "auto" else cfg.dtype


def predict_spec(shape: Any, method: Any, batch_size: int, prompt_len: int, cfg: Any, tp: int = 1) -> Any:
    """The planner's ``MemoryEstimate`` per rank of a run of ``batch_size`` prompts padded to ``prompt_len``."""
    from .planner import predict

    return predict(shape, method, batch_size, prompt_len, cfg.max_new_tokens, tp=tp, dtype=planned_dtype(cfg))


def _budget(cfg: Any) -> int | None:
    fn = getattr(cfg, "budget_bytes", None)
    return fn() if callable(fn) else None


def weights_bytes(model: Any) -> int | None:
    """Bytes of the parameters this process holds (after a tensor-parallel split: this rank's share)."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return None
    seen, total = set(), 0
    for p in params():
        if id(p) not in seen:  # tied weights count once
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def budget_fields(cfg: Any, estimate: Any, model: Any = None) -> dict[str, Any]:
    """The memory part of a summary: the budget and the prediction (per rank), the bytes of the weights this
    process holds (``weights_bytes``; the planner's ``predicted.weights`` is its estimate) and this process's peak
    host memory (``peak_host_bytes``)."""
    return {
        "memory_budget_bytes": _budget(cfg),
        "predicted_peak_bytes": None if estimate is None else estimate.total,
        "predicted": None if estimate is None else estimate.as_dict(),
        "weights_bytes": weights_bytes(model),
        "peak_host_bytes": peak_host_bytes(),
    }


def peak_host_bytes() -> int:
    """This process's peak resident host memory so far (loading included), in bytes."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def over_budget_message(estimate: Any, budget: int) -> str:
    parts = (f"K/V {fmt_bytes(estimate.kv)}, score block {fmt_bytes(estimate.workspace)}, "
             f"weights {fmt_bytes(estimate.weights)}, activations {fmt_bytes(estimate.activations)}")
    return (f"predicted peak {fmt_bytes(estimate.total)} per rank ({estimate.total} bytes: {parts}) exceeds "
            f"memory_budget {fmt_bytes(budget)} ({budget} bytes); not run")


def warm_up_methods(cfg: Any) -> list:
    """One method of each kind for the untimed warm-up of a procedure (its runs are known only after planning)."""
    from .policy import Method

    kv = cfg.kv_values[0] if cfg.kv_values else max(128, cfg.p + 64)
    return [Method("fkv", p=cfg.p), Method("ed", kv_max=2, p=cfg.p), Method("bm", kv_max=kv, p=cfg.p, rule=cfg.rule)]


# ---------------------------------------------------------------------- the paper's procedure
def ed_trials(model: Any, input_ids: Any, attention_mask: Any, cfg: Any, *, rank: int = 0, world: int = 1,
              generate_fn: Callable[..., Any] | None = None) -> Callable[[int], bool]:
    """``fits(b)`` for :func:`tuner.find_b0`: ED (kv_max 2) on ``b`` copies of the longest prompt
    (``input_ids [1, s]``), 2 new tokens (ED's peak is its whole-prompt prefill), for real.

    Each verdict is kept in ``OUT/b0-trials/`` (``fits-b<B>.json`` from rank 0, ``oom-b<B>-rank<R>.json`` from the
    rank that ran out of memory), so a search resumed after a crash asks no batch twice (OUT must be storage every
    rank sees). In one process an out-of-memory error is the verdict; in several, the rank that hits it cannot tell
    its peers (they may wait inside the model's all-reduce): it leaves its marker and raises ``RankOutOfMemory``,
    which ends the job; the same command again goes on from the markers.
    """
    import gc

    import torch

    from .evaluate import RankOutOfMemory, is_oom
    from .policy import Method
    from .runner import atomic_write_text

    generate_fn = generate_fn or importlib.import_module("batchmax_tp.engine").generate
    folder = Path(cfg.out) / "b0-trials"
    ed2 = Method("ed", kv_max=2, p=cfg.p)

    def fits(b: int) -> bool:
        if (folder / f"fits-b{b}.json").is_file():
            return True
        if any(folder.glob(f"oom-b{b}-rank*.json")):
            return False
        error = None
        try:
            generate_fn(model, input_ids.expand(b, -1), attention_mask.expand(b, -1), ed2, 2, ignore_eos=True)
        except Exception as err:  # noqa: BLE001 - only out-of-memory is a verdict; the rest re-raises
            if not is_oom(err):
                raise
            error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        if error is None:
            if rank == 0:
                atomic_write_text(folder / f"fits-b{b}.json", json.dumps({"batch": b, "fits": True}) + "\n")
            logger.info("paper procedure: ED kv_max 2 at b=%d fits", b)
            return True
        atomic_write_text(folder / f"oom-b{b}-rank{rank}.json", json.dumps({"batch": b, "error": error}) + "\n")
        if world > 1:
            raise RankOutOfMemory(f"paper procedure: rank {rank} ran out of memory trying ED at b={b} ({error}); "
                                  "run the same command again to go on with the b0 search")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("paper procedure: ED kv_max 2 at b=%d runs out of memory", b)
        return False

    return fits


def paper_specs(cfg: Any, shape: Any, prompt_len: int, *, num_samples: int, tp: int = 1,
                fits: Callable[[int], bool] | None = None) -> tuple[list, dict]:
    """The runs of the paper's procedure (``tuner.paper_plan``) as ``RunSpec``s, and the plan as a dict
    (``OUT/plan.json``): b0, the prompt length, each run's predicted peak and whether it fits.

    ``fits``: real trials (:func:`ed_trials`, on CUDA): b0 is then searched for real from the planner's guess
    (``b0_source: measured``); without it the planner's b0 stands (``b0_source: planner``, as on a CPU)."""
    from .evaluate import RunSpec
    from .tuner import find_b0, kv_grid, paper_plan, planned_b0

    budget = cfg.budget_bytes()
    grid = list(cfg.kv_values) if cfg.kv_values else kv_grid(prompt_len, 128, cfg.p)
    dtype = planned_dtype(cfg)
    guess = planned_b0(budget, shape, prompt_len, cfg.max_new_tokens, dtype=dtype, tp=tp, p=cfg.p)
    measured = find_b0(guess, fits) if fits is not None else None
    plan = paper_plan(budget, shape, prompt_len, cfg.max_new_tokens, dtype=dtype, tp=tp, p=cfg.p,
                      num_samples=num_samples, kv_values=grid, b0=measured)
    specs = [RunSpec(dataclasses.replace(m, rule=cfg.rule_for(m.name)), b) for m, b in plan]
    b0 = specs[0].batch_size
    adjusted = None
    for spec in specs:
        if spec.method.name == "fkv" and spec.batch_size < b0 - 1:
            adjusted = (f"FKV at b0 - 1 = {b0 - 1} is predicted over the budget; it runs at b = {spec.batch_size}, "
                        f"the largest batch that fits (only its metric is used)")
            logger.warning("paper procedure: %s", adjusted)
    rows = []
    for spec in specs:
        est = predict_spec(shape, spec.method, spec.batch_size, prompt_len, cfg, tp)
        rows.append({"run": spec.name, "method": spec.method.name, "rule": spec.method.rule,
                     "batch_size": spec.batch_size,
                     "kv_max": spec.kv_max, "predicted_peak_bytes": est.total, "fits": est.total <= budget})
    planned = {s.kv_max for s in specs if s.method.name == "bm"}
    info = {
        "procedure": "paper",
        "memory_budget_bytes": budget,
        "prompt_len": prompt_len,
        "max_new_tokens": cfg.max_new_tokens,
        "num_samples": num_samples,
        "tp_size": tp,
        "b0": b0,
        "b0_source": "planner" if measured is None else "measured",
        "b0_planned": guess,
        "b0_note": (f"b0 = {b0} from the planner's prediction (no real out-of-memory search on this device)"
                    if measured is None else f"b0 = {b0} found by real ED trials on the device (the planner "
                    f"predicted {guess}; trials in b0-trials/)"),
        "adjusted": adjusted,
        "kv_values": grid,
        "kv_values_without_a_fitting_batch": [k for k in grid if k not in planned],
        "runs": rows,
    }
    logger.info("paper procedure: budget %s, longest prompt %d tokens, b0 = %d (ED kv_max 2 does not fit); runs: %s",
                fmt_bytes(budget), prompt_len, b0, ", ".join(s.name for s in specs))
    if info["kv_values_without_a_fitting_batch"]:
        logger.warning("paper procedure: no batch dividing %d fits BM with kv_max %s", num_samples,
                       info["kv_values_without_a_fitting_batch"])
    big = [s.name for s in specs[1:] if s.batch_size > num_samples]
    if big:
        logger.warning("paper procedure: %s ask for more than the %d samples; their batches hold %d", big,
                       num_samples, num_samples)
    return specs, info


# ---------------------------------------------------------------------- the auto-tuner
def tuned_config(cfg: Any, best: Any) -> Any:
    """The configuration of the chosen BM run: one method at one batch size, into ``OUT/tuned``."""
    return dataclasses.replace(cfg, methods=["bm"], kv_max=best.kv_max, batch_size=best.batch, runs=None,
                               procedure=None, kv_values=None, out=str(Path(cfg.out) / "tuned"))


def run_tuner(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Any],
    cfg: Any,
    *,
    shape: Any,
    prompt_len: int,
    layout: Any = None,
    group: Any = None,
    generate_fn: Callable[..., Any] | None = None,
    encode_fn: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """``tuner.tune`` with real runs: each trial (method, b) is a run of the harness into ``OUT/tune/<run>/``
    (resumable: a finished trial is read back, not run again). Collective in a multi-process run (every rank
    calls it; rank 0's summaries are broadcast so that every rank makes the same choices). Returns the content
    of ``OUT/tune.json`` (the rank-0 caller writes it, ``OUT/tuned.yaml`` and ``OUT/tune/report.md``:
    :func:`write_tune_results`)."""
    from . import evaluate, results
    from .policy import Method
    from .tuner import Trial, divisor_batches, kv_grid, tune

    if all(getattr(s, "reference", None) is None for s in samples):
        raise ValueError("metric: the tuner compares BM's task metric with FKV's, but no sample has a reference")
    comm = evaluate._Comm(layout, group)
    tp = 1 if layout is None else layout.tp
    budget = cfg.budget_bytes()
    trial_cfg = dataclasses.replace(cfg, out=str(Path(cfg.out) / "tune"))
    summaries: dict[str, dict] = {}

    def run_trial(method: Any, batch: int) -> Trial:
        spec = evaluate.RunSpec(Method(method.name, kv_max=method.kv_max, p=cfg.p, rule=cfg.rule_for(method.name)),
                                batch)
        summary = evaluate.evaluate_run(model, tokenizer, samples, spec, trial_cfg, layout=layout, group=group,
                                        prompt_len=prompt_len, shape=shape, generate_fn=generate_fn,
                                        encode_fn=encode_fn)
        summary = comm.broadcast(summary)
        summaries[spec.name] = summary
        if summary.get("status") != "done":
            if method.name == "fkv":
                raise ValueError(f"memory_budget: FKV at b={batch} fits the budget on paper but ran out of memory "
                                 f"({summary.get('error')}); the target metric cannot be measured")
            return Trial(method.name, spec.kv_max, batch, None, None)
        if method.name == "fkv" and summary.get("score") is None:
            raise ValueError("metric: FKV's run has no metric (no sample with a reference was scored)")
        return Trial(method.name, spec.kv_max, batch, summary.get("tokens_per_s"), summary.get("score"))

    grid = list(cfg.kv_values) if cfg.kv_values else kv_grid(prompt_len, 128, cfg.p)
    batches = divisor_batches(len(samples), len(samples))
    fkv_1 = predict_spec(shape, Method("fkv", p=cfg.p), 1, prompt_len, cfg, tp)
    if fkv_1.total > budget:
        raise ValueError(f"memory_budget: {fmt_bytes(budget)} per rank does not fit FKV at batch 1 (predicted "
                         f"{fmt_bytes(fkv_1.total)} for the longest prompt, {prompt_len} tokens): the target metric "
                         "cannot be measured")
    result = tune(run_trial, budget, shape, prompt_len, cfg.max_new_tokens, target=cfg.target, dtype=planned_dtype(cfg),
                  tp=tp, p=cfg.p, kv_values=grid, batches=batches)
    info = {
        "procedure": "tune",
        "memory_budget_bytes": budget,
        "prompt_len": prompt_len,
        "max_new_tokens": cfg.max_new_tokens,
        "num_samples": len(samples),
        "tp_size": tp,
        "target": cfg.target,
        "kv_values": grid,
        "batches": batches,
        **result.as_dict(),
    }
    for trial in info["trials"]:
        name = results.run_dir_name(trial["method"], trial["batch"], trial["kv_max"])
        trial["run"] = name
        trial["predicted_peak_bytes"] = summaries[name].get("predicted_peak_bytes")
    info["summaries"] = list(summaries.values())
    return info


def write_tune_results(cfg: Any, info: dict[str, Any]) -> str:
    """Rank 0 after :func:`run_tuner`: ``OUT/tune.json``, ``OUT/tune/report.md`` (+ CSV, plots) and, when a BM
    configuration reached the target, ``OUT/tuned.yaml``. Returns the text to print."""
    from . import report
    from .runner import atomic_write_text, utc_now
    from .tuner import Trial

    out = Path(cfg.out)
    summaries = info.pop("summaries")
    if summaries:
        report.write_report(out / "tune", summaries)
    lines = ["| trial | method | b | kv_max | metric | tokens/s | predicted peak |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for t in info["trials"]:
        metric = "OOM" if t["tokens_per_s"] is None else ("n/a" if t["metric"] is None else f"{t['metric']:.3f}")
        speed = "OOM" if t["tokens_per_s"] is None else f"{t['tokens_per_s']:.1f}"
        kv = "N/A" if t["kv_max"] is None or t["method"] == "fkv" else t["kv_max"]
        lines.append(f"| {t['run']} | {t['method'].upper()} | {t['batch']} | {kv} | {metric} | {speed} | "
                     f"{fmt_bytes(t['predicted_peak_bytes'])} |")
    best = info["best"]
    head = (f"Auto-tuner: budget {fmt_bytes(info['memory_budget_bytes'])} per rank, longest prompt "
            f"{info['prompt_len']} tokens, target {info['target']} x FKV's metric "
            f"({info['fkv']['metric']:.3f}) = {info['target_metric']:.3f}; {len(info['trials'])} trials.")
    text = [head, "", *lines, ""]
    if best is None:
        info["tuned_config"] = None
        text.append("No BM configuration that fits the budget reaches the target metric; no tuned.yaml written.")
    else:
        tuned = tuned_config(cfg, Trial(**best))
        path = out / "tuned.yaml"
        header = (f"# Chosen by the batchmax_tp auto-tuner (launch/tune.py) {utc_now()}: BM b={best['batch']} "
                  f"kv_max={best['kv_max']}, {best['tokens_per_s']:.2f} tokens/s, metric {best['metric']:.4f} "
                  f">= {info['target_metric']:.4f}.\n# Run with: python launch/run.py --config {path}\n")
        atomic_write_text(path, header + tuned.to_yaml())
        info["tuned_config"] = str(path)
        text += [f"Chosen: BM b={best['batch']} kv_max={best['kv_max']} ({best['tokens_per_s']:.1f} tokens/s, "
                 f"metric {best['metric']:.3f}); {path}:", "", tuned.to_yaml().rstrip()]
    atomic_write_text(out / "tune.json", json.dumps(info, indent=2) + "\n")
    return "\n".join(text) + "\n"
