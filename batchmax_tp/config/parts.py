"""The simple parts: :class:`ModelConfig`, :class:`DataConfig`, :class:`GenerationConfig`,
:class:`ParallelConfig` and :class:`OutputConfig` (the sweep and the memory budget have their own modules)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ..embedded import EMBEDDED_MODEL
from .settings import (
    FLAG,
    INT,
    MAX_COUNT,
    MAX_RANKS,
    MAX_SEED,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    NUMBER,
    OPTIONAL_INT,
    OPTIONAL_TEXT,
    TEXT,
    ConfigError,
    Part,
    setting,
)
from .tasks import METRICS, PAPER_TASKS, TASK_NAMES

DTYPES = ("auto", "float32", "float16", "bfloat16")  #: auto: float32 on CPU, the checkpoint's own on CUDA
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
#: Sampling temperatures: below the lowest, float16 logits divided by it overflow (use greedy decoding instead).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelConfig(Part):
    """What to load, in which dtype, on which device."""

    title: ClassVar[str] = "model"
    name: str | None = setting(
        None, OPTIONAL_TEXT, "HF model id or local path (default: the embedded SmolLM2)", key="model"
    )
    dtype: str = setting(
        "auto",
        TEXT,
        "model dtype (default auto: float32 on CPU; on CUDA float16 for a float16 checkpoint, else bfloat16 on GPUs "
        "of compute capability >= 8.0 and float16 below)",
        metavar="|".join(DTYPES),
        choices=DTYPES,
    )
    device: str = setting(
        "auto",
        TEXT,
        "default auto = cuda if available (multi-process runs: the local rank's GPU)",
        metavar="auto|cpu|cuda|cuda:N",
    )

    def normalise(self) -> None:
        if self.name is None:
            self._set("name", EMBEDDED_MODEL)

    def validate(self) -> None:
        if not self.name.strip():
            raise ConfigError("model", "must not be empty")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class DataConfig(Part):
    """The task and its samples: which file or dataset, how many, how prompts are built and scored."""

    title: ClassVar[str] = "data and task"
    task: str = setting(
        "jsonl",
        TEXT,
        "jsonl (--data = a JSONL file; default) or a paper task (--data = hub id or folder)",
        metavar="|".join(TASK_NAMES),
        choices=TASK_NAMES,
    )
    path: str | None = setting(
        None, OPTIONAL_TEXT, "samples file (default: the embedded fixture)", key="data", metavar="JSONL"
    )
    num_samples: int | None = setting(
        None,
        OPTIONAL_INT,
        "use N samples drawn with --seed (the same for every run), kept in file order (default null: all)",
        metavar="N|null",
        low=1,
        high=MAX_COUNT,
        null="all",
    )
    num_shots: int | None = setting(
        None,
        OPTIONAL_INT,
        "few-shot examples (default null: CNN/DM 1, NarrativeQA 2, GSM8K 16)",
        metavar="N|null",
        low=0,
        high=1024,
        null="the paper's count",
    )
    max_input_tokens: int | None = setting(
        3584,
        OPTIONAL_INT,
        "cut paper-task prompts to N tokens, in the document only (default 3584)",
        metavar="N|null",
        low=1,
        high=MAX_TOKENS,
        null="no limit",
    )
    metric: str | None = setting(
        None,
        OPTIONAL_TEXT,
        "default: the task's (jsonl: contains)",
        metavar="|".join(METRICS),
        choices=tuple(METRICS),
    )

    def validate(self) -> None:
        if self.task == "jsonl" and self.num_shots:
            raise ConfigError("num_shots", "JSONL prompts have no shots; num_shots is for the paper's tasks")
        if self.path is None:
            return
        if self.task == "jsonl":
            if not os.path.isfile(self.path):
                raise ConfigError("data", f"file not found: {self.path}")
        elif not os.path.isdir(self.path) and (os.path.exists(self.path) or not _HUB_ID_RE.match(self.path)):
            raise ConfigError(
                "data",
                f"task {self.task} needs a hub id (owner/name) or a folder with train.jsonl and "
                f"test.jsonl, got {self.path!r}",
            )

    def shots_for_task(self) -> int:
        """``num_shots``, or the paper's count for the task (0 for jsonl)."""
        if self.num_shots is not None:
            return self.num_shots
        return 0 if self.task == "jsonl" else PAPER_TASKS[self.task].shots

    def metric_for_task(self) -> str:
        """``metric``, or the task's (CNN/DM and NarrativeQA rouge2, GSM8K accuracy, jsonl contains)."""
        if self.metric is not None:
            return self.metric
        return "contains" if self.task == "jsonl" else PAPER_TASKS[self.task].metric


@dataclass(frozen=True)
class GenerationConfig(Part):
    """How each prompt is continued: length, EOS, greedy or sampled, and the seed."""

    title: ClassVar[str] = "generation"
    max_new_tokens: int = setting(
        64,
        INT,
        "tokens to generate per sample (default 64; below the model's context length)",
        metavar="N",
        low=1,
        high=MAX_TOKENS,
    )
    ignore_eos: bool = setting(
        True,
        FLAG,
        "always generate --max-new-tokens, past EOS (default; throughput runs)",
        off="stop a sample at its first EOS",
    )
    seed: int = setting(0, INT, "random seed (default 0)", metavar="N", low=0, high=MAX_SEED)
    do_sample: bool = setting(
        False,
        FLAG,
        "sample (--temperature, --top-k, --top-p) instead of greedy decoding",
        off="greedy decoding (default)",
    )
    temperature: float = setting(
        1.0,
        NUMBER,
        f"sampling temperature, {MIN_TEMPERATURE} to {MAX_TEMPERATURE} (default 1.0; --do-sample only)",
        metavar="T",
        low=MIN_TEMPERATURE,
        high=MAX_TEMPERATURE,
    )
    top_k: int = setting(
        0, INT, "top-k sampling, 0 = off (default 0; --do-sample only)", metavar="K", low=0, high=MAX_COUNT
    )
    top_p: float = setting(1.0, NUMBER, "nucleus sampling, 1.0 = off (default 1.0; --do-sample only)", metavar="P")

    def normalise(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                self._set(name, float(value))

    def validate(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.do_sample:  # greedy decoding reads none of them: a value set is a mistake, not a no-op
            for f, _, key in self.settings():
                if key in ("temperature", "top_k", "top_p") and getattr(self, f.name) != f.default:
                    raise ConfigError(
                        key, f"{getattr(self, f.name)} is unused by greedy decoding: add --do-sample (do_sample: true)"
                    )

    def sampling(self) -> dict[str, Any]:
        """The keyword arguments ``bench.padded.generate`` and ``core.requests.Sampling`` take from this part."""
        return {
            "ignore_eos": self.ignore_eos,
            "do_sample": self.do_sample,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
        }


@dataclass(frozen=True)
class ParallelConfig(Part):
    """How the launch's processes split the work: tensor-parallel groups, data-parallel replicas."""

    title: ClassVar[str] = "parallelism"
    tp_size: int | None = setting(
        None,
        OPTIONAL_INT,
        "tensor-parallel ranks per model replica (default null: every process of the launch splits one model); "
        "data-parallel replicas = world size / N",
        metavar="N|null",
        low=1,
        high=MAX_RANKS,
        null="the world size",
    )
    dp_size: int | None = setting(
        None,
        OPTIONAL_INT,
        "data-parallel replicas (default null: world size / tp_size); a value must equal it",
        metavar="N|null",
        low=1,
        high=MAX_RANKS,
        null="world size / tp_size",
    )
    setup_timeout: int = setting(
        1800,
        INT,
        "seconds ranks wait for each other while loading (default 1800); generation collectives time out after 60 s",
        metavar="S",
        low=1,
        high=MAX_TIMEOUT_S,
    )


@dataclass(frozen=True)
class OutputConfig(Part):
    """Where results go and how much is logged."""

    title: ClassVar[str] = "output"
    dir: str = setting("results/main", TEXT, "output directory (default results/main)", key="out", metavar="DIR")
    log_level: str = setting(
        "INFO", TEXT, "DEBUG, INFO, WARNING, ... (default INFO)", metavar="LEVEL", choices=LOG_LEVELS
    )

    def normalise(self) -> None:
        if isinstance(self.log_level, str):
            self._set("log_level", self.log_level.upper())

    def validate(self) -> None:
        if not self.dir.strip():
            raise ConfigError("out", "must not be empty")
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise ConfigError("out", f"exists and is not a directory: {self.dir}")
        folder = os.path.abspath(self.dir)  # the nearest folder that exists must be one (the job creates the rest)
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise ConfigError("out", f"cannot create {self.dir}: {folder} is not a directory")
