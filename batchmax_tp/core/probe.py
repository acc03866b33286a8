"""The look-ahead probe's attention over a cache layer's slots: one function for a probed pass and for re-scoring.

A probed prefill pass (``core.rules``: rules with a ``window``) feeds the prompt's last ``w`` tokens as extra
queries. Each probe query attends to every valid slot and causally to the probe's own keys up to itself (pad probe
tokens are neither queries nor keys). A slot's probe value is the attention it got, summed over the query group
and averaged over the sample's real probe queries.

With a rule's ``every > 1`` the probe rides along only every ``every``-th block; the probe's scaled queries, its
own keys and query weights are kept (``ProbeState``), and the prefill evictions between probed passes re-score the
slots kept then with them (``rescore``): the same formula, fresh keys, queries of the last probed pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG = torch.finfo(torch.float32).min


@dataclass
class ProbeState:
    """What a probed pass leaves for re-scoring: scaled queries ``q`` [B, Hkv, g*w, D] (rows ordered (g, w)),
    own keys ``k`` [B, Hkv, w, D] and query weights [B, w] (1 / real probe tokens, 0 for pads)."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.weights))


def query_weights(probe_mask: torch.Tensor | None, batch: int, w: int, device: torch.device) -> torch.Tensor:
    """[B, w]: each real probe query's share of the mean (1 / real probe tokens), 0 for pads."""
    if probe_mask is None:
        return torch.full((batch, w), 1.0 / w, device=device)
    real = probe_mask.float()  # [B, w]
    return real / real.sum(-1, keepdim=True).clamp(min=1)


def probabilities(q: torch.Tensor, slot_keys: torch.Tensor, slot_pos: torch.Tensor, own_keys: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Probe attention probabilities [B, Hkv, g*w, hi + w] (float32) over the slots, then its own keys.

    q: [B, Hkv, g*w, D] scaled queries; slot_keys: [B, Hkv, hi, D]; slot_pos: [B, Hkv, hi] (-1 hides a slot);
    own_keys: [B, Hkv, w, D]; weights: [B, w] (0 marks a pad probe token, hidden as a key).
    """
    B, Hkv, gw, _ = q.shape
    w = own_keys.shape[2]
    g = gw // w
    slot_logits = torch.matmul(q, slot_keys.transpose(2, 3)).float()  # [B, Hkv, g*w, hi]
    slot_logits.masked_fill_((slot_pos < 0)[:, :, None, :], NEG)
    own = torch.matmul(q, own_keys.transpose(2, 3)).float().view(B, Hkv, g, w, w)  # [B, Hkv, g, w, w]
    hidden = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)  # [w, w] later probe tokens
    hidden = hidden | (weights <= 0)[:, None, None, None, :]  # [B, 1, 1, w, w] pad probe keys too
    own.masked_fill_(hidden, NEG)
    return torch.softmax(torch.cat([slot_logits, own.view(B, Hkv, g * w, w)], dim=-1), dim=-1)


def per_slot(to_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """to_slots [B, Hkv, g*w, hi] (rows (g, w)) -> [B, Hkv, hi]: summed over the group, weighted mean over w."""
    B, Hkv, gw, hi = to_slots.shape
    g = gw // weights.shape[1]
    return torch.matmul(weights.repeat(1, g)[:, None, None, :], to_slots).view(B, Hkv, hi)  # [B, Hkv, hi]


def rescore(state: ProbeState, slot_keys: torch.Tensor, slot_pos: torch.Tensor) -> torch.Tensor:
    """The stored probe's attention per slot [B, Hkv, hi] over the slots held now."""
    probs = probabilities(state.q, slot_keys, slot_pos, state.k, state.weights)  # [B, Hkv, g*w, hi + w]
    return per_slot(probs[..., : slot_keys.shape[2]], state.weights)
