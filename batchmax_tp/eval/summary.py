"""What a run's files say besides its measurements: the job's resolved configuration (``OUT/config.yaml``), a
run's settings and the memory part of its ``summary.json`` (the budget, the planner's prediction, the bytes of the
weights and the host memory this process holds).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..plan.budget import RunSpec
from ..plan.planner import MemoryEstimate, ModelShape
from .files import atomic_write_text, utc_now

if TYPE_CHECKING:  # only the configuration's type is named here (config/ sits below eval/)
    from ..config import RunConfig

__all__ = ["budget_fields", "model_shape", "peak_host_bytes", "run_settings", "weights_bytes", "write_config"]


def write_config(out: str | Path, cfg: RunConfig) -> None:
    """The resolved configuration as ``OUT/config.yaml`` (loadable again with ``--config``)."""
    header = (
        "# Resolved batchmax_tp run configuration (defaults -> --config YAML -> CLI flags).\n"
        f"# Written {utc_now()}. Re-run with: python launch/run.py --config <this file>\n"
    )
    atomic_write_text(Path(out) / "config.yaml", header + cfg.to_yaml())


def run_settings(cfg: RunConfig, spec: RunSpec, *, tp_size: int = 1, dp_size: int = 1) -> dict[str, Any]:
    """The settings part of a run's ``summary.json`` (everything but the measurements)."""
    return {
        "run": spec.name,
        "method": spec.method.name,
        "rule": spec.rule,
        "batch_size": spec.batch_size,
        "kv_max": spec.kv_max,
        "p": spec.method.p,
        "model": cfg.model.name,
        "task": cfg.data.task,
        "data": cfg.data.path,
        "num_shots": cfg.data.shots_for_task(),
        "metric": cfg.data.metric_for_task(),
        "max_input_tokens": cfg.data.max_input_tokens,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "ignore_eos": cfg.generation.ignore_eos,
        "do_sample": cfg.generation.do_sample,
        "seed": cfg.generation.seed,
        "dtype": cfg.model.dtype,
        "device": cfg.model.device,
        "tp_size": tp_size,
        "dp_size": dp_size,
    }


def model_shape(model: torch.nn.Module) -> ModelShape | None:
    """``planner.ModelShape`` of a loaded model (its text config), or None when it has no usable config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    try:
        return ModelShape.from_config(config)
    except (AttributeError, TypeError):
        return None


def weights_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of the parameters this process holds (after a tensor-parallel split: this rank's share)."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return None
    seen, total = set(), 0
    for p in params():
        if id(p) not in seen:  # tied weights count once
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def peak_host_bytes() -> int:
    """This process's peak resident host memory so far (loading included), in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def budget_fields(cfg: RunConfig, estimate: MemoryEstimate | None, model: torch.nn.Module | None = None) -> dict:
    """The memory part of a summary: the budget and the prediction (per rank), the bytes of the weights this
    process holds (``weights_bytes``; the planner's ``predicted.weights`` is its estimate) and this process's peak
    host memory (``peak_host_bytes``)."""
    return {
        "memory_budget_bytes": cfg.memory.budget_bytes(),
        "predicted_peak_bytes": None if estimate is None else estimate.total,
        "predicted": None if estimate is None else estimate.as_dict(),
        "weights_bytes": None if model is None else weights_bytes(model),
        "peak_host_bytes": peak_host_bytes(),
    }
