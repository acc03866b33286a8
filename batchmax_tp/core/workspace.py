"""Bytes of the temporaries each attention path allocates per call: pure arithmetic on shapes, no torch.

The attention kernels (``attention.batchmax_attention`` and the baselines' SDPA) own these numbers and the
planner (``batchmax_tp.plan.planner``) predicts with them, so they live here, importable without torch or
transformers. ``workspace_bytes`` is checked against measured allocations in ``tests/test_memory.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

#: Largest attention-probability block materialised at once (bytes of float32 scores); longer query blocks are
#: processed in chunks of queries so prefill never builds an attention matrix over the whole prompt.
SCORE_CHUNK_BYTES = 64 * 2**20
#: Query chunk of an in-order (not yet evicted) block: smaller chunks skip more of the causal upper triangle.
CAUSAL_CHUNK = 128
#: The baselines' attention implementations (transformers' names).
SDPA = "sdpa"
FLASH = "flash_attention_2"


def query_chunks(batch: int, q_heads: int, queries: int, slots: int, ordered: bool,
                 chunk_bytes: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(start, end, visible slots) of each query chunk of a block of ``queries`` over ``slots`` written slots.

    A chunk holds as many queries as keep its float32 score block within ``SCORE_CHUNK_BYTES``. ``ordered``
    (no eviction yet): slots hold positions in order and the block sits in [slots - queries, slots), so a chunk
    ending at block index b sees only slots [0, slots - queries + b) and chunks of ``CAUSAL_CHUNK`` skip more of
    the causal upper triangle; otherwise every chunk sees all slots.
    """
    chunk = max(1, (SCORE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * batch * q_heads * slots))
    if ordered and queries > 1:
        chunk = min(chunk, CAUSAL_CHUNK)
    for a in range(0, queries, chunk):
        b = min(queries, a + chunk)
        yield a, b, (slots - queries + b if ordered else slots)


def workspace_bytes(batch: int, q_heads: int, kv_heads: int, queries: int, slots: int, head_dim: int, *,
                    ordered: bool, padded: bool, elem: int = 4) -> int:
    """Peak bytes one block call of ``attention.batchmax_attention`` (a prefill block, or a decode step with a mask)
    allocates above what it was given: every tensor it (and the kernels it calls) holds at the worst moment, the
    returned output included.

    ``queries`` x ``slots``: the block and the cache's high-water mark; ``padded``: a token mask came with the
    block (the engine's prefill passes one, decode steps none); ``elem``: bytes per element of the model dtype.
    Checked against measured allocations in ``tests/test_memory.py``.
    """
    return _workspace_bytes(batch, q_heads, kv_heads, queries, slots, head_dim, ordered, padded, elem,
                            SCORE_CHUNK_BYTES)


@functools.lru_cache(maxsize=4096)  # called by every attention call: the shapes repeat, the arithmetic need not
def _workspace_bytes(batch: int, q_heads: int, kv_heads: int, queries: int, slots: int, head_dim: int,
                     ordered: bool, padded: bool, elem: int, chunk_bytes: int) -> int:
    B, Hq, Hkv, n, D, e = batch, q_heads, kv_heads, queries, head_dim, elem
    g = Hq // Hkv
    # Held through the loop: the slot positions with empty slots pushed last (int64; a prefill block), or the
    # hidden-slot mask (bool; a decode step), plus the result buffer when the block takes several chunks.
    held = 8 * B * Hkv * slots if n > 1 else B * Hkv * slots
    peak = 0
    for a, b, lim in query_chunks(B, Hq, n, slots, ordered, chunk_bytes):
        m = b - a
        if m < n and a == 0:
            held += e * B * n * Hq * D  # the [B, n, Hq, D] result
        q = e * B * Hq * m * D  # the chunk's scaled queries (and later its output)
        logits = e * B * Hq * m * lim  # q @ k^T in the model dtype
        p = 4 * B * Hq * m * lim  # float32 logits, and the probabilities
        mask = B * Hkv * m * lim if n > 1 else 0  # the visibility mask
        if padded:  # per-query weights [B, g*m], broadcast copy inside matmul, its [B, Hkv, lim] result
            score = 4 * B * g * m + max(B * g * m, 4 * B * Hkv * g * m + 4 * B * Hkv * lim)
        else:
            score = 4 * B * Hkv * lim  # the probabilities summed over the query rows
        steps = [
            q + logits + (p if e != 4 else 0),  # q @ k^T and its float32 copy
            p + mask + p,  # masked logits, mask and probabilities
            p + score,  # score accumulation
            p + (logits if e != 4 else 0) + q,  # probabilities (cast back) @ V
            q + (q if m == n > 1 else 0),  # the output, and its [B, n, Hq, D] copy when one chunk did all
        ]
        peak = max(peak, held + max(steps))
    return peak


@functools.lru_cache(maxsize=4096)
def decode_workspace_bytes(batch: int, q_heads: int, kv_heads: int, slots: int, head_dim: int, elem: int = 4) -> int:
    """Peak bytes of an engine decode step in ``attention.batchmax_attention`` (one query, no mask): the scaled,
    masked logits (model dtype) and the float32 probabilities (a float32 copy of the logits first in half
    precision); then the probabilities with their sum over the query group; then with their cast back and the output.
    """
    B, Hq, Hkv, hi, D, e = batch, q_heads, kv_heads, slots, head_dim, elem
    half = 0 if e == 4 else 4 * B * Hq * hi
    probs = 4 * B * Hq * hi
    return max(e * B * Hq * hi + half + probs, probs + 4 * B * Hkv * hi,
               probs + (0 if e == 4 else e * B * Hq * hi) + e * B * Hq * D)


def probe_state_bytes(batch: int, q_heads: int, window: int, head_dim: int, elem: int) -> int:
    """Bytes of one layer's ``probe.ProbeState``: scaled queries (model dtype), their float32 log-sum-exp over the
    probe's own keys and the float32 query weights."""
    return batch * (q_heads * window * head_dim * elem + q_heads * window * 4 + window * 4)


@functools.lru_cache(maxsize=4096)
def probe_workspace_bytes(batch: int, q_heads: int, kv_heads: int, window: int, slots: int, head_dim: int,
                          elem: int = 4) -> int:
    """An upper bound on the peak bytes of a look-ahead probe pass (``attention._probe_attention``): the scaled
    queries, the logits over the own keys and over the slots (model dtype and float32, with log-sum-exp's
    temporary), the slot mask and per-slot sums, the outputs and their layout copy."""
    B, Hq, Hkv, w, hi, D, e = batch, q_heads, kv_heads, window, slots, head_dim, elem
    return (e * B * Hq * w * D + (e + 4) * B * Hq * w * w + 4 * B * Hq * w + (e + 8) * B * Hq * w * hi
            + 5 * B * Hkv * hi + 3 * e * B * Hq * w * D + 8 * B * w)



def sdpa_workspace_bytes(batch: int, q_heads: int, kv_heads: int, head_dim: int, prompt_len: int,
                         dtype_bytes: int, padded: bool, impl: str = SDPA) -> int:
    """Largest attention temporaries HF's SDPA path materialises beyond Q/K/V and the cache (an estimate).

    Only a padded prompt's prefill allocates any: HF's boolean 4D mask ``[B, 1, s, s]`` and, since SDPA then
    gets a mask, ``repeat_kv`` copies of one layer's keys and values for GQA. Unpadded prefill runs ``is_causal``
    with ``enable_gqa``; decode steps use views (mask) and ``pack_gqa`` (no copy). The kernel's own scratch
    (blockwise on the CPU flash, memory-efficient and FlashAttention kernels) is not counted; with
    FlashAttention-2 (unpadded inputs) this returns 0.
    """
    if impl != SDPA or not padded or prompt_len < 2:
        return 0
    mask = batch * prompt_len * prompt_len  # [B, 1, s, s] bool
    repeat = 2 * batch * q_heads * prompt_len * head_dim * dtype_bytes if q_heads != kv_heads else 0
    return mask + repeat
