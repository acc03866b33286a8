"""A fixed pool of slots for continuous batching: ``slots`` cache rows allocated once, constant for the whole run.

Each slot holds one request at a time. Under BM its prefill chunks run in passes with the chunks of the other
prefilling rows, each row at its own position and with its own evictions, on its unpadded prompt, so the kept
positions are those of ``engine.generate`` of that prompt alone. Under FKV/ED its prefill runs on a cache bound to
the slot's row (views of the pool's tensors), with the rows of the requests admitted beside it when their prompts
have its length (``core.scheduler`` groups). Then the slot joins the decode steps, where every decoding slot writes
its token and attends in one pass over the pool, each at its own position and eviction step.

- ``BoundedPool`` (BM): per layer keys/values [S, H, C + 1, D], and per slot ``pos``/``score``/``bias`` as in
  ``core.cache`` and a free list ``free`` [S, H, C + 1] with C = ``kv_max``. Column C is a scratch slot: a row
  that is not decoding in a decode pass writes its (unused) pair there, so nothing else is touched; the free
  lists end in C and no attention or eviction ever reads it.
- ``DensePool`` (FKV, ED) on the model's SDPA: per layer keys/values [S, H, C + 1, D] holding slots
  ``[0, length)`` of each row; C = ``kv_max`` for ED (its prompt is prefilled into a prompt-sized staging cache,
  one slot at a time, and the newest pair moves into the row: Algorithm 3's first eviction), the longest prompt +
  generation for FKV (each slot reserves a whole request, so admission never needs more).

A group admitted with ``shared=True`` holds one prompt several times (the choices of a multiple-choice question, scored
from one context): its prefill runs on the first row alone and ``graduate`` copies that row into the others, which
is exact, since a slot's state after its prompt depends on the prompt only.

Per-slot state between passes is host integers (``RowState``). Each pool describes its passes from them
(``prefill_pass`` for BM, ``decode_pass`` for both: a ``step.RowsPass``, its tensors built once per pass, handed
to the attention) and advances them; nothing per pass is set on a pool or layer. The dense pools' prefill runs on a
``DenseCache`` over the group's rows (``admit``), as the static engine's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from . import probe as lookahead
from .baseline import DenseCache, DenseLayer
from .cache import SlotLayer, free_slots
from .method import Method
from .schedule import Phase
from .step import Eviction, RowsPass, SlotWork
from .workspace import decode_workspace_bytes, eviction_layers


@dataclass
class RowState:
    """One slot's host state: pairs held (``filled``), next position (``seen``), write pointer into its free list
    (``ptr``), slots ever written (``high``), whether its free list is still the identity (``contiguous``), whether
    its last pass was a look-ahead probe (``probed``: its next prefill eviction ranks with it); the dense pools'
    ``length`` (slots [0, length) held)."""

    filled: int = 0
    seen: int = 0
    ptr: int = 0
    high: int = 0
    contiguous: bool = True
    probed: bool = False
    length: int = 0


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Pool(Cache):
    """What both pools share: rows, peaks, the shared prefill's fork."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, layer_class, static: bool):
        super().__init__(layers=[layer_class(self, i) for i in range(num_layers)])
        self.method, self.slots, self.capacity = method, slots, capacity
        # static: every decode pass attends over all C slots (one shape for the whole run: compiled or captured
        # once); else over the slots written so far
        self.static = static
        self.stacks: dict[str, torch.Tensor] = {}
        self.rows = [RowState() for _ in range(slots)]
        self.row_caches: dict[int, Cache] = {}  # first slot of each group being prefilled -> the group's cache
        self.peak_kv_bytes = self.peak_meta_bytes = self.peak_workspace_bytes = 0

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the pool from the first pass's local shapes (heads under tensor parallelism), once. What an
        eviction reads is stacked over the layers [L, S, ...] (``stacks``: one call frees slots in every layer),
        each layer holding its views [S, ...]: BM's slot state, ED's few slots of K/V. BM's and FKV's K/V are one
        tensor per layer: a compiled pass writes those in place only when they are not views into a larger buffer
        (inductor copied each layer's whole K/V every pass otherwise, 138 against 100 ms a BM pass on the CPU)."""
        if self.allocated:
            return
        H, dtype, device = key_states.shape[1], key_states.dtype, key_states.device
        S, C1 = self.slots, self.capacity + 1
        L = len(self.layers)
        kv = {
            "keys": (L, S, H, C1, key_states.shape[-1]),
            "values": (L, S, H, C1, value_states.shape[-1]),
        }
        stacked = self.method.keeps_newest_only  # ED's eviction reads every layer's K/V
        self.stacks = {
            **({name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in kv.items()} if stacked else {}),
            **self.meta_stacks(L, H, dtype, device),
        }
        for i, layer in enumerate(self.layers):
            own = {} if stacked else {n: torch.zeros(shape[1:], dtype=dtype, device=device) for n, shape in kv.items()}
            layer.bind_storage({**own, **{name: t[i] for name, t in self.stacks.items()}}, dtype, device)
        self.note()

    def meta_stacks(self, L: int, H: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The pool's per-slot bookkeeping, stacked over the layers (none for the dense pools)."""
        return {}

    @property
    def allocated(self) -> bool:
        return self.layers[0].is_initialized

    def kv_bytes(self) -> int:
        return sum(_bytes(layer.keys, layer.values) for layer in self.layers) + sum(
            c.kv_bytes() for c in self.row_caches.values() if not isinstance(c, _RowBound)
        )

    def meta_bytes(self) -> int:
        return 0

    def note(self) -> None:
        """Record the peaks now (K/V, bookkeeping, and each prefilling slot's workspace)."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        self.peak_meta_bytes = max(self.peak_meta_bytes, self.meta_bytes())
        for cache in self.row_caches.values():
            self.peak_workspace_bytes = max(self.peak_workspace_bytes, cache.peak_workspace_bytes)

    def note_workspace(self, nbytes: int) -> None:
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, nbytes)

    def release(self) -> None:
        """Drop every buffer (the run is over): the layers refer to their pool, so without this the memory would
        wait for a garbage collection."""
        self.stacks = {}
        self.row_caches.clear()
        self.layers.clear()

    def note_decode(self, query_group: int, hi: int) -> None:
        """Note a decode pass's workspace from the host (a compiled pass does not: ``attention._decode_attention``);
        ``query_group``: query heads per KV head."""
        keys = self.layers[0].keys  # [S, H, C + 1, D]
        H, D = keys.shape[1], keys.shape[-1]
        self.note_workspace(decode_workspace_bytes(self.slots, H * query_group, H, hi, D, keys.element_size()))

    def _decode_pass(
        self,
        work: tuple[SlotWork, ...],
        write: list[int],
        seen: list[int],
        hi: int,
        evicting: list,
        device,
        lengths: list[int] | None = None,
    ) -> RowsPass:
        """A decode pass over every row from per-row host lists (one host-to-device copy): ``write`` (BM: the index
        into the row's free list; the dense pools: the slot), ``seen`` (the position fed; -1 for idle rows) and, for
        the dense pools, ``lengths`` (the slots each row holds after the pass: the additive mask of its row); the
        decoding rows of ``work`` ride in the same copy."""
        S, k = self.slots, len(work)
        decoding = [w.row for w in work] + [-1] * (S - k)
        packed = to_device([write, seen, decoding, *([lengths] if lengths is not None else [])], device)  # [3|4, S]
        qpos = packed[1].view(S, 1)  # [S, 1]; -1 for idle rows
        bias = active = None
        if lengths is not None:  # [S, hi]: 0 for each row's held slots, -inf after
            bias = torch.zeros(S, hi, dtype=self.layers[0].dtype, device=device)
            bias.masked_fill_(torch.arange(hi, device=device) >= packed[3][:, None], float("-inf"))
        else:  # [S, 1, 1]: the rows whose attention joins their slots' sums
            active = (qpos >= 0).to(torch.float32).view(S, 1, 1)
        return RowsPass(
            kind="decode",
            pool=self,
            rows=torch.arange(S, device=device),
            span=slice(0, S),
            qpos=qpos,
            real=None,
            write=packed[0].view(S, 1),
            hi=hi,
            evictions=_evictions(evicting, device),
            active=active,
            bias=bias,
            decoding=packed[2, :k],
        )

    def fork(self, rows: range) -> None:
        """Copy row ``rows.start`` (a shared prefill's result) into the other rows of ``rows``, in every layer."""
        for layer in self.layers:
            for t in layer.row_tensors():
                t[rows.start + 1 : rows.stop] = t[rows.start : rows.start + 1]


class _RowBound:
    """Marks a batch-1 cache whose layers are views of a pool row (its K/V bytes are the pool's)."""


class _PoolLayer(SlotLayer):
    """One decoder layer of a pool: keys/values [S, H, C + 1, D], views of the pool's stacks (``_Pool.allocate``)."""

    def bind_storage(self, views: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        for name, view in views.items():
            setattr(self, name, view)
        self.dtype, self.device, self.is_initialized = dtype, device, True

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor with one row per slot (what ``_Pool.fork`` copies)."""
        return self.keys, self.values

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool allocates in a prefill pass first
        raise RuntimeError("a pool's decode pass ran before any prefill allocated it")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.cache.capacity


# -- Batch-Max ------------------------------------------------------------------------------------------------------
class PoolLayer(_PoolLayer):
    """One decoder layer of the BM pool: keys/values [S, H, C + 1, D]; pos, score, bias, free [S, H, C + 1]; for a
    rule with a look-ahead probe, ``probe`` [S, H, C + 1] and (a rule probing every few blocks) the last probe's
    stored queries of every row (``probe_q``, ``probe_lse``, ``probe_w``), allocated by the first probe pass."""

    def __init__(self, cache: BoundedPool, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.pos = self.score = self.bias = self.free = self.probe = None
        self.probe_q = self.probe_lse = self.probe_w = None

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        stored = (self.probe, self.probe_q, self.probe_lse, self.probe_w)
        return (
            self.keys,
            self.values,
            self.pos,
            self.score,
            self.bias,
            self.free,
            *(t for t in stored if t is not None),
        )

    def reset_row(self, row: int) -> None:
        self.pos[row] = -1
        self.score[row] = 0.0
        self.bias[row] = float("-inf")
        self.free[row] = torch.arange(self.free.shape[-1], device=self.device)

    def meta_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.pos, self.score, self.bias, self.free, self.probe, self.probe_q, self.probe_lse, self.probe_w

    # -- a pass's writes: the new pairs (evictions: ``BoundedPool.evict``, before the pass) ----------------------
    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write each row's columns [R, H, n, D] at the slots its free list gives (masked columns: the scratch slot)."""
        R, H, n, _ = key_states.shape
        C1 = self.keys.shape[2]
        slots = step.take(self.free).gather(2, step.write[:, None, :].expand(R, H, n))  # [R, H, n]
        heads = torch.arange(H, device=self.device)[None, :, None]  # [1, H, 1]
        flat = ((step.rows[:, None, None] * H + heads) * C1 + slots).view(-1)  # [R*H*n] into the flattened rows
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, key_states.reshape(-1, key_states.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(
            0, flat, value_states.reshape(-1, value_states.shape[-1])
        )
        qpos = step.qpos[:, None, :].expand(R, H, n)  # [R, H, n]
        self.pos.view(-1).index_copy_(0, flat, qpos.reshape(-1))
        self.score.view(-1).index_fill_(0, flat, 0.0)
        bias = torch.zeros(qpos.shape, dtype=self.bias.dtype, device=self.device).masked_fill_(qpos < 0, float("-inf"))
        self.bias.view(-1).index_copy_(0, flat, bias.view(-1))

    def store_probe(self, rows: torch.Tensor, q: torch.Tensor, own_lse: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep the rows' probe queries [R, Hkv, g*w, D], log-sum-exp [R, Hkv, g*w, 1] and weights [R, w] for
        re-scoring (``probe.ProbeState``); every row's are allocated by the first probe pass."""
        if self.probe_q is None:
            S = self.cache.slots
            self.probe_q, self.probe_lse, self.probe_w = (t.new_zeros((S, *t.shape[1:])) for t in (q, own_lse, weights))
        for dst, src in ((self.probe_q, q), (self.probe_lse, own_lse), (self.probe_w, weights)):
            dst.index_copy_(0, rows, src)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.capacity + query_length, 0

    def update(self, *args, **kwargs):
        raise RuntimeError("BM's pool is written by the 'batchmax' attention from its pass (step.RowsPass), not by HF")


class BoundedPool(_Pool):
    """BM's pool: ``slots`` rows of ``kv_max`` slots (+ the scratch column) per layer and local KV head. A row's
    prefill chunks run in passes with other rows' chunks (each row at its own position, its own evictions), then
    its decode steps in passes over the whole pool; ``prefill_pass``/``decode_pass`` describe each pass
    (``step.RowsPass``) from the rows' host state (``RowState``), which they advance."""

    def __init__(self, method: Method, num_layers: int, slots: int, static: bool = False):
        if not method.reads_scores:
            raise ValueError(f"BoundedPool serves method 'bm' (its attention scores), not {method.name!r}")
        super().__init__(method, num_layers, slots, method.kv_max, PoolLayer, static)

    def meta_stacks(self, L: int, H: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """pos (-1: empty), score, bias (-inf: empty), the free lists (identity, ending in the scratch slot C) and,
        for a rule with a look-ahead probe, probe: each [L, S, H, C + 1]."""
        shape = (L, self.slots, H, self.capacity + 1)
        stacks = {
            "pos": torch.full(shape, -1, dtype=torch.long, device=device),
            "score": torch.zeros(shape, dtype=torch.float32, device=device),
            "bias": torch.full(shape, float("-inf"), dtype=dtype, device=device),
            "free": torch.arange(shape[-1], device=device).repeat(*shape[:-1], 1),
        }
        if self.method.lookahead:
            stacks["probe"] = torch.zeros(shape, dtype=torch.float32, device=device)
        return stacks

    def meta_bytes(self) -> int:
        return sum(_bytes(*layer.meta_tensors()) for layer in self.layers)

    def evict(self, ev: Eviction) -> None:
        """Free ``ev.count`` slots in each of the rows ``ev.rows``, in as many layers at once as
        ``workspace.EVICT_CHUNK_BYTES`` allows (usually all: ``cache.free_slots`` on their slot state gathered from
        the stacks, [n*E, H, C]), and make the freed slots the head of each row's free list. A "rescore" eviction
        first ranks each layer's slots with that layer's stored probe queries."""
        bias = self.stacks["bias"]  # [L, S, H, C + 1]
        L, E, H, C = bias.shape[0], ev.rows.numel(), bias.shape[2], self.capacity
        step = eviction_layers(L, E, H, C, bias.element_size())
        for first in range(0, L, step):
            self._evict_layers(ev, slice(first, min(first + step, L)))

    def _evict_layers(self, ev: Eviction, layers: slice) -> None:
        e, C = ev.rows, self.capacity
        state = {n: self.stacks[n][layers, ..., :C] for n in ("pos", "score", "bias")}  # [n, S, H, C] views
        pos, score, bias = (t.index_select(1, e).flatten(0, 1) for t in state.values())  # [n*E, H, C]
        n = state["pos"].shape[0]
        probe = None  # [n*E, H, C]
        if ev.probe == "fresh":
            probe = self.stacks["probe"][layers, ..., :C].index_select(1, e).flatten(0, 1)
        elif ev.probe == "rescore":  # each layer's last probe pass's queries, over the slots it holds now
            probe = torch.cat([self._rescored(lay, e, p) for lay, p in zip(self.layers[layers], pos.chunk(n))])
        priority = self.method.priority(score, pos, ev.curr_id.repeat(n, 1, 1), probe)  # [n*E, H, C]
        freed = free_slots(priority, pos, score, bias, ev.count)  # [n*E, H, count]
        for dst, src in zip(state.values(), (pos, score, bias)):
            dst.index_copy_(1, e, src.unflatten(0, (n, -1)))
        self.stacks["free"][layers, ..., : ev.count].index_copy_(1, e, freed.unflatten(0, (n, -1)))

    def _rescored(self, layer: PoolLayer, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s look-ahead attention [E, H, C] over the slots ``pos`` [E, H, C] of ``rows``, from the
        queries its last probe pass stored."""
        state = lookahead.ProbeState(
            *(t.index_select(0, rows) for t in (layer.probe_q, layer.probe_lse, layer.probe_w))
        )
        return lookahead.rescore(state, layer.keys[:, :, : self.capacity].index_select(0, rows), pos)

    def admit(self, rows: range, prompt_len: int, shared: bool = False) -> None:
        """Requests enter the slots ``rows``: their slots are emptied."""
        for row in rows:
            if self.allocated:
                for layer in self.layers:
                    layer.reset_row(row)
            self.rows[row] = RowState()

    def graduate(self, rows: range, decodes: list[bool]) -> None:
        """A shared group's prefill (on its first row) is over: that row becomes every row of the group."""
        if len(rows) > 1:
            self.fork(rows)
            for row in rows[1:]:
                self.rows[row] = RowState(**vars(self.rows[rows.start]))
        self.note()

    def _evict_row(self, row: int, phase: Phase, prefill: bool) -> tuple[int, int, int, str | None]:
        """A row's eviction before ``phase`` (count: its empty slots + the phase's), its host state advanced."""
        st, C = self.rows[row], self.capacity
        probe = None
        if prefill and self.method.lookahead:
            probe = "fresh" if st.probed or self.method.probe_every == 1 else "rescore"
        count = C - st.filled + phase.evict
        st.filled -= phase.evict
        st.ptr, st.contiguous, st.high = 0, False, C
        return row, count, st.seen - 1, probe

    def prefill_pass(
        self, work: tuple[SlotWork, ...], prompts: list[torch.Tensor], device
    ) -> tuple[RowsPass, torch.Tensor, torch.Tensor]:
        """The pass of ``work`` (each row's prefill chunk, or each row's look-ahead probe), with its input ids and
        RoPE positions [R, n]: every row's tokens right-aligned, masked columns in front."""
        kind = work[0].phase.kind
        n = self.method.lookahead if kind == "probe" else max(w.phase.size for w in work)  # probes: the whole window
        rows = [w.row for w in work]
        qpos, write, evicting, ids = [], [], [], []
        for w, prompt in zip(work, prompts):
            ph, st = w.phase, self.rows[w.row]
            pad = n - ph.size
            qpos.append([-1] * pad + list(range(ph.start, ph.end)))
            ids.append(torch.nn.functional.pad(prompt[ph.start : ph.end], (pad, 0)))
            if kind == "probe":
                st.probed = True
                continue
            if ph.evict:
                evicting.append(self._evict_row(w.row, ph, prefill=True))
            st.probed = False
            write.append([self.capacity] * pad + list(range(st.ptr, st.ptr + ph.size)))
            st.ptr, st.filled, st.seen = st.ptr + ph.size, st.filled + ph.size, ph.end
            if st.contiguous:
                st.high = max(st.high, st.ptr)
        R, hi = len(rows), max(self.rows[r].high for r in rows)
        columns = to_device([*qpos, *write], device)  # [R or 2R, n]: one host-to-device copy
        qpos_t = columns[:R]  # [R, n]
        step = RowsPass(
            kind=kind,
            pool=self,
            rows=to_device(rows, device),
            span=_span(rows),
            qpos=qpos_t,
            real=None if all(w.phase.size == n for w in work) else qpos_t >= 0,
            write=columns[R:] if write else None,
            hi=hi,
            evictions=_evictions(evicting, device),
        )
        return step, torch.stack(ids), qpos_t.clamp(min=0)

    def decode_pass(self, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: each decoding row's eviction (its own step's count) and write slot."""
        S, C = self.slots, self.capacity
        ptr, seen, evicting = [C] * S, [-1] * S, []
        for w in work:
            st = self.rows[w.row]
            if w.phase.evict:  # Algorithm 1: p pairs (the empty slots too) go before a step that does not fit
                evicting.append(self._evict_row(w.row, w.phase, prefill=False))
            ptr[w.row], seen[w.row] = st.ptr, st.seen
            if st.contiguous:
                st.high = max(st.high, st.ptr + 1)
            st.ptr, st.filled, st.seen = st.ptr + 1, st.filled + 1, st.seen + 1
        hi = C if self.static else max(self.rows[w.row].high for w in work)
        return self._decode_pass(work, ptr, seen, hi, evicting, device)

    def kept_positions(self, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the sorted positions row ``row`` holds (host copy; for tests)."""
        C = self.capacity
        return [
            [sorted(p for p in head.tolist() if p >= 0) for head in layer.pos[row, :, :C].cpu()]
            for layer in self.layers
        ]


def to_device(data: list, device) -> torch.Tensor:
    """Host lists (of ints) as one tensor on ``device``. On CUDA through pinned memory, asynchronously: a copy from
    pageable memory would wait for the device to finish its queued work, so the host could not run ahead."""
    if torch.device(device).type == "cuda":
        return torch.tensor(data, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, device=device)


def _evictions(evicting: list[tuple[int, int, int, str | None]], device) -> tuple[Eviction, ...]:
    """(row, count, curr_id, probe) per evicting row -> one ``Eviction`` per (count, probe) kind."""
    kinds: dict[tuple[int, str | None], list[tuple[int, int]]] = {}
    for row, count, curr_id, probe in evicting:
        kinds.setdefault((count, probe), []).append((row, curr_id))
    out = []
    for (count, probe), members in kinds.items():
        t = to_device(members, device)  # [E, 2]: one copy per kind
        out.append(Eviction(t[:, 0], t[:, 1].view(-1, 1, 1), count, probe))
    return tuple(out)


def _span(rows: list[int]) -> slice | None:
    """``rows`` as a slice when they are adjacent and ascending, else None."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None


class _RowView:
    """A cache layer whose buffers are views of the adjacent rows ``rows`` of a pool (slots [0, C)): the pool is
    allocated from the first pass's shapes, then the layer binds its views."""

    def __init__(self, cache: Cache, layer_idx: int, pool: _Pool, rows: range):
        super().__init__(cache, layer_idx)
        self.pool, self.rows = pool, slice(rows.start, rows.stop)

    def bind(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Allocate the pool if needed; set keys/values to the rows' views [k, H, C, D]; return the pool layer."""
        self.pool.allocate(key_states, value_states)
        src, r, C = self.pool.layers[self.layer_idx], self.rows, self.pool.capacity
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = src.keys[r, :, :C], src.values[r, :, :C]  # [k, H, C, D] views
        self.is_initialized = True
        return src


# -- the baselines --------------------------------------------------------------------------------------------------
class DensePoolLayer(_PoolLayer):
    """One decoder layer of the baselines' pool: keys/values [S, H, C + 1, D]; row r holds slots [0, length)."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.capacity + query_length, 0

    def write(self, step: RowsPass, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A decode pass: each row's pair [S, H, 1, D] at its slot ``step.write`` (idle rows: the scratch column)."""
        S, H = self.keys.shape[:2]
        idx = step.write[:, None, :, None]  # [S, 1, 1, 1]
        self.keys.scatter_(2, idx.expand(S, H, 1, self.keys.shape[-1]), key_states)
        self.values.scatter_(2, idx.expand(S, H, 1, self.values.shape[-1]), value_states)

    def update(self, *args, **kwargs):
        raise RuntimeError("a dense pool's decode pass is written by the 'batchmax' attention (step.RowsPass)")


class _RowDenseLayer(_RowView, DenseLayer):
    """FKV's prefill layer: ``DenseLayer`` on views of a pool row (slots [0, C))."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.bind(key_states, value_states)


class _RowDenseCache(DenseCache, _RowBound):
    def __init__(self, pool: DensePool, rows: range, prompt_mask: torch.Tensor):
        super().__init__(pool.method, len(pool.layers), pool.capacity, prompt_mask)
        self.layers = [_RowDenseLayer(self, i, pool, rows) for i in range(len(pool.layers))]


class _StagingLayer(DenseLayer):
    """ED's prefill layer: a prompt-sized buffer of its own; the pool is allocated from its first shapes."""

    def __init__(self, cache: DenseCache, layer_idx: int, pool: DensePool):
        super().__init__(cache, layer_idx)
        self.pool = pool

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.pool.allocate(key_states, value_states)
        super().lazy_initialization(key_states, value_states)


class _StagingCache(DenseCache):
    def __init__(self, pool: DensePool, prompt_mask: torch.Tensor):
        super().__init__(pool.method, len(pool.layers), prompt_mask.shape[1], prompt_mask)
        self.layers = [_StagingLayer(self, i, pool) for i in range(len(pool.layers))]


class DensePool(_Pool):
    """The baselines' pool: prefill on the model's SDPA, decode on ``core.attention``'s fused grouped product.
    ``capacity``: ED ``kv_max``; FKV the longest prompt + max_new_tokens - 1."""

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, static: bool = False):
        if method.reads_scores:
            raise ValueError(
                f"DensePool serves the baselines fkv and ed (no attention scores read), not {method.name!r}"
            )
        super().__init__(method, num_layers, slots, capacity, DensePoolLayer, static)

    def evict(self, ev: Eviction) -> None:
        """ED's eviction (Algorithm 3, ``Method.keep_newest`` with one slot for every row) in the rows ``ev.rows``, in
        every layer at once: each keeps its newest pair, at slot ``ev.count`` (its pairs before the pass, less one),
        moved to slot 0. Only that slot is gathered ([L, E, H, D])."""
        for name in ("keys", "values"):
            stack = self.stacks[name]  # [L, S, H, C + 1, D]
            stack[:, :, :, 0].index_copy_(1, ev.rows, stack[:, :, :, ev.count].index_select(1, ev.rows))

    def admit(self, rows: range, prompt_len: int, shared: bool = False) -> DenseCache:
        device = self.layers[0].device if self.allocated else None
        prefill = rows[:1] if shared else rows  # shared: one prompt for all rows, prefilled once
        mask = torch.ones(len(prefill), prompt_len, dtype=torch.long, device=device)  # [k, s]: unpadded
        if not self.method.keeps_newest_only:  # FKV: the row holds the prompt itself
            if prompt_len > self.capacity:
                raise ValueError(f"a {prompt_len}-token prompt does not fit FKV slots of {self.capacity}")
            cache = _RowDenseCache(self, prefill, mask)
        else:
            cache = _StagingCache(self, mask)
        for row in rows:
            self.rows[row] = RowState()
        self.row_caches[rows.start] = cache
        return cache

    def graduate(self, rows: range, decodes: list[bool]) -> None:
        """FKV: the row holds its prompt. ED: the prompt's newest pair moves into slot 0 of the row (Algorithm 3's
        first eviction, done once here; the first decode step's own eviction then finds one pair); a request with
        no decode step (its ``decodes`` entry False) keeps its prompt, as alone."""
        cache = self.row_caches[rows.start]
        self.note()
        held = cache.length
        ed = self.method.keeps_newest_only
        if ed:  # [k or 1, H, D] -> every row of the group
            for layer, src in zip(self.layers, cache.layers):
                self.method.keep_newest(layer.keys[rows.start : rows.stop], src.keys, held - 1)
                self.method.keep_newest(layer.values[rows.start : rows.stop], src.values, held - 1)
        elif cache.layers[0].rows.stop < rows.stop:  # FKV, a shared prefill: its row becomes every row
            self.fork(rows)
        for row, more in zip(rows, decodes):
            self.rows[row] = RowState(seen=cache.seen, length=1 if ed and more else held)
        cache.layers.clear()  # a layer refers to its cache: ED's staging buffers go now, not at the next gc
        del self.row_caches[rows.start]

    def decode_pass(self, work: tuple[SlotWork, ...], device) -> RowsPass:
        """A decode pass over every row: ED's keep-newest where a row's step evicts, each row's write slot, and the
        additive mask [S, span] of the slots each row holds (idle rows: slot 0 alone, finite and never used)."""
        S, C = self.slots, self.capacity
        write, seen, lengths, evicting = [C] * S, [-1] * S, [1] * S, []
        for w in work:
            st = self.rows[w.row]
            if w.phase.evict:  # ED (Algorithm 3): only the newest pair stays, moved to slot 0
                evicting.append((w.row, st.length - 1, st.seen - 1, None))
                st.length = 1
            write[w.row], seen[w.row] = st.length, st.seen
            st.length, st.seen = st.length + 1, st.seen + 1
            lengths[w.row] = st.length
        hi = C if self.static else max(lengths[w.row] for w in work)
        return self._decode_pass(work, write, seen, hi, evicting, device, lengths)

    def meta_bytes(self) -> int:
        return 0

    def kept_positions(self, row: int) -> list[list[list[int]]]:
        """Per layer and local KV head: the positions row ``row`` holds (slots [0, length) hold the last ``length``
        positions, in order)."""
        st = self.rows[row]
        held = list(range(st.seen - st.length, st.seen))
        return [[held] * layer.keys.shape[1] for layer in self.layers]
