"""The memory budget per rank and the procedures that choose runs within it: :class:`MemoryConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..plan.planner import parse_bytes
from .settings import BYTES, FLAG, INT_LIST, MAX_TOKENS, NULL_OR_TEXT, NUMBER, ConfigError, Part, setting

#: ``procedure`` values: the paper's batch-size procedure (section 4.1) and the auto-tuner
#: (``batchmax_tp.eval.procedures``).
PROCEDURES = ("paper", "tune")
MAX_BUDGET = 2**60  #: the largest memory_budget read (1 EiB)


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
    target: float = setting(
        0.95, NUMBER, "tune: BM's metric must reach T x FKV's, 0 < T <= 1 (default 0.95)", metavar="T", high=1.0
    )
    cheaper_rules: bool = setting(
        True,
        FLAG,
        "tune: also try the rule's cheaper settings as candidates of their own (question: every=8, window=16; default)",
        off="tune: try the rule as given only",
    )

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
            if not 1 <= k <= MAX_TOKENS:
                raise ConfigError("kv_values", f"entries must be from 1 to {MAX_TOKENS}, got {k}")

    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None without a budget)."""
        if self.budget is None:
            return None
        try:
            value = parse_bytes(self.budget)
        except (ValueError, OverflowError):  # OverflowError: inf
            value = None
        if value is None or value <= 0:
            raise ConfigError(
                "memory_budget",
                f"cannot read a positive byte size from {self.budget!r} (examples: 24GiB, 512MiB, 1.5GB, 1000000)",
            )
        if value > MAX_BUDGET:
            raise ConfigError("memory_budget", f"{self.budget!r} is more than 1 EiB per rank")
        return value
