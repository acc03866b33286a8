"""Merge a data-parallel job's shards by hand: each run's ``replica<R>/`` shards into its ``samples.jsonl``,
``batches.jsonl`` and ``summary.json``, then ``OUT/report.md`` from every finished run (``launch/merge.py``).

The job does this itself (the last replica to finish a run merges it, rank 0 writes the report); this is for
shards gathered from nodes without a shared file system, or a job that ended before its last merge. A run is
merged only when its shards hold every batch; a run left unfinished is named, and the command exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import results
from .report import write_report

logger = logging.getLogger(__name__)

__all__ = ["main", "merge_out"]


def _merge_one(folder: Path) -> str | None:
    """Merge a run whose shards hold every batch (unless it has its summary already); else why not."""
    if results.read_summary(folder) is not None:
        return None
    parts = results.read_parts(folder)
    heads = [p["head"] for p in parts if p["head"] is not None]
    if not heads:
        return f"{folder.name}: no replica shard with its {results.HEAD_FILE}"
    head = heads[0]
    done = {b.batch for p in parts for b in p["batches"]}
    total = len(head["batch_ids"])
    if len(done) < total:
        return (
            f"{folder.name}: {len(done)} of {total} batches done; run the same command again to complete "
            "the missing ones"
        )
    if any(folder.glob("oom-rank*.json")):
        return f"{folder.name}: a rank ran out of memory; run the same command again to record its OOM row"
    results.merge_run(folder, head, parts, head["settings"]["metric"])
    return None


def merge_out(out: str | Path) -> tuple[list[results.RunSummary], list[str]]:
    """Merge every run folder of ``out`` that has shards; the summaries of its finished runs (oldest first) and
    what could not be merged."""
    out = Path(out)
    summaries, problems = [], []
    for folder in sorted({p.parent.parent for p in out.glob(f"*/replica*/{results.HEAD_FILE}")}):
        problem = _merge_one(folder)
        if problem is not None:
            problems.append(problem)
    for path in sorted(out.glob(f"*/{results.SUMMARY_FILE}")):
        summaries.append(results.read_summary(path.parent))
    summaries.sort(key=lambda s: s.started_at or "")
    return summaries, problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/merge.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the job's out folder (holding <run>/replica<R>/ shards)")
    args = parser.parse_args(argv)
    if not Path(args.out).is_dir():
        print(f"error: out: no such folder {args.out}", file=sys.stderr)
        return 2
    summaries, problems = merge_out(args.out)
    for problem in problems:
        print(f"not merged: {problem}", file=sys.stderr)
    if summaries:
        paths = write_report(args.out, summaries)
        print(paths["report.md"].read_text(encoding="utf-8"), end="")
    return 1 if problems else 0
