"""Memory planner: predict a run's peak memory from shapes alone, and the largest batch that fits a budget.

Three parts are counted:
- ``kv``: the K/V buffers (what ``BatchMaxCache.peak_kv_bytes`` measures): BM ``kv_max`` slots, ED the whole
  prompt during prefill, FKV prompt + generation, per (sample, local KV head, layer);
- ``slot_meta``: BM's bookkeeping (what ``BatchMaxCache.peak_meta_bytes`` measures): per slot its position, attention
  sum and additive mask for the whole run; for a rule with a look-ahead probe, during prefill only, the probe's
  per-slot values and (``every > 1``) its stored queries (``core.probe.ProbeState``) once the first probe pass ran;
- ``workspace``: the peak of one "batchmax" attention call, every tensor it allocates at its worst moment
  (``core.workspace.workspace_bytes``: one query chunk's float32 logits and probabilities, visibility mask, scaled
  queries and output, the slot positions, the [B, n, Hq, D] result), bounded by the query chunking of
  ``core.workspace.SCORE_CHUNK_BYTES``. The attention reports the same count (``BatchMaxCache.peak_workspace_bytes``),
  and ``tests/test_memory.py`` holds both to the allocations measured on CPU (float32: equal, call by call) and,
  on CUDA, to ``torch.cuda.max_memory_allocated``; for FKV/ED, which run on the model's SDPA or FlashAttention-2
  (``core.baseline``), ``core.workspace.dense_workspace_bytes`` of their largest pass (a padded prefill: HF's 4D
  mask, its additive copy and GQA's K/V copies, or FlashAttention-2's gathered Q/K/V; an FKV decode step holding
  pads: FlashAttention-2's copies of the layer's whole K/V), held to measured allocations the same way;
- ``weights`` and ``activations``: the model's parameters (split by tensor parallelism) and an estimate of one
  forward's live activations; exact on no machine, checked against ``torch.cuda.max_memory_allocated`` on GPU.

Everything is per rank: under tensor parallelism heads and MLP columns are divided by ``tp`` (KV heads unevenly,
as AutoTP does: rank 0 holds the most, which is what a budget must fit).

BM's peak is found pass by pass (``core.schedule.plan``: prefill blocks, probe passes, decode steps): K/V and the
run-long bookkeeping, plus the pass's activations, attention workspace and the prefill-only probe buffers alive
then; the estimate reports the parts of the largest pass. A rule costs what it holds when it holds it: the first,
longest block runs before any probe state exists, and probe passes are passes of their own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..core.method import Method
from ..core.schedule import Phase, plan
from ..core.workspace import (
    FLASH,
    SDPA,
    SDPA_REPEAT,
    decode_workspace_bytes,
    dense_workspace_bytes,
    eviction_workspace_bytes,
    probe_state_bytes,
    probe_workspace_bytes,
    workspace_bytes,
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


def predict(
    shape: ModelShape,
    method: Method,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    tp: int = 1,
    dtype: str = "float32",
) -> MemoryEstimate:
    """Peak memory per rank of generating ``max_new_tokens`` for ``batch`` prompts padded to ``prompt_len``."""
    nbytes = DTYPE_BYTES[dtype]
    q_heads, kv_heads = shape.local_heads(tp)
    cap = method.capacity(prompt_len, max_new_tokens)
    kv = 2 * batch * shape.layers * kv_heads * cap * shape.head_dim * nbytes
    # Live in one decoder layer (``_per_token``); logits of the last position only (logits_to_keep=1) in
    # float32 (a probe pass makes none).
    per_token = _per_token(shape, tp, nbytes)
    logits = batch * shape.vocab * 4
    weights = shape.weights_per_rank(tp) * nbytes
    if not method.reads_scores:  # FKV/ED run on the model's SDPA or FlashAttention-2 with a DenseCache
        # (core.baseline): no score blocks, no per-slot bookkeeping; worst case a padded batch (HF's prefill mask,
        # FKV's decode mask).
        workspace = baseline_workspace(shape, method, batch, prompt_len, max_new_tokens, tp=tp, dtype=dtype)
        slot_meta = batch * cap if not method.evicts and max_new_tokens > 1 else 0  # FKV's bool decode mask
        activations = batch * prompt_len * per_token + logits
        return MemoryEstimate(kv, workspace, weights, activations, slot_meta)

    phases = plan(method, prompt_len, 1)  # the prefill blocks and probe passes
    held, probe_values, state = _bookkeeping(shape, method, batch, phases, cap, q_heads, kv_heads, nbytes)
    passes = _prefill_passes(
        shape, method, batch, phases, cap, q_heads, kv_heads, nbytes, per_token, probe_values, state
    )
    if max_new_tokens > 1:  # decode steps: one query over the slots held (never more than cap), no mask
        decode_slots = min(cap, prompt_len + max_new_tokens - 1)
        passes.append(
            (
                batch * per_token + logits,
                decode_workspace_bytes(batch, q_heads, kv_heads, decode_slots, shape.head_dim, nbytes),
                0,
            )
        )
    activations, workspace, transient = max(passes, key=sum)
    return MemoryEstimate(kv, workspace, weights, activations, held + transient)


def baseline_workspace(
    shape: ModelShape,
    method: Method,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    tp: int = 1,
    dtype: str = "float32",
    padded: bool = True,
    impls: tuple[str, ...] | None = None,
) -> int:
    """The largest attention workspace per rank of an FKV/ED pass (``core.workspace.dense_workspace_bytes``): the
    prefill (one block over the prompt) or a decode step (FKV's last: over prompt + generation, the prompt's pads
    still held when ``padded``; ED's: no pad left after its first eviction). ``impls``: the attention
    implementations the run may get (``core.baseline.fastest_attention``; default ``half_dtype_impls``).
    ``padded``: a left-padded batch, the worst case (FlashAttention-2 counted as if every pair were real,
    an upper bound); False: no pad, no mask."""
    nbytes = DTYPE_BYTES[dtype]
    q_heads, kv_heads = shape.local_heads(tp)
    if impls is None:
        impls = half_dtype_impls(nbytes, q_heads, kv_heads)
    passes = [(prompt_len, prompt_len, padded)]  # (queries, slots, masked)
    if max_new_tokens > 1:
        if not method.evicts:  # FKV: the last step over prompt + generation, its pads still held
            passes.append((1, method.capacity(prompt_len, max_new_tokens), padded))
        else:
            passes.append((1, min(method.kv_max, prompt_len + 1), False))
    return max(
        dense_workspace_bytes(batch, q_heads, kv_heads, shape.head_dim, n, slots, nbytes, padded=masked, impl=impl)
        for impl in impls
        for n, slots, masked in passes
    )


def _per_token(shape: ModelShape, tp: int, nbytes: int) -> int:
    """Live bytes per token in one decoder layer: residual + normed hidden, q/k/v/out projections, 3 MLP
    intermediates (local heads and columns under tensor parallelism)."""
    q_heads, kv_heads = shape.local_heads(tp)
    local_inter = math.ceil(shape.intermediate / tp)
    return (3 * shape.hidden + (q_heads + 2 * kv_heads) * shape.head_dim + 3 * local_inter) * nbytes


def _prefill_passes(
    shape: ModelShape,
    method: Method,
    batch: int,
    phases: list[Phase],
    cap: int,
    q_heads: int,
    kv_heads: int,
    nbytes: int,
    per_token: int,
    probe_values: int,
    state: int,
    padded: bool = True,
) -> list[tuple[int, int, int]]:
    """(activations, attention workspace, prefill-only bookkeeping) of each BM prefill block and probe pass
    (``padded``: the blocks come with a token mask, as the static engine's do; a pool's slot prefills without)."""
    logits = batch * shape.vocab * 4
    passes = []
    slots, probed = 0, False
    for phase in phases:
        if phase.kind == "probe":
            probed = True
            passes.append(
                (
                    batch * phase.size * per_token,
                    probe_workspace_bytes(batch, q_heads, kv_heads, phase.size, slots, shape.head_dim, nbytes),
                    probe_values + state,
                )
            )
            continue
        # Queries attend over the slots written so far (the cache's high-water mark): in order until the first
        # eviction, then all ``cap``. The engine passes a token mask with prefill blocks.
        ordered = slots < cap and phase.end <= cap
        slots = min(cap, phase.end) if ordered else cap
        ws = workspace_bytes(
            batch, q_heads, kv_heads, phase.size, slots, shape.head_dim, ordered=ordered, padded=padded, elem=nbytes
        )
        passes.append((batch * phase.size * per_token + logits, ws, probe_values + (state if probed else 0)))
    return passes


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
    """Peak memory per rank of continuous batching (``core.serve``) in ``slots`` slots, for requests of at most
    ``prompt_len`` prompt tokens and ``max_new_tokens`` new tokens (``pass_tokens``: BM's prefill pass size as
    ``serve`` takes it). Constant for the whole run:

    - ``kv``: the pool's K/V, allocated once -- ``slots`` rows of C + 1 slots (C: BM and ED ``kv_max``, FKV the
      longest prompt + generation; the extra scratch slot takes idle rows' writes) -- plus ED's prompt-sized
      staging buffer of the one slot it prefills at a time;
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
    kv = _pool_kv_bytes(shape, method, slots, prompt_len, cap, kv_heads, nbytes)
    decode = (
        slots * per_token + slots * shape.vocab * 4,
        decode_workspace_bytes(slots, q_heads, kv_heads, cap, shape.head_dim, nbytes) if max_new_tokens > 1 else 0,
        0,
    )
    if not method.reads_scores:
        activations, workspace, _ = _dense_slot_prefill(shape, prompt_len, tp, nbytes)
        return MemoryEstimate(kv, workspace + decode[1], weights, activations + decode[0], 0)
    meta = pool_bookkeeping_bytes(shape, method, slots, prompt_len, tp=tp, dtype=dtype)
    tokens = method.pass_tokens(slots) if pass_tokens is None else pass_tokens
    passes = _pool_prefill_passes(shape, method, slots, tokens, q_heads, kv_heads, nbytes, per_token)
    evicting = (0, eviction_workspace_bytes(shape.layers, slots, kv_heads, method.kv_max, nbytes))
    activations, workspace = max([*passes, evicting], key=sum)
    return MemoryEstimate(kv, workspace + decode[1], weights, activations + decode[0], meta)


def _pool_prefill_passes(
    shape: ModelShape, method: Method, slots: int, tokens: int, q_heads: int, kv_heads: int, nbytes: int, per_token: int
) -> list[tuple[int, int]]:
    """(activations, attention workspace) of BM's batched prefill passes at their largest: R rows of n columns
    (``R * n <= tokens``, the pass size, n <= p; a probe pass n = the rule's window) over all ``kv_max`` slots, the
    rows' slot state gathered (rows that are not adjacent)."""
    C, D, V = method.kv_max, shape.head_dim, shape.vocab
    passes = []
    for n in range(1, method.p + 1):
        R = min(slots, max(1, tokens // n))
        gathered = R * kv_heads * C * (2 * D * nbytes + 8 + 4)  # keys, values, positions, sums of the rows
        ws = workspace_bytes(R, q_heads, kv_heads, n, C, D, ordered=False, padded=True, elem=nbytes)
        passes.append((R * n * per_token + R * V * 4, gathered + ws))
    w = method.lookahead
    if w:
        R = min(slots, max(1, tokens // w))
        gathered = R * kv_heads * C * (2 * D * nbytes + 8)
        passes.append((R * w * per_token, gathered + probe_workspace_bytes(R, q_heads, kv_heads, w, C, D, nbytes)))
    return passes


def _pool_kv_bytes(
    shape: ModelShape, method: Method, slots: int, prompt_len: int, cap: int, kv_heads: int, nbytes: int
) -> int:
    """A pool's K/V: ``slots`` rows of ``cap`` + 1 slots (the scratch slot takes idle rows' writes), plus ED's
    prompt-sized staging cache of the slot being prefilled."""
    L, D = shape.layers, shape.head_dim
    kv = 2 * slots * L * kv_heads * (cap + 1) * D * nbytes
    if method.keeps_newest_only:  # ED prefills into a staging cache, keeps the newest
        kv += 2 * L * kv_heads * prompt_len * D * nbytes  # the staging cache of the slot being prefilled
    return kv


def half_dtype_impls(nbytes: int, q_heads: int, kv_heads: int) -> tuple[str, ...]:
    """The attention paths a baseline may take, whatever the card (``core.baseline.choose_attention``): SDPA; in a
    half dtype FlashAttention-2 too and, for GQA, SDPA with K/V copied per query head (cards below compute
    capability 8.0). The planner counts the largest: an upper bound on the card it runs on."""
    if nbytes != 2:
        return (SDPA,)
    return (SDPA, FLASH, SDPA_REPEAT) if q_heads != kv_heads else (SDPA, FLASH)


def _dense_slot_prefill(shape: ModelShape, prompt_len: int, tp: int, nbytes: int) -> tuple[int, int, int]:
    """(activations, attention workspace, bookkeeping) of an FKV/ED pool's slot prefill: unpadded, causal SDPA (the
    "batchmax" attention hands it over: no mask, no K/V copies; on a card below compute capability 8.0 a GQA
    model's K/V copied per query head, ``core.baseline.dense_prefill_attention``)."""
    q_heads, kv_heads = shape.local_heads(tp)
    paths = [i for i in half_dtype_impls(nbytes, q_heads, kv_heads) if i != FLASH]  # its prefill never takes FA2
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
    probing every few blocks, every row's stored probe queries (from the first probe pass on, so only when a prompt
    of ``prompt_len`` tokens probes at all); 0 for FKV/ED."""
    if not method.reads_scores:
        return 0
    q_heads, kv_heads = shape.local_heads(tp)
    nbytes = DTYPE_BYTES[dtype]
    per_row = shape.layers * kv_heads * (method.kv_max + 1)
    held = slots * per_row * (8 + 4 + nbytes + 8 + (4 if method.lookahead else 0))
    probes = any(ph.kind == "probe" for ph in plan(method, prompt_len, 1))
    if probes and method.probe_every > 1:
        held += slots * shape.layers * probe_state_bytes(1, q_heads, method.lookahead, shape.head_dim, nbytes)
    return held


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


def _bookkeeping(
    shape: ModelShape,
    method: Method,
    batch: int,
    phases: list[Phase],
    cap: int,
    q_heads: int,
    kv_heads: int,
    nbytes: int,
) -> tuple[int, int, int]:
    """BM's bookkeeping bytes: (held all run: position, attention sum, additive mask per slot; the probe's values per
    slot, prefill only; the stored probe state of a rule with ``every > 1``, from its first probe pass on)."""
    held = batch * shape.layers * kv_heads * cap * (8 + 4 + nbytes)  # pos (int64), score (float32), bias
    if not method.lookahead:
        return held, 0, 0
    probe_values = batch * shape.layers * kv_heads * cap * 4
    w = max((ph.size for ph in phases if ph.kind == "probe"), default=0)
    state = (
        batch * shape.layers * probe_state_bytes(1, q_heads, w, shape.head_dim, nbytes)
        if w and method.probe_every > 1
        else 0
    )
    return held, probe_values, state  # the probe values are allocated with the cache, probe pass or not


def bookkeeping_bytes(
    shape: ModelShape,
    method: Method,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    tp: int = 1,
    dtype: str = "float32",
) -> int:
    """The most per-slot bookkeeping BM holds at once (what ``BatchMaxCache.peak_meta_bytes`` measures); 0 for
    FKV/ED, which run on the baselines' cache."""
    if not method.reads_scores:
        return 0
    q_heads, kv_heads = shape.local_heads(tp)
    cap = method.capacity(prompt_len, max_new_tokens)
    return sum(
        _bookkeeping(shape, method, batch, plan(method, prompt_len, 1), cap, q_heads, kv_heads, DTYPE_BYTES[dtype])
    )


def max_batch(
    budget_bytes: int,
    shape: ModelShape,
    method: Method,
    prompt_len: int,
    max_new_tokens: int,
    *,
    tp: int = 1,
    dtype: str = "float32",
    limit: int = 1 << 16,
) -> int:
    """The largest batch whose predicted peak fits ``budget_bytes`` (0 if not even one sample fits)."""

    return _largest(
        lambda b: predict(shape, method, b, prompt_len, max_new_tokens, tp=tp, dtype=dtype).total <= budget_bytes, limit
    )


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
