"""FKV and snap prefilled in chunks (``Method.chunk``; ``slots.chunk_pass``), as vLLM and SGLang prefill.

Chunked FKV must give one-pass FKV's logits (float32, 1e-4) and HF's own ``generate``'s tokens, with chunks that cut a
prompt mid-block and several requests at different phases in one pass; chunked snap must keep exactly the positions
per (layer, KV head) one-pass snap keeps (its last chunk holding its whole window, merged when shorter); the planner
counts the chunk's activations, so that a prompt one-pass FKV cannot hold in a budget is served chunked in it; a bad
chunk is one line.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_random_model
from tiny import PEAKED

from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method, chunk_blocks, make_method
from batchmax_tp.core.requests import Batching, Record, Request, Sampling
from batchmax_tp.core.scheduler import Scheduler
from batchmax_tp.plan.planner import ModelShape, max_prompt_len, predict_pool

ATOL = 1e-4
LENGTHS = [150, 37, 130, 90, 201, 64, 83]
NEW = [6, 1, 3, 7, 5, 8, 4]  # the second ends with its prompt: its slot takes a request mid-way through others


def prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def hf_alone(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def steps(monkeypatch):
    """Every pass a run's scheduler hands out (its ``Step``s, in order)."""
    seen = []
    original = Scheduler.next_step

    def recording(self):
        step = original(self)
        if step is not None:
            seen.append(step)
        return step

    monkeypatch.setattr(Scheduler, "next_step", recording)
    return seen


def several_at_different_phases(steps) -> bool:
    """Some prefill pass holds the chunks of several requests, one of them past its prompt's first chunk."""
    for step in steps:
        work = [w for w in step.work if w.phase.kind == "prefill"]
        if len({w.row for w in work}) > 1:
            if any(w.phase.start > 0 for w in work) and any(w.phase.start == 0 for w in work):
                return True
    return False


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("block", [16, 0], ids=["paged", "slots"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "apart"])
def test_chunked_fkv_equals_one_pass_logits_and_hf_generate_tokens(family, block, mixed, steps):
    """Chunks of 40 tokens (blocks of 16: every chunk after the first starts mid-block) in 3 slots, 120 prompt tokens a
    pass (vLLM's token budget over its chunk): the passes mix the first chunks of new requests with the later chunks
    (and last, shorter ones) of others; ``mixed``: the decoding rows' steps ride in those passes (one model call)."""
    model = tiny_random_model(family, seed=0, **PEAKED)
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    rec = Record(logits=True)
    one = Engine(model, Method("fkv", block=block, chunk=0), 3).run(requests, Sampling(), record=rec)
    assert not any(step.kind == "prefill" and len(step.work) > 1 and step.work[0].phase.start for step in steps)
    steps.clear()
    batching = Batching(pass_tokens=120, mixed=mixed)
    chunked = Engine(model, Method("fkv", block=block, chunk=40), 3, batching=batching).run(requests, record=rec)
    assert several_at_different_phases(steps)
    both = [s for s in steps if {w.phase.kind for w in s.work} == {"prefill", "decode"}]
    assert all(s.kind == "mixed" for s in both) and (len(both) > 3) == mixed, [s.kind for s in steps]
    assert any(w.phase.start % 16 for step in steps for w in step.work if w.phase.kind == "prefill")  # mid-block
    for i, (a, b, r) in enumerate(zip(one.outputs, chunked.outputs, requests)):
        assert b.tokens == hf_alone(model, r.input_ids, r.max_new_tokens), f"request {i}"
        assert b.tokens == a.tokens, f"request {i}"
        err = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
        assert err <= ATOL, f"request {i} ({LENGTHS[i]} tokens): chunked logits differ by {err:.3g}"


@pytest.mark.parametrize("prefills", [1, 2])
def test_chunked_snap_keeps_one_pass_snaps_positions(prefills, steps):
    """Chunks of 40, a window of 12: the 83-token prompt's last chunk (3 tokens) merges with the one before it, so its
    window's queries are in its last pass; every (layer, KV head) keeps what one-pass snap keeps, and the tokens are
    one-pass snap's."""
    model = tiny_random_model("llama", seed=0, **PEAKED)
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    rec = Record(logits=True, positions=True)
    kw = dict(kv_max=48, p=8, window=12, kernel=5)
    one = Engine(model, Method("snap", chunk=0, **kw), 3).run(requests, Sampling(), record=rec)
    steps.clear()
    snap = Method("snap", chunk=40, prefills=prefills, **kw)
    chunked = Engine(model, snap, 3, batching=Batching(pass_tokens=120)).run(requests, record=rec)
    assert several_at_different_phases(steps) or prefills == 1  # (one prompt's blocks: a long one prefills alone)
    for i, (a, b) in enumerate(zip(one.outputs, chunked.outputs)):
        assert b.kept_positions == a.kept_positions, f"request {i}"
        assert any(min(head) < LENGTHS[i] - 48 for layer in b.kept_positions for head in layer) or LENGTHS[i] <= 48
        assert b.tokens == a.tokens, f"request {i}"
        err = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
        assert err <= ATOL, f"request {i}: {err:.3g}"
    # its full pairs are held only while it prefills: the blocks of ``prefills`` of the longest prompt
    full = 2 * 2 * 2 * 16 * 4 * 64 * (prefills * -(-max(LENGTHS) // 64) + 1)  # K and V, layers, heads, dim, fp32
    assert chunked.peak_kv_bytes - one.peak_kv_bytes == full


def test_chunks_of_a_prompt():
    assert chunk_blocks(100, 0) == [(0, 100)]
    assert chunk_blocks(100, 40) == [(0, 40), (40, 80), (80, 100)]
    assert chunk_blocks(83, 40, least_last=12) == [(0, 40), (40, 83)]
    assert chunk_blocks(10, 40, least_last=12) == [(0, 10)]
    assert Method("fkv", chunk=40).prefill_blocks(90) == [(0, 40), (40, 80), (80, 90)]
    assert Method("snap", kv_max=64, p=8, chunk=40, window=12).prefill_blocks(83) == [(0, 40), (40, 83)]
    assert Method("fkv").label() == "fkv" and Method("fkv", chunk=0).label() == "fkv(one-pass)"
    assert "one-pass" in Method("snap", kv_max=64, p=8, chunk=0).label()


@pytest.mark.parametrize(
    "spec,says",
    [
        ("fkv:chunk=-1", "chunk must be a non-negative integer"),
        ("snap:chunk=-5", "chunk must be a non-negative integer"),
        ("snap:prefills=0", "prefills must be a positive integer"),
    ],
)
def test_a_bad_chunk_is_one_line(spec, says):
    with pytest.raises(ValueError, match=says) as err:
        make_method(spec, kv_max=64)
    assert "\n" not in str(err.value)


def test_a_prompt_one_pass_fkv_cannot_hold_is_served_chunked_in_that_budget():
    """In the budget one-pass FKV's planner gives a 1,024-token prompt in one slot, chunked FKV (256-token chunks)
    holds a longer prompt that one-pass FKV does not, and serves it: HF's own tokens, within the planner's total."""
    from memtrack import AllocationTracker

    model = tiny_random_model("llama", seed=0, max_position_embeddings=4096, **PEAKED)
    shape = ModelShape.from_config(model.config)
    one, chunked = Method("fkv", chunk=0), Method("fkv", chunk=256)
    budget = predict_pool(shape, one, 1, 1024, 4).total
    longest_one = max_prompt_len(budget, shape, one, 4)
    longest = max_prompt_len(budget, shape, chunked, 4)
    assert 1024 <= longest_one < longest
    prompt = torch.randint(3, 128, (longest,), generator=torch.Generator().manual_seed(1)).tolist()
    assert predict_pool(shape, one, 1, longest, 4).total > budget  # refused one-pass
    with AllocationTracker() as t:
        (out,) = Engine(model, chunked, 1).run([Request(prompt, 4)], Sampling(ignore_eos=True)).outputs
    est = predict_pool(shape, chunked, 1, longest, 4)
    assert est.total <= budget and t.peak <= est.total - est.weights
    assert out.tokens == hf_alone(model, prompt, 4)
