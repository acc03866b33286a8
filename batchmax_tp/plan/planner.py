"""Memory planner: predict a run's peak memory from shapes alone, and the largest batch that fits a budget.

Three parts are counted:
- ``kv``: the K/V buffers (what ``BatchMaxCache.peak_kv_bytes`` measures): BM ``kv_max`` slots, ED the whole
  prompt during prefill, FKV prompt + generation, per (sample, local KV head, layer);
- ``workspace``: the peak of one "batchmax" attention call, every tensor it allocates at its worst moment
  (``core.workspace.workspace_bytes``: one query chunk's float32 logits and probabilities, visibility mask, scaled
  queries and output, the slot positions, the [B, n, Hq, D] result), bounded by the query chunking of
  ``core.workspace.SCORE_CHUNK_BYTES``. The attention reports the same count (``BatchMaxCache.peak_workspace_bytes``),
  and ``tests/test_memory.py`` holds both to the allocations measured on CPU (float32: equal, call by call) and,
  on CUDA, to ``torch.cuda.max_memory_allocated``; for FKV/ED, which run on the model's SDPA
  (``core.baseline``), ``core.workspace.sdpa_workspace_bytes``;
- ``weights`` and ``activations``: the model's parameters (split by tensor parallelism) and an estimate of one
  forward's live activations; exact on no machine, checked against ``torch.cuda.max_memory_allocated`` on GPU.

Everything is per rank: under tensor parallelism heads and MLP columns are divided by ``tp`` (KV heads unevenly,
as AutoTP does: rank 0 holds the most, which is what a budget must fit).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..core.workspace import sdpa_workspace_bytes, workspace_bytes
from ..core.method import Method
from ..core.schedule import capacity, prefill_blocks

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
    slot_meta: int = 0  # the cache's per-slot position (int64) and attention sum (float32)

    @property
    def total(self) -> int:
        return self.kv + self.workspace + self.weights + self.activations + self.slot_meta

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def predict(shape: ModelShape, method: Method, batch: int, prompt_len: int, max_new_tokens: int, *, tp: int = 1,
            dtype: str = "float32") -> MemoryEstimate:
    """Peak memory per rank of generating ``max_new_tokens`` for ``batch`` prompts padded to ``prompt_len``."""
    nbytes = DTYPE_BYTES[dtype]
    q_heads, kv_heads = shape.local_heads(tp)
    cap = capacity(method, prompt_len, max_new_tokens)
    kv = 2 * batch * shape.layers * kv_heads * cap * shape.head_dim * nbytes
    window = method.lookahead  # look-ahead probe tokens per prefill block (rules.py); 0 for the paper's rule
    slot_meta = batch * shape.layers * kv_heads * cap * (8 + 4 + (4 if window else 0))
    if window and method.probe_every > 1:  # the last probe's queries, own keys and weights, kept for re-scoring
        slot_meta += batch * shape.layers * window * ((q_heads + kv_heads) * shape.head_dim * nbytes + 4)

    # Attention calls: queries attend over the slots written so far (the cache's high-water mark): a prefill
    # block ending at ``end`` sees ``end`` slots in order until the first eviction, then all ``cap``; a decode
    # step one query. The engine passes a token mask with prefill blocks, none with decode steps.
    def call(queries: int, slots: int, ordered: bool, padded: bool) -> int:
        return workspace_bytes(batch, q_heads, kv_heads, queries, slots, shape.head_dim,
                                         ordered=ordered, padded=padded, elem=nbytes)

    workspace, evicted = 0, False
    for start, end in prefill_blocks(method, prompt_len):
        evicted = evicted or end > cap
        block_ws = call(end - start, cap if evicted else end, not evicted, True)
        w = prompt_len - max(end, prompt_len - window) if window else 0
        if w:  # the probe's float32 logits and probabilities over the slots and its own keys, and its outputs
            block_ws += 2 * 4 * batch * q_heads * w * (min(cap, end) + w) + nbytes * batch * w * q_heads * shape.head_dim
        workspace = max(workspace, block_ws)
    if max_new_tokens > 1:
        if method.name == "ed":  # compacted to one pair at the first step, then never more than kv_max
            decode_slots = min(method.kv_max, max_new_tokens)
        else:
            decode_slots = min(cap, prompt_len + max_new_tokens - 1)
        workspace = max(workspace, call(1, decode_slots, False, False))

    if method.name != "bm":  # FKV/ED run on the model's SDPA with a DenseCache (core.baseline): no score
        # blocks, no per-slot bookkeeping; worst case a padded batch (HF's prefill mask, FKV's decode mask).
        workspace = sdpa_workspace_bytes(batch, q_heads, kv_heads, shape.head_dim, prompt_len, nbytes, padded=True)
        slot_meta = batch * cap if method.name == "fkv" and max_new_tokens > 1 else 0

    block = max(end - start for start, end in prefill_blocks(method, prompt_len)) + window
    local_inter = math.ceil(shape.intermediate / tp)
    # Live in one decoder layer: residual + normed hidden, q/k/v/out projections, 3 MLP intermediates; logits of
    # the last position only (logits_to_keep=1) in float32.
    per_token = (3 * shape.hidden + (q_heads + 2 * kv_heads) * shape.head_dim + 3 * local_inter) * nbytes
    activations = batch * block * per_token + batch * shape.vocab * 4
    weights = shape.weights_per_rank(tp) * nbytes
    return MemoryEstimate(kv, workspace, weights, activations, slot_meta)


def max_batch(budget_bytes: int, shape: ModelShape, method: Method, prompt_len: int, max_new_tokens: int, *,
              tp: int = 1, dtype: str = "float32", limit: int = 1 << 16) -> int:
    """The largest batch whose predicted peak fits ``budget_bytes`` (0 if not even one sample fits)."""

    def fits(b: int) -> bool:
        return predict(shape, method, b, prompt_len, max_new_tokens, tp=tp, dtype=dtype).total <= budget_bytes

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
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise ValueError(f"cannot read a byte size from {text!r} (examples: 24GiB, 512MiB, 1000000)")
    return int(value * units[unit])
