"""The engine's BM prefill attention before it was fused (2026-11-27, 3d3f50a), kept as the fused path's reference.

Per layer it builds each chunk's visibility mask from the slots' positions ([R, Hkv, 1, m, hi], bool), fills the
float32 logits with it, takes a softmax into a new tensor and sums it: the same arithmetic as
``attention._rows_block``, op by op as it was. ``tests/test_fused.py`` runs the engine with this in its place.
"""

from __future__ import annotations

import torch

from batchmax_tp.core import workspace
from batchmax_tp.core.attention import add_received
from batchmax_tp.core.hf_cache import _chunk_probs, _slot_hiding


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
    other = layer.other_heads(step.take)  # [R, Hkv, G, T + 1] or None
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
