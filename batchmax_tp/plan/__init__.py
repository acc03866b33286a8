"""Planning from shapes alone (no torch): memory predictions, batch sizes under a budget, the paper's procedure.

``planner`` (peak memory per rank of a run), ``tuner`` (the paper's b0 plan and the auto-tuner's search) and
``budget`` (runs and the plans that choose their batch sizes).
"""

from .planner import (
    MemoryEstimate,
    ModelShape,
    max_batch,
    max_prompt_len,
    max_slots,
    parse_bytes,
    predict,
    predict_pool,
)

__all__ = [
    "MemoryEstimate",
    "ModelShape",
    "max_batch",
    "max_prompt_len",
    "max_slots",
    "parse_bytes",
    "predict",
    "predict_pool",
]
