"""The HF drop-in: ``model.generate(..., past_key_values=BatchMaxCache(method))`` inside ``use_drop_in(model)``
(the model's attention implementation "batchmax_hf", registered here). An adapter on top of the engine's attention
(``core.attention``, which imports nothing from here), plugged in through transformers' Cache and Attention APIs:
one ``BoundedLayer`` per decoder layer, driven by HF's generate, which states no pass: each layer infers its eviction
from the block it is handed (``Method.num_to_evict``) and hands itself to this module's attention function, called
next (a thread-local: this module is the only place one exists). A decode step runs the engine's fused decode
(``attention.decode_attention``); a block runs in query chunks here (``_block_attention``).

Each layer preallocates, per (sample, local KV head), ``capacity`` slots of keys and values plus, per slot, the
absolute (padded-sequence) position of the token it holds (-1: empty, pad or evicted) and the attention weight it
has received. Eviction frees slots in place; new pairs are written into freed slots by index. Keys already carry
RoPE, so nothing is compacted or re-rotated.

Head counts come from the tensors the model hands to ``update`` (under tensor parallelism they are the rank's
local heads). The cache works only with the "batchmax" attention function (``core.attention``), which
reads the layer's slot state and adds each query's attention probabilities to the slots it attended. Beside
``pos`` each layer keeps ``bias``, the additive mask of its slots (0 valid, -inf empty/evicted/pad), updated
wherever ``pos`` changes, so that a decode step's attention is one fused product with no mask to build.

HF's generate runs no look-ahead probe pass: a rule with one ranks without its probe here (the engine runs it).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from . import workspace
from .attention import add_received, decode_attention, padding_mask, use_batchmax_attention
from .method import Method
from .pool import free_slots

logger = logging.getLogger(__name__)

NAME = "batchmax_hf"  # the drop-in's attention implementation (the engine's is "batchmax")

# The layer whose ``update`` ran last on this thread, handed to the attention call that follows it in the same
# attention module (transformers calls ``past_key_values.update`` and then the attention function).
_handoff = threading.local()


def take_updated_layer(key: torch.Tensor) -> BoundedLayer:
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is None or layer.keys is not key:
        raise RuntimeError(
            "the 'batchmax_hf' attention needs past_key_values=BatchMaxCache(...) and a model that passes the "
            "cache's keys straight to its attention function"
        )
    return layer


def drop_in_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The drop-in's attention: query [B, Hq, n, D]; key/value the cache layer's buffers [B, Hkv, C, D] (its
    ``update`` just wrote the block); attention_mask the block's padding mask (last n columns of a 2D [B, *] mask,
    True for real tokens) or None. An unmasked decode step is fused, a block chunked. Returns [B, n, Hq, D]."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = take_updated_layer(key)
    if query.shape[2] == 1 and attention_mask is None:
        layer.new_slots = None
        B, Hq, _, D = query.shape
        ws = workspace.decode_workspace_bytes(B, Hq, key.shape[1], layer.high, D, query.element_size())
        layer.cache.note_workspace(ws)  # (the engine's pools count theirs from the pass's description)
        return decode_attention(layer, query, key, value, scaling, layer.high), None
    return _block_attention(layer, query, key, value, attention_mask, scaling), None


def register() -> None:
    """Register the drop-in's attention and mask builder under "batchmax_hf" (idempotent)."""
    AttentionInterface.register(NAME, drop_in_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


@contextlib.contextmanager
def use_drop_in(model: torch.nn.Module):
    """Run ``model`` with the drop-in's attention inside the block (for ``model.generate(...,
    past_key_values=BatchMaxCache(...))``), restoring its implementation after."""
    register()
    with use_batchmax_attention(model, NAME):
        yield model


def _block_attention(
    layer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """A prefill block (or a masked decode step): causal over the kept slots in query chunks. Returns [B, n, Hq, D]."""
    B, Hq, n, D = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    token_mask = None if attention_mask is None else attention_mask[:, -n:].bool()  # [B, n]
    layer.mark_pads(token_mask)
    hi = layer.high  # slots [hi, C) were never written: leave them out of every product
    keys_t = key[:, :, :hi].transpose(2, 3)  # [B, Hkv, D, hi]
    values = value[:, :, :hi]  # [B, Hkv, hi, D]
    score = layer.score[:, :, :hi]  # [B, Hkv, hi], a view: accumulated in place
    hiding = _slot_hiding(layer.pos[:, :, :hi], n)
    first = layer.seen - n  # padded position of the block's first query
    qg = query.view(B, Hkv, g, n, D)  # [B, Hkv, g, n, D]: query heads grouped by their KV head (a view)

    # Memory: at most one chunk's tensors are alive at a time (each is dropped as soon as it is used), the
    # scaling is folded into the chunk's own query copy, and chunk outputs go straight into the result's
    # [B, n, Hq, D] layout. ``workspace_bytes`` counts what remains, allocation by allocation.
    ordered = layer.free is None
    converted = 0 if attention_mask is None or attention_mask.dtype == torch.bool else B * n  # token_mask bytes
    layer.cache.note_workspace(
        converted
        + workspace.workspace_bytes(
            B, Hq, Hkv, n, hi, D, ordered=ordered, padded=token_mask is not None, elem=query.element_size()
        )
    )
    out = None  # [B, n, Hkv, g, D]: allocated once when the block takes more than one chunk
    for a, b, lim in workspace.query_chunks(B, Hq, n, hi, ordered):
        m = b - a
        if out is None and m < n:
            out = torch.empty(B, n, Hkv, g, D, dtype=value.dtype, device=value.device)
        probs = _chunk_probs(qg[:, :, :, a:b], keys_t[..., :lim], scaling, hiding, first + a)  # [B, Hkv, g*m, lim]
        add_received(score[..., :lim], probs, None if token_mask is None else token_mask[:, a:b])
        o = torch.matmul(probs.to(value.dtype), values[:, :, :lim]).view(B, Hkv, g, m, D)  # [B, Hkv, g, m, D]
        del probs
        if out is None:  # the whole block in one chunk
            out = o.permute(0, 3, 1, 2, 4).contiguous()  # [B, n, Hkv, g, D]; no copy when n == 1
        else:
            out[:, a:b].copy_(o.permute(0, 3, 1, 2, 4))  # [B, m, Hkv, g, D]
        del o
    return out.view(B, n, Hq, D)  # [B, n, Hq, D]


def _slot_hiding(slot_pos: torch.Tensor, n: int) -> torch.Tensor:
    """What hides slots [B, Hkv, hi] from a block of ``n`` queries. A decode step (n == 1): every kept slot precedes
    the query, so the mask [B, Hkv, 1, 1, hi] of empty/evicted slots. A longer block: each slot's effective
    position [B, Hkv, hi] (empty and pad slots after every query), compared per chunk with the queries'."""
    if n == 1:
        return (slot_pos < 0)[:, :, None, None, :]  # [B, Hkv, 1, 1, hi]
    return slot_pos.masked_fill(slot_pos < 0, torch.iinfo(slot_pos.dtype).max)  # [B, Hkv, hi]


def _chunk_probs(
    q: torch.Tensor,
    keys_t: torch.Tensor,
    scaling: float,
    hiding: torch.Tensor,
    qpos: torch.Tensor | int,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """A query chunk's attention probabilities: q [B, Hkv, g, m, D] (a view), keys_t [B, Hkv, D, lim], ``hiding``
    from ``_slot_hiding``, ``qpos`` the queries' positions: [B, m] per row (-1: a masked query, which sees no slot),
    or the first one's position (every row's queries at the same positions); ``other`` [B, Hkv, G, >= lim] (a budget
    shared by G heads: the slots each head's g / G query heads must not see). Returns [B, Hkv, g*m, lim]."""
    B, Hkv, g, m, D = q.shape
    lim = keys_t.shape[-1]
    # The chunk's scaled queries, copied contiguous (never a view: scaled in place) [B, Hkv, g, m, D]
    qc = q.clone(memory_format=torch.contiguous_format).mul_(scaling)
    logits = torch.matmul(qc.view(B, Hkv, g * m, D), keys_t)  # [B, Hkv, g*m, lim]
    del qc
    logits = logits.float().view(B, Hkv, g, m, lim)  # [B, Hkv, g, m, lim]
    if hiding.dim() == 5:  # a decode step's mask [B, Hkv, 1, 1, hi]
        hidden = hiding[..., :lim]
    else:
        if isinstance(qpos, int):
            qpos = torch.arange(qpos, qpos + m, device=q.device)[None]  # [1, m]
        hidden = (hiding[:, :, None, :lim] > qpos[:, None, :, None])[:, :, None]  # [B, Hkv, 1, m, lim]
        del qpos
    # A pad query sees no slot at all; a finite fill keeps its row finite (its weights are dropped below).
    logits.masked_fill_(hidden, torch.finfo(torch.float32).min)
    if other is not None:  # [B, Hkv, G, g/G, m, lim]: another head's slots
        G = other.shape[2]
        hid = other[:, :, :, None, None, :lim]  # [B, Hkv, G, 1, 1, lim]
        logits.view(B, Hkv, G, g // G, m, lim).masked_fill_(hid, torch.finfo(torch.float32).min)
    probs = torch.softmax(logits, dim=-1).view(B, Hkv, g * m, lim)  # [B, Hkv, g*m, lim]
    del logits, hidden
    return probs


class BoundedLayer(CacheLayerMixin):
    """One decoder layer's slots, written by index, never slid, cropped or compiled: keys/values [B, H, C, D], pos
    [B, H, C] (int64), score [B, H, C] (float32), bias [B, H, C] (model dtype, 0 or -inf as pos is valid or not)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: BatchMaxCache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.pos: torch.Tensor | None = None
        self.score: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None  # additive mask of the slots: 0 where pos >= 0, -inf elsewhere
        self.filled = 0  # occupied slots per (sample, head), pads included: the same host int for all of them
        self.seen = 0  # tokens processed so far = padded position of the next token
        self.high = 0  # slots [0, high) have been written at least once; the rest are empty
        self.free: torch.Tensor | None = None  # [B, H, F] freed slot indices; None: slots [filled, C) are free
        self.free_ptr = 0
        self.decoding = False
        self.new_slots: torch.Tensor | slice | None = None  # where the last update wrote, for the attention call

    # -- transformers' CacheLayerMixin ------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        capacity = self.cache.method.capacity(max(key_states.shape[2], self.cache.reserve), 1)  # BM: kv_max
        self._allocate(key_states.shape[0], key_states.shape[1], key_states.shape[-1], value_states.shape[-1], capacity)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        """The most pairs held per (sample, KV head): the method's ``kv_max``, -1 for the full cache."""
        kv_max = self.cache.method.held_kv_max
        return -1 if kv_max is None else kv_max

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.score = self.bias = None
        self.is_initialized = False
        self.filled = self.seen = self.free_ptr = self.high = 0
        self.free, self.decoding, self.new_slots = None, False, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name in ("keys", "values", "pos", "score", "bias", "free"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, beam_idx.to(t.device)))

    # -- storage ------------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _allocate(self, batch: int, heads: int, k_dim: int, v_dim: int, capacity: int) -> None:
        # Zero-filled, never empty(): masked slots still enter the probs @ V product (with weight 0), so they must
        # hold finite values.
        kw = dict(dtype=self.dtype, device=self.device)
        self.keys = torch.zeros(batch, heads, capacity, k_dim, **kw)
        self.values = torch.zeros(batch, heads, capacity, v_dim, **kw)
        self.pos = torch.full((batch, heads, capacity), -1, dtype=torch.long, device=self.device)
        self.score = torch.zeros(batch, heads, capacity, dtype=torch.float32, device=self.device)
        self.bias = torch.full((batch, heads, capacity), float("-inf"), **kw)
        self.cache.note_capacity()

    def _resize(self, capacity: int) -> None:
        """Reallocate to ``capacity`` slots keeping the occupied ones; only while slots [0, filled) hold them."""
        assert self.free is None, "resizing needs a compact layout"
        old = (self.keys, self.values, self.pos, self.score, self.bias)
        B, H, _, Dk = self.keys.shape
        self._allocate(B, H, Dk, self.values.shape[-1], capacity)
        n = self.filled
        for new, prev in zip((self.keys, self.values, self.pos, self.score, self.bias), old):
            new[:, :, :n] = prev[:, :, :n]

    def kv_bytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # -- eviction -----------------------------------------------------------------------------------------------
    def evict(self, n: int, curr_id: int) -> None:
        """Drop ``n`` occupied pairs per (sample, head) by the method's rule; pads and empty slots go first."""
        method = self.cache.method
        empty = self.capacity - self.filled
        priority = method.priority(self.score, self.pos, curr_id)  # [B, H, C]
        freed = free_slots(priority, self.pos, self.score, self.bias, empty + n)  # [B, H, empty + n]
        self.filled -= n
        self.free, self.free_ptr = freed, 0
        self.high = self.capacity  # freed slots may lie anywhere below the capacity

    # -- the update called by the attention module ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Make room (evicting as the block requires), write the block's pairs into free slots, return the full buffers.

        key_states/value_states: [B, H, n, D] (RoPE applied). Returns keys/values [B, H, C, D]; which slots
        are valid, and at which positions, is in ``self.pos`` (read by the attention function).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.new_slots is not None:
            raise RuntimeError(
                "BatchMaxCache was updated twice without the 'batchmax' attention in between: load the model with "
                "attn_implementation='batchmax' (batchmax_tp.core.attention.use_batchmax_attention(model))"
            )
        n = key_states.shape[2]
        evict = self._evict_count(n)
        if evict:
            self.evict(evict, curr_id=self.seen - 1)
        if self.free is None:
            self.new_slots = self._append(key_states, value_states)
        else:
            self.new_slots = self._write_free(key_states, value_states)
        self.filled += n
        self.seen += n
        _handoff.layer = self  # HF's generate passes no pass description: hand the layer to its attention call
        return self.keys, self.values

    def _evict_count(self, n: int) -> int:
        """The eviction before a block of ``n`` (HF generate states none), inferred from the block."""
        first_decode = n == 1 and self.seen > 0 and not self.decoding
        self.decoding = self.decoding or first_decode
        return self.cache.method.num_to_evict(self.filled, n, self.cache.method.kv_max, first_decode)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> slice:
        """Write the block [B, H, n, D] at slots [filled, filled + n) of a compact layout; return those slots."""
        n = key_states.shape[2]
        needed = self.filled + n
        if needed > self.capacity:
            if self.cache.method.capacity(needed, 1) < needed:  # a bounded cache (BM)
                raise ValueError(f"a block of {n} tokens does not fit in kv_max={self.cache.method.kv_max}")
            # Grow geometrically (``reserve``: the exact size, when known)
            self._resize(max(needed, self.cache.reserve, 2 * self.capacity))
        slots = slice(self.filled, needed)
        self.high = max(self.high, needed)
        self.keys[:, :, slots] = key_states
        self.values[:, :, slots] = value_states
        if n == 1:
            self.pos[:, :, slots] = self.seen
        else:
            self.pos[:, :, slots] = torch.arange(self.seen, self.seen + n, device=self.device)
        self.score[:, :, slots] = 0.0
        self.bias[:, :, slots] = 0.0
        return slots

    def _write_free(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """Write the block [B, H, n, D] into the next ``n`` freed slots; return their indices [B, H, n]."""
        n = key_states.shape[2]
        if self.free_ptr + n > self.free.shape[-1]:
            raise ValueError(f"a block of {n} tokens does not fit in the {self.free.shape[-1]} freed slots")
        slots = self.free[..., self.free_ptr : self.free_ptr + n]  # [B, H, n]
        self.free_ptr += n
        idx_k = slots[..., None].expand(-1, -1, -1, key_states.shape[-1])  # [B, H, n, Dk]
        idx_v = slots[..., None].expand(-1, -1, -1, value_states.shape[-1])  # [B, H, n, Dv]
        self.keys.scatter_(2, idx_k, key_states)
        self.values.scatter_(2, idx_v, value_states)
        if n == 1:
            self.pos.scatter_(2, slots, self.seen)
        else:
            new_pos = torch.arange(self.seen, self.seen + n, device=self.device).expand_as(slots)  # [B, H, n]
            self.pos.scatter_(2, slots, new_pos)
        self.score.scatter_(2, slots, 0.0)
        self.bias.scatter_(2, slots, 0.0)
        return slots

    def mark_pads(self, token_mask: torch.Tensor) -> None:
        """Invalidate the slots just written for pad tokens. token_mask: [B, n] bool, True for real tokens."""
        slots = self.new_slots
        self.new_slots = None
        if token_mask is None:
            return
        pads = ~token_mask[:, None, :]  # [B, 1, n]
        if isinstance(slots, slice):
            self.pos[:, :, slots].masked_fill_(pads, -1)
            self.bias[:, :, slots].masked_fill_(pads, float("-inf"))
        else:
            self.pos.scatter_(2, slots, self.pos.gather(2, slots).masked_fill(pads, -1))  # [B, H, n]
            self.bias.scatter_(2, slots, self.bias.gather(2, slots).masked_fill(pads, float("-inf")))

    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted real positions held, per sample and local KV head (host copy; for tests and inspection)."""
        pos = self.pos.cpu()
        return [[sorted(p for p in row.tolist() if p >= 0) for row in sample] for sample in pos]


class BatchMaxCache(Cache):
    """KV cache bounded by ``method.kv_max`` pairs per (sample, KV head) during prefill and decoding, for
    ``model.generate(..., past_key_values=BatchMaxCache(method))`` on a model whose attention implementation is
    "batchmax_hf" (``use_drop_in``). HF's generate prefills the whole prompt in one block, so
    a prompt longer than ``kv_max`` needs ``prefill_chunk_size=p`` (identical to Algorithm 1 when ``kv_max`` is a
    multiple of ``p``). ``reserve`` preallocates that many slots for FKV/ED so their prefill does not reallocate.
    A rule whose heads share a budget (``share`` != 1) runs in the engine's pool only (``core.serve``).
    """

    share = 1  # every head holds its own kv_max pairs (``core.pool``'s shared budgets are the engine's)

    def __init__(self, method: Method, num_layers: int | None = None, reserve: int = 0):
        if method.scorer.share != 1:
            raise ValueError(
                f"rule {method.rule!r}: heads sharing a budget run in batchmax_tp's engine (serve, generate), "
                "not in HF generate's BatchMaxCache"
            )
        self.method = method
        self.reserve = reserve
        self.peak_kv_bytes = 0
        self.peak_meta_bytes = 0  # largest bookkeeping held at once (``meta_bytes``)
        self.peak_workspace_bytes = 0  # largest peak of one attention call (attention.workspace_bytes)
        if num_layers is None:
            super().__init__(layers=None, layer_class_to_replicate=self._new_layer)
        else:
            super().__init__(layers=[BoundedLayer(self, i) for i in range(num_layers)])

    def _new_layer(self) -> BoundedLayer:
        return BoundedLayer(self, len(self.layers))

    def note_capacity(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        self.peak_meta_bytes = max(self.peak_meta_bytes, self.meta_bytes())

    def note_workspace(self, nbytes: int) -> None:
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, nbytes)

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers allocated now (all layers)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def meta_bytes(self) -> int:
        """Bytes of the per-slot bookkeeping held now (positions, attention sums, the additive mask)."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (layer.pos, layer.score, layer.bias)
            if t is not None
        )

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """Per layer, sample and local KV head: the sorted positions of the pairs held."""
        return [layer.kept_positions() for layer in self.layers]
