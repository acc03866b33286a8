"""Memory planner: predict a run's peak memory from shapes alone, and the largest batch that fits a budget.

Three parts are counted:
- ``kv``: the K/V buffers (what ``BatchMaxCache.peak_kv_bytes`` measures): BM ``kv_max`` slots, ED the whole
  prompt during prefill, FKV prompt + generation, per (sample, local KV head, layer);
- ``workspace``: the largest attention-score block the "batchmax" attention materialises (float32 logits and
  probabilities plus the visibility mask; ``BatchMaxCache.peak_workspace_bytes`` measures it), bounded by the
  query chunking of ``attention.SCORE_CHUNK_BYTES``;
- ``weights`` and ``activations``: the model's parameters (split by tensor parallelism) and an estimate of one
  forward's live activations; exact on no machine, checked against ``torch.cuda.max_memory_allocated`` on GPU.

Everything is per rank: under tensor parallelism heads and MLP columns are divided by ``tp`` (KV heads unevenly,
as AutoTP does: rank 0 holds the most, which is what a budget must fit).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from . import attention
from .policy import Method
from .schedule import capacity, prefill_blocks

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


def score_block_bytes(batch: int, q_heads: int, kv_heads: int, queries: int, slots: int,
                      ordered: bool = False) -> int:
    """Largest score block for ``queries`` queries over ``slots`` slots, chunked like the attention does.

    ``ordered``: no eviction yet, so the block is the last ``queries`` slots and a chunk ending at block index b
    sees ``slots - queries + b`` slots (causal skipping); otherwise every chunk sees all slots.
    """
    chunk = max(1, attention.SCORE_CHUNK_BYTES // (4 * batch * q_heads * slots))
    if ordered and queries > 1:
        chunk = min(chunk, attention.CAUSAL_CHUNK)
    best = 0
    for a in range(0, queries, chunk):
        m = min(queries, a + chunk) - a
        seen = slots - queries + a + m if ordered else slots
        best = max(best, 2 * 4 * batch * q_heads * m * seen + batch * kv_heads * m * seen)
    return best


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
    cap = capacity(method, prompt_len, max_new_tokens)
    kv = 2 * batch * shape.layers * kv_heads * cap * shape.head_dim * nbytes
    window = method.lookahead  # look-ahead probe tokens per prefill block (rules.py); 0 for the paper's rule
    slot_meta = batch * shape.layers * kv_heads * cap * (8 + 4 + (4 if window else 0))

    # Score blocks: queries attend over the slots written so far (the cache's high-water mark): a prefill block
    # ending at ``end`` sees ``end`` slots until the first eviction, then all ``cap``; a decode step one query.
    workspace, evicted = 0, False
    for start, end in prefill_blocks(method, prompt_len):
        evicted = evicted or end > cap
        block_ws = score_block_bytes(batch, q_heads, kv_heads, end - start, cap if evicted else end,
                                     ordered=not evicted)
        w = prompt_len - max(end, prompt_len - window) if window else 0
        if w:  # the probe's queries over the slots and its own keys, while the block's last chunk is still live
            block_ws += 2 * 4 * batch * q_heads * w * (min(cap, end) + w)
        workspace = max(workspace, block_ws)
    if max_new_tokens > 1:
        if method.name == "ed":  # compacted to one pair at the first step, then never more than kv_max
            decode_slots = min(method.kv_max, max_new_tokens)
        else:
            decode_slots = min(cap, prompt_len + max_new_tokens - 1)
        workspace = max(workspace, score_block_bytes(batch, q_heads, kv_heads, 1, decode_slots))

    block = max(end - start for start, end in prefill_blocks(method, prompt_len)) + window
    local_inter = math.ceil(shape.intermediate / tp)
    # Live in one decoder layer: residual + normed hidden, q/k/v/out projections, 3 MLP intermediates; logits of
    # the last position only (logits_to_keep=1) in float32.
    per_token = (3 * shape.hidden + (q_heads + 2 * kv_heads) * shape.head_dim + 3 * local_inter) * nbytes
    activations = batch * block * per_token + batch * shape.vocab * 4
    weights = shape.weights_per_rank(tp) * nbytes
    return MemoryEstimate(kv, workspace, weights, activations, slot_meta)


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
