"""The look-ahead probe's attention over a cache layer's slots: one formula for a probe pass and for re-scoring.

A probe (``core.rules``: rules with a ``window``; ``core.schedule``: a phase after a prefill block, run in that block's
pass as more columns, ``attention._folded``) feeds the prompt's last ``w`` tokens as queries. Each probe query attends
to every valid slot and causally to the probe's own keys up to itself (pad probe tokens are neither queries nor keys). A
slot's probe value is the attention it got, summed over the query group and averaged over the sample's real probe
queries.

The own keys enter a query's softmax only through their log-sum-exp, which never changes once the pass ran (the
query and the own keys are fixed). So a rule with ``every > 1`` keeps the probe's scaled queries, that per-query
log-sum-exp and the query weights (``ProbeState``), and the prefill evictions between probe passes re-score the
slots kept then with them (``rescore``): the same formula, fresh keys, queries of the last probe pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG = torch.finfo(torch.float32).min
#: Log-probabilities are clamped here before ``exp``: CPU ``exp`` takes a slow path on very negative inputs (a masked
#: logit, 3-8x slower) and on outputs below float32's normal range; e**-80 ~ 1.8e-35, which is then either a real
#: probability off by less than that or a masked one, set to 0.
_LOG_FLOOR = -80.0


def probabilities(logits: torch.Tensor, lse: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``exp(logits - lse)`` in place, 0 where ``hidden`` (broadcast to ``logits``) is True (a product with the
    visible slots as 0/1: a broadcast ``masked_fill_`` is several times slower on the CPU)."""
    return logits.sub_(lse).clamp_(min=_LOG_FLOOR).exp_().mul_(hidden.logical_not().to(logits.dtype))


@dataclass
class ProbeState:
    """What a probe pass leaves for re-scoring: scaled queries ``q`` [B, Hkv, g*w, D] (rows ordered (g, w)), the
    log-sum-exp of each query's logits over its own (causal, real) probe keys ``own_lse`` [B, Hkv, g*w, 1] (float32)
    and query weights [B, w] (1 / real probe tokens, 0 for pads)."""

    q: torch.Tensor
    own_lse: torch.Tensor
    weights: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.own_lse, self.weights))


def query_weights(probe_mask: torch.Tensor | None, batch: int, w: int, device: torch.device) -> torch.Tensor:
    """[B, w]: each real probe query's share of the mean (1 / real probe tokens), 0 for pads."""
    if probe_mask is None:
        return torch.full((batch, w), 1.0 / w, device=device)
    real = probe_mask.float()  # [B, w]
    return real / real.sum(-1, keepdim=True).clamp(min=1)


def own_logits(q: torch.Tensor, own_keys: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [B, Hkv, g*w, w] of the probe queries over the probe's own keys (causal, pad keys hidden) and
    what hides them, [B, 1, 1, w, w] against the logits viewed [B, Hkv, g, w, w].

    q: [B, Hkv, g*w, D] scaled queries; own_keys: [B, Hkv, w, D]; weights: [B, w] (0 marks a pad probe token)."""
    B, Hkv, gw, _ = q.shape
    w = own_keys.shape[2]
    own = torch.matmul(q, own_keys.transpose(2, 3)).float().view(B, Hkv, gw // w, w, w)  # [B, Hkv, g, w, w]
    hidden = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)  # [w, w] later probe tokens
    hidden = hidden | (weights <= 0)[:, None, None, None, :]  # [B, 1, 1, w, w] pad probe keys too
    return own.masked_fill_(hidden, NEG).view(B, Hkv, gw, w), hidden


def slot_probabilities(
    q: torch.Tensor,
    slot_keys: torch.Tensor,
    slot_pos: torch.Tensor,
    own_lse: torch.Tensor,
    other: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's attention probabilities over the slots [B, Hkv, g*w, hi] (float32) and each query's log-sum-exp
    over slots and own keys together [B, Hkv, g*w, 1].

    slot_keys: [B, Hkv, hi, D]; slot_pos: [B, Hkv, hi] (-1 hides a slot); own_lse: [B, Hkv, g*w, 1]; ``other``
    [B, Hkv, G, hi] (a budget shared by G heads, rows (G, g/G, w)): the slots each head's queries must not see."""
    logits = torch.matmul(q, slot_keys.transpose(2, 3)).float()  # [B, Hkv, g*w, hi]
    B, Hkv, gw, hi = logits.shape
    G = 1 if other is None else other.shape[2]
    hidden = (slot_pos < 0)[:, :, None, None, :]  # [B, Hkv, 1, 1, hi]
    if other is not None:
        hidden = hidden | other[:, :, :, None, :]  # [B, Hkv, G, 1, hi]
    grouped = logits.view(B, Hkv, G, gw // G, hi)  # [B, Hkv, G, g/G*w, hi] (a view)
    # exp(logits - top) once, hidden slots 0 (never a masked logit through exp, whose CPU path is slow); the row's
    # log-sum-exp over slots and own keys from its sum; the probabilities are that tile rescaled by exp(top - lse)
    top = grouped.masked_fill_(hidden, NEG).amax(-1, keepdim=True)  # [B, Hkv, G, g/G*w, 1]
    top.masked_fill_(top == NEG, 0.0)  # a query that sees no slot: its tile all hidden, 0 after the product below
    grouped.sub_(top).clamp_(min=_LOG_FLOOR).exp_().mul_(hidden.logical_not().to(logits.dtype))
    lse = torch.logaddexp(top.view(B, Hkv, gw, 1) + logits.sum(-1, keepdim=True).log(), own_lse)  # [B, Hkv, g*w, 1]
    grouped.mul_((top - lse.view(B, Hkv, G, gw // G, 1)).exp())
    return logits, lse


def per_slot(to_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """to_slots [B, Hkv, g*w, hi] (rows (g, w)) -> [B, Hkv, hi]: summed over the group, weighted mean over w."""
    B, Hkv, gw, hi = to_slots.shape
    g = gw // weights.shape[1]
    return torch.matmul(weights.repeat(1, g)[:, None, None, :], to_slots).view(B, Hkv, hi)  # [B, Hkv, hi]


def rescore(
    state: ProbeState, slot_keys: torch.Tensor, slot_pos: torch.Tensor, other: torch.Tensor | None = None
) -> torch.Tensor:
    """The stored probe's attention per slot [B, Hkv, hi] over the slots held now (``other``: as
    ``slot_probabilities``)."""
    probs, _ = slot_probabilities(state.q, slot_keys, slot_pos, state.own_lse, other)  # [B, Hkv, g*w, hi]
    return per_slot(probs, state.weights)


def rescore_parts(state: ProbeState, parts) -> list[torch.Tensor]:
    """The stored probe's attention per pair [B, Hkv, n_i] of each part of one set of pairs too large to hold at once
    (the recall over the slots and the tier, ``core.bounded``): ``parts()`` yields (keys [B, Hkv, n_i, D], positions
    [B, Hkv, n_i]) in the same order each time it is called; the softmax runs over all of them and the own keys
    (two passes: the log-sum-exp first, then each part's probabilities), so the result is ``rescore`` over the parts
    joined, a part's keys in memory at a time."""

    def logits(keys: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = (pos < 0)[:, :, None, :]  # [B, Hkv, 1, n_i]
        out = torch.matmul(state.q, keys.transpose(2, 3)).float()  # [B, Hkv, g*w, n_i]
        return out.masked_fill_(hidden, NEG), hidden

    return [per_slot(p, state.weights) for p in parts_probabilities(logits, parts, state.own_lse)]


def parts_probabilities(logits, parts, lse: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One softmax over the pairs of several parts, a part's keys in memory at a time (two passes: the log-sum-exp,
    then each part's probabilities): ``parts()`` yields (keys, positions) in the same order each call, ``logits(keys,
    positions)`` their float32 logits (hidden ones at ``NEG``) and what hides them; ``lse``: the log-sum-exp of logits
    outside the parts (a probe's own keys) or None. Returns each part's probabilities (hidden: 0)."""
    for keys, pos in parts():
        part = logits(keys, pos)[0].logsumexp(-1, keepdim=True)
        lse = part if lse is None else torch.logaddexp(lse, part)
    out = []
    for keys, pos in parts():
        part, hidden = logits(keys, pos)
        out.append(probabilities(part, lse, hidden))
    return out
