"""Budgets shared by a layer's heads (``Rule.share``, Ada-KV's allocation under Algorithm 1): allocation and eviction
equal the naive reference (``tests/reference.py``'s ``groups``: kept positions per head, logits within 1e-4) on tiny
models of each family, left-padded and continuous (under tp=2: ``test_tp.py``'s matrix of every method); storage is
sized to the group's total, which the planner predicts byte for byte and which never holds more pairs than the
paper's per-head ``kv_max``."""

from __future__ import annotations

import pytest
import torch
from conftest import PEAKED, assert_kept_equal, assert_logits_close, assert_tokens_equal, left_padded_batch
from multiproc import FAMILIES, make_model
from reference import reference_generate, rule_string
from tiny import tiny_llama, tiny_random_model

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method
from batchmax_tp.core.requests import Record, Request, Sampling
from batchmax_tp.plan.planner import ModelShape, pool_bookkeeping_bytes, predict, predict_pool

ATOL = 1e-4
QUESTION = dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2)


def four_kv_heads():
    """A tiny Llama with 8 query / 4 KV heads (``share=2``: two groups of two heads)."""
    return tiny_random_model(
        "llama", seed=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8, **PEAKED
    )


def four_layers():
    """A tiny Llama of 4 layers (4 query / 2 KV heads): at kv_max 16, p 4, taper 50 its budgets are 24, 20, 12, 8."""
    return tiny_llama(0, num_hidden_layers=4, **PEAKED)


MODELS = {
    "llama": lambda: tiny_llama(0, **PEAKED),  # 4 query / 2 KV heads
    "qwen2": lambda: tiny_random_model(seed=0, **FAMILIES["qwen2"]),
    "mistral": lambda: tiny_random_model(seed=0, **FAMILIES["mistral"]),
    "llama-4kv": four_kv_heads,
    "llama-4-layers": four_layers,
}
# (model, rule, its parameters, share, the reference's head groups, the prompts' seed: no near tie)
CASES = [
    ("llama", "paper", {}, 0, [[0, 1]], 3),
    ("llama", "question", QUESTION, 0, [[0, 1]], 1),
    ("llama", "pooled", dict(kernel=5, pool="avg"), 2, [[0, 1]], 1),
    ("qwen2", "snapkv", dict(window=8, every=1, weight=2.0, kernel=3, pool="max"), 0, [[0, 1]], 1),
    ("mistral", "question", QUESTION, 0, [[0, 1]], 1),
    ("llama-4kv", "question", QUESTION, 2, [[0, 1], [2, 3]], 1),
    ("llama-4kv", "paper", {}, 0, [[0, 1, 2, 3]], 1),
]


def shared(rule: str, params: dict, share: int) -> str:
    return rule_string(rule, {**params, "share": share})


def tapered(rule: str, params: dict, taper: int, share: int = 1) -> str:
    return rule_string(rule, {**params, "taper": taper, **({"share": share} if share != 1 else {})})


def assert_padded_run_is_the_references(model, ids, mask, method: Method, n: int, ref) -> None:
    """``generate`` on the padded batch: logits, tokens and kept positions equal ``ref``'s at the end, right after
    the prompt, and after a decode eviction."""
    out = generate(model, ids, mask, method, n, ignore_eos=True, return_logits=True)
    assert_logits_close(out.logits, ref.logits, ATOL, what="logits")
    assert_tokens_equal(out.tokens, ref.tokens)
    assert_kept_equal(out.kept_positions(), ref.kept)
    for steps in (1, 2 * method.p + 2):
        out_k = generate(model, ids, mask, method, steps, ignore_eos=True)
        assert_kept_equal(out_k.kept_positions(), ref.kept_history[steps - 1], what=f"kept after {steps} tokens")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-share{c[3]}")
def test_shared_budget_matches_the_reference_left_padded(case):
    family, rule, params, share, groups, seed = case
    model = MODELS[family]()
    ids, mask = left_padded_batch([37, 52, 60], seed=seed)
    kv_max, p, n = 16, 4, 14
    ref = reference_generate(model, ids, mask, "bm", kv_max, p, n, rule=rule, rule_params=params, groups=groups)
    assert ref.min_margin > 1e-4, f"near tie in the reference ranking ({ref.min_margin:.2g}); pick another seed"
    method = Method("bm", kv_max=kv_max, p=p, rule=shared(rule, params, share))
    assert_padded_run_is_the_references(model, ids, mask, method, n, ref)
    # Not vacuous: some head held more than kv_max pairs (the budget moved between heads), each group held at most
    # its heads' kv_max each, and the kept sets differ from the paper's per-head budgets.
    sizes = [[len(h) for h in sample] for state in ref.kept_history for layer in state for sample in layer]
    assert max(max(s) for s in sizes) > kv_max
    assert all(sum(s[h] for h in g) <= kv_max * len(g) for s in sizes for g in groups)
    alone = reference_generate(model, ids, mask, "bm", kv_max, p, n, rule=rule, rule_params=params)
    assert alone.kept != ref.kept


@pytest.mark.parametrize(
    "budgets",
    [
        dict(rule=shared("question", QUESTION, 0), model="llama", reference=dict(groups=[[0, 1]])),
        dict(
            rule=tapered("question", QUESTION, 50), model="llama-4-layers", reference=dict(layer_kv_max=(24, 20, 12, 8))
        ),
    ],
    ids=["share", "taper"],
)
def test_budgets_match_the_reference_continuous(budgets):
    """Requests of several lengths through 2 slots, each at its own eviction steps (heads sharing a budget; budgets
    across layers): each equals the reference run on its own unpadded prompt."""
    model = MODELS[budgets["model"]]()
    g = torch.Generator().manual_seed(3)
    lengths, new = [9, 40, 61, 23], [6, 12, 3, 14]
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    method = Method("bm", kv_max=16, p=4, rule=budgets["rule"])
    requests = [Request(pr, n) for pr, n in zip(prompts, new)]
    out = Engine(model, method, 2).run(requests, Sampling(ignore_eos=True), record=Record(logits=True, positions=True))
    for pr, n, o in zip(prompts, new, out.outputs):
        ids = torch.tensor([pr])
        ref = reference_generate(
            model, ids, torch.ones_like(ids), "bm", 16, 4, n, rule="question", rule_params=QUESTION,
            **budgets["reference"],
        )  # fmt: skip
        assert ref.min_margin > 1e-4, ref.min_margin
        assert o.tokens == ref.tokens[0].tolist()
        assert_logits_close([x[None] for x in o.logits], ref.logits, ATOL)
        assert o.kept_positions == [layer[0] for layer in ref.kept]


# -- memory ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["paper:share=0", "question:window=6,every=3,kernel=3,sinks=1,recent=4,share=0"])
def test_planner_predicts_shared_storage_exactly(rule):
    """K/V and bookkeeping held equal the planner's byte for byte; the group holds Hs x (G x kv_max + 1) slots."""
    model = tiny_llama(seed=0)
    ids = torch.randint(3, 128, (3, 70), generator=torch.Generator().manual_seed(0))
    method = Method("bm", kv_max=24, p=8, rule=rule)
    out = generate(model, ids, None, method, 12, ignore_eos=True)
    shape = ModelShape.from_config(model.config)
    assert out.peak_kv_bytes == predict(shape, method, 3, 70, 12).kv
    assert out.peak_meta_bytes == pool_bookkeeping_bytes(shape, method, 3, 70)
    D, L = shape.head_dim, shape.layers
    assert out.peak_kv_bytes == 2 * 3 * L * 1 * (2 * 24 + 1) * D * 4  # one storage head of 2 x 24 slots + scratch


@pytest.mark.parametrize("heads,kv_heads,tp", [(9, 3, 1), (9, 3, 2), (32, 32, 1), (32, 32, 4), (32, 8, 2)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_shared_budget_never_holds_more_than_the_papers(heads, kv_heads, tp, dtype):
    """Same pairs per slot (G x kv_max per group), fewer scratch slots: K/V bytes never exceed the per-head pool's,
    and K/V + bookkeeping (one int8 head tag per slot) neither, at kv_max 128-1024."""
    shape = ModelShape(4, 64 * heads, 128, heads, kv_heads, 64, 1000, 10**6, False)
    for kv_max in (128, 512, 1024):
        paper = predict_pool(shape, Method("bm", kv_max=kv_max), 8, 2048, 64, tp=tp, dtype=dtype)
        for share in (0, 1):
            est = predict_pool(shape, Method("bm", kv_max=kv_max, rule=f"paper:share={share}"), 8, 2048, 64, tp=tp,
                               dtype=dtype)  # fmt: skip
            assert est.kv <= paper.kv and est.kv + est.slot_meta <= paper.kv + paper.slot_meta


def test_bad_shares_are_one_line_errors():
    with pytest.raises(ValueError, match="share=2 does not divide the 3 KV heads"):
        Method("bm", kv_max=64, p=16, rule="paper:share=2").group(3)
    with pytest.raises(ValueError, match="share=2 does not divide"):
        predict_pool(ModelShape.from_config(make_model(False).config), Method("bm", 64, 16, rule="paper:share=2"),
                     2, 100, 4)  # fmt: skip
    from batchmax_tp.core.hf_cache import BatchMaxCache

    with pytest.raises(ValueError, match="heads sharing a budget run in batchmax_tp's engine"):
        BatchMaxCache(Method("bm", kv_max=128, p=16, rule="question:share=0"))


# -- budgets across layers (a rule's taper) -------------------------------------------------------------------------
# (rule, its parameters, taper, share, the reference's head groups, the prompts' seed: no near tie)
TAPERS = [
    ("paper", {}, 50, 1, None, 3),
    ("question", QUESTION, 50, 1, None, 1),
    ("question", QUESTION, -50, 1, None, 1),
    ("question", QUESTION, 50, 0, [[0, 1]], 1),  # with a budget shared by the heads too
]


#: The combinations below that are refused: a taper of 75% leaves the smallest layer p slots or fewer.
REFUSED_TAPERS = {(16, 4, 75), (256, 64, 75), (96, 16, 75)}


@pytest.mark.parametrize("layers", [1, 2, 4, 24, 28, 30, 32])
@pytest.mark.parametrize("kv_max, p", [(16, 4), (256, 64), (512, 64), (1024, 64), (96, 16)])
@pytest.mark.parametrize("taper", [25, 50, -50, 75])
def test_layer_budgets_add_up_to_the_papers_and_follow_a_line(layers, kv_max, p, taper):
    """Every layer's budget is the smallest's plus whole blocks of p, within p of PyramidKV's line from (1 + t) x
    kv_max at the first layer to (1 - t) x kv_max at the last (reversed for a negative taper), in order, and all of
    them together hold exactly ``layers x kv_max`` slots: what the paper's per-layer ``kv_max`` holds."""
    if (kv_max, p, taper) in REFUSED_TAPERS:  # its smallest layer would hold p slots or fewer: refused, one line
        with pytest.raises(ValueError, match=f"taper={taper} leaves its smallest layer") as err:
            Method("bm", kv_max=kv_max, p=p, rule=f"paper:taper={taper}")
        assert "\n" not in str(err.value)
        return
    method = Method("bm", kv_max=kv_max, p=p, rule=f"paper:taper={taper}")
    caps = method.layer_capacities(layers)
    m = method.taper_steps
    assert m >= 1 and method.least_kv_max_of_layers == kv_max - m * p
    assert len(caps) == layers and sum(caps) == layers * kv_max
    assert all((c - method.least_kv_max_of_layers) % p == 0 for c in caps)
    assert list(caps) == sorted(caps, reverse=taper > 0)
    for i, c in enumerate(caps):
        slope = 1 - 2 * i / (layers - 1) if layers > 1 else 0
        assert abs(c - (kv_max + m * p * (slope if taper > 0 else -slope))) < p, (i, c)
    if layers > 1:
        assert min(caps) == kv_max - m * p and max(caps) == kv_max + m * p
    assert Method("bm", kv_max=kv_max, p=p).layer_capacities(layers) is None


def test_bad_tapers_are_one_line_errors():
    with pytest.raises(ValueError, match="taper must be <= 99"):
        Method("bm", kv_max=512, rule="question:taper=100")
    with pytest.raises(ValueError, match="taper must be an integer >= -99"):
        Method("bm", kv_max=512, rule="question:taper=-100")
    with pytest.raises(ValueError, match=r"taper=80 leaves its smallest layer 64 slots, below p \+ the pairs it prot"):
        Method("bm", kv_max=256, rule="question:taper=80")
    with pytest.raises(ValueError, match=r"taper=5 moves no layer's budget by a whole p=64 at kv_max=512 \(\|taper\| "):
        Method("bm", kv_max=512, rule="paper:taper=5")
    with pytest.raises(ValueError, match="applies to method 'bm' only"):
        Method("snap", kv_max=512, rule="paper:taper=50")
    from batchmax_tp.core.hf_cache import BatchMaxCache

    with pytest.raises(ValueError, match=r"budgets across layers \(taper\) run in batchmax_tp's engine"):
        BatchMaxCache(Method("bm", kv_max=128, p=16, rule="paper:taper=50"))


@pytest.mark.parametrize("case", TAPERS, ids=lambda c: f"{c[0]}-taper{c[2]}-share{c[3]}")
def test_budgets_across_layers_match_the_reference_left_padded(case):
    """Each layer evicts p when its own budget is full (the first block is the smallest layer's): kept positions per
    layer and head, logits and tokens equal the reference's (``layer_kv_max``), right after the prompt, after a
    decode eviction and at the end (the paper's padded batch)."""
    rule, params, taper, share, groups, seed = case
    model = four_layers()
    ids, mask = left_padded_batch([37, 52, 60], seed=seed)
    kv_max, p, n = 16, 4, 14
    method = Method("bm", kv_max=kv_max, p=p, rule=tapered(rule, params, taper, share))
    caps = method.layer_capacities(4)
    assert caps == ((24, 20, 12, 8) if taper > 0 else (8, 12, 20, 24))
    kw = dict(rule=rule, rule_params=params, groups=groups)
    ref = reference_generate(model, ids, mask, "bm", kv_max, p, n, layer_kv_max=caps, **kw)
    assert ref.min_margin > 1e-4, f"near tie in the reference ranking ({ref.min_margin:.2g}); pick another seed"
    assert_padded_run_is_the_references(model, ids, mask, method, n, ref)
    # Not vacuous: after the prompt each layer held its own budget's pairs (less the p its last block's eviction
    # freed, plus that block), more than kv_max in the largest layers, and the kept sets differ from every layer at
    # kv_max's.
    held = [max(sum(len(h) for h in sample) // len(sample) for sample in layer) for layer in ref.kept_after_prefill]
    assert [h > kv_max for h in held] == [c > kv_max for c in caps] and all(h <= c for h, c in zip(held, caps))
    uniform = reference_generate(model, ids, mask, "bm", kv_max, p, n, **kw)
    assert uniform.kept != ref.kept


def test_budgets_across_layers_are_stored_in_the_papers_bytes():
    """Each layer group's storage is sized to its own budget (+ the scratch slot); K/V and bookkeeping held are the
    paper's per-layer kv_max pool's, byte for byte, and the planner's."""
    from batchmax_tp.core.layered import LayeredPool
    from batchmax_tp.core.pool import make_pool
    from batchmax_tp.core.slots import KVLayout

    method = Method("bm", kv_max=16, p=4, rule=tapered("question", QUESTION, 50))
    layout = KVLayout(2, 16, 16, torch.float32, torch.device("cpu"), 4)
    pool, paper = (
        make_pool(method, 4, 3, 16, False),
        make_pool(Method("bm", 16, 4, rule=rule_string("question", QUESTION)), 4, 3, 16, False),
    )
    assert isinstance(pool, LayeredPool) and [len(part.layers) for part in pool.parts] == [1, 1, 1, 1]
    for each in (pool, paper):
        each.allocate(layout)
    assert [layer.keys.shape[2] for layer in pool.layers] == [25, 21, 13, 9]
    assert pool.kv_bytes() == paper.kv_bytes() and pool.meta_bytes() == paper.meta_bytes()
    model = four_layers()
    ids = torch.randint(3, 128, (3, 70), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, None, method, 12, ignore_eos=True)
    shape = ModelShape.from_config(model.config)
    assert out.peak_kv_bytes == predict(shape, method, 3, 70, 12).kv == pool.kv_bytes()
    assert out.peak_meta_bytes == pool_bookkeeping_bytes(shape, method, 3, 70)
