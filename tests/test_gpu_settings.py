"""Settings users get right the first time on their GPUs, checked before any weights load: the dtype each rank runs
in (its own GPU's compute capability, simulated), models Batch-Max cannot run exactly, and a memory budget that
cannot hold the model."""

from __future__ import annotations

import importlib.util
import logging
import re

import pytest
import torch
from tiny import tiny_random_model
from transformers import AutoConfig

from batchmax_tp import cli, models
from batchmax_tp.bench.padded import generate
from batchmax_tp.core import products
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method
from batchmax_tp.core.requests import Record, Request, Sampling


def fake_gpus(monkeypatch, capabilities: dict[int, tuple[int, int]], current: int = 0) -> None:
    """CUDA devices ``index -> compute capability``; ``is_bf16_supported`` says yes as it does on a V100 (emulation)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capabilities[int(device)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU{int(device)}")


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float32", None, "float16"])
@pytest.mark.parametrize("capability", [(7, 0), (8, 0), (9, 0)])
def test_auto_dtype_is_bfloat16_only_on_gpus_that_have_it(monkeypatch, capability, checkpoint):
    fake_gpus(monkeypatch, {0: capability})
    config = AutoConfig.for_model("llama", dtype=checkpoint) if checkpoint else AutoConfig.for_model("llama")
    expected = "float16" if checkpoint == "float16" or capability < (8, 0) else "bfloat16"
    assert models.resolve_dtype("auto", "cuda", config) == expected
    assert models.resolve_dtype("auto", "cpu", config) == "float32"


def test_auto_dtype_asks_the_ranks_own_gpu(monkeypatch):
    """A rank on cuda:1 (a TITAN V next to an H100 that is the current device) runs float16."""
    fake_gpus(monkeypatch, {0: (9, 0), 1: (7, 0)}, current=0)
    config = AutoConfig.for_model("llama", dtype="bfloat16")
    assert models.resolve_dtype("auto", "cuda:1", config) == "float16"
    assert models.resolve_dtype("auto", "cuda:0", config) == "bfloat16"


def test_explicit_bfloat16_on_a_gpu_without_it_is_one_line(monkeypatch, tmp_path, capsys, no_model_load):
    fake_gpus(monkeypatch, {0: (7, 0)})
    out = tmp_path / "out"
    assert cli.main(["--device", "cuda", "--dtype", "bfloat16", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: dtype: bfloat16 needs a GPU of compute capability 8.0")
    assert "compute capability 7.0" in err and not out.exists()
    fake_gpus(monkeypatch, {0: (8, 0)})
    assert models.resolve_dtype("bfloat16", "cuda", None) == "bfloat16"
    assert models.resolve_dtype("float16", "cuda", None) == "float16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("cpu, machine", [("AVX2", "x86_64"), ("AVX512", "x86_64"), ("DEFAULT", "aarch64")])
def test_half_dtypes_on_a_cpu_without_avx512_say_so_in_one_line(monkeypatch, caplog, dtype, cpu, machine):
    """bfloat16 / float16 products on an AVX2 CPU take torch's generic path (~100x slower than float32, measured
    2026-12-03): the dtype is kept, with one line saying the engine runs its products in float32; none for float32,
    AVX-512 or another architecture."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu)
    monkeypatch.setattr(products.platform, "machine", lambda: machine)
    models._half_products_note.cache_clear()
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        assert models.resolve_dtype(dtype, "cpu", None) == dtype
        assert models.resolve_dtype(dtype, "cpu", None) == dtype  # said once a process
        assert models.resolve_dtype("auto", "cpu", None) == "float32"
    warned = [r.getMessage() for r in caplog.records if r.name == models.__name__]
    slow = dtype != "float32" and cpu == "AVX2"
    assert (products.slow_half_products(getattr(torch, dtype), "cpu") == "AVX2") is slow
    assert products.slow_half_products(getattr(torch, dtype), "cuda:0") is None
    if slow:
        assert len(warned) == 1 and warned[0].startswith(f"{dtype} on this CPU (torch kernels AVX2: no AVX-512)")
        assert "\n" not in warned[0] and f"products in float32, rounded to {dtype}" in warned[0]
    else:
        assert warned == []


@pytest.mark.parametrize("method", [Method("bm", 24, 8), Method("fkv", chunk=16)], ids=str)
def test_half_products_on_an_avx2_cpu_run_in_float32_with_torchs_own_answers(monkeypatch, method):
    """On an AVX2 CPU the engine runs a bfloat16 model's products in float32, rounded to bfloat16 once (the generic
    kernel's arithmetic, in float32's fast kernels): every product of the run goes that way, and the tokens and
    logits equal those of torch's own bfloat16 products (the same run with the capability reported as AVX-512), up to a
    few roundings (the float32 sums' order differs). Snap is left out: on this tiny model its bfloat16 scores tie, and
    a one-rounding difference picks another pair (as it would between two CPUs' own kernels)."""
    model = tiny_random_model("qwen2", initializer_range=0.2).to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    requests = [Request(torch.randint(3, 128, (n,), generator=g).tolist(), 6) for n in (20, 57, 41)]
    widened = []
    own = products.Float32Products.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        if (func in products.PRODUCTS or func is products.ATTENTION) and args[0].dtype == torch.bfloat16:
            widened.append(func)
        return own(self, func, types, args, kwargs)

    monkeypatch.setattr(products.Float32Products, "__torch_dispatch__", counted)
    monkeypatch.setattr(products.platform, "machine", lambda: "x86_64")
    runs = {}
    for cpu in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda cpu=cpu: cpu)
        runs[cpu] = Engine(model, method, 2).run(requests, Sampling(ignore_eos=True), record=Record(logits=True))
        if cpu == "AVX512":
            assert widened == []  # torch's own kernels: the engine leaves them alone
    assert len(widened) > 100  # every linear layer's product, each pass
    for own_out, wide_out in zip(runs["AVX512"].outputs, runs["AVX2"].outputs):
        assert wide_out.tokens == own_out.tokens
        for a, b in zip(own_out.logits, wide_out.logits):
            torch.testing.assert_close(b.float(), a.float(), atol=0.03 * a.float().abs().max().item(), rtol=0)


def test_float32_products_widen_a_weight_once_and_round_each_product_once():
    """A weight's views are widened once a mode (the pass after reads the kept copy); activations each time; each
    product is float32's, rounded to the half dtype once; float32 operands are left alone."""
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32, generator=g).to(torch.bfloat16), requires_grad=False)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    xs = [torch.randn(5, 32, generator=g).to(torch.bfloat16) for _ in range(3)]
    mode = products.Float32Products([w])
    with mode:
        got = [torch.nn.functional.linear(x, w, b) for x in xs]
        plain = torch.randn(4, 32) @ torch.randn(32, 6)
    assert len(mode.widened) == 1 and next(iter(mode.widened.values())).dtype == torch.float32
    assert plain.dtype == torch.float32
    for x, y in zip(xs, got):
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, torch.nn.functional.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))


UNSUPPORTED = {
    "phi-3-mini-4k": (
        dict(model_type="phi3", sliding_window=2047, max_position_embeddings=4096),
        "sliding_window=2047",
    ),
    "mistral-v0.1": (
        dict(model_type="mistral", sliding_window=4096, max_position_embeddings=32768),
        "sliding_window=4096",
    ),
    "gemma-2": (dict(model_type="gemma2"), "attn_logit_softcapping=50.0"),
    "qwen2-sliding": (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=1), "sliding_window=4096"),
}
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_models_batchmax_cannot_run_exactly_are_refused_before_weights(name, tmp_path, capsys, no_model_load):
    """A checkpoint folder with only its config.json: the run stops at the configuration, naming the setting."""
    fields, setting = UNSUPPORTED[name]
    fields = dict(fields)
    AutoConfig.for_model(fields.pop("model_type"), **TINY, **fields).save_pretrained(tmp_path / name)
    out = tmp_path / "out"
    assert cli.main(["--model", str(tmp_path / name), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: model: ") and setting in err, err
    assert not out.exists()
    if importlib.util.find_spec("lm_eval") is None:  # the GPU machine has no lm-eval: the rest of this module runs
        pytest.skip("lm_eval is not installed (the GPU machine's package set): the harness's refusal is not checked")
    from batchmax_tp.harness import BatchMaxLM, ModelArgsError, Settings

    with pytest.raises(ModelArgsError, match=setting):
        BatchMaxLM._read_config(Settings.parse({"pretrained": str(tmp_path / name)}))


def test_a_model_built_in_code_with_a_sliding_window_is_refused_by_the_engine():
    model = tiny_random_model("mistral", sliding_window=8)
    ids = torch.ones(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="sliding_window=8"):
        generate(model, ids, torch.ones_like(ids), Method("bm", kv_max=8, p=4), 2, ignore_eos=True)


def test_phi_3_5_mini_keeps_working(tmp_path):
    """Phi-3.5-mini's window (262144) is longer than its context (131072): it never hides a key, so the model runs,
    and BM with room for everything equals FKV."""
    long_window = dict(sliding_window=262144, max_position_embeddings=131072)
    AutoConfig.for_model("phi3", **TINY, **long_window).save_pretrained(tmp_path / "phi35")
    assert models.read_config(str(tmp_path / "phi35")).sliding_window == 262144
    model = tiny_random_model("phi3", **long_window)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    fkv = generate(model, ids, mask, Method("fkv"), 6, ignore_eos=True)
    bm = generate(model, ids, mask, Method("bm", kv_max=64, p=4), 6, ignore_eos=True)
    assert torch.equal(bm.tokens, fkv.tokens)


def test_a_budget_below_the_weights_is_one_line_naming_both_figures(tmp_path, capsys, no_model_load):
    out = tmp_path / "out"
    assert cli.main(["--memory-budget", "1KB", "--same-memory", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert re.match(r"error: memory_budget: 1000 bytes per rank is below the 51\d\.\d MiB that ", captured.err)
    assert "513.1 MiB of it weights" in captured.err and not out.exists()
