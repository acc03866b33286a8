"""batchmax_tp: high-throughput batched LLM inference with KV-cache eviction in prefill and decoding (Batch-Max).

The public API, in one place::

    from batchmax_tp import BatchMaxCache, Method, generate, plan

- ``Method("bm", kv_max=512, p=64, rule="paper")``: what to keep (``core.method``; ``bm``, ``ed`` or ``fkv``);
- ``generate(model, input_ids, attention_mask, method, max_new_tokens)``: Algorithm 1 (BM) or 3 (ED) on an
  unchanged Hugging Face causal LM (``core.engine``);
- ``BatchMaxCache``: the bounded cache as a transformers ``Cache`` (``core.cache``), for ``model.generate``;
- ``plan``: memory planning from shapes (``plan.predict``, ``plan.max_batch``, ``plan.ModelShape``).

``Method`` and ``plan`` import no torch; ``BatchMaxCache`` and ``generate`` load torch and transformers when first
used, so that the command line can reject a bad configuration before those load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import plan
from .core.method import Method

if TYPE_CHECKING:
    from .core.cache import BatchMaxCache
    from .core.engine import generate

__version__ = "0.1.0"
__all__ = ["BatchMaxCache", "Method", "generate", "plan"]


def __getattr__(name: str) -> object:
    """``BatchMaxCache`` and ``generate`` on first use (they bring torch and transformers)."""
    if name == "BatchMaxCache":
        from .core.cache import BatchMaxCache

        return BatchMaxCache
    if name == "generate":
        from .core.engine import generate

        return generate
    raise AttributeError(f"module 'batchmax_tp' has no attribute {name!r}")
