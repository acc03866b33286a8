"""A bounded KV cache that plugs into transformers' Cache API: one ``BoundedLayer`` per decoder layer.

Each layer preallocates, per (sample, local KV head), ``capacity`` slots of keys and values plus, per slot, the
absolute (padded-sequence) position of the token it holds (-1: empty, pad or evicted) and the attention weight it
has received. Eviction frees slots in place; new pairs are written into freed slots by index. Keys already carry
RoPE, so nothing is compacted or re-rotated (ED compacts its single kept pair, once per eviction).

Head counts come from the tensors the model hands to ``update`` (under tensor parallelism they are the rank's
local heads). The cache works only with the "batchmax" attention function (``core.attention``), which
reads the layer's slot state and adds each query's attention probabilities to the slots it attended. Beside
``pos`` each layer keeps ``bias``, the additive mask of its slots (0 valid, -inf empty/evicted/pad), updated
wherever ``pos`` changes, so that a decode step's attention is one fused product with no mask to build.

Rules with a look-ahead probe (``core.rules``) run probe passes of their own (``schedule.Phase`` kind
``probe``): ``update`` writes nothing and hands the probe's keys/values to the attention call aside; the
attention writes the probe's attention per slot into ``probe``. A rule that probes only every ``every``-th block
also leaves the probe's queries (``core.probe.ProbeState``): a prefill eviction after an unprobed block re-scores
the slots held then with them. Both are prefill-only and freed when the prefill ends (``end_prefill``).
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import probe as lookahead
from .method import Method
from .schedule import Phase

logger = logging.getLogger(__name__)

# The layer whose ``update`` ran last on this thread, handed to the attention call that follows it in the same
# attention module (transformers calls ``past_key_values.update`` and then the attention function).
_handoff = threading.local()


def take_updated_layer(key: torch.Tensor) -> BoundedLayer:
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is None or layer.keys is not key:
        raise RuntimeError(
            "the 'batchmax' attention needs past_key_values=BatchMaxCache(...) and a model that passes the cache's "
            "keys straight to its attention function"
        )
    return layer


def slots_to_evict(priority: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
    """Indices [B, H, n] of the ``n`` slots with the smallest ``(priority, position, slot)``, in that order.

    Exact priority ties evict the older pair first, and empty slots (position -1) in slot order, so the result
    does not depend on the slot layout. One sort of an int64 key: the float32 priority's bits made
    order-preserving in the high half, the position (empty slots: their index, below every position) in the low.
    """
    C = pos.shape[-1]
    bits = priority.float().contiguous().view(torch.int32)  # [B, H, C]
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # negative floats: reversed order fixed
    low = torch.where(pos >= 0, pos + C, torch.arange(C, device=pos.device))  # [B, H, C], in [0, 2**32)
    return (bits * 2**32 + low).topk(n, dim=-1, largest=False, sorted=True).indices  # [B, H, n]


def free_slots(
    priority: torch.Tensor, pos: torch.Tensor, score: torch.Tensor, bias: torch.Tensor, n: int
) -> torch.Tensor:
    """Free the ``n`` slots of lowest ``priority`` (``slots_to_evict``) in the slot state ``pos``/``score``/``bias``
    [B, H, C] (views are written through) and return their indices [B, H, n]."""
    freed = slots_to_evict(priority, pos, n)  # [B, H, n]
    pos.scatter_(2, freed, -1)
    score.scatter_(2, freed, 0.0)
    bias.scatter_(2, freed, float("-inf"))
    return freed


class SlotLayer(CacheLayerMixin):
    """A decoder layer of a preallocated cache (``BatchMaxCache`` or the baselines' ``DenseCache``): slots written
    by index, never slid, cropped or compiled."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: Cache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx

    def get_max_length(self) -> int:
        """The most pairs held per (sample, KV head): the method's ``kv_max``, -1 for the full cache."""
        kv_max = self.cache.method.held_kv_max
        return -1 if kv_max is None else kv_max


class BoundedLayer(SlotLayer):
    """One decoder layer's slots: keys/values [B, H, C, D], pos [B, H, C] (int64), score [B, H, C] (float32),
    bias [B, H, C] (model dtype, 0 or -inf as pos is valid or not); probe [B, H, C] (float32) only for rules with
    a look-ahead probe, during prefill."""

    def __init__(self, cache: BatchMaxCache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.pos: torch.Tensor | None = None
        self.score: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None  # additive mask of the slots: 0 where pos >= 0, -inf elsewhere
        self.probe: torch.Tensor | None = None  # look-ahead attention per slot of the last probed pass
        self.probe_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # this pass's probe keys/values, transient
        self.probe_fresh = False  # ``probe`` comes from the pass just run (else re-scored from ``probe_state``)
        self.probe_state: lookahead.ProbeState | None = None  # the last probed pass's queries (rule every > 1)
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
        m = self.cache.method
        capacity = m.kv_max if m.bounded else self.cache.reserve
        self._allocate(key_states.shape[0], key_states.shape[1], key_states.shape[-1], value_states.shape[-1], capacity)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.score = self.bias = self.probe = None
        self.probe_kv = self.probe_state = None
        self.probe_fresh = False
        self.is_initialized = False
        self.filled = self.seen = self.free_ptr = self.high = 0
        self.free, self.decoding, self.new_slots = None, False, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name in ("keys", "values", "pos", "score", "bias", "probe", "free"):
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
        if self.cache.method.lookahead and not self.decoding:
            self.probe = torch.zeros(batch, heads, capacity, dtype=torch.float32, device=self.device)
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
    def evict(self, n: int, curr_id: int, prefill: bool = False) -> None:
        """Drop ``n`` occupied pairs per (sample, head) by the method's rule; pads and empty slots go first.
        ``prefill``: a prefill eviction (the look-ahead probe's attention joins the rule's score)."""
        with torch.profiler.record_function("batchmax::evict"):
            self._evict(n, curr_id, prefill)

    def _evict(self, n: int, curr_id: int, prefill: bool = False) -> None:
        method = self.cache.method
        empty = self.capacity - self.filled
        probe = self.probe if prefill else None
        if prefill and self.probe_state is not None and not self.probe_fresh:  # the last block ran unprobed
            self.probe = lookahead.rescore(self.probe_state, self.keys, self.pos)  # [B, H, C]
            probe = self.probe
        self.probe_fresh = False
        priority = method.priority(self.score, self.pos, curr_id, probe)  # [B, H, C]
        if method.keeps_newest_only:
            self._keep_newest(slots_to_evict(-priority, self.pos, 1))  # [B, H, 1]: the newest pair's slot
            return
        freed = free_slots(priority, self.pos, self.score, self.bias, empty + n)  # [B, H, empty + n]
        self.filled -= n
        self.free, self.free_ptr = freed, 0
        self.high = self.capacity  # freed slots may lie anywhere below the capacity

    def _keep_newest(self, newest: torch.Tensor) -> None:
        """ED's eviction: the newest pair (slot ``newest`` [B, H, 1]) moves to slot 0, the rest of the buffer is
        free again, and the prompt-sized buffer shrinks to ``kv_max``."""
        for buf in (self.keys, self.values, self.pos, self.score, self.bias):
            self.cache.method.keep_newest(buf, buf, newest)
        self.pos[:, :, 1:] = -1
        self.score[:, :, 1:] = 0
        self.bias[:, :, 1:] = float("-inf")
        self.filled, self.free, self.free_ptr, self.high = 1, None, 0, 1
        if self.capacity > self.cache.method.kv_max:
            self._resize(self.cache.method.kv_max)

    # -- the update called by the attention module ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Make room (evicting per the phase), write the block's pairs into free slots, return the full buffers.

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
        phase = self.cache.phase
        if phase is not None and phase.kind == "probe":
            # A look-ahead probe pass: its keys/values go to the attention aside and are never stored.
            self.probe_kv = (key_states, value_states)  # [B, H, w, D] each
            return self.keys, self.values
        n = key_states.shape[2]
        evict = self._evict_count(n) if phase is None else phase.evict
        if evict:
            self.evict(evict, curr_id=self.seen - 1, prefill=phase is not None and phase.kind == "prefill")
        if self.free is None:
            self.new_slots = self._append(key_states, value_states)
        else:
            self.new_slots = self._write_free(key_states, value_states)
        self.filled += n
        self.seen += n
        if phase is None:  # HF's generate passes no pass description: hand the layer to its attention call
            _handoff.layer = self
        return self.keys, self.values

    def _evict_count(self, n: int) -> int:
        """Driven by HF generate (no phase stated): the eviction before a block of ``n``, inferred from the block."""
        first_decode = n == 1 and self.seen > 0 and not self.decoding
        self.decoding = self.decoding or first_decode
        return self.cache.method.num_to_evict(self.filled, n, self.cache.method.kv_max, first_decode)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> slice:
        """Write the block [B, H, n, D] at slots [filled, filled + n) of a compact layout; return those slots."""
        n = key_states.shape[2]
        needed = self.filled + n
        if needed > self.capacity:
            if self.cache.method.bounded:
                raise ValueError(f"a block of {n} tokens does not fit in kv_max={self.cache.method.kv_max}")
            # Grow geometrically when HF generate drives the cache (the engine reserves the exact size).
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

    def end_prefill(self) -> None:
        """Free what only prefill evictions read: the look-ahead probe's values and stored queries."""
        self.probe = self.probe_state = None
        self.decoding = True

    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted real positions held, per sample and local KV head (host copy; for tests and inspection)."""
        pos = self.pos.cpu()
        return [[sorted(p for p in row.tolist() if p >= 0) for row in sample] for sample in pos]


class BatchMaxCache(Cache):
    """KV cache bounded by ``method.kv_max`` pairs per (sample, KV head) during prefill and decoding.

    Use it through ``batchmax_tp.core.engine.generate`` (Algorithm 1's block schedule) or as a drop-in
    ``model.generate(..., past_key_values=BatchMaxCache(method))`` on a model whose attention implementation is
    "batchmax"; HF's generate prefills the whole prompt in one block, so a prompt longer than ``kv_max`` needs
    ``prefill_chunk_size=p`` (identical to Algorithm 1 when ``kv_max`` is a multiple of ``p``).

    ``reserve`` preallocates that many slots for FKV/ED so their prefill does not reallocate.
    """

    def __init__(self, method: Method, num_layers: int | None = None, reserve: int = 0):
        self.method = method
        self.reserve = reserve
        self.phase: Phase | None = None
        self.peak_kv_bytes = 0
        self.peak_meta_bytes = 0  # largest bookkeeping held at once (``meta_bytes``: the probe's prefill-only part too)
        self.peak_workspace_bytes = 0  # largest peak of one attention call (attention.workspace_bytes)
        if num_layers is None:
            super().__init__(layers=None, layer_class_to_replicate=self._new_layer)
        else:
            super().__init__(layers=[BoundedLayer(self, i) for i in range(num_layers)])

    def _new_layer(self) -> BoundedLayer:
        return BoundedLayer(self, len(self.layers))

    def begin(self, phase: Phase | None) -> None:
        """State the phase of the next forward pass (the engine does; HF generate leaves it None)."""
        self.phase = phase

    def note_capacity(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        self.note_meta()

    def note_meta(self) -> None:
        self.peak_meta_bytes = max(self.peak_meta_bytes, self.meta_bytes())

    def end_prefill(self) -> None:
        """The prefill is over (the engine says so): free the probe's prefill-only buffers in every layer."""
        self.note_meta()
        for layer in self.layers:
            layer.end_prefill()

    def note_workspace(self, nbytes: int) -> None:
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, nbytes)

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers allocated now (all layers)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def meta_bytes(self) -> int:
        """Bytes of the per-slot bookkeeping held now (positions, attention sums, the additive mask and, during a
        probe rule's prefill, look-ahead sums), and the stored probe queries of a rule that probes every few blocks."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (layer.pos, layer.score, layer.bias, layer.probe)
            if t is not None
        ) + sum(layer.probe_state.nbytes() for layer in self.layers if layer.probe_state is not None)

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """Per layer, sample and local KV head: the sorted positions of the pairs held."""
        return [layer.kept_positions() for layer in self.layers]
