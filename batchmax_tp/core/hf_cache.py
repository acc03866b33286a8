"""The HF drop-in: ``model.generate(..., past_key_values=BatchMaxCache(method))`` inside ``use_drop_in(model)``.

On top of the engine, plugged in through transformers' Cache, Attention and mask APIs: the cache holds one of the
engine's bounded pools (``core.bounded.BoundedPool``), a row per sample of the batch, and describes each forward pass
HF's generate runs as one pass over it (``step.RowsPass``: the block of ``n`` tokens every row feeds, at the padded
batch's positions; its eviction inferred from the block by ``Method.num_to_evict``, as HF's generate states no
schedule), which the engine's attention runs in every layer (``attention.batchmax_attention``). One storage, one
eviction path, one attention: this module adds the hand-over alone.

The hand-over (transformers asks the cache for the mask's sizes, builds the mask once per forward, then calls, per
layer, ``past_key_values.update`` and the attention function with that mask): the cache's ``get_mask_sizes`` hands
the cache to the mask builder ("batchmax_hf", registered here, through a thread-local: this module is the only
place one exists), which allocates the pool (first forward), describes the pass from the batch's padding mask and
the cache's ``state`` (the pool's host state, held here as the engine holds it), takes the rows' states after it and
executes its storage part (``pool.ready``: evictions, bookkeeping, the workspace count), and returns the pass as the
forward's mask: transformers hands it to every layer's attention call, which runs it. The block's pairs go
through ``update`` untouched: the attention writes them into the pool's slots.

Every method runs on the bounded pool. HF's generate gives no length up front, so FKV's and ED's pool (never
evicted from during the prompt) grows by doubling (``reserve``: the exact size, when known). HF's generate runs no
look-ahead probe: a rule with one ranks without it here (the engine runs it); a rule whose heads share a budget runs
in the engine only.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from . import attention
from .bounded import BoundedPool
from .method import Method
from .schedule import Phase
from .slots import RowState, kv_layout
from .step import Change, PoolState, RowsPass, SlotWork

logger = logging.getLogger(__name__)

NAME = "batchmax_hf"  # the drop-in's attention implementation (the engine's is "batchmax")

# Per thread: the model the drop-in runs (``use_drop_in``: its KV layout and layers), and the cache whose mask sizes
# transformers asked for last, whose pass the mask builder that follows describes.
_handoff = threading.local()


def drop_in_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The drop-in's attention: query [B, Hq, n, D]; key/value the block's pairs [B, Hkv, n, D], handed through by
    the cache's ``update``; ``attention_mask`` the forward's pass (``drop_in_mask``). Returns [B, n, Hq, D]."""
    if not isinstance(attention_mask, RowsPass):
        raise RuntimeError("the 'batchmax_hf' attention needs past_key_values=BatchMaxCache(...) (use_drop_in)")
    return attention.batchmax_attention(module, query, key, value, None, scaling, batchmax=attention_mask)


def drop_in_mask(attention_mask: torch.Tensor | None = None, batch_size: int = 0, q_length: int = 0, **kwargs):
    """Mask builder for "batchmax_hf": the forward's pass over the cache's pool (``BatchMaxCache.describe``), from
    the batch's padding mask (bool [B, seen + n], True for real tokens; or None), in place of a mask."""
    cache, _handoff.cache = getattr(_handoff, "cache", None), None
    if cache is None:
        raise RuntimeError("the 'batchmax_hf' attention needs past_key_values=BatchMaxCache(...)")
    return cache.describe(attention_mask, batch_size, q_length)


def register() -> None:
    """Register the drop-in's attention and mask builder under "batchmax_hf" (idempotent)."""
    AttentionInterface.register(NAME, drop_in_attention)
    AttentionMaskInterface.register(NAME, drop_in_mask)


@contextlib.contextmanager
def use_drop_in(model: torch.nn.Module):
    """Run ``model`` with the drop-in's attention inside the block (for ``model.generate(...,
    past_key_values=BatchMaxCache(...))``), restoring its implementation after."""
    register()
    previous = getattr(_handoff, "model", None)
    _handoff.model = (kv_layout(model), model.config.get_text_config().num_hidden_layers)
    try:
        with attention.use_batchmax_attention(model, NAME):
            yield model
    finally:
        _handoff.model = previous


class DropInPool(BoundedPool):
    """The drop-in's pool: BM's bounded rows for every method, its prefill ranked without a look-ahead probe (HF's
    generate runs none), and, while nothing has been evicted, grown in place of a new one (``grown``)."""

    def _evict_row(self, row: int, st: RowState, evict: int, prefill: bool, tier=None) -> tuple:
        row, count, curr_id, _, _ = super()._evict_row(row, st, evict, prefill)
        return row, count, curr_id, None, None

    def grown(self, state: PoolState, capacity: int) -> DropInPool:
        """A pool of ``capacity`` slots per row holding what this one holds in ``state`` (only while no row has
        evicted: slots [0, filled) then hold every row's pairs and the free lists are still the identity); the
        rows' state is the same."""
        if not all(st.contiguous for st in state.rows):
            raise RuntimeError("only a pool no row has evicted from grows")
        new = DropInPool(self.method, len(self.layers), self.slots, capacity)
        new.allocate(self.layout)
        C = self.capacity
        for old_layer, new_layer in zip(self.layers, new.layers):
            for name in ("keys", "values"):
                getattr(new_layer, name)[:, :, :C] = getattr(old_layer, name)[:, :, :C]
        for name, t in self.stacks.items():
            if name != "free":
                new.stacks[name][..., :C] = t[..., :C]
        new.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes() + new.kv_bytes())  # both held while copying
        new.peak_meta_bytes = max(new.peak_meta_bytes, self.peak_meta_bytes)
        new.peak_workspace_bytes = self.peak_workspace_bytes
        self.release()
        return new

    def reordered(self, state: PoolState, index: list[int]) -> Change:
        """Rows in the order ``index`` gives (beam search): row r becomes row ``index[r]``, its state and storage."""
        return Change(after=tuple((row, state.rows[i].copy()) for row, i in enumerate(index)), order=tuple(index))

    def apply(self, change: Change) -> None:
        """``BoundedPool``'s, and a reorder's storage (``change.order``), in every layer."""
        super().apply(change)
        if change.order is None:
            return
        index = torch.tensor(change.order, device=self.layout.device)
        for layer in self.layers:
            for t in (layer.keys, layer.values):
                t.copy_(t.index_select(0, index))
        for t in self.stacks.values():
            t.copy_(t.index_select(1, index))


class DropInLayer(CacheLayerMixin):
    """One decoder layer as HF's generate sees it: it holds nothing (the pool holds every layer's slots); its
    ``update`` hands the block's pairs through to the attention, which writes them as the forward's pass says."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: BatchMaxCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states: the block's pairs [B, H, n, D] (RoPE applied), returned as they are for the
        attention call that follows, which writes them into the pool."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if getattr(_handoff, "model", None) is None:
            raise RuntimeError("BatchMaxCache runs inside batchmax_tp.core.hf_cache.use_drop_in(model)")
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen + query_length, 0

    def get_max_length(self) -> int:
        """The most pairs held per (sample, KV head): the method's ``kv_max``, -1 for the full cache."""
        kv_max = self.cache.method.held_kv_max
        return -1 if kv_max is None else kv_max

    def reset(self) -> None:
        self.is_initialized = False
        if self.layer_idx == 0:
            self.cache.release()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.layer_idx == 0 and self.cache.pool is not None:
            self.cache.reorder(beam_idx.tolist())


class BatchMaxCache(Cache):
    """KV cache bounded by ``method.kv_max`` pairs per (sample, KV head) during prefill and decoding, for
    ``model.generate(..., past_key_values=BatchMaxCache(method))`` on a model run inside ``use_drop_in(model)``.
    HF's generate prefills the whole prompt in one block, so a prompt longer than ``kv_max`` needs
    ``prefill_chunk_size=p`` (identical to Algorithm 1 when ``kv_max`` is a multiple of ``p``); a left-padded batch
    runs as the paper's padded batch. ``reserve`` preallocates that many slots for FKV/ED so their prefill does not
    reallocate.
    """

    def __init__(self, method: Method, num_layers: int | None = None, reserve: int = 0):
        if method.scorer.share != 1 or method.scorer.taper:
            what = "heads sharing a budget" if method.scorer.share != 1 else "budgets across layers (taper)"
            raise ValueError(
                f"rule {method.rule!r}: {what} run in batchmax_tp's engine (Engine, generate), "
                "not in HF generate's BatchMaxCache"
            )
        self.method = method
        self.reserve = reserve
        self.pool: DropInPool | None = None
        self.state: PoolState | None = None  # the pool's host state: the empty one at the first forward, then replaced
        # whole by ``_change``, never edited
        if num_layers is None:
            super().__init__(layers=None, layer_class_to_replicate=self._new_layer)
        else:
            super().__init__(layers=[DropInLayer(self, i) for i in range(num_layers)])

    @property
    def seen(self) -> int:
        """Tokens fed so far = the padded position of the next token (every row's: the pool's rows' state)."""
        return 0 if self.state is None else self.state.rows[0].seen

    def _new_layer(self) -> DropInLayer:
        return DropInLayer(self, len(self.layers))

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The mask's sizes; transformers builds the forward's mask next, whose builder describes this cache's pass
        (handed over here: the layers may not exist yet at the first forward)."""
        if getattr(_handoff, "model", None) is None:
            raise RuntimeError("BatchMaxCache runs inside batchmax_tp.core.hf_cache.use_drop_in(model)")
        _handoff.cache = self
        return self.seen + query_length, 0

    def describe(self, mask: torch.Tensor | None, batch: int, n: int):
        """The forward's pass of ``n`` tokens per row of a batch of ``batch``: allocate or grow the pool as the block
        needs, describe the pass every row runs (its eviction inferred from the block), take the rows' states after
        it and execute its storage part. ``mask``: the batch's padding mask [B, seen + n] (or None)."""
        began = self.state is not None and self.state.rows[0].decoding  # HF's generate decodes since an earlier pass
        first_decode = n == 1 and self.seen > 0 and not began  # its first single-token forward after the prompt
        decoding = began or first_decode
        filled = 0 if self.state is None else self.state.rows[0].filled  # the same in every row (pads counted)
        evict = self.method.num_to_evict(filled, n, self.method.kv_max, first_decode)
        self._make_room(batch, filled + n - evict, n)
        pool, device = self.pool, self.pool.layout.device
        phase = Phase("decode" if decoding else "prefill", self.seen, self.seen + n, evict)
        work = tuple(SlotWork(row, phase) for row in range(batch))
        if decoding:
            described = pool.decode_pass(self.state, work, device)
        else:
            pads = _left_pads(mask, batch, self.seen + n)  # the pads seen so far (a later block may show more)
            described, _ = pool.prefill_pass(self.state, work, None, device, offsets=pads)
        self._change(described.change())  # its rows' states after it: ``seen`` advanced by n
        return pool.ready(described)

    def _change(self, change: Change) -> None:
        """Take a described change: the pool's host state after it (the only assignment of ``state``), then its
        storage part (``DropInPool.apply``)."""
        self.state = self.state.changed(change)
        self.pool.apply(change)

    def _make_room(self, batch: int, needed: int, n: int) -> None:
        """A pool whose rows hold ``needed`` pairs: allocated at the first forward (``method.capacity``: BM's
        ``kv_max``; FKV/ED the block or ``reserve``) from the model's layout on this rank (its share of the heads
        under tensor parallelism), grown geometrically after (FKV/ED, nothing evicted yet)."""
        if self.pool is not None and needed <= self.pool.capacity:
            return
        if self.method.capacity(needed, 1) < needed:  # a bounded cache (BM)
            raise ValueError(f"a block of {n} tokens does not fit in kv_max={self.method.kv_max}")
        if self.pool is not None:
            self.pool = self.pool.grown(self.state, max(needed, self.reserve, 2 * self.pool.capacity))
            return
        layout, layers = _handoff.model
        self.pool = DropInPool(self.method, layers, batch, self.method.capacity(max(needed, self.reserve), 1))
        self.pool.allocate(layout)
        self.state = self.pool.initial()

    def release(self) -> None:
        """Drop the pool (a new generation starts from nothing)."""
        if self.pool is not None:
            self.pool.release()
        self.pool = self.state = None

    def reorder(self, index: list[int]) -> None:
        """Rows in the order ``index`` gives (beam search): their states and storage."""
        self._change(self.pool.reordered(self.state, index))

    @property
    def peak_kv_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.peak_kv_bytes

    @property
    def peak_meta_bytes(self) -> int:
        """The most bookkeeping held at once (positions, attention sums, the additive mask, the free lists)."""
        return 0 if self.pool is None else self.pool.peak_meta_bytes

    @property
    def peak_workspace_bytes(self) -> int:
        """The largest peak of one attention call (``core.workspace``, counted from each pass's description)."""
        return 0 if self.pool is None else self.pool.peak_workspace_bytes

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers allocated now (all layers)."""
        return 0 if self.pool is None else self.pool.kv_bytes()

    def meta_bytes(self) -> int:
        """Bytes of the per-slot bookkeeping held now (positions, attention sums, the additive mask, the free lists)."""
        return 0 if self.pool is None else self.pool.meta_bytes()

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """Per layer, sample and local KV head: the sorted positions of the pairs held."""
        rows = [self.pool.kept_positions(self.state, row) for row in range(self.pool.slots)]  # [sample][layer][head]
        return [[rows[b][layer] for b in range(len(rows))] for layer in range(len(self.pool.layers))]


def _left_pads(mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Each row's pads among the first ``length`` positions of a left-padded mask [B, >= length] (None: none); a
    mask with a pad after a real token is refused in one line. Reads the mask on the host (prefill passes only)."""
    if mask is None:
        return [0] * batch
    mask = mask[:, :length].bool()
    pads = (~mask).sum(dim=1)  # [B]
    left = torch.arange(length, device=mask.device)[None, :] >= pads[:, None]  # [B, length]: left padding's shape
    if not torch.equal(mask, left):
        raise ValueError("BatchMaxCache needs a LEFT-padded batch (pads before every real token of a row)")
    return pads.tolist()
