"""Reports of a sweep of runs: a Markdown table laid out like the paper's Tables 1-2, a CSV and two PNG plots.

Input: the ``summary.json`` objects of the runs (``results.summarise`` plus the run's settings), in run order. A run
that ran out of memory has ``status: "oom"`` and
shows as ``OOM`` in the table (as in the paper) and as a cross on the throughput plot.

Files (in ``OUT``): ``report.md``, ``results.csv``, ``throughput.png`` (tokens/s against batch size, one line
per method, rule and kv_max) and ``metric_vs_kv.png`` (the task metric against kv_max; FKV, which has no kv_max,
as a dashed line); a same-memory run adds ``claim.png`` (tokens/s against answers, one point per method). Plots
are drawn with matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from ..core.method import METHODS, Method, has, ranks_by_attention
from .files import atomic_write_text
from .metrics import METRIC_LABELS
from .records import RunSummary

logger = logging.getLogger(__name__)

__all__ = [
    "CSV_COLUMNS",
    "REPORT_FILES",
    "format_csv",
    "format_report",
    "mask_timings",
    "plot_metric_vs_kv",
    "plot_throughput",
    "write_report",
]

REPORT_FILES = ("report.md", "results.csv", "throughput.png", "metric_vs_kv.png")
#: The same-memory run's picture (tokens/s against answers, one point per method), beside ``REPORT_FILES``.
CLAIM_FILE = "claim.png"

#: CSV columns left empty for a run that ran out of memory (its batches before the OOM are not a result).
_MEASURED = (
    "score",
    "num_scored",
    "generated_tokens",
    "prefill_s",
    "decode_s",
    "tokens_per_s",
    "peak_kv_mib",
    "samples_cut",
    "tokens_cut",
    "peak_workspace_mib",
    "cuda_max_memory_allocated_mib",
)

CSV_COLUMNS = (
    "task",
    "model",
    "method",
    "batch_size",
    "kv_max",
    "p",
    "status",
    "metric",
    "score",
    "num_samples",
    "num_scored",
    "generated_tokens",
    "prefill_s",
    "decode_s",
    "tokens_per_s",
    "peak_kv_mib",
    "samples_cut",
    "tokens_cut",
    "max_new_tokens",
    "tp_size",
    "dp_size",
    "run",
    # memory (per rank except peak_kv_mib, which is the replica's K/V over its tensor-parallel ranks)
    "peak_workspace_mib",
    "cuda_max_memory_allocated_mib",
    "predicted_peak_mib",
    "memory_budget_mib",
    "oom_cause",
    "weights_mib",
    "rule",
    "tokens_per_s_spread",
    "num_correct",
    "num_checked",
)
_MIB_OF = {
    "peak_workspace_mib": "peak_workspace_bytes",
    "cuda_max_memory_allocated_mib": "cuda_max_memory_allocated",
    "predicted_peak_mib": "predicted_peak_bytes",
    "memory_budget_mib": "memory_budget_bytes",
    "weights_mib": "weights_bytes",
}

#: Colours of further series of one method (another kv_max or rule), in order of appearance.
_MORE_COLOURS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
#: Markers of BM under rules other than the paper's, in order (metric plot), beside :data:`_MORE_COLOURS`.
_RULE_MARKERS = ("D", "v", "P", "X", "*", "h", "<")
_AXIS_LABELS = {
    "rouge2": "rouge-2 F-measure (mean over samples)",
    "accuracy": "accuracy (fraction of correct answers)",
    "exact": "exact match (fraction of samples)",
    "contains": "contains (fraction of outputs with the answer)",
}
_TIMING_CELL = "t/s"  # what mask_timings puts in place of a timing


def _style(name: str) -> tuple[str, str, str]:
    """(legend label, colour, marker) of the method called ``name``: facts of the method (``core.method``); a name no
    method has: itself, grey, a circle."""
    kind = METHODS.get(name)
    return (kind.legend, kind.colour, kind.marker) if kind is not None else (name, "tab:gray", "o")


def _typed(summaries: Sequence[RunSummary | Mapping[str, Any]]) -> list[RunSummary]:
    """The runs as :class:`RunSummary` (a ``summary.json`` object as read is converted)."""
    return [RunSummary.from_json(s) for s in summaries]


def _is(s: RunSummary, kind: Callable[[type[Method]], bool]) -> bool:
    """Whether summary ``s`` is a run of a method that ``kind`` picks by its class's facts (``core.method.has``)."""
    return has(s.method, kind)


def _full_cache(kind: type[Method]) -> bool:
    """FKV, the accuracy reference: never evicts."""
    return not kind.evicts


def _decoding_only(kind: type[Method]) -> bool:
    """ED, the throughput reference: keeps the newest pair alone."""
    return kind.keeps_newest


def _with_rules(kind: type[Method]) -> bool:
    """BM: has eviction rules to choose among."""
    return kind.takes_rule


def _short(method: str) -> str:
    """The method called ``method`` in tables and plots (``Method.short_name``; an unknown name as it is)."""
    cls = METHODS.get(method)
    return method if cls is None else cls.short_name


def _order(method: str) -> int:
    """Where reports list the method called ``method`` (``Method.report_order``; an unknown name last)."""
    cls = METHODS.get(method)
    return 9 if cls is None else cls.report_order


def _lead(summaries: Sequence[RunSummary]) -> RunSummary:
    """The run whose settings head the report: the first that did not run out of memory (an OOM run may have
    stopped before its first sample)."""
    return next((s for s in summaries if not s.oom), summaries[0])


def _metric_label(summaries: Sequence[RunSummary]) -> str:
    metric = next((s.metric for s in summaries if s.metric), "contains")
    return METRIC_LABELS.get(metric, metric)


def _speed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _score(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


# ---------------------------------------------------------------------- Markdown
def format_report(summaries: Sequence[RunSummary | Mapping[str, Any]], *, title: str | None = None) -> str:
    """The Markdown report: a header with the settings, the paper-style table, then BM against ED and FKV."""
    summaries = _typed(summaries)
    if not summaries:
        raise ValueError("format_report needs at least one run")
    first = _lead(summaries)
    label = _metric_label(summaries)
    task = first.task or "jsonl"
    lines = [f"# {title or f'Batch-Max results: {task}'}", ""]
    lines.append(
        f"Model `{first.model}`, task `{task}` ({first.num_shots}-shot, metric {label}), "
        f"{_prompts(summaries)} samples, {first.max_new_tokens} new tokens"
        f"{' (EOS ignored)' if first.ignore_eos else ''}, max_input_tokens {first.max_input_tokens}, "
        f"p = {first.p}, tp_size {first.tp_size} x dp_size {first.dp_size}, "
        f"{first.dtype} on {first.device}."
    )
    lines += [
        "",
        f"| Method | b | kv_max | {label} | correct | tokens/s | peak KV MiB | predicted peak MiB | prompts cut |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        method = _method_label(s)
        kv = "N/A" if s.kv_max is None else str(s.kv_max)
        predicted = _mib(s.predicted_peak_bytes)
        if s.oom:
            lines.append(f"| {method} | {s.batch_size} | {kv} | OOM | - | OOM | OOM | {predicted} | |")
            continue
        correct = f"{s.num_correct}/{s.num_checked}" if s.num_checked else "-"
        lines.append(
            f"| {method} | {s.batch_size} | {kv} | {_score(s.score)} | {correct} | "
            f"{_speed(s.tokens_per_s)} | {s.peak_kv_mib:.1f} | {predicted} | "
            f"{s.samples_cut}/{s.num_samples} |"
        )
    main = [s for s in summaries if not s.paper_setting]  # the paper's static setting has its own section
    fkv = _fastest_fkv(summaries)
    lines += ["", *_comparison(main, label)]
    lines += ["", *_same_memory_ratios(main, label, fkv)]
    lines += ["", *_memory(summaries)]
    lines += ["", *_every_method(main, label, fkv)]
    lines += ["", *_paper_setting(main, [s for s in summaries if s.paper_setting])]
    return "\n".join(lines).rstrip() + "\n"


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def _memory(summaries: Sequence[RunSummary]) -> list[str]:
    """The memory accounting of each run: the planner's prediction per rank (and the budget) beside what was
    measured. Only for runs that recorded a prediction (``plan.budget.predict_spec``)."""
    rows = [s for s in summaries if s.predicted]
    if not rows:
        return []
    budgets = {s.memory_budget_bytes for s in rows}
    budget = next(iter(budgets)) if len(budgets) == 1 else None
    lines = ["## Memory per rank (MiB)", ""]
    lines.append(
        (
            f"Budget {_mib(budget)} MiB per rank: a run whose predicted peak exceeds it is an OOM row "
            "without being run. "
            if budget is not None
            else "No memory budget. "
        )
        + "Predicted by `batchmax_tp.plan.planner` from shapes: K/V and the score block exactly, weights from the "
        "parameter count, activations an estimate. Measured: the K/V buffers, the largest score block, the "
        "weights this process holds"
        + (" (K/V over all tensor-parallel ranks of a replica)" if any(s.tp_size > 1 for s in rows) else "")
        + ", and on CUDA `torch.cuda.max_memory_allocated`."
    )
    lines += [
        "",
        "| Method | b | kv_max | status | predicted | K/V | score block | weights | activations | "
        "measured K/V | measured score block | loaded weights | CUDA max allocated |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in rows:
        p = s.predicted
        method = _method_label(s)
        kv = "N/A" if s.kv_max is None else str(s.kv_max)
        status = f"OOM ({s.oom_cause or 'runtime'})" if s.oom else "done"
        measured = (
            ["", "", _mib(s.weights_bytes), ""]
            if s.oom
            else [
                _mib(s.peak_kv_bytes),
                _mib(s.peak_workspace_bytes),
                _mib(s.weights_bytes),
                _mib(s.cuda_max_memory_allocated),
            ]
        )
        lines.append(
            f"| {method} | {s.batch_size} | {kv} | {status} | {_mib(p['total'])} | {_mib(p['kv'])} | "
            f"{_mib(p['workspace'])} | {_mib(p['weights'])} | {_mib(p['activations'])} | " + " | ".join(measured) + " |"
        )
    return lines


def _spread(s: RunSummary) -> str:
    x = s.tokens_per_s_spread
    return f"+/-{100.0 * x:.0f}% over {s.num_batches} batches" if x is not None else "1 full batch"


def _comparison(summaries: Sequence[RunSummary], label: str) -> list[str]:
    """BM's throughput against the fastest ED run and its metric against the FKV run (the paper's analysis). Next
    to each throughput ratio: how far the runs' own batches spread (the machine's noise as the runs saw it); a
    difference smaller than that spread is called so."""
    ok = [s for s in summaries if not s.oom]
    ed = [s for s in ok if _is(s, _decoding_only) and s.tokens_per_s]
    fkv = [s for s in ok if _is(s, _full_cache) and s.score is not None]
    bm = [s for s in ok if _is(s, _with_rules)]
    if not bm or not (ed or fkv):
        return []
    best_ed = max(ed, key=lambda s: s.tokens_per_s) if ed else None
    ref = fkv[0] if fkv else None
    against = []
    if best_ed:
        against.append(f"the fastest ED run (b={best_ed.batch_size}, kv_max={best_ed.kv_max})")
    if ref:
        against.append(f"the full cache FKV (b={ref.batch_size})")
    lines = [
        f"BM against {' and '.join(against)} (throughput spread: half the range of a run's full batches' "
        "tokens/s, as a share of their mean):"
    ]
    for s in bm:
        parts = []
        if best_ed and s.tokens_per_s:
            gain = 100.0 * (s.tokens_per_s / best_ed.tokens_per_s - 1.0)
            noise = 100.0 * max(s.tokens_per_s_spread or 0.0, best_ed.tokens_per_s_spread or 0.0)
            within = " -- within that noise" if abs(gain) <= noise else ""
            parts.append(f"throughput {gain:+.1f}% vs ED (spread BM {_spread(s)}, ED {_spread(best_ed)}{within})")
        if ref and s.score is not None and ref.score:
            parts.append(f"{label} {100.0 * s.score / ref.score:.1f}% of FKV")
        elif ref and s.score is not None:
            parts.append(f"{label} {_score(s.score)} (FKV {_score(ref.score)})")
        rule = "" if s.rule == "paper" else f" rule {s.rule}"
        lines.append(f"- BM{rule} b={s.batch_size} kv_max={s.kv_max}: {', '.join(parts)}")
    return lines


def _fastest_fkv(summaries: Sequence[RunSummary]) -> RunSummary | None:
    """The fastest FKV run of a same-memory job (continuous, or the paper's static padded batch beside it): what every
    same-memory ratio divides by."""
    runs = [s for s in summaries if s.same_memory_budget_bytes and not s.oom and s.tokens_per_s]
    return max((s for s in runs if _is(s, _full_cache)), key=lambda s: s.tokens_per_s, default=None)


def _fkv_named(fkv: RunSummary | None) -> str:
    """Which FKV run the ratios divide by: its batch and policy."""
    if fkv is None:
        return "none ran"
    policy = "the paper's static padded batch" if fkv.paper_setting else "continuous"
    return f"b={fkv.batch_size}, {policy}"


def _ratio(x: float | None, ref: RunSummary | None) -> str:
    if x is None or ref is None or not ref.tokens_per_s:
        return "n/a"
    return f"{x / ref.tokens_per_s:.2f}x"


def _same_memory_ratios(summaries: Sequence[RunSummary], label: str, fkv: RunSummary | None) -> list[str]:
    """The plain run's claim in one table (only for the same-memory run, whose summaries carry its budget): each
    BM rule's tokens/s, and snap's (SnapKV after the prompt: the peer users run instead), over the fastest FKV run's
    (``fkv``: continuous or static) and over the fastest ED run's, all in the same memory; the paper's rule first."""
    if not any(s.same_memory_budget_bytes for s in summaries):
        return []
    ok = [s for s in summaries if not s.oom and s.tokens_per_s]
    # BM (the paper's rule first), then snap
    bm = sorted(
        (s for s in summaries if _is(s, ranks_by_attention)),
        key=lambda s: (_order(s.method), s.rule != "paper"),
    )
    ed = max((s for s in ok if _is(s, _decoding_only)), key=lambda s: s.tokens_per_s, default=None)
    if not bm:
        return []
    lines = ["## Same memory: BM's tokens/s over FKV's and ED's", ""]
    lines.append(
        "Each BM rule's tokens/s, and snap's, divided by those of the fastest FKV run ("
        + _fkv_named(fkv)
        + ") and of the fastest ED run ("
        + (f"b={ed.batch_size}, kv_max={ed.kv_max}" if ed else "none ran")
        + "), every run within the same memory budget; the paper's rule first."
    )
    lines += [
        "",
        f"| method | b | kv_max | {label} | tokens/s | tokens/s / FKV | tokens/s / ED |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in bm:
        kv = s.kv_max
        name = _short(s.method) + (f" ({s.rule})" if _is(s, _with_rules) else "")
        if s.oom:
            lines.append(f"| {name} | {s.batch_size} | {kv} | OOM | OOM | OOM | OOM |")
            continue
        speed = s.tokens_per_s
        lines.append(
            f"| {name} | {s.batch_size} | {kv} | {_score(s.score)} | {_speed(speed)} | "
            f"{_ratio(speed, fkv)} | {_ratio(speed, ed)} |"
        )
    return lines


def _every_method(summaries: Sequence[RunSummary], label: str, fkv: RunSummary | None) -> list[str]:
    """The same-memory run's every method at its own fastest, one table (answers beside tokens/s, the prompt's and
    the decode's seconds apart), its tokens/s over the fastest FKV run's (``fkv``), and the ceiling the arithmetic
    allows: that FKV's prefill seconds with the fastest bounded method's decode seconds (the prompt at full-cache
    cost, the decode at a bounded slot's)."""
    if not any(s.same_memory_budget_bytes for s in summaries):
        return []
    ok = [s for s in summaries if not s.oom and s.tokens_per_s]
    lines = [
        "## Every method at its own fastest, one budget",
        "",
        "Prefill ms per real prompt token and decode seconds are the run's own (summed over its passes); tokens/s / "
        f"FKV divides by the fastest FKV run ({_fkv_named(fkv)}).",
        "",
        f"| method | b | kv_max | {label} | correct | tokens/s | tokens/s / FKV | prefill ms / prompt token "
        "| decode s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sorted(summaries, key=lambda s: (_order(s.method), s.rule != "paper")):
        kv = "N/A" if s.kv_max is None else str(s.kv_max)
        name = _method_label(s)
        if s.oom:
            lines.append(f"| {name} | {s.batch_size} | {kv} | OOM | - | OOM | OOM | OOM | OOM |")
            continue
        correct = f"{s.num_correct}/{s.num_checked}" if s.num_checked else "-"
        per_token = f"{1e3 * s.prefill_s / s.prompt_tokens:.2f}" if s.prompt_tokens else "n/a"
        lines.append(
            f"| {name} | {s.batch_size} | {kv} | {_score(s.score)} | {correct} | "
            f"{_speed(s.tokens_per_s)} | {_ratio(s.tokens_per_s, fkv)} | {per_token} | "
            f"{'n/a' if s.decode_s is None else format(s.decode_s, '.1f')} |"
        )
    bounded = [s for s in ok if not _is(s, _full_cache) and not _is(s, _decoding_only) and s.decode_s is not None]
    if fkv and bounded and fkv.prefill_s is not None:
        best = min(bounded, key=lambda s: s.decode_s)
        ceiling = fkv.generated_tokens / (fkv.prefill_s + best.decode_s)
        lines += [
            "",
            f"Ceiling: FKV's prefill ({fkv.prefill_s:.1f} s) with {_method_label(best)}'s decode "
            f"({best.decode_s:.1f} s) would make {ceiling:.1f} tokens/s ({ceiling / fkv.tokens_per_s:.2f}x FKV).",
        ]
    return lines


def _paper_setting(main: Sequence[RunSummary], paper: Sequence[RunSummary]) -> list[str]:
    """The paper's comparison (static padded batches: ED and FKV at b0 - 1, BM at its batch) beside the continuous
    engine's runs of the same methods in the same budget, and why BM's gain over ED differs between them."""
    if not paper:
        return []

    def find(runs, kind, **match) -> RunSummary | None:
        found = [s for s in runs if _is(s, kind) and all(getattr(s, k) == v for k, v in match.items())]
        return found[0] if found else None

    rows = [("ED", _decoding_only, {}), ("FKV", _full_cache, {}), ("BM", _with_rules, {"rule": "paper"})]
    ed_static = find(paper, _decoding_only)
    lines = [
        "## The paper's setting beside the continuous engine",
        "",
        "The paper compares static padded batches: ED and FKV at b0 - 1"
        + (f" = {ed_static.batch_size}" if ed_static else "")
        + ", where b0 is the smallest batch at which the paper's ED, its prompts held in full through prefill, "
        "does not fit the budget, and BM at its largest fitting batch. The continuous engine prefills one group of "
        "prompts at a time, so an ED slot never holds its prompt (2 pairs per head): ED's batch is no longer capped "
        "by b0, and BM's gain over ED shrinks or turns.",
        "",
        "| method | static b | static tokens/s | continuous b | continuous tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, kind, match in rows:
        st, co = find(paper, kind, **match), find(main, kind, **match)
        cells = [
            ("-", "-") if r is None else (str(r.batch_size), "OOM" if r.oom else _speed(r.tokens_per_s))
            for r in (st, co)
        ]
        lines.append(f"| {name} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | {cells[1][1]} |")
    gains = []
    for where, runs in (("static (the paper's setting)", paper), ("continuous", main)):
        ed, bm = find(runs, _decoding_only), find(runs, _with_rules, rule="paper")
        if ed and bm and ed.tokens_per_s and bm.tokens_per_s:
            gains.append(f"{where} {100.0 * (bm.tokens_per_s / ed.tokens_per_s - 1.0):+.0f}%")
    if gains:
        lines += ["", f"BM (paper) over ED: {', '.join(gains)}."]
    return lines


def plot_claim(summaries: Sequence[RunSummary | Mapping[str, Any]], path: str | os.PathLike[str]) -> Figure:
    """The claim in one picture (the same-memory run): tokens/s against answers kept (the metric), one point per
    method at its own fastest, in one memory budget, and the line of 90% of FKV's metric."""
    summaries = _typed(summaries)
    fig, ax = _figure()
    ok = [s for s in summaries if not s.oom and s.tokens_per_s and s.score is not None]
    labels = []
    for s in ok:
        _, colour, marker = _style(s.method)
        if s.rule != "paper":
            colour, marker = "tab:purple", "D"
        ax.scatter([s.tokens_per_s], [s.score], color=colour, marker=marker, s=60, zorder=3)
        name = _method_label(s) + ("" if s.kv_max is None else f" {s.kv_max}")
        line = {"arrowstyle": "-", "color": "tab:gray", "linewidth": 0.5, "shrinkA": 0, "shrinkB": 4}
        labels.append(
            ax.annotate(
                name, (s.tokens_per_s, s.score), textcoords="offset points", xytext=(6, 4), fontsize=8, arrowprops=line
            )
        )
    fkv = next((s for s in ok if _is(s, _full_cache)), None)
    if fkv is not None:  # the accuracy the claim is made at
        ax.axhline(0.9 * fkv.score, color="tab:gray", linestyle="--", linewidth=1, label="90% of FKV's")
        ax.legend(fontsize=8, loc="lower right")
    budget = next((s.same_memory_budget_bytes for s in summaries if s.same_memory_budget_bytes), None)
    ax.set_xlabel("throughput (generated tokens / s)")
    ax.set_ylabel(_AXIS_LABELS.get(_lead(summaries).metric, _metric_label(summaries)))
    ax.set_title(
        f"Tokens/s against answers, one budget ({_mib(budget)} MiB)\n{_subtitle(summaries)}",
        fontsize=10,
    )
    ax.set_xlim(left=0.0, right=max([1e-3, *(s.tokens_per_s for s in ok)]) * 1.3)
    ax.set_ylim(bottom=0.0, top=max([1e-3, *(s.score for s in ok)]) * 1.15)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    _separate(fig, labels)
    fig.savefig(path, format="png")
    return fig


def _separate(fig: Figure, labels: list, step: float = 9.0, tries: int = 24) -> None:
    """Move each label (an annotation, in offset points) up or down, farther each try, until its box overlaps no
    label placed before it: points that sit close (FKV and a rule that keeps its answers) keep readable labels, each
    joined to its point by a thin line."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for label in labels:
        x, y = label.xyann
        for k in range(tries + 1):
            label.xyann = (x, y + (k + 1) // 2 * step * (1 if k % 2 else -1))  # 0, +1, -1, +2, -2, ... steps
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
        placed.append(label.get_window_extent(renderer))


def mask_timings(report: str) -> str:
    """``report.md`` with everything that depends on wall-clock time replaced by ``t/s``: every table column whose
    header names tokens/s (the speeds and their ratios) and the throughput percentages of the comparison lines."""
    out = []
    columns: list[int] | None = None
    for line in report.splitlines():
        if line.startswith("|"):
            cells = line.split("|")
            if columns is None:
                columns = [i for i, c in enumerate(cells) if "tokens/s" in c]  # the header row
            elif columns and not set(cells[columns[0]].strip()) <= set("-:"):  # a row, not the alignment line
                for i in columns:
                    cells[i] = f" {_TIMING_CELL} " if cells[i].strip() != "OOM" else cells[i]
            line = "|".join(cells)
        else:
            columns = None  # a table ends at the first line that is not a row
        line = re.sub(r"throughput [+-][\d.]+% vs ED \(spread [^)]*\)", f"throughput {_TIMING_CELL} vs ED", line)
        out.append(line)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- CSV
def _method_label(s: RunSummary) -> str:
    """``BM``, or ``BM (snapkv)`` for a rule other than the paper's; ``ED, static`` for a run of the main job's
    paper setting."""
    label = _rule_label(s.method, s.rule)
    return f"{label}, static" if s.paper_setting else label


def _rule_label(method: str, rule: str | None) -> str:
    """``BM``, or ``BM (snapkv)`` for a rule other than the paper's."""
    return _short(method) if rule == "paper" else f"{_short(method)} ({rule})"


def format_csv(summaries: Sequence[RunSummary | Mapping[str, Any]]) -> str:
    """One row per run with :data:`CSV_COLUMNS` (empty cells for OOM runs' measurements)."""
    summaries = _typed(summaries)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for s in summaries:
        row = {key: getattr(s, key) for key in CSV_COLUMNS if key not in _MIB_OF}
        for column, key in _MIB_OF.items():
            row[column] = None if getattr(s, key) is None else getattr(s, key) / 2**20
        if s.oom:
            row.update({key: None for key in _MEASURED})
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


# ---------------------------------------------------------------------- plots
def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7.0, 4.6), dpi=120)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _subtitle(summaries: Sequence[RunSummary]) -> str:
    first = _lead(summaries)
    model = str(first.model or "").split("/")[-1].replace("embedded:", "")
    return f"{first.task or 'jsonl'}, {model}, {_prompts(summaries)} samples, {first.max_new_tokens} new tokens"


def _prompts(summaries: Sequence[RunSummary]) -> int:
    """The samples every run answered: the fewest a run served (the main job's whole waves add unscored repeats to
    some runs)."""
    ran = [s.num_samples for s in summaries if not s.oom]
    return min(ran) if ran else _lead(summaries).num_samples


def _methods(summaries: Sequence[RunSummary]) -> list[str]:
    return sorted({s.method for s in summaries}, key=_order)


def _series(summaries: Sequence[RunSummary]) -> list[tuple[str, str, list[RunSummary]]]:
    """(label, colour, runs by batch size) of each line of the throughput plot: one per method, rule and kv_max,
    so that a line never joins two cache sizes."""
    groups: dict[tuple, list[RunSummary]] = {}
    for method in _methods(summaries):
        for s in summaries:
            if s.method == method and not s.oom and s.tokens_per_s:
                groups.setdefault((method, s.rule, s.kv_max), []).append(s)
    out, used = [], set()
    for (method, rule, kv), runs in groups.items():
        colour = _style(method)[1] if method not in used else _MORE_COLOURS[(len(out)) % len(_MORE_COLOURS)]
        used.add(method)
        label = _style(method)[0] if not _evicts(method) else f"{_rule_label(method, rule)}, kv_max {kv}"
        out.append((label, colour, sorted(runs, key=lambda s: s.batch_size)))
    return out


def plot_throughput(summaries: Sequence[RunSummary | Mapping[str, Any]], path: str | os.PathLike[str]) -> Figure:
    """tokens/s against batch size, one line per method, rule and kv_max (named in the legend, so no point carries
    a label that could overlap another's); OOM runs as crosses. Returns the figure (also saved to ``path``)."""
    summaries = _typed(summaries)
    fig, ax = _figure()
    ok = [s for s in summaries if not s.oom and s.tokens_per_s]
    for label, colour, runs in _series(summaries):
        ax.plot(
            [s.batch_size for s in runs],
            [s.tokens_per_s for s in runs],
            marker=_style(runs[0].method)[2],
            color=colour,
            label=label,
        )
    ooms = [s for s in summaries if s.oom]
    if ooms:
        ax.scatter(
            [s.batch_size for s in ooms],
            [0.0] * len(ooms),
            marker="x",
            s=60,
            color="tab:red",
            label="out of memory (OOM)",
            zorder=3,
            clip_on=False,
        )
    ax.set_xlabel("batch size b (samples per batch)")
    ax.set_ylabel("throughput (generated tokens / s)")
    ax.set_title(f"Throughput vs batch size\n{_subtitle(summaries)}", fontsize=10)
    top = max([1e-3, *(s.tokens_per_s for s in ok)])
    ax.set_ylim(bottom=0.0, top=top * 1.12)
    ax.margins(x=0.12)
    batch_sizes = sorted({s.batch_size for s in summaries})
    if len(batch_sizes) <= 12:
        ax.set_xticks(batch_sizes)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return fig


def _point_series(runs: Sequence[RunSummary]) -> list[tuple[str, str, tuple[str, str, str]]]:
    """(method, rule, (legend label, colour, marker)) of each point series of the metric plot: one per method and
    rule, so that BM under each eviction rule has its own marker, colour and label (``BM (question)``)."""
    keys = sorted(
        {(s.method, s.rule) for s in runs},
        key=lambda k: (_order(k[0]), k[1] != "paper", k[1]),
    )
    out, extra = [], 0
    for method, rule in keys:
        if rule == "paper":
            style = _style(method)
        else:
            style = (
                _rule_label(method, rule),
                _MORE_COLOURS[extra % len(_MORE_COLOURS)],
                _RULE_MARKERS[extra % len(_RULE_MARKERS)],
            )
            extra += 1
        out.append((method, rule, style))
    return out


def plot_metric_vs_kv(summaries: Sequence[RunSummary | Mapping[str, Any]], path: str | os.PathLike[str]) -> Figure:
    """The task metric against kv_max (log2 axis) for ED and BM (one marker and colour per eviction rule), points
    labelled with b; FKV as a dashed line. Returns the figure (also saved to ``path``)."""
    summaries = _typed(summaries)
    fig, ax = _figure()
    label = _metric_label(summaries)
    ok = [s for s in summaries if not s.oom and s.score is not None]
    kvs = sorted({s.kv_max for s in ok if s.kv_max is not None})
    for method, rule, (legend, colour, marker) in _point_series(ok):
        runs = [s for s in ok if s.method == method and s.rule == rule]
        if not _evicts(method):  # the full cache: one dashed line per score
            _plot_full_cache(ax, runs, legend, colour)
            continue
        _plot_points(ax, sorted(runs, key=lambda s: (s.kv_max, s.batch_size)), legend, colour, marker)
    _kv_axis(ax, kvs)
    ax.set_xlabel("kv_max (KV pairs kept per sample and KV head, log scale)")
    ax.set_ylabel(_AXIS_LABELS.get(next((s.metric for s in summaries if s.metric), ""), f"{label} (mean over samples)"))
    ax.set_title(f"{label} vs KV cache size\n{_subtitle(summaries)}", fontsize=10)
    top = max([1e-3, *(s.score for s in ok)]) * 1.15
    ax.set_ylim(bottom=-0.03 * top, top=top)  # points at 0 stay whole
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return fig


def _evicts(method: str) -> bool:
    """Whether the method called ``method`` evicts (FKV: a line across the metric plot, no kv_max)."""
    kind = METHODS.get(method)
    return kind is None or kind.evicts


def _plot_full_cache(ax, runs: list[RunSummary], legend: str, colour: str) -> None:
    for value in sorted({round(s.score, 6) for s in runs}):
        bs = ",".join(str(s.batch_size) for s in runs if round(s.score, 6) == value)
        ax.axhline(value, linestyle="--", color=colour, label=f"{legend}, b={bs}")


def _plot_points(ax, runs: list[RunSummary], legend: str, colour: str, marker: str) -> None:
    """One method and rule's (kv_max, metric) points, each labelled with its batch sizes."""
    ax.plot(
        [s.kv_max for s in runs],
        [s.score for s in runs],
        linestyle="none",
        marker=marker,
        markersize=7,
        color=colour,
        label=legend,
        clip_on=False,
        zorder=3,
    )
    points: dict[tuple[int, float], list[int]] = {}  # runs at the same point share one label "b=1,3"
    for s in runs:
        points.setdefault((s.kv_max, round(s.score, 6)), []).append(s.batch_size)
    keys = list(points)
    for index, (kv, value) in enumerate(keys):  # a label goes below its point when the neighbour is higher
        other = keys[index - 1] if index else keys[min(1, len(keys) - 1)]
        below = other != (kv, value) and 0 < value < other[1]
        ax.annotate(
            "b=" + ",".join(map(str, points[(kv, value)])),
            (kv, value),
            textcoords="offset points",
            xytext=(5, -11 if below else 4),
            fontsize=7,
            color=colour,
        )


def _kv_axis(ax, kvs: list[int]) -> None:
    """A log2 kv_max axis with a tick at each power of two the runs span."""
    if not kvs:
        return
    ax.set_xscale("log", base=2)
    low, high = min(kvs) / 1.5, max(kvs) * 1.5
    ticks = [2**e for e in range(0, 24) if low <= 2**e <= high]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlim(low, high)


def write_report(
    out: str | os.PathLike[str], summaries: Sequence[RunSummary | Mapping[str, Any]], notes: Sequence[str] = ()
) -> dict[str, Path]:
    """Write :data:`REPORT_FILES` into ``out`` (text files atomically) and return their paths; ``notes`` end
    report.md (e.g. where the paper procedure's b0 came from)."""
    summaries = _typed(summaries)
    out = Path(out)
    paths = {name: out / name for name in REPORT_FILES}
    text = format_report(summaries)
    if notes:
        text = text.rstrip("\n") + "\n\n" + "\n".join(f"Note: {n}" for n in notes) + "\n"
    atomic_write_text(paths["report.md"], text)
    atomic_write_text(paths["results.csv"], format_csv(summaries))
    plots = [("throughput.png", plot_throughput), ("metric_vs_kv.png", plot_metric_vs_kv)]
    if any(s.same_memory_budget_bytes for s in summaries):  # the claim in one picture
        paths[CLAIM_FILE] = out / CLAIM_FILE
        plots.append((CLAIM_FILE, plot_claim))
    main = [s for s in summaries if not s.paper_setting] or summaries  # the paper's setting: a table only
    for name, plot in plots:
        tmp = out / f".{name}.tmp"
        plot(main, tmp)
        os.replace(tmp, paths[name])
    logger.info("report: %s", ", ".join(str(p) for p in paths.values()))
    return paths
