"""The lm-eval model ``batchmax`` (``batchmax_tp.harness``) against lm-eval's own ``hf`` model, the naive reference,
and itself at other batch sizes; its command line, its errors and its parallel runs.

A tiny random Llama with the embedded model's tokenizer (saved once per session) keeps every run fast; one test
runs the embedded model itself against ``hf``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from conftest import PEAKED  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import CachingLM  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from multiproc import (  # noqa: E402
    CHILDREN_PY,
    LOSE_AFTER_S,
    free_port,
    lm_eval_cli,
    lose_node_1,
    tool,
    torchrun_nodes,
)
from reference import reference_generate  # noqa: E402

from batchmax_tp import harness, models  # noqa: E402
from batchmax_tp.harness import BatchMaxLM, ModelArgsError  # noqa: E402
from batchmax_tp.plan.planner import predict_pool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASKS = str(ROOT / "configs" / "lm_eval")
CONTEXTS = [
    "The keeper of the lighthouse had a small brown dog called Pepper, who arrived one stormy night. " * 3
    + "Question: what was the dog called? Answer:",
    "Rotterdam is a port city. The professor moved there last spring, after many years abroad. "
    "Question: where did the professor move? Answer:",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen. " * 2
    + "What comes after sixteen?",
]
CHOICES = [[" Pepper", " Rex the dog", " Max"], [" Rotterdam", " the city of Lyon"], [" seventeen", " eighteen"]]


def ll_requests(contexts=CONTEXTS, choices=CHOICES) -> list[Instance]:
    return [Instance("loglikelihood", {}, (c, x), i) for i, (c, xs) in enumerate(zip(contexts, choices)) for x in xs]


def gen_requests() -> list[Instance]:
    kwargs = [
        {"until": ["."], "max_gen_toks": 12},
        {"until": ["\n", "the"], "max_gen_toks": 9},
        {"until": ["."], "max_gen_toks": 12},
    ]
    return [Instance("generate_until", {}, (c, k), i) for i, (c, k) in enumerate(zip(CONTEXTS, kwargs))]


def assert_scores_close(got, want, atol=1e-4):
    assert len(got) == len(want)
    for i, ((a, ga), (b, gb)) in enumerate(zip(got, want)):
        assert abs(a - b) <= atol, f"request {i}: {a} != {b}"
        assert ga == gb, f"request {i}: is_greedy {ga} != {gb}"


# -- against lm-eval's own hf model -------------------------------------------------------------------------------
def test_fkv_equals_lm_eval_hf_model_on_the_bundled_tasks(tiny_dir, monkeypatch):
    """Per-request loglikelihoods (within 1e-4, same is_greedy) and generated texts of the two bundled tasks, run by
    lm-eval's evaluator with log_samples, equal those of ``--model hf``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    tasks = ["batchmax_needle_mc", "batchmax_passkey"]
    runs = {}
    for name, lm in (
        ("hf", HFLM(pretrained=tiny_dir, device="cpu", dtype="float32", batch_size=4)),
        ("batchmax", BatchMaxLM(pretrained=tiny_dir, method="fkv", batch_size=4)),
    ):
        out = simple_evaluate(
            model=lm,
            tasks=tasks,
            limit=2,
            log_samples=True,
            task_manager=TaskManager(include_path=TASKS, include_defaults=False),
        )
        runs[name] = {t: [s["resps"] for s in out["samples"][t]] for t in tasks}
    mc_hf, mc_bm = runs["hf"]["batchmax_needle_mc"], runs["batchmax"]["batchmax_needle_mc"]
    assert len(mc_hf) == 2 and len(mc_hf[0]) == 4
    for doc_hf, doc_bm in zip(mc_hf, mc_bm):
        assert_scores_close([tuple(r[0]) for r in doc_bm], [tuple(r[0]) for r in doc_hf])
    assert runs["batchmax"]["batchmax_passkey"] == runs["hf"]["batchmax_passkey"]


def test_embedded_model_fkv_equals_hf():
    """The embedded SmolLM2: loglikelihoods and greedy texts of ``method=fkv`` equal ``--model hf``."""
    ours = BatchMaxLM(method="fkv", batch_size=3)
    theirs = HFLM(pretrained=ours.model, tokenizer=ours.tokenizer, device="cpu", batch_size=3)
    assert_scores_close(ours.loglikelihood(ll_requests()), theirs.loglikelihood(ll_requests()))
    assert ours.generate_until(gen_requests()) == theirs.generate_until(gen_requests())


def test_fkv_rolling_loglikelihood_equals_hf(tiny_dir):
    """lm-eval's rolling windows (max_length 24: several windows per text) score as ``hf`` scores them."""
    reqs = [Instance("loglikelihood_rolling", {}, (c,), i) for i, c in enumerate(CONTEXTS)]
    ours = BatchMaxLM(pretrained=tiny_dir, method="fkv", batch_size=4, max_length=24)
    theirs = HFLM(pretrained=tiny_dir, device="cpu", dtype="float32", batch_size=4, max_length=24)
    got, want = ours.loglikelihood_rolling(reqs), theirs.loglikelihood_rolling(reqs)
    assert len(ours.tok_encode(CONTEXTS[0])) > 2 * 24
    assert got == pytest.approx(want, abs=1e-3)


# -- Batch-Max's scores --------------------------------------------------------------------------------------------
def test_bm_with_room_for_every_prompt_equals_fkv(tiny_dir):
    fkv = BatchMaxLM(pretrained=tiny_dir, method="fkv", batch_size=4)
    bm = BatchMaxLM(pretrained=tiny_dir, method="bm", kv_max=256, p=16, batch_size=4)
    assert max(len(fkv.tok_encode(c)) for c in CONTEXTS) + 8 < 256
    assert_scores_close(bm.loglikelihood(ll_requests()), fkv.loglikelihood(ll_requests()))
    assert bm.generate_until(gen_requests()) == fkv.generate_until(gen_requests())


def test_bm_small_kv_max_scores_equal_the_naive_reference_and_differ_from_fkv(tiny_dir):
    """kv_max 24, p 8: the context is prefilled with eviction and the continuation teacher-forced through the
    bounded cache; each score equals the naive reference run token by token (forced), and eviction moves it."""
    bm = BatchMaxLM(pretrained=tiny_dir, method="bm", kv_max=24, p=8, batch_size=4)
    fkv = BatchMaxLM(pretrained=tiny_dir, method="fkv", batch_size=4)
    reqs = ll_requests()
    got, full = bm.loglikelihood(reqs), fkv.loglikelihood(reqs)
    moved = 0
    for (context, continuation), (score, greedy), (full_score, _) in zip((r.args for r in reqs), got, full):
        ctx, cont = bm._encode_pair(context, continuation)
        assert len(ctx) > 24
        ref = reference_generate(
            bm.model,
            torch.tensor([ctx]),
            torch.ones(1, len(ctx), dtype=torch.long),
            "bm",
            kv_max=24,
            p=8,
            max_new_tokens=len(cont),
            force_tokens=torch.tensor([cont]),
        )
        want = sum(float(torch.log_softmax(ref.logits[t][0], -1)[c]) for t, c in enumerate(cont))
        assert score == pytest.approx(want, abs=1e-4)
        assert greedy == (ref.tokens[0].tolist() == cont)
        moved += abs(score - full_score) > 1e-3
    assert moved >= len(reqs) // 2, "eviction did not reach the scores"


@pytest.mark.parametrize("method", ["bm", "ed", "fkv"])
def test_batch_sizes_1_and_8_give_the_same_results_in_request_order(tiny_dir, method):
    """Batch 8 shares each context's prefill between its choices and runs requests side by side; batch 1 runs
    each alone. Results are the same, in request order (a reversed request list gives reversed results)."""
    args = {"bm": dict(kv_max=24, p=8), "ed": dict(kv_max=6), "fkv": {}}[method]
    one = BatchMaxLM(pretrained=tiny_dir, method=method, batch_size=1, **args)
    eight = BatchMaxLM(pretrained=tiny_dir, method=method, batch_size=8, **args)
    reqs = ll_requests()
    got1, got8 = one.loglikelihood(reqs), eight.loglikelihood(reqs)
    assert_scores_close(got8, got1, atol=1e-5)
    assert_scores_close(eight.loglikelihood(reqs[::-1]), got8[::-1], atol=1e-5)
    gens = gen_requests()
    texts = one.generate_until(gens)
    assert eight.generate_until(gens) == texts
    assert eight.generate_until(gens[::-1]) == texts[::-1]
    assert not any("." in t for t in texts)  # cut at the stop string


def test_batch_size_auto_fits_the_budget_for_the_longest_request(tiny_dir):
    lm = BatchMaxLM(pretrained=tiny_dir, method="bm", kv_max=24, p=8, batch_size="auto", memory_budget="1GB")
    reqs = ll_requests()
    pairs = [lm._encode_pair(*r.args) for r in reqs]
    longest, new = max(len(c) for c, _ in pairs), max(len(x) for _, x in pairs)
    fits = lambda n: predict_pool(lm.shape, lm.method, n, longest, new, dtype="float32").total  # noqa: E731
    budget = fits(3) + 1  # room for 3 slots of the longest real request, not for 4
    lm.settings = harness.Settings.parse(
        {
            "pretrained": tiny_dir,
            "method": "bm",
            "kv_max": 24,
            "p": 8,
            "batch_size": "auto",
            "memory_budget": str(budget),
        }
    )
    lm.loglikelihood(reqs)
    assert lm.batch_sizes[0] == 3 and fits(4) > budget
    assert lm.get_model_info()["batchmax"]["slots"] == 3


# -- model_args, the cache, the command line ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, key",
    [
        ({"method": "xyz"}, "method"),
        ({"kv_max": 10, "p": 64}, "kv_max"),
        ({"rule": "nope"}, "rule"),
        ({"batch_size": "many"}, "batch_size"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"dtype": "int3"}, "dtype"),
        ({"kv_maxx": 3}, "kv_maxx"),
        ({"batch_size": "auto"}, "memory_budget"),
        ({"pretrained": "/no/such/model"}, "pretrained"),
    ],
)
def test_bad_model_args_are_one_line_before_any_load(monkeypatch, args, key):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    with pytest.raises(ModelArgsError) as err:
        BatchMaxLM(**args)
    message = str(err.value)
    assert "\n" not in message and message.startswith("model_args: ") and key in message


def test_use_cache_files_never_mix_methods(tiny_dir, tmp_path):
    paths = {m: harness.cache_path(str(tmp_path / "c"), f"method={m}") for m in ("fkv", "ed", "bm")}
    assert len(set(paths.values())) == 3
    assert harness.cache_path("c", "method=bm,kv_max=256") != harness.cache_path("c", "method=bm,kv_max=128")
    lm = BatchMaxLM(pretrained=tiny_dir, method="fkv")
    with pytest.raises(ModelArgsError, match="use_cache"):
        CachingLM(lm, str(tmp_path / "plain_rank0.db"))
    fingerprint = lm.settings.fingerprint()
    cached = CachingLM(lm, str(tmp_path / f"cache.{fingerprint}_rank0.db"))
    assert cached.loglikelihood(ll_requests()[:2]) == lm.loglikelihood(ll_requests()[:2])
    argv = ["--model", "batchmax", "--model_args", "method=ed,kv_max=65", "--use_cache", "x/y"]
    assert harness._rewrite_use_cache(argv)[-1] == harness.cache_path("x/y", "method=ed,kv_max=65")


def test_console_script_runs_a_bundled_task_and_keeps_hf(tiny_dir, tmp_path):
    """The documented command (``batchmax-lm-eval ...``) from the repository root writes lm-eval's
    results JSON with the method in its config; lm-eval's own models stay registered beside ours."""
    out = tmp_path / "out"
    done = lm_eval_cli(
        "--model",
        "batchmax",
        "--model_args",
        f"pretrained={tiny_dir},method=bm,kv_max=256",
        "--tasks",
        "batchmax_needle_mc",
        "--include_path",
        "configs/lm_eval",
        "--limit",
        "2",
        "--output_path",
        str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert results["config"]["method"] == "bm" and results["config"]["kv_max"] == 256
    assert "acc,none" in results["results"]["batchmax_needle_mc"]
    from lm_eval.api.registry import get_model

    assert get_model("batchmax") is BatchMaxLM and get_model("hf") is HFLM


def test_console_script_bad_model_args_exit_2_with_one_line():
    done = lm_eval_cli(
        "--model",
        "batchmax",
        "--model_args",
        "method=bm,kv_max=32,p=64",
        "--tasks",
        "batchmax_passkey",
        "--include_path",
        "configs/lm_eval",
    )
    assert done.returncode == 2
    lines = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "kv_max" in lines[0], done.stderr[-2000:]


# -- tensor parallel and replicas ---------------------------------------------------------------------------------
_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_dir):
    """The lm-eval worker's (``children.lm_eval_worker``) single-process results."""
    single = tmp_path_factory.mktemp("harness-tp") / "single.json"
    subprocess.run(
        [sys.executable, CHILDREN_PY, "lm_eval_worker", tiny_dir, "1", str(single)],
        cwd=ROOT,
        env=_ENV,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return single


@pytest.mark.parametrize("tp", [2, 1])
def test_tp_and_replicas_give_the_results_of_one_process(tiny_dir, tmp_path, worker, tp):
    """2 processes: tp 2 (one replica, heads split) or tp 1 (two replicas splitting the documents). Only one
    process reports, and its per-document results equal a single process's."""
    single = worker
    multi = tmp_path / "multi.json"
    env = _ENV
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            CHILDREN_PY,
            "lm_eval_worker",
            tiny_dir,
            str(tp),
            str(multi),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = json.loads(multi.read_text()), json.loads(single.read_text())
    assert got.keys() == want.keys()
    for task in want:
        assert [d for d, _ in got[task]] == [d for d, _ in want[task]]
        for (_, a), (_, b) in zip(got[task], want[task]):  # [0]: lm-eval pads a short replica with repeats
            if task == "batchmax_passkey":
                assert [x[0] for x in a] == [x[0] for x in b]
            else:
                assert_scores_close([tuple(x[0]) for x in a], [tuple(x[0]) for x in b])


@pytest.mark.parametrize(
    "stage, lose", [("load", "stop"), ("setup", "kill")], ids=["load-worker-stopped", "setup-node-killed"]
)
def test_a_replica_lost_while_starting_ends_the_other_lm_eval_replica(tmp_path, tiny_dir, stage, lose):
    """Two replicas of the lm-eval model on two torchrun "nodes"; node 1 lost while it loads (its worker stopped:
    hung, or its node lost with its sockets open) or inside the first process-group set-up (its agent and worker
    killed). The other replica waits for it (a gloo collective or the rendezvous: up to 30 minutes); its watchdog,
    started before anything waits (``replicas.watch_from_start``), ends it naming rank 1 (within ~30 s)."""
    if tool("torchrun") is None:
        pytest.skip("torchrun is not installed")
    marker = tmp_path / "held.pid"
    env = dict(HF_DATASETS_OFFLINE="1", HOLD_MARKER=str(marker), HOLD_STAGE=stage, BATCHMAX_DEAD_AFTER_S=LOSE_AFTER_S)
    nodes = torchrun_nodes(CHILDREN_PY, ["held_lm_eval_worker", tiny_dir, "1", str(tmp_path / "out.json")], **env)
    worker = None
    try:
        worker, _ = lose_node_1(nodes, marker, lose)
        _, err = nodes[0].communicate(timeout=150)  # a guard: the watchdog's line below is the assertion
    finally:
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        if worker is not None:  # a stopped worker outlives its node's process group
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
    assert nodes[0].returncode != 0, err[-3000:]
    assert "rank 1 has not answered" in err, err[-3000:]


# -- the serving core under the adapter ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["bm", "ed", "fkv"])
def test_shared_prefill_equals_separate_prefills(method, monkeypatch):
    """``Batching(share_prompts=True)``: three requests with one prompt prefill once (one row), then each is
    teacher-forced along its own continuation; tokens, log-probabilities and kept positions equal three
    separate prefills."""
    from conftest import tiny_llama

    from batchmax_tp import Method
    from batchmax_tp.core import engine as serving
    from batchmax_tp.core.engine import Engine
    from batchmax_tp.core.requests import Batching, Record, Request, Sampling

    rows = []  # prompt rows each prefill pass computes

    def counting(model, step, ids, mask, *keep, _orig=serving.forward_pass):
        rows.append(ids.shape[0] if step.kind != "decode" else 0)
        return _orig(model, step, ids, mask, *keep)

    monkeypatch.setattr(serving, "forward_pass", counting)

    model = tiny_llama(**PEAKED)
    m = {"bm": Method("bm", kv_max=24, p=8), "ed": Method("ed", kv_max=6), "fkv": Method("fkv")}[method]
    g = torch.Generator().manual_seed(0)
    prompt, other = torch.randint(3, 128, (50,), generator=g).tolist(), torch.randint(3, 128, (50,), generator=g)
    conts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    reqs = [Request(p, len(c), continuation=c) for p, c in zip([prompt] * 3 + [other.tolist()], conts)]
    runs, computed = {}, {}
    for share in (False, True):
        rows.clear()
        engine = Engine(model, m, 4, batching=Batching(share_prompts=share))
        runs[share] = engine.run(reqs, Sampling(ignore_eos=True), record=Record(positions=True))
        computed[share] = sum(rows)
    assert computed[True] * 2 == computed[False]  # 1 + 1 rows per block instead of 3 + 1
    for a, b in zip(runs[True].outputs, runs[False].outputs):
        assert a.tokens == b.tokens and a.kept_positions == b.kept_positions
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5) and len(a.logprobs) == len(a.tokens)


def test_deepspeed_launchers_local_rank_argument_is_taken_out(monkeypatch):
    # setenv first, so that teardown removes the LOCAL_RANK _launcher_args sets: a later test's lm-eval subprocess
    # would inherit it, and accelerate (``--model hf``) would then expect a torch.distributed launch
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")
    assert harness._launcher_args(["--local_rank=1", "--model", "batchmax"]) == ["--model", "batchmax"]
    assert os.environ["LOCAL_RANK"] == "1"
    assert harness._launcher_args(["--tasks", "t", "--local_rank", "3"]) == ["--tasks", "t"]
