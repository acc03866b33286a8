"""Run configuration in parts: layered defaults -> YAML (``--config FILE``) -> CLI flags.

The keys stay flat (YAML ``batch_size``, flag ``--batch-size``); the code reads them by concern, one small validated
dataclass per part:

=============== ======================================================================================
``cfg.model``   :class:`ModelConfig`: ``model`` (``.name``), ``dtype``, ``device``
``cfg.data``    :class:`DataConfig`: ``task``, ``data`` (``.path``), ``num_samples``, shots, cutting, metric
``cfg.generation`` :class:`GenerationConfig`: ``max_new_tokens``, EOS, sampling, ``seed``
``cfg.sweep``   :class:`SweepConfig`: the runs -- ``methods``/``runs``, ``rule``, ``kv_max``, ``p``, batching
``cfg.memory``  :class:`MemoryConfig`: ``memory_budget`` (``.budget``), ``procedure``, ``kv_values``, ``target``
``cfg.parallel`` :class:`ParallelConfig`: ``tp_size``, ``dp_size``, ``setup_timeout``
``cfg.output``  :class:`OutputConfig`: ``out`` (``.dir``), ``log_level``
=============== ======================================================================================

Each field's metadata (:class:`Setting`) holds its YAML key, its kind (the type a YAML value must have and how its
flag's text is read), its help and its limits: the parts check themselves from it, and :func:`build_parser` makes
the flags from it. Every problem is a :class:`ConfigError` with a one-line message that starts with the offending
key, e.g. ``kv_max: kv_max must be > p for method 'bm', got kv_max=64 p=64``.

The job: the same-memory comparison (the "main job", ``RunConfig.main_job``) runs unless the configuration lists its
runs itself -- a ``methods`` (``method``), ``batch_size``, ``kv_max``, ``runs`` or ``procedure`` given in the YAML or
as a flag (:data:`LISTING_KEYS`) -- or sets ``same_memory: false``; ``same_memory: true`` forces it.

Validation needs only torch-free modules (``core.method``, ``core.rules``, ``plan``, ``eval.tasks``), so a bad
setting is reported in a fraction of a second, before torch or transformers load; nothing here loads a model or
writes a file.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import yaml

from .core.method import METHODS, BatchMax, Method, method_type
from .core.rules import get_rule, rule_names
from .embedded import EMBEDDED_MODEL  # re-exported (__all__): the default model
from .eval.metrics import METRICS
from .eval.tasks import TASK_NAMES, TASKS
from .plan.budget import RunSpec, story_methods
from .plan.planner import parse_bytes

__all__ = [
    "ConfigError",
    "DataConfig",
    "EMBEDDED_MODEL",
    "GenerationConfig",
    "LISTING_KEYS",
    "MemoryConfig",
    "ModelConfig",
    "OutputConfig",
    "ParallelConfig",
    "RunConfig",
    "SweepConfig",
    "DTYPES",
    "LOG_LEVELS",
    "METRICS",
    "PROCEDURES",
    "RUN_KEYS",
    "TASK_NAMES",
    "build_parser",
    "load_yaml",
    "parse_args",
]

DTYPES = ("auto", "float32", "float16", "bfloat16")  #: auto: float32 on CPU, the checkpoint's own on CUDA
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SCHEDULERS = ("static", "continuous")  #: how prompts share the model's passes (``core.serve`` for continuous)
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
#: Keys of one entry of ``runs`` (``rule``: BM's eviction rule for that run; default the config's ``rule``).
RUN_KEYS = ("method", "batch_size", "kv_max", "rule")
#: ``procedure`` values: the paper's batch-size procedure (section 4.1) and the auto-tuner
#: (``batchmax_tp.eval.procedures``).
PROCEDURES = ("paper", "tune")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ConfigError(ValueError):
    """A one-line, user-facing configuration error naming the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        message = " ".join(str(message).split())  # always one line
        super().__init__(f"{key}: {message}" if key else message)


# ---------------------------------------------------------------------- kinds of values
def _int_or_null(text: str) -> int | None:
    if text.lower() in ("null", "none", "default", "all"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or null, got {text!r}") from None


def _null_or_text(text: str) -> str | None:
    return None if text.lower() in ("null", "none") else text


def _int_or_text(text: str) -> int | str | None:
    """``--memory-budget``: null, a plain integer (bytes) or a size with a unit (checked by MemoryConfig)."""
    if text.lower() in ("null", "none"):
        return None
    return int(text) if text.strip().isdigit() else text


def _int_list(text: str) -> list[int] | None:
    if text.lower() in ("null", "none", "default"):
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 896,1024, got {text!r}") from None


@dataclass(frozen=True)
class Kind:
    """A setting's type: what a YAML value must be (:meth:`check`) and how its flag's text is read (``parse``;
    None: the text itself). ``float`` settings take ints too; a bool is never an int here."""

    what: str
    types: tuple[type, ...]
    nullable: bool = False
    parse: Callable[[str], Any] | None = None

    def describe(self) -> str:
        return f"{self.what} or null" if self.nullable else self.what

    def check(self, key: str, value: Any) -> None:
        if value is None:
            if not self.nullable:
                raise ConfigError(key, f"must be {self.describe()}, got null")
            return
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            raise ConfigError(key, f"must be {self.describe()}, got {type(value).__name__} {value!r}")


TEXT = Kind("a string", (str,))
OPTIONAL_TEXT = Kind("a string", (str,), nullable=True)
NULL_OR_TEXT = Kind("a string", (str,), nullable=True, parse=_null_or_text)
INT = Kind("an integer", (int,), parse=int)
OPTIONAL_INT = Kind("an integer", (int,), nullable=True, parse=_int_or_null)
NUMBER = Kind("a number", (int, float), parse=float)
FLAG = Kind("a boolean (true/false)", (bool,))
OPTIONAL_FLAG = Kind("a boolean (true/false)", (bool,), nullable=True)
BYTES = Kind("a byte size (e.g. 24GiB, 512MiB or 1000000)", (str, int), nullable=True, parse=_int_or_text)
INT_LIST = Kind("a list", (list,), nullable=True, parse=_int_list)
LIST = Kind("a list", (list,))
OPTIONAL_LIST = Kind("a list", (list,), nullable=True)


@dataclass(frozen=True)
class Setting:
    """A field's metadata: its YAML key (default the field's name), kind, help and limits. ``flag``: the CLI flag
    (default ``--key-with-dashes``; "" = YAML only); ``low``: the lowest value, ``null`` what null means then;
    ``lists``: setting it lists the job's runs (it leaves the main job); ``off``: the help of ``--no-FLAG``."""

    kind: Kind
    help: str
    key: str | None = None
    flag: str | None = None
    metavar: str | None = None
    low: int | None = None
    null: str | None = None
    choices: tuple[str, ...] | None = None
    lists: bool = False
    off: str | None = None


def setting(default: Any, kind: Kind, help: str, **meta: Any) -> Any:
    """A part's field with its :class:`Setting` (a list default is copied per instance)."""
    info = {"setting": Setting(kind, help, **meta)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=info)
    return field(default=default, metadata=info)


def _validate_rule(rule: str, key: str) -> None:
    try:
        get_rule(rule)
    except ValueError as err:
        raise ConfigError(key, str(err)) from None


class Part:
    """A part of the configuration: a frozen dataclass whose fields carry a :class:`Setting`. Construction checks
    each value's kind and limits, then the part's own rules (:meth:`validate`); errors name the YAML key."""

    title: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.normalise()
        for f, s, key in self.settings():
            s.kind.check(key, getattr(self, f.name))
        for f, s, key in self.settings():
            self._check_limits(s, key, getattr(self, f.name))
        self.validate()

    @staticmethod
    def _check_limits(s: Setting, key: str, value: Any) -> None:
        if value is None:
            return
        if s.low is not None and value < s.low:
            raise ConfigError(key, f"must be >= {s.low}{f' or null ({s.null})' if s.null else ''}, got {value}")
        if s.choices is not None and value not in s.choices:
            null = " or null" if s.kind.nullable else ""
            raise ConfigError(key, f"must be one of {', '.join(s.choices)}{null}, got {value!r}")

    def normalise(self) -> None:
        """Settle spellings before the checks (frozen: through ``_set``)."""

    def validate(self) -> None:
        """The part's own rules beyond each value's kind and limits."""

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @classmethod
    def settings(cls) -> list[tuple[Any, Setting, str]]:
        """(field, setting, YAML key) of each field, in order."""
        return [(f, f.metadata["setting"], f.metadata["setting"].key or f.name) for f in fields(cls)]

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> Part:
        return cls(**{f.name: flat[key] for f, _, key in cls.settings() if key in flat})

    def to_flat(self) -> dict[str, Any]:
        return {key: copy.deepcopy(getattr(self, f.name)) for f, _, key in self.settings()}


# ---------------------------------------------------------------------- the parts
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
        null="all",
    )
    num_shots: int | None = setting(
        None,
        OPTIONAL_INT,
        "few-shot examples (default null: CNN/DM 1, NarrativeQA 2, GSM8K 16)",
        metavar="N|null",
        low=0,
        null="the paper's count",
    )
    max_input_tokens: int | None = setting(
        3584,
        OPTIONAL_INT,
        "cut paper-task prompts to N tokens, in the document only (default 3584)",
        metavar="N|null",
        low=1,
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
        return 0 if self.task == "jsonl" else TASKS[self.task].shots

    def metric_for_task(self) -> str:
        """``metric``, or the task's (CNN/DM and NarrativeQA rouge2, GSM8K accuracy, jsonl contains)."""
        if self.metric is not None:
            return self.metric
        return "contains" if self.task == "jsonl" else TASKS[self.task].metric


@dataclass(frozen=True)
class GenerationConfig(Part):
    """How each prompt is continued: length, EOS, greedy or sampled, and the seed."""

    title: ClassVar[str] = "generation"
    max_new_tokens: int = setting(64, INT, "tokens to generate per sample (default 64)", metavar="N", low=1)
    ignore_eos: bool = setting(
        True,
        FLAG,
        "always generate --max-new-tokens, past EOS (default; throughput runs)",
        off="stop a sample at its first EOS",
    )
    seed: int = setting(0, INT, "random seed (default 0)", metavar="N")
    do_sample: bool = setting(
        False,
        FLAG,
        "sample (--temperature, --top-k, --top-p) instead of greedy decoding",
        off="greedy decoding (default)",
    )
    temperature: float = setting(1.0, NUMBER, "sampling temperature (default 1.0)", metavar="T")
    top_k: int = setting(0, INT, "top-k sampling, 0 = off (default 0)", metavar="K", low=0)
    top_p: float = setting(1.0, NUMBER, "nucleus sampling, 1.0 = off (default 1.0)", metavar="P")

    def normalise(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                self._set(name, float(value))

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")

    def sampling(self) -> dict[str, Any]:
        """The keyword arguments ``core.engine.generate`` and ``core.serve.serve`` take from this part."""
        return {
            "ignore_eos": self.ignore_eos,
            "do_sample": self.do_sample,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
        }


@dataclass(frozen=True)
class SweepConfig(Part):
    """The runs: the methods at one batch size (or the listed ``runs``), BM's rule and cache size, batching."""

    title: ClassVar[str] = "methods and runs"
    methods: list[str] = setting(
        list(METHODS),
        LIST,
        "method to run; repeat (or comma-separate) for several (default: fkv, ed, bm)",
        flag="--method",
        metavar="{" + ",".join(METHODS) + "}",
        lists=True,
    )
    rule: str = setting(
        "paper",
        TEXT,
        "BM's eviction rule (default paper; --list-rules names them; parameters as NAME:key=value,..., "
        "e.g. snapkv:window=64)",
        metavar="NAME",
    )
    kv_max: int | None = setting(
        None,
        OPTIONAL_INT,
        "bm/ed KV pairs per (sample, KV head) (default null: bm 512, ed 2)",
        metavar="N|null",
        low=1,
        null="per-method default",
        lists=True,
    )
    p: int = setting(64, INT, "BM eviction amount / prefill block (default 64)", metavar="N", low=1)
    batch_size: int = setting(4, INT, "samples per batch (default 4)", metavar="N", low=1, lists=True)
    runs: list[dict[str, Any]] | None = setting(
        None,
        OPTIONAL_LIST,
        "sweep entries {method, batch_size, kv_max, rule}; null = methods x batch_size",
        flag="",
        lists=True,
    )
    same_memory: bool | None = setting(
        None,
        OPTIONAL_FLAG,
        "run the main job: FKV, ED, BM and BM with the best rule each at its largest batch within FKV's memory at "
        "batch 4 (default: unless the configuration lists its runs)",
        off="run the methods (or runs) as given, at --batch-size",
    )
    scheduler: str = setting(
        "static",
        TEXT,
        "static: padded batches of --batch-size; continuous: --batch-size slots, each refilled as soon as its "
        "request ends (default static)",
        metavar="|".join(SCHEDULERS),
        choices=SCHEDULERS,
    )
    prefill_budget: int | None = setting(
        None,
        OPTIONAL_INT,
        "continuous: prompt tokens prefilled between two decode steps (default null: no limit)",
        metavar="N|null",
        low=1,
        null="no limit",
    )

    def normalise(self) -> None:
        if isinstance(self.methods, str):
            self._set("methods", [self.methods])

    def validate(self) -> None:
        if not self.methods:
            raise ConfigError("methods", "must name at least one method")
        for m in self.methods:
            if not isinstance(m, str):
                raise ConfigError("methods", f"entries must be strings, got {type(m).__name__} {m!r}")
        dup = sorted({m for m in self.methods if self.methods.count(m) > 1})
        if dup:
            raise ConfigError("methods", f"duplicate method(s) {', '.join(dup)}")
        _validate_rule(self.rule, "rule")
        self.run_specs()  # the method rules live in core.method; check them now, before any model loads

    # -- what each method runs with
    def kv_max_for(self, name: str) -> int | None:
        """The cache size method ``name`` runs with: ``kv_max`` if set (methods that evict), else its default."""
        cls = METHODS.get(name)
        if cls is None or not cls.evicts:
            return None
        return self.kv_max if self.kv_max is not None else cls.default_kv_max

    def rule_for(self, name: str) -> str:
        """The eviction rule method ``name`` runs with: ``rule`` where it takes one (BM), else the paper's."""
        cls = METHODS.get(name)
        return self.rule if cls is not None and cls.takes_rule else "paper"

    def method_specs(self) -> list[Method]:
        """One ``core.method.Method`` per entry of ``methods``; errors name the key that caused them."""
        specs = []
        for name in self.methods:
            try:
                specs.append(Method(name, kv_max=self.kv_max_for(name), p=self.p, rule=self.rule_for(name)))
            except ValueError as err:
                raise ConfigError(self._blame(name), f"{err}{self._default_hint(name)}") from None
        return specs

    def _default_hint(self, name: str) -> str:
        default = self.kv_max_for(name)
        if self.kv_max is not None or default is None:
            return ""
        return f" (kv_max null = the {name} default {default}; set kv_max explicitly)"

    def _blame(self, name: str) -> str:
        """Which key made ``Method(name, ...)`` fail, found by retrying with defaults (Method owns the rules)."""
        cls = METHODS.get(name)
        default = None if cls is None else cls.default_kv_max
        try:
            Method(name, kv_max=default, p=64)
        except ValueError:
            return "methods"
        try:
            Method(name, kv_max=default, p=self.p)
        except ValueError:  # p is too large for the default kv_max: kv_max is the fix only if set
            if self.kv_max is None:
                return "p"
            try:
                Method(name, kv_max=self.kv_max, p=64)
            except ValueError:
                return "kv_max"
            return "p"
        return "kv_max"

    def story_methods(self) -> list[Method]:
        """The main job's methods: FKV, ED, the paper's BM and BM with the best rule (``plan.budget``)."""
        return story_methods({"ed": self.kv_max_for("ed"), "bm": self.kv_max_for("bm")}, self.p, self.rule)

    # -- the listed runs
    def run_specs(self) -> list[RunSpec]:
        """The listed runs (``plan.budget.RunSpec``): the ``runs`` entries, or each of ``methods`` at
        ``batch_size``. Errors name the entry, e.g. ``runs[2].kv_max: ...``."""
        if self.runs is None:
            return [RunSpec(method, self.batch_size) for method in self.method_specs()]
        if not self.runs:
            raise ConfigError("runs", "must list at least one run, or be null (methods x batch_size)")
        specs, names = [], {}
        for i, entry in enumerate(self.runs):
            spec = self._run_spec(f"runs[{i}]", entry)
            if spec.name in names:
                raise ConfigError(f"runs[{i}]", f"the same run as runs[{names[spec.name]}] ({spec.name})")
            names[spec.name] = i
            specs.append(spec)
        return specs

    def _run_spec(self, where: str, entry: Any) -> RunSpec:
        """One ``runs`` entry as a RunSpec; each check names the entry's key it is about."""
        _check_run_entry(where, entry)
        method, kv_max, rule = entry["method"], entry.get("kv_max"), entry.get("rule")
        try:
            cls = method_type(method)
        except ValueError as err:
            raise ConfigError(f"{where}.method", str(err)) from None
        if rule is None:
            rule = self.rule_for(method)
        elif rule != "paper" and not cls.takes_rule:
            raise ConfigError(f"{where}.rule", f"rule {rule!r} applies to method bm only, not {method!r}")
        try:  # method, rule and p are valid: what is left is the cache size
            return RunSpec(
                Method(method, kv_max=self.kv_max_for(method) if kv_max is None else kv_max, p=self.p, rule=rule),
                entry["batch_size"],
            )
        except ValueError as err:
            raise ConfigError(f"{where}.kv_max", str(err)) from None


def _check_run_entry(where: str, entry: Any) -> None:
    """The shape of one ``runs`` entry: a mapping of :data:`RUN_KEYS` with a method and a batch size."""
    if not isinstance(entry, dict):
        raise ConfigError(where, f"must be a mapping like {{method: bm, batch_size: 8, kv_max: 512}}, got {entry!r}")
    for key in entry:
        if key not in RUN_KEYS:
            raise ConfigError(f"{where}.{key}", f"unknown key; a run has {', '.join(RUN_KEYS)}")
    for key in ("method", "batch_size"):
        if key not in entry:
            raise ConfigError(f"{where}.{key}", "missing")
    method, batch_size, kv_max, rule = (entry.get(k) for k in RUN_KEYS)
    if rule is not None:
        if not isinstance(rule, str):
            raise ConfigError(f"{where}.rule", f"must be a string, got {rule!r}")
        _validate_rule(rule, f"{where}.rule")
    if not isinstance(method, str):
        raise ConfigError(f"{where}.method", f"must be a string, got {method!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"{where}.batch_size", f"must be an integer >= 1, got {batch_size!r}")
    if kv_max is not None and (isinstance(kv_max, bool) or not isinstance(kv_max, int) or kv_max < 1):
        raise ConfigError(f"{where}.kv_max", f"must be an integer >= 1 or null, got {kv_max!r}")


@dataclass(frozen=True)
class MemoryConfig(Part):
    """The memory budget per rank and the procedures that choose runs within it."""

    title: ClassVar[str] = "memory and procedures"
    budget: str | int | None = setting(
        None,
        BYTES,
        "peak memory per rank a run may need, e.g. 24GiB (planner prediction; over it = OOM row)",
        key="memory_budget",
        metavar="BYTES",
    )
    procedure: str | None = setting(
        None,
        NULL_OR_TEXT,
        "paper: the paper's b0 procedure (launch/sweep.py); tune: the auto-tuner (launch/tune.py)",
        metavar="paper|tune|null",
        choices=PROCEDURES,
        lists=True,
    )
    kv_values: list[int] | None = setting(
        None,
        INT_LIST,
        "BM kv_max values the procedures try (default: multiples of 128 below the longest prompt)",
        metavar="K1,K2,...|null",
    )
    target: float = setting(0.95, NUMBER, "tune: BM's metric must reach T x FKV's (default 0.95)", metavar="T")

    def normalise(self) -> None:
        if isinstance(self.target, int) and not isinstance(self.target, bool):
            self._set("target", float(self.target))

    def validate(self) -> None:
        self.budget_bytes()  # raises ConfigError("memory_budget: ...")
        if self.procedure is not None and self.budget is None:
            raise ConfigError(
                "memory_budget",
                f"procedure {self.procedure} needs a memory budget per rank "
                "(e.g. memory_budget: 24GiB or --memory-budget 24GiB)",
            )
        if not self.target > 0:
            raise ConfigError("target", f"must be > 0 (a fraction of FKV's metric, e.g. 0.95), got {self.target}")
        if self.kv_values is None:
            return
        if not self.kv_values:
            raise ConfigError("kv_values", "must list at least one kv_max, or be null (multiples of 128)")
        for k in self.kv_values:
            if isinstance(k, bool) or not isinstance(k, int):
                raise ConfigError("kv_values", f"entries must be integers, got {k!r}")

    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None without a budget)."""
        if self.budget is None:
            return None
        try:
            value = parse_bytes(self.budget)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise ConfigError(
                "memory_budget",
                f"cannot read a positive byte size from {self.budget!r} (examples: 24GiB, 512MiB, 1.5GB, 1000000)",
            )
        return value


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
        null="the world size",
    )
    dp_size: int | None = setting(
        None,
        OPTIONAL_INT,
        "data-parallel replicas (default null: world size / tp_size); a value must equal it",
        metavar="N|null",
        low=1,
        null="world size / tp_size",
    )
    setup_timeout: int = setting(
        1800,
        INT,
        "seconds ranks wait for each other while loading (default 1800); generation collectives time out after 60 s",
        metavar="S",
        low=1,
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


#: The parts in the order the resolved configuration lists their keys: (attribute of RunConfig, class).
PARTS: tuple[tuple[str, type[Part]], ...] = (
    ("model", ModelConfig),
    ("data", DataConfig),
    ("generation", GenerationConfig),
    ("sweep", SweepConfig),
    ("memory", MemoryConfig),
    ("parallel", ParallelConfig),
    ("output", OutputConfig),
)
#: Every setting by its YAML key.
SETTINGS: dict[str, Setting] = {key: s for _, part in PARTS for _, s, key in part.settings()}
#: The keys that list the job's runs: set to a value (YAML or flag), they leave the main job.
LISTING_KEYS: tuple[str, ...] = tuple(key for key, s in SETTINGS.items() if s.lists)


# ---------------------------------------------------------------------- the whole configuration
@dataclass(frozen=True, init=False)
class RunConfig:
    """Everything one ``launch/run.py`` invocation needs, in parts. ``RunConfig(**settings)`` takes the flat keys
    (the YAML's) and validates (raises :class:`ConfigError`); ``given`` holds the keys that were set."""

    model: ModelConfig
    data: DataConfig
    generation: GenerationConfig
    sweep: SweepConfig
    memory: MemoryConfig
    parallel: ParallelConfig
    output: OutputConfig
    given: frozenset[str] = field(compare=False, repr=False)

    def __init__(self, **settings: Any) -> None:
        self._build(settings, frozenset(settings))

    def _build(self, settings: dict[str, Any], given: frozenset[str]) -> None:
        _check_keys(settings, "RunConfig")
        settings = dict(settings)
        if isinstance(settings.get("methods"), str):
            settings["methods"] = [settings["methods"]]
        for key, value in settings.items():  # every value's type first, whichever part holds it
            SETTINGS[key].kind.check(key, value)
        for name, part in PARTS:
            object.__setattr__(self, name, part.from_flat(settings))
        object.__setattr__(self, "given", given)
        self._validate()

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some flat keys changed (validated again; the changed keys count as given)."""
        new = object.__new__(type(self))
        new._build({**self.to_dict(), **changes}, self.given | frozenset(changes))
        return new

    # -- rules across parts
    def _validate(self) -> None:
        procedure = self.memory.procedure
        if procedure is not None and self.sweep.scheduler == "continuous":
            raise ConfigError("scheduler", f"procedure {procedure} plans static batches: use scheduler static")
        for k in self.memory.kv_values or ():
            try:  # each entry is a BM run with the configured rule (Method owns the rules)
                BatchMax(kv_max=k, p=self.sweep.p, rule=self.sweep.rule)
            except ValueError as err:
                raise ConfigError("kv_values", f"BM cannot run with kv_max={k}: {err}") from None
        if self.memory.kv_values is not None and len(set(self.memory.kv_values)) != len(self.memory.kv_values):
            raise ConfigError("kv_values", f"duplicate values in {self.memory.kv_values}")
        if self.sweep.same_memory and (self.sweep.runs is not None or procedure is not None):
            listed = "runs" if self.sweep.runs is not None else "procedure"
            raise ConfigError("same_memory", f"the main job plans its own runs: it cannot run with {listed} set")
        if self.main_job:
            self._validate_main_job()

    def _validate_main_job(self) -> None:
        """The main job runs FKV, ED, the paper's BM and BM with the best rule (whatever ``methods`` says): each
        must run with ``kv_max`` and ``p``."""
        try:
            self.sweep.story_methods()
        except ValueError as err:
            key = "kv_max" if self.sweep.kv_max is not None else "p"
            raise ConfigError(
                key, f"the same-memory run (FKV, ED, BM, BM with the best rule) cannot use it: {err}"
            ) from None

    @property
    def listed_by(self) -> list[str]:
        """The keys set to a value that list the runs (:data:`LISTING_KEYS`, in that order)."""
        flat = self.to_dict()
        return [key for key in LISTING_KEYS if key in self.given and flat[key] is not None]

    @property
    def main_job(self) -> bool:
        """Whether the job is the same-memory comparison (``plan.budget.same_memory_plan``): ``same_memory`` when
        set, else unless a listing key is set (``listed_by``). Only which keys list runs decides, never which
        other flags were given."""
        if self.sweep.same_memory is not None:
            return self.sweep.same_memory
        return not self.listed_by

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """The flat keys and values (the YAML's): ``OUT/config.yaml`` and the resume key."""
        return {key: value for name, _ in PARTS for key, value in getattr(self, name).to_flat().items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @classmethod
    def keys(cls) -> list[str]:
        return list(SETTINGS)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> RunConfig:
        """Build from a YAML-style mapping (unknown keys rejected; ``method: bm`` is accepted for one method)."""
        return cls(**_normalise_mapping(data, source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> RunConfig:
        return cls.from_dict(load_yaml(path), source=str(path))


def _check_keys(data: dict[str, Any], source: str) -> None:
    for key in data:
        if key not in SETTINGS:
            known = list(SETTINGS)
            hint = f" (did you mean {key.replace('-', '_')}?)" if str(key).replace("-", "_") in known else ""
            raise ConfigError(str(key), f"unknown key in {source}{hint}; known keys: method, {', '.join(known)}")


def _normalise_mapping(data: Any, source: str) -> dict[str, Any]:
    """A YAML mapping's keys checked against the settings, ``method: X`` read as ``methods: [X]``."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{source}: top level must be a mapping of keys, got {type(data).__name__}")
    data = dict(data)
    _check_keys({k: v for k, v in data.items() if k != "method"}, source)
    if "method" in data:
        if "methods" in data:
            raise ConfigError("method", f"give either method or methods in {source}, not both")
        method = data.pop("method")
        if not isinstance(method, str):
            raise ConfigError("method", f"must be a string (use methods: [...] for several), got {method!r}")
        data["methods"] = [method]
    return data


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config file into a plain dict (empty file -> {}). Errors are one line, keyed ``config``."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError("config", f"cannot parse {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError("", message)


class _ListRules(argparse.Action):
    """``--list-rules``: print the rule names (one per line) and exit 0, like ``--help``."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message("\n".join(rule_names()) + "\n", sys.stdout)
        parser.exit(0)


def _flag(key: str, s: Setting) -> str:
    return s.flag if s.flag is not None else "--" + key.replace("_", "-")


def _add_setting(group: argparse._ArgumentGroup, key: str, s: Setting) -> None:
    """One setting's flag (``--x`` and ``--no-x`` for a boolean), from its metadata."""
    flag = _flag(key, s)
    text = s.help + (" [lists the runs: leaves the main job]" if s.lists else "")
    if s.kind.types == (bool,):
        pair = group.add_mutually_exclusive_group()
        pair.add_argument(flag, dest=key, action="store_true", help=text)
        pair.add_argument("--no-" + flag[2:], dest=key, action="store_false", help=s.off)
    elif s.kind is LIST:  # --method: repeated or comma-separated
        group.add_argument(flag, dest=key, action="append", metavar=s.metavar, help=text)
    else:
        group.add_argument(flag, dest=key, type=s.kind.parse, metavar=s.metavar, help=text)


def _main_job_help() -> str:
    flags = ", ".join(_flag(key, SETTINGS[key]) for key in LISTING_KEYS if SETTINGS[key].flag != "")
    keys = ", ".join(["method", *LISTING_KEYS])
    return (
        "The main job (FKV, ED, BM and BM with the best rule, each at its largest batch within FKV's memory at "
        f"batch 4) runs unless the configuration lists its runs: {flags} (YAML: {keys}) leave it, as does "
        "--no-same-memory; --same-memory forces it. Every other flag keeps it."
    )


def build_parser(prog: str = "run.py") -> argparse.ArgumentParser:
    """The flags of every setting (from the parts' metadata), ``--config`` and ``--list-rules``. Only flags
    actually given are in the parsed namespace: they override the YAML and the defaults."""
    parser = _Parser(
        prog=prog,
        description="Batched generation with Batch-Max (bm), extreme decoding-only (ed) or full-cache (fkv) "
        "KV caches. Settings layer: built-in defaults -> --config YAML -> these flags.",
        epilog=_main_job_help(),
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file with any of the keys below (underscores)")
    parser.add_argument("--list-rules", nargs=0, action=_ListRules, help="print the eviction rule names and exit")
    for _, part in PARTS:
        group = parser.add_argument_group(part.title)
        for _, s, key in part.settings():
            if s.flag != "":
                _add_setting(group, key, s)
    # Passed by the deepspeed / torch.distributed launchers; accepted and ignored (LOCAL_RANK env is used).
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None, prog: str = "run.py") -> RunConfig:
    """defaults -> ``--config`` YAML -> CLI flags, validated. Raises :class:`ConfigError` (one line)."""
    args = vars(build_parser(prog).parse_args(argv))
    args.pop("local_rank", None)
    config_path = args.pop("config", None)
    merged: dict[str, Any] = {}
    if config_path is not None:
        merged.update(_normalise_mapping(load_yaml(config_path), str(config_path)))
    if "methods" in args:
        methods = [m.strip() for item in args["methods"] for m in item.split(",") if m.strip()]
        if not methods:
            raise ConfigError("method", "--method needs a method name (bm, ed or fkv)")
        args["methods"] = methods
    merged.update(args)
    return RunConfig(**merged)
