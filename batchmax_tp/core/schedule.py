"""The block/step schedule of Algorithm 1 (BM) and Algorithm 3 (ED), stated phase by phase.

The schedule depends only on host integers (padded prompt length, kv_max, p, max_new_tokens), never on tensor
values, so every layer, every sample and every tensor-parallel rank runs the same phases and evicts at the same
points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .method import Method


@dataclass(frozen=True)
class Phase:
    """One forward pass: a prefill block, a look-ahead probe or a decode step.

    ``start``/``end`` are padded-sequence positions ``[start, end)`` fed in this pass; ``evict`` is how many
    pairs each (sample, KV head) drops before the pass; ``step`` is the decode step t (1-based, 0 in prefill).
    A ``probe`` pass (rules with a look-ahead window, ``core.rules``) follows a prefill block ``[a, b)`` and feeds
    the prompt's positions ``[max(b, s - window), s)`` as queries over the slots kept then; nothing is written
    to the cache. The engine runs it in the block's own pass (``window`` more columns per row; ``SlotWork.probe``).
    A rule with ``every > 1`` probes only after blocks ``0, every, 2 * every, ...``; never after the last block.
    """

    kind: Literal["prefill", "probe", "decode"]
    start: int
    end: int
    evict: int
    step: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def curr_id(self) -> int:
        """The last position already processed when this phase's eviction is decided."""
        return self.start - 1


def plan(method: Method, prompt_len: int, max_new_tokens: int, chunk: int | None = None) -> list[Phase]:
    """Every forward pass of a generation of ``max_new_tokens`` tokens from a padded prompt of ``prompt_len``.

    The first token comes from the last prefill block; decode step t (1..max_new_tokens-1) feeds the token at
    position ``prompt_len + t - 1``. ``chunk``: the first block is fed in passes of at most ``chunk`` tokens (nothing
    is evicted before the cache is full, so this is Algorithm 1 still; a probe follows the whole block).
    """
    if prompt_len < 1:
        raise ValueError("prompt must have at least one token")
    cap = method.schedule_capacity(prompt_len, max_new_tokens)  # with budgets across layers: the smallest's
    phases, filled = [], 0
    window = method.lookahead
    for i, (start, end) in enumerate(method.prefill_blocks(prompt_len)):
        evict = method.num_to_evict(filled, end - start, cap, first_decode=False)
        filled += end - start - evict
        cuts = range(start, end, chunk) if chunk and i == 0 else (start,)
        phases.extend(Phase("prefill", a, min(a + chunk, end) if chunk and i == 0 else end, evict) for a in cuts)
        # Look-ahead probe: the prompt's positions [max(end, s - window), s), after every ``every``-th block but
        # the last.
        if window and end < prompt_len and i % method.probe_every == 0:
            phases.append(Phase("probe", max(end, prompt_len - window), prompt_len, 0))
    for t in range(1, max_new_tokens):
        pos = prompt_len + t - 1
        evict = method.num_to_evict(filled, 1, cap, first_decode=t == 1)
        filled += 1 - evict
        phases.append(Phase("decode", pos, pos + 1, evict, step=t))
    return phases
