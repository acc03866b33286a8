"""The procedures that choose runs by running: the paper's b0 by real ED trials, and the auto-tuner's trials.

- :func:`b0_trials`: ``fits(b)`` for ``plan.tuner.find_b0`` -- ED (kv_max 2) on the task's b longest prompts,
  left-padded together, for real and under ``memory_budget`` (on CUDA; on a CPU the planner's b0 stands,
  ``plan.budget.paper_specs``);
- :func:`run_tuner`: ``plan.tuner.tune`` over real runs (``OUT/tune/<run>/``, resumable), the chosen config
  written as ``OUT/tuned.yaml`` (usable with ``launch/run.py --config``) and every trial in ``OUT/tune.json``
  (:func:`write_tune_results`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.engine import generate
from ..core.method import Method, method_type
from ..plan.budget import RunSpec, fmt_bytes, planned_dtype, predict_spec, run_dir_name
from ..plan.tuner import Trial, divisor_batches, kv_grid, tune
from .context import RunContext
from .files import atomic_write_text, utc_now
from .generation import EncodeFn, GenerateFn, encode_prompts
from .oom import RankOutOfMemory, error_line, free_memory, is_oom
from .report import write_report
from .run import evaluate_run
from .tasks import Sample, prompt_ids

if TYPE_CHECKING:  # the configuration sits above the evaluation layer; only its type is named here
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["b0_trials", "run_tuner", "tuned_config", "write_tune_results"]


def trial_prompts(tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample]) -> Callable[[int], list]:
    """``prompts(b)``: the prompts of the ``b`` longest samples (encoded length, chat template applied), longest
    first, ties in sample order; cycled from the longest again when ``b`` exceeds the samples."""
    if not samples:
        raise ValueError("b0 trials need at least one sample")
    lengths = [len(prompt_ids(tokenizer, s.prompt)) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])  # stable: ties keep the samples' order
    return lambda b: [samples[order[k % len(order)]].prompt for k in range(b)]


def b0_trials(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    cfg: RunConfig,
    *,
    rank: int = 0,
    world: int = 1,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
) -> Callable[[int], bool]:
    """``fits(b)`` for ``plan.tuner.find_b0``: ED (kv_max 2), 2 new tokens (ED's peak is its whole-prompt
    prefill), for real, on the batch a run of size ``b`` meets at its worst: the ``b`` longest samples' prompts
    (cycled when there are fewer samples, :func:`trial_prompts`) encoded together with left padding
    (``encode_fn``, ``generation.encode_prompts`` unless given), so the trial holds the real lengths and the padding.

    A trial runs under ``cfg.memory.budget_bytes()`` (None: no budget, the whole device): on CUDA the peak is measured
    with ``torch.cuda.max_memory_allocated`` (reset before each trial; weights included, as in the planner's
    total), and a peak over the budget is "does not fit" exactly like an out-of-memory error.

    Each verdict is kept in ``OUT/b0-trials/`` (``fits-b<B>.json`` from rank 0, ``oom-b<B>-rank<R>.json`` from the
    rank that ran out of memory or over the budget; a marker outranks ``fits``, which only speaks for rank 0), so a
    search resumed after a crash asks no batch twice (OUT must be storage every rank sees). In one process the
    verdict is returned; in several, the rank that fails cannot tell its peers (after an out-of-memory error they
    may wait inside the model's all-reduce): it leaves its marker and raises ``RankOutOfMemory``, which ends the
    job; the same command again goes on from the markers.
    """
    return _B0Trials(
        model,
        tokenizer,
        trial_prompts(tokenizer, samples),
        Path(cfg.output.dir) / "b0-trials",
        Method("ed", kv_max=2, p=cfg.sweep.p),
        cfg.memory.budget_bytes(),
        rank,
        world,
        generate_fn or generate,
        encode_fn or encode_prompts,
    )


@dataclass
class _B0Trials:
    """``fits(b)`` of :func:`b0_trials`: a verdict kept in ``folder`` is read back; otherwise ED (``ed2``) runs on
    the ``b`` longest prompts and its verdict is kept."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    prompts: Callable[[int], list]
    folder: Path
    ed2: Method
    budget: int | None
    rank: int
    world: int
    generate_fn: GenerateFn
    encode_fn: EncodeFn

    def __call__(self, b: int) -> bool:
        if any(self.folder.glob(f"oom-b{b}-rank*.json")):
            return False
        if (self.folder / f"fits-b{b}.json").is_file():
            return True
        error, peak = self._trial(b)
        if error is None:
            self._fits(b, peak)
            return True
        self._does_not_fit(b, error, peak)
        return False

    def _trial(self, b: int) -> tuple[str | None, int | None]:
        """(error, peak bytes) of ED on the ``b`` longest prompts: an out-of-memory error, or a peak over the budget
        (the peak is measured on CUDA only)."""
        device = getattr(self.model, "device", None)
        cuda = getattr(device, "type", None) == "cuda"
        input_ids, attention_mask = self.encode_fn(self.tokenizer, self.prompts(b))  # [b, s] left-padded
        if device is not None:
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        error, peak = None, None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            self.generate_fn(self.model, input_ids, attention_mask, self.ed2, 2, ignore_eos=True)
            if cuda:
                peak = int(torch.cuda.max_memory_allocated(device))
        except Exception as err:  # only out-of-memory is a verdict; the rest re-raises
            if not is_oom(err):
                raise
            error = error_line(err)
        del input_ids, attention_mask
        if error is None and peak is not None and self.budget is not None and peak > self.budget:
            error = (
                f"over the memory budget: peak {fmt_bytes(peak)} ({peak} bytes) > memory_budget "
                f"{fmt_bytes(self.budget)} ({self.budget} bytes)"
            )
        return error, peak

    def _fits(self, b: int, peak: int | None) -> None:
        if self.rank == 0:
            verdict = {"batch": b, "fits": True, "peak_bytes": peak, "budget_bytes": self.budget}
            atomic_write_text(self.folder / f"fits-b{b}.json", json.dumps(verdict) + "\n")
        logger.info(
            "paper procedure: ED kv_max 2 at b=%d fits (peak %s, budget %s)", b, fmt_bytes(peak), fmt_bytes(self.budget)
        )

    def _does_not_fit(self, b: int, error: str, peak: int | None) -> None:
        verdict = {"batch": b, "error": error, "peak_bytes": peak, "budget_bytes": self.budget}
        atomic_write_text(self.folder / f"oom-b{b}-rank{self.rank}.json", json.dumps(verdict) + "\n")
        if self.world > 1:
            raise RankOutOfMemory(
                f"paper procedure: rank {self.rank} does not fit ED at b={b} ({error}); "
                "run the same command again to go on with the b0 search"
            )
        free_memory(getattr(self.model, "device", None))
        logger.info("paper procedure: ED kv_max 2 at b=%d does not fit (%s)", b, error)


def tuned_config(cfg: RunConfig, best: Trial) -> RunConfig:
    """The configuration of the chosen BM run: one method at one batch size, into ``OUT/tuned``, on the scheduler the
    trials ran (static batches: a procedure's)."""
    return cfg.replace(
        scheduler=cfg.scheduler,
        methods=["bm"],
        kv_max=best.kv_max,
        batch_size=best.batch,
        runs=None,
        procedure=None,
        kv_values=None,
        target=type(cfg.memory)().target,  # the tuner's goal, unused by the run it chose: the default
        out=str(Path(cfg.output.dir) / "tuned"),
    )


@dataclass
class _TunerTrials:
    """``run_trial(method, b)`` for ``tuner.tune``: a run of the harness into ``OUT/tune/<run>/`` (resumable), its
    summary broadcast from rank 0 so that every rank makes the same choices; the summaries are kept by run name."""

    ctx: RunContext
    samples: Sequence[Sample]
    cfg: RunConfig  #: the job's, with out = OUT/tune
    summaries: dict[str, dict] = field(default_factory=dict)

    def __call__(self, method: Method, batch: int) -> Trial:
        spec = RunSpec(method, batch)  # the method the tuner sized the batch with (BM with the configured rule)
        summary = self.ctx.comm.broadcast(evaluate_run(self.ctx, self.samples, spec, self.cfg))
        self.summaries[spec.name] = summary
        baseline = not method.evicts  # FKV: the metric every BM trial is held to
        if summary.get("status") != "done":
            if baseline:
                raise ValueError(
                    f"memory_budget: FKV at b={batch} fits the budget on paper but ran out of memory "
                    f"({summary.get('error')}); the target metric cannot be measured"
                )
            return Trial(method.name, spec.kv_max, batch, None, None)
        if baseline and summary.get("score") is None:
            raise ValueError("metric: FKV's run has no metric (no sample with a reference was scored)")
        return Trial(method.name, spec.kv_max, batch, summary.get("tokens_per_s"), summary.get("score"))


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
        "kv_values": grid,
        "batches": batches,
        **result.as_dict(),
    }
    for trial in info["trials"]:
        name = run_dir_name(trial["method"], trial["batch"], trial["kv_max"], cfg.sweep.rule_for(trial["method"]))
        trial["run"] = name
        trial["predicted_peak_bytes"] = trials.summaries[name].get("predicted_peak_bytes")
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
        "| trial | method | b | kv_max | metric | tokens/s | predicted peak |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in info["trials"]:
        metric = "OOM" if t["tokens_per_s"] is None else ("n/a" if t["metric"] is None else f"{t['metric']:.3f}")
        speed = "OOM" if t["tokens_per_s"] is None else f"{t['tokens_per_s']:.1f}"
        kv = "N/A" if t["kv_max"] is None or not method_type(t["method"]).evicts else t["kv_max"]
        lines.append(
            f"| {t['run']} | {t['method'].upper()} | {t['batch']} | {kv} | {metric} | {speed} | "
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
        text.append("No BM configuration that fits the budget reaches the target metric; no tuned.yaml written.")
    else:
        tuned = tuned_config(cfg, Trial(**best))
        path = out / "tuned.yaml"
        header = (
            f"# Chosen by the batchmax_tp auto-tuner (launch/tune.py) {utc_now()}: BM b={best['batch']} "
            f"kv_max={best['kv_max']}, {best['tokens_per_s']:.2f} tokens/s, metric {best['metric']:.4f} "
            f">= {info['target_metric']:.4f}.\n# Run with: python launch/run.py --config {path}\n"
        )
        atomic_write_text(path, header + tuned.to_yaml())
        info["tuned_config"] = str(path)
        text += [
            f"Chosen: BM b={best['batch']} kv_max={best['kv_max']} ({best['tokens_per_s']:.1f} tokens/s, "
            f"metric {best['metric']:.3f}); {path}:",
            "",
            tuned.to_yaml().rstrip(),
        ]
    atomic_write_text(out / "tune.json", json.dumps(info, indent=2) + "\n")
    return "\n".join(text) + "\n"
