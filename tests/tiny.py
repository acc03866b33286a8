"""Tiny random causal LMs for tests: every supported family, deterministic per seed, built in milliseconds.

Test code only (the package never builds a model without weights except ``models.architecture_model``, which
measures speed). ``conftest`` re-exports :func:`tiny_llama` and :data:`PEAKED` for the tests that take them from
there; a test that needs another family imports :func:`tiny_random_model` from here.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

#: Families of the tiny random test models: the paper's Llama-2 and Phi-3/3.5 (fused ``qkv_proj`` and
#: ``gate_up_proj``), plus Qwen2 (q/k/v biases) and Mistral.
TINY_FAMILIES = ("llama", "phi3", "qwen2", "mistral")

# The tiny model's default init (initializer_range=0.02) gives near-uniform attention, whose average-attention
# ranking has near-ties (relative gaps ~1e-5); a larger init gives peaked attention and clear decisions.
PEAKED = dict(initializer_range=0.2)


def tiny_random_model(family: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny random causal LM of ``family`` for tests, deterministic for a given seed (global RNG untouched).

    Defaults: vocab 128, hidden 64, 2 layers, 4 query heads, 2 KV heads, head_dim 16, intermediate 128,
    max_position_embeddings 1024, pad/bos/eos ids 0/1/2; ``overrides`` replace any config field. Returned in
    float32, eval mode, with ``attn_implementation="sdpa"``.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}: choose one of {', '.join(TINY_FAMILIES)}")
    params: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        params["sliding_window"] = None
    params.update(overrides)
    config = AutoConfig.for_model(family, **params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    model.set_attn_implementation("sdpa")
    return model.to(torch.float32).eval()


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A tiny random GQA Llama (:func:`tiny_random_model` with ``family="llama"``)."""
    return tiny_random_model("llama", seed=seed, **overrides)


def tiny_arch(folder, vocab: int = 256) -> str:
    """``arch:PATH`` of a tiny Llama architecture written into ``folder`` (for the launch scripts' ``--model``)."""
    import json
    from pathlib import Path

    path = Path(folder) / f"tiny-{vocab}.json"
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    fields.update(num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512)
    path.write_text(json.dumps({"model_type": "llama", **fields}))
    return f"arch:{path}"
