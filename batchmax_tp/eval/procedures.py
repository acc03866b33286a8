"""The procedure that chooses runs by running: the auto-tuner's trials.

- :func:`run_tuner`: ``plan.tuner.tune`` over real runs (``OUT/tune/<run>/``, resumable), the chosen config
  written as ``OUT/tuned.yaml`` (usable with ``launch/run.py --config``) and every trial in ``OUT/tune.json``
  (:func:`write_tune_results`).

(The paper's b0 came from real ED trials on CUDA until 2026-11-26: this engine's ED never caches its prompts, so it
does not run out of memory where the paper's ED does; b0 is now the planner's, ``planner.paper_ed_bytes``.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.method import Method, is_full_cache, method_type, takes_rule
from ..plan.budget import RunSpec, fmt_bytes, planned_dtype, predict_spec
from ..plan.tuner import Trial, divisor_batches, kv_grid, trial_name, tune
from .context import RunContext
from .files import atomic_write_text, utc_now
from .records import RunSummary
from .report import write_report
from .run import evaluate_run
from .tasks import Sample

if TYPE_CHECKING:  # only the configuration's type is named here (config/ sits below eval/)
    from ..config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["run_tuner", "tuned_config", "write_tune_results"]


def tuned_config(cfg: RunConfig, best: Trial) -> RunConfig:
    """The configuration of the chosen run: one method (its spec as the tuner was given it) at one batch size, into
    ``OUT/tuned``, on the scheduler the trials ran (static batches: a procedure's)."""
    spec = next((m for m in tune_methods(cfg) if method_type(m).name == best.method), best.method)
    rule = {} if best.rule is None else {"rule": best.rule}
    return cfg.replace(
        **rule,
        scheduler=cfg.scheduler,
        methods=[spec],
        kv_max=None if is_full_cache(spec) else best.kv_max,
        batch_size=best.batch,
        runs=None,
        procedure=None,
        kv_values=None,
        target=type(cfg.memory)().target,  # the tuner's goal and candidates, unused by the run it chose: defaults
        cheaper_rules=type(cfg.memory)().cheaper_rules,
        out=str(Path(cfg.output.dir) / "tuned"),
    )


@dataclass
class _TunerTrials:
    """``run_trial(method, b)`` for ``tuner.tune``: a run of the harness into ``OUT/tune/<run>/`` (resumable), its
    summary broadcast from rank 0 so that every rank makes the same choices; the summaries are kept by run name."""

    ctx: RunContext
    samples: Sequence[Sample]
    cfg: RunConfig  #: the job's, with out = OUT/tune
    summaries: dict[str, RunSummary] = field(default_factory=dict)
    names: dict[tuple, str] = field(default_factory=dict)  #: (method, kv_max, rule, batch) -> the run's folder name

    def __call__(self, method: Method, batch: int) -> Trial:
        spec = RunSpec(method, batch)  # the method the tuner sized the batch with (BM with the rule it tries)
        rule = method.rule if takes_rule(method) else None
        summary = self.ctx.comm.broadcast(evaluate_run(self.ctx, self.samples, spec, self.cfg))
        self.summaries[spec.name] = summary
        self.names[method.name, spec.kv_max, rule, batch] = spec.name
        baseline = is_full_cache(method)  # FKV: the metric every BM trial is held to
        if summary.status != "done":
            if baseline:
                raise ValueError(
                    f"memory_budget: FKV at b={batch} fits the budget on paper but ran out of memory "
                    f"({summary.error}); the target metric cannot be measured"
                )
            return Trial(method.name, spec.kv_max, batch, None, None, rule)
        if baseline and summary.score is None:
            raise ValueError("metric: FKV's run has no metric (no sample with a reference was scored)")
        return Trial(method.name, spec.kv_max, batch, summary.tokens_per_s, summary.score, rule)


def tune_methods(cfg: RunConfig) -> list[str]:
    """The methods the tuner chooses among: ``--method`` when given (e.g. ``fkv,bm,snap``), else BM alone."""
    given = cfg.sweep.methods != type(cfg.sweep)().methods
    return list(cfg.sweep.methods) if given else ["bm"]


def run_tuner(ctx: RunContext, samples: Sequence[Sample], cfg: RunConfig) -> dict[str, Any]:
    """``tuner.tune`` with real runs (:class:`_TunerTrials`, into ``OUT/tune/<run>/``); BM runs with the configured
    rule, and its batches are sized with it. ``ctx`` holds the model's ``shape`` and the longest ``prompt_len``.
    Collective in a multi-process run (every rank calls it). Returns the content of ``OUT/tune.json`` (the rank-0
    caller writes it, ``OUT/tuned.yaml`` and ``OUT/tune/report.md``: :func:`write_tune_results`)."""
    if all(getattr(s, "reference", None) is None for s in samples):
        raise ValueError("metric: the tuner compares BM's task metric with FKV's, but no sample has a reference")
    budget, prompt_len, p = cfg.memory.budget_bytes(), ctx.prompt_len, cfg.sweep.p
    _check_fkv_fits(ctx, cfg, budget)
    rule = cfg.sweep.rule_for("bm")
    grid = list(cfg.memory.kv_values) if cfg.memory.kv_values else kv_grid(prompt_len, 128, p, rule)
    batches = divisor_batches(len(samples), len(samples))
    trials = _TunerTrials(ctx, samples, cfg.replace(out=str(Path(cfg.output.dir) / "tune")))
    new_tokens, dtype = cfg.generation.max_new_tokens, planned_dtype(cfg.model.dtype)
    target = cfg.memory.target
    result = tune(
        trials,
        budget,
        ctx.shape,
        prompt_len,
        new_tokens,
        target=target,
        dtype=dtype,
        tp=ctx.tp,
        p=p,
        kv_values=grid,
        batches=batches,
        rule=rule,
        methods=tune_methods(cfg),
        cheaper=cfg.memory.cheaper_rules,
    )
    info = {
        "procedure": "tune",
        "memory_budget_bytes": budget,
        "prompt_len": prompt_len,
        "max_new_tokens": new_tokens,
        "num_samples": len(samples),
        "tp_size": ctx.tp,
        "target": target,
        "rule": rule,
        "methods": tune_methods(cfg),
        "kv_values": grid,
        "batches": batches,
        **result.as_dict(),
    }
    for trial in info["trials"]:
        name = trials.names[trial["method"], trial["kv_max"], trial["rule"], trial["batch"]]
        trial["run"] = name
        trial["predicted_peak_bytes"] = trials.summaries[name].predicted_peak_bytes
    info["summaries"] = list(trials.summaries.values())
    return info


def _check_fkv_fits(ctx: RunContext, cfg: RunConfig, budget: int) -> None:
    """ValueError when FKV does not fit the budget at batch 1: then the target metric cannot be measured."""
    fkv = Method("fkv", p=cfg.sweep.p)
    fkv_1 = predict_spec(ctx.shape, fkv, 1, ctx.prompt_len, cfg.generation.max_new_tokens, cfg.model.dtype, ctx.tp)
    if fkv_1.total > budget:
        raise ValueError(
            f"memory_budget: {fmt_bytes(budget)} per rank does not fit FKV at batch 1 (predicted "
            f"{fmt_bytes(fkv_1.total)} for the longest prompt, {ctx.prompt_len} tokens): the target metric "
            "cannot be measured"
        )


def write_tune_results(cfg: RunConfig, info: dict[str, Any]) -> str:
    """Rank 0 after :func:`run_tuner`: ``OUT/tune.json``, ``OUT/tune/report.md`` (+ CSV, plots) and, when a BM
    configuration reached the target, ``OUT/tuned.yaml``. Returns the text to print."""
    out = Path(cfg.output.dir)
    summaries = info.pop("summaries")
    if summaries:
        write_report(out / "tune", summaries)
    lines = [
        "| trial | method | rule | b | kv_max | metric | tokens/s | predicted peak |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in info["trials"]:
        metric = "OOM" if t["tokens_per_s"] is None else ("n/a" if t["metric"] is None else f"{t['metric']:.3f}")
        speed = "OOM" if t["tokens_per_s"] is None else f"{t['tokens_per_s']:.1f}"
        kv = "N/A" if t["kv_max"] is None or is_full_cache(t["method"]) else t["kv_max"]
        lines.append(
            f"| {t['run']} | {t['method'].upper()} | {t['rule'] or '-'} | {t['batch']} | {kv} | {metric} | {speed} | "
            f"{fmt_bytes(t['predicted_peak_bytes'])} |"
        )
    best = info["best"]
    head = (
        f"Auto-tuner: budget {fmt_bytes(info['memory_budget_bytes'])} per rank, longest prompt "
        f"{info['prompt_len']} tokens, target {info['target']} x FKV's metric "
        f"({info['fkv']['metric']:.3f}) = {info['target_metric']:.3f}; {len(info['trials'])} trials."
    )
    text = [head, "", *lines, ""]
    if best is None:
        info["tuned_config"] = None
        text.append(
            f"No configuration of {', '.join(info['methods'])} that fits the budget reaches the target metric; no "
            "tuned.yaml written."
        )
    else:
        chosen = Trial(**best)
        tuned = tuned_config(cfg, chosen)
        path = out / "tuned.yaml"
        header = (
            f"# Chosen by the batchmax_tp auto-tuner (launch/tune.py) {utc_now()}: {trial_name(chosen)} "
            f"b={best['batch']}, {best['tokens_per_s']:.2f} tokens/s, metric "
            f"{best['metric']:.4f} >= {info['target_metric']:.4f}.\n# Run with: python launch/run.py --config {path}\n"
        )
        atomic_write_text(path, header + tuned.to_yaml())
        info["tuned_config"] = str(path)
        text += [
            f"Chosen: {trial_name(chosen)} b={best['batch']} "
            f"({best['tokens_per_s']:.1f} tokens/s, metric {best['metric']:.3f}); {path}:",
            f"Why: {info['why']}.",
            "",
            tuned.to_yaml().rstrip(),
        ]
    atomic_write_text(out / "tune.json", json.dumps(info, indent=2) + "\n")
    return "\n".join(text) + "\n"
