"""The fair baselines: FKV and ED on the engine's ``DensePool`` (the model's SDPA over a prompt's own pairs, a fused
product in decode steps, no score sums).

They must give what the score-collecting path gives (HF's generate drop-in on a ``BatchMaxCache`` with the
"batchmax" attention: tokens identical, logits within 1e-4), what HF's own full-cache forward gives (FKV), keep
exactly Algorithm 3's pairs (ED, naive reference), and hold no per-slot score/position buffers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import (
    PEAKED,
    assert_kept_equal,
    assert_logits_close,
    assert_tokens_equal,
    hf_full_cache_logits,
    left_padded_batch,
    tiny_llama,
)
from memtrack import KERNEL_SCRATCH, AllocationTracker, AttentionPasses
from reference import reference_generate
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from batchmax_tp.bench.hf_reference import hf_reference_generate
from batchmax_tp.bench.padded import generate
from batchmax_tp.core import hf_cache
from batchmax_tp.core.hf_cache import BatchMaxCache
from batchmax_tp.core.method import FullCache, Method
from batchmax_tp.core.workspace import dense_workspace_bytes
from batchmax_tp.plan.planner import ModelShape, predict_pool

ATOL = 1e-4
LENGTHS = [37, 52, 60]  # three different left paddings (23, 8, 0)
METHODS = [Method("fkv"), Method("ed", kv_max=2), Method("ed", kv_max=5), Method("ed", kv_max=65)]
IDS = ["fkv", "ed2", "ed5", "ed65"]  # ed65: kv_max above the prompt length


def run(model, ids, mask, method, n):
    return generate(model, ids, mask, method, n, ignore_eos=True, return_logits=True)


def score_path(model, ids, mask, method, n) -> SimpleNamespace:
    """The score-collecting path: HF's ``model.generate`` drop-in on a ``BatchMaxCache`` (reserved to the run's
    size) with the "batchmax" attention: its tokens, logits, cache and kept positions."""
    cache = BatchMaxCache(method, reserve=method.capacity(ids.shape[1], n))
    with torch.no_grad(), hf_cache.use_drop_in(model):
        res = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=n,
            eos_token_id=-1,  # no EOS: every step runs (min_new_tokens would ban the EOS token instead)
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return SimpleNamespace(
        tokens=res.sequences[:, ids.shape[1] :],
        logits=[x.float() for x in res.logits],
        cache=cache,
        kept_positions=cache.kept_positions,
    )


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_fast_baseline_equals_batchmax_path_and_reference(method):
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    n = 12
    old = score_path(model, ids, mask, method, n)
    new = run(model, ids, mask, method, n)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert_tokens_equal(new.tokens, old.tokens, what=f"{method.label()}: fast vs batchmax path")
    assert_logits_close(new.logits, old.logits, ATOL, what=f"{method.label()}: fast vs batchmax path")
    assert_kept_equal(new.kept_positions(), old.kept_positions(), what=f"{method.label()} kept")
    ref = reference_generate(model, ids, mask, method.name, method.kv_max, None, n)
    assert_tokens_equal(new.tokens, ref.tokens, what=f"{method.label()}: fast vs reference")
    assert_kept_equal(new.kept_positions(), ref.kept, what=f"{method.label()}: fast vs Algorithm 3")
    assert_logits_close(
        new.logits,
        hf_full_cache_logits(model, ids, mask, new.tokens) if isinstance(method, FullCache) else ref.logits,
        ATOL,
        what=f"{method.label()}: fast vs HF full forward / reference",
    )
    # The pool's K/V as planned (ED: kv_max + 1 slots per row, never the prompt), and no per-slot score or
    # position buffers.
    want = predict_pool(ModelShape.from_config(model.config), method, len(LENGTHS), max(LENGTHS), n).kv
    assert new.peak_kv_bytes == want > 0 and new.served.kv_bytes_range == (want, want)
    assert old.cache.meta_bytes() > 0 and new.peak_meta_bytes == 0


@pytest.mark.parametrize("kv_max", [2, 3, 5])
def test_ed_kept_sets_follow_algorithm_3_step_by_step(kv_max):
    model = tiny_llama(1, **PEAKED)
    ids, mask = left_padded_batch([5, 60, 45], seed=4)  # a 5-token row: 55 pads before its prompt
    s, n = ids.shape[1], 3 * kv_max + 2
    ref = reference_generate(model, ids, mask, "ed", kv_max, None, n)
    for steps in range(1, n + 1):
        out = run(model, ids, mask, Method("ed", kv_max=kv_max), steps)
        assert_kept_equal(
            out.kept_positions(),
            ref.kept_history[steps - 1],
            what=f"[ed kv_max={kv_max}] kept after {steps} token(s)",
        )
        assert_tokens_equal(out.tokens, ref.tokens[:, :steps])
        held = out.kept_positions()[0][0][0]
        if steps == 1:  # prefill only: the whole (real) prompt
            assert held == list(range(s - 5, s))
        else:  # bounded by kv_max, newest token included, contiguous
            assert 2 <= len(held) <= kv_max and held[-1] == s + steps - 2
            assert held == list(range(held[0], held[-1] + 1))


@pytest.mark.parametrize("padded", [False, True])
def test_fkv_equals_hf_generate(padded, monkeypatch):
    """FKV = HF's own generate with its default cache (greedy), padded or not (unpadded: no mask at all)."""
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS if padded else [60, 60, 60], seed=2)
    n = 10
    with AttentionPasses(monkeypatch).measure() as measured:  # every pass's attention allocations
        out = run(model, ids, mask, Method("fkv", chunk=0), n)  # in one pass: its SDPA's count is exact
    with torch.no_grad():
        want = model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )[:, ids.shape[1] :]
    assert_tokens_equal(out.tokens, want, what="fkv vs HF generate")
    assert_logits_close(out.logits, hf_full_cache_logits(model, ids, mask, out.tokens), ATOL, what="fkv vs HF")
    # workspace: what the run's attention measured, pass by pass (each prompt's SDPA, each decode step's fused
    # product), is what the engine reports; the first call also allocates the pool (K/V, not workspace)
    measured[0] -= out.peak_kv_bytes
    assert out.peak_workspace_bytes == max(measured) > 0


COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)
ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"num_key_value_heads": 4}),  # fused qkv, no GQA
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_other_families_fast_equals_batchmax_path(arch):
    config_cls, model_cls, extra = ARCHS[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**COMMON, **extra})).float().eval()
    model.set_attn_implementation("sdpa")
    ids, mask = left_padded_batch([20, 33, 40], seed=0)
    for method in (Method("fkv"), Method("ed", kv_max=3)):
        old, new = score_path(model, ids, mask, method, 9), run(model, ids, mask, method, 9)
        assert_tokens_equal(new.tokens, old.tokens, what=f"{arch} {method.label()}")
        assert_logits_close(new.logits, old.logits, ATOL, what=f"{arch} {method.label()}")
        assert_kept_equal(new.kept_positions(), old.kept_positions(), what=f"{arch} {method.label()}")


# (batch, query heads, KV heads, head dim, queries, keys, mask): a prefill (queries = keys) or a decode step
SDPA_CALLS = [
    (2, 4, 2, 16, 10, 10, True),
    (2, 4, 4, 16, 10, 10, True),
    (2, 4, 2, 16, 10, 10, False),
    (3, 4, 2, 16, 1, 13, True),
    (3, 4, 2, 16, 1, 13, False),
    (2, 6, 2, 8, 24, 24, True),
]


@pytest.mark.parametrize("B,Hq,Hkv,D,n,L,masked", SDPA_CALLS)
def test_sdpa_calls_allocate_what_is_counted(B, Hq, Hkv, D, n, L, masked):
    """HF's SDPA attention function called as a baseline's layer calls it, measured: the queries in HF's layout
    (projected [B, n, Hq, D], transposed), keys/values views of a cache buffer, a padded prefill's boolean
    [B, 1, n, L] mask (built before, held: counted) or a decode step's view of the cache's [B, 1, 1, C] mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    query = torch.randn(B, n, Hq, D, generator=g).transpose(1, 2)  # [B, Hq, n, D]
    keys, values = torch.randn(2, B, Hkv, L + 5, D, generator=g)  # cache buffers [B, Hkv, C, D]
    real = torch.arange(L) >= torch.tensor([3, 0, 1])[:B, None]  # [B, L]: left pads
    held = 0
    if not masked:
        mask = None
    elif n > 1:  # HF's prefill mask: causal and not a pad
        mask = (torch.ones(n, L, dtype=torch.bool).tril() & real[:, None, :])[:, None]  # [B, 1, n, L]
        held = mask.numel()
    else:
        mask = torch.ones(B, 1, 1, L + 5, dtype=torch.bool)
        mask[..., :L] = real[:, None, None]
        mask = mask[..., :L]  # [B, 1, 1, L] view

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = Hq // Hkv, True

    with AllocationTracker() as t, torch.profiler.record_function("call"):
        out, _ = sdpa_attention_forward(Layer(), query, keys[:, :, :L], values[:, :, :L], mask, scaling=D**-0.5)
    assert out.shape == (B, n, Hq, D)
    measured = held + t.spans("call", scratch=KERNEL_SCRATCH)[0]
    assert measured == dense_workspace_bytes(B, Hq, Hkv, D, n, L, 4, padded=masked, align=False)


@pytest.mark.parametrize(
    "method", [Method("fkv"), Method("ed", kv_max=2), Method("ed", kv_max=4)], ids=["fkv", "ed2", "ed4"]
)
def test_plain_hf_references_give_the_engines_tokens(method):
    """The benchmark's plain-HF versions (HF generate; DynamicCache cut to its newest pair) agree with the engine."""
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=3)
    tokens, prefill_s, decode_s = hf_reference_generate(model, ids, mask, method, 11)
    assert prefill_s > 0 and decode_s > 0
    assert_tokens_equal(tokens, run(model, ids, mask, method, 11).tokens, what=f"plain HF {method.label()}")
    if method.evicts:  # ED: and the cut really changes the result (the reference is not a full cache)
        assert not torch.equal(tokens, run(model, ids, mask, Method("fkv"), 11).tokens)
