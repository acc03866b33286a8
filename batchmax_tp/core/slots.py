"""What every slot pool shares (``core.pool`` chooses a method's pool): the rows' host state (``RowState``), each
layer's storage (``SlotLayer``: keys/values [S, H, C + 1, D] and the views an eviction reads), the allocation from the
model's shapes (``KVLayout``), the peaks, and the pass descriptions every pool builds the same way: a decode pass from
per-row host lists in one host-to-device copy (``SlotPool._decode_pass``), a group's prompt pass (``group_pass``).

Per-slot state between passes is host integers (``RowState``, a tuple of them in a ``step.PoolState``), which the
pool does not hold: its holder (the engine, the HF drop-in's cache) hands it to every description. A pool describes a
pass from it and changes nothing (the rows' states after the pass ride in the description, ``RowsPass.after``; its
holder takes them with ``PoolState.changed``); its ``ready`` executes the pass's storage part before the model call
(evictions, bookkeeping). A change between passes (``admitted``, ``graduated``, ``finished``) is described the same
way, as a ``step.Change``, and ``apply`` executes its storage part (slots emptied, a shared prompt copied). A pool's
attributes are storage: nothing but its tensors' contents and its peaks changes while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .method import Method
from .schedule import Phase
from .step import Change, Eviction, PoolState, RowsPass, SlotWork
from .workspace import chunk_workspace_bytes, decode_workspace_bytes, dense_impl, dense_workspace_bytes


class KVLayout(NamedTuple):
    """The model's attention as this rank holds it (``serve.kv_layout``): what a pool is allocated from and what
    its passes' workspace is counted with. ``kv_heads``/``query_heads``: this rank's (AutoTP's share, which may differ
    between ranks); ``k_dim``/``v_dim``: a key's and a value's size."""

    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    query_heads: int


def kv_layout(model: torch.nn.Module) -> KVLayout:
    """The model's attention as this rank holds it (KV heads, key and value sizes, dtype, device, query heads), read
    from its first attention module's projections (under AutoTP a rank holds its share of the heads, and the ranks'
    shares may differ): what the pool is allocated from before the first pass."""
    attn = next(m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "head_dim"))
    D = attn.head_dim
    q_heads = attn.o_proj.weight.shape[1] // D  # o_proj [hidden, q_heads x D] on this rank
    if hasattr(attn, "k_proj"):  # llama, mistral, qwen2: [kv_heads x D, hidden] on this rank
        weight = attn.k_proj.weight
        heads = weight.shape[0] // D
    else:  # phi3's fused projection [(q_heads + 2 kv_heads) x D, hidden]
        weight = attn.qkv_proj.weight
        heads = (weight.shape[0] // D - q_heads) // 2
    return KVLayout(heads, D, D, weight.dtype, weight.device, q_heads)


@dataclass
class RowState:
    """One slot's host state: pairs held (``filled``), next position (``seen``), write pointer into its free list
    (``ptr``), slots ever written (``high``), whether its free list is still the identity (``contiguous``), whether
    its last pass carried its look-ahead probe (``probed``: its next prefill eviction ranks with it), whether some
    pass of its request did (``asked``: its stored probe, where the rule keeps one, is this request's); the dense
    pools' ``length`` (slots [0, length) held); whether its decode passes have begun (``decoding``). A padded row's
    ``filled`` counts its pads (Algorithm 1 on the padded batch)."""

    filled: int = 0
    seen: int = 0
    ptr: int = 0
    high: int = 0
    contiguous: bool = True
    probed: bool = False
    asked: bool = False
    length: int = 0
    offset: int = 0  # a padded row's left pads: its positions are the padded batch's, its RoPE positions offset less
    decoding: bool = False  # its decode passes have begun (the HF drop-in reads it: HF's generate states no schedule)
    tiered: int = 0  # pairs a head its prefill's evictions put in its recall tier (``question:recall=tier|window``)

    def copy(self) -> RowState:
        """A copy to advance in a pass's description (every decode pass copies its rows' states: 0.4 us a row,
        ``dataclasses.replace`` 1.4, this CPU, 2026-11-28)."""
        new = object.__new__(RowState)
        new.__dict__.update(self.__dict__)
        return new


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class SlotPool:
    """What every pool shares: its layers' storage, the peaks, the descriptions of a change between passes from the
    host state handed in, the shared prefill's fork."""

    stacked_kv = False  # K/V stacked over the layers too (ED's eviction reads every layer's newest pair)
    num_blocks = 0  # K/V blocks shared by the rows (FKV paged; 0: each row holds its own slots)
    share = 1  # KV heads sharing one budget of slots (BM under a rule's ``share``; set once by ``allocate``)
    first_layer = 0  # the model's layer its first layer is (a layer group of ``LayeredPool``: its first)
    mixes = False  # a prefill pass takes the decoding rows' next step along (FKV in chunks: ``DensePool.mixed_pass``)

    def __init__(self, method: Method, num_layers: int, slots: int, capacity: int, layer_class, static: bool):
        self.layers = [layer_class(self, i) for i in range(num_layers)]
        self.method, self.slots, self.capacity = method, slots, capacity
        # static: every decode pass attends over all C slots (one shape for the whole run: compiled or captured
        # once); else over the slots written so far
        self.static = static
        self.stacks: dict[str, torch.Tensor] = {}
        self.peak_kv_bytes = self.peak_meta_bytes = self.peak_workspace_bytes = 0
        self.layout: KVLayout | None = None  # the model's attention shapes on this rank (``allocate``)
        self.dense_impl = None  # how a prompt runs on SDPA here (``workspace.dense_impl``; ``allocate``)

    def allocate(self, layout: KVLayout) -> None:
        """Allocate the pool, once, before its first pass, from the model's local shapes (``KVLayout``). What an
        eviction reads is stacked over the layers [L, S, ...] (``stacks``: one call frees slots in every layer), each
        layer holding its views [S, ...]: BM's slot state, ED's few slots of K/V. BM's and FKV's K/V are one tensor
        per layer: a compiled pass writes those in place only when they are not views into a larger buffer (inductor
        copied each layer's whole K/V every pass otherwise, 138 against 100 ms a BM pass on the CPU)."""
        if self.allocated:
            return
        kv_heads, k_dim, v_dim, dtype, device, q_heads = layout
        self.layout = layout
        self.dense_impl = dense_impl(q_heads, kv_heads, dtype.itemsize, torch.device(device))
        H, C1 = self.storage(kv_heads)
        L = len(self.layers)
        kv = {"keys": (L, *self.kv_dims(H, C1), k_dim), "values": (L, *self.kv_dims(H, C1), v_dim)}
        stacked = self.stacked_kv
        self.stacks = {
            **({name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in kv.items()} if stacked else {}),
            **self.meta_stacks(L, H, dtype, device),
        }
        for i, layer in enumerate(self.layers):
            own = {} if stacked else {n: torch.zeros(shape[1:], dtype=dtype, device=device) for n, shape in kv.items()}
            layer.bind_storage({**own, **{name: t[i] for name, t in self.stacks.items()}}, dtype, device)
        self.note()

    def storage(self, kv_heads: int) -> tuple[int, int]:
        """(heads, slots) of a row's storage per layer for the model's ``kv_heads`` local KV heads: one row of
        ``capacity`` slots + the scratch slot per head."""
        return kv_heads, self.capacity + 1

    def kv_dims(self, heads: int, slots: int) -> tuple[int, ...]:
        """One layer's K/V dimensions before the head dimension: a row per slot of the pool, each of ``slots``
        slots per head."""
        return (self.slots, heads, slots)

    def meta_stacks(self, L: int, H: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The pool's per-slot bookkeeping, stacked over the layers (none for the dense pools)."""
        return {}

    # -- changes between passes: described (pure functions of the state handed in), storage executed by ``apply`` --
    def initial(self) -> PoolState:
        """The host state of the pool before its first request: every row empty."""
        return PoolState(tuple(RowState() for _ in range(self.slots)))

    def admitted(
        self, state: PoolState, rows: range, offsets: list[int], lengths: list[int], max_new: list[int]
    ) -> Change:
        """Requests enter the slots ``rows`` (``offsets``: each one's left pads, 0 but for a padded batch's rows;
        ``lengths``/``max_new``: each one's prompt and generation): their rows start empty."""
        return Change(after=tuple((row, RowState(offset=offset)) for row, offset in zip(rows, offsets)))

    def graduated(self, state: PoolState, rows: range, decodes: list[bool]) -> Change:
        """A group's prefill is over (``decodes``: whether each row's request decodes on). A shared group's ran on its
        first row alone (the others have seen nothing), which then becomes every row of the group."""
        if len(rows) > 1 and state.rows[rows.start + 1].seen == 0:
            return Change(after=tuple((row, state.rows[rows.start].copy()) for row in rows[1:]), fork=rows)
        return Change()

    def finished(self, state: PoolState, row: int) -> Change:
        """Row ``row``'s request has ended (its slot is free until the next admission): nothing changes but FKV paged's
        blocks."""
        return Change()

    def apply(self, change: Change) -> None:
        """Execute a described change's storage part: the slots it empties, a shared prefill's row copied (the host
        state it carries is its holder's, ``PoolState.changed``)."""
        for row in change.reset:
            for layer in self.layers:
                layer.reset_row(row)
        if change.fork is not None:
            self.fork(change)

    @property
    def allocated(self) -> bool:
        return self.layers[0].is_initialized

    def kv_bytes(self) -> int:
        return sum(nbytes(layer.keys, layer.values) for layer in self.layers)

    def meta_bytes(self) -> int:
        return 0

    def note(self) -> None:
        """Record the peaks now (K/V, bookkeeping)."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        self.peak_meta_bytes = max(self.peak_meta_bytes, self.meta_bytes())

    def note_workspace(self, nbytes: int) -> None:
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, nbytes)

    def release(self) -> None:
        """Drop every buffer (the run is over): the layers refer to their pool, so without this the memory would
        wait for a garbage collection."""
        self.stacks = {}
        self.layers.clear()

    def pass_workspace(self, step: RowsPass) -> int:
        """The most one attention call of ``step`` allocates (``core.workspace``; each layer's call the same),
        counted on the host from the description: here a decode pass's fused product (``attention.decode_attention``);
        the pools' other passes in theirs."""
        keys = self.layers[0].keys  # [S, Hs, T + 1, D]
        H, D, G = keys.shape[1], keys.shape[-1], self.share
        return decode_workspace_bytes(
            step.qpos.shape[0], self.layout.query_heads, H, step.hi * G, D, keys.element_size(), G
        )

    def _decode_pass(
        self,
        work: tuple[SlotWork, ...],
        write: list[int],
        seen: list[int],
        hi: int,
        evicting: list,
        device,
        lengths: list[int] | None = None,
        blocks: tuple[list[int], list[int]] | None = None,
        after: dict[int, RowState] | None = None,
    ) -> RowsPass:
        """A decode pass over every row from per-row host lists (one host-to-device copy): ``write`` (BM: the index
        into the row's free list; the dense pools: the slot), ``seen`` (the position fed; -1 for idle rows) and, for
        the dense pools, ``lengths`` (the slots each row holds after the pass: the additive mask of its row); the
        decoding rows of ``work`` and each row's RoPE position ride in the same copy, and FKV paged's ``blocks``:
        (owner, filled positions) of each of the first ``hi`` blocks; ``after``: the decoding rows' states after the
        pass."""
        S, k, after = self.slots, len(work), after or {}
        decoding = [w.row for w in work] + [-1] * (S - k)
        # each row's RoPE position (an offset never changes in a pass; idle rows: 0)
        rope = [max(0, p - after[row].offset) if p >= 0 else 0 for row, p in enumerate(seen)]
        lists = [write, seen, decoding, rope, *([lengths] if lengths is not None else [])]
        flat = to_device([x for values in [*lists, *(blocks or ())] for x in values], device)  # one copy
        packed = flat[: len(lists) * S].view(len(lists), S)
        qpos = packed[1].view(S, 1)  # [S, 1]; -1 for idle rows
        bias = active = None
        owner = None
        if blocks is not None:  # FKV paged: each block's row, and [hi x H, 1, Bs] its held positions
            owner, fill = flat[len(lists) * S :].view(2, hi)
            H, Bs = self.layers[0].keys.shape[1], self.layers[0].keys.shape[2]
            empty = (torch.arange(Bs, device=device) >= fill[:, None]).view(hi, 1, 1, Bs)
            bias = torch.zeros(hi, H, 1, Bs, dtype=self.layers[0].dtype, device=device)
            bias = bias.masked_fill_(empty, float("-inf")).view(hi * H, 1, Bs)
        elif lengths is not None:  # [S, hi]: 0 for each row's held slots, -inf after
            bias = torch.zeros(S, hi, dtype=self.layers[0].dtype, device=device)
            bias.masked_fill_(torch.arange(hi, device=device) >= packed[4][:, None], float("-inf"))
        else:  # [S, 1, 1] (BM): the rows whose attention joins their slots' sums
            active = (qpos >= 0).to(torch.float32).view(S, 1, 1)
        return RowsPass(
            kind="decode",
            pool=self,
            method=self.method,
            share=self.share,
            rows=torch.arange(S, device=device),
            span=slice(0, S),
            qpos=qpos,
            positions=packed[3].view(S, 1),
            real=None,
            write=packed[0].view(S, 1),
            hi=hi,
            evictions=evictions_of(evicting, device),
            active=active,
            bias=bias,
            decoding=packed[2, :k],
            owner=owner,
            after=tuple(after.items()),
        )

    def ready(self, step: RowsPass) -> RowsPass:
        """Execute a described pass's storage part before the model call: its evictions (every layer at once), and
        note the workspace its attention calls will take (``pass_workspace``: counted here, on the host, so the
        attention notes nothing); returns what the model call reads (``RowsPass.for_model``). (Its rows' new states,
        ``RowsPass.change``, are its holder's to take.)"""
        for eviction in step.evictions:
            self.evict(eviction)
        self.note_workspace(self.pass_workspace(step))
        return step.for_model()

    def fork(self, change: Change) -> None:
        """Copy row ``change.fork.start`` (a shared prefill's result) into the other rows of ``change.fork``, in every
        layer."""
        rows = change.fork
        for layer in self.layers:
            for t in layer.row_tensors():
                t[rows.start + 1 : rows.stop] = t[rows.start : rows.start + 1]


class SlotLayer:
    """One decoder layer of a pool: keys/values [S, H, C + 1, D] (and what an eviction reads: views of the pool's
    stacks, ``SlotPool.allocate``). Storage only: the attention writes and reads it as each pass's description says."""

    def __init__(self, cache: SlotPool, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx
        self.keys = self.values = None
        self.is_initialized = False

    def bind_storage(self, views: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        for name, view in views.items():
            setattr(self, name, view)
        self.dtype, self.device, self.is_initialized = dtype, device, True

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor with one row per slot (what ``SlotPool.fork`` copies)."""
        return self.keys, self.values

    def chunk_storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a chunked prefill's pairs go, as blocks [N, H, Bs, D] (``slots.chunk_pass``): FKV's K/V (fixed slots:
        a row's C + 1 slots a block)."""
        return self.keys, self.values


def write_blocks(keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor, key_states, value_states) -> None:
    """Each row's columns key/value_states [R, H, n, D] into K/V kept in blocks [N, H, Bs, D], at ``write`` [R, n]
    (block x Bs + offset)."""
    R, H, n, _ = key_states.shape
    flat = write.reshape(R * n)  # [R*n]
    block, offset = flat // keys.shape[2], flat % keys.shape[2]
    for dst, src in ((keys, key_states), (values, value_states)):
        dst[block, :, offset] = src.transpose(1, 2).reshape(R * n, H, src.shape[-1])  # [R*n, H, D]


def gather_blocks(store: torch.Tensor, table: torch.Tensor, hi: int) -> torch.Tensor:
    """Each row's first ``hi`` positions [R, H, hi, D] of K or V kept in blocks [N, H, Bs, D], its blocks ``table``
    [R, nb] in order (one block a row: a slice of it, gathered once)."""
    R, nb = table.shape
    _, H, Bs, D = store.shape
    if nb == 1:
        return store[:, :, :hi].index_select(0, table[:, 0])  # [R, H, hi, D]
    blocks = store.index_select(0, table.reshape(-1)).view(R, nb, H, Bs, D)  # [R, nb, H, Bs, D]
    return blocks.transpose(1, 2).reshape(R, H, nb * Bs, D)[:, :, :hi]  # [R, H, hi, D]


def prompt_workspace(pool: SlotPool, R: int, s: int) -> int:
    """R prompts of s tokens on the model's SDPA over their own pairs (``attention._dense_prefill``)."""
    lay = pool.layout
    return dense_workspace_bytes(
        R,
        lay.query_heads,
        lay.kv_heads,
        lay.k_dim,
        s,
        s,
        lay.dtype.itemsize,
        padded=False,
        impl=pool.dense_impl,
        align=torch.device(lay.device).type == "cuda",
    )


def group_pass(
    pool: SlotPool, state: PoolState, work, prompts, device, kind: str, slots=None, kept: int | None = None
) -> tuple[RowsPass, torch.Tensor]:
    """The pass of one group's prompts (one length s, a single block; a padded batch's rows at its positions, no pad)
    and their ids [R, s], the rows' ``seen`` advanced in its ``after``; ``slots(s)``: where each of the s pairs is
    written (None: the pass writes none itself, a compress pass keeps its own choice); ``kept``: at most how many
    pairs each row holds after a compress pass (slots [0, min(s, kept)), in the rows' states after it)."""
    rows, end, offset = [w.row for w in work], work[0].phase.end, state.rows[work[0].row].offset
    s = end - offset
    columns = to_device([list(range(offset, end)), list(range(s)), *([slots(s)] if slots else [])], device)  # [2|3, s]
    R = len(rows)
    held = {} if kept is None else dict.fromkeys(("filled", "ptr", "high"), min(s, kept))
    after = tuple((row, replace(state.rows[row], seen=end, **held)) for row in rows)  # each row's state after it
    step = RowsPass(
        kind=kind,
        pool=pool,
        method=pool.method,
        share=pool.share,
        rows=to_device(rows, device),
        span=span_of(rows),
        qpos=columns[0].expand(R, s),
        positions=columns[1].expand(R, s),
        real=None,
        write=columns[2].expand(R, s) if slots else None,
        hi=s,
        after=after,
    )
    return step, torch.stack(prompts)


def to_device(data: list, device) -> torch.Tensor:
    """Host lists (of ints) as one tensor on ``device``. On CUDA through pinned memory, asynchronously: a copy from
    pageable memory would wait for the device to finish its queued work, so the host could not run ahead."""
    if torch.device(device).type == "cuda":
        return torch.tensor(data, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, device=device)


def evictions_of(evicting: list[tuple], device) -> tuple[Eviction, ...]:
    """(row, count, curr_id, probe, tier) per evicting row -> one ``Eviction`` per (count, probe) kind (``tier``: the
    row's entry under a rule with a recall tier, else None: ``Eviction.tier``)."""
    kinds: dict[tuple[int, str | None], list[tuple]] = {}
    for row, count, curr_id, probe, tier in evicting:
        kinds.setdefault((count, probe), []).append((row, curr_id, tier))
    out = []
    for (count, probe), members in kinds.items():
        t = to_device([m[:2] for m in members], device)  # [E, 2]: one copy per kind
        tier = tuple(m[2] for m in members)  # [E]: each row's entry, or None
        out.append(Eviction(t[:, 0], t[:, 1].view(-1, 1, 1), count, probe, tier if any(tier) else ()))
    return tuple(out)


def span_of(rows: list[int]) -> slice | None:
    """``rows`` as a slice when they are adjacent and ascending, else None."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None


def columns(
    phase: Phase, st: RowState, prompt: torch.Tensor | None, n: int
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """A row's ``n`` columns of ``phase`` (a prefill chunk or a look-ahead probe): each column's position (-1:
    masked), RoPE position and token id (None without a prompt), real tokens right-aligned (a padded row's pads are
    masked columns)."""
    a = min(max(phase.start, st.offset), phase.end)  # the phase's first real position (end: all pads)
    pad = n - (phase.end - a)
    qpos = [-1] * pad + list(range(a, phase.end))
    rope = [0] * pad + list(range(a - st.offset, phase.end - st.offset))
    if prompt is None:
        return qpos, rope, None
    return qpos, rope, torch.nn.functional.pad(prompt[a - st.offset : phase.end - st.offset], (pad, 0))


def chunk_pass(
    pool: SlotPool,
    state: PoolState,
    work: tuple[SlotWork, ...],
    prompts: list[torch.Tensor],
    device,
    tables: tuple[tuple[int, ...], ...],
    block: int,
    scratch: int,
) -> tuple[RowsPass, torch.Tensor]:
    """A chunked prefill pass (FKV, and snap's prompt held in full until it compresses) and its ids [R, n]: each row's
    chunk ``[a, b)`` of its prompt, real tokens right-aligned (masked columns in front: a padded row's pads, a shorter
    chunk's room), its pairs written at its slots (slot j: the row's j-th prompt position) in its blocks (``tables``:
    each row's blocks of ``block`` positions; K/V [N, H, block, D]; ``write`` [R, n]: block x ``block`` + offset, masked
    columns ``scratch``), its queries over its slots [0, b) (the pairs it holds and the chunk's own, causal: ``mask``
    [R, 1, n, hi] additive in the model dtype, built once for every layer; a masked column sees slot 0 alone, so its
    softmax stays finite); ``table`` [R, ceil(hi / block)]: each row's blocks (a row holding fewer: ``scratch``'s
    block, masked). The rows' ``seen`` advance in its ``after``. A pass whose rows hold nothing before it (``own``:
    every chunk its prompt's first) attends over its own pairs, gathering nothing: ``mask`` [R, 1, n, n] over its
    columns (a masked column sees itself alone), or None for one row of real tokens (causal: a one-pass prefill's
    SDPA)."""
    n = max(w.phase.size for w in work)
    qpos, rope, ids, slot, write, after = [], [], [], [], [], []
    for j, w in enumerate(work):
        st = state.rows[w.row]
        q, r, i = columns(w.phase, st, prompts[j], n)
        at = [x - st.offset if x >= 0 else -1 for x in q]  # each column's slot (-1: masked)
        qpos.append(q)
        rope.append(r)
        ids.append(i)
        slot.append([max(x, 0) for x in at])
        write.append([tables[w.row][x // block] * block + x % block if x >= 0 else scratch for x in at])
        after.append((w.row, replace(st, seen=w.phase.end)))
    own_pairs = all(w.phase.start <= state.rows[w.row].offset for w in work)  # nothing held before the pass
    hi = max(w.phase.end - state.rows[w.row].offset for w in work)  # the pass's most slots held
    nb = -(-hi // block)
    scratch_block = scratch // block
    table = [list(tables[w.row][:nb]) + [scratch_block] * (nb - len(tables[w.row][:nb])) for w in work]
    R = len(work)
    flat = to_device([x for part in (qpos, rope, slot, write, table) for row in part for x in row], device)
    qpos_t, rope_t, slot_t, write_t, table_t = flat.split([R * n] * 4 + [R * nb])
    qpos_t = qpos_t.view(R, n)
    real = None if all(q[0] >= 0 for q in qpos) else qpos_t >= 0
    if own_pairs:  # keys: the pass's own columns; a masked key hidden but from its own (masked) query
        cols = torch.arange(n, device=device)
        later = cols[None, None, :] > cols[None, :, None]  # [1, n, n]: keys after each query
        if real is not None:
            later = later | (~real[:, None, :] & (cols[None, None, :] != cols[None, :, None]))  # [R, n, n]
        hi = n
    else:
        later = torch.arange(hi, device=device) > slot_t.view(R, n, 1)  # [R, n, hi]: slots after each query's
    mask = None
    if not own_pairs or R > 1 or real is not None:
        mask = torch.zeros(R, 1, n, hi, dtype=pool.layout.dtype, device=device)
        mask.masked_fill_(later.expand(R, n, hi)[:, None], float("-inf"))  # [R, 1, n, hi]
    rows = [w.row for w in work]
    step = RowsPass(
        kind="prefill",
        pool=pool,
        method=pool.method,
        share=pool.share,
        rows=to_device(rows, device),
        span=span_of(rows),
        qpos=qpos_t,
        positions=rope_t.view(R, n),
        real=real,
        write=write_t.view(R, n),
        hi=hi,
        mask=mask,
        table=table_t.view(R, nb),
        own=own_pairs,
        after=tuple(after),
    )
    return step, torch.stack(ids)


def chunk_workspace(pool: SlotPool, step: RowsPass, block: int) -> int:
    """One layer's call of a chunked prefill pass (``chunk_pass``; ``workspace.chunk_workspace_bytes``)."""
    lay = pool.layout
    (R, n), e = step.qpos.shape, lay.dtype.itemsize
    gqa = torch.device(lay.device).type == "cpu"
    heads = (lay.query_heads, lay.kv_heads, lay.k_dim)
    return chunk_workspace_bytes(R, *heads, n, step.hi, block, e, gqa, step.own, step.mask is not None)
