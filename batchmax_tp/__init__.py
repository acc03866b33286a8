"""batchmax_tp: high-throughput batched LLM inference with KV-cache eviction in prefill and decoding (Batch-Max).

The public API, in one place::

    from batchmax_tp import BatchMaxCache, Method, generate, plan, run_prompts

- ``Method("bm", kv_max=512, p=64, rule="paper")``: what to keep (``core.method``; ``bm``, ``ed`` or ``fkv``);
- ``run_prompts(model, prompts, method, max_new_tokens, tokenizer=tok)``: prompts (text or token ids) in, one output
  per prompt out, served on the one engine in the memory FKV would need (``api``);
- ``generate(model, input_ids, attention_mask, method, max_new_tokens)``: a left-padded batch as the paper's padded
  batch, Algorithm 1 (BM) or 3 (ED) on an unchanged Hugging Face causal LM (``core.engine``);
- ``BatchMaxCache``: the bounded cache as a transformers ``Cache`` (``core.hf_cache``), for ``model.generate``;
- ``plan``: memory planning from shapes (``plan.predict``, ``plan.max_batch``, ``plan.ModelShape``).

``Method`` and ``plan`` import no torch; ``BatchMaxCache``, ``generate`` and ``run_prompts`` load torch and
transformers when first used, so that the command line can reject a bad configuration before those load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import plan
from .core.method import Method

if TYPE_CHECKING:
    from .api import run_prompts
    from .core.engine import generate
    from .core.hf_cache import BatchMaxCache

__version__ = "0.1.0"
__all__ = ["BatchMaxCache", "Method", "generate", "plan", "run_prompts"]


def __getattr__(name: str) -> object:
    """``BatchMaxCache``, ``generate`` and ``run_prompts`` on first use (they bring torch and transformers)."""
    if name == "BatchMaxCache":
        from .core.hf_cache import BatchMaxCache

        return BatchMaxCache
    if name == "generate":
        from .core.engine import generate

        return generate
    if name == "run_prompts":
        from .api import run_prompts

        return run_prompts
    raise AttributeError(f"module 'batchmax_tp' has no attribute {name!r}")
