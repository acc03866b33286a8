"""A fixed pool of slots: ``slots`` cache rows allocated once, constant for the whole run; the one engine's storage.

Each slot holds one request at a time. Its prefill runs in passes with the other prefilling rows (BM: each row's
next chunk at its own position, with its own evictions, on its unpadded prompt; FKV/ED/snap: a group of one prompt
length, one block), then the slot joins the decode passes, where every decoding slot writes its token and attends
in one pass over the pool, each at its own position and eviction step.

The method says which pool it holds (``Method.pool_kind``); the pools, one module per concept:

- ``core.slots``: what every pool shares (the rows' host state, each layer's storage, the allocation, the decode
  pass's description);
- ``core.bounded``: Batch-Max's ranked slots (``BoundedPool``) and ``snap``'s (``SnapPool``);
- ``core.layered``: Batch-Max with budgets across layers (``LayeredPool``, a rule's ``taper``);
- ``core.dense``: the baselines' rows: FKV (``FullPool``; ``PagedPool`` in blocks), ED (``NewestPool``).

A pool is storage: per-slot state between passes is host integers (``slots.RowState``) in a ``step.PoolState`` its
holder keeps (the engine; the HF drop-in's cache) and hands to every description. Each pool describes its passes
from it (``prefill_pass``, ``decode_pass``: a ``step.RowsPass``, its tensors built once per pass in one
host-to-device copy, handed to the attention, the rows' states after it inside) and its changes between passes
(``admitted``, ``graduated``, ``finished``: a ``step.Change``); the holder takes the state after each
(``PoolState.changed``) and the pool executes its storage part (``ready``, ``apply``); nothing per pass is set on a
pool or layer.
"""

from __future__ import annotations

from .bounded import BoundedPool, SnapPool
from .dense import FullPool, NewestPool, PagedPool
from .layered import LayeredPool
from .method import Method
from .slots import SlotPool

#: ``Method.pool_kind`` -> the pool class that holds its rows.
POOLS = {"bounded": BoundedPool, "full": FullPool, "newest": NewestPool, "snap": SnapPool}


def make_pool(method: Method, num_layers: int, slots: int, capacity: int, static: bool, blocks: int = 0) -> SlotPool:
    """The method's pool: ``capacity`` slots per row (``Method.decode_capacity`` of the longest request); FKV paged:
    ``blocks`` blocks shared by ``slots`` rows; snap: ``blocks`` blocks for the prompts it prefills in chunks;
    a rule with budgets across layers: a pool per layer group."""
    if method.paged:
        return PagedPool(method, num_layers, slots, blocks, static)
    if method.transient_blocks:  # snap: its prompts' full pairs in ``blocks`` blocks while they prefill in chunks
        return SnapPool(method, num_layers, slots, capacity, static, blocks)
    if (capacities := method.layer_capacities(num_layers)) is not None:
        return LayeredPool(method, capacities, slots, static)
    return POOLS[method.pool_kind](method, num_layers, slots, capacity, static)
