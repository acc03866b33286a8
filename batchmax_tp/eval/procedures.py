"""The procedures that choose runs by running: the paper's b0 by real ED trials, and the auto-tuner's trials.

- :func:`b0_trials`: ``fits(b)`` for ``plan.tuner.find_b0`` -- ED (kv_max 2) on the task's b longest prompts,
  left-padded together, for real and under ``memory_budget`` (on CUDA; on a CPU the planner's b0 stands,
  ``plan.budget.paper_specs``);
- :func:`run_tuner`: ``plan.tuner.tune`` over real runs (``OUT/tune/<run>/``, resumable), the chosen config
  written as ``OUT/tuned.yaml`` (usable with ``launch/run.py --config``) and every trial in ``OUT/tune.json``
  (:func:`write_tune_results`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.engine import generate
from ..core.method import Method
from ..parallel import Layout
from ..plan.budget import RunSpec, fmt_bytes, planned_dtype, predict_spec, run_dir_name
from ..plan.planner import ModelShape
from ..plan.tuner import Trial, divisor_batches, kv_grid, tune
from .files import atomic_write_text, utc_now
from .report import write_report
from .run import (
    Collectives,
    EncodeFn,
    GenerateFn,
    RankOutOfMemory,
    encode_prompts,
    error_line,
    evaluate_run,
    free_memory,
    is_oom,
)
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
    (``encode_fn``, ``run.encode_prompts`` unless given), so the trial holds the real lengths and the padding.

    A trial runs under ``cfg.budget_bytes()`` (None: no budget, the whole device): on CUDA the peak is measured
    with ``torch.cuda.max_memory_allocated`` (reset before each trial; weights included, as in the planner's
    total), and a peak over the budget is "does not fit" exactly like an out-of-memory error.

    Each verdict is kept in ``OUT/b0-trials/`` (``fits-b<B>.json`` from rank 0, ``oom-b<B>-rank<R>.json`` from the
    rank that ran out of memory or over the budget; a marker outranks ``fits``, which only speaks for rank 0), so a
    search resumed after a crash asks no batch twice (OUT must be storage every rank sees). In one process the
    verdict is returned; in several, the rank that fails cannot tell its peers (after an out-of-memory error they
    may wait inside the model's all-reduce): it leaves its marker and raises ``RankOutOfMemory``, which ends the
    job; the same command again goes on from the markers.
    """
    folder = Path(cfg.out) / "b0-trials"
    ed2 = Method("ed", kv_max=2, p=cfg.p)
    budget = cfg.budget_bytes()
    prompts = trial_prompts(tokenizer, samples)
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    device = getattr(model, "device", None)
    cuda = getattr(device, "type", None) == "cuda"

    def fits(b: int) -> bool:
        if any(folder.glob(f"oom-b{b}-rank*.json")):
            return False
        if (folder / f"fits-b{b}.json").is_file():
            return True
        input_ids, attention_mask = encode_fn(tokenizer, prompts(b))  # [b, s] left-padded, s = the longest
        if device is not None:
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        error, peak = None, None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            generate_fn(model, input_ids, attention_mask, ed2, 2, ignore_eos=True)
            if cuda:
                peak = int(torch.cuda.max_memory_allocated(device))
        except Exception as err:  # only out-of-memory is a verdict; the rest re-raises
            if not is_oom(err):
                raise
            error = error_line(err)
        del input_ids, attention_mask
        if error is None and peak is not None and budget is not None and peak > budget:
            error = (
                f"over the memory budget: peak {fmt_bytes(peak)} ({peak} bytes) > memory_budget "
                f"{fmt_bytes(budget)} ({budget} bytes)"
            )
        if error is None:
            if rank == 0:
                atomic_write_text(
                    folder / f"fits-b{b}.json",
                    json.dumps({"batch": b, "fits": True, "peak_bytes": peak, "budget_bytes": budget}) + "\n",
                )
            logger.info(
                "paper procedure: ED kv_max 2 at b=%d fits (peak %s, budget %s)", b, fmt_bytes(peak), fmt_bytes(budget)
            )
            return True
        atomic_write_text(
            folder / f"oom-b{b}-rank{rank}.json",
            json.dumps({"batch": b, "error": error, "peak_bytes": peak, "budget_bytes": budget}) + "\n",
        )
        if world > 1:
            raise RankOutOfMemory(
                f"paper procedure: rank {rank} does not fit ED at b={b} ({error}); "
                "run the same command again to go on with the b0 search"
            )
        free_memory(device)
        logger.info("paper procedure: ED kv_max 2 at b=%d does not fit (%s)", b, error)
        return False

    return fits


def tuned_config(cfg: RunConfig, best: Trial) -> RunConfig:
    """The configuration of the chosen BM run: one method at one batch size, into ``OUT/tuned``."""
    return dataclasses.replace(
        cfg,
        methods=["bm"],
        kv_max=best.kv_max,
        batch_size=best.batch,
        runs=None,
        procedure=None,
        kv_values=None,
        out=str(Path(cfg.out) / "tuned"),
    )


def run_tuner(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    cfg: RunConfig,
    *,
    shape: ModelShape,
    prompt_len: int,
    layout: Layout | None = None,
    comm: Collectives | None = None,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
) -> dict[str, Any]:
    """``tuner.tune`` with real runs: each trial (method, b) is a run of the harness into ``OUT/tune/<run>/``
    (resumable: a finished trial is read back, not run again); BM runs with ``cfg.rule``, and its batches are sized
    with it. Collective in a multi-process run (every rank calls it; rank 0's summaries are broadcast so that every
    rank makes the same choices). Returns the content of ``OUT/tune.json`` (the rank-0 caller writes it,
    ``OUT/tuned.yaml`` and ``OUT/tune/report.md``: :func:`write_tune_results`)."""
    if all(getattr(s, "reference", None) is None for s in samples):
        raise ValueError("metric: the tuner compares BM's task metric with FKV's, but no sample has a reference")
    comm = comm or Collectives(layout)
    tp = 1 if layout is None else layout.tp
    budget = cfg.budget_bytes()
    trial_cfg = dataclasses.replace(cfg, out=str(Path(cfg.out) / "tune"))
    summaries: dict[str, dict] = {}

    def run_trial(method: Method, batch: int) -> Trial:
        spec = RunSpec(method, batch)  # the method the tuner sized the batch with (BM with the configured rule)
        summary = evaluate_run(
            model,
            tokenizer,
            samples,
            spec,
            trial_cfg,
            layout=layout,
            comm=comm,
            prompt_len=prompt_len,
            shape=shape,
            generate_fn=generate_fn,
            encode_fn=encode_fn,
        )
        summary = comm.broadcast(summary)
        summaries[spec.name] = summary
        if summary.get("status") != "done":
            if method.name == "fkv":
                raise ValueError(
                    f"memory_budget: FKV at b={batch} fits the budget on paper but ran out of memory "
                    f"({summary.get('error')}); the target metric cannot be measured"
                )
            return Trial(method.name, spec.kv_max, batch, None, None)
        if method.name == "fkv" and summary.get("score") is None:
            raise ValueError("metric: FKV's run has no metric (no sample with a reference was scored)")
        return Trial(method.name, spec.kv_max, batch, summary.get("tokens_per_s"), summary.get("score"))

    rule = cfg.rule_for("bm")
    grid = list(cfg.kv_values) if cfg.kv_values else kv_grid(prompt_len, 128, cfg.p, rule)
    batches = divisor_batches(len(samples), len(samples))
    fkv_1 = predict_spec(shape, Method("fkv", p=cfg.p), 1, prompt_len, cfg.max_new_tokens, cfg.dtype, tp)
    if fkv_1.total > budget:
        raise ValueError(
            f"memory_budget: {fmt_bytes(budget)} per rank does not fit FKV at batch 1 (predicted "
            f"{fmt_bytes(fkv_1.total)} for the longest prompt, {prompt_len} tokens): the target metric "
            "cannot be measured"
        )
    result = tune(
        run_trial,
        budget,
        shape,
        prompt_len,
        cfg.max_new_tokens,
        target=cfg.target,
        dtype=planned_dtype(cfg.dtype),
        tp=tp,
        p=cfg.p,
        kv_values=grid,
        batches=batches,
        rule=rule,
    )
    info = {
        "procedure": "tune",
        "memory_budget_bytes": budget,
        "prompt_len": prompt_len,
        "max_new_tokens": cfg.max_new_tokens,
        "num_samples": len(samples),
        "tp_size": tp,
        "target": cfg.target,
        "rule": rule,
        "kv_values": grid,
        "batches": batches,
        **result.as_dict(),
    }
    for trial in info["trials"]:
        name = run_dir_name(trial["method"], trial["batch"], trial["kv_max"], cfg.rule_for(trial["method"]))
        trial["run"] = name
        trial["predicted_peak_bytes"] = summaries[name].get("predicted_peak_bytes")
    info["summaries"] = list(summaries.values())
    return info


def write_tune_results(cfg: RunConfig, info: dict[str, Any]) -> str:
    """Rank 0 after :func:`run_tuner`: ``OUT/tune.json``, ``OUT/tune/report.md`` (+ CSV, plots) and, when a BM
    configuration reached the target, ``OUT/tuned.yaml``. Returns the text to print."""
    out = Path(cfg.out)
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
        kv = "N/A" if t["kv_max"] is None or t["method"] == "fkv" else t["kv_max"]
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
