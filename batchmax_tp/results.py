"""Results that survive a crash: the per-sample log of a run, resuming, summaries and what "equal" means.

Layout of one run's folder (``OUT/<run>/``):

- ``samples.jsonl``: one JSON object per sample (:data:`RECORD_KEYS`), appended batch by batch: each finished
  batch is written with one ``write``, flushed and fsynced before the next batch starts, so a run killed at
  any moment (SIGKILL included) loses at most the batch in flight. A torn last line, and the lines of a batch
  that was only partly written, are dropped when the log is read again (:meth:`SampleLog.load`).
- ``summary.json``: written (atomically) when the run is over; its ``status`` is ``done`` or ``oom``.
- ``oom-rank<R>.json``: written by rank R of a multi-process run that ran out of memory, just before the job
  ends (its tensor-parallel peers may be waiting inside the model's collectives, so nothing can be gathered);
  the next run of the same configuration turns it into the run's OOM row and goes on (:func:`read_oom_marker`).

Resuming: running the same configuration into the same ``out`` again skips every run whose ``summary.json``
exists and, inside an unfinished run, every batch that is complete in ``samples.jsonl``; only the rest runs.
Batches are cut the same way every time and batch ``i`` always samples with ``seed + i``, so the resumed
files equal those of an uninterrupted run up to the timing fields (:func:`comparable`). ``OUT/config.yaml``
(the resolved configuration, written first) is the key: results made with a configuration that differs in
anything that changes outputs (:func:`check_same_config`) are never resumed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "RECORD_KEYS",
    "SAMPLES_FILE",
    "SUMMARY_FILE",
    "TIMING_KEYS",
    "SampleLog",
    "check_same_config",
    "comparable",
    "read_oom_marker",
    "read_summary",
    "run_dir_name",
    "write_oom_marker",
    "summarise",
]

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"

#: The fields of one ``samples.jsonl`` line. ``batch_*`` fields belong to the sample's batch (the same on every
#: line of that batch); ``reference`` is a string, a list of strings (several references) or null.
RECORD_KEYS = (
    "id", "batch", "replica", "output", "reference", "score", "correct", "prompt_tokens", "generated_tokens", "tokens_cut",
    "batch_prefill_s", "batch_decode_s", "batch_peak_kv_bytes", "batch_peak_workspace_bytes",
    "batch_cuda_max_memory_allocated",
)

#: Wall-clock (and process-memory) fields: they differ between two runs of the same configuration, and are all
#: that may differ between a resumed run's files and an uninterrupted run's (:func:`comparable`).
TIMING_KEYS = frozenset({
    "batch_prefill_s", "batch_decode_s", "prefill_s", "decode_s", "total_s", "tokens_per_s",
    "started_at", "finished_at", "wall_s", "peak_host_bytes",
})

#: Configuration keys that do not change any output (and so never block resuming). With a ``runs`` list (or a
#: ``procedure``, which builds its own runs) each run's folder is named after its method, batch size and
#: kv_max, so ``runs``, ``methods`` and ``batch_size`` do not matter either. ``target`` only steers which runs
#: the tuner asks for.
_NEUTRAL_KEYS = frozenset({"out", "log_level", "target", "setup_timeout"})
_NEUTRAL_KEYS_WITH_RUNS = _NEUTRAL_KEYS | {"runs", "methods", "batch_size"}


def run_dir_name(method: str, batch_size: int, kv_max: int | None, rule: str = "paper") -> str:
    """Folder of one entry of a ``runs`` list: ``fkv-b4``, ``ed-b4-kv2``, ``bm-b32-kv1024``; a rule other than
    the paper's is named after the method: ``bm-snapkv-b32-kv1024``, ``bm-snapkv-window64-b32-kv1024``."""
    if rule != "paper":
        method = f"{method}-{rule_slug(rule)}"
    return f"{method}-b{batch_size}" if kv_max is None or method == "fkv" else f"{method}-b{batch_size}-kv{kv_max}"


def rule_slug(rule: str) -> str:
    """A rule spelled for a folder name: ``snapkv:window=64,pool=avg`` -> ``snapkv-window64-poolavg``."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", rule.replace("=", "")).strip("-")


# ---------------------------------------------------------------------- the per-sample log
class SampleLog:
    """The append-only ``samples.jsonl`` of one run."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def load(self, batches: Sequence[Sequence[str]] | None = None) -> list[dict[str, Any]]:
        """The records of the batches that are complete in the file, in file order.

        ``batches``: the ids of each batch of the run (batch ``i`` = ``batches[i]``); a batch counts as done when
        the file holds a record for each of its ids, and records of other batches are dropped. A line that is
        not valid JSON ends the readable part of the file (only the last line can be torn; anything after it
        is dropped too). When lines were dropped the file is rewritten (atomically) without them, so that new
        batches are appended to a clean file.
        """
        if not self.path.is_file():
            return []
        raw = self.path.read_bytes()
        records: list[dict[str, Any]] = []
        torn = False
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                torn = True
                break
            if not isinstance(record, dict) or "id" not in record or "batch" not in record:
                raise ValueError(f"{self.path}: not a batchmax_tp sample log (line without id/batch); "
                                 "delete it or choose another out")
            records.append(record)
        kept = records
        if batches is not None:
            wanted = {i: set(ids) for i, ids in enumerate(batches)}
            have: dict[int, set[str]] = {}
            for record in records:
                have.setdefault(record["batch"], set()).add(str(record["id"]))
            done = {i for i, ids in wanted.items() if ids and have.get(i, set()) >= ids}
            kept = [r for r in records if r["batch"] in done and str(r["id"]) in wanted[r["batch"]]]
            seen: set[tuple[int, str]] = set()
            unique = []
            for record in kept:  # a batch is written once; keep the first copy if it ever appears twice
                key = (record["batch"], str(record["id"]))
                if key not in seen:
                    seen.add(key)
                    unique.append(record)
            kept = unique
        if torn or len(kept) != len(records):
            logger.warning("%s: dropping %d incomplete line(s)%s; resuming after %d complete sample(s)",
                           self.path, len(records) - len(kept) + int(torn), " (torn last line)" if torn else "",
                           len(kept))
            self._rewrite(kept)
        return kept

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append one batch's records with a single write, then flush and fsync."""
        text = "".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in records)
        if not text:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def _rewrite(self, records: Sequence[Mapping[str, Any]]) -> None:
        from .runner import atomic_write_text

        atomic_write_text(self.path, "".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in records))


# ---------------------------------------------------------------------- summaries
def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Throughput and metric numbers of a run from its per-sample records.

    ``prefill_s`` and ``decode_s`` are summed over the batches of a data-parallel replica (``replica``; 0 in a
    single process); replicas run side by side, so the run's are those of the slowest replica (largest sum),
    and ``tokens_per_s`` = all generated tokens / (its ``prefill_s + decode_s``). ``peak_kv_bytes`` is the
    largest batch's (summed over tensor-parallel ranks); ``peak_workspace_bytes`` (the largest attention-score
    block) and ``cuda_max_memory_allocated`` (None off CUDA) are the largest batch's on one rank (the replica's
    tensor-parallel rank 0). ``score`` is the mean metric over samples with a
    reference; ``accuracy`` the fraction of ``correct`` samples among those with a yes/no verdict.
    """
    batches: dict[int, Mapping[str, Any]] = {}
    for record in records:
        batches.setdefault(int(record["batch"]), record)
    per_replica: dict[int, list[float]] = {}
    for record in batches.values():
        times = per_replica.setdefault(int(record.get("replica") or 0), [0.0, 0.0])
        times[0] += float(record.get("batch_prefill_s") or 0.0)
        times[1] += float(record.get("batch_decode_s") or 0.0)
    prefill_s, decode_s = max(per_replica.values(), key=sum, default=[0.0, 0.0])
    total_s = prefill_s + decode_s
    generated = sum(int(r["generated_tokens"]) for r in records)
    scores = [float(r["score"]) for r in records if r.get("score") is not None]
    checked = [bool(r["correct"]) for r in records if r.get("correct") is not None]
    peak = max((int(r.get("batch_peak_kv_bytes") or 0) for r in batches.values()), default=0)
    workspace = max((int(r.get("batch_peak_workspace_bytes") or 0) for r in batches.values()), default=0)
    cuda = [int(r["batch_cuda_max_memory_allocated"]) for r in batches.values()
            if r.get("batch_cuda_max_memory_allocated") is not None]
    return {
        "num_samples": len(records),
        "num_batches": len(batches),
        "generated_tokens": generated,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "tokens_per_s": generated / total_s if total_s > 0 else None,
        "peak_kv_bytes": peak,
        "peak_kv_mib": peak / 2**20,
        "peak_workspace_bytes": workspace,
        "cuda_max_memory_allocated": max(cuda) if cuda else None,
        "score": sum(scores) / len(scores) if scores else None,
        "num_scored": len(scores),
        "num_checked": len(checked),
        "num_correct": sum(checked),
        "accuracy": sum(checked) / len(checked) if checked else None,
        "samples_cut": sum(1 for r in records if r.get("tokens_cut")),
        "tokens_cut": sum(int(r.get("tokens_cut") or 0) for r in records),
    }


def read_summary(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A finished run's ``summary.json``, or None when the run has not finished."""
    path = Path(folder) / SUMMARY_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def write_oom_marker(folder: str | os.PathLike[str], rank: int, error: str, batch: int) -> Path:
    """Record, from the rank that hit it, that this run ran out of memory in ``batch`` (written atomically)."""
    from .runner import atomic_write_text

    path = Path(folder) / f"oom-rank{rank}.json"
    atomic_write_text(path, json.dumps({"rank": rank, "batch": batch, "error": error}) + "\n")
    return path


def read_oom_marker(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The first ``oom-rank<R>.json`` of a run (lowest rank), or None."""
    found = sorted(Path(folder).glob("oom-rank*.json"), key=lambda p: int(p.stem.removeprefix("oom-rank") or 0))
    return json.loads(found[0].read_text(encoding="utf-8")) if found else None


# ---------------------------------------------------------------------- resuming and equality
def check_same_config(out: str | os.PathLike[str], config: Mapping[str, Any]) -> bool:
    """Whether ``out`` holds results of an earlier run that this ``config`` (a resolved config dict) may resume.

    False when ``out/config.yaml`` does not exist (nothing to resume: existing run files are started over).
    Raises ``ValueError("out: ...")`` (one line) when it exists and differs in a key that changes outputs, i.e.
    any key except ``out`` and ``log_level`` (and ``runs``, ``methods``, ``batch_size`` when ``runs`` is set).
    """
    import yaml

    path = Path(out) / "config.yaml"
    if not path.is_file():
        return False
    try:
        old = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"out: cannot read {path} to resume: {' '.join(str(err).split())}") from None
    neutral = _NEUTRAL_KEYS_WITH_RUNS if config.get("runs") or config.get("procedure") else _NEUTRAL_KEYS
    for key in sorted((set(old) | set(config)) - neutral):
        if old.get(key) != config.get(key):
            raise ValueError(
                f"out: {out} holds results made with {key}={old.get(key)!r}, this run has {key}={config.get(key)!r}; "
                "choose another out or delete the folder"
            )
    return True


def comparable(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What must be equal between a resumed and an uninterrupted run with the same config, for a folder of
    results (an ``OUT`` or one run's folder, searched recursively):

    - every ``samples.jsonl``: the list of records (in file order) without the :data:`TIMING_KEYS`;
    - every ``summary.json``: the object without the :data:`TIMING_KEYS`;
    - every ``results.csv``: the rows without the timing columns;
    - every ``report.md``: the text with the tokens/s column and the comparison lines' speed-ups blanked.

    ``config.yaml`` (header comment has the time) and the PNG plots (drawn from the CSV; the throughput plot
    shows timings) are not compared.
    """
    import csv
    import io

    from .report import mask_timings

    folder = Path(folder)
    found: dict[str, Any] = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.name == SAMPLES_FILE:
            lines = path.read_text(encoding="utf-8").splitlines()
            found[rel] = [_drop_timing(json.loads(line)) for line in lines if line.strip()]
        elif path.name == SUMMARY_FILE:
            found[rel] = _drop_timing(json.loads(path.read_text(encoding="utf-8")))
        elif path.name == "results.csv":
            rows = list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"))))
            found[rel] = [_drop_timing(row) for row in rows]
        elif path.name == "report.md":
            found[rel] = mask_timings(path.read_text(encoding="utf-8"))
    return found


def _drop_timing(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_timing(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [_drop_timing(v) for v in obj]
    return obj
