"""What a run can name: the tasks and metrics, as data (no torch, no data loading). The configuration validates
against them and ``eval`` implements them (``eval.tasks``: each task's loader; ``eval.metrics``: each metric)."""

from __future__ import annotations

from dataclasses import dataclass

#: The metrics a run can be scored with (``eval.metrics.score``).
METRICS = ("rouge2", "accuracy", "exact", "contains")


@dataclass(frozen=True)
class Task:
    """A paper task: where its data lives, how many shots, which metric (``eval.tasks.TaskDef`` adds how a record
    becomes a turn)."""

    name: str
    hub_id: str  #: the dataset the paper used
    hub_config: str | None
    shots: int
    metric: str
    test_split: str = "test"
    shot_split: str = "train"


#: The paper's tasks, by name.
PAPER_TASKS: dict[str, Task] = {
    "cnn_dailymail": Task("cnn_dailymail", "abisee/cnn_dailymail", "3.0.0", 1, "rouge2"),
    "narrativeqa": Task("narrativeqa", "deepmind/narrativeqa", None, 2, "rouge2"),
    "gsm8k": Task("gsm8k", "openai/gsm8k", "main", 16, "accuracy"),
}
#: ``jsonl`` = generic ``{"id", "prompt", "reference"}`` samples (``eval.tasks.load_jsonl``), then the paper's tasks.
TASK_NAMES = ("jsonl", *PAPER_TASKS)
