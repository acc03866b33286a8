"""Scoring the retention benchmark: needle hits, summary fidelity against the full cache, and each row's table entry
with its ratios to FKV and to the paper rule and whether it meets the issue's targets.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import Any

from ...core.method import is_full_cache
from ...eval.intervals import share_interval
from ...eval.metrics import is_correct, rouge2
from .run import Row
from .suite import TARGET_LENGTH, Needle, RetentionSample

TARGETS = {"hits_vs_fkv": 0.90, "fidelity": 0.45, "speed_vs_paper": 0.85}


def passkey_hit(output: str, key: str) -> bool:
    """The five digits appear as one number (a thousands separator, "48,213", is tolerated)."""
    digits = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", output)
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", digits) is not None


def needle_hits(output: str, needles: Sequence[Needle]) -> list[bool]:
    return [
        passkey_hit(output, n.answer) if n.kind == "passkey" else bool(is_correct(output, n.answer)) for n in needles
    ]


def score_rows(
    samples: Sequence[RetentionSample],
    runs: dict[Row, dict[str, Any]],
    target_length: int = TARGET_LENGTH,
    split: str = "all",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(table rows, per-sample records). ``runs`` must hold the FKV row (the fidelity reference).

    Per row: needle hits (all lengths, and prompts of ``target_length``), as fractions of FKV's; fidelity =
    mean ROUGE-2 F of each summary against FKV's summary of the same prompt (all, and at ``target_length``);
    tokens/s and its ratio to the paper rule's at the same kv_max. Rows and records name the prompts' ``split``.
    """
    reference = next(r for r in runs if not r.evicts)
    records: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    for row, run in runs.items():
        tally = _Tally(row, run, runs[reference]["outputs"], row is reference, target_length, split)
        records += [tally.score(s) for s in samples]
        table.append({**_entry(row, run, tally), "split": split})
    _compare(table)
    return table, records


class _Tally:
    """One row's needle hits and summary scores, over all prompts and over those of ``target`` length; the
    summaries are scored against ``reference`` (FKV's outputs)."""

    def __init__(self, row: Row, run, reference: dict[str, str], is_reference: bool, target: int, split: str) -> None:
        self.row, self.run, self.reference, self.is_reference = row, run, reference, is_reference
        self.target, self.split = target, split
        self.hits = self.total = self.hits_t = self.total_t = 0
        self.cells: dict[str, list[int]] = {}  # kind and length -> each prompt's answers found, in prompt order
        self.fid: list[float] = []
        self.fid_t: list[float] = []
        self.agree: list[float] = []

    def score(self, s: RetentionSample) -> dict[str, Any]:
        """The record of sample ``s`` in the row's run, counted into the tallies."""
        row, run, reference, is_reference, target = self.row, self.run, self.reference, self.is_reference, self.target
        out = run["outputs"][s.id]
        rec = {
            "row": row.label,
            "rule": row.rule,
            "kv_max": row.kv_max,
            "split": self.split,
            "id": s.id,
            "kind": s.kind,
            "prompt_tokens": s.prompt_tokens,
            "depths": s.depths,
            "answers": s.answers,
            "output": out,
        }
        if s.kind == "summary":
            f = 1.0 if is_reference else rouge2(out, reference[s.id]) if reference[s.id].strip() else 0.0
            self.fid.append(f)
            if s.length == target:
                self.fid_t.append(f)
            rec["fidelity_rouge2"] = f
            a = 1.0 if is_reference else run.get("agreement", {}).get(s.id)
            if a is not None:
                self.agree.append(a)
                rec["forced_agreement"] = a
        else:
            h = needle_hits(out, s.needles)
            self.cells.setdefault(f"{s.kind} {s.length}", []).append(sum(h))
            self.hits += sum(h)
            self.total += len(h)
            if s.length == target:
                self.hits_t += sum(h)
                self.total_t += len(h)
            rec["hits"] = h
        return rec


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _tokens_per_s(run: dict[str, Any]) -> float | None:
    """The median of the interleaved timings when there are some, else the whole run's tokens / seconds."""
    if run.get("speed"):
        return statistics.median(run["speed"])
    total_s = run["prefill_s"] + run["decode_s"]
    return run["generated_tokens"] / total_s if total_s > 0 else None


def _entry(row: Row, run: dict[str, Any], t: _Tally) -> dict[str, Any]:
    """A row's table entry before the comparisons with FKV and the paper rule."""
    return {
        "method": row.method,
        "rule": row.rule or "-",
        "kv_max": row.kv_max,
        "p": row.p,
        "needle_hits": t.hits,
        "needle_total": t.total,
        "hit_cells": t.cells,
        "hits_2k": t.hits_t,
        "total_2k": t.total_t,
        "fidelity_rouge2": _mean(t.fid),
        "fidelity_2k": _mean(t.fid_t),
        "forced_agreement": _mean(t.agree),
        "generated_tokens": run["generated_tokens"],
        "prefill_s": round(run["prefill_s"], 3),
        "decode_s": round(run["decode_s"], 3),
        "tokens_per_s": _tokens_per_s(run),
        "speed": run.get("speed"),
        "peak_kv_mib": run["peak_kv_bytes"] / 2**20,
    }


def _compare(table: list[dict[str, Any]]) -> None:
    """Each entry's hits over FKV's, tokens/s over the paper rule's at its kv_max, and whether it meets the targets."""
    fkv = next(t for t in table if is_full_cache(t["method"]))
    paper = {t["kv_max"]: t for t in table if t["rule"] == "paper"}
    for t in table:
        evicts = not is_full_cache(t["method"])
        t["hits_vs_fkv"] = t["needle_hits"] / fkv["needle_hits"] if fkv["needle_hits"] else None
        t["hits_2k_vs_fkv"] = t["hits_2k"] / fkv["hits_2k"] if fkv["hits_2k"] else None
        # paired, stratified (kind x length) bootstrap over the prompts: the 95% interval of hits / FKV
        share = share_interval(t["hit_cells"], fkv["hit_cells"], totals=True) if fkv["hit_cells"] else None
        t["hits_vs_fkv_low"], t["hits_vs_fkv_high"] = (None, None) if share is None else (share.low, share.high)
        ref = paper.get(t["kv_max"])
        t["speed_vs_paper"] = (
            t["tokens_per_s"] / ref["tokens_per_s"]
            if ref and evicts and ref["tokens_per_s"] and t["tokens_per_s"]
            else None
        )
        if t["speed_vs_paper"] is not None and t["speed"] and ref["speed"]:  # interleaved repeats: ratio per repeat
            t["speed_vs_paper"] = statistics.median(a / b for a, b in zip(t["speed"], ref["speed"]))
        t["meets_targets"] = (
            None
            if not evicts or None in (t["hits_2k_vs_fkv"], t["fidelity_2k"], t["speed_vs_paper"])
            else t["hits_2k_vs_fkv"] >= TARGETS["hits_vs_fkv"]
            and t["fidelity_2k"] >= TARGETS["fidelity"]
            and t["speed_vs_paper"] >= TARGETS["speed_vs_paper"]
        )
