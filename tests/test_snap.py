"""``snap`` (SnapKV's compression once after an unchunked prefill) against the naive reference: kept positions per
(layer, KV head), logits within 1e-4 and tokens, for every request served in 1, 2 or 5 slots, on Llama, Qwen2,
Mistral and Phi-3 shapes, prompts shorter than, equal to and longer than ``kv_max``, EOS ignored and honoured."""

from __future__ import annotations

import pytest
import torch
from conftest import PEAKED
from reference import reference_generate
from tiny import tiny_random_model

from batchmax_tp.core import snap
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method
from batchmax_tp.core.requests import Record, Request, Sampling

KV, P, WINDOW, KERNEL = 40, 8, 12, 5
METHOD = Method("snap", kv_max=KV, p=P, window=WINDOW, kernel=KERNEL)
SHAPES = {
    "llama": dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96),
    "qwen2": dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64),
    "phi3": dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=64),
}
LENGTHS = [7, KV - 1, KV, KV + 1, 97, 150]  # shorter than, equal to and longer than kv_max
NEW = [9, 30, 3, 45, 21, 12]  # decode evictions once a slot fills (kv_max - held < new)


def model_of(family: str):
    return tiny_random_model(family, seed=0, head_dim=16, **SHAPES[family], **PEAKED)


def prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def reference(model, prompt: list[int], new: int, eos: int | None = None):
    """The reference alone on one unpadded prompt: (tokens through EOS when honoured, logits, kept positions)."""
    ids = torch.tensor([prompt])
    ref = reference_generate(
        model, ids, torch.ones_like(ids), "snap", KV, P, new, snap={"window": WINDOW, "kernel": KERNEL}
    )
    tokens = ref.tokens[0].tolist()
    n = len(tokens) if eos is None or eos not in tokens else tokens.index(eos) + 1
    return tokens[:n], [x[0] for x in ref.logits[:n]], [layer[0] for layer in ref.kept_history[n - 1]]


@pytest.fixture(scope="module")
def refs():
    cache = {}

    def get(family: str, eos: int | None = None):
        if (family, eos) not in cache:
            model = model_of(family)
            cache[family, eos] = [reference(model, p, n, eos) for p, n in zip(prompts(), NEW)]
        return cache[family, eos]

    return get


def check(out, want) -> None:
    for i, (o, (tokens, logits, kept)) in enumerate(zip(out.outputs, want)):
        assert o.tokens == tokens, f"request {i} ({LENGTHS[i]} tokens): tokens differ from the reference"
        torch.testing.assert_close(
            torch.stack(o.logits), torch.stack(logits), atol=1e-4, rtol=0, msg=lambda m, i=i: f"request {i}: {m}"
        )
        assert o.kept_positions == kept, f"request {i} ({LENGTHS[i]} tokens): kept positions differ"


@pytest.mark.parametrize("family", list(SHAPES))
def test_every_request_equals_the_reference(family, refs):
    model, requests = model_of(family), [Request(p, n) for p, n in zip(prompts(), NEW)]
    for slots in (1, 2, 5):
        record = Record(logits=True, positions=True)
        out = Engine(model, METHOD, slots).run(requests, Sampling(ignore_eos=True), record=record)
        check(out, refs(family))


def test_eos_honoured_ends_a_request_where_the_reference_emits_it(refs):
    """EOS honoured: each request ends at the reference's first EOS (a token it does emit), its slot taken by the
    next; every output equals the reference's up to there."""
    full = refs("llama")
    eos = next(t for tokens, _, _ in full for t in tokens[1:-1] if t not in tokens[:1])  # one that ends a request early
    want = refs("llama", eos)
    assert any(len(w[0]) < n for w, n in zip(want, NEW)), "no request ends early: the test would prove nothing"
    out = Engine(model_of("llama"), METHOD, 2).run(
        [Request(p, n) for p, n in zip(prompts(), NEW)],
        Sampling(eos_token_id=eos),
        record=Record(logits=True, positions=True),
    )
    check(out, want)


def test_the_choice_is_not_the_newest_pairs_and_differs_from_bm():
    """Not vacuous: a long prompt keeps pairs from before its last kv_max positions, and BM keeps other ones."""
    model, prompt = model_of("llama"), prompts()[-1]
    (out,) = Engine(model, METHOD, 1).run([Request(prompt, 1)], record=Record(positions=True)).outputs
    bm_engine = Engine(model, Method("bm", kv_max=KV, p=P), 1)
    bm = bm_engine.run([Request(prompt, 1)], record=Record(positions=True)).outputs[0]
    kept = out.kept_positions
    assert all(len(head) == KV for layer in kept for head in layer)
    assert any(min(head) < len(prompt) - KV for layer in kept for head in layer)
    assert all(head[-WINDOW:] == list(range(len(prompt) - WINDOW, len(prompt))) for layer in kept for head in layer)
    assert kept != bm.kept_positions


def test_window_scores_and_choice_on_a_known_case():
    """Two keys, one query per head in a window of 1: the softmax by hand; pooling with zeros at the ends."""
    query = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]]]])  # [1, 1, 3, 2]: the last query is the window
    key = torch.tensor([[[[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]]])
    scores = snap.window_scores(query, key, 1.0, 1)  # query 2 . keys = [2, 0, 2]
    e = torch.tensor([2.0, 0.0, 2.0]).exp()
    torch.testing.assert_close(scores[0, 0], e / e.sum())
    s = torch.tensor([[[0.5, 0.1, 0.1, 0.9, 0.0, 0.3]]])  # [1, 1, 6], window 1 (position 5)
    # kernel 3 over the prefix [0.5, 0.1, 0.1, 0.9, 0.0] with zeros beyond: [0.2, 0.233, 0.367, 0.333, 0.3]
    assert snap.choose(s, 3, 1, 3).tolist() == [[[2, 3, 5]]]
    assert snap.choose(s, 6, 1, 3).tolist() == [[list(range(6))]]  # kv_max >= s: everything


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(kv_max=32, window=32), "kv_max must be > window"),
        (dict(kv_max=64, window=0), "window must be a positive integer"),
        (dict(kv_max=64, kernel=-1), "kernel must be a positive integer"),
        (dict(kv_max=64, kernel=4), "kernel must be odd"),
        (dict(kv_max=64, window=1.5), "window must be a positive integer"),
        (dict(kv_max=64, rule="question"), "applies to method 'bm' only"),
    ],
)
def test_bad_snap_parameters_are_one_line(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Method("snap", p=8, **kwargs)
