"""Engine-level properties: exactness with room for everything, HF drop-in cache, bounded memory, padding
invariance, method validation."""

from __future__ import annotations

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
from reference import reference_generate
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.hf_cache import BatchMaxCache
from batchmax_tp.core.method import ExtremeDecoding, FullCache, Method

ATOL = 1e-4


def real_positions(mask_row):
    return [i for i, m in enumerate(mask_row.tolist()) if m]


# ------------------------------------------------------------------------------- room for everything
@pytest.mark.parametrize("method", [Method("bm", kv_max=80, p=8), Method("fkv")], ids=["bm", "fkv"])
def test_large_kv_max_equals_hf_full_cache_tiny(method):
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch([37, 52, 60], seed=1)
    s, n = ids.shape[1], 12  # s + n <= 80: BM never evicts
    want_plain = model.generate(
        ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, s:]
    out = generate(model, ids, mask, method, n, ignore_eos=True, return_logits=True)
    assert_logits_close(
        out.logits, hf_full_cache_logits(model, ids, mask, out.tokens), ATOL, what=f"{method.name} vs HF full forward"
    )
    assert_tokens_equal(out.tokens, want_plain, what=f"{method.name} vs HF generate")
    for layer in out.kept_positions():
        for j, heads in enumerate(layer):
            assert heads == [real_positions(mask[j]) + list(range(s, s + n - 1))] * 2


@pytest.mark.parametrize("method", [Method("bm", kv_max=80, p=8), Method("fkv")], ids=["bm", "fkv"])
def test_forced_tokens_are_fed_and_own_choices_recorded(method):
    """Teacher forcing: each step is HF's full forward over the prompt and the FORCED tokens so far; ``tokens``
    holds the model's own argmax at each step, not the forced ids."""
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch([37, 52, 60], seed=1)
    n = 10
    forced = torch.randint(3, model.config.vocab_size, (ids.shape[0], n), generator=torch.Generator().manual_seed(5))
    out = generate(model, ids, mask, method, n, ignore_eos=True, return_logits=True, force_tokens=forced)
    want = hf_full_cache_logits(model, ids, mask, forced)
    assert_logits_close(out.logits, want, ATOL, what=f"{method.name} forced vs HF full forward")
    assert_tokens_equal(out.tokens, torch.stack(want, dim=1).argmax(-1), what="own choices")
    assert not torch.equal(out.tokens, forced)  # random ids are not the model's choices: the two are told apart
    with pytest.raises(ValueError, match="force_tokens must be"):
        generate(model, ids, mask, method, n, force_tokens=forced[:, :3])


PROMPTS = [
    "The lighthouse keeper on the northern island kept a logbook of every ship that passed during the long "
    "winter. In January he recorded eleven fishing boats, three cargo ships and a single sailing yacht that "
    "had lost its way in a storm. In February the sea froze near the shore and no ships came at all, so he "
    "spent his evenings repairing nets and reading old letters. How many ships did he record in January?",
    "Write one short sentence describing a quiet morning in a small mountain village, mentioning the "
    "baker, the church bell and the first bus of the day that takes the children to school in the valley.",
]


def test_embedded_model_greedy_equals_hf_generate(embedded):
    from batchmax_tp.eval.generation import encode_prompts

    model, tok = embedded
    ids, mask = encode_prompts(tok, PROMPTS)
    s, n = ids.shape[1], 16
    assert 60 <= s <= 160 and mask.sum(1).min() < s  # ~100 tokens, really padded
    with torch.no_grad():
        want = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )[:, s:]
    want = torch.nn.functional.pad(want, (0, n - want.shape[1]), value=tok.pad_token_id)  # all may stop early
    full_logits = hf_full_cache_logits(model, ids, mask, want)
    out = generate(
        model,
        ids,
        mask,
        Method("bm", kv_max=s + n + 8, p=16),
        n,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        return_logits=True,
    )
    assert_tokens_equal(out.tokens, want, what="embedded model: engine BM vs HF generate")
    # logits of the steps before any EOS (after it the continuation differs only by padding conventions)
    first_eos = [int(out.num_generated[j]) for j in range(len(PROMPTS))]
    steps = min(first_eos)
    assert steps >= 4, first_eos
    # 30 fp32 layers, logits ~20 in magnitude: observed max |diff| ~5e-5; a little headroom for other BLAS
    assert_logits_close(out.logits[:steps], full_logits[:steps], 5e-4, what="embedded model: BM vs HF forward")


# --------------------------------------------------------------------------------------- HF drop-in cache
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
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
}


def tiny_arch(name, seed=0):
    config_cls, model_cls, extra = ARCHS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**COMMON, **extra))
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None  # compare full lengths
    return model.float().eval()


def hf_generate(model, ids, mask, n, cache=None, **kw):
    from batchmax_tp.core.hf_cache import use_drop_in

    args = dict(
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    with torch.no_grad():
        if cache is None:
            res = model.generate(ids, **args)
        else:
            with use_drop_in(model):
                res = model.generate(ids, past_key_values=cache, **args)
    return res.sequences[:, ids.shape[1] :], [x.float() for x in res.logits]


def test_hf_generate_drop_in_follows_beam_search(monkeypatch):
    """HF's beam search reorders the cache's rows after each step (``reorder_cache``): the drop-in's rows, their
    states and storage, follow, so FKV and BM without an eviction give HF's own beams; the reorders were not the
    identity (without them the beams differ)."""
    from batchmax_tp.core import hf_cache

    model = tiny_arch("llama")
    ids, mask = left_padded_batch([20, 33, 40], seed=0)
    want, want_logits = hf_generate(model, ids, mask, 8, num_beams=3)
    orders, reorder = [], hf_cache.BatchMaxCache.reorder

    def reordering(self, index):
        orders.append(list(index))
        reorder(self, index)

    monkeypatch.setattr(hf_cache.BatchMaxCache, "reorder", reordering)
    for method in (Method("fkv"), Method("bm", kv_max=64, p=8)):
        got, got_logits = hf_generate(model, ids, mask, 8, BatchMaxCache(method), num_beams=3)
        assert_tokens_equal(got, want, what=f"drop-in {method.label()} vs HF beam search")
        assert_logits_close(got_logits, want_logits, ATOL, what=f"drop-in {method.label()} beam logits")
    assert any(order != list(range(len(order))) for order in orders)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_generate_drop_in(arch):
    model = tiny_arch(arch)
    ids, mask = left_padded_batch([20, 33, 40], seed=0)
    s, n = ids.shape[1], 12
    want, want_logits = hf_generate(model, ids, mask, n)
    # large kv_max: identical to plain HF generate
    got, got_logits = hf_generate(model, ids, mask, n, BatchMaxCache(Method("bm", kv_max=64, p=8)))
    assert_tokens_equal(got, want, what=f"{arch}: drop-in BM (no eviction) vs HF generate")
    assert_logits_close(got_logits, want_logits, ATOL, what=f"{arch}: drop-in BM (no eviction) logits")
    assert model.config._attn_implementation == "sdpa"  # restored
    # the full cache, its pool grown as HF's generate feeds it (the prompt, then twice its size)
    cache = BatchMaxCache(Method("fkv"))
    got, got_logits = hf_generate(model, ids, mask, n, cache)
    assert_tokens_equal(got, want, what=f"{arch}: drop-in FKV vs HF generate")
    assert_logits_close(got_logits, want_logits, ATOL, what=f"{arch}: drop-in FKV logits")
    held = [len(h) for h in cache.kept_positions()[0][0]]  # sample 0: its 20 tokens, then n - 1 fed
    assert cache.pool.capacity == 2 * s and held == [20 + n - 1] * COMMON["num_key_value_heads"]
    # small kv_max with chunked prefill: runs, evicts, stays bounded
    kv_max, p = 16, 4
    cache = BatchMaxCache(Method("bm", kv_max=kv_max, p=p))
    got, _ = hf_generate(model, ids, mask, n, cache, prefill_chunk_size=p)
    assert got.shape == (3, n)
    kept = cache.kept_positions()
    assert len(kept) == COMMON["num_hidden_layers"]
    for layer in kept:
        for j, heads in enumerate(layer):
            assert len(heads) == COMMON["num_key_value_heads"]
            for positions in heads:
                assert 0 < len(positions) <= kv_max < int(mask[j].sum()) + n - 1
                assert s + n - 2 in positions  # the newest fed token is held
    if arch != "phi3":  # fused qkv projection: outside the reference's module layout
        # kv_max a multiple of p: HF's p-chunked prefill is Algorithm 1, so the reference applies exactly
        ref = reference_generate(model, ids, mask, "bm", kv_max, p, n)
        assert ref.min_margin > 1e-4
        cache = BatchMaxCache(Method("bm", kv_max=kv_max, p=p))
        got, got_logits = hf_generate(model, ids, mask, n, cache, prefill_chunk_size=p)
        assert_logits_close(got_logits, ref.logits, ATOL, what=f"{arch}: drop-in BM vs reference")
        assert_tokens_equal(got, ref.tokens, what=f"{arch}: drop-in BM vs reference")
        assert_kept_equal(cache.kept_positions(), ref.kept, what=f"{arch}: drop-in BM kept vs reference")


@pytest.mark.parametrize("kv_max", [2, 5])
def test_hf_generate_drop_in_ed_keeps_what_algorithm_3_keeps(kv_max):
    """ED through HF generate with a chunked prefill: no eviction inside the prompt (Algorithm 3 prefills it
    whole), then exactly the engine's (and the reference's) kept pairs, tokens and logits."""
    model = tiny_arch("llama")
    ids, mask = left_padded_batch([20, 33, 40], seed=0)
    n = 12
    ref = reference_generate(model, ids, mask, "ed", kv_max, 64, n)
    cache = BatchMaxCache(Method("ed", kv_max=kv_max))
    got, got_logits = hf_generate(model, ids, mask, n, cache, prefill_chunk_size=8)
    assert_logits_close(got_logits, ref.logits, ATOL, what="drop-in ED vs reference")
    assert_tokens_equal(got, ref.tokens, what="drop-in ED vs reference")
    assert_kept_equal(cache.kept_positions(), ref.kept, what="drop-in ED kept vs reference")


def test_the_drop_in_refuses_to_run_outside_its_context_or_on_a_right_padded_batch():
    """Outside ``use_drop_in`` the cache would hand each block's pairs to another attention unseen: a one-line
    error; so is a batch padded on the right."""
    model = tiny_arch("llama")
    ids, mask = left_padded_batch([20, 33], seed=0)
    with pytest.raises(RuntimeError, match="use_drop_in") as err, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=BatchMaxCache(Method("fkv")), use_cache=True)
    assert "\n" not in str(err.value)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="LEFT-padded") as err:
        hf_generate(model, ids.flip(1), mask.flip(1), 2, BatchMaxCache(Method("fkv")))
    assert "\n" not in str(err.value)


def test_right_padded_batch_is_rejected_in_one_line():
    from batchmax_tp.bench.padded import generate

    model = tiny_arch("llama")
    ids, mask = left_padded_batch([20, 33], seed=0)
    right_ids, right_mask = ids.flip(1), mask.flip(1)  # the same samples, padded on the right
    for bad_mask in (right_mask, torch.cat([mask[:, :5], torch.zeros_like(mask[:, :1]), mask[:, 6:]], dim=1)):
        with pytest.raises(ValueError, match="LEFT-padded") as err:
            generate(model, right_ids, bad_mask, Method("bm", kv_max=16, p=4), 2)
        assert "\n" not in str(err.value)
    generate(model, ids, mask, Method("bm", kv_max=16, p=4), 2)  # the left-padded batch runs


# ------------------------------------------------------------------------------------------ KV memory
def test_bm_kv_bytes_bounded_and_independent_of_prompt_length():
    """A padded batch's K/V: B rows of kv_max slots + the scratch slot, per layer and KV head, held from the first
    pass to the last whatever the prompt length; FKV's grows with the prompt."""
    model = tiny_llama(0, **PEAKED)
    cfg = model.config
    kv_max, p, n, batch = 32, 8, 10, 2
    expected = batch * cfg.num_hidden_layers * cfg.num_key_value_heads * (kv_max + 1) * cfg.head_dim * 2 * 4
    for longest in (40, 120):
        ids, mask = left_padded_batch([longest - 7, longest], seed=longest)
        out = generate(model, ids, mask, Method("bm", kv_max=kv_max, p=p), n, ignore_eos=True)
        assert out.peak_kv_bytes == expected, (longest, out.peak_kv_bytes, expected)
        assert out.served.kv_bytes_range == (expected, expected)
    fkv = [
        generate(model, *left_padded_batch([m - 7, m], seed=m), Method("fkv"), n, ignore_eos=True).peak_kv_bytes
        for m in (40, 120)
    ]
    assert fkv[0] < fkv[1] and fkv[1] > expected


# ----------------------------------------------------------------------------------- padding invariance
def test_samples_alone_equal_batch_without_eviction():
    model = tiny_llama(0, **PEAKED)
    lengths = [37, 52, 60]
    ids, mask = left_padded_batch(lengths, seed=1)
    s, n = ids.shape[1], 10
    method = Method("bm", kv_max=s + n, p=8)
    batch = generate(model, ids, mask, method, n, ignore_eos=True, return_logits=True)
    for j, length in enumerate(lengths):
        alone_ids = ids[j : j + 1, s - length :]
        alone = generate(model, alone_ids, torch.ones_like(alone_ids), method, n, ignore_eos=True, return_logits=True)
        assert_tokens_equal(alone.tokens[0], batch.tokens[j], what=f"sample {j} alone vs in batch")
        assert_logits_close(
            [x[0] for x in alone.logits], [x[j] for x in batch.logits], ATOL, what=f"sample {j} alone vs in batch"
        )


def test_samples_alone_equal_batch_with_eviction():
    """BM evicting. The schedule follows the padded length and pads occupy slots (paper, section 3), so a
    row's result may depend on its own padding -- but never on the other rows: each row, run alone with its
    padding, equals its row in the batch; the unpadded longest row equals itself run unpadded."""
    model = tiny_llama(0, **PEAKED)
    lengths = [37, 52, 60]
    ids, mask = left_padded_batch(lengths, seed=1)
    n = 14
    method = Method("bm", kv_max=16, p=4)
    batch = generate(model, ids, mask, method, n, ignore_eos=True, return_logits=True)
    kept = batch.kept_positions()
    assert all(len(h) < min(lengths) for layer in kept for row in layer for h in row)  # evicted
    for j in range(len(lengths)):
        alone = generate(model, ids[j : j + 1], mask[j : j + 1], method, n, ignore_eos=True, return_logits=True)
        assert_tokens_equal(alone.tokens[0], batch.tokens[j], what=f"row {j} alone vs in batch")
        assert_logits_close(
            [x[0] for x in alone.logits], [x[j] for x in batch.logits], ATOL, what=f"row {j} alone vs in batch"
        )
        assert_kept_equal(
            [[layer[0]] for layer in alone.kept_positions()],
            [[layer[j]] for layer in kept],
            what=f"row {j} alone vs in batch",
        )
    assert mask[2].all()  # the longest row has no pads


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "args,kwargs",
    [
        (("bm",), dict(kv_max=16, p=0)),
        (("bm",), dict(kv_max=16, p=-3)),
        (("bm",), dict(kv_max=4, p=4)),
        (("bm",), dict(kv_max=3, p=4)),
        (("ed",), dict(kv_max=1)),
        (("ed",), dict(kv_max=0)),
        (("h2o",), dict(kv_max=16, p=4)),
        (("",), dict()),
    ],
)
def test_method_validation(args, kwargs):
    with pytest.raises(ValueError) as err:
        Method(*args, **kwargs)
    msg = str(err.value)
    assert msg and "\n" not in msg.strip()


def test_valid_methods():
    assert Method("bm", kv_max=5, p=4).kv_max == 5
    assert type(Method("ed", kv_max=2)) is ExtremeDecoding and Method("ed", kv_max=2).name == ExtremeDecoding.name
    assert type(Method("fkv")) is FullCache and Method("fkv").name == FullCache.name
