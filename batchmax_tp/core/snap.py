"""SnapKV's choice, made once after an unchunked prefill (the method ``snap``, ``core.method.Snap``).

A prompt of s tokens runs through each layer in one pass (the model's SDPA, as FKV's), and with its keys in hand the
layer keeps ``kv_max`` of its pairs per (row, KV head): the observation window (the prompt's last ``w`` positions,
where the question sits) and the ``kv_max - w`` others the window's queries attended to most (SnapKV, Li et al.
2024; kvpress's ``SnapKVPress``):

- score[j] = the attention probability the window's queries give prompt pair j, summed over the window's queries and
  the KV head's query heads (causal: a window query sees the pairs up to its own position);
- the scores of the pairs before the window are pooled over positions as SnapKV does (``avg_pool1d`` with kernel
  ``kernel``, stride 1, padding ``kernel // 2``, the padding counted: a pair near either end averages with zeros);
- kept: the window, and the ``kv_max - w`` pairs before it of highest pooled score (ties: the older pair first).

A prompt of at most ``kv_max`` tokens keeps every pair. The kept pairs then decode in a bounded slot with the
paper's decode-time eviction (``p`` pairs of smallest average attention when a step finds the slot full). Their
attention sums start at the window's score (unpooled): the attention they received from the window's queries, the
only prompt queries whose attention is computed -- the choice ``tests/reference.py`` reads the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import probe


def window_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int) -> torch.Tensor:
    """query [R, Hq, n, D] (the prompt's last n >= min(window, s) queries: all of it, or its last chunk), key
    [R, Hkv, s, D] (one prompt length s, RoPE applied): the attention every pair gets from the last ``min(window, s)``
    queries, summed over them and over each KV head's query heads, float32 [R, Hkv, s]. Reads only the window's
    queries: [R, Hkv, g*w, s] logits at a time."""
    R, Hq, _, D = query.shape
    Hkv, s = key.shape[1], key.shape[2]
    g, w = Hq // Hkv, min(window, s)
    q = query[:, :, -w:].reshape(R, Hkv, g * w, D)  # [R, Hkv, g*w, D]: the window's queries grouped by KV head
    logits = torch.matmul(q, key.transpose(2, 3)).float().mul_(scaling)  # [R, Hkv, g*w, s]
    # window query i sits at position s - w + i: pairs after it are hidden (the same for every query head)
    after = torch.arange(s, device=key.device) > torch.arange(s - w, s, device=key.device)[:, None]  # [w, s]
    logits.view(R, Hkv, g, w, s).masked_fill_(after, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=2)  # [R, Hkv, s]


def window_scores_parts(query: torch.Tensor, qpos: torch.Tensor, scaling: float, parts) -> list[torch.Tensor]:
    """``window_scores`` over one set of pairs too large to hold at once (``question:recall=window``, issue 68): query
    [Hkv, g, w, D] (a window's queries grouped by KV head, RoPE applied), qpos [w] their positions; ``parts()`` yields
    (keys [Hkv, n_i, D], positions [Hkv, n_i], -1: none) in the same order each call. A query's softmax runs over every
    part's pairs at or before its position (two passes: the log-sum-exp, then the probabilities, a part's keys in
    memory at a time). Returns each part's [Hkv, n_i] float32: summed over the queries and each KV head's query
    heads."""
    Hkv, g, w, D = query.shape
    q = query.reshape(Hkv, g * w, D)  # [Hkv, g*w, D]: rows (g, w)
    later = qpos.repeat(g)[None, :, None]  # [1, g*w, 1]: each row's query position

    def logits(keys: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = (pos[:, None, :] < 0) | (pos[:, None, :] > later)  # [Hkv, g*w, n_i]: none, or after the query
        out = torch.matmul(q, keys.transpose(1, 2)).float().mul_(scaling)  # [Hkv, g*w, n_i]
        return out.masked_fill_(hidden, probe.NEG), hidden

    return [p.sum(1) for p in probe.parts_probabilities(logits, parts)]  # [Hkv, n_i] each


def choose(
    scores: torch.Tensor, kv_max: int, window: int, kernel: int, pool: str = "avg", protect: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """The positions each (row, KV head) keeps, ascending, [R, Hkv, min(s, kv_max)], from ``window_scores``
    [R, Hkv, s]: the window and the ``kv_max - w`` pairs before it of highest pooled score (``pool``: SnapKV's
    average over ``kernel`` positions, the padding counted; ``max``: the largest, as ``question`` pools).
    ``protect`` (first, last): the first ``first`` and the last ``last`` positions are kept before any other (a rule's
    sinks and recent pairs, ``question:recall=window``)."""
    R, Hkv, s = scores.shape
    if s <= kv_max:
        return torch.arange(s, device=scores.device).expand(R, Hkv, s)
    w = min(window, s)
    prefix = scores[..., : s - w].reshape(R * Hkv, 1, s - w)  # [R*Hkv, 1, s - w]
    pooling = F.avg_pool1d if pool == "avg" else F.max_pool1d
    pooled = pooling(prefix, kernel, stride=1, padding=kernel // 2).view(R, Hkv, s - w)  # [R, Hkv, s - w]
    first, last = protect
    if first or last > w:
        kept = torch.arange(s - w, device=scores.device)  # [s - w]: the prefix's positions
        pooled = pooled.masked_fill((kept < first) | (kept >= s - last), float("inf"))
    # the highest pooled scores, ties to the older pair: a stable sort keeps positions ascending among equals
    top = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[..., : kv_max - w]  # [R, Hkv, kv_max-w]
    recent = torch.arange(s - w, s, device=scores.device).expand(R, Hkv, w)  # [R, Hkv, w]
    return torch.cat([top.sort(dim=-1).values, recent], dim=-1)  # [R, Hkv, kv_max], ascending
