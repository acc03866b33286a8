"""The "batchmax" attention function, registered through transformers' ``AttentionInterface``.

Each pass is described by the engine (``step.RowsPass``): the attention writes the pass's new pairs into the pool
at the slots the description gives and attends. Queries attend over their row's kept slots (the block itself
included): a slot is visible to a query when it is valid (not empty or evicted) and its position is not after the
query's (causal inside the block). Each query's attention probabilities are added to the slots' running sums, which
the eviction rule reads. GQA: queries are grouped per KV head, so one KV head's slot sums the probabilities of its
whole query group, and no ``repeat_kv`` copy is made. The baselines' prompts run on the model's SDPA over their own
pairs (``_dense_prefill``).

Memory: long blocks run in query chunks (``workspace.SCORE_CHUNK_BYTES``), one chunk's tensors alive at a time.
Nothing is noted or allocated here: the pool counts each pass's peak on the host from its description
(``pool.*.pass_workspace``, with ``core.workspace``'s counts: what the planner predicts, checked against measured
allocations in ``tests/test_memory.py``) and allocates what a pass writes before it runs.

A decode step (one query per row) is one fused product: ``baddbmm`` adds the additive slot mask (``bias``) to the
scaled logits, then softmax, the score sums and ``probs @ V`` (``workspace.decode_workspace_bytes``).

Look-ahead probe (rules ``probe``, ``snapkv``, ``question``): a probe (its keys/values never stored; its queries the
first columns of the prefill pass of the chunk it follows, ``_folded``) attends from the probe's queries to every valid
slot (all precede it) and causally to the probe keys up to itself (masked probe columns hidden); its output goes on
through the layer, its attention to the slots, summed over the query group and averaged over the row's real probe
queries, becomes the slots' ``probe`` values (overwritten each probe pass); the paper's sums get nothing from it. The
math is ``core.probe``'s, shared with the re-scoring of rules that probe only every few blocks.

HF's ``model.generate`` drop-in (``core.hf_cache``) sits on top: it describes each forward HF's generate runs as
a pass over a pool of its own and runs it through ``batchmax_attention``.

Nothing is registered at import time: call ``register()`` (or use ``use_batchmax_attention``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from . import probe, snap, workspace
from .bounded import PoolLayer
from .slots import gather_blocks, write_blocks
from .step import RowsPass
from .workspace import SDPA_REPEAT

NAME = "batchmax"


def batchmax_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    batchmax: RowsPass | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, n, D]; ``batchmax``: the engine's description of the pass (``core.step``), whose key/value
    [B, Hkv, n, D] are the pass's new pairs (``attention_mask`` is not read: the description states what each query
    sees). Returns [B, n, Hq, D]."""
    if batchmax is None:
        raise RuntimeError(
            "the 'batchmax' attention runs the engine's passes (batchmax_tp.core.engine.Engine); for HF's "
            "model.generate use BatchMaxCache under batchmax_tp.core.hf_cache.use_drop_in(model)"
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _rows_attention(module, batchmax, query, key, value, scaling), None


def decode_attention(
    layer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    hi: int,
    active: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    share: int = 1,
) -> torch.Tensor:
    """One decode step (engine-driven, no mask): every kept slot precedes the query, so the layer's additive
    mask (``bias``: -inf on empty/evicted slots) is all the masking needed; slots [hi, C) were never written and
    stay out of every product. ``active`` [B, 1, 1] (a pool's pass): 1 for the rows decoding, 0 for idle rows,
    whose attention is not added to their slots' sums. An explicit ``bias`` [B, 1, hi] (the baselines' pool: each
    row's held length) replaces the layer's, and no sums are kept. In a budget shared by G heads (key/value
    [B, Hs, T + 1, D], Hs = Hkv / G storage heads) each query head's group also hides the other heads' slots.
    Returns [B, 1, Hq, D]."""
    B, Hq, _, D = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    G = share
    q = query.reshape(B * Hkv, g, D)  # [B*Hkv, g, D]: query heads grouped by their KV head (a view)
    keys_t = key[:, :, :hi].transpose(2, 3).reshape(B * Hkv, D, hi)  # [B*Hkv, D, hi] (a view)
    if bias is not None:
        bias = bias[:, None, None, :].expand(B, Hkv, 1, hi).reshape(B * Hkv, 1, hi)  # [B*Hkv, 1, hi] (a view)
    elif G == 1:
        bias = layer.bias[:, :, :hi].reshape(B * Hkv, 1, hi)  # [B*Hkv, 1, hi]: 0 valid, -inf hidden (a view)
    else:  # [B, Hs, G, hi]: each head's own slots -> [B*Hs, g, hi], the G heads' query groups in order
        other = layer.other_heads(lambda t: t, G)[..., :hi]  # [B, Hs, G, hi]
        bias = layer.bias[:, :, None, :hi].masked_fill(other, float("-inf"))
        del other
        bias = bias[:, :, :, None, :].expand(B, Hkv, G, g // G, hi).reshape(B * Hkv, g, hi)
    logits = torch.baddbmm(bias, q, keys_t, alpha=scaling)  # [B*Hkv, g, hi], scaled and masked
    del bias
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B*Hkv, g, hi]
    del logits
    if layer.score is not None:  # a layer that keeps score sums (the baselines' pools keep none)
        received = probs.view(B, Hkv, g, hi).sum(dim=2)  # [B, Hkv, hi]: attention received, summed over the group
        if active is not None:  # idle rows add nothing (a fill, not a product: an empty row's softmax is NaN)
            received.masked_fill_(active == 0, 0.0)
        layer.score[:, :, :hi] += received
        del received
    out = torch.bmm(probs.to(value.dtype), value[:, :, :hi].reshape(B * Hkv, hi, D))  # [B*Hkv, g, D]
    return out.view(B, 1, Hq, D)  # [B, 1, Hq, D]: (Hkv, g) rows are the query heads in order


def _rows_attention(
    module: torch.nn.Module,
    step: RowsPass,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """A pool's pass, as ``step`` states it (BM's prefill chunks, probes and decode steps; the dense pools' prefill
    and decode steps): write the new pairs key/value [R, Hkv, n, D], attend. Returns [R, n, Hq, D]."""
    step = step.at(module.layer_idx)  # budgets across layers: the layer's group's own part of the pass
    if step.subs:  # BM's wide pass: its blocks one after another, each evicting first
        return _wide(module, step, query, key, value, scaling)
    if step.mixed is not None:  # FKV's chunks and decode step in one call: each part on its columns
        return _mixed(module, step, query, key, value, scaling)
    layer = step.layer(module)
    hi = step.hi * step.share  # a shared budget's G heads hold G slots per column
    if step.kind == "compress":  # snap: the prompt on SDPA, then each row keeps its window's choice
        return _compress(module, layer, step, query, key, value, scaling)
    if step.table is not None:  # a chunked prefill (FKV, snap): over the pairs each row holds and its chunk's own
        return _chunked(layer, step, query, key, value, scaling)
    # The pass's evictions ran before it (the pool's ``evict``); it writes its pairs, then attends.
    if step.kind == "prefill" and layer.score is not None:  # BM's prefill (a layer with sums): over the slots written
        if step.probe is not None:  # the probes folded into the pass: its first columns
            out = _folded(layer, step, query, key, value, scaling, hi)
        else:
            out = _rows_block(layer, step, query, scaling, hi, layer.write(step, key, value))
        if step.window_rows is not None:  # recall=window: the window's queries kept, the last blocks' choice made
            w = 0 if step.probe is None else step.probe.qpos.shape[1]
            step.pool.choose_by_window(layer, step, query[:, :, w:], scaling)
        return out
    if step.written is not None:  # BM's decode: the pool recorded each pair's slot in every layer (its ``ready``)
        _copy_pairs(layer, step.written[layer.layer_idx], key, value)
    else:
        layer.write(step, key, value)
    if step.kind == "decode" and step.owner is not None:  # FKV paged: block by block
        return _paged_decode(layer, query, step, scaling)
    if step.kind == "decode":
        return decode_attention(layer, query, layer.keys, layer.values, scaling, hi, step.active, step.bias, step.share)
    return _dense_prefill(module, query, key, value, scaling)  # a baseline's prompt: over its own pairs


def _mixed(module, step: RowsPass, query, key, value, scaling: float) -> torch.Tensor:
    """A mixed pass (``dense.DensePool.mixed_pass``): query [1, Hq, R*n + S, D], key/value [1, Hkv, R*n + S, D], the
    chunks' R rows of n columns flattened, then the decode step's one column per pool row. Each part runs as its own
    pass would, on views of its columns: the chunks first (their pairs written, then attended), then the decode step.
    Returns [1, R*n + S, Hq, D]."""
    chunks, decode = step.mixed
    R, n = chunks.qpos.shape
    split = R * n

    def rows(t: torch.Tensor) -> torch.Tensor:  # [1, H, R*n, D] -> [R, H, n, D] (a view)
        return t[0, :, :split].unflatten(1, (R, n)).transpose(0, 1)

    def steps(t: torch.Tensor) -> torch.Tensor:  # [1, H, S, D] -> [S, H, 1, D] (a view)
        return t[0, :, split:].transpose(0, 1).unsqueeze(2)

    out = _rows_attention(module, chunks, *(rows(t) for t in (query, key, value)), scaling)  # [R, n, Hq, D]
    last = _rows_attention(module, decode, *(steps(t) for t in (query, key, value)), scaling)  # [S, 1, Hq, D]
    return torch.cat([out.reshape(1, split, *out.shape[2:]), last.transpose(0, 1)], dim=1)  # [1, R*n + S, Hq, D]


def _wide(module, step: RowsPass, query, key, value, scaling: float) -> torch.Tensor:
    """A wide pass (``bounded.BoundedPool.wide_pass``): query [R, Hq, N, D], key/value [R, Hkv, N, D], the columns of
    its blocks' passes (``step.subs``) one after another. Each block runs in this layer as its own pass would: its
    rows' evictions in this layer (Algorithm 1: ranked by this layer's sums and probes, which only this layer's
    earlier blocks changed), then its pairs written and attended on views of its columns. Returns [R, N, Hq, D]."""
    pool = step.pool
    layer = module.layer_idx - pool.first_layer
    outs, a = [], 0
    for sub in step.subs:
        for eviction in sub.evictions:
            pool.evict_layer(eviction, layer)
        b = a + sub.positions.shape[1]  # its probe's columns and its block's
        outs.append(_rows_attention(module, sub, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scaling))
        a = b
    return torch.cat(outs, dim=1)  # [R, N, Hq, D]


def _copy_pairs(layer, flat: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """BM's decode pass: each row's new pair key/value [S, Hkv, 1, D] to its slot, ``flat`` [S*Hkv] (indices into
    the layer's K/V rows flattened [S*Hs*(T + 1), D], row by row, local KV head in order), whose position, sum and
    mask the pool recorded before the pass (``RowsPass.written``)."""
    for dst, src in ((layer.keys, key), (layer.values, value)):
        dst.view(-1, dst.shape[-1]).index_copy_(0, flat, src.reshape(-1, src.shape[-1]))  # [S*Hkv, D] rows


def _folded(layer: PoolLayer, step: RowsPass, query, key, value, scaling: float, hi: int) -> torch.Tensor:
    """A prefill pass with look-ahead probes folded in: query/key/value [R, H, w + n, D], the probes' ``w``
    columns first. The chunks' pairs are written and attended (``_rows_block``); then the probing rows' probes
    attend over the slots held now and their own keys (``_rows_probe``), as a probe pass of their own after the
    chunks would. Returns [R, w + n, Hq, D] (a row that does not probe: zeros in its probe columns)."""
    w = step.probe.qpos.shape[1]
    out = _rows_block(layer, step, query[:, :, w:], scaling, hi, layer.write(step, key[:, :, w:], value[:, :, w:]))
    probe_in = [t[:, :, :w] for t in (query, key, value)]  # [R, H, w, D] each (views)
    if step.among is not None:  # [Rp, H, w, D]: the probing rows'
        probe_in = [t.index_select(0, step.among) for t in probe_in]
    looked = _rows_probe(layer, step.probe, probe_in[0], (probe_in[1], probe_in[2]), scaling, hi)  # [Rp, w, Hq, D]
    del probe_in
    if step.among is not None:
        looked = looked.new_zeros(out.shape[0], *looked.shape[1:]).index_copy_(0, step.among, looked)
    return torch.cat([looked, out], dim=1)  # [R, w + n, Hq, D]


def _paged_decode(layer, query: torch.Tensor, step: RowsPass, scaling: float) -> torch.Tensor:
    """FKV's paged decode step: query [S, Hq, 1, D] over the first ``step.hi`` blocks of keys/values
    [N + 1, Hkv, Bs, D], block by block (each block's products with its row's queries, ``step.owner``, under its
    additive mask ``step.bias`` [n*Hkv, 1, Bs]), then each row's softmax across its blocks: one maximum and one sum
    per row (``scatter_reduce``/``index_add`` over the owners), so every row's output is its softmax over its held
    positions. Each block is read once. A block no decoding row holds is masked whole and given to a decoding row,
    to which it adds exp(-inf) = 0; a row holding no block (idle) gets 0. Returns [S, 1, Hq, D]."""
    S, Hq, _, D = query.shape
    n, Hkv, Bs = step.hi, layer.keys.shape[1], layer.keys.shape[2]
    g = Hq // Hkv
    owner = step.owner  # [n]
    q = query.view(S, Hkv, g, D).index_select(0, owner).view(n * Hkv, g, D)  # [n*Hkv, g, D]: each block's row's
    keys_t = layer.keys[:n].view(n * Hkv, Bs, D).transpose(1, 2)  # [n*Hkv, D, Bs] (a view)
    logits = torch.baddbmm(step.bias, q, keys_t, alpha=scaling)  # [n*Hkv, g, Bs], scaled and masked
    del q
    logits = logits.float().view(n, Hkv, g, Bs)  # [n, Hkv, g, Bs] (a copy in half precision only)
    top = logits.new_full((S, Hkv, g), float("-inf"))
    top.scatter_reduce_(0, owner.view(n, 1, 1).expand(n, Hkv, g), logits.amax(dim=-1), "amax")  # [S, Hkv, g]
    expo = logits.sub_(top.index_select(0, owner)[..., None]).exp_()  # [n, Hkv, g, Bs] in place
    del logits, top
    total = expo.new_zeros(S, Hkv, g).index_add_(0, owner, expo.sum(dim=-1))  # [S, Hkv, g]
    values = layer.values[:n].view(n * Hkv, Bs, D)  # [n*Hkv, Bs, D] (a view)
    part = torch.bmm(expo.view(n * Hkv, g, Bs).to(values.dtype), values).view(n, Hkv, g, D)  # [n, Hkv, g, D]
    del expo
    out = total.new_zeros(S, Hkv, g, D).index_add_(0, owner, part.float())  # [S, Hkv, g, D] float32
    del part
    out.div_(total.clamp_min_(torch.finfo(torch.float32).tiny)[..., None])  # idle rows: 0 / tiny
    return out.to(query.dtype).view(S, 1, Hq, D)  # [S, 1, Hq, D]: (Hkv, g) are the query heads in order


def _dense_prefill(module, query, key, value, scaling: float) -> torch.Tensor:
    """FKV's or ED's prompt [R, Hq, s, D]: the model's SDPA, causal, over the pass's own pairs [R, Hkv, s, D] (K/V
    copied per query head first for GQA in a half dtype on a card below compute capability 8.0, where SDPA's
    memory-efficient kernel rejects ``enable_gqa`` and the math kernel would hold every score). Returns
    [R, s, Hq, D]."""
    Hq, Hkv = query.shape[1], key.shape[1]
    if workspace.dense_impl(Hq, Hkv, query.element_size(), query.device) == SDPA_REPEAT:
        key, value = repeat_kv(key, Hq // Hkv), repeat_kv(value, Hq // Hkv)  # [R, Hq, s, D] each
        module = _OneGroup(module)
    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling)[0]


def _chunked(layer, step: RowsPass, query, key, value, scaling: float) -> torch.Tensor:
    """A chunked prefill pass (``slots.chunk_pass``): each row's chunk key/value [R, Hkv, n, D] written into its blocks
    (the layer's ``chunk_storage``: FKV's K/V, snap's full pairs while it prefills), then its queries [R, Hq, n, D]
    over its first ``hi`` slots, gathered [R, Hkv, hi, D], under the pass's additive mask (SDPA, one call for the
    rows); snap's rows whose prompt ends here (``step.compress``) then keep their window's choice of their whole
    prompt, as the one-pass compress does. Returns [R, n, Hq, D]."""
    keys, values = layer.chunk_storage()  # [N, Hkv, Bs, D] each
    write_blocks(keys, values, step.write, key, value)
    if step.own:  # nothing held before the pass: its own pairs (right-aligned, as the queries)
        k, v = key, value  # [R, Hkv, n, D]
    else:
        k, v = gather_blocks(keys, step.table, step.hi), gather_blocks(values, step.table, step.hi)  # [R, Hkv, hi, D]
    Hq, Hkv = query.shape[1], k.shape[1]
    gqa = Hq != Hkv and (query.device.type == "cpu" or step.mask is None)  # CUDA's kernels with a mask: copies
    if Hq != Hkv and not gqa:
        k, v = repeat_kv(k, Hq // Hkv), repeat_kv(v, Hq // Hkv)  # [R, Hq, hi, D] each
    causal = step.mask is None  # one row of real tokens, holding nothing before: a one-pass prefill
    out = F.scaled_dot_product_attention(
        query, k, v, attn_mask=step.mask, is_causal=causal, scale=scaling, enable_gqa=gqa
    )
    out = out.transpose(1, 2).contiguous()  # [R, n, Hq, D]
    method = step.method
    for j, s, offset in step.compress:  # snap: the row's whole prompt [1, Hkv, s, D], its window the chunk's last
        first = k.shape[2] - s if step.own else 0  # own pairs: right-aligned
        kj, vj = k[j : j + 1, :, first : first + s], v[j : j + 1, :, first : first + s]
        if kj.shape[1] != Hkv:  # (copied per query head above: each KV head's first copy)
            kj, vj = kj[:, :: Hq // Hkv], vj[:, :: Hq // Hkv]
        scores = snap.window_scores(query[j : j + 1], kj, scaling, method.window)  # [1, Hkv, s] float32
        kept = snap.choose(scores, method.kv_max, method.window, method.kernel)  # [1, Hkv, K]
        layer.keep(step.rows[j : j + 1], kj, vj, kept, scores.gather(2, kept), offset)
    return out


def _compress(module, layer: PoolLayer, step: RowsPass, query, key, value, scaling: float) -> torch.Tensor:
    """A compress pass (``snap``): the prompts [R, Hq, s, D] on the model's SDPA over their own pairs, then each
    (row, KV head) keeps the pairs its observation window chooses (``core.snap``), their sums the window's
    attention. Returns [R, s, Hq, D]."""
    method = step.method
    out = _dense_prefill(module, query, key, value, scaling)  # [R, s, Hq, D]
    scores = snap.window_scores(query, key, scaling, method.window)  # [R, Hkv, s] float32
    kept = snap.choose(scores, method.kv_max, method.window, method.kernel)  # [R, Hkv, K]
    layer.keep(step.rows, key, value, kept, scores.gather(2, kept), step.qpos[:, :1, None])
    return out


class _OneGroup:
    """An attention module seen with as many KV heads as query heads: HF's SDPA function then neither repeats K/V
    nor asks SDPA for ``enable_gqa`` (it reads ``num_key_value_groups`` only when the module has one)."""

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        if name == "num_key_value_groups":
            raise AttributeError(name)
        return getattr(self._module, name)


def _rows_block(
    layer: PoolLayer, step: RowsPass, query: torch.Tensor, scaling: float, hi: int, own: torch.Tensor
) -> torch.Tensor:
    """Prefill chunks of R rows, each at its own positions (``step.qpos``), over each row's kept slots [0, hi) (a
    shared budget: each head over its own), the pass's own pairs already written at ``own`` [R, Hs, n*G] (the slots
    ``PoolLayer.write`` used; masked columns: the scratch slot). Returns [R, n, Hq, D].

    Fused: the product of the scaled queries, the pool's additive mask (empty and evicted slots -inf) added in
    place, so the old slots need nothing more; only the pass's own columns get the causal mask, built once per pass
    (``step.causal``), added at their slots; one softmax; the column sums; probs @ V. The tile (float32 [R*Hs,
    g*m, hi]) is written once by the product and once by the softmax."""
    R, Hq, n, D = query.shape
    Hs, G = layer.keys.shape[1], step.share
    g = Hq // Hs  # query rows per storage head (a shared budget: its G heads' groups, in order)
    keys_t = step.take(layer.keys[:, :, :hi]).reshape(R * Hs, hi, D).transpose(1, 2)  # [R*Hs, D, hi] (a view)
    values = step.take(layer.values[:, :, :hi]).reshape(R * Hs, hi, D)  # [R*Hs, hi, D]
    bias = step.take(layer.bias[:, :, :hi]).reshape(R * Hs, 1, hi)  # [R*Hs, 1, hi]: 0 held, -inf empty/evicted
    score = step.take(layer.score[:, :, :hi])  # [R, Hs, hi]: a view (adjacent rows) or a copy written back
    own = own.clamp(max=hi - 1)  # [R, Hs, n*G]: masked columns' scratch slot -> any slot (their causal bias 0)
    causal = step.causal if G == 1 else step.causal.repeat_interleave(G, dim=-1)  # [R, n, n*G], as ``own``
    other = layer.other_heads(step.take, step.share)  # [R, Hs, G, T + 1] or None
    if other is not None:  # [R, Hs, G, 1, 1, hi] additive: another head's slots
        other = torch.zeros(other[..., :hi].shape, dtype=torch.float32, device=query.device).masked_fill_(
            other[..., :hi], torch.finfo(torch.float32).min
        )[:, :, :, None, None, :]
    qg = query.view(R, Hs, g, n, D)  # [R, Hs, g, n, D]: query heads grouped by their storage head (a view)
    out = None  # [R, n, Hs, g, D]: allocated once when the block takes more than one chunk
    for a, b in workspace.query_chunks(R, Hq, n, hi):
        m = b - a
        if out is None and m < n:
            out = torch.empty(R, n, Hs, g, D, dtype=values.dtype, device=values.device)
        qm = torch.empty(R, Hs, g, m, D, dtype=query.dtype, device=query.device)
        torch.mul(qg[:, :, :, a:b], scaling, out=qm)  # [R, Hs, g, m, D]: the chunk's scaled queries, contiguous
        logits = torch.bmm(qm.view(R * Hs, g * m, D), keys_t).add_(bias)  # [R*Hs, g*m, hi]: old slots masked
        del qm
        logits = logits.float().view(R, Hs, g, m, hi)  # (a copy in half precision only)
        later = causal[:, None, None, a:b, :].expand(R, Hs, g, m, n * G)  # [R, Hs, g, m, n*G] (a view)
        logits.scatter_add_(-1, own[:, :, None, None, :].expand(R, Hs, g, m, n * G), later)
        del later
        if other is not None:
            logits.view(R, Hs, G, g // G, m, hi).add_(other)
        if step.blind:  # a row sees no slot at all (pads alone, nothing held): keep its softmax finite
            logits.clamp_min_(torch.finfo(torch.float32).min)
        # the softmax in place: a fresh tile per call costs its page faults too (1.3 ms of 2.1 a call, 2026-11-27)
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits).view(R, Hs, g * m, hi)  # [R, Hs, g*m, hi]
        del logits
        add_received(score, probs, None if step.real is None else step.real[:, a:b])
        o = torch.bmm(probs.to(values.dtype).view(R * Hs, g * m, hi), values).view(R, Hs, g, m, D)
        del probs
        if out is None:
            out = o.permute(0, 3, 1, 2, 4).contiguous()  # [R, n, Hs, g, D]
        else:
            out[:, a:b].copy_(o.permute(0, 3, 1, 2, 4))  # [R, m, Hs, g, D]
        del o
    if step.span is None:
        layer.score[:, :, :hi].index_copy_(0, step.rows, score)
    return out.view(R, n, Hq, D)  # [R, n, Hq, D]


def _rows_probe(
    layer: PoolLayer,
    step: RowsPass,
    query: torch.Tensor,
    probe_kv: tuple[torch.Tensor, torch.Tensor],
    scaling: float,
    hi: int,
) -> torch.Tensor:
    """A look-ahead probe pass of R rows: queries [R, Hq, w, D] over each row's slots [0, hi) and the probe's own
    keys (causal; masked columns are neither queries nor keys). Writes the rows' ``probe`` (and, for a rule probing
    every few blocks, their stored queries); returns the probe outputs [R, w, Hq, D]. In a budget shared by G heads
    the slots are the Hs = Hkv / G storage heads' (each query head over its own head's slots), the own keys the
    model's Hkv heads'; the query rows (G, g, w) of a storage head are the (g, w) rows of its G heads in order."""
    pk, pv = probe_kv  # [R, Hkv, w, D] each
    R, Hq, w, D = query.shape
    Hkv, Hs, G = pk.shape[1], layer.keys.shape[1], step.share
    g = Hq // Hkv
    q = (query * scaling).reshape(R, Hkv, g * w, D)  # [R, Hkv, g*w, D]
    weights = probe.query_weights(step.real, R, w, q.device)  # [R, w]
    own, own_hidden = probe.own_logits(q, pk, weights)  # [R, Hkv, g*w, w], [R, 1, 1, w, w]
    own_lse = own.logsumexp(-1, keepdim=True)  # [R, Hkv, g*w, 1]
    q, own_lse = q.view(R, Hs, G * g * w, D), own_lse.view(R, Hs, G * g * w, 1)  # storage heads' rows
    slot_pos = step.take(layer.pos[:, :, :hi])  # [R, Hs, hi]
    other = layer.other_heads(step.take, step.share)  # [R, Hs, G, T + 1] or None
    other = None if other is None else other[..., :hi]
    to_slots, lse = probe.slot_probabilities(q, step.take(layer.keys[:, :, :hi]), slot_pos, own_lse, other)
    layer.probe[:, :, :hi].index_copy_(0, step.rows, probe.per_slot(to_slots, weights))  # [R, Hs, hi]
    if step.method.stores_probe:
        layer.store_probe(step.rows, q, own_lse, weights)
    to_own = probe.probabilities(own.view(R, Hkv, g, w, w), lse.view(R, Hkv, g, w, 1), own_hidden)
    to_own = to_own.view(R, Hkv, g * w, w)  # [R, Hkv, g*w, w]
    values = step.take(layer.values[:, :, :hi])  # [R, Hs, hi, D]
    out = torch.matmul(to_slots.to(pv.dtype), values)  # [R, Hs, G*g*w, D]
    out = out.view(R, Hkv, g * w, D) + torch.matmul(to_own.to(pv.dtype), pv)  # [R, Hkv, g*w, D]
    return out.view(R, Hkv, g, w, D).permute(0, 3, 1, 2, 4).reshape(R, w, Hq, D)  # [R, w, Hq, D]


def add_received(score: torch.Tensor, probs: torch.Tensor, token_mask: torch.Tensor | None) -> None:
    """Add the attention each slot received, summed over the query group and the chunk's real queries, to
    ``score`` [B, Hkv, lim] (a view, in place). probs [B, Hkv, g*m, lim]; token_mask [B, m] or None."""
    if token_mask is None:
        score += probs.sum(dim=2)  # [B, Hkv, lim]
        return
    B, Hkv, gm, lim = probs.shape
    real = token_mask.repeat(1, gm // token_mask.shape[1]).to(probs.dtype)  # [B, g*m], row order of probs
    score += torch.matmul(real[:, None, None, :], probs).view(B, Hkv, lim)  # pads add 0


#: The model families Batch-Max's attention runs exactly (full causal attention, no logit softcapping).
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "phi3")


def unsupported(config) -> str | None:
    """Why the "batchmax" attention cannot run a model of this (text) config exactly, or None when it can.

    It attends over every kept slot: a sliding window (keys older than ``sliding_window`` hidden, e.g.
    Phi-3-mini-4k's 2047, Mistral v0.1's 4096) or attention logit softcapping (Gemma-2) would be silently ignored.
    A window at least ``max_position_embeddings`` long never hides anything (Phi-3.5-mini: 262144 > 131072).
    """
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        return f"attn_logit_softcapping={cap} (attention logit softcapping)"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = "sliding_attention" in layer_types
    else:
        sliding = window is not None and window < (getattr(config, "max_position_embeddings", None) or window + 1)
    if sliding:
        return f"sliding_window={window} (attention limited to the last {window} tokens)"
    return None


def padding_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask builder for "batchmax": the 2D padding mask passes through; slot positions do the causal part."""
    return attention_mask


def register() -> None:
    """Register the attention function and its mask builder under the name "batchmax" (idempotent)."""
    AttentionInterface.register(NAME, batchmax_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


@contextlib.contextmanager
def use_batchmax_attention(model: torch.nn.Module, name: str = NAME):
    """Run ``model`` with the "batchmax" attention (or another registered under ``name``: the HF drop-in's, which
    registers it first) inside the block, restoring its implementation after."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    reason = unsupported(config)
    if reason is not None:
        raise ValueError(f"Batch-Max's attention cannot run this model exactly: {reason}")
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
