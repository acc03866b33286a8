"""The "batchmax" attention function, registered through transformers' ``AttentionInterface``.

Queries of the current block attend over the layer's kept slots, which include the block itself (``update`` wrote
it before the attention call): a slot is visible to a query when it is valid (not empty, evicted or a pad) and its
position is not after the query's (causal inside the block). Each query's attention probabilities are added to
the slots' running sums, which the eviction rule reads. GQA: queries are grouped per KV head, so one KV head's slot
sums the probabilities of its whole query group, and no ``repeat_kv`` copy is made.

Memory: long blocks run in query chunks (``workspace.SCORE_CHUNK_BYTES``), one chunk's tensors alive at a time; each call
reports its peak allocation, counted by ``workspace.workspace_bytes`` (what the planner predicts, checked against measured
allocations in ``tests/test_memory.py``).

Look-ahead probe (rules ``probe``, ``snapkv``, ``question``): when the cache layer holds probe keys/values for this pass, the
last ``w`` queries are the probe's. Each attends to every valid slot (all precede it) and causally to the probe
keys up to itself (pad probe tokens hidden); its output goes on through the layer, its attention to the slots,
summed over the query group and averaged over the sample's real probe queries, becomes the slots' ``probe``
values (overwritten each probed pass); the paper's sums get nothing from it. The math is ``core.probe``'s, shared
with the re-scoring of rules that probe only every few blocks.

Nothing is registered at import time: call ``register()`` (or use ``use_batchmax_attention``).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import probe, workspace
from .cache import take_updated_layer

NAME = "batchmax"


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
    probe_kv, layer.probe_kv = layer.probe_kv, None
    wp = 0 if probe_kv is None else probe_kv[0].shape[2]  # look-ahead probe queries at the end of the block
    B, Hq, n_all, D = query.shape
    n = n_all - wp
    Hkv = key.shape[1]
    g = Hq // Hkv
    scaling = D**-0.5 if scaling is None else scaling

    all_mask = None if attention_mask is None else attention_mask[:, -n_all:].bool()  # [B, n + wp]
    token_mask = None if all_mask is None else all_mask[:, :n]  # [B, n]
    layer.mark_pads(token_mask)
    hi = layer.high  # slots [hi, C) were never written: leave them out of every product
    keys_t = key[:, :, :hi].transpose(2, 3)  # [B, Hkv, D, hi]
    values = value[:, :, :hi]  # [B, Hkv, hi, D]
    slot_pos = layer.pos[:, :, :hi]  # [B, Hkv, hi]
    score = layer.score[:, :, :hi]  # [B, Hkv, hi], a view: accumulated in place
    if n == 1:  # a decode step: every kept slot precedes the query, only empty/evicted slots are hidden
        hidden = (slot_pos < 0)[:, :, None, None, :]  # [B, Hkv, 1, 1, hi]
    else:  # empty and pad slots get a position after every query, so one comparison hides them too
        eff_pos = slot_pos.masked_fill(slot_pos < 0, torch.iinfo(slot_pos.dtype).max)  # [B, Hkv, hi]
    first = layer.seen - n  # padded position of the block's first query
    qg = query[:, :, :n].view(B, Hkv, g, n, D)  # [B, Hkv, g, n, D]: query heads grouped by their KV head (a view)

    # Memory: at most one chunk's tensors are alive at a time (each is dropped as soon as it is used), the
    # scaling is folded into the chunk's own query copy, and chunk outputs go straight into the result's
    # [B, n, Hq, D] layout. ``workspace_bytes`` counts what remains, allocation by allocation.
    ordered = layer.free is None
    converted = 0 if attention_mask is None or attention_mask.dtype == torch.bool else B * n  # token_mask bytes
    layer.cache.note_workspace(converted + workspace.workspace_bytes(B, Hq, Hkv, n, hi, D, ordered=ordered,
                                                           padded=token_mask is not None, elem=query.element_size()))
    out = None  # [B, n, Hkv, g, D]: allocated once when the block takes more than one chunk
    for a, b, lim in workspace.query_chunks(B, Hq, n, hi, ordered):
        m = b - a
        if out is None and (m < n or wp):
            out = torch.empty(B, n_all, Hkv, g, D, dtype=value.dtype, device=value.device)
        # The chunk's scaled queries, copied contiguous (never a view: scaled in place) [B, Hkv, g, m, D]
        qc = qg[:, :, :, a:b].clone(memory_format=torch.contiguous_format).mul_(scaling)
        logits = torch.matmul(qc.view(B, Hkv, g * m, D), keys_t[..., :lim])  # [B, Hkv, g*m, lim]
        del qc
        logits = logits.float().view(B, Hkv, g, m, lim)  # [B, Hkv, g, m, lim]
        if n > 1:
            qpos = torch.arange(first + a, first + b, device=query.device)  # [m]
            hidden = (eff_pos[:, :, None, :lim] > qpos[:, None])[:, :, None]  # [B, Hkv, 1, m, lim]
            del qpos
        # A pad query sees no slot at all; a finite fill keeps its row finite (its weights are dropped below).
        logits.masked_fill_(hidden, torch.finfo(torch.float32).min)
        probs = torch.softmax(logits, dim=-1).view(B, Hkv, g * m, lim)  # [B, Hkv, g*m, lim]
        del logits
        if n > 1:
            del hidden
        # Attention received per slot, summed over the query group and the block's real queries.
        with torch.profiler.record_function("batchmax::score"):
            if token_mask is None:
                score[..., :lim] += probs.sum(dim=2)  # [B, Hkv, lim]
            else:
                real = token_mask[:, a:b].repeat(1, g).to(probs.dtype)  # [B, g*m], row order of probs
                score[..., :lim] += torch.matmul(real[:, None, None, :], probs).view(B, Hkv, lim)  # pads add 0
                del real
        o = torch.matmul(probs.to(value.dtype), values[:, :, :lim]).view(B, Hkv, g, m, D)  # [B, Hkv, g, m, D]
        del probs
        if out is None:  # the whole block in one chunk
            out = o.permute(0, 3, 1, 2, 4).contiguous()  # [B, n, Hkv, g, D]; no copy when n == 1
        else:
            out[:, a:b].copy_(o.permute(0, 3, 1, 2, 4))  # [B, m, Hkv, g, D]
        del o
    if wp:  # the look-ahead probe's queries: their outputs go on through the layer (and are dropped at the end)
        probe_mask = None if all_mask is None else all_mask[:, n:]  # [B, wp]
        probe_out = _probe_attention(layer, query[:, :, n:], probe_kv, probe_mask, scaling, hi)  # [B, Hq, wp, D]
        out[:, n:].copy_(probe_out.view(B, Hkv, g, wp, D).permute(0, 3, 1, 2, 4))  # [B, wp, Hkv, g, D]
    return out.view(B, n_all, Hq, D), None  # [B, n + wp, Hq, D]


def _probe_attention(layer, query: torch.Tensor, probe_kv: tuple[torch.Tensor, torch.Tensor],
                     probe_mask: torch.Tensor | None, scaling: float, hi: int) -> torch.Tensor:
    """The look-ahead probe's queries [B, Hq, w, D] over the slots [0, hi) and the probe's own keys (causal).

    Writes the probe's attention per slot into ``layer.probe`` (kept for re-scoring when the rule probes only
    every few blocks) and returns the probe outputs [B, Hq, w, D]."""
    pk, pv = probe_kv  # [B, Hkv, w, D] each
    B, Hq, w, D = query.shape
    Hkv = pk.shape[1]
    q = (query * scaling).reshape(B, Hkv, Hq // Hkv * w, D)  # [B, Hkv, g*w, D]
    weights = probe.query_weights(probe_mask, B, w, q.device)  # [B, w]
    probs = probe.probabilities(q, layer.keys[:, :, :hi], layer.pos[:, :, :hi], pk, weights)  # [B, Hkv, g*w, hi+w]
    layer.cache.note_workspace(2 * probs.numel() * probs.element_size())
    to_slots, to_own = probs[..., :hi], probs[..., hi:]  # [B, Hkv, g*w, hi], [B, Hkv, g*w, w]
    layer.probe[:, :, :hi] = probe.per_slot(to_slots, weights)  # [B, Hkv, hi]
    layer.probe_fresh = True
    if layer.cache.method.probe_every > 1:  # own keys copied: a view would hold the whole block's keys
        layer.probe_state = probe.ProbeState(q, pk.clone(), weights)
    out = torch.matmul(to_slots.to(pv.dtype), layer.values[:, :, :hi]) + torch.matmul(to_own.to(pv.dtype), pv)
    return out.view(B, Hq, w, D)  # [B, Hq, w, D]


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
