"""Memory planner: predict a run's peak memory from shapes alone, and the most slots that fit a budget.

Every run is a pool of slots (``core.pool``: continuous batching, or the paper's padded batches in as many slots as
the batch has rows), so one prediction serves both (``predict_pool``; ``predict``/``max_batch`` name it for a padded
batch). Counted, per rank:
- ``kv``: the pool's K/V (what ``ServeOutput.peak_kv_bytes`` measures), allocated once: ``slots`` rows of C + 1
  slots (BM and ED ``kv_max``, FKV the longest prompt + generation) per layer and local KV head;
- ``slot_meta``: BM's bookkeeping (``ServeOutput.peak_meta_bytes``): per slot its position, attention sum, additive
  mask and free list, and for a rule with a look-ahead probe its per-slot values and (``every > 1``) stored queries;
- ``workspace``: the peak of one attention call (``core.workspace``: BM's query chunks bounded by
  ``SCORE_CHUNK_BYTES``, a decode pass's fused product, a baseline prompt's SDPA), as the attention reports it and
  ``tests/test_memory.py`` holds to the allocations measured on CPU and, on CUDA, ``torch.cuda.max_memory_allocated``;
- ``weights`` and ``activations``: the model's parameters (split by tensor parallelism) and an estimate of one
  forward's live activations; exact on no machine, checked against ``torch.cuda.max_memory_allocated`` on GPU.

Under tensor parallelism heads and MLP columns are divided by ``tp`` (KV heads unevenly, as AutoTP does: rank 0 holds
the most, which is what a budget must fit).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

from ..core.method import BLOCK, Method, chunk_blocks
from ..core.schedule import plan
from ..core.workspace import (
    SDPA,
    SDPA_REPEAT,
    choice_workspace_bytes,
    chunk_workspace_bytes,
    decode_workspace_bytes,
    dense_workspace_bytes,
    eviction_workspace_bytes,
    paged_decode_workspace_bytes,
    probe_state_bytes,
    probe_workspace_bytes,
    rows_workspace_bytes,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int
    tied: bool = False  # input and output embeddings share one matrix

    @classmethod
    def from_config(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        h, i, v, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
        attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
        per_layer = attn + 3 * h * i + 2 * h
        tied = bool(getattr(config, "tie_word_embeddings", False))
        embed = v * h * (1 if tied else 2)
        return cls(L, h, i, heads, kv_heads, head_dim, v, L * per_layer + embed + h, tied)

    def weights_per_rank(self, tp: int) -> int:
        """Parameters on the fullest rank, split as DeepSpeed AutoTP splits them: attention by whole KV groups
        (unevenly), MLP columns and the lm_head's input features in grains of 64 (the tail to the last rank);
        the input embedding and the norms stay whole on every rank."""
        if tp == 1:
            return self.params
        h, d = self.hidden, self.head_dim
        per_rank = []
        for rank in range(tp):
            kv = self.kv_heads // tp + (1 if rank < self.kv_heads % tp else 0)
            q = kv * (self.heads // self.kv_heads)
            inter = _grain_shard(self.intermediate, tp, rank)
            per_layer = 2 * h * q * d + 2 * h * kv * d + 3 * h * inter + 2 * h
            per_rank.append(self.layers * per_layer + self.vocab * h + self.vocab * _grain_shard(h, tp, rank) + h)
        return max(per_rank)

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) on the rank holding the most, as AutoTP splits whole KV groups."""
        kv = math.ceil(self.kv_heads / tp)
        return kv * (self.heads // self.kv_heads), kv


def _grain_shard(total: int, tp: int, rank: int, grain: int = 64) -> int:
    """AutoTP's share of ``total`` features for ``rank`` outside attention (DeepSpeed's ``get_shard_size``)."""
    if total < grain:
        return total // tp + (1 if rank < total % tp else 0)
    grains, tail = divmod(total, grain)
    share = (grains // tp + (1 if rank < grains % tp else 0)) * grain
    return share + (tail if rank == tp - 1 else 0)


@dataclass(frozen=True)
class MemoryEstimate:
    kv: int
    workspace: int
    weights: int
    activations: int
    slot_meta: int = 0  # BM's bookkeeping at the peak pass (``bookkeeping_bytes`` is its most over the run)

    @property
    def total(self) -> int:
        return self.kv + self.workspace + self.weights + self.activations + self.slot_meta

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _per_token(shape: ModelShape, tp: int, nbytes: int) -> int:
    """Live bytes per token in one decoder layer: residual + normed hidden, q/k/v/out projections, 3 MLP
    intermediates (local heads and columns under tensor parallelism)."""
    q_heads, kv_heads = shape.local_heads(tp)
    local_inter = math.ceil(shape.intermediate / tp)
    return (3 * shape.hidden + (q_heads + 2 * kv_heads) * shape.head_dim + 3 * local_inter) * nbytes


def predict_pool(
    shape: ModelShape,
    method: Method,
    slots: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    tp: int = 1,
    dtype: str = "float32",
    pass_tokens: int | None = None,
) -> MemoryEstimate:
    """Peak memory per rank of continuous batching (``core.engine``) in ``slots`` slots, for requests of at most
    ``prompt_len`` prompt tokens and ``max_new_tokens`` new tokens (``pass_tokens``: BM's prefill pass size as
    ``serve`` takes it). Constant for the whole run:

    - ``kv``: the pool's K/V, allocated once -- ``slots`` rows of C + 1 slots (C: BM and ED ``kv_max``, FKV the
      longest prompt + generation; the extra scratch slot takes idle rows' writes);
    - ``slot_meta``: BM's per-slot position, attention sum, additive mask and free list for every row, plus the
      look-ahead probe's prefill-only buffers of the one slot being prefilled;
    - activations and workspace of a decode pass over all slots (every row attending over its whole capacity),
      held for the whole run (a decode pass captured as a CUDA graph keeps them in the graph's memory; an upper
      bound for an eager pass), plus the largest of a prefill pass (a dense slot's: batch 1, the longest prompt;
      BM's batched passes) and, for BM, one eviction call (``workspace.eviction_workspace_bytes``, every row
      evicting at once).
    """
    nbytes = DTYPE_BYTES[dtype]
    q_heads, kv_heads = shape.local_heads(tp)
    per_token = _per_token(shape, tp, nbytes)
    weights = shape.weights_per_rank(tp) * nbytes
    cap = method.decode_capacity(prompt_len, max_new_tokens)
    G = method.group(kv_heads)  # heads sharing one budget: Hs storage heads of T = G x cap slots
    Hs, T = kv_heads // G, G * cap
    kv = _pool_kv_bytes(shape, slots, T, Hs, nbytes)  # budgets across layers: the same slots in all (their sum)
    runs = _layer_runs(shape, method, cap)
    widest = G * max(c for _, c in runs)  # the layer whose attention calls are the largest
    decode = (
        slots * per_token + slots * shape.vocab * 4,
        decode_workspace_bytes(slots, q_heads, Hs, widest, shape.head_dim, nbytes, G) if max_new_tokens > 1 else 0,
        0,
    )
    if method.paged:  # the memory of ``slots`` rows, in blocks, and the scratch block
        blocks = slots * method.blocks(prompt_len, max_new_tokens) + 1
        kv = 2 * shape.layers * blocks * kv_heads * method.block * shape.head_dim * nbytes
        ws = paged_decode_workspace_bytes(slots, q_heads, kv_heads, blocks, method.block, shape.head_dim, nbytes)
        decode = (decode[0], ws if max_new_tokens > 1 else 0, 0)
    tokens = method.pass_tokens(slots) if pass_tokens is None else pass_tokens
    if tokens is not None and not method.bounded_prefill:  # FKV and snap prefilled in chunks
        kv += _transient_kv_bytes(shape, method, prompt_len, kv_heads, nbytes)
        activations, workspace = _chunked_prefill(shape, method, slots, prompt_len, tokens, tp, nbytes)
        meta = pool_bookkeeping_bytes(shape, method, slots, prompt_len, tp=tp, dtype=dtype)
        return MemoryEstimate(kv, workspace + decode[1], weights, activations + decode[0], meta)
    if tokens is None:  # one group of one prompt length per prefill pass (FKV, ED; snap keeps its choice after)
        activations, workspace, _ = _dense_slot_prefill(shape, prompt_len, tp, nbytes)
        compress = method.prefill_workspace_bytes(q_heads, kv_heads, shape.head_dim, prompt_len, nbytes)
        meta = pool_bookkeeping_bytes(shape, method, slots, prompt_len, tp=tp, dtype=dtype)
        return MemoryEstimate(kv, max(workspace, compress) + decode[1], weights, activations + decode[0], meta)
    meta = pool_bookkeeping_bytes(shape, method, slots, prompt_len, tp=tp, dtype=dtype)
    passes = _pool_prefill_passes(shape, method, slots, tokens, q_heads, kv_heads, nbytes, per_token, prompt_len)
    evicting = (0, max(eviction_workspace_bytes(n, slots, Hs, G * c, nbytes, G) for n, c in runs))  # per group
    activations, workspace = max([*passes, evicting], key=sum)
    return MemoryEstimate(kv, workspace + decode[1], weights, activations + decode[0], meta)


def _transient_kv_bytes(shape: ModelShape, method: Method, prompt_len: int, kv_heads: int, nbytes: int) -> int:
    """Snap prefilled in chunks: the blocks holding ``Snap.prefills`` prompts' full pairs while they prefill, and the
    scratch block (``bounded.SnapPool``); 0 for the others."""
    if not method.transient_blocks or not method.blocks(prompt_len, 1):
        return 0
    blocks = method.prefills * method.blocks(prompt_len, 1) + 1
    return 2 * shape.layers * blocks * kv_heads * BLOCK * shape.head_dim * nbytes


def _chunked_prefill(
    shape: ModelShape, method: Method, slots: int, prompt_len: int, tokens: int, tp: int, nbytes: int
) -> tuple[int, int]:
    """(activations, attention workspace) of the largest chunked prefill pass of FKV or snap (``slots.chunk_pass``): one
    of the longest prompt's chunks (one row: its columns over the pairs held by its end; its first over its own
    pairs, causal, nothing gathered), or whole short prompts side by side (as many rows of ``prompt_len`` columns as
    ``tokens`` holds: their own pairs, masked); snap's last chunk also makes its choice over the whole prompt
    (``workspace.choice_workspace_bytes``). A shorter prompt's chunks are no larger. K/V copied per query head where
    SDPA gets no ``enable_gqa`` (counted for a half dtype, a card's)."""
    q_heads, kv_heads = shape.local_heads(tp)
    per_token, D, e = _per_token(shape, tp, nbytes), shape.head_dim, nbytes
    block = method.block if method.paged else (BLOCK if method.transient_blocks else prompt_len + 1)
    gqa = not (nbytes == 2 and q_heads != kv_heads)
    heads = (q_heads, kv_heads, D)
    # a lone row's consecutive chunks run as one pass while they fit ``tokens`` (``Scheduler._first_block``)
    merged = max(method.chunk, tokens // method.chunk * method.chunk)
    blocks = chunk_blocks(prompt_len, merged, getattr(method, "window", 1))
    passes = [(1, b - a, b, a == 0, a > 0) for a, b in blocks]  # rows, columns, held, own pairs, masked
    # whole prompts side by side (snap: as many as its blocks hold at once, ``Snap.prefills``)
    side = min(slots, tokens // prompt_len, method.prefills if method.transient_blocks else slots)
    if side > 1:
        passes.append((side, prompt_len, prompt_len, True, True))
    out = []
    for R, n, held, own, masked in passes:
        ws = chunk_workspace_bytes(R, *heads, n, held, block, e, gqa, own, masked)
        if method.transient_blocks and held == prompt_len:  # snap's last chunk: its choice
            kept = min(prompt_len, method.kv_max)
            ws += choice_workspace_bytes(1, *heads, prompt_len, method.window, kept, e)
        out.append((R * n * per_token + R * shape.vocab * 4, ws))
    return max(out, key=sum)


def _layer_runs(shape: ModelShape, method: Method, cap: int) -> list[tuple[int, int]]:
    """(layers, slots per head) of each run of layers of one budget: one run of every layer at ``cap``, or with budgets
    across layers (a rule's ``taper``) each of the pool's layer groups (``layered.LayeredPool``)."""
    capacities = method.layer_capacities(shape.layers) or (cap,) * shape.layers
    return [(len(list(run)), c) for c, run in itertools.groupby(capacities)]


def _pool_prefill_passes(
    shape: ModelShape,
    method: Method,
    slots: int,
    tokens: int,
    q_heads: int,
    kv_heads: int,
    nbytes: int,
    per_token: int,
    prompt_len: int,
) -> list[tuple[int, int]]:
    """(activations, attention workspace) of BM's batched prefill passes at their largest: R rows of n columns
    (``R * n <= tokens``, the pass size, n <= p) over all ``kv_max`` slots (a shared budget: its storage heads'
    G x ``kv_max``), the rows' slot state gathered (rows that are not adjacent). A rule with a look-ahead probe
    folds it into the pass (``attention._folded``): w more columns per row (the rule's window), whose probe attends
    after the chunk, the chunk's output held, then both outputs joined. A row prefilling alone runs its first block
    in one pass (R = 1, n = ``kv_max`` or the whole prompt when shorter)."""
    G = method.group(kv_heads)
    widest = max(c for _, c in _layer_runs(shape, method, method.kv_max))  # budgets across layers: the largest
    C, D, V, H, w, e = G * widest, shape.head_dim, shape.vocab, kv_heads // G, method.lookahead, nbytes
    passes = []
    blocks = range(1, method.p + 1) if method.wide else [*range(1, method.p + 1), min(method.kv_max, prompt_len)]
    for n in blocks:
        R = min(slots, max(1, tokens // (n + w))) if n <= method.p else 1
        gathered = R * H * C * (2 * D * e + 4 + e)  # keys, values, sums and additive mask of the rows
        ws = gathered + rows_workspace_bytes(R, q_heads, H, n, C, D, padded=True, elem=e, share=G)
        if w:
            chunk_out = e * R * n * q_heads * D
            probe_in = e * R * (q_heads + 2 * kv_heads) * w * D  # the probing rows' queries, keys, values
            probe_gathered = R * H * C * (2 * D * e + 8)  # keys, values and positions of the rows
            probe = probe_gathered + probe_workspace_bytes(R, q_heads, H, w, C, D, e, G) + chunk_out + probe_in
            joined = chunk_out + 3 * e * R * w * q_heads * D + e * R * (n + w) * q_heads * D
            ws = max(ws, probe, joined)
        if method.wide:  # its blocks one after another over ``tokens`` columns: their outputs held, an eviction's
            N = max(R * (n + w), min(tokens, slots * (prompt_len + w * -(-prompt_len // method.p))))
            ws += 2 * e * N * q_heads * D + eviction_workspace_bytes(1, R, H, C, e, G)
            passes.append((N * per_token + R * V * 4, ws))
            continue
        passes.append((R * (n + w) * per_token + R * V * 4, ws))
    return passes


def _pool_kv_bytes(shape: ModelShape, slots: int, cap: int, kv_heads: int, nbytes: int) -> int:
    """A pool's K/V: ``slots`` rows of ``cap`` + 1 slots per (storage) head (the scratch slot takes idle rows'
    writes)."""
    return 2 * slots * shape.layers * kv_heads * (cap + 1) * shape.head_dim * nbytes


def _dense_slot_prefill(shape: ModelShape, prompt_len: int, tp: int, nbytes: int) -> tuple[int, int, int]:
    """(activations, attention workspace, bookkeeping) of an FKV/ED pool's slot prefill: unpadded, causal SDPA (the
    "batchmax" attention hands it over: no mask, no K/V copies; on a card below compute capability 8.0 a GQA
    model's K/V copied per query head, ``core.attention._dense_prefill``)."""
    q_heads, kv_heads = shape.local_heads(tp)
    paths = [SDPA, SDPA_REPEAT] if nbytes == 2 and q_heads != kv_heads else [SDPA]  # the card's, at its worst
    D, L = shape.head_dim, prompt_len
    return (
        prompt_len * _per_token(shape, tp, nbytes) + shape.vocab * 4,
        max(dense_workspace_bytes(1, q_heads, kv_heads, D, L, L, nbytes, padded=False, impl=i) for i in paths),
        0,
    )


def pool_bookkeeping_bytes(
    shape: ModelShape, method: Method, slots: int, prompt_len: int, *, tp: int = 1, dtype: str = "float32"
) -> int:
    """The bookkeeping a BM pool holds (what ``ServeOutput.peak_meta_bytes`` measures): every row's position,
    attention sum, additive mask and free list; for a rule with a probe, every row's probe values and, for a rule
    that re-scores (probing every few blocks, or ranking decode evictions by its probe), every row's stored probe
    queries (from the first probe pass on, so only when a prompt of ``prompt_len`` tokens probes at all); under
    ``recall=window`` every row's window of prompt queries; 0 for FKV/ED."""
    q_heads, kv_heads = shape.local_heads(tp)
    nbytes = DTYPE_BYTES[dtype]
    G = method.group(kv_heads)
    per_slot = method.slot_state_bytes(nbytes, G)
    if not per_slot:
        return 0
    held = slots * shape.layers * (kv_heads // G) * (G * method.kv_max + 1) * per_slot
    probes = any(ph.kind == "probe" for ph in plan(method, prompt_len, 1))
    if probes and method.stores_probe:
        held += slots * shape.layers * probe_state_bytes(1, q_heads, method.lookahead, shape.head_dim, nbytes)
    if method.recall_window:  # recall=window: every row's last prompt queries, from its first prefill pass on
        held += slots * shape.layers * q_heads * method.recall_window * shape.head_dim * nbytes
    return held


def paper_ed_bytes(
    shape: ModelShape, batch: int, prompt_len: int, max_new_tokens: int, *, tp: int = 1, dtype: str = "float32", p=64
) -> int:
    """The peak per rank of the paper's ED (kv_max 2) on a padded batch: its prefill caches every prompt's pairs, in
    every layer, until the first decode step (HF generate on a static batch), where this engine's ED holds only its
    slots (``predict_pool``). The paper's procedure defines its memory budget by it (b0: the smallest batch it does
    not fit, ``tuner.planned_b0``)."""
    est = predict_pool(shape, Method("ed", kv_max=2, p=p), batch, prompt_len, max_new_tokens, tp=tp, dtype=dtype)
    _, kv_heads = shape.local_heads(tp)
    return est.total + 2 * batch * shape.layers * kv_heads * prompt_len * shape.head_dim * DTYPE_BYTES[dtype]


def max_slots(
    budget_bytes: int,
    shape: ModelShape,
    method: Method,
    prompt_len: int,
    max_new_tokens: int,
    *,
    tp: int = 1,
    dtype: str = "float32",
    limit: int = 1 << 16,
    pass_tokens: int | None = None,
) -> int:
    """The most slots whose pool (``predict_pool``) fits ``budget_bytes`` (0 if not even one does)."""
    kw = dict(tp=tp, dtype=dtype, pass_tokens=pass_tokens)
    return _largest(
        lambda n: predict_pool(shape, method, n, prompt_len, max_new_tokens, **kw).total <= budget_bytes, limit
    )


def max_prompt_len(
    budget_bytes: int,
    shape: ModelShape,
    method: Method,
    max_new_tokens: int,
    *,
    slots: int = 1,
    tp: int = 1,
    dtype: str = "float32",
    limit: int = 1 << 24,
) -> int:
    """The longest prompt (tokens) whose pool of ``slots`` slots (``predict_pool``) fits ``budget_bytes``: 0 if not
    even a one-token prompt does, ``limit`` when every length up to it does. FKV and snap hold a prompt's pairs (FKV
    keeps them, snap holds them while it prefills, then compresses), and in one pass (``chunk=0``, and ED) its
    activations too, so they hold prompts up to a length; BM prefills in blocks over its ``kv_max`` slots, so its
    peak stops growing at ``kv_max`` tokens and a budget that fits one of its slots holds every length."""
    fits = lambda n: predict_pool(shape, method, slots, n, max_new_tokens, tp=tp, dtype=dtype).total <= budget_bytes  # noqa: E731
    return _largest(fits, limit)


def _largest(fits, limit: int) -> int:
    """The largest n in [1, limit] with ``fits(n)`` (0 if none), for a ``fits`` that stays false once false."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # peak grows with the batch, so bisection finds the boundary
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def parse_bytes(text: str | int) -> int:
    """'24GiB', '512MiB', '1.5GB', '123456' -> bytes."""
    if isinstance(text, int):
        return text
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise ValueError(f"cannot read a byte size from {text!r} (examples: 24GiB, 512MiB, 1000000)")
    return int(value * units[unit])


#: A padded batch of ``batch`` prompts padded to ``prompt_len`` tokens runs in a pool of ``batch`` slots.
predict = predict_pool
max_batch = max_slots
