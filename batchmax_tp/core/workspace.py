"""Bytes of the temporaries each attention path allocates per call: pure arithmetic on shapes, no torch.

The attention kernels (``attention.batchmax_attention`` and the baselines' SDPA) own these
numbers and the planner (``batchmax_tp.plan.planner``) predicts with them, so they live here, importable without
torch or transformers. They are checked against measured allocations in ``tests/test_memory.py`` and
``tests/test_continuous.py``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

#: Largest attention-probability block materialised at once (bytes of float32 scores); longer query blocks are
#: processed in chunks of queries so prefill never builds an attention matrix over the whole prompt.
SCORE_CHUNK_BYTES = 64 * 2**20
#: The baselines' prompt attention: HF's SDPA, or SDPA with K/V copied per query head.
SDPA = "sdpa"
#: HF's SDPA with K/V copied per query head first (``core.attention._dense_prefill``): a GQA model on a card of
#: compute capability < 8.0, where SDPA's memory-efficient kernel rejects ``enable_gqa`` and the math kernel would
#: materialise every [n, L] score block.
SDPA_REPEAT = "batchmax_sdpa_repeat"


def query_chunks(
    batch: int, q_heads: int, queries: int, slots: int, chunk_bytes: int | None = None
) -> Iterator[tuple[int, int]]:
    """(start, end) of each query chunk of a block of ``queries`` over ``slots`` slots: as many queries as keep its
    float32 score block within ``SCORE_CHUNK_BYTES``."""
    chunk = max(1, (SCORE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * batch * q_heads * slots))
    for a in range(0, queries, chunk):
        yield a, min(queries, a + chunk)


def rows_workspace_bytes(
    rows: int,
    q_heads: int,
    kv_heads: int,
    queries: int,
    slots: int,
    head_dim: int,
    *,
    padded: bool,
    elem: int = 4,
    share: int = 1,
) -> int:
    """Peak bytes one BM prefill call of the engine (``attention._rows_block``, fused) allocates above what it was
    given, the returned output included: ``rows`` rows of ``queries`` columns over ``slots`` slots per storage head
    (``kv_heads``: the storage heads, ``share`` heads each); ``padded``: some column is masked. Checked against
    measured allocations in ``tests/test_continuous.py``."""
    held = _rows_workspace_bytes(rows, q_heads, kv_heads, queries, slots, head_dim, padded, elem, SCORE_CHUNK_BYTES)
    if share == 1:
        return held
    # the other heads' slots: the head tags compared (``head_mask_bytes``), then as an additive float32 mask
    # [R, Hs, G, slots] held through the loop, and the pass's causal mask repeated per head [R, n, n*G]
    other = 4 * rows * kv_heads * share * slots + 4 * rows * queries * queries * share
    return held + other + head_mask_bytes(rows, kv_heads, slots, share)


@functools.lru_cache(maxsize=4096)
def _rows_workspace_bytes(
    R: int, Hq: int, Hs: int, n: int, hi: int, D: int, padded: bool, e: int, chunk_bytes: int
) -> int:
    g = Hq // Hs
    held = 8 * R * Hq // g * n  # the own slots, clamped [R, Hs, n] (int64)
    peak = 0
    for a, b in query_chunks(R, Hq, n, hi, chunk_bytes):
        m = b - a
        if m < n and a == 0:
            held += e * R * n * Hq * D  # the [R, n, Hq, D] result
        q = e * R * Hq * m * D  # the chunk's queries (a copy), later its output
        logits = e * R * Hq * m * hi  # the masked, scaled product in the model dtype
        p = 4 * R * Hq * m * hi  # float32 logits, and the probabilities
        if padded:  # per-query weights [R, g*m], broadcast copy inside matmul, its [R, Hs, hi] result
            score = 4 * R * g * m + max(R * g * m, 4 * R * Hs * g * m + 4 * R * Hs * hi)
        else:
            score = 4 * R * Hs * hi  # the probabilities summed over the query rows
        steps = [
            q + logits,  # the product
            logits + p if e != 4 else 0,  # its float32 copy
            p + score,  # the probabilities (the softmax in place), summed
            p + (logits if e != 4 else 0) + q,  # probabilities (cast back) @ V
            q + (q if m == n else 0),  # the output, and its [R, n, Hq, D] copy when one chunk did all
        ]
        peak = max(peak, held + max(steps))
    return peak


def head_mask_bytes(batch: int, kv_heads: int, slots: int, share: int) -> int:
    """What a pass over a budget shared by ``share`` heads holds to hide each head's slots from the others' queries
    (``bounded.PoolLayer.other_heads``: the rows' head tags gathered and compared, bool [B, Hs, G, T + 1]); 0
    unshared."""
    return 0 if share == 1 else batch * kv_heads * (share + 1) * (slots + 1)


#: Largest slot state one eviction call gathers (bytes): the pool evicts in every layer at once (one call, few
#: kernel launches) unless that would hold more than this, then in groups of layers (``eviction_layers``).
EVICT_CHUNK_BYTES = 256 * 2**20
#: Bytes per (layer, row, head, slot) an eviction holds at once, besides the bias (model dtype): gathered positions
#: (8) and sums (4), a probe's attention (4), the priority (4), the sort key's parts and the key (8 + 8 + 8), and a
#: rule's own temporaries (two float32 and one int64: pooling by position).
_EVICT_ELEMENT_BYTES = 8 + 4 + 4 + 4 + 24 + 16


#: What ranking a slot of a shared budget adds: its head gathered (int8), as int64 and in the pooling and tie keys.
_SHARED_ELEMENT_BYTES = 1 + 8 + 8 + 8 + 8


def eviction_layers(layers: int, rows: int, heads: int, slots: int, elem: int, share: int = 1) -> int:
    """How many layers one eviction call of ``rows`` rows takes at once (at least one)."""
    per_layer = rows * heads * slots * _evict_element_bytes(elem, share)
    return max(1, min(layers, EVICT_CHUNK_BYTES // max(per_layer, 1)))


def _evict_element_bytes(elem: int, share: int) -> int:
    return _EVICT_ELEMENT_BYTES + elem + (0 if share == 1 else _SHARED_ELEMENT_BYTES)


def eviction_workspace_bytes(layers: int, rows: int, heads: int, slots: int, elem: int, share: int = 1) -> int:
    """Upper bound of what one eviction call of BM's pool holds: its layers' gathered slot state and priorities
    (``heads`` x ``slots``: the storage heads' of a budget shared by ``share`` heads)."""
    n = eviction_layers(layers, rows, heads, slots, elem, share)
    return n * rows * heads * slots * _evict_element_bytes(elem, share)


@functools.lru_cache(maxsize=4096)
def decode_workspace_bytes(
    batch: int, q_heads: int, kv_heads: int, slots: int, head_dim: int, elem: int = 4, share: int = 1
) -> int:
    """Peak bytes of an engine decode step in ``attention.batchmax_attention`` (one query, no mask): the scaled,
    masked logits (model dtype) and the float32 probabilities (a float32 copy of the logits first in half
    precision); then the probabilities with their sum over the query group; then with their cast back and the output.
    A budget shared by ``share`` heads (``kv_heads``: the storage heads) first builds each query head's additive
    mask: the head mask, the masked copy [B, Hs, G, hi] and its per-query-head layout (model dtype), at most.
    """
    B, Hq, Hkv, hi, D, e = batch, q_heads, kv_heads, slots, head_dim, elem
    half = 0 if e == 4 else 4 * B * Hq * hi
    probs = 4 * B * Hq * hi
    masks = 0 if share == 1 else head_mask_bytes(B, Hkv, hi, share) + e * B * Hkv * share * hi + e * B * Hq * hi
    return masks + max(
        e * B * Hq * hi + half + probs,
        probs + 4 * B * Hkv * hi,
        probs + (0 if e == 4 else e * B * Hq * hi) + e * B * Hq * D,
    )


def paged_decode_workspace_bytes(
    rows: int, q_heads: int, kv_heads: int, blocks: int, block: int, head_dim: int, elem: int = 4
) -> int:
    """Peak bytes of a paged decode step (``attention._paged_decode``, FKV by real length) of ``rows`` rows over
    ``blocks`` blocks of ``block`` positions, at its largest of: each block's queries and logits (model dtype);
    the float32 logits (a copy in half precision), becoming their exponentials in place, with the rows' maxima
    [S, Hq] and then each block's (the gathered maxima, or the sums); the exponentials with the rows' sums, their
    cast to the model dtype in half precision and each block's output [N, Hq, D]; that output (as float32 too in
    half precision) with the rows' sums and float32 output [S, Hq, D]; the output's cast back in half precision."""
    S, N, Hq, D, e = rows, blocks, q_heads, head_dim, elem
    half = e != 4
    logits = 4 * N * Hq * block  # float32
    return max(
        N * Hq * (D + block) * e,
        logits + (N * Hq * block * e if half else 0),
        logits + 4 * (S + N) * Hq,
        logits + 4 * S * Hq + (N * Hq * block * e if half else 0) + N * Hq * D * e,
        4 * S * Hq + N * Hq * D * e + 4 * S * Hq * D + (4 * N * Hq * D if half else 0),
        4 * S * Hq + 4 * S * Hq * D + (S * Hq * D * e if half else 0),
    )


def probe_state_bytes(batch: int, q_heads: int, window: int, head_dim: int, elem: int) -> int:
    """Bytes of one layer's ``probe.ProbeState``: scaled queries (model dtype), their float32 log-sum-exp over the
    probe's own keys and the float32 query weights."""
    return batch * (q_heads * window * head_dim * elem + q_heads * window * 4 + window * 4)


@functools.lru_cache(maxsize=4096)
def probe_workspace_bytes(
    batch: int, q_heads: int, kv_heads: int, window: int, slots: int, head_dim: int, elem: int = 4, share: int = 1
) -> int:
    """An upper bound on the peak bytes of a look-ahead probe pass (``attention._probe_attention``): the scaled
    queries, the logits over the own keys and over the slots (model dtype and float32, the latter turned into the
    probabilities in place: ``probe.slot_probabilities``), the slot mask and per-slot sums, the outputs and their
    layout copy."""
    B, Hq, Hkv, w, hi, D, e = batch, q_heads, kv_heads, window, slots, head_dim, elem
    return (
        head_mask_bytes(B, Hkv, hi, share)
        + e * B * Hq * w * D
        + (e + 4) * B * Hq * w * w
        + 4 * B * Hq * w
        + (e + 4) * B * Hq * w * hi
        + 5 * B * Hkv * hi
        + 3 * e * B * Hq * w * D
        + 8 * B * w
    )


def dense_impl(q_heads: int, kv_heads: int, elem: int, device) -> str:
    """How a baseline's prompt runs on SDPA (``attention._dense_prefill``) on ``device`` (a ``torch.device``):
    ``SDPA_REPEAT`` (K/V copied per query head first) for GQA in a half dtype on a card below compute capability
    8.0, where SDPA's memory-efficient kernel rejects ``enable_gqa`` and the math kernel would hold every score;
    else ``SDPA``."""
    if device.type != "cuda":
        return SDPA
    import torch  # (only a CUDA device asks: this module stays importable without torch)

    old_card = torch.cuda.get_device_capability(device) < (8, 0)
    return SDPA_REPEAT if q_heads != kv_heads and elem == 2 and old_card else SDPA


#: SDPA's memory-efficient CUDA kernel wants every stride of an additive mask but the last to be a multiple of this
#: many elements; torch copies any other mask into rows padded to the next multiple (``preprocess_mask``). The CPU
#: kernel reads the mask as it is.
MASK_ALIGN = 8


@functools.lru_cache(maxsize=4096)  # the baselines note one pass at a time: the shapes repeat
def dense_workspace_bytes(
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    queries: int,
    slots: int,
    elem: int,
    *,
    padded: bool,
    impl: str = SDPA,
    align: bool = True,
) -> int:
    """Peak bytes one SDPA call of the baselines (FKV/ED, ``core.attention._dense_prefill``) allocates above the
    queries, keys, values and the cache: every tensor HF's attention function (``sdpa_attention_forward``) and
    the kernel's wrapper hold at the worst moment of a layer's call, the returned output included, plus a mask
    built for the pass, which every layer's call finds held. The fused kernel's own scratch (the CPU flash
    kernel's per-thread blocks) is not counted. Checked against measured allocations in ``tests/test_memory.py``
    (the CUDA alignment copy excepted).

    ``queries`` x ``slots``: the pass's queries and the keys they attend over (a baseline's prefill is one block:
    both the prompt; a decode step: 1 x the slots held); ``padded``: the pass gets a mask (held slots include a
    pad); ``elem``: bytes per element of the model dtype; ``align``: count the
    memory-efficient CUDA kernel's copy of a mask whose rows are not ``MASK_ALIGN``-aligned (False: the CPU).
    ``impl``: ``"sdpa"`` (:func:`_sdpa_workspace_bytes`, which says what it counts) or ``SDPA_REPEAT`` (K/V
    copied per query head, then SDPA's count).
    """
    if impl == SDPA_REPEAT:  # K and V copied per query head, then SDPA over as many KV heads as query heads
        copies = 2 * elem * batch * q_heads * slots * head_dim if q_heads != kv_heads else 0
        return copies + _sdpa_workspace_bytes(batch, q_heads, q_heads, head_dim, queries, slots, elem, padded, align)
    if impl != SDPA:
        raise ValueError(f"no workspace count for attention implementation {impl!r}")
    return _sdpa_workspace_bytes(batch, q_heads, kv_heads, head_dim, queries, slots, elem, padded, align)


@functools.cache
def sdpa_packs_gqa() -> bool:
    """Whether HF's SDPA attention packs a masked decode step's query heads per KV head (``pack_gqa``: transformers
    5.24) instead of copying K and V per query head (``repeat_kv``: 5.17). Read from the code of the transformers
    that ``import`` would find first on ``sys.path``, not its version string, without importing it (this module
    stays free of torch); True where none is found there."""
    for root in sys.path:
        source = Path(root or ".") / "transformers" / "integrations" / "sdpa_attention.py"
        if source.is_file():
            return "def pack_gqa(" in source.read_text(encoding="utf-8")
    return True


def _sdpa_workspace_bytes(B: int, Hq: int, Hkv: int, D: int, n: int, L: int, e: int, padded: bool, align: bool) -> int:
    """SDPA: without a mask, ``is_causal`` and ``enable_gqa`` (no copies): the kernel's output and its float32
    log-sum-exp (the output takes the queries' memory layout, [B, n, Hq, D] as HF's projections are viewed and
    transposed, so HF's transpose back is a view). With one (a padded prefill: HF's boolean [B, 1, n, L]; a decode
    step holding pads: a view of the cache's), also GQA's ``repeat_kv`` copies of K and V (prefill; a decode step
    packs the query heads instead), the mask converted to an additive one in the model dtype inside
    ``scaled_dot_product_attention``, and on CUDA its aligned copy."""
    out, lse = e * B * Hq * n * D, 4 * B * Hq * n  # the kernel's output and float32 log-sum-exp
    if not padded:
        return out + lse
    held = B * n * L if n > 1 else 0  # HF's boolean [B, 1, n, L] mask (a decode step's is the cache's view)
    # repeat_kv's K and V (a decode step packs the query heads instead where HF has pack_gqa: 5.24, not 5.17)
    repeat = 2 * e * B * Hq * L * D if Hq != Hkv and (n > 1 or not sdpa_packs_gqa()) else 0
    additive = e * B * n * L  # the boolean mask made additive in the model dtype
    aligned = e * B * n * (L + MASK_ALIGN - L % MASK_ALIGN) if align and L % MASK_ALIGN else 0
    return held + repeat + max(additive + aligned, (aligned or additive) + out + lse)


def snap_workspace_bytes(
    batch: int, q_heads: int, kv_heads: int, head_dim: int, prompt: int, window: int, kept: int, elem: int
) -> int:
    """Peak bytes a compress pass (``snap``, ``core.snap``) allocates above the pass's queries, keys and values and
    the pool, per layer's call, at most: SDPA's output and log-sum-exp (``dense_workspace_bytes``, unpadded), alive
    while the window's choice is made (``choice_workspace_bytes``). An upper bound: these phases are counted as if
    alive together."""
    sdpa = _sdpa_workspace_bytes(batch, q_heads, kv_heads, head_dim, prompt, prompt, elem, padded=False, align=False)
    return sdpa + choice_workspace_bytes(batch, q_heads, kv_heads, head_dim, prompt, window, kept, elem)


def choice_workspace_bytes(
    batch: int, q_heads: int, kv_heads: int, head_dim: int, prompt: int, window: int, kept: int, elem: int
) -> int:
    """Snap's choice of ``batch`` rows' ``prompt`` pairs: the window's queries copied and scored (their logits in the
    model dtype, a float32 copy of them in a half dtype, the float32 softmax, the per-pair sums), then the choice (a
    few [rows, heads, prompt] int64 and float32 tensors: the pooled scores, the stable sort's values and indices) and
    the kept pairs gathered (K and V, their positions and sums). An upper bound: counted as if alive together."""
    B, Hq, Hkv, D, s, w, K, e = batch, q_heads, kv_heads, head_dim, prompt, min(window, prompt), kept, elem
    logits = B * Hq * w * s * (e + (4 if e != 4 else 0) + 4)  # the product, its float32 copy, the softmax
    scoring = e * B * Hq * w * D + logits + 4 * B * Hkv * s
    choosing = B * Hkv * s * (4 + 4 + 4 + 8)  # the prefix copied, pooled, sorted (values, indices)
    keeping = B * Hkv * K * (2 * e * D + 8 + 8 + 4)  # K and V, positions (and their index), sums
    return scoring + choosing + keeping


@functools.lru_cache(maxsize=4096)
def chunk_workspace_bytes(
    rows: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    queries: int,
    held: int,
    block: int,
    elem: int,
    gqa: bool,
    own: bool = False,
    masked: bool = True,
) -> int:
    """Peak bytes of one layer's call of a chunked prefill pass (FKV, snap; ``attention._chunked``): ``rows`` rows of
    ``queries`` columns over their first ``held`` pairs, kept in blocks of ``block`` positions: the additive mask
    [R, 1, n, held] the pass holds (model dtype, built once), the rows' blocks gathered ([R x blocks, H, Bs, D], K and
    V) and laid out per head ([R, H, held, D], a second copy when a row holds more than one block), K/V copied per
    query head where SDPA gets no ``enable_gqa`` (``gqa`` False: off the CPU), and SDPA's output and float32
    log-sum-exp. ``own``: the rows hold nothing before the pass (its own pairs, nothing gathered); ``masked``: the
    pass has a mask (one row of real tokens holding nothing before has none: causal)."""
    R, Hq, Hkv, D, n, L, e = rows, q_heads, kv_heads, head_dim, queries, held, elem
    nb = -(-L // block)
    gathered = 0 if own else 2 * e * R * Hkv * D * (L if nb == 1 else 2 * nb * block)  # K and V
    repeat = 0 if gqa or Hq == Hkv else 2 * e * R * Hq * L * D
    return (e * R * n * L if masked else 0) + gathered + repeat + e * R * Hq * n * D + 4 * R * Hq * n
