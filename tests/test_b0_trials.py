"""The paper procedure's b0 trials (``eval.procedures.b0_trials``): the trial batch for b is the task's b longest
prompts, left-padded together, and a trial runs under ``memory_budget`` (CUDA simulated: no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from batchmax_tp.config import RunConfig
from batchmax_tp.core.method import ExtremeDecoding
from batchmax_tp.eval import procedures
from batchmax_tp.eval.generation import encode_prompts
from batchmax_tp.eval.oom import RankOutOfMemory
from batchmax_tp.eval.tasks import Sample, prompt_ids
from batchmax_tp.models import _prepare_tokenizer, embedded_model_dir


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    _prepare_tokenizer(tok)
    return tok


# Five prompts of clearly different lengths, not in length order.
SAMPLES = [Sample(f"s{i}", "word " * n + "?") for i, n in enumerate([3, 40, 12, 25, 7])]
BY_LENGTH = ["s1", "s3", "s2", "s4", "s0"]  # longest first


class Recorder:
    """A generate function that records what it gets and succeeds (the peak is simulated separately)."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, model, input_ids, attention_mask, method, max_new_tokens, **kw):
        assert method == ExtremeDecoding(kv_max=2, p=method.p) and max_new_tokens == 2
        self.calls.append((input_ids, attention_mask))
        return SimpleNamespace()


def test_b0_trial_batch_is_the_b_longest_prompts_left_padded(tokenizer, tmp_path):
    cfg = RunConfig(out=str(tmp_path), memory_budget=None)
    gen = Recorder()
    fits = procedures.b0_trials(SimpleNamespace(device=torch.device("cpu")), tokenizer, SAMPLES, cfg, generate_fn=gen)
    lengths = {s.id: len(prompt_ids(tokenizer, s.prompt)) for s in SAMPLES}
    prompt_of = {s.id: s.prompt for s in SAMPLES}
    for b in (1, 3, 5, 7):
        assert fits(b)
        ids, mask = gen.calls[-1]
        want = [BY_LENGTH[k % len(BY_LENGTH)] for k in range(b)]  # cycled past the 5 samples
        assert ids.shape == mask.shape == (b, lengths["s1"])  # padded to the longest prompt
        assert mask.sum(-1).tolist() == [lengths[i] for i in want]  # the real lengths
        expect_ids, expect_mask = encode_prompts(tokenizer, [prompt_of[i] for i in want])
        assert torch.equal(ids, expect_ids) and torch.equal(mask, expect_mask)
        if b > 1:  # left padding: the shorter rows start with pads, every row ends with a real token
            shorter = torch.tensor([lengths[i] < lengths["s1"] for i in want])
            assert shorter.any() and (mask[:, -1] == 1).all() and (mask[shorter, 0] == 0).all()
            assert (ids[mask == 0] == tokenizer.pad_token_id).all()
    assert len(gen.calls) == 4
    assert fits(3) and len(gen.calls) == 4  # a verdict kept in OUT/b0-trials is not asked again


class FakeCuda:
    """torch.cuda's peak counter, simulated: a trial's peak is ``per_row`` bytes per batch row plus ``base``."""

    def __init__(self, monkeypatch, per_row: int, base: int = 1000):
        self.per_row, self.base, self.peak, self.resets = per_row, base, 0, 0
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def reset(self, device=None):
        self.resets += 1
        self.peak = self.base  # what stays allocated (weights)

    def generate(self, model, input_ids, attention_mask, method, max_new_tokens, **kw):
        self.peak = max(self.peak, self.base + self.per_row * input_ids.shape[0])
        return SimpleNamespace()


class OnCuda:
    """A tensor as if already on the (simulated) GPU: ``.to(device)`` keeps it."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape = t, t.shape

    def to(self, device):
        return self


def _cuda_encode(tokenizer, prompts):
    return tuple(OnCuda(t) for t in encode_prompts(tokenizer, prompts))


@pytest.mark.parametrize("world", [1, 2])
def test_b0_trial_over_the_memory_budget_does_not_fit(tokenizer, tmp_path, monkeypatch, world):
    gpu = FakeCuda(monkeypatch, per_row=1000)
    model = SimpleNamespace(device=torch.device("cuda", 0))
    kw = {"generate_fn": gpu.generate, "encode_fn": _cuda_encode, "world": world}

    # Without a budget the whole (simulated) GPU is there: b = 4 (peak 5000 bytes) fits.
    free = procedures.b0_trials(model, tokenizer, SAMPLES, RunConfig(out=str(tmp_path / "free")), **kw)
    assert free(4) and free(3)

    # The same trials under a 4500-byte budget: b = 3 (4000) fits, b = 4 (5000) is over it, as if out of memory.
    cfg = RunConfig(out=str(tmp_path / "budget"), memory_budget=4500)
    fits = procedures.b0_trials(model, tokenizer, SAMPLES, cfg, **kw)
    assert fits(3)
    resets = gpu.resets
    if world == 1:
        assert not fits(4)
    else:  # a rank cannot tell its peers: marker + RankOutOfMemory, as for an out-of-memory error
        with pytest.raises(RankOutOfMemory, match="over the memory budget"):
            fits(4)
    assert gpu.resets == resets + 1  # the peak is measured from a reset before each trial
    markers = list((tmp_path / "budget" / "b0-trials").glob("oom-b4-rank*.json"))
    assert len(markers) == 1 and "over the memory budget" in markers[0].read_text()
    # Resumed: the verdict is read back, not run again; a marker outranks a fits file rank 0 may have written.
    (tmp_path / "budget" / "b0-trials" / "fits-b4.json").write_text('{"batch": 4, "fits": true}\n')
    again = procedures.b0_trials(model, tokenizer, SAMPLES, cfg, **kw)
    assert not again(4) and again(3) and gpu.resets == resets + 1
