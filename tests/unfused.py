"""The engine's BM prefill attention before it was fused (2026-11-27, 3d3f50a), kept as the fused path's reference.

Per layer it builds each chunk's visibility mask from the slots' positions ([R, Hkv, 1, m, hi], bool), fills the
float32 logits with it, takes a softmax into a new tensor and sums it: the same arithmetic as
``attention._rows_block``, op by op as it was. ``tests/test_fused.py`` runs the engine with this in its place.
Its chunk helpers (``_slot_hiding``, ``_chunk_probs``) were the HF drop-in's own block attention's until the drop-in
ran on the engine's (2026-11-28): they live here now, as they were.
"""

from __future__ import annotations

import torch

from batchmax_tp.core import workspace
from batchmax_tp.core.attention import add_received


def rows_block(layer, step, query: torch.Tensor, scaling: float, hi: int, own: torch.Tensor) -> torch.Tensor:
    """``attention._rows_block``'s signature; ``own`` (the slots the pass wrote) is not needed here."""
    del own
    R, Hq, n, D = query.shape
    Hkv = layer.keys.shape[1]
    g = Hq // Hkv
    keys_t = step.take(layer.keys[:, :, :hi]).transpose(2, 3)  # [R, Hkv, D, hi]
    values = step.take(layer.values[:, :, :hi])  # [R, Hkv, hi, D]
    score = step.take(layer.score[:, :, :hi])  # [R, Hkv, hi]
    hiding = _slot_hiding(step.take(layer.pos[:, :, :hi]), n)  # [R, Hkv, hi]
    other = layer.other_heads(step.take, step.share)  # [R, Hkv, G, T + 1] or None
    qg = query.view(R, Hkv, g, n, D)
    out = None
    for a, b in workspace.query_chunks(R, Hq, n, hi):
        m = b - a
        if out is None and m < n:
            out = torch.empty(R, n, Hkv, g, D, dtype=values.dtype, device=values.device)
        probs = _chunk_probs(qg[:, :, :, a:b], keys_t, scaling, hiding, step.qpos[:, a:b], other)
        add_received(score, probs, None if step.real is None else step.real[:, a:b])
        o = torch.matmul(probs.to(values.dtype), values).view(R, Hkv, g, m, D)
        if out is None:
            out = o.permute(0, 3, 1, 2, 4).contiguous()
        else:
            out[:, a:b].copy_(o.permute(0, 3, 1, 2, 4))
    if step.span is None:
        layer.score[:, :, :hi].index_copy_(0, step.rows, score)
    return out.view(R, n, Hq, D)


def _slot_hiding(slot_pos: torch.Tensor, n: int) -> torch.Tensor:
    """What hides slots [B, Hkv, hi] from a block of ``n`` queries. A decode step (n == 1): every kept slot precedes
    the query, so the mask [B, Hkv, 1, 1, hi] of empty/evicted slots. A longer block: each slot's effective
    position [B, Hkv, hi] (empty and pad slots after every query), compared per chunk with the queries'."""
    if n == 1:
        return (slot_pos < 0)[:, :, None, None, :]  # [B, Hkv, 1, 1, hi]
    return slot_pos.masked_fill(slot_pos < 0, torch.iinfo(slot_pos.dtype).max)  # [B, Hkv, hi]


def _chunk_probs(
    q: torch.Tensor,
    keys_t: torch.Tensor,
    scaling: float,
    hiding: torch.Tensor,
    qpos: torch.Tensor | int,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """A query chunk's attention probabilities: q [B, Hkv, g, m, D] (a view), keys_t [B, Hkv, D, lim], ``hiding``
    from ``_slot_hiding``, ``qpos`` the queries' positions: [B, m] per row (-1: a masked query, which sees no slot),
    or the first one's position (every row's queries at the same positions); ``other`` [B, Hkv, G, >= lim] (a budget
    shared by G heads: the slots each head's g / G query heads must not see). Returns [B, Hkv, g*m, lim]."""
    B, Hkv, g, m, D = q.shape
    lim = keys_t.shape[-1]
    # The chunk's scaled queries, copied contiguous (never a view: scaled in place) [B, Hkv, g, m, D]
    qc = q.clone(memory_format=torch.contiguous_format).mul_(scaling)
    logits = torch.matmul(qc.view(B, Hkv, g * m, D), keys_t)  # [B, Hkv, g*m, lim]
    del qc
    logits = logits.float().view(B, Hkv, g, m, lim)  # [B, Hkv, g, m, lim]
    if hiding.dim() == 5:  # a decode step's mask [B, Hkv, 1, 1, hi]
        hidden = hiding[..., :lim]
    else:
        if isinstance(qpos, int):
            qpos = torch.arange(qpos, qpos + m, device=q.device)[None]  # [1, m]
        hidden = (hiding[:, :, None, :lim] > qpos[:, None, :, None])[:, :, None]  # [B, Hkv, 1, m, lim]
        del qpos
    # A pad query sees no slot at all; a finite fill keeps its row finite (its weights are dropped below).
    logits.masked_fill_(hidden, torch.finfo(torch.float32).min)
    if other is not None:  # [B, Hkv, G, g/G, m, lim]: another head's slots
        G = other.shape[2]
        hid = other[:, :, :, None, None, :lim]  # [B, Hkv, G, 1, 1, lim]
        logits.view(B, Hkv, G, g // G, m, lim).masked_fill_(hid, torch.finfo(torch.float32).min)
    probs = torch.softmax(logits, dim=-1).view(B, Hkv, g * m, lim)  # [B, Hkv, g*m, lim]
    del logits, hidden
    return probs
