"""The typed records of a run's files: a line of ``samples.jsonl`` (:class:`SampleRecord`), a line of
``batches.jsonl`` (:class:`BatchRecord`) and ``summary.json`` (:class:`RunSummary`). Each is a frozen dataclass that
reads its JSON (``from_json``) and writes it (``to_json``); ``eval.results`` writes and reads the files,
``eval.report`` reads the summaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["BATCH_KEYS", "SAMPLE_KEYS", "BatchRecord", "RunSummary", "SampleRecord"]


@dataclass(frozen=True)
class SampleRecord:
    """One line of ``samples.jsonl``: only what the model produced. ``reference``: a string, a list of strings
    (several references) or None; ``correct``: None for ROUGE (no yes/no verdict) and samples without a
    reference."""

    id: str
    prompt_tokens: int | None
    output: str
    reference: str | list[str] | None
    correct: bool | None
    generated_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in SAMPLE_KEYS}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SampleRecord:
        """A line read back (a field it lacks is None)."""
        return cls(**{f: obj.get(f) for f in SAMPLE_KEYS})


@dataclass(frozen=True)
class BatchRecord:
    """One line of ``batches.jsonl``: a finished batch (static) or request (continuous). ``peak_kv_bytes`` is summed
    over the replica's tensor-parallel ranks (each rank's in ``peak_kv_bytes_per_rank``); ``peak_workspace_bytes``
    and ``cuda_max_memory_allocated`` (None off CUDA) are its tensor-parallel rank 0's. A request the continuous
    scheduler finished also has its ``slot``, ``first_token_s`` and ``latency_s`` (seconds from the run's start);
    a static batch's line has none of them."""

    batch: int
    replica: int
    ids: list[str]
    tokens_cut: list[int]
    generated_tokens: int
    prefill_s: float
    decode_s: float
    peak_kv_bytes: int
    peak_kv_bytes_per_rank: list[int]
    peak_workspace_bytes: int | None = None
    cuda_max_memory_allocated: int | None = None
    slot: int | None = None
    first_token_s: float | None = None
    latency_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    def to_json(self) -> dict[str, Any]:
        line = {f: getattr(self, f) for f in BATCH_KEYS}
        line.update({f: getattr(self, f) for f in _SERVED_KEYS if getattr(self, f) is not None})
        return line

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BatchRecord:
        """A line read back (``replica`` 0, ``tokens_cut`` none and ``peak_kv_bytes_per_rank`` the total where the
        line lacks them; other missing fields None)."""
        line = {f: obj.get(f) for f in (*BATCH_KEYS, *_SERVED_KEYS)}
        line["replica"] = int(line["replica"] or 0)
        line["tokens_cut"] = list(line["tokens_cut"] or [])
        line["peak_kv_bytes"] = int(line["peak_kv_bytes"] or 0)
        line["peak_kv_bytes_per_rank"] = line["peak_kv_bytes_per_rank"] or [line["peak_kv_bytes"]]
        return cls(**line)


#: The fields of one ``samples.jsonl`` line (:class:`SampleRecord`), in file order.
SAMPLE_KEYS = tuple(f.name for f in fields(SampleRecord))
#: A continuous request's own fields (:class:`BatchRecord`), written only where set.
_SERVED_KEYS = ("slot", "first_token_s", "latency_s")
#: The fields of every ``batches.jsonl`` line (:class:`BatchRecord`), in file order; a continuous request's line
#: adds ``_SERVED_KEYS``.
BATCH_KEYS = tuple(f.name for f in fields(BatchRecord) if f.name not in _SERVED_KEYS)


@dataclass(frozen=True)
class RunSummary:
    """A run's ``summary.json``, typed: its settings (``eval.summary.run_settings``), ``status`` (``done`` or
    ``oom``, with ``error`` and ``oom_cause``), its measurements (``results.summarise``: the slowest replica's
    seconds, tokens/s, peaks, the metric's score) and its memory fields (``eval.summary.budget_fields``, the
    same-memory run's budget). A field the file lacks takes its default; ``raw`` is the object as written (every
    key, the ones no reader names too: ``to_json`` gives it back unchanged)."""

    run: str = ""
    method: str = ""
    rule: str | None = "paper"  #: summaries written before rules existed ran the paper's
    batch_size: int = 0
    kv_max: int | None = None
    p: int | None = None
    model: str | None = None
    task: str | None = None
    num_shots: int = 0
    metric: str | None = None
    max_input_tokens: int | None = None
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    dtype: str | None = None
    device: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    status: str = "done"
    error: str | None = None
    oom_cause: str | None = None  #: an OOM row's: predicted (over the budget on paper) or runtime
    num_samples: int = 0
    num_batches: int | None = None
    generated_tokens: int | None = None
    prompt_tokens: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_spread: float | None = None
    peak_kv_bytes: int | None = None
    peak_kv_mib: float = 0.0
    peak_workspace_bytes: int | None = None
    cuda_max_memory_allocated: int | None = None
    score: float | None = None
    num_scored: int | None = None
    num_checked: int | None = None
    num_correct: int | None = None
    accuracy: float | None = None
    started_at: str | None = None  #: when the run's earliest replica started (UTC, ISO 8601)
    samples_cut: int = 0
    tokens_cut: int | None = None
    memory_budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted: Mapping[str, int] | None = None  #: the planner's estimate per rank: total, kv, workspace, weights, ...
    weights_bytes: int | None = None
    same_memory_budget_bytes: int | None = None  #: the same-memory run's one budget
    paper_setting: bool = False  #: a run of the same-memory run's paper setting (static, ED and FKV at b0 - 1)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def oom(self) -> bool:
        return self.status == "oom"

    def to_json(self) -> dict[str, Any]:
        return dict(self.raw)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunSummary:
        """The summary as read (a key the object holds keeps its value, None included; a missing one its
        default)."""
        if isinstance(obj, RunSummary):
            return obj
        return cls(**{k: obj[k] for k in _SUMMARY_KEYS if k in obj}, raw=dict(obj))


#: The keys of ``summary.json`` that :class:`RunSummary` names.
_SUMMARY_KEYS = tuple(f.name for f in fields(RunSummary) if f.name != "raw")
