"""The whole configuration: :class:`RunConfig` composing the parts (``PARTS``), its rules across parts, the main
job, and reading YAML (:func:`load_yaml`) / writing it back (:meth:`RunConfig.to_yaml`)."""

from __future__ import annotations

import difflib
import os
from dataclasses import MISSING, dataclass, field
from typing import Any

import yaml

from ..core.method import METHODS, BatchMax, Method, is_full_cache, takes_rule
from .memory import MemoryConfig
from .parts import DataConfig, GenerationConfig, ModelConfig, OutputConfig, ParallelConfig
from .settings import ConfigError, Part, Setting
from .sweep import SweepConfig

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
#: Every setting's built-in default by its YAML key.
DEFAULTS: dict[str, Any] = {
    key: f.default if f.default is not MISSING else f.default_factory()
    for _, part in PARTS
    for f, _, key in part.settings()
}


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

    @property
    def scheduler(self) -> str:
        """The scheduler the runs use: ``sweep.scheduler``, or by default continuous (unpadded; the main job measured
        about twice as fast for every method as with static batches, docs/performance.md), static under a procedure
        (it plans static batches)."""
        if self.sweep.scheduler is not None:
            return self.sweep.scheduler
        return "static" if self.memory.procedure is not None else "continuous"

    # -- rules across parts
    def _validate(self) -> None:
        procedure = self.memory.procedure
        if procedure is not None and self.sweep.scheduler == "continuous":
            raise ConfigError("scheduler", f"procedure {procedure} plans static batches: use scheduler static")
        if self.sweep.compile not in ("none", "auto") and self.scheduler != "continuous":
            raise ConfigError("compile", "compiles the continuous scheduler's decode passes: use scheduler continuous")
        if self.sweep.compile == "cudagraphs" and self.model.device == "cpu":
            raise ConfigError("compile", "cudagraphs captures CUDA graphs: it needs device cuda (or auto on a GPU)")
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
        self._refuse_unused()

    def _refuse_unused(self) -> None:
        """A setting this job would not read, set to a value other than its default, is refused with the reason (a
        saved ``OUT/config.yaml`` holds every key at its default where the job does not read it, so it still loads).
        """
        sweep, procedure = self.sweep, self.memory.procedure
        changed = {key for key, value in self.to_dict().items() if value != DEFAULTS[key]}

        def refuse(keys: tuple[str, ...], why: str) -> None:
            for key in keys:
                if key in changed:
                    raise ConfigError(key, why.format(key=key))

        if procedure is not None:
            refuse(
                ("batch_size", "kv_max") if procedure == "tune" else ("methods", "batch_size", "kv_max"),
                f"procedure {procedure} chooses its runs (FKV, ED and BM at kv_values) and their batches: {{key}} is "
                "unused; drop it (BM's kv_max values: kv_values"
                + ("; the methods tune chooses among: --method" if procedure == "tune" else "")
                + ")",
            )
            if procedure == "tune" and "methods" in changed:
                _refuse_untunable(sweep.methods)
        elif self.main_job:
            refuse(
                ("batch_size",),
                "the main job (same_memory) runs FKV, ED, BM, BM with the best rule and snap, each at its largest "
                "batch within the same memory: {key} is unused; drop it, or list the runs with --no-same-memory",
            )
        elif sweep.runs is not None:
            refuse(("methods", "batch_size"), "runs lists each run's method and batch_size: {key} is unused; drop it")
        if procedure is None and not self.main_job:
            self._refuse_unused_by_runs(changed)
        if not self.main_job:
            refuse(("max_prompts",), "the prompts the main job fills its samples up to: unused outside the main job")
        if "prefill_budget" in changed and self.scheduler == "static":
            raise ConfigError(
                "prefill_budget",
                "static batches prefill every prompt of a batch at once: it applies to scheduler continuous",
            )
        if procedure is None:
            refuse(("kv_values",), "the BM kv_max values the procedures try: unused without procedure paper or tune")
        if procedure != "tune":
            refuse(("target",), "the goal of the tuner: unused without procedure tune")
            refuse(("cheaper_rules",), "the tuner's candidates: unused without procedure tune")

    def _refuse_unused_by_runs(self, changed: set[str]) -> None:
        """``rule`` when no listed run is BM without its own rule; ``kv_max`` when no listed run evicts without its own
        kv_max (a ``runs`` entry's own rule or kv_max is checked with the entry)."""
        sweep = self.sweep
        if sweep.runs is None:
            listed = [(name, None, None) for name in sweep.methods]
        else:
            listed = [(e["method"], e.get("rule"), e.get("kv_max")) for e in sweep.runs]
        names = ", ".join(dict.fromkeys(name for name, _, _ in listed))
        if "rule" in changed and not any(takes_rule(m) and rule is None for m, rule, _ in listed):
            raise ConfigError(
                "rule", f"rule {sweep.rule!r} applies to method bm only, and no listed run takes it (runs: {names})"
            )
        if "kv_max" in changed and not any(not is_full_cache(m) and kv is None for m, _, kv in listed):
            raise ConfigError(
                "kv_max", f"applies to ed and bm (fkv keeps every pair), and no listed run takes it (runs: {names})"
            )

    def _validate_main_job(self) -> None:
        """The main job runs FKV, ED, the paper's BM, BM with the best rule and snap (or those ``methods`` names, when
        given): each must run with ``kv_max`` and ``p``."""
        try:
            self.sweep.story_methods()
        except ValueError as err:
            key = "kv_max" if self.sweep.kv_max is not None else "p"
            raise ConfigError(
                key, f"the same-memory run (FKV, ED, BM, BM with the best rule, snap) cannot use it: {err}"
            ) from None
        try:
            self.main_job_methods()
        except ValueError as err:
            raise ConfigError("methods", str(err)) from None

    def main_job_methods(self) -> list[Method]:
        """The main job's methods (``SweepConfig.story_methods``): all five, or those whose method ``methods`` names
        when it is given (``--method fkv,bm,snap``: no ED, and so no paper's setting beside them)."""
        return self.sweep.story_methods(self.sweep.methods if "methods" in self.given else None)

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
        """The flat keys as YAML (``OUT/config.yaml``), loadable again with ``--config`` into the same job: the main
        job's leaves out ``batch_size`` (it does not read it, and given it would list the runs) and ``methods`` unless
        given (then it chooses the main job's methods, with ``same_memory: true``). Both are neutral in the resume key
        (``eval.results.check_same_config``), so results written before still resume.
        """
        data = self.to_dict()
        if self.main_job:
            del data["batch_size"]
            if "methods" not in self.given:
                del data["methods"]
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)

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


def _refuse_untunable(methods: list[str]) -> None:
    """ConfigError for a method ``--procedure tune`` cannot pick: one that keeps the newest pair alone (ED), whose
    first decode step drops the prompt whatever its kv_max, so no kv_max of the grid buys it answers."""
    names = [m.partition(":")[0] for m in methods]
    refused = [n for n in names if n in METHODS and METHODS[n].keeps_newest]
    if refused:
        picks = [n for n, kind in METHODS.items() if not kind.keeps_newest]
        among = f"{', '.join(picks[:-1])} and {picks[-1]}"
        raise ConfigError("methods", f"procedure tune chooses among {among}: {', '.join(refused)} is not one to pick")


def _check_keys(data: dict[str, Any], source: str) -> None:
    for key in data:
        if key not in SETTINGS:
            known = list(SETTINGS)
            underscored = str(key).replace("-", "_")
            close = [underscored] if underscored in known else difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
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
