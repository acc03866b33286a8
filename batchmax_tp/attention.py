"""The "batchmax" attention function, registered through transformers' ``AttentionInterface``.

Queries of the current block attend over the layer's kept slots, which include the block itself (``update`` wrote
it before the attention call): a slot is visible to a query when it is valid (not empty, evicted or a pad) and its
position is not after the query's (causal inside the block). Each query's attention probabilities are added to
the slots' running sums, which the eviction rule reads. GQA: queries are grouped per KV head, so one KV head's slot
sums the probabilities of its whole query group, and no ``repeat_kv`` copy is made.

Nothing is registered at import time: call ``register()`` (or use ``use_batchmax_attention``).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .cache import take_updated_layer

NAME = "batchmax"
# Largest attention-probability block materialised at once (bytes of float32 scores); longer query blocks are
# processed in chunks of queries so prefill never builds an attention matrix over the whole prompt.
SCORE_CHUNK_BYTES = 64 * 2**20


def batchmax_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, n, D]; key/value: the cache layer's buffers [B, Hkv, C, D]; attention_mask: the block's
    padding mask (last n columns of a 2D [B, *] mask, True for real tokens) or None. Returns [B, n, Hq, D]."""
    layer = take_updated_layer(key)
    B, Hq, n, D = query.shape
    Hkv, C = key.shape[1], key.shape[2]
    g = Hq // Hkv
    scaling = D**-0.5 if scaling is None else scaling

    token_mask = None if attention_mask is None else attention_mask[:, -n:].bool()  # [B, n]
    layer.mark_pads(token_mask)
    slot_pos = layer.pos  # [B, Hkv, C]
    valid = slot_pos >= 0  # [B, Hkv, C]
    first = layer.seen - n  # padded position of the block's first query
    q = (query * scaling).view(B, Hkv, g, n, D)  # [B, Hkv, g, n, D]: query heads grouped by their KV head

    chunk = max(1, SCORE_CHUNK_BYTES // (4 * B * Hq * C))  # queries per score block
    outputs = []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        qc = q[:, :, :, a:b].reshape(B, Hkv, g * (b - a), D)  # [B, Hkv, g*m, D]
        logits = torch.matmul(qc, key.transpose(2, 3)).float()  # [B, Hkv, g*m, C]
        logits = logits.view(B, Hkv, g, b - a, C)  # [B, Hkv, g, m, C]
        if n == 1:  # a decode step: every kept slot precedes the query
            visible = valid[:, :, None, :]  # [B, Hkv, 1, C]
        else:
            qpos = torch.arange(first + a, first + b, device=query.device)  # [m]
            visible = valid[:, :, None, :] & (slot_pos[:, :, None, :] <= qpos[:, None])  # [B, Hkv, m, C]
        # A pad query sees no slot at all; a finite fill keeps its row finite (its weights are dropped below).
        logits = logits.masked_fill(~visible[:, :, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(logits, dim=-1)  # [B, Hkv, g, m, C]
        # Live score buffers at this point: the masked logits, the probabilities and the visibility mask.
        layer.cache.note_workspace(2 * probs.numel() * probs.element_size() + visible.numel() * visible.element_size())
        with torch.profiler.record_function("batchmax::score"):
            received = probs.sum(dim=2)  # [B, Hkv, m, C]
            if token_mask is not None:
                received = received * token_mask[:, None, a:b, None]  # pad queries add nothing
            layer.score += received.sum(dim=2)  # [B, Hkv, C]
        out = torch.matmul(probs.view(B, Hkv, g * (b - a), C).to(value.dtype), value)  # [B, Hkv, g*m, D]
        outputs.append(out.view(B, Hq, b - a, D))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [B, Hq, n, D]
    return out.transpose(1, 2).contiguous(), None  # [B, n, Hq, D]


def padding_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask builder for "batchmax": the 2D padding mask passes through; slot positions do the causal part."""
    return attention_mask


def register() -> None:
    """Register the attention function and its mask builder under the name "batchmax" (idempotent)."""
    AttentionInterface.register(NAME, batchmax_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


@contextlib.contextmanager
def use_batchmax_attention(model: torch.nn.Module):
    """Run ``model`` with the "batchmax" attention inside the block, restoring its implementation after."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
