"""Results that survive a crash: the files of a run, resuming, summaries and what "equal" means.

Layout of one run's folder (``OUT/<run>/``):

- ``samples.jsonl``: one JSON object per sample (:data:`SAMPLE_KEYS`: id, prompt tokens, output, reference,
  correct, generated tokens) -- only what the model produced, so two runs of the same configuration write the
  same bytes;
- ``batches.jsonl``: one JSON object per finished batch (:data:`BATCH_KEYS`: its index, replica, sample ids,
  tokens cut from each prompt, timings and memory peaks). A batch is appended after its samples, each with one
  ``write``, flushed and fsynced, so a run killed at any moment (SIGKILL included) loses at most the batch in
  flight: its line in ``batches.jsonl`` is what makes it count. Torn last lines and the samples of batches without
  a line are dropped when the run is read again (:meth:`RunLog.load`);
- ``summary.json``: written (atomically) when the run is over; its ``status`` is ``done`` or ``oom``;
- ``replica<R>/`` (several data-parallel replicas): replica R's shard, the same two logs of its own batches plus
  :data:`HEAD_FILE` and, once its share is done, :data:`DONE_FILE`; the last replica to finish merges the shards
  into the run's logs (batch order) and summary (:func:`merge_run`; by hand: ``launch/merge.py``);
- ``oom-rank<R>.json``: written by rank R of a multi-process run that ran out of memory, just before the job
  ends (its tensor-parallel peers may be waiting inside the model's collectives, so nothing can be gathered);
  the next run of the same configuration turns it into the run's OOM row, clears it, and goes on
  (:func:`read_oom_marker`); a run that finishes clears any marker too.

Resuming: running the same configuration into the same ``out`` again skips every run whose ``summary.json``
exists and, inside an unfinished run, every batch that is complete; only the rest runs. Batches are cut the same
way every time and batch ``i`` always samples with ``seed + i``, so the resumed files equal those of an
uninterrupted run up to the timing fields (:func:`comparable`). ``OUT/config.yaml`` (the resolved configuration,
written first) is the key: results made with a configuration that differs in anything that changes outputs
(:func:`check_same_config`) are never resumed.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .files import atomic_write_text, utc_now
from .metrics import score as metric_score
from .records import BATCH_KEYS, SAMPLE_KEYS, BatchRecord, RunSummary, SampleRecord
from .report import mask_timings

logger = logging.getLogger(__name__)

__all__ = [
    "BATCHES_FILE",
    "BATCH_KEYS",
    "SAMPLES_FILE",
    "SAMPLE_KEYS",
    "BatchRecord",
    "SampleRecord",
    "SUMMARY_FILE",
    "TIMING_KEYS",
    "RunLog",
    "RunSummary",
    "check_same_config",
    "merge_run",
    "read_parts",
    "shard_folder",
    "per_replica",
    "comparable",
    "read_oom_marker",
    "read_summary",
    "write_oom_marker",
    "summarise",
]

SAMPLES_FILE = "samples.jsonl"
BATCHES_FILE = "batches.jsonl"
SUMMARY_FILE = "summary.json"
HEAD_FILE = "run.json"  #: in a replica's shard: the run's settings, batch ids, layout and memory fields
DONE_FILE = "done.json"  #: in a replica's shard: written when the replica has finished its share of the run


#: Wall-clock (and process-memory) fields: they differ between two runs of the same configuration, and are all
#: that may differ between a resumed run's files and an uninterrupted run's (:func:`comparable`). Under the
#: continuous scheduler a request's latencies and its slot (where a resumed run restarted decides it) too.
TIMING_KEYS = frozenset(
    {
        "prefill_s",
        "decode_s",
        "total_s",
        "tokens_per_s",
        "tokens_per_s_spread",
        "started_at",
        "finished_at",
        "wall_s",
        "peak_host_bytes",
        "first_token_s",
        "latency_s",
        "slot",
        "latency_p50_s",
        "latency_p99_s",
        "first_token_p50_s",
    }
)

#: Configuration keys that do not change any output (and so never block resuming). Each run's folder is named
#: after its method, rule, batch size and kv_max, so the list of runs does not matter either. ``target`` and
#: ``cheaper_rules`` only steer which runs the tuner asks for.
#: ``compile`` changes no output (the compiled decode passes give the eager tokens: tests/test_continuous.py).
_NEUTRAL_KEYS = frozenset(
    {"out", "log_level", "target", "cheaper_rules", "setup_timeout", "runs", "methods", "batch_size", "compile"}
)


# ---------------------------------------------------------------------- the run's log
def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(objects, torn): the lines of ``path`` up to the first one that is not valid JSON (only the last line can be
    torn; anything after it is dropped too)."""
    if not path.is_file():
        return [], False
    out = []
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return out, True
        if not isinstance(obj, dict):
            raise ValueError(
                f"{path}: not a batchmax_tp run log (a line that is not an object); delete it or choose another out"
            )
        out.append(obj)
    return out, False


def _lines(records: Sequence[SampleRecord | BatchRecord]) -> str:
    return "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records)


class RunLog:
    """The append-only ``samples.jsonl`` + ``batches.jsonl`` of one run's folder."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        self.samples_path = self.folder / SAMPLES_FILE
        self.batches_path = self.folder / BATCHES_FILE

    def load(self, batches: Sequence[Sequence[str]] | None = None) -> tuple[list[SampleRecord], list[BatchRecord]]:
        """(samples, batches) of the batches that are complete, in file order.

        ``batches``: the ids of each batch of the run (batch ``i`` = ``batches[i]``); a batch counts as done when
        ``batches.jsonl`` has its line with exactly those ids and ``samples.jsonl`` a record for each of them.
        Anything else (a torn line, samples of an unfinished batch, lines of batches this run does not have) is
        dropped and both files are rewritten (atomically) without it, so that new batches are appended to clean
        files.
        """
        samples, torn_s = _read_jsonl(self.samples_path)
        lines, torn_b = _read_jsonl(self.batches_path)
        by_id: dict[str, SampleRecord] = {}
        for obj in samples:
            if "id" not in obj:
                raise ValueError(
                    f"{self.samples_path}: not a batchmax_tp sample log (line without id); "
                    "delete it or choose another out"
                )
            by_id.setdefault(str(obj["id"]), SampleRecord.from_json(obj))
        kept_batches, seen = [], set()
        for obj in lines:
            index = obj.get("batch")
            if not isinstance(index, int) or not isinstance(obj.get("ids"), list):
                raise ValueError(
                    f"{self.batches_path}: not a batchmax_tp batch log (a line without batch/ids); "
                    "delete it or choose another out"
                )
            line = BatchRecord.from_json(obj)
            ids = [str(i) for i in line.ids]
            wanted = None if batches is None or not 0 <= index < len(batches) else [str(i) for i in batches[index]]
            if index in seen or (batches is not None and ids != wanted) or not all(i in by_id for i in ids):
                continue
            seen.add(index)
            kept_batches.append(line)
        kept_samples = [by_id[str(i)] for line in kept_batches for i in line.ids]
        if torn_s or torn_b or len(kept_samples) != len(samples) or len(kept_batches) != len(lines):
            logger.warning(
                "%s: dropping %d incomplete sample line(s) and %d batch line(s); resuming after %d complete batch(es)",
                self.folder,
                len(samples) - len(kept_samples) + int(torn_s),
                len(lines) - len(kept_batches) + int(torn_b),
                len(kept_batches),
            )
            atomic_write_text(self.samples_path, _lines(kept_samples))
            atomic_write_text(self.batches_path, _lines(kept_batches))
        return kept_samples, kept_batches

    def append(self, samples: Sequence[SampleRecord], batches: Sequence[BatchRecord]) -> None:
        """Append finished batches: their samples first, then their batch lines (each one write, flushed, fsynced)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for path, objs in ((self.samples_path, samples), (self.batches_path, batches)):
            text = _lines(objs)
            if not text:
                continue
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())


# ---------------------------------------------------------------------- summaries
def summarise(samples: Sequence[SampleRecord], batches: Sequence[BatchRecord], metric: str) -> dict[str, Any]:
    """Throughput and metric numbers of a run from its sample and batch records.

    ``prefill_s`` and ``decode_s`` are summed over the batches of a data-parallel replica (``replica``; 0 in a
    single process); replicas run side by side, so the run's are those of the slowest replica (largest sum),
    and ``tokens_per_s`` = all generated tokens / (its ``prefill_s + decode_s``). ``tokens_per_s_spread``: half the
    range of the full batches' own tokens/s, as a fraction of their mean (the machine's noise as this run saw it;
    None with fewer than two full batches). ``peak_kv_bytes`` is the largest batch's (summed over tensor-parallel
    ranks); ``peak_workspace_bytes`` (the largest attention-score block) and ``cuda_max_memory_allocated`` (None off
    CUDA) are the largest batch's on one rank. ``score`` is the mean ``metric`` over samples with a reference;
    ``accuracy`` the fraction of ``correct`` samples among those with a yes/no verdict.
    """
    prefill_s, decode_s = _slowest_replica(batches)
    total_s = prefill_s + decode_s
    generated = sum(r.generated_tokens for r in samples)
    scores = [x for x in (metric_score(metric, r.output, r.reference) for r in samples) if x is not None]
    checked = [bool(r.correct) for r in samples if r.correct is not None]
    peak = max((b.peak_kv_bytes for b in batches), default=0)
    workspace = max((b.peak_workspace_bytes or 0 for b in batches), default=0)
    cuda = [b.cuda_max_memory_allocated for b in batches if b.cuda_max_memory_allocated is not None]
    cut = [n for b in batches for n in b.tokens_cut]
    return {
        "num_samples": len(samples),
        "num_batches": len(batches),
        "generated_tokens": generated,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in samples),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "tokens_per_s": generated / total_s if total_s > 0 else None,
        "tokens_per_s_spread": _speed_spread(batches),
        "peak_kv_bytes": peak,
        "peak_kv_mib": peak / 2**20,
        "peak_workspace_bytes": workspace,
        "cuda_max_memory_allocated": max(cuda) if cuda else None,
        "score": sum(scores) / len(scores) if scores else None,
        "num_scored": len(scores),
        "num_checked": len(checked),
        "num_correct": sum(checked),
        "accuracy": sum(checked) / len(checked) if checked else None,
        "samples_cut": sum(1 for n in cut if n),
        "tokens_cut": sum(cut),
    }


def _slowest_replica(batches: Sequence[BatchRecord]) -> list[float]:
    """[prefill_s, decode_s] summed over the batches of the replica whose sum is the largest."""
    per_replica: dict[int, list[float]] = {}
    for batch in batches:
        times = per_replica.setdefault(batch.replica, [0.0, 0.0])
        times[0] += batch.prefill_s
        times[1] += batch.decode_s
    return max(per_replica.values(), key=sum, default=[0.0, 0.0])


def _speed_spread(batches: Sequence[BatchRecord]) -> float | None:
    """Half the range of the full batches' own tokens/s, as a fraction of their mean (None below two)."""
    full = max((len(b.ids) for b in batches), default=0)
    speeds = [b.generated_tokens / b.seconds for b in batches if len(b.ids) == full and b.seconds > 0]
    return (max(speeds) - min(speeds)) / 2 / (sum(speeds) / len(speeds)) if len(speeds) > 1 else None


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs``, linear between the closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of nothing")
    at = (len(s) - 1) * q / 100
    lo = math.floor(at)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (at - lo)


def latency_fields(batches: Sequence[BatchRecord]) -> dict[str, Any]:
    """A continuous run's per-request latency (seconds from the run's start to the request's end, every request
    queued at the start) and time to first token: p50 and p99 over its samples (``percentile``)."""
    latency = [b.latency_s for b in batches if b.latency_s is not None]
    first = [b.first_token_s for b in batches if b.first_token_s is not None]
    return {
        "scheduler": "continuous",
        "tokens_per_s_spread": None,
        "latency_p50_s": percentile(latency, 50) if latency else None,
        "latency_p99_s": percentile(latency, 99) if latency else None,
        "first_token_p50_s": percentile(first, 50) if first else None,
    }


def per_replica(batches: Sequence[BatchRecord], dp: int, tp: int) -> list[dict[str, Any]]:
    """A multi-process run's ``per_replica`` list: each data-parallel replica's ranks, samples, tokens, timings and
    tokens/s, and its K/V peak per tensor-parallel rank (each rank holds only its own KV heads)."""
    out = []
    for r in range(dp):
        mine = [b for b in batches if b.replica == r]
        prefill, decode = sum(b.prefill_s for b in mine), sum(b.decode_s for b in mine)
        tokens = sum(b.generated_tokens for b in mine)
        ranks = [max((b.peak_kv_bytes_per_rank[t] for b in mine), default=0) for t in range(tp)]
        out.append(
            {
                "replica": r,
                "ranks": list(range(r * tp, (r + 1) * tp)),
                "num_samples": sum(len(b.ids) for b in mine),
                "num_batches": len(mine),
                "generated_tokens": tokens,
                "prefill_s": prefill,
                "decode_s": decode,
                "tokens_per_s": tokens / (prefill + decode) if prefill + decode > 0 else None,
                "peak_kv_bytes": sum(ranks),
                "peak_kv_bytes_per_rank": ranks,
            }
        )
    return out


# ---------------------------------------------------------------------- replicas' shards and their merge
def shard_folder(folder: str | os.PathLike[str], replica: int, dp: int) -> Path:
    """Where replica ``replica`` of ``dp`` writes its records: the run's folder itself with one replica,
    ``replica<R>/`` in it with several (each replica's tensor-parallel rank 0 writes only its own)."""
    return Path(folder) if dp == 1 else Path(folder) / f"replica{replica}"


def read_parts(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The replicas' parts of a run as they are on disk (for ``merge_run``): each ``replica<R>/`` shard's head
    (:data:`HEAD_FILE`), its finished batches and their samples, and its :data:`DONE_FILE` timing when it finished
    its share; a run of one replica is the folder's own log."""
    folder = Path(folder)
    shards = sorted(folder.glob("replica*/"), key=lambda p: int(p.name.removeprefix("replica") or 0))
    parts = []
    for shard in shards:
        head_path, done_path = shard / HEAD_FILE, shard / DONE_FILE
        head = json.loads(head_path.read_text(encoding="utf-8")) if head_path.is_file() else None
        done = json.loads(done_path.read_text(encoding="utf-8")) if done_path.is_file() else {}
        samples, batches = RunLog(shard).load(None if head is None else head["batch_ids"])
        parts.append(
            {
                "replica": int(shard.name.removeprefix("replica")),
                "head": head,
                "samples": samples,
                "batches": batches,
                "started_at": done.get("started_at"),
                "wall_s": done.get("wall_s"),
                "finished": bool(done),
                "stop": done.get("stop"),
            }
        )
    if not shards and (folder / BATCHES_FILE).is_file():
        samples, batches = RunLog(folder).load()
        parts.append(
            {
                "replica": 0,
                "head": None,
                "samples": samples,
                "batches": batches,
                "started_at": None,
                "wall_s": None,
                "finished": False,
                "stop": None,
            }
        )
    return parts


def merge_run(
    folder: str | os.PathLike[str],
    head: Mapping[str, Any],
    parts: Sequence[Mapping[str, Any]],
    metric: str,
    *,
    error: str | None = None,
    cause: str = "runtime",
) -> RunSummary:
    """Merge the replicas' ``parts`` of a run into its folder: ``samples.jsonl`` and ``batches.jsonl`` in batch order
    (rewritten atomically when there are shards) and ``summary.json`` (``status`` done, or oom with ``error`` and
    ``oom_cause`` ``cause``). Any out-of-memory marker of the run is then cleared: it has become this row, or the
    run has since succeeded. Returns the summary.

    ``head``: the run's settings, batch ids, layout and memory fields (``eval.run.evaluate_run`` writes it into
    each shard as :data:`HEAD_FILE`). A part: a replica's ``samples`` and ``batches`` records, its ``started_at``
    and ``wall_s`` (this session's seconds on its share)."""
    folder = Path(folder)
    dp, tp = int(head["dp"]), int(head["tp"])
    by_index = {b.batch: b for part in parts for b in part["batches"]}
    batches = [by_index[i] for i in sorted(by_index)]
    by_id = {str(r.id): r for part in parts for r in part["samples"]}
    samples = [by_id[str(i)] for b in batches for i in b.ids]
    if dp > 1:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / SAMPLES_FILE, _lines(samples))
        atomic_write_text(folder / BATCHES_FILE, _lines(batches))
    summary = dict(head["settings"])
    summary["status"] = "oom" if error else "done"
    summary.update(summarise(samples, batches, metric))
    summary.update(head["budget"])
    summary.update(head["extra"])
    if error:
        summary.update({"error": error, "oom_cause": cause})
    walls = {int(p["replica"]): float(p["wall_s"]) for p in parts if p.get("wall_s") is not None}
    summary.update(_session_times(parts, walls))
    if dp * tp > 1 and not error:
        summary["per_replica"] = [dict(r, wall_s=walls.get(r["replica"])) for r in per_replica(batches, dp, tp)]
    if head["continuous"] and not error:
        summary.update(latency_fields(batches))
    atomic_write_text(folder / SUMMARY_FILE, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    for marker in folder.glob("oom-rank*.json"):
        marker.unlink(missing_ok=True)
    return RunSummary.from_json(summary)


def _session_times(parts: Sequence[Mapping[str, Any]], walls: dict[int, float]) -> dict[str, Any]:
    """When the run's earliest replica started, now, and the slowest replica's seconds this session."""
    starts = [p["started_at"] for p in parts if p.get("started_at")]
    return {
        "started_at": min(starts) if starts else utc_now(),
        "finished_at": utc_now(),
        "wall_s": max(walls.values(), default=0.0),
    }


def read_summary(folder: str | os.PathLike[str]) -> RunSummary | None:
    """A finished run's ``summary.json``, or None when the run has not finished."""
    path = Path(folder) / SUMMARY_FILE
    if not path.is_file():
        return None
    return RunSummary.from_json(json.loads(path.read_text(encoding="utf-8")))


def write_oom_marker(folder: str | os.PathLike[str], rank: int, error: str, batch: int) -> Path:
    """Record, from the rank that hit it, that this run ran out of memory in ``batch`` (written atomically)."""
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
    path = Path(out) / "config.yaml"
    if not path.is_file():
        return False
    try:
        old = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"out: cannot read {path} to resume: {' '.join(str(err).split())}") from None
    old.setdefault("dp_size", 1)  # written before dp_size was a key: single-process results
    old.setdefault("max_prompts", 64)  # written before max_prompts was a key: the main job's fixed 64
    old.setdefault("bm_chunk", 0)  # written before bm_chunk was a key: BM's passes of one block
    for key in sorted((set(old) | set(config)) - _NEUTRAL_KEYS):
        if old.get(key) != config.get(key):
            raise ValueError(
                f"out: {out} holds results made with {key}={old.get(key)!r}, this run has {key}={config.get(key)!r}; "
                "choose another out or delete the folder"
            )
    return True


def comparable(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What must be equal between a resumed and an uninterrupted run with the same config, for a folder of
    results (an ``OUT`` or one run's folder, searched recursively):

    - every ``samples.jsonl`` and ``batches.jsonl``: the list of records (in file order) without the
      :data:`TIMING_KEYS`;
    - every ``summary.json``: the object without the :data:`TIMING_KEYS`;
    - every ``results.csv``: the rows without the timing columns;
    - every ``report.md``: the text with the tokens/s column and the comparison lines' speed-ups blanked.

    ``config.yaml`` (header comment has the time) and the PNG plots (drawn from the CSV; the throughput plot
    shows timings) are not compared.
    """
    folder = Path(folder)
    found: dict[str, Any] = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.name in (SAMPLES_FILE, BATCHES_FILE):
            lines = path.read_text(encoding="utf-8").splitlines()
            found[rel] = [_drop_timing(json.loads(line)) for line in lines if line.strip()]
            if path.parent.name.startswith("replica"):  # a shard: in the order its replica finished them
                found[rel].sort(key=lambda r: json.dumps(r, sort_keys=True))
        elif path.name in (HEAD_FILE, DONE_FILE) and path.parent.name.startswith("replica"):
            found[rel] = _drop_timing(json.loads(path.read_text(encoding="utf-8")))
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
