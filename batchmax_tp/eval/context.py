"""What a run is given and what it holds: :class:`RunContext` (what every run of a job shares: the model, where
this process sits, the collectives, the engine, the planning inputs) and :class:`OpenRun` (one run in
progress: its spec, its folder and this replica's shard, its batches, the planner's peak)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.engine import Engine
from ..core.method import Method
from ..core.requests import Batching
from ..parallel import Layout
from ..plan.budget import RunSpec
from ..plan.planner import MemoryEstimate, ModelShape
from . import generation, results
from .collectives import Collectives
from .generation import EncodeFn
from .summary import budget_fields, run_settings
from .tasks import Sample

if TYPE_CHECKING:  # only the configuration's type is named here (config/ sits below eval/)
    from ..config import RunConfig

__all__ = ["OpenRun", "RunContext"]


@dataclass
class RunContext:
    """What every run of a job shares: the model and its tokenizer; where this process sits (``layout``; None: one
    process) and the job's collectives (``comm``; default: those of ``layout`` alone); the engine and the encoder
    (``engine_fn``, ``encode_fn``: ``core.engine.Engine`` and ``generation.encode_prompts`` unless given, e.g. test
    doubles; looked up at call time); the planning inputs (``prompt_len``: the longest encoded prompt of the samples,
    ``shape``: the model's ``planner.ModelShape``; found per run when None); ``progress``: show a bar (default: on
    rank 0)."""

    model: Any
    tokenizer: Any
    layout: Layout | None = None
    comm: Collectives | None = None
    engine_fn: Callable[..., Engine] | None = None
    encode_fn: EncodeFn | None = None
    prompt_len: int | None = None
    shape: ModelShape | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = Collectives(self.layout)

    def engine(self, method: Method, slots: int, compile: str, batching: Batching = Batching()) -> Engine:
        """The engine every pass of a run goes through (both policies, and the warm-up): ``slots`` slots of
        ``method`` over the model, with its tensor-parallel group (so that ``auto`` never captures a
        tensor-parallel pass and every rank takes the first rank's tokens)."""
        make = self.engine_fn or Engine
        group = getattr(self.model, "batchmax_tp_group", None)
        return make(self.model, method, slots, tp_group=group, compile=compile, batching=batching)

    @property
    def encode(self) -> EncodeFn:
        return self.encode_fn or generation.encode_prompts

    @property
    def is_main(self) -> bool:
        return self.layout is None or self.layout.is_main

    @property
    def dp(self) -> int:
        return 1 if self.layout is None else self.layout.dp

    @property
    def tp(self) -> int:
        return 1 if self.layout is None else self.layout.tp

    @property
    def replica(self) -> int:
        return 0 if self.layout is None else self.layout.replica

    @property
    def lead(self) -> bool:
        """Whether this rank writes its replica's shard (the replica's tensor-parallel rank 0)."""
        return self.layout is None or self.layout.tp_rank == 0


@dataclass
class OpenRun:
    """One run in progress: its spec and configuration, its folder and this replica's shard of it, its batches
    (one sample each under the continuous scheduler: each is done and resumed alone) and the planner's peak."""

    spec: RunSpec
    cfg: RunConfig
    folder: Path
    shard: results.RunLog
    batches: list[list[Sample]]
    continuous: bool
    extra: dict[str, Any]
    estimate: MemoryEstimate | None = None

    @property
    def batch_ids(self) -> list[list[str]]:
        return [[s.id for s in batch] for batch in self.batches]

    def head(self, ctx: RunContext) -> dict[str, Any]:
        """What the run's summary says besides its measurements (``results.merge_run``)."""
        return {
            "settings": run_settings(self.cfg, self.spec, tp_size=ctx.tp, dp_size=ctx.dp),
            "batch_ids": self.batch_ids,
            "dp": ctx.dp,
            "tp": ctx.tp,
            "continuous": self.continuous,
            "budget": budget_fields(self.cfg, self.estimate, ctx.model),
            "extra": self.extra,
        }
