"""batchmax_tp: high-throughput batched LLM inference with KV-cache eviction in prefill and decoding (Batch-Max).

The public API, in one place::

    from batchmax_tp import Engine, Method, Request, Sampling, Batching, Record, run_prompts, generate, plan

- ``Method("bm", kv_max=512, p=64, rule="paper")``: what to keep (``core.method``; ``bm``, ``snap``, ``ed``, ``fkv``);
- ``Engine(model, method, slots).run([Request(ids, max_new_tokens)], Sampling(...))``: the one engine, one output
  per request (``core.engine``; ``Batching``: how requests share passes, ``Record``: what outputs keep);
- ``run_prompts(model, prompts, method, max_new_tokens, tokenizer=tok)``: prompts (text or token ids) in, one output
  per prompt out, served on the engine in the memory FKV would need (``api``);
- ``generate(model, input_ids, attention_mask, method, max_new_tokens)``: a left-padded batch as the paper's padded
  batch, Algorithm 1 (BM) or 3 (ED) on an unchanged Hugging Face causal LM (``bench.padded``);
- ``BatchMaxCache``: the bounded cache as a transformers ``Cache`` (``core.hf_cache``), for ``model.generate``;
- ``plan``: memory planning from shapes (``plan.predict``, ``plan.max_batch``, ``plan.ModelShape``).

``Method`` and ``plan`` import no torch; the rest load torch and transformers when first used, so that the command
line can reject a bad configuration before those load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import plan
from .core.method import Method

if TYPE_CHECKING:
    from .api import run_prompts
    from .bench.padded import generate
    from .core.engine import Engine
    from .core.hf_cache import BatchMaxCache
    from .core.requests import Batching, Record, Request, Sampling

__version__ = "0.1.0"
__all__ = [
    "Batching",
    "BatchMaxCache",
    "Engine",
    "Method",
    "Record",
    "Request",
    "Sampling",
    "generate",
    "plan",
    "run_prompts",
]


def __getattr__(name: str) -> object:
    """The torch-bound names of ``__all__`` on first use (they bring torch and transformers)."""
    if name == "BatchMaxCache":
        from .core.hf_cache import BatchMaxCache

        return BatchMaxCache
    if name == "Engine":
        from .core.engine import Engine

        return Engine
    if name == "generate":
        from .bench.padded import generate

        return generate
    if name in ("Batching", "Record", "Request", "Sampling"):
        from .core import requests

        return getattr(requests, name)
    if name == "run_prompts":
        from .api import run_prompts

        return run_prompts
    raise AttributeError(f"module 'batchmax_tp' has no attribute {name!r}")
