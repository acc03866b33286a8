"""RunConfig layering/validation, launch/run.py's early exits, and the run path's batching/summaries/files.

Everything here is offline and model-free: the engine, the model loader and the prompt encoder are faked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from fakes import FakeTokenizer, fake_encode, make_fake_engine

from batchmax_tp import cli
from batchmax_tp.config import EMBEDDED_MODEL, ConfigError, RunConfig, parse_args
from batchmax_tp.core.method import Method, method_type
from batchmax_tp.eval import context, generation, results
from batchmax_tp.eval.context import RunContext
from batchmax_tp.eval.files import atomic_write_text
from batchmax_tp.eval.run import evaluate_run
from batchmax_tp.eval.summary import write_config

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "launch" / "run.py"


def _write_yaml(tmp_path: Path, data, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


# ---------------------------------------------------------------------- defaults and layering
def test_defaults():
    cfg = RunConfig()
    assert cfg.model.name == EMBEDDED_MODEL
    assert cfg.sweep.methods == ["fkv", "ed", "bm"]
    assert cfg.sweep.kv_max is None and cfg.sweep.p == 64
    assert cfg.sweep.batch_size == 4 and cfg.generation.max_new_tokens == 64
    assert cfg.generation.ignore_eos is True and cfg.generation.do_sample is False
    assert cfg.data.path is None and cfg.data.num_samples is None
    assert cfg.output.dir == "results/main"  # configs/default.yaml writes results/default: the two never collide
    assert cfg.model.dtype == "auto" and cfg.model.device == "auto" and cfg.generation.seed == 0
    assert parse_args([]) == cfg
    specs = cfg.sweep.method_specs()
    assert [(m.name, m.kv_max, m.p) for m in specs] == [("fkv", None, 64), ("ed", 2, 64), ("bm", 512, 64)]
    assert all(isinstance(m, Method) for m in specs)


def test_yaml_overrides_defaults_and_cli_overrides_yaml(tmp_path):
    path = _write_yaml(
        tmp_path, {"method": "bm", "kv_max": 256, "p": 32, "batch_size": 8, "ignore_eos": False, "top_p": 1}
    )
    cfg = parse_args(["--config", path])
    assert cfg.sweep.methods == ["bm"] and cfg.sweep.kv_max == 256 and cfg.sweep.p == 32 and cfg.sweep.batch_size == 8
    assert cfg.generation.ignore_eos is False and cfg.generation.max_new_tokens == 64  # untouched key keeps its default
    assert cfg.generation.top_p == 1.0 and isinstance(cfg.generation.top_p, float)

    cfg = parse_args(["--config", path, "--batch-size", "2", "--ignore-eos", "--kv-max", "null", "--p", "16"])
    assert (
        cfg.sweep.batch_size == 2
        and cfg.generation.ignore_eos is True
        and cfg.sweep.kv_max is None
        and cfg.sweep.p == 16
    )
    assert cfg.sweep.methods == ["bm"] and cfg.sweep.method_specs()[0].kv_max == method_type("bm").default_kv_max

    cfg = parse_args(["--config", path, "--method", "ed", "--kv-max", "4"])
    assert cfg.sweep.methods == ["ed"] and cfg.sweep.method_specs()[0].kv_max == 4


def test_method_forms(tmp_path):
    assert parse_args(["--method", "bm"]).sweep.methods == ["bm"]
    assert parse_args(["--method", "bm", "--method", "fkv"]).sweep.methods == ["bm", "fkv"]
    assert parse_args(["--method", "ed,bm"]).sweep.methods == ["ed", "bm"]
    assert parse_args(["--config", _write_yaml(tmp_path, {"methods": ["ed", "fkv"]})]).sweep.methods == ["ed", "fkv"]
    assert parse_args(["--config", _write_yaml(tmp_path, {"methods": "ed"})]).sweep.methods == ["ed"]
    assert parse_args(["--config", _write_yaml(tmp_path, "")]) == RunConfig()  # empty file = defaults


def test_local_rank_is_accepted_and_ignored():
    assert parse_args(["--local_rank", "0"]) == RunConfig()
    assert parse_args(["--local-rank=3", "--method", "bm"]).sweep.methods == ["bm"]
    assert parse_args(["--local_rank=1"]) == RunConfig()


def test_to_dict_round_trips_through_yaml(tmp_path):
    cfg = parse_args(["--method", "bm", "--kv-max", "128", "--p", "8", "--num-samples", "3", "--do-sample"])
    d = cfg.to_dict()
    assert d["methods"] == ["bm"] and d["kv_max"] == 128 and d["num_samples"] == 3 and d["do_sample"] is True
    path = _write_yaml(tmp_path, cfg.to_yaml())
    assert parse_args(["--config", path]) == cfg


# ---------------------------------------------------------------------- errors
def _error_of(argv) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


@pytest.mark.parametrize(
    "yaml_data, key",
    [
        ({"batchsize": 4}, "batchsize"),  # unknown key
        ({"batch-size": 4}, "batch-size"),  # CLI spelling in YAML
        ({"batch_size": "4"}, "batch_size"),  # wrong types
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"p": True}, "p"),
        ({"kv_max": 1.5}, "kv_max"),
        ({"methods": [1]}, "methods"),
        ({"temperature": "hot"}, "temperature"),
        ({"p": 0}, "p"),  # impossible values
        ({"method": "bm", "kv_max": 64}, "kv_max"),
        ({"method": "bm", "kv_max": 32, "p": 64}, "kv_max"),
        ({"method": "ed", "kv_max": 1}, "kv_max"),
        ({"method": "bm", "p": 600}, "p"),  # p too large for the default kv_max 512
        ({"methods": ["bm", "lru"]}, "methods"),
        ({"methods": ["bm", "bm"]}, "methods"),
        ({"methods": []}, "methods"),
        ({"method": "bm", "methods": ["ed"]}, "method"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"num_samples": 0}, "num_samples"),
        ({"data": "/nonexistent/samples.jsonl"}, "data"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"top_p": 0}, "top_p"),
        ({"log_level": "LOUD"}, "log_level"),
        # kv_max values the configured rule cannot run with (question keeps 4 sinks + 60 recent: kv_max >= p + 64)
        ({"rule": "question", "procedure": "paper", "memory_budget": "2GiB", "kv_values": [128, 96]}, "kv_values"),
        ({"rule": "question", "method": "bm", "kv_max": 96}, "kv_max"),
        ({"rule": "question", "runs": [{"method": "bm", "batch_size": 2, "kv_max": 96}]}, "runs[0].kv_max"),
        ({"runs": [{"method": "bm", "batch_size": 2, "kv_max": 96, "rule": "question"}]}, "runs[0].kv_max"),
        ({"same_memory": True, "kv_max": 100}, "kv_max"),  # the plain run's BM (question) runs with kv_max too
    ],
)
def test_yaml_errors_are_one_line_and_name_the_key(tmp_path, yaml_data, key):
    message = _error_of(["--config", _write_yaml(tmp_path, yaml_data)])
    assert message.startswith(f"{key}:"), message


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--p", "0"], "p"),
        (["--method", "bm", "--kv-max", "64"], "kv_max"),
        (["--method", "ed", "--kv-max", "1"], "kv_max"),
        (["--method", "xyz"], "methods"),
        (["--data", "/nonexistent/samples.jsonl"], "data"),
        (["--batch-size", "0"], "batch_size"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_cli_errors_are_one_line_and_name_the_key(argv, key):
    message = _error_of(argv)
    assert message.startswith(f"{key}:"), message


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--batch-size", "four"], "--batch-size"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--ignore-eos", "--no-ignore-eos"], "--no-ignore-eos"),
        (["--config", "/nonexistent/run.yaml"], "config"),
    ],
)
def test_cli_parse_errors_are_one_line(argv, needle):
    assert needle in _error_of(argv)


def test_yaml_syntax_and_shape_errors(tmp_path):
    assert _error_of(["--config", _write_yaml(tmp_path, "p: [1,\n")]).startswith("config:")
    assert _error_of(["--config", _write_yaml(tmp_path, "- 1\n- 2\n")]).startswith("config:")


def test_existing_data_file_is_accepted(tmp_path):
    data = tmp_path / "s.jsonl"
    data.write_text('{"id": 1, "prompt": "hi"}\n')
    assert parse_args(["--data", str(data)]).data.path == str(data)


# ---------------------------------------------------------------------- launch/run.py early exits
@pytest.mark.parametrize(
    "bad",
    [
        ["--bogus-flag"],
        ["--p", "0"],
        ["--method", "bm", "--kv-max", "10"],
        ["--batch-size", "x"],
        ["--data", "/nonexistent.jsonl"],
        ["--model", "/no/such/dir"],
        ["--model", "nobody/no-such-model"],
        ["--dtype", "float8"],
        ["--setup-timeout", "0"],
    ],
)
def test_run_py_bad_config_exits_2_before_loading(tmp_path, capsys, no_model_load, bad):
    out = tmp_path / "out"
    rc = cli.main(["--out", str(out), *bad])
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert not out.exists()


KV_VALUES_THE_RULE_CANNOT_RUN = [
    "--procedure",
    "paper",
    "--memory-budget",
    "2GiB",
    "--rule",
    "question",
    "--kv-values",
    "96",
]


def test_kv_values_the_rule_cannot_run_exit_2_before_loading(tmp_path, capsys, no_model_load):
    """Every kv_values entry must be a BM the configured rule runs with: one line naming the key, no model, no files."""
    out = tmp_path / "out"
    assert cli.main([*KV_VALUES_THE_RULE_CANNOT_RUN, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("error: kv_values: ") and "kv_max=96" in captured.err and "question" in captured.err
    assert not out.exists()
    assert parse_args([*KV_VALUES_THE_RULE_CANNOT_RUN[:-1], "128"]).memory.kv_values == [128]  # p + 64 is enough
    proc = subprocess.run(
        [sys.executable, str(RUN_PY), *KV_VALUES_THE_RULE_CANNOT_RUN],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: kv_values: ") and os.listdir(tmp_path) == []  # no results/main either


def test_run_py_subprocess_bad_flag(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(RUN_PY), "--bogus", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "--bogus" in proc.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


# ---------------------------------------------------------------------- runner
def _fake_result(num_generated, prefill_s, decode_s, peak, tokens=None):
    num_generated = torch.tensor(num_generated)
    if tokens is None:
        tokens = torch.full((len(num_generated), int(num_generated.max())), 7)
    return SimpleNamespace(
        tokens=torch.as_tensor(tokens),
        num_generated=num_generated,
        prefill_s=prefill_s,
        decode_s=decode_s,
        peak_kv_bytes=peak,
    )


def test_batched_keeps_file_order():
    assert list(generation.batched(list(range(7)), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(generation.batched([], 3)) == []
    with pytest.raises(ValueError):
        list(generation.batched([1], 0))


def test_cut_at_eos():
    assert generation.cut_at_eos([5, 6, 2, 7], 4, 2) == [5, 6]
    assert generation.cut_at_eos([5, 6, 7, 8], 3, 2) == [5, 6, 7]
    assert generation.cut_at_eos([5, 9, 6], 3, [9, 2]) == [5]
    assert generation.cut_at_eos([2, 5], 2, None) == [2, 5]


def test_summary_with_fake_batches():
    batches = [
        {
            "batch": 0,
            "replica": 0,
            "ids": ["a", "b"],
            "tokens_cut": [0, 3],
            "generated_tokens": 16,
            "prefill_s": 1.0,
            "decode_s": 3.0,
            "peak_kv_bytes": 1000,
        },
        {
            "batch": 1,
            "replica": 0,
            "ids": ["c", "d"],
            "tokens_cut": [0, 0],
            "generated_tokens": 13,
            "prefill_s": 0.5,
            "decode_s": 1.5,
            "peak_kv_bytes": 3000,
        },
        {
            "batch": 2,
            "replica": 0,
            "ids": ["e"],
            "tokens_cut": [0],
            "generated_tokens": 2,
            "prefill_s": 0.25,
            "decode_s": 0.75,
            "peak_kv_bytes": 500,
        },
    ]
    outputs = {"a": ("the w10 x", "w10"), "b": ("w11", "w10"), "c": ("x", None), "d": ("w10", "w10"), "e": ("y", None)}
    samples = [
        {
            "id": k,
            "output": o,
            "reference": r,
            "correct": None if r is None else "w10" in o.split(),
            "generated_tokens": n,
        }
        for (k, (o, r)), n in zip(outputs.items(), [8, 8, 8, 5, 2])
    ]
    samples = [results.SampleRecord.from_json(r) for r in samples]
    agg = results.summarise(samples, [results.BatchRecord.from_json(b) for b in batches], "contains")
    assert agg["generated_tokens"] == 31
    assert agg["prefill_s"] == pytest.approx(1.75) and agg["decode_s"] == pytest.approx(5.25)
    assert agg["tokens_per_s"] == pytest.approx(31 / 7.0)
    # The full batches ran at 16/4 and 13/2 tokens/s: half their range over their mean.
    assert agg["tokens_per_s_spread"] == pytest.approx((6.5 - 4.0) / 2 / 5.25)
    assert agg["peak_kv_bytes"] == 3000 and agg["num_batches"] == 3 and agg["num_samples"] == 5
    assert (agg["num_correct"], agg["num_checked"]) == (2, 3) and agg["accuracy"] == pytest.approx(2 / 3)
    assert agg["score"] == pytest.approx(2 / 3) and agg["num_scored"] == 3
    assert (agg["samples_cut"], agg["tokens_cut"]) == (1, 3)

    empty = results.summarise([], [], "contains")
    assert empty["tokens_per_s"] is None and empty["accuracy"] is None and empty["tokens_per_s_spread"] is None


def test_evaluate_run_with_fake_engine(tmp_path):
    samples = [
        SimpleNamespace(id=str(i), prompt="a " * (i + 1), reference=ref, tokens_cut=0)
        for i, ref in enumerate(["w10 w11", "w99", None])
    ]
    cfg = RunConfig(
        methods=["bm"], kv_max=128, p=16, batch_size=2, max_new_tokens=4, seed=5, out=str(tmp_path), scheduler="static"
    )
    calls = []
    spec = cfg.sweep.run_specs()[0]
    engine = dict(engine_fn=make_fake_engine(calls), encode_fn=fake_encode, progress=False)
    summary = evaluate_run(RunContext(SimpleNamespace(), FakeTokenizer(), **engine), samples, spec, cfg)
    assert [c["batch"] for c in calls] == [2, 1]
    assert [c["seed"] for c in calls] == [5, 6]
    assert all(c["ignore_eos"] is True and c["eos_token_id"] == 2 and c["max_new_tokens"] == 4 for c in calls)
    folder = tmp_path / spec.name
    assert spec.name == "bm-b2-kv128" and sorted(os.listdir(folder)) == [
        "batches.jsonl",
        "samples.jsonl",
        "summary.json",
    ]
    records = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert [tuple(r) for r in records] == [results.SAMPLE_KEYS] * 3
    assert [r["id"] for r in records] == ["0", "1", "2"]
    assert [r["prompt_tokens"] for r in records] == [1, 2, 3]
    assert records[0]["output"] == "w10 w11"  # cut at the first EOS (id 2)
    assert [r["correct"] for r in records] == [True, False, None]
    assert [r["generated_tokens"] for r in records] == [4, 4, 4]
    batches = [json.loads(line) for line in (folder / "batches.jsonl").read_text().splitlines()]
    assert [(b["batch"], b["ids"], b["peak_kv_bytes"]) for b in batches] == [(0, ["0", "1"], 2048), (1, ["2"], 1024)]
    assert summary.to_json() == json.loads((folder / "summary.json").read_text())
    assert summary.generated_tokens == 12 and summary.tokens_per_s == pytest.approx(12 / 4.0)
    assert summary.peak_kv_bytes == 2048 and summary.kv_max == 128 and summary.tp_size == 1
    assert summary.accuracy == pytest.approx(0.5) and summary.status == "done"


def test_a_static_run_gives_its_engine_the_runs_compile_and_tensor_parallel_group(tmp_path):
    """The paper's padded batches run on the same engine as a continuous run, with the same settings: each batch's
    engine gets the run's ``compile`` and the model's tensor-parallel group (without them, on CUDA under tensor
    parallelism, ``auto`` would capture CUDA graphs and no rank would take the first rank's tokens)."""
    samples = [SimpleNamespace(id=str(i), prompt="a " * (i + 1), reference=None, tokens_cut=0) for i in range(3)]
    cfg = RunConfig(
        methods=["bm"], kv_max=128, p=16, batch_size=2, max_new_tokens=4, out=str(tmp_path), scheduler="static",
        compile="none",
    )  # fmt: skip
    calls, group = [], object()
    engine = dict(engine_fn=make_fake_engine(calls), encode_fn=fake_encode, progress=False)
    model = SimpleNamespace(batchmax_tp_group=group)
    evaluate_run(RunContext(model, FakeTokenizer(), **engine), samples, cfg.sweep.run_specs()[0], cfg)
    assert [c["batch"] for c in calls] == [2, 1]
    assert all(c["compile"] == "none" and c["tp_group"] is group for c in calls)


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "x.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert os.listdir(target.parent) == ["x.json"]


# ---------------------------------------------------------------------- run.py end to end with fakes
@pytest.fixture
def fake_stack(monkeypatch, tmp_path):
    import batchmax_tp.models as models

    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": i, "prompt": "x " * (i + 2), "reference": "w10" if i % 2 == 0 else "nope"}) + "\n"
            for i in range(5)
        )
    )
    calls = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (SimpleNamespace(), FakeTokenizer()))
    # The run path looks its engine and encoder up at call time.
    monkeypatch.setattr(generation, "encode_prompts", fake_encode)
    monkeypatch.setattr(context, "Engine", make_fake_engine(calls))
    return SimpleNamespace(data=str(data), calls=calls)


def test_run_py_several_methods_layout(tmp_path, capsys, fake_stack):
    out = tmp_path / "res"
    argv = ["--data", fake_stack.data, "--out", str(out), "--batch-size", "2", "--max-new-tokens", "3"]
    argv += ["--device", "cpu", "--log-level", "WARNING", "--scheduler", "static"]  # the fake engine's batches
    assert cli.main(argv) == 0
    runs = ["fkv-b2", "ed-b2-kv2", "bm-b2-kv512"]
    assert sorted(os.listdir(out)) == sorted(
        [*runs, "config.yaml", "metric_vs_kv.png", "report.md", "results.csv", "throughput.png"]
    )
    for name, method in zip(runs, ("fkv", "ed", "bm")):
        assert sorted(os.listdir(out / name)) == ["batches.jsonl", "samples.jsonl", "summary.json"]
        summary = json.loads((out / name / "summary.json").read_text())
        for key in (
            "method",
            "batch_size",
            "kv_max",
            "p",
            "tp_size",
            "num_samples",
            "generated_tokens",
            "tokens_per_s",
            "prefill_s",
            "decode_s",
            "peak_kv_bytes",
            "accuracy",
            "model",
            "started_at",
            "finished_at",
        ):
            assert key in summary, key
        assert summary["method"] == method and summary["num_samples"] == 5 and summary["generated_tokens"] == 15
        assert summary["kv_max"] == {"fkv": None, "ed": 2, "bm": 512}[method]
        assert summary["accuracy"] == pytest.approx(3 / 5)
        rows = [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == ["0", "1", "2", "3", "4"]
        assert tuple(rows[0]) == ("id", "prompt_tokens", "output", "reference", "correct", "generated_tokens")
    printed = capsys.readouterr().out
    assert printed == (out / "report.md").read_text()
    assert "| BM | 2 | 512 | 0.600 | 3/5 |" in printed
    resolved = parse_args(["--config", str(out / "config.yaml")])
    assert resolved.model.device == "cpu" and resolved.sweep.batch_size == 2 and resolved.data.path == fake_stack.data
    # One untimed warm-up per method (2 new tokens, at most 8 prompt tokens), then 3 methods x 3 batches.
    warm, timed = fake_stack.calls[:3], fake_stack.calls[3:]
    assert [c["method"].name for c in warm] == ["fkv", "ed", "bm"]
    assert all(c["max_new_tokens"] == 2 and c["batch"] == 1 for c in warm)
    assert len(timed) == 9 and all(c["max_new_tokens"] == 3 for c in timed)
    # The same command again: every run is finished, nothing is generated, the same report is printed.
    assert cli.main(argv) == 0
    assert len(fake_stack.calls) == 12 and capsys.readouterr().out == printed


def test_run_py_single_method_layout(tmp_path, capsys, fake_stack):
    out = tmp_path / "res"
    rc = cli.main(
        [
            "--data",
            fake_stack.data,
            "--out",
            str(out),
            "--method",
            "ed",
            "--kv-max",
            "8",
            "--num-samples",
            "3",
            "--device",
            "cpu",
            "--log-level",
            "WARNING",
            "--scheduler",
            "static",  # the fake engine's batches
        ]
    )
    assert rc == 0
    assert sorted(os.listdir(out / "ed-b4-kv8")) == ["batches.jsonl", "samples.jsonl", "summary.json"]
    summary = json.loads((out / "ed-b4-kv8" / "summary.json").read_text())
    assert summary["method"] == "ed" and summary["kv_max"] == 8 and summary["num_samples"] == 3
    assert capsys.readouterr().out.startswith("# Batch-Max results: jsonl")


# ---------------------------------------------------------------------- which job runs
def _job(argv) -> dict:
    cfg = parse_args(argv)
    return {**cfg.to_dict(), "main_job": cfg.main_job}


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--out", "results/x"], "out"),
        (["--data", str(ROOT / "batchmax_tp" / "fixtures" / "long_qa.jsonl")], "data"),
        (["--model", "some/model"], "model"),
    ],
)
def test_a_flag_changes_what_it_names_and_keeps_the_main_job(argv, key):
    """``--out``, ``--data``, ``--model`` run the same job as a plain run, apart from the field they name."""
    value = argv[1]
    plain, flagged = _job([]), _job(argv)
    assert plain["main_job"] is True and flagged["main_job"] is True
    assert flagged[key] == value and plain[key] != value
    assert {k: v for k, v in flagged.items() if k != key} == {k: v for k, v in plain.items() if k != key}


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-samples", "3"],
        ["--max-new-tokens", "8"],
        ["--device", "cpu"],
        ["--dtype", "float32"],
        ["--task", "gsm8k"],
        ["--memory-budget", "2GiB"],  # the main job's budget instead of FKV's at batch 4
        ["--rule", "snapkv"],
        ["--p", "32"],
        ["--seed", "3"],
        ["--log-level", "DEBUG"],
        ["--scheduler", "continuous"],
        ["--same-memory"],
        ["--local_rank", "0"],
    ],
)
def test_other_flags_keep_the_main_job(argv):
    assert parse_args(argv).main_job


@pytest.mark.parametrize(
    "argv, yaml_data",
    [
        (["--method", "bm"], {"method": "bm"}),
        (["--method", "fkv,ed,bm"], {"methods": ["fkv", "ed", "bm"]}),  # even the default list: it is a listing
        (["--batch-size", "4"], {"batch_size": 4}),
        (["--kv-max", "256"], {"kv_max": 256}),
        (["--procedure", "paper", "--memory-budget", "2GiB"], {"procedure": "tune", "memory_budget": "2GiB"}),
        (["--no-same-memory"], {"same_memory": False}),
        (None, {"runs": [{"method": "fkv", "batch_size": 2}]}),
    ],
)
def test_each_listing_key_leaves_the_main_job(tmp_path, argv, yaml_data):
    if argv is not None:
        assert not parse_args(argv).main_job
    assert not parse_args(["--config", _write_yaml(tmp_path, yaml_data)]).main_job
    if "method" not in yaml_data:  # the flat keys, as RunConfig takes them
        assert not RunConfig(**yaml_data).main_job


def test_null_listing_keys_keep_the_main_job_and_same_memory_forces_it(tmp_path):
    assert parse_args(["--kv-max", "null", "--procedure", "null"]).main_job
    assert parse_args(["--config", _write_yaml(tmp_path, {"runs": None, "kv_max": None})]).main_job
    assert parse_args(["--same-memory", "--rule", "snapkv"]).main_job
    # the main job reads neither methods nor batch_size: set, they are refused, not silently ignored
    assert _error_of(["--method", "bm", "--same-memory"]).startswith("methods:")
    assert _error_of(["--config", _write_yaml(tmp_path, {"same_memory": True, "batch_size": 2})]).startswith(
        "batch_size:"
    )
    assert parse_args(["--config", _write_yaml(tmp_path, {"same_memory": True, "batch_size": 4})]).main_job
    assert not parse_args(["--config", str(ROOT / "configs" / "default.yaml")]).main_job  # it lists its runs
    for data in ({"same_memory": True, "runs": [{"method": "fkv", "batch_size": 1}]},
                 {"same_memory": True, "procedure": "paper", "memory_budget": "2GiB"}):  # fmt: skip
        assert _error_of(["--config", _write_yaml(tmp_path, data)]).startswith("same_memory:")


def test_saved_config_keeps_its_resume_key(tmp_path):
    """``OUT/config.yaml`` holds the flat keys as before the configuration came in parts: results made earlier
    resume (``results.check_same_config``), the main job's too."""
    keys = set(RunConfig().to_dict())
    assert keys == {
        *"model methods rule kv_max p batch_size max_new_tokens ignore_eos data num_samples out dtype device".split(),
        *"seed do_sample temperature top_k top_p log_level tp_size dp_size setup_timeout same_memory task".split(),
        *"num_shots max_input_tokens metric runs memory_budget procedure kv_values target scheduler".split(),
        "prefill_budget",
        "compile",
        "cheaper_rules",
        "max_prompts",
        "bm_chunk",
    }
    cfg = parse_args(["--out", str(tmp_path)]).replace(device="cpu", dtype="float32", tp_size=1, dp_size=1)
    assert cfg.main_job and cfg.to_dict()["same_memory"] is None  # as a plain run wrote it
    write_config(tmp_path, cfg)
    assert results.check_same_config(tmp_path, cfg.to_dict())
    saved = tmp_path / "config.yaml"  # written before `compile` existed: it changes no output, so it resumes
    for key in ("compile: auto", "cheaper_rules: true", "max_prompts: 64", "bm_chunk: 0"):  # keys added later: a
        # folder written before them resumes (the first two change no output; the main job filled up to 64 prompts
        # before the third and ran BM's passes of one block before the fourth)
        text = saved.read_text()
        assert f" {key}," in text
        saved.write_text(text.replace(f" {key},", ""))
        assert results.check_same_config(tmp_path, cfg.replace(compile="default").to_dict())


def test_help_names_the_flags_that_leave_the_main_job(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "runs unless the configuration lists its runs: --method, --kv-max, --batch-size, --procedure" in text
    assert text.count("[lists the runs: leaves the main job]") == 4


def test_bm_chunk_gives_the_main_jobs_bm_runs_wide_passes_and_no_other_method():
    """``--bm-chunk N``: both of the main job's BM runs (the paper's rule and the best) prefill in wide passes of N
    columns; FKV, ED and snap are as without it; an out-of-range value is one line."""
    plain = parse_args([]).sweep.story_methods()
    wide = parse_args(["--bm-chunk", "2048"]).sweep.story_methods()
    assert [m.name for m in wide] == [m.name for m in plain]
    for a, b in zip(plain, wide):
        assert b.wide == (b.name == "bm") and getattr(b, "chunk", 0) == (
            2048 if b.name == "bm" else getattr(a, "chunk", 0)
        )
    assert _error_of(["--bm-chunk", "-1"]).startswith("bm_chunk:")
