"""The runs: :class:`SweepConfig` (the methods at one batch size or the listed ``runs``, BM's rule and cache size,
batching) and the shape of one ``runs`` entry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.method import METHODS, Method, is_full_cache, make_method, method_type, takes_rule
from ..core.rules import get_rule
from ..core.step import COMPILE_MODES
from ..plan.budget import STORY_MAX_PROMPTS, RunSpec, story_methods
from .settings import (
    INT,
    LIST,
    MAX_BATCH,
    MAX_TOKENS,
    OPTIONAL_FLAG,
    OPTIONAL_INT,
    OPTIONAL_LIST,
    OPTIONAL_TEXT,
    TEXT,
    ConfigError,
    Part,
    setting,
)

SCHEDULERS = ("static", "continuous")  #: how prompts share the model's passes (``core.engine`` for continuous)
#: Keys of one entry of ``runs`` (``rule``: BM's eviction rule for that run; default the config's ``rule``).
RUN_KEYS = ("method", "batch_size", "kv_max", "rule")


def _validate_rule(rule: str, key: str) -> None:
    try:
        get_rule(rule)
    except ValueError as err:
        raise ConfigError(key, str(err)) from None


@dataclass(frozen=True)
class SweepConfig(Part):
    """The runs: the methods at one batch size (or the listed ``runs``), BM's rule and cache size, batching."""

    title: ClassVar[str] = "methods and runs"
    methods: list[str] = setting(
        ["fkv", "ed", "bm"],
        LIST,
        "method to run; repeat (or comma-separate) for several (default: fkv, ed, bm); with --procedure tune: the "
        "methods it chooses among (e.g. fkv,bm,snap; default bm); own parameters as NAME:key=value (fkv:block=0 "
        "fixed-capacity slots, snap:window=16)",
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
        "bm/ed/snap KV pairs per (sample, KV head) (default null: bm and snap 512, ed 2)",
        metavar="N|null",
        low=1,
        high=MAX_TOKENS,
        null="per-method default",
        lists=True,
    )
    p: int = setting(64, INT, "BM eviction amount / prefill block (default 64)", metavar="N", low=1, high=MAX_TOKENS)
    bm_chunk: int = setting(
        0,
        INT,
        "the main job's BM: prefill columns a pass in wide passes, several blocks of each row with each layer evicting "
        "before each (the same kept pairs; default 0: a block of each row a pass, the paper's passes)",
        metavar="N",
        low=0,
        high=MAX_TOKENS,
    )
    batch_size: int = setting(4, INT, "samples per batch (default 4)", metavar="N", low=1, high=MAX_BATCH, lists=True)
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
        "run the main job: FKV, ED, BM, BM with the best rule and snap each at its largest batch within FKV's memory "
        "at batch 4 (default: unless the configuration lists its runs)",
        off="run the methods (or runs) as given, at --batch-size",
    )
    max_prompts: int = setting(
        STORY_MAX_PROMPTS,
        INT,
        f"the main job: most prompts it fills its samples up to (its largest fitting batch, at most this; default "
        f"{STORY_MAX_PROMPTS}); lower it where each prompt costs minutes (long prompts on a CPU), which bounds the "
        "largest batch too",
        metavar="N",
        low=1,
        high=MAX_BATCH,
    )
    scheduler: str | None = setting(
        None,
        OPTIONAL_TEXT,
        "static: padded batches of --batch-size; continuous: --batch-size slots, each refilled as soon as its "
        "request ends (default null: continuous, static under a procedure, which plans static batches)",
        metavar="|".join(SCHEDULERS),
        choices=SCHEDULERS,
    )
    compile: str = setting(
        "auto",
        TEXT,
        "decode passes (either scheduler) eager (none), compiled whole with torch.compile (default: 1.19x faster steps "
        "for BM on a 2-core CPU, after 1-3 minutes of compiling), captured once as a CUDA graph and replayed "
        "(cudagraphs, CUDA only), or auto (cudagraphs on CUDA, none elsewhere)",
        metavar="|".join(COMPILE_MODES),
        choices=COMPILE_MODES,
    )
    prefill_budget: int | None = setting(
        None,
        OPTIONAL_INT,
        "continuous: prompt tokens prefilled between two decode steps (default null: no limit)",
        metavar="N|null",
        low=1,
        high=MAX_TOKENS,
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
        cls = METHODS.get(name.partition(":")[0])
        if cls is None or is_full_cache(cls.name):
            return None
        return self.kv_max if self.kv_max is not None else cls.default_kv_max

    def rule_for(self, name: str) -> str:
        """The eviction rule method ``name`` runs with: ``rule`` where it takes one (BM), else the paper's."""
        cls = METHODS.get(name.partition(":")[0])
        return self.rule if cls is not None and takes_rule(cls.name) else "paper"

    def method_specs(self) -> list[Method]:
        """One ``core.method.Method`` per entry of ``methods``; errors name the key that caused them."""
        specs = []
        for name in self.methods:
            try:
                specs.append(make_method(name, kv_max=self.kv_max_for(name), p=self.p, rule=self.rule_for(name)))
            except ValueError as err:
                key = self._blame(name)
                raise ConfigError(key, f"{err}{self._default_hint(name) if key != 'methods' else ''}") from None
        return specs

    def _default_hint(self, name: str) -> str:
        default = self.kv_max_for(name)
        if self.kv_max is not None or default is None:
            return ""
        return f" (kv_max null = the {name} default {default}; set kv_max explicitly)"

    def _blame(self, name: str) -> str:
        """Which key made ``Method(name, ...)`` fail, found by retrying with defaults (Method owns the rules)."""
        cls = METHODS.get(name.partition(":")[0])
        default = None if cls is None else cls.default_kv_max
        try:
            make_method(name, kv_max=default, p=64)
        except ValueError:
            return "methods"
        try:
            make_method(name, kv_max=default, p=self.p)
        except ValueError:  # p is too large for the default kv_max: kv_max is the fix only if set
            if self.kv_max is None:
                return "p"
            try:
                make_method(name, kv_max=self.kv_max, p=64)
            except ValueError:
                return "kv_max"
            return "p"
        return "kv_max"

    def story_methods(self, chosen: Sequence[str] | None = None) -> list[Method]:
        """The main job's methods: FKV, ED, the paper's BM, BM with the best rule and snap (``plan.budget``); with
        ``chosen`` (``methods`` as given to the main job), those of them whose method is named (``bm``: both BMs)."""
        methods = story_methods(self.kv_max_for, self.p, self.rule, self.bm_chunk)
        if chosen is None:
            return methods
        names = [m.name for m in methods]
        unknown = [c for c in chosen if c not in names]
        if unknown:
            raise ValueError(
                f"the main job chooses among {', '.join(dict.fromkeys(names))} (no own parameters): not "
                f"{', '.join(unknown)}"
            )
        chosen_methods = [m for m in methods if m.name in chosen]
        if all(m.evicts for m in chosen_methods):
            reference = next(m.name for m in methods if not m.evicts)
            raise ValueError(f"the main job's budget and ratios are FKV's: name {reference} among the methods")
        return chosen_methods

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
        elif rule != "paper" and not takes_rule(cls.name):
            raise ConfigError(f"{where}.rule", f"rule {rule!r} applies to method bm only, not {method!r}")
        try:  # method, rule and p are valid: what is left is the cache size
            return RunSpec(
                make_method(method, kv_max=self.kv_max_for(method) if kv_max is None else kv_max, p=self.p, rule=rule),
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH:
        raise ConfigError(f"{where}.batch_size", f"must be an integer from 1 to {MAX_BATCH}, got {batch_size!r}")
    if kv_max is not None and (
        isinstance(kv_max, bool) or not isinstance(kv_max, int) or not 1 <= kv_max <= MAX_TOKENS
    ):
        raise ConfigError(f"{where}.kv_max", f"must be an integer from 1 to {MAX_TOKENS} or null, got {kv_max!r}")
