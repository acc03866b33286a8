"""BM's fused prefill attention (``attention._rows_block``) against the unfused one it replaced (``unfused.py``):
the same kept positions, tokens and logits for every rule, shared budgets, padded batches and unpadded rows; and
what one layer call computes, counted op by op (no per-layer mask, the tile written once)."""

from __future__ import annotations

import math

import pytest
import torch
import unfused
from tiny import PEAKED, tiny_random_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchmax_tp.bench.padded import generate
from batchmax_tp.core import attention
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method
from batchmax_tp.core.requests import Record, Request, Sampling
from batchmax_tp.core.rules import RULES

LENGTHS = [5, 40, 97, 130, 200, 290]
NEW = [6, 3, 9, 4, 7, 5]
KV, P = 96, 16
HEAD_DIM = 16  # the tiny model's


@pytest.fixture(scope="module")
def model_3kv():
    """3 KV heads (6 query heads), so that budgets can be shared by 1, 3 or all (``share=0``) of them."""
    return tiny_random_model("llama", seed=0, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, **PEAKED)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def _served(model_3kv, method: Method):
    out = Engine(model_3kv, method, 3).run(
        [Request(p, n) for p, n in zip(_prompts(), NEW)],
        Sampling(ignore_eos=True),
        record=Record(logits=True, positions=True),
    )
    return [(o.tokens, torch.stack(o.logits), o.kept_positions) for o in out.outputs]


def _padded(model_3kv, method: Method):
    """The paper's padded batch (``generate``: the static policy), left-padded prompts."""
    ps = _prompts()[2:5]
    s = max(map(len, ps))
    ids = torch.zeros(len(ps), s, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, s - len(p) :], mask[i, s - len(p) :] = torch.tensor(p), 1
    out = generate(model_3kv, ids, mask, method, 6, ignore_eos=True, return_logits=True)
    return [(out.tokens.tolist(), torch.stack(out.logits), out.kept_positions())]


METHODS = [f"{rule}:share={share}" for rule in RULES for share in (1, 3, 0)]


@pytest.mark.parametrize("run", [_served, _padded], ids=["rows", "padded"])
@pytest.mark.parametrize("rule", METHODS)
def test_fused_equals_unfused(model_3kv, monkeypatch, run, rule):
    method = Method("bm", kv_max=KV, p=P, rule=rule)
    fused = run(model_3kv, method)
    monkeypatch.setattr(attention, "_rows_block", unfused.rows_block)
    reference = run(model_3kv, method)
    assert len(fused) == len(reference) > 0
    for i, ((tokens, logits, kept), (tokens_u, logits_u, kept_u)) in enumerate(zip(fused, reference)):
        assert kept == kept_u, f"request {i}: kept positions differ"
        assert tokens == tokens_u, f"request {i}: tokens differ"
        torch.testing.assert_close(logits, logits_u, atol=1e-4, rtol=0)


class _Ops(TorchDispatchMode):
    """Every aten op run inside, with each output's dtype, size and whether it is new storage (not a view of, or
    written into, one of the op's inputs)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, torch.dtype, tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                fresh = t.untyped_storage().data_ptr() not in given
                self.ops.append((str(func.overloadpacket.__name__), t.dtype, tuple(t.shape), fresh))
        return out


def _layer_calls(model_3kv, monkeypatch, block) -> list[tuple[tuple[int, int, int, int], list]]:
    """(rows, query heads, columns, slots) and the ops of every BM prefill layer call ``block`` makes."""
    calls = []

    def counted(layer, step, query, scaling, hi, own):
        with _Ops() as ops:
            out = block(layer, step, query, scaling, hi, own)
        calls.append(((query.shape[0], query.shape[1], query.shape[2], hi), ops.ops))
        return out

    monkeypatch.setattr(attention, "_rows_block", counted)
    engine = Engine(model_3kv, Method("bm", kv_max=KV, p=P), 3)
    engine.run([Request(p, 2) for p in _prompts()], Sampling(ignore_eos=True))
    return calls


def _excess(calls) -> list[str]:
    """What a layer call does beyond the fused path's budget: a mask of the tile's queries x slots built (a bool
    tensor of at least columns x slots elements per row and head), or the float tile materialised more than once
    (fresh tensors of its size, ending in the slots); calls whose slots equal the head dimension are left out (their
    queries and outputs would count as tiles)."""
    problems = []
    for (R, Hq, n, hi), ops in calls:
        if hi == HEAD_DIM:
            continue
        tile = R * Hq * n * hi
        masks = [op for op, dtype, shape, _ in ops if dtype == torch.bool and math.prod(shape) >= R * n * hi]
        tiles = [
            op
            for op, dtype, shape, fresh in ops
            if dtype == torch.float32 and math.prod(shape) == tile and shape[-1] == hi and fresh
        ]
        if masks:
            problems.append(f"a mask built per layer: {masks}")
        if len(tiles) != 1:
            problems.append(f"the tile materialised {len(tiles)} times: {tiles}")
    return problems


def test_one_prefill_layer_call_builds_no_mask_and_writes_one_tile(model_3kv, monkeypatch):
    calls = _layer_calls(model_3kv, monkeypatch, attention._rows_block)
    assert len(calls) > 10 and any(R > 1 for (R, *_), _ in calls)
    assert _excess(calls) == []


def test_the_op_count_catches_the_unfused_call(model_3kv, monkeypatch):
    """The count above can fail: the unfused call builds a mask per layer and a second tile (the softmax's)."""
    problems = _excess(_layer_calls(model_3kv, monkeypatch, unfused.rows_block))
    assert any("mask built per layer" in p for p in problems)
    assert any("materialised 2 times" in p for p in problems)


def _decode_write_ops(model_3kv, monkeypatch, rule: str) -> list[list[str]]:
    """The ops that compute or write (not views) in each layer's write of every BM decode pass of a run: the copy of
    its pairs to the slots the pool recorded (``attention._copy_pairs``), or else the layer's own write."""
    from batchmax_tp.core.bounded import PoolLayer

    write, copy, calls = PoolLayer.write, attention._copy_pairs, []

    def counted(fn, layer, *args):
        with _Ops() as ops:
            out = fn(layer, *args)
        calls.append([op for op, _, _, fresh in ops.ops if fresh or op.endswith("_")])
        return out

    def writing(layer, step, key_states, value_states):
        if step.kind != "decode":
            return write(layer, step, key_states, value_states)
        return counted(write, layer, step, key_states, value_states)

    monkeypatch.setattr(PoolLayer, "write", writing)
    monkeypatch.setattr(attention, "_copy_pairs", lambda layer, *args: counted(copy, layer, *args))
    engine = Engine(model_3kv, Method("bm", kv_max=KV, p=P, rule=rule), 3)
    engine.run([Request(p, 12) for p in _prompts()], Sampling(ignore_eos=True))
    return calls


@pytest.mark.parametrize("rule", ["paper", "paper:share=3"])
def test_a_decode_layer_only_copies_its_pairs(model_3kv, monkeypatch, rule):
    """A decode pass's slot bookkeeping (positions, sums, masks, heads) is recorded once for every layer before the
    model call (``BoundedPool.ready``); inside it each layer's write is the two copies of its pairs."""
    calls = _decode_write_ops(model_3kv, monkeypatch, rule)
    assert len(calls) > 10 * model_3kv.config.num_hidden_layers
    assert all(ops == ["index_copy_", "index_copy_"] for ops in calls), calls[0]


def test_the_decode_write_count_catches_per_layer_bookkeeping(model_3kv, monkeypatch):
    """The count above can fail: without the pool's once-per-pass record each layer gathers its slot, builds its
    indices and writes its positions, sums and mask."""
    from batchmax_tp.core.bounded import BoundedPool
    from batchmax_tp.core.slots import SlotPool

    monkeypatch.setattr(BoundedPool, "ready", SlotPool.ready)
    calls = _decode_write_ops(model_3kv, monkeypatch, "paper")
    assert calls and all(len(ops) > 6 and "gather" in ops for ops in calls)


def test_a_row_that_sees_no_slot_stays_finite(model_3kv, monkeypatch):
    """A padded batch's row whose chunk is all pads and that holds nothing yet sees no slot at all (``blind``): its
    softmax stays finite, so no NaN reaches the pass's output or any slot's sums."""
    blind, block = [], attention._rows_block

    def checked(layer, step, query, scaling, hi, own):
        out = block(layer, step, query, scaling, hi, own)
        blind.append(step.blind)
        assert torch.isfinite(out).all() and torch.isfinite(layer.score).all()
        return out

    monkeypatch.setattr(attention, "_rows_block", checked)
    _padded(model_3kv, Method("bm", kv_max=KV, p=P))
    assert any(blind) and not all(blind)


def test_probes_folded_into_passes_of_rows_that_do_not_probe_change_nothing(model_3kv, monkeypatch):
    """Rows at their own phases share passes: in some a row probes and another does not (its probe columns are
    masked; ``among``), in others every row probes. Every request's kept positions, tokens and logits equal its
    generation alone (where every pass's probe is its own row's)."""
    method = Method("bm", kv_max=KV, p=P, rule="question:every=1")
    partial, folded = [], attention._folded

    def spy(layer, step, *args):
        partial.append(step.among is not None)
        return folded(layer, step, *args)

    monkeypatch.setattr(attention, "_folded", spy)
    served = _served(model_3kv, method)
    assert any(partial) and not all(partial)
    for prompt, new, (tokens, logits, kept) in zip(_prompts(), NEW, served):
        alone = generate(model_3kv, torch.tensor([prompt]), None, method, new, ignore_eos=True, return_logits=True)
        assert kept == [layer[0] for layer in alone.kept_positions()]
        assert tokens == alone.tokens[0].tolist()
        torch.testing.assert_close(logits, torch.stack([x[0] for x in alone.logits]), atol=1e-4, rtol=0)
