"""Memory budget in the main job, the paper's procedure (launch/sweep.py) and the auto-tuner (launch/tune.py).

Offline and fast: a tiny random Llama with the embedded tokenizer's vocabulary on the bundled NarrativeQA fixture
(prompts cut to 420 tokens, 3 new tokens), and the embedded SmolLM2 on two short JSONL prompts for the tuner.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import csv
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from fakes import counting_engine

from batchmax_tp import cli
from batchmax_tp.config import ConfigError, parse_args
from batchmax_tp.core.method import BatchMax, ExtremeDecoding, Method
from batchmax_tp.eval import batches, generation, oom, report, tasks
from batchmax_tp.plan import budget
from batchmax_tp.plan.planner import ModelShape, max_batch, max_prompt_len, paper_ed_bytes, predict
from batchmax_tp.plan.tuner import paper_plan

ROOT = Path(__file__).resolve().parent.parent


class _Entry:
    """``launch/<name>.py``: ``batchmax_tp.cli.main`` with the entry point's procedure."""

    def __init__(self, procedure: str | None):
        self.procedure = procedure

    def main(self, argv):
        return cli.main(argv, procedure=self.procedure)


def _load(name: str) -> _Entry:
    return _Entry({"run": None, "sweep": "paper", "tune": "tune"}[name])


def _yaml(tmp_path, data, name="cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    from tiny import tiny_llama

    return tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=2048)


@pytest.fixture
def stack(monkeypatch, tokenizer, tiny_model):
    """The main job with the tiny model; records each timed generate call as (method, kv_max, batch) and can
    raise an error for the calls that ``stack.fail`` selects."""
    import batchmax_tp.eval.context as context  # the run path looks its ``Engine`` up here at call time
    import batchmax_tp.models as models

    state = type("Stack", (), {})()
    state.calls, state.fail = [], None

    def counting(engine, requests):
        method, batch = engine.method, len(requests)
        if requests[0].max_new_tokens > 2 and engine.batching.policy == "static":  # timed static batches
            state.calls.append((method.name, method.held_kv_max, batch))
            if state.fail is not None and state.fail(method, batch):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (tiny_model, tokenizer))
    monkeypatch.setattr(models, "read_config", lambda *a, **k: tiny_model.config)  # what the job plans with
    monkeypatch.setattr(context, "Engine", counting_engine(counting))
    return state


def _nqa(out, **extra):
    data = {
        "task": "narrativeqa",
        "num_samples": 4,
        "max_input_tokens": 420,
        "max_new_tokens": 3,
        "p": 32,
        "device": "cpu",
        "log_level": "WARNING",
        "out": str(out),
        "scheduler": "static",  # the stack counts static batches (generate calls)
    }
    data.update(extra)
    return data


def _prompt_len(tokenizer, num_samples=4) -> int:
    data = tasks.load_task("narrativeqa", num_samples=num_samples, seed=0)
    return generation.longest_prompt(tokenizer, tasks.build_samples(tokenizer, data, 420))


def _predict(model, method, b, prompt_len, new=3):
    return predict(ModelShape.from_config(model.config), method, b, prompt_len, new).total


def _csv(out):
    return list(csv.DictReader(io.StringIO((out / "results.csv").read_text())))


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "data, key",
    [
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"memory_budget": "1.5.3GiB"}, "memory_budget"),
        ({"memory_budget": 0}, "memory_budget"),
        ({"memory_budget": "-2GiB"}, "memory_budget"),
        ({"memory_budget": True}, "memory_budget"),
        ({"memory_budget": 1.5}, "memory_budget"),
        ({"memory_budget": [1]}, "memory_budget"),
        ({"procedure": "paper"}, "memory_budget"),  # a procedure needs a budget
        ({"procedure": "grid", "memory_budget": "1GiB"}, "procedure"),
        ({"kv_values": [64]}, "kv_values"),  # BM needs kv_max > p (64)
        ({"kv_values": []}, "kv_values"),
        ({"kv_values": [128, 128]}, "kv_values"),
        ({"kv_values": ["128"]}, "kv_values"),
        ({"target": 0}, "target"),
    ],
)
def test_bad_budget_configs_are_one_line_errors_naming_the_key(tmp_path, data, key):
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", _yaml(tmp_path, data)])
    assert str(info.value).startswith(f"{key}:") and "\n" not in str(info.value), str(info.value)


def test_budget_values_and_flags(tmp_path, capsys):
    assert parse_args(["--memory-budget", "2GiB"]).memory.budget_bytes() == 2 * 2**30
    assert parse_args(["--memory-budget", "1000"]).memory.budget_bytes() == 1000
    data = {"procedure": "paper", "memory_budget": "512MiB", "kv_values": [128, 256]}  # kv_values: a procedure's
    cfg = parse_args(["--config", _yaml(tmp_path, data)])
    assert cfg.memory.budget_bytes() == 512 * 2**20 and cfg.memory.kv_values == [128, 256]
    assert parse_args([]).memory.budget_bytes() is None
    assert parse_args(["--config", _yaml(tmp_path, cfg.to_dict())]) == cfg  # config.yaml loads back
    # launch scripts: one line on stderr, exit 2, before any model is loaded or file written
    rc = _load("sweep").main(["--memory-budget", "lots", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: memory_budget: ") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
    assert cli.procedure_argv(["--kv-max", "896,1024", "--kv-max=5"], "paper") == [
        "--kv-values",
        "896,1024",
        "--kv-values=5",
        "--procedure",
        "paper",
    ]


# ---------------------------------------------------------------------- budget in the main job
def test_run_over_budget_is_an_oom_row_and_the_sweep_goes_on(tmp_path, stack, tokenizer, tiny_model, capsys):
    s = _prompt_len(tokenizer)
    bm = Method("bm", kv_max=128, p=32)
    limit = _predict(tiny_model, bm, 4, s) + 1  # both BM runs fit, FKV at b=4 does not (no score block: b=2 fits)
    assert _predict(tiny_model, Method("fkv"), 4, s) > limit
    out = tmp_path / "res"
    runs = [
        {"method": "fkv", "batch_size": 4},
        {"method": "bm", "batch_size": 2, "kv_max": 128},
        {"method": "bm", "batch_size": 4, "kv_max": 128},
    ]
    assert _load("run").main(["--config", _yaml(tmp_path, _nqa(out, runs=runs, memory_budget=limit))]) == 0
    assert stack.calls == [("bm", 128, 2), ("bm", 128, 2), ("bm", 128, 4)]  # FKV never ran

    fkv = json.loads((out / "fkv-b4" / "summary.json").read_text())
    assert fkv["status"] == "oom" and fkv["oom_cause"] == "predicted" and fkv["num_samples"] == 0
    assert fkv["predicted_peak_bytes"] > fkv["memory_budget_bytes"] == limit
    assert "exceeds memory_budget" in fkv["error"] and not (out / "fkv-b4" / "samples.jsonl").exists()
    held = max_prompt_len(limit, ModelShape.from_config(tiny_model.config), Method("fkv"), 3, slots=4)
    assert 0 < held < s and f"fkv holds prompts of at most {held:,} tokens in it (4 slots)" in fkv["error"]
    for name in ("bm-b2-kv128", "bm-b4-kv128"):
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["status"] == "done" and summary["num_samples"] == 4
        assert summary["predicted_peak_bytes"] <= limit and summary["memory_budget_bytes"] == limit
        # K/V and the score block are predicted exactly (BM's K/V does not depend on the prompt lengths)
        assert summary["peak_kv_bytes"] == summary["predicted"]["kv"]
        assert 0 < summary["peak_workspace_bytes"] <= summary["predicted"]["workspace"]
        assert summary["cuda_max_memory_allocated"] is None  # CPU
        assert summary["weights_bytes"] == summary["predicted"]["weights"]  # one process: every parameter
        row = json.loads((out / name / "batches.jsonl").read_text().splitlines()[0])
        assert row["peak_workspace_bytes"] > 0 and row["cuda_max_memory_allocated"] is None

    text = (out / "report.md").read_text()
    assert "| FKV | 4 | N/A | OOM | - | OOM | OOM |" in text and "## Memory per rank (MiB)" in text
    assert "| FKV | 4 | N/A | OOM (predicted) |" in text
    memory = text[text.index("## Memory") :]
    assert report.mask_timings(text).endswith(memory)  # no timing there: masking leaves the memory table alone
    assert capsys.readouterr().out == text
    rows = _csv(out)
    assert [r["run"] for r in rows] == ["fkv-b4", "bm-b2-kv128", "bm-b4-kv128"]
    assert rows[0]["status"] == "oom" and rows[0]["oom_cause"] == "predicted" and rows[0]["tokens_per_s"] == ""
    assert float(rows[0]["predicted_peak_mib"]) > float(rows[0]["memory_budget_mib"])
    assert rows[1]["status"] == "done" and float(rows[1]["peak_workspace_mib"]) > 0

    # Resuming: nothing runs again, the OOM row stays.
    stack.calls.clear()
    assert _load("run").main(["--config", _yaml(tmp_path, _nqa(out, runs=runs, memory_budget=limit))]) == 0
    assert stack.calls == [] and "| FKV | 4 | N/A | OOM | - | OOM | OOM |" in (out / "report.md").read_text()


def _long_prompt(tmp_path, tokenizer, tokens: int) -> tuple[Path, int]:
    """A JSONL file of one prompt of about ``tokens`` tokens (the retention fixture's filler) and its length."""
    import random

    from batchmax_tp.bench.retention import load_fixture
    from batchmax_tp.bench.retention.suite import filler_paragraph

    rng, fx, text = random.Random(0), load_fixture(), ""
    while len(tokenizer(text).input_ids) < tokens:
        text += filler_paragraph(rng, fx) + " "
    sample = {"id": "long", "prompt": text + "What is the first word of this text?", "reference": text.split()[0]}
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(sample) + "\n")
    return path, generation.longest_prompt(tokenizer, tasks.load_jsonl(path))


def test_a_prompt_whose_full_cache_exceeds_the_budget_is_refused_before_load_and_answered_by_bm(
    tmp_path, monkeypatch, tokenizer, tiny_model, capsys
):
    """FKV and snap alone are refused before any load (one line, exit 2, nothing written) when the budget is below
    one prompt's full pairs and activations; BM answers the prompt in it, its measured peak within the planner's."""
    from memtrack import AllocationTracker

    import batchmax_tp.models as models

    path, s = _long_prompt(tmp_path, tokenizer, 1500)
    shape = ModelShape.from_config(tiny_model.config)
    bm = Method("bm", kv_max=128, p=32)
    limit = predict(shape, bm, 1, s, 3).total
    for method in (Method("fkv"), Method("snap", kv_max=128, p=32)):
        assert predict(shape, method, 1, s, 3).total > limit  # premise: one prompt does not fit either
        assert 0 < max_prompt_len(limit, shape, method, 3) < s
    assert max_prompt_len(limit, shape, bm, 3, limit=1 << 16) == 1 << 16  # BM holds every length in it

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    monkeypatch.setattr(models, "read_config", lambda *a, **k: tiny_model.config)
    common = ["--data", str(path), "--max-new-tokens", "3", "--p", "32", "--device", "cpu", "--dtype", "float32"]
    common += ["--memory-budget", str(limit), "--log-level", "WARNING", "--batch-size", "1"]
    for method, name in (("fkv", "fkv-b1"), ("snap", "snap-b1-kv128")):
        out = tmp_path / f"out-{method}"
        kv = [] if method == "fkv" else ["--kv-max", "128"]
        rc = _load("run").main([*common, "--method", method, *kv, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and not out.exists(), (rc, err)
        held = max_prompt_len(limit, shape, Method(method, **({} if method == "fkv" else {"kv_max": 128, "p": 32})), 3)
        assert err[0].startswith(f"error: memory_budget: {budget.fmt_bytes(limit)} per rank holds none of the runs")
        assert f"longest prompt ({s:,} tokens): {name} needs " in err[0]
        assert f"{method} holds prompts of at most {held:,} tokens in it (1 slot)" in err[0]
        assert err[0].endswith("it fits one slot with kv_max up to 128 (--method bm --kv-max 128)")

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (tiny_model, tokenizer))
    out = tmp_path / "out-bm"
    with AllocationTracker() as t:
        rc = _load("run").main([*common, "--method", "bm", "--kv-max", "128", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "bm-b1-kv128" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["num_samples"] == 1 and summary["predicted_peak_bytes"] <= limit
    assert t.peak <= limit - summary["predicted"]["weights"], (t.peak, summary["predicted"])


def test_a_real_out_of_memory_is_recorded_and_memory_is_freed_after_the_handler(tmp_path, stack, monkeypatch):
    freed = []
    monkeypatch.setattr(batches, "free_memory", lambda device: freed.append(sys.exc_info()[0]))
    stack.fail = lambda method, b: isinstance(method, ExtremeDecoding)  # CUDA OOM in ed's first batch
    out = tmp_path / "res"
    runs = [{"method": "ed", "batch_size": 2, "kv_max": 2}, {"method": "bm", "batch_size": 2, "kv_max": 128}]
    assert _load("run").main(["--config", _yaml(tmp_path, _nqa(out, runs=runs, memory_budget="1GiB"))]) == 0
    assert stack.calls == [("ed", 2, 2), ("bm", 128, 2), ("bm", 128, 2)]
    assert freed == [None]  # called once, with the exception (and the frames holding its tensors) gone
    ed = json.loads((out / "ed-b2-kv2" / "summary.json").read_text())
    assert ed["status"] == "oom" and ed["oom_cause"] == "runtime" and "OutOfMemoryError" in ed["error"]
    assert ed["predicted_peak_bytes"] <= ed["memory_budget_bytes"] == 2**30  # fitted on paper
    assert json.loads((out / "bm-b2-kv128" / "summary.json").read_text())["status"] == "done"
    assert "| ED | 2 | 2 | OOM | - | OOM | OOM |" in (out / "report.md").read_text()
    assert "OOM (runtime)" in (out / "report.md").read_text()


def test_free_memory_empties_the_cuda_cache(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    oom.free_memory(torch.device("cpu"))
    assert emptied == []
    oom.free_memory(torch.device("cuda", 0))
    assert emptied == [1]


def test_single_method_summaries_report_memory(tmp_path, stack):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"Say the number {i} " * 10, "reference": str(i)}) + "\n" for i in range(3)
        )
    )
    out = tmp_path / "res"
    rc = _load("run").main(
        [
            "--data",
            str(data),
            "--method",
            "bm",
            "--kv-max",
            "24",
            "--p",
            "8",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--log-level",
            "WARNING",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "bm-b2-kv24" / "summary.json").read_text())  # the one layout (no budget)
    assert summary["peak_workspace_bytes"] > 0 and summary["cuda_max_memory_allocated"] is None
    assert summary["peak_kv_bytes"] == summary["predicted"]["kv"] and summary["memory_budget_bytes"] is None
    assert summary["predicted_peak_bytes"] == summary["predicted"]["total"] > 0


# ---------------------------------------------------------------------- the paper's procedure
def test_sweep_runs_the_papers_plan_in_order(tmp_path, stack, tokenizer, tiny_model, capsys):
    s = _prompt_len(tokenizer)
    ed2, fkv = Method("ed", kv_max=2), Method("fkv", block=0, chunk=0)  # the paper's FKV: a fixed slot, one pass
    shape = ModelShape.from_config(tiny_model.config)
    paper_ed = [paper_ed_bytes(shape, b, s, 3, p=32) for b in (2, 3)]  # the paper's ED defines b0
    limit = max(paper_ed[0], _predict(tiny_model, ed2, 2, s), _predict(tiny_model, fkv, 2, s)) + 1
    assert paper_ed[1] > limit  # so b0 = 3
    plan = paper_plan(limit, shape, s, 3, dtype="float32", p=32, num_samples=4, kv_values=[128, 192])
    names = [budget.RunSpec(m, b).name for m, b in plan]
    assert names[:4] == ["ed-b3-kv2", "ed-b2-kv2", "ed-b2-kv65", "fkv-block0-chunk0-b2"]
    bm = [(m.kv_max, b) for m, b in plan[4:]]
    assert [k for k, _ in bm] == [128, 192] and all(b in (2, 4) for _, b in bm)  # divisors of 4, >= b0 - 1

    out = tmp_path / "res"
    rc = _load("sweep").main(
        ["--config", _yaml(tmp_path, _nqa(out)), "--memory-budget", str(limit), "--kv-max", "128,192"]
    )
    assert rc == 0
    # b0 is where the paper's ED runs out of memory; this engine's ED fits it (a slot never holds its prompt), so
    # its row runs too; every run in the plan's order.
    assert stack.calls == [("ed", 2, 3), ("ed", 2, 1)] + [("ed", 2, 2)] * 2 + [("ed", 65, 2)] * 2 + [
        ("fkv", None, 2)
    ] * 2 + [("bm", k, b) for k, b in bm for _ in range(4 // b)]
    planned = json.loads((out / "plan.json").read_text())
    assert planned["b0"] == 3 and planned["prompt_len"] == s and [r["run"] for r in planned["runs"]] == names
    assert [r["fits"] for r in planned["runs"]] == [True] * 6 and planned["adjusted"] is None
    assert [r["run"] for r in _csv(out)] == names and set(report.REPORT_FILES) <= set(os.listdir(out))
    text = (out / "report.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:7]] == ["ED", "ED", "ED", "FKV", "BM", "BM"]
    assert "BM against the fastest ED run" in text and capsys.readouterr().out == text
    assert json.loads((out / "ed-b3-kv2" / "summary.json").read_text())["status"] == "done"
    # Resume: nothing runs again.
    stack.calls.clear()
    assert (
        _load("sweep").main(
            ["--config", _yaml(tmp_path, _nqa(out)), "--memory-budget", str(limit), "--kv-max", "128,192"]
        )
        == 0
    )
    assert stack.calls == []


def test_paper_specs_run_fkv_at_a_fitting_batch_when_b0_minus_1_does_not_fit():
    shape = ModelShape(
        layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, params=134_515_008
    )
    cfg = parse_args(["--procedure", "paper", "--memory-budget", "1", "--max-new-tokens", "512", "--kv-values", "512"])
    s = 1024
    cfg = cfg.replace(memory_budget=paper_ed_bytes(shape, 6, s, 512))  # the paper's ED fits 6 exactly; FKV does not
    assert predict(shape, Method("fkv", block=0, chunk=0), 6, s, 512).total > cfg.memory.budget_bytes()
    specs, info = budget.paper_specs(
        shape,
        s,
        budget=cfg.memory.budget_bytes(),
        max_new_tokens=512,
        dtype="float32",
        p=64,
        rule="paper",
        kv_values=[512],
        num_samples=960,
    )
    paper_fkv = Method("fkv", block=0, chunk=0)
    fit = max_batch(cfg.memory.budget_bytes(), shape, paper_fkv, s, 512)
    assert 0 < fit < 6 and predict(shape, paper_fkv, fit, s, 512).total <= cfg.memory.budget_bytes()
    assert [x.name for x in specs[:4]] == ["ed-b7-kv2", "ed-b6-kv2", "ed-b6-kv65", f"fkv-block0-chunk0-b{fit}"]
    assert f"b = {fit}" in info["adjusted"] and [r["fits"] for r in info["runs"]] == [True] * 5  # ED: this engine's


def test_paper_procedure_sizes_bm_with_the_rule_it_runs():
    """``--procedure paper --rule question``: BM's batch is the largest the question rule fits (probe tokens and
    stored probe queries counted), not the paper rule's, which would overflow the budget."""
    shape = ModelShape(
        layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, params=134_515_008
    )
    cfg = parse_args(
        ["--procedure", "paper", "--memory-budget", "1", "--rule", "question", "--kv-values", "512", "--device", "cpu"]
    )
    s, new = 1024, 64
    paper, question = Method("bm", kv_max=512, p=64), Method("bm", kv_max=512, p=64, rule=cfg.sweep.rule)
    limit = predict(shape, paper, 40, s, new).total  # the paper's rule fits b=40 (a divisor of 960) exactly
    assert paper_plan(limit, shape, s, new, dtype="float32", kv_values=[512])[-1] == (paper, 40)
    assert predict(shape, question, 40, s, new).total > limit  # premise: the paper's sizing overflows question
    specs, info = budget.paper_specs(
        shape,
        s,
        budget=limit,
        max_new_tokens=new,
        dtype="float32",
        p=cfg.sweep.p,
        rule=cfg.sweep.rule,
        kv_values=cfg.memory.kv_values,
        num_samples=960,
    )
    bm = [x for x in specs if isinstance(x.method, BatchMax)]
    assert [x.method for x in bm] == [question] and bm[0].name == f"bm-question-b{bm[0].batch_size}-kv512"
    assert 0 < bm[0].batch_size < 40 and predict(shape, question, bm[0].batch_size, s, new).total <= limit
    assert [r["fits"] for r in info["runs"] if r["method"] == "bm"] == [True]


def test_sweep_with_a_rule_runs_bm_at_the_batch_that_rule_fits(tmp_path, stack, tokenizer, tiny_model):
    s = _prompt_len(tokenizer)
    paper, question = Method("bm", kv_max=128, p=32), Method("bm", kv_max=128, p=32, rule="question")
    limit = max(
        _predict(tiny_model, paper, 4, s), _predict(tiny_model, Method("fkv"), 1, s)
    )  # FKV's trial fits  # the paper's rule fits all 4 samples in one batch
    assert _predict(tiny_model, question, 4, s) > limit >= _predict(tiny_model, question, 2, s)  # question fits 2
    out = tmp_path / "res"
    rc = _load("sweep").main(
        ["--config", _yaml(tmp_path, _nqa(out)), "--memory-budget", str(limit), "--kv-max", "128", "--rule", "question"]
    )
    assert rc == 0
    planned = json.loads((out / "plan.json").read_text())
    bm = [r for r in planned["runs"] if r["method"] == "bm"]
    assert [(r["run"], r["rule"], r["fits"]) for r in bm] == [("bm-question-b2-kv128", "question", True)]
    summary = json.loads((out / "bm-question-b2-kv128" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["predicted_peak_bytes"] <= limit
    assert stack.calls[-2:] == [("bm", 128, 2)] * 2


# ---------------------------------------------------------------------- the auto-tuner
def test_tune_with_a_rule_sizes_and_names_its_trials_by_it(tmp_path, stack, tokenizer, tiny_model, capsys):
    s = _prompt_len(tokenizer)
    paper, question = Method("bm", kv_max=128, p=32), Method("bm", kv_max=128, p=32, rule="question")
    limit = max(_predict(tiny_model, paper, 4, s), _predict(tiny_model, Method("fkv"), 1, s))  # FKV's trial fits
    assert _predict(tiny_model, question, 4, s) > limit >= _predict(tiny_model, question, 2, s)
    out = tmp_path / "res"
    rc = _load("tune").main(
        [
            "--config",
            _yaml(tmp_path, _nqa(out)),
            "--memory-budget",
            str(limit),
            "--kv-max",
            "128",
            "--rule",
            "question",
            "--target",
            "0.01",
        ]
    )
    assert rc == 0  # a trial meets the 0.01 target (the stack's runs score what they score, every time)
    info = json.loads((out / "tune.json").read_text())
    bm = [t for t in info["trials"] if t["method"] == "bm"]
    # the rule as given, then its cheaper settings as candidates of their own (core.rules.rule_candidates)
    assert info["rule"] == "question" and [(t["run"], t["rule"], t["batch"]) for t in bm] == [
        ("bm-question-b2-kv128", "question", 2),
        ("bm-question-every8-b2-kv128", "question:every=8", 2),
        ("bm-question-window16-b2-kv128", "question:window=16", 2),
    ]
    assert all(t["predicted_peak_bytes"] <= limit for t in bm) and ("bm", 128, 2) in stack.calls
    for t in bm:
        assert json.loads((out / "tune" / t["run"] / "summary.json").read_text())["status"] == "done"
    printed = capsys.readouterr().out
    assert "| bm-question-every8-b2-kv128 | BM | question:every=8 | 2 |" in printed


def test_tune_with_no_cheaper_rules_tries_the_rule_as_given(tmp_path, stack, tokenizer, tiny_model):
    s = _prompt_len(tokenizer)
    limit = max(
        _predict(tiny_model, Method("bm", kv_max=128, p=32, rule="question"), 2, s),
        _predict(tiny_model, Method("fkv"), 1, s),
    )
    out = tmp_path / "res"
    args = ["--config", _yaml(tmp_path, _nqa(out)), "--memory-budget", str(limit), "--kv-max", "128"]
    rc = _load("tune").main([*args, "--rule", "question", "--target", "0.01", "--no-cheaper-rules"])
    assert rc == 0
    bm = [t for t in json.loads((out / "tune.json").read_text())["trials"] if t["method"] == "bm"]
    assert [(t["run"], t["rule"]) for t in bm] == [("bm-question-b2-kv128", "question")]


def test_tune_on_the_embedded_model_writes_a_usable_tuned_config(tmp_path, monkeypatch, capsys):
    import batchmax_tp.eval.context as context  # the run path looks its ``Engine`` up here at call time
    import batchmax_tp.models as models

    loaded = models.load_model()
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)
    timed = []

    def counting(engine, requests):
        if requests[0].max_new_tokens > 2 and engine.batching.policy == "static":  # timed static batches
            timed.append((engine.method.name, len(requests)))

    monkeypatch.setattr(context, "Engine", counting_engine(counting))
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps(
            {
                "id": "a",
                "prompt": "Mara has a red kite, a blue ball and a green hat. The kite is her favourite "
                "toy and she flies it every Sunday with her brother Jonah. What colour is the kite?",
                "reference": "red",
            }
        )
        + "\n"
        + json.dumps(
            {
                "id": "b",
                "prompt": "Tom bought three apples, then two pears, then one more apple at the "
                "market near the old bridge. How many apples did Tom buy in all?",
                "reference": "four",
            }
        )
        + "\n"
    )
    shape = ModelShape.from_config(loaded[0].config)
    samples = tasks.load_jsonl(data)
    s = generation.longest_prompt(loaded[1], samples)
    limit = predict(shape, Method("fkv"), 2, s, 4).total  # FKV fits both samples in one batch
    out = tmp_path / "res"
    args = [
        "--data",
        str(data),
        "--max-new-tokens",
        "4",
        "--p",
        "16",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--log-level",
        "WARNING",
        "--memory-budget",
        str(limit),
        "--kv-max",
        "24,40",
        "--target",
        "0.5",
    ]
    rc = _load("tune").main(args)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    info = json.loads((out / "tune.json").read_text())
    assert info["fkv"]["batch"] == 2 and info["kv_values"] == [24, 40] and info["prompt_len"] == s
    assert info["best"]["method"] == "bm" and info["best"]["kv_max"] in (24, 40) and info["best"]["batch"] == 2
    assert sorted(t["run"] for t in info["trials"]) == ["bm-b2-kv24", "bm-b2-kv40", "fkv-b2"]
    for trial in info["trials"]:  # every trial is a saved run of the harness
        assert json.loads((out / "tune" / trial["run"] / "summary.json").read_text())["status"] == "done"
    assert len(timed) == 3 and (out / "tune" / "report.md").is_file() and "tuned.yaml" in printed

    tuned = parse_args(["--config", str(out / "tuned.yaml")])
    assert (tuned.sweep.methods, tuned.sweep.kv_max, tuned.sweep.batch_size) == (["bm"], info["best"]["kv_max"], 2)
    assert (
        tuned.memory.procedure is None
        and tuned.output.dir == str(out / "tuned")
        and tuned.memory.budget_bytes() == limit
    )

    timed.clear()  # trials are resumable: a second tune runs nothing and chooses the same
    assert _load("tune").main(args) == 0 and timed == []
    assert json.loads((out / "tune.json").read_text())["best"] == info["best"]

    assert _load("run").main(["--config", str(out / "tuned.yaml"), "--log-level", "WARNING"]) == 0
    name = f"bm-b2-kv{info['best']['kv_max']}"
    assert timed == [("bm", 2)] and json.loads((out / "tuned" / name / "summary.json").read_text())["status"] == "done"


def test_tune_refuses_a_budget_without_fkv(tmp_path, stack, capsys):
    out = tmp_path / "res"
    rc = _load("tune").main(["--config", _yaml(tmp_path, _nqa(out)), "--memory-budget", "1MiB"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: memory_budget: ") and err.count("\n") == 1, err
    assert stack.calls == []


def test_a_refusal_on_a_model_not_converted_yet_converts_nothing(tmp_path, monkeypatch, capsys):
    """An empty model cache (nothing converted yet): a budget too small for the embedded model's prompts is refused in
    one line before any load, from the GGUF file's configuration and tokenizer alone; nothing is converted (the
    conversion, 20-70 s, waits for a run that loads the model)."""
    import batchmax_tp.models as models

    def boom(*args, **kwargs):
        raise AssertionError("converted or loaded")

    monkeypatch.setenv("BATCHMAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_convert_gguf", boom)
    monkeypatch.setattr(models, "load_model", boom)
    out = tmp_path / "out"
    args = ["--method", "fkv", "--memory-budget", "64MiB", "--device", "cpu", "--log-level", "WARNING"]
    rc = _load("run").main([*args, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: memory_budget: 64.0 MiB per rank"), (rc, err)
    assert not out.exists() and not any((tmp_path / "cache").glob("smollm2*"))
