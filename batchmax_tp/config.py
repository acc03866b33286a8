"""Run configuration: one validated dataclass, layered defaults -> YAML (``--config FILE``) -> CLI flags.

YAML keys use underscores (``batch_size``), CLI flags use dashes (``--batch-size``). Every problem is reported
as a :class:`ConfigError` with a one-line message that starts with the offending key, e.g.
``kv_max: kv_max must be > p for method 'bm', got kv_max=64 p=64``.

Validation needs only torch-free modules (``core.method``, ``core.rules``, ``plan.planner``, ``eval.tasks``), so a
bad setting is reported in a fraction of a second, before torch or transformers load; nothing here loads a model or
writes a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from .core.method import Method
from .core.rules import get_rule, rule_names
from .embedded import EMBEDDED_MODEL  # re-exported (__all__): the default model
from .eval.metrics import METRICS
from .eval.tasks import TASK_NAMES, TASKS
from .plan.budget import RunSpec, story_methods
from .plan.planner import parse_bytes

__all__ = [
    "ConfigError",
    "EMBEDDED_MODEL",
    "RunConfig",
    "DEFAULT_KV_MAX",
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

#: Per-method cache size used when ``kv_max`` is null (fkv has none).
DEFAULT_KV_MAX: dict[str, int | None] = {"bm": 512, "ed": 2, "fkv": None}
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


#: The python types a setting's annotation names (``float`` settings take ints too; bool is never an int here).
_BASE_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "list": (list,),
}


def _field_types(annotation: str) -> tuple[tuple[type, ...], bool]:
    """(accepted types, nullable) of a ``RunConfig`` field from its annotation, e.g. ``str | int | None``."""
    parts = [part.strip() for part in annotation.split("|")]
    types = tuple(t for part in parts if part != "None" for t in _BASE_TYPES[part.split("[")[0]])
    return types, "None" in parts


#: Lowest value of each integer setting, and what null means where it is allowed (top_k 0 = disabled, setup_timeout
#: in seconds).
_LOWEST: dict[str, tuple[int, str | None]] = {
    "batch_size": (1, None),
    "max_new_tokens": (1, None),
    "num_samples": (1, "all"),
    "kv_max": (1, "per-method default"),
    "top_k": (0, None),
    "tp_size": (1, "the world size"),
    "dp_size": (1, "world size / tp_size"),
    "setup_timeout": (1, None),
    "prefill_budget": (1, "no limit"),
}

_TYPE_NAMES = {str: "a string", list: "a list", int: "an integer", bool: "a boolean (true/false)"}


def _type_name(types: tuple[type, ...], nullable: bool) -> str:
    if str in types and int in types:
        name = "a byte size (e.g. 24GiB, 512MiB or 1000000)"
    else:
        name = "a number" if float in types else _TYPE_NAMES[types[0]]
    return f"{name} or null" if nullable else name


def _check_type(key: str, value: Any) -> None:
    types, nullable = _field_types(_ANNOTATIONS[key])
    if value is None:
        if nullable:
            return
        raise ConfigError(key, f"must be {_type_name(types, nullable)}, got null")
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise ConfigError(key, f"must be {_type_name(types, nullable)}, got {type(value).__name__} {value!r}")


@dataclass
class RunConfig:
    """Everything one ``launch/run.py`` invocation needs. Construction validates (raises :class:`ConfigError`)."""

    model: str | None = None  #: HF model id or local path; null -> :data:`EMBEDDED_MODEL`
    methods: list[str] = field(default_factory=lambda: ["fkv", "ed", "bm"])
    rule: str = "paper"  #: BM's eviction rule (``core.rules``; ``name`` or ``name:key=value,...``)
    kv_max: int | None = None  #: bm/ed cache size per (sample, KV head); null -> DEFAULT_KV_MAX
    p: int = 64  #: BM eviction amount / prefill block size
    batch_size: int = 4
    max_new_tokens: int = 64
    ignore_eos: bool = True  #: always generate max_new_tokens (throughput runs)
    data: str | None = None  #: JSONL path; null -> the embedded fixture
    num_samples: int | None = None  #: first N samples of the file; null -> all
    out: str = "results/main"
    dtype: str = "auto"  #: auto = float32 on CPU; CUDA: float16 for float16 checkpoints, else bf16 on GPUs >= 8.0
    device: str = "auto"  #: auto = cuda if available, else cpu
    seed: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  #: 0 = disabled
    top_p: float = 1.0
    log_level: str = "INFO"
    tp_size: int | None = None  #: ranks per tensor-parallel group; null = the world size; dp = world / tp_size
    dp_size: int | None = (
        None  #: data-parallel replicas; null = world / tp_size (a value must equal it: the resume key)
    )
    setup_timeout: int = 1800  #: seconds the ranks may wait for each other while loading and setting up
    #: FKV, ED, BM and BM with the best rule, each at its largest batch within FKV's memory at batch 4 (not for
    #: sweeps); null = only for a plain ``python launch/run.py`` without arguments
    same_memory: bool | None = None
    task: str = "jsonl"  #: jsonl (``data`` = a JSONL file) or a paper task (``data`` = hub id or folder)
    num_shots: int | None = None  #: null = the paper's count (CNN/DM 1, NarrativeQA 2, GSM8K 16; jsonl 0)
    max_input_tokens: int | None = 3584  #: prompts of paper tasks are cut (in the document) to this many tokens
    metric: str | None = None  #: null = the task's (jsonl: contains)
    runs: list[dict[str, Any]] | None = None  #: sweep entries {method, batch_size, kv_max}; null = methods x b
    memory_budget: str | int | None = None  #: peak bytes per rank a run may need (planner); over it = an OOM row
    procedure: str | None = None  #: null = the runs as listed; paper = the paper's b0 procedure; tune = auto-tuner
    kv_values: list[int] | None = None  #: BM kv_max values for the procedures; null = tuner.kv_grid(prompt, rule)
    target: float = 0.95  #: tune: the BM metric must reach target x FKV's
    #: static: batches of batch_size prompts, padded, decoded together; continuous: batch_size slots, a request
    #: enters a slot as soon as one frees (``core.serve``)
    scheduler: str = "static"
    prefill_budget: int | None = None  #: continuous: prompt tokens prefilled between decode steps; null = no limit

    def __post_init__(self) -> None:
        if isinstance(self.methods, str):
            self.methods = [self.methods]
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name))
        if isinstance(self.temperature, int):
            self.temperature = float(self.temperature)
        if isinstance(self.top_p, int):
            self.top_p = float(self.top_p)
        if isinstance(self.target, int):
            self.target = float(self.target)
        self.log_level = self.log_level.upper()
        if self.model is None:
            self.model = EMBEDDED_MODEL
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        if not self.model.strip():
            raise ConfigError("model", "must not be empty")
        if not self.methods:
            raise ConfigError("methods", "must name at least one method")
        for m in self.methods:
            if not isinstance(m, str):
                raise ConfigError("methods", f"entries must be strings, got {type(m).__name__} {m!r}")
        dup = sorted({m for m in self.methods if self.methods.count(m) > 1})
        if dup:
            raise ConfigError("methods", f"duplicate method(s) {', '.join(dup)}")
        self._validate_rule(self.rule, "rule")
        for key, (low, null) in _LOWEST.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ConfigError(key, f"must be >= {low}{f' or null ({null})' if null else ''}, got {value}")
        for key, choices in (("dtype", DTYPES), ("log_level", LOG_LEVELS), ("scheduler", SCHEDULERS)):
            if getattr(self, key) not in choices:
                raise ConfigError(key, f"must be one of {', '.join(choices)}, got {getattr(self, key)!r}")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.temperature <= 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.out.strip():
            raise ConfigError("out", "must not be empty")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ConfigError("out", f"exists and is not a directory: {self.out}")
        self._validate_task()
        self._validate_budget()
        if self.runs is None:
            self.method_specs()  # the method rules live in core.method.Method; check them now, before any model loads
        else:
            self.run_specs()
        if self.same_memory:
            self._validate_story()

    @staticmethod
    def _validate_rule(rule: str, key: str) -> None:
        try:
            get_rule(rule)
        except ValueError as err:
            raise ConfigError(key, str(err)) from None

    def _validate_story(self) -> None:
        """``same_memory: true`` runs FKV, ED, the paper's BM and BM with the best rule (``plan.budget.story_methods``,
        whatever ``methods`` says): each must run with ``kv_max`` and ``p``."""
        try:
            story_methods({"ed": self.kv_max_for("ed"), "bm": self.kv_max_for("bm")}, self.p, self.rule)
        except ValueError as err:
            raise ConfigError(
                "kv_max", f"the same-memory run (FKV, ED, BM, BM with the best rule) cannot use it: {err}"
            ) from None

    def rule_for(self, method: str) -> str:
        """The eviction rule ``method`` runs with: ``rule`` for bm, the paper's (the only one) for ed/fkv."""
        return self.rule if method == "bm" else "paper"

    def _validate_task(self) -> None:
        if self.task not in TASK_NAMES:
            raise ConfigError("task", f"must be one of {', '.join(TASK_NAMES)}, got {self.task!r}")
        if self.metric is not None and self.metric not in METRICS:
            raise ConfigError("metric", f"must be one of {', '.join(METRICS)} or null, got {self.metric!r}")
        if self.num_shots is not None and self.num_shots < 0:
            raise ConfigError("num_shots", f"must be >= 0 or null (the paper's count), got {self.num_shots}")
        if self.task == "jsonl" and self.num_shots:
            raise ConfigError("num_shots", "JSONL prompts have no shots; num_shots is for the paper's tasks")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ConfigError("max_input_tokens", f"must be >= 1 or null (no limit), got {self.max_input_tokens}")
        if self.data is None:
            return
        if self.task == "jsonl":
            if not os.path.isfile(self.data):
                raise ConfigError("data", f"file not found: {self.data}")
        elif not os.path.isdir(self.data) and (os.path.exists(self.data) or not _HUB_ID_RE.match(self.data)):
            raise ConfigError(
                "data",
                f"task {self.task} needs a hub id (owner/name) or a folder with train.jsonl and "
                f"test.jsonl, got {self.data!r}",
            )

    def _validate_budget(self) -> None:
        self.budget_bytes()  # raises ConfigError("memory_budget: ...")
        if self.procedure is not None and self.procedure not in PROCEDURES:
            raise ConfigError("procedure", f"must be one of {', '.join(PROCEDURES)} or null, got {self.procedure!r}")
        if self.procedure is not None and self.scheduler == "continuous":
            raise ConfigError("scheduler", f"procedure {self.procedure} plans static batches: use scheduler static")
        if self.procedure is not None and self.memory_budget is None:
            raise ConfigError(
                "memory_budget",
                f"procedure {self.procedure} needs a memory budget per rank "
                "(e.g. memory_budget: 24GiB or --memory-budget 24GiB)",
            )
        if not self.target > 0:
            raise ConfigError("target", f"must be > 0 (a fraction of FKV's metric, e.g. 0.95), got {self.target}")
        if self.kv_values is not None:
            if not self.kv_values:
                raise ConfigError("kv_values", "must list at least one kv_max, or be null (multiples of 128)")
            for k in self.kv_values:
                if isinstance(k, bool) or not isinstance(k, int):
                    raise ConfigError("kv_values", f"entries must be integers, got {k!r}")
                try:  # each entry is a BM run with the configured rule (Method owns the rules)
                    Method("bm", kv_max=k, p=self.p, rule=self.rule_for("bm"))
                except ValueError as err:
                    raise ConfigError("kv_values", f"BM cannot run with kv_max={k}: {err}") from None
            if len(set(self.kv_values)) != len(self.kv_values):
                raise ConfigError("kv_values", f"duplicate values in {self.kv_values}")

    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None without a budget)."""
        if self.memory_budget is None:
            return None
        try:
            value = parse_bytes(self.memory_budget)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise ConfigError(
                "memory_budget",
                f"cannot read a positive byte size from {self.memory_budget!r} "
                "(examples: 24GiB, 512MiB, 1.5GB, 1000000)",
            )
        return value

    # ------------------------------------------------------------------ tasks
    def same_memory_for(self, argv: Sequence[str] | None) -> bool:
        """Whether this run is the same-memory comparison (``plan.budget.same_memory_plan``): the ``same_memory``
        key when set; otherwise only a plain ``python launch/run.py`` (``argv`` empty) is. Never with ``runs`` or a
        procedure, which list their own runs."""
        if self.runs is not None or self.procedure is not None:
            return False
        if self.same_memory is not None:
            return self.same_memory
        return argv is not None and len(argv) == 0

    def shots_for_task(self) -> int:
        """``num_shots``, or the paper's count for the task (0 for jsonl)."""
        if self.num_shots is not None:
            return self.num_shots
        if self.task == "jsonl":
            return 0
        return TASKS[self.task].shots

    def metric_for_task(self) -> str:
        """``metric``, or the task's (CNN/DM and NarrativeQA rouge2, GSM8K accuracy, jsonl contains)."""
        if self.metric is not None:
            return self.metric
        if self.task == "jsonl":
            return "contains"
        return TASKS[self.task].metric

    def run_specs(self) -> list[RunSpec]:
        """The listed runs (``plan.budget.RunSpec``): the ``runs`` entries, or each of ``methods``
        at ``batch_size``. Errors name the entry, e.g. ``runs[2].kv_max: ...``."""
        if self.runs is None:
            return [RunSpec(method, self.batch_size) for method in self.method_specs()]
        if not self.runs:
            raise ConfigError("runs", "must list at least one run, or be null (methods x batch_size)")
        specs, names = [], {}
        for i, entry in enumerate(self.runs):
            where = f"runs[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(
                    where, f"must be a mapping like {{method: bm, batch_size: 8, kv_max: 512}}, got {entry!r}"
                )
            for key in entry:
                if key not in RUN_KEYS:
                    raise ConfigError(f"{where}.{key}", f"unknown key; a run has {', '.join(RUN_KEYS)}")
            for key in ("method", "batch_size"):
                if key not in entry:
                    raise ConfigError(f"{where}.{key}", "missing")
            method, batch_size, kv_max = entry["method"], entry["batch_size"], entry.get("kv_max")
            rule = entry.get("rule")
            if rule is not None:
                if not isinstance(rule, str):
                    raise ConfigError(f"{where}.rule", f"must be a string, got {rule!r}")
                self._validate_rule(rule, f"{where}.rule")
                if method != "bm" and rule != "paper":
                    raise ConfigError(f"{where}.rule", f"rule {rule!r} applies to method bm only, not {method!r}")
            else:
                rule = self.rule_for(method)
            if not isinstance(method, str):
                raise ConfigError(f"{where}.method", f"must be a string, got {method!r}")
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ConfigError(f"{where}.batch_size", f"must be an integer >= 1, got {batch_size!r}")
            if kv_max is not None and (isinstance(kv_max, bool) or not isinstance(kv_max, int) or kv_max < 1):
                raise ConfigError(f"{where}.kv_max", f"must be an integer >= 1 or null, got {kv_max!r}")
            if kv_max is None:
                kv_max = self.kv_max_for(method)
            try:
                spec = RunSpec(Method(method, kv_max=kv_max, p=self.p, rule=rule), batch_size)
            except ValueError as err:
                key = (
                    "method"
                    if "unknown method" in str(err)
                    else "p"
                    if str(err).startswith("p ")
                    else "rule"
                    if "rule" in str(err) and "protects" not in str(err)
                    else "kv_max"
                )
                raise ConfigError(f"{where}.{key}", str(err)) from None
            if spec.name in names:
                raise ConfigError(where, f"the same run as runs[{names[spec.name]}] ({spec.name})")
            names[spec.name] = i
            specs.append(spec)
        return specs

    # ------------------------------------------------------------------ methods
    def kv_max_for(self, name: str) -> int | None:
        """The cache size method ``name`` runs with: ``kv_max`` if set (bm/ed), else the per-method default."""
        if name == "fkv":
            return None
        return self.kv_max if self.kv_max is not None else DEFAULT_KV_MAX.get(name)

    def method_specs(self) -> list[Method]:
        """One ``core.method.Method`` per entry of ``methods``; errors name the key that caused them."""
        specs = []
        for name in self.methods:
            try:
                specs.append(Method(name, kv_max=self.kv_max_for(name), p=self.p, rule=self.rule_for(name)))
            except ValueError as err:
                hint = ""
                if self.kv_max is None and DEFAULT_KV_MAX.get(name) is not None and self._p_alone_ok():
                    hint = f" (kv_max null = the {name} default {DEFAULT_KV_MAX[name]}; set kv_max explicitly)"
                raise ConfigError(self._blame(name), f"{err}{hint}") from None
        return specs

    def _p_alone_ok(self) -> bool:
        try:
            Method("fkv", p=self.p)
        except ValueError:
            return False
        return True

    def _blame(self, name: str) -> str:
        """Which key made ``Method(name, ...)`` fail, found by retrying with defaults (Method owns the rules)."""
        try:
            Method(name, kv_max=DEFAULT_KV_MAX.get(name), p=64)
        except ValueError:
            return "methods"
        try:
            Method(name, kv_max=DEFAULT_KV_MAX.get(name), p=self.p)
        except ValueError:
            # p alone is invalid, or p is too large for the default kv_max (then kv_max is the fix only if set).
            if self.kv_max is None:
                return "p"
            try:
                Method(name, kv_max=self.kv_max, p=64)
            except ValueError:
                return "kv_max"
            return "p"
        return "kv_max"

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> RunConfig:
        """Build from a YAML-style mapping (unknown keys rejected; ``method: bm`` is accepted for one method)."""
        return cls(**_normalise_mapping(data, source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> RunConfig:
        return cls.from_dict(load_yaml(path), source=str(path))


#: Each setting's annotation: the one statement of its type (checked by ``_check_type``).
_ANNOTATIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}


def _normalise_mapping(data: Any, source: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{source}: top level must be a mapping of keys, got {type(data).__name__}")
    data = dict(data)
    known = RunConfig.keys()
    for key in data:
        if key == "method":
            continue
        if key not in known:
            hint = f" (did you mean {key.replace('-', '_')}?)" if key.replace("-", "_") in known else ""
            raise ConfigError(str(key), f"unknown key in {source}{hint}; known keys: method, {', '.join(known)}")
    if "method" in data:
        if "methods" in data:
            raise ConfigError("method", f"give either method or methods in {source}, not both")
        method = data.pop("method")
        if not isinstance(method, str):
            raise ConfigError("method", f"must be a string (use methods: [...] for several), got {method!r}")
        data["methods"] = [method]
    for key, value in data.items():
        if key == "methods" and isinstance(value, str):
            continue
        _check_type(key, value)
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


def _bool_flag(parser: argparse.ArgumentParser, name: str, help: str, no_help: str) -> None:
    dest = name.replace("-", "_")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(f"--{name}", dest=dest, action="store_true", default=argparse.SUPPRESS, help=help)
    group.add_argument(f"--no-{name}", dest=dest, action="store_false", default=argparse.SUPPRESS, help=no_help)


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
    """``--memory-budget``: null, a plain integer (bytes) or a size with a unit (checked by RunConfig)."""
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


class _ListRules(argparse.Action):
    """``--list-rules``: print the rule names (one per line) and exit 0, like ``--help``."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = rule_names()
        parser._print_message("\n".join(names) + "\n", sys.stdout)
        parser.exit(0)


def build_parser(prog: str = "run.py") -> argparse.ArgumentParser:
    S = argparse.SUPPRESS  # only flags actually given override the YAML / defaults
    p = _Parser(
        prog=prog,
        description="Batched generation with Batch-Max (bm), extreme decoding-only (ed) or full-cache (fkv) "
        "KV caches. Settings layer: built-in defaults -> --config YAML -> these flags.",
        argument_default=S,
        allow_abbrev=False,
    )
    p.add_argument("--config", metavar="FILE", help="YAML file with any of the keys below (underscores)")
    p.add_argument("--model", help="HF model id or local path (default: the embedded SmolLM2)")
    p.add_argument(
        "--method",
        dest="methods",
        action="append",
        metavar="{bm,ed,fkv}",
        help="method to run; repeat (or comma-separate) for several (default: fkv, ed, bm)",
    )
    p.add_argument(
        "--rule",
        metavar="NAME",
        help="BM's eviction rule (default paper; --list-rules names them; parameters as "
        "NAME:key=value,..., e.g. snapkv:window=64)",
    )
    p.add_argument("--list-rules", nargs=0, action=_ListRules, help="print the eviction rule names and exit")
    p.add_argument(
        "--kv-max",
        type=_int_or_null,
        metavar="N|null",
        help="bm/ed KV pairs per (sample, KV head) (default null: bm 512, ed 2)",
    )
    p.add_argument("--p", type=int, metavar="N", help="BM eviction amount / prefill block (default 64)")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples per batch (default 4)")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate per sample (default 64)")
    _bool_flag(
        p,
        "ignore-eos",
        "always generate --max-new-tokens, past EOS (default; throughput runs)",
        "stop a sample at its first EOS",
    )
    p.add_argument("--data", metavar="JSONL", help="samples file (default: the embedded fixture)")
    p.add_argument(
        "--num-samples",
        type=_int_or_null,
        metavar="N|null",
        help="use N samples drawn with --seed (the same for every run), kept in file order (default null: all)",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (default results/main)")
    p.add_argument(
        "--dtype",
        metavar="|".join(DTYPES),
        help="model dtype (default auto: float32 on CPU; on CUDA float16 for a float16 checkpoint, else "
        "bfloat16 on GPUs of compute capability >= 8.0 and float16 below)",
    )
    p.add_argument(
        "--device",
        metavar="auto|cpu|cuda|cuda:N",
        help="default auto = cuda if available (multi-process runs: the local rank's GPU)",
    )
    p.add_argument("--seed", type=int, metavar="N", help="random seed (default 0)")
    _bool_flag(
        p,
        "do-sample",
        "sample (--temperature, --top-k, --top-p) instead of greedy decoding",
        "greedy decoding (default)",
    )
    _bool_flag(
        p,
        "same-memory",
        "run FKV, ED, BM and BM with the best rule each at its largest batch within FKV's "
        "memory at batch 4 (default: only a plain run without arguments)",
        "run the methods (or runs) as given, at --batch-size",
    )
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, metavar="K", help="top-k sampling, 0 = off (default 0)")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling, 1.0 = off (default 1.0)")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ... (default INFO)")
    p.add_argument(
        "--tp-size",
        type=_int_or_null,
        metavar="N|null",
        help="tensor-parallel ranks per model replica (default null: every process of the launch splits "
        "one model); data-parallel replicas = world size / N",
    )
    p.add_argument(
        "--dp-size",
        type=_int_or_null,
        metavar="N|null",
        help="data-parallel replicas (default null: world size / tp_size); a value must equal it",
    )
    p.add_argument(
        "--setup-timeout",
        type=int,
        metavar="S",
        help="seconds ranks wait for each other while loading (default 1800); generation collectives "
        "time out after 60 s",
    )
    p.add_argument(
        "--task",
        metavar="|".join(TASK_NAMES),
        help="jsonl (--data = a JSONL file; default) or a paper task (--data = hub id or folder)",
    )
    p.add_argument(
        "--num-shots",
        type=_int_or_null,
        metavar="N|null",
        help="few-shot examples (default null: CNN/DM 1, NarrativeQA 2, GSM8K 16)",
    )
    p.add_argument(
        "--max-input-tokens",
        type=_int_or_null,
        metavar="N|null",
        help="cut paper-task prompts to N tokens, in the document only (default 3584)",
    )
    p.add_argument("--metric", metavar="|".join(METRICS), help="default: the task's (jsonl: contains)")
    p.add_argument(
        "--memory-budget",
        type=_int_or_text,
        metavar="BYTES",
        help="peak memory per rank a run may need, e.g. 24GiB (planner prediction; over it = OOM row)",
    )
    p.add_argument(
        "--procedure",
        type=_null_or_text,
        metavar="paper|tune|null",
        help="paper: the paper's b0 procedure (launch/sweep.py); tune: the auto-tuner (launch/tune.py)",
    )
    p.add_argument(
        "--kv-values",
        type=_int_list,
        metavar="K1,K2,...|null",
        help="BM kv_max values the procedures try (default: multiples of 128 below the longest prompt)",
    )
    p.add_argument("--target", type=float, metavar="T", help="tune: BM's metric must reach T x FKV's (default 0.95)")
    p.add_argument(
        "--scheduler",
        metavar="|".join(SCHEDULERS),
        help="static: padded batches of --batch-size; continuous: --batch-size slots, each refilled as "
        "soon as its request ends (default static)",
    )
    p.add_argument(
        "--prefill-budget",
        type=_int_or_null,
        metavar="N|null",
        help="continuous: prompt tokens prefilled between two decode steps (default null: no limit)",
    )
    # Passed by the deepspeed / torch.distributed launchers; accepted and ignored (LOCAL_RANK env is used).
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, help=S)
    return p


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
