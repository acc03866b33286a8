"""Shared helpers for the reference / core tests (tiny models, padded batches, precise comparisons)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers loads (tiny.py imports it)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # so tests can `import reference`, `import tiny`
from tiny import PEAKED, tiny_llama, tiny_random_model  # noqa: E402, F401 (PEAKED, tiny_llama: for the tests)

pytest_plugins = ["require_deps"]  # under scripts/test.sh a test skipped for a missing dependency fails the run

# Tiny tensors: one intra-op thread is as fast, deterministic, and immune to oversubscription on a busy
# 2-core box (where 2 spinning OpenMP threads made the embedded-model test ~20x slower).
torch.set_num_threads(int(os.environ.get("BATCHMAX_TEST_THREADS", "1")))


def left_padded_batch(lengths, vocab: int = 128, seed: int = 0, low: int = 3):
    """Random token ids (avoiding pad/bos/eos 0/1/2), LEFT-padded with 0 to the longest length."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.long)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for j, n in enumerate(lengths):
        ids[j, s - n :] = torch.randint(low, vocab, (n,), generator=g)
        mask[j, s - n :] = 1
    return ids, mask


def hf_full_cache_logits(model, input_ids, attention_mask, continuation):
    """Teacher-forced logits of HF's own full forward: prompt + continuation[:, :-1].

    Returns a list (one per generated token) of float32 [B, V]: the logits at the last prompt token, then at
    each continuation token.  Position ids follow HF generate (cumsum(mask)-1)."""
    from reference import hf_position_ids

    bsz, s = input_ids.shape
    n = continuation.shape[1]
    full = torch.cat([input_ids, continuation[:, : n - 1]], dim=1)
    mask = torch.cat([attention_mask, torch.ones(bsz, n - 1, dtype=attention_mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(full, attention_mask=mask, position_ids=hf_position_ids(mask)).logits.float()
    return [logits[:, s - 1 + t] for t in range(n)]


def assert_logits_close(got, want, atol=1e-4, what="logits"):
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)}"
    for t, (a, b) in enumerate(zip(got, want)):
        a = a.detach().float().cpu()
        b = b.detach().float().cpu()
        assert a.shape == b.shape, f"{what}: step {t}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        err = (a - b).abs().amax(dim=-1)
        if not bool((err <= atol).all()):
            j = int(err.argmax())
            raise AssertionError(
                f"{what}: first diverging step {t} (sample {j}): max |diff| {float(err[j]):.3g} > {atol}; "
                f"per-sample max diff {[round(float(e), 6) for e in err]}"
            )


def assert_tokens_equal(got, want, what="tokens"):
    got = got.cpu()
    want = want.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if not torch.equal(got, want):
        diff = (got != want).nonzero().tolist()
        j, t = diff[0]
        raise AssertionError(
            f"{what}: first mismatch sample {j} step {t}: got {got[j].tolist()} want {want[j].tolist()}"
        )


def assert_kept_equal(got, want, what="kept positions"):
    """got/want: [layer][sample][kv_head] -> sorted list[int]."""
    assert len(got) == len(want), f"{what}: {len(got)} layers vs {len(want)}"
    problems = []
    for layer, (gl, wl) in enumerate(zip(got, want)):
        assert len(gl) == len(wl), f"{what}: layer {layer}: {len(gl)} samples vs {len(wl)}"
        for j, (gs, ws) in enumerate(zip(gl, wl)):
            assert len(gs) == len(ws), f"{what}: layer {layer} sample {j}: {len(gs)} kv heads vs {len(ws)}"
            for h, (g, w) in enumerate(zip(gs, ws)):
                g = [int(x) for x in g]
                if g != list(w):
                    problems.append(
                        f"layer {layer} sample {j} kv_head {h}: only fast {sorted(set(g) - set(w))}, "
                        f"only reference {sorted(set(w) - set(g))} (fast {len(g)} kept, reference {len(w)})"
                    )
    if problems:
        raise AssertionError(f"{what}: {len(problems)} (layer, sample, head) differ; first: " + "; ".join(problems[:4]))


#: Tensor parallelism over processes (``parallel.init_distributed``) needs DeepSpeed, which the GPU machine lacks.
requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (tensor parallelism across processes)"
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU (skipped without one); run with -m cuda on a GPU machine"
    )
    config.addinivalue_line("markers", "xdist_group(name): run with the other tests of the group on one worker")


#: The modules whose tests start processes (launchers, nodes, ranks, jobs): under ``pytest -n 2 --dist loadgroup``
#: (``scripts/test.sh``) they run one after another on one worker, so that no two of them share the 2 cores (their
#: watchdog and set-up bounds are in seconds), while the other worker runs the in-process tests.
PROCESS_MODULES = ("test_launchers", "test_replicas", "test_harness", "test_tp", "test_scripts", "test_validation")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group from the marker (else: no group at all)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama (the embedded tokenizer's vocabulary) saved with that tokenizer."""
    from transformers import AutoTokenizer

    from batchmax_tp.models import embedded_model_dir

    folder = tmp_path_factory.mktemp("tiny-lm")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = tiny_random_model(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **PEAKED,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer, prepared as ``load_model`` prepares it (left padding, a pad token)."""
    from transformers import AutoTokenizer

    from batchmax_tp.models import _prepare_tokenizer, embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    _prepare_tokenizer(tok)
    return tok


@pytest.fixture(scope="session")
def embedded():
    """The embedded model and its tokenizer (float32, CPU), loaded once for the whole suite."""
    from batchmax_tp.models import load_model

    return load_model()


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama (seed 0)."""
    return tiny_llama(seed=0)


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: a configuration that is refused loads no weights."""
    import batchmax_tp.models as models

    def boom(*args, **kwargs):
        raise AssertionError("no model may load for a configuration that is refused")

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(models, "architecture_model", boom)
