"""Every value checked before anything loads: a bad configuration is one ``error: <key>: <problem>`` line on stderr,
exit status 2, nothing written and no model loaded.

The configuration's own verdict (``batchmax_tp.cli.main`` before the job) runs in-process; a few cases run as real
``launch/run.py`` processes too (with ``-X importtime``: torch is never imported). The checks that need the model's
configuration (its context length) or the file system (the ``--out`` folder) or the hub run at the job's set-up,
still before any weight loads. A property-based test (Hypothesis) throws generated YAML files and flag lists at the
whole configuration surface: each parses into a valid configuration, whose saved ``config.yaml`` loads back into the
same job, or ends with exactly one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchmax_tp import cli
from batchmax_tp.config import ConfigError, RunConfig, build_parser, parse_args
from batchmax_tp.eval import results
from batchmax_tp.eval.summary import write_config

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "launch" / "run.py"


def _main(argv: list[str]) -> tuple[int, str, str]:
    """``cli.main(argv)`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _assert_refused(argv: list[str], key: str, out: Path) -> str:
    """Exit status 2, nothing on stdout, one ``error: <key>: ...`` line on stderr, ``out`` not made."""
    rc, stdout, stderr = _main([*argv, "--out", str(out)])
    assert rc == 2 and stdout == "", (rc, stdout, stderr)
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: {key}: "), stderr
    assert not out.exists()
    return stderr


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------- the configuration's verdict
@pytest.mark.parametrize(
    "text, key",
    [
        ("temperature: .nan\n", "temperature"),
        ("do_sample: true\ntemperature: .inf\n", "temperature"),
        ("do_sample: true\ntop_p: .nan\n", "top_p"),
        ("procedure: tune\nmemory_budget: 2GiB\ntarget: -.inf\n", "target"),
        ("max_new_tokens: 1000000000000\n", "max_new_tokens"),
        ("seed: -1\n", "seed"),
        ("same_memory: true\nmethods: [bm]\n", "methods"),
        ("methods: [ed]\nrule: question\n", "rule"),
        ("runs: [{method: fkv, batch_size: 2}]\nbatch_size: 8\n", "batch_size"),
        ("runs: [{method: fkv, batch_size: 2}]\nkv_max: 256\n", "kv_max"),
        ("runs: [{method: ed, batch_size: 2}]\nrule: question\n", "rule"),
        ("runs: [{method: bm, batch_size: 100000000}]\n", "runs[0].batch_size"),
        ('model: "a\\0b"\n', "model"),
    ],
)
def test_bad_yaml_values_are_one_line_exit_2(tmp_path, no_model_load, text, key):
    _assert_refused(["--config", _yaml(tmp_path, text)], key, tmp_path / "out")


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--temperature", "nan"], "temperature"),
        (["--do-sample", "--temperature", "inf"], "temperature"),
        (["--do-sample", "--temperature", "0"], "temperature"),
        (["--target", "inf"], "target"),
        (["--procedure", "tune", "--memory-budget", "2GiB", "--target", "1.5"], "target"),
        (["--max-new-tokens", "1000000000000"], "max_new_tokens"),
        (["--batch-size", "1000000000", "--method", "bm"], "batch_size"),
        (["--kv-max", "99999999999"], "kv_max"),
        (["--setup-timeout", "100000000000000"], "setup_timeout"),
        (["--memory-budget", "inf"], "memory_budget"),
        (["--memory-budget", "1e400GiB"], "memory_budget"),
        (["--memory-budget", "2000000EiB"], "memory_budget"),
        (["--seed", "-1"], "seed"),
        # flags the job would silently ignore
        (["--same-memory", "--method", "bm"], "methods"),
        (["--same-memory", "--batch-size", "8"], "batch_size"),
        (["--method", "ed", "--rule", "question"], "rule"),
        (["--method", "fkv", "--kv-max", "256"], "kv_max"),
        (["--procedure", "paper", "--memory-budget", "2GiB", "--method", "bm"], "methods"),
        (["--procedure", "paper", "--memory-budget", "2GiB", "--kv-max", "256"], "kv_max"),
        (["--temperature", "0.7"], "temperature"),
        (["--top-k", "5"], "top_k"),
        (["--method", "bm", "--scheduler", "static", "--prefill-budget", "16"], "prefill_budget"),
        (["--kv-values", "256"], "kv_values"),
        (["--target", "0.5"], "target"),
        # snap's own parameters (--method snap:key=value,...)
        (["--method", "snap:window=600"], "methods"),  # window >= kv_max (512)
        (["--method", "snap", "--kv-max", "32"], "kv_max"),  # kv_max <= window (32)
        (["--method", "snap:window=0"], "methods"),
        (["--method", "snap:window=1.5"], "methods"),
        (["--method", "snap:kernel=x"], "methods"),
        (["--method", "snap:kernel=4"], "methods"),
        (["--method", "snap:windw=16"], "methods"),
        (["--method", "snap", "--rule", "question"], "rule"),
        # FKV's block size (--method fkv:block=N; 0: fixed-capacity slots)
        (["--method", "fkv:block=-1"], "methods"),
        (["--method", "fkv:block=x"], "methods"),
        (["--method", "fkv:block=1.5"], "methods"),
        (["--config", "RUNS_SNAP_RULE"], "runs[0].rule"),
        # argparse's own errors name the key
        (["--batch-size", "four"], "batch_size"),
        (["--temperature", "warm"], "temperature"),
        (["--ignore-eos", "--no-ignore-eos"], "ignore_eos"),
        (["--max-new-tokens"], "max_new_tokens"),
        (["--method"], "methods"),
    ],
)
def test_bad_flags_are_one_line_exit_2(tmp_path, no_model_load, argv, key):
    if "RUNS_SNAP_RULE" in argv:
        argv = ["--config", _yaml(tmp_path, "runs: [{method: snap, batch_size: 2, rule: question}]\n")]
    _assert_refused(argv, key, tmp_path / "out")


def test_ignored_flags_name_the_reason(tmp_path, no_model_load):
    line = _assert_refused(["--method", "ed", "--rule", "question"], "rule", tmp_path / "out")
    assert "applies to method bm only" in line  # as a runs entry {method: ed, rule: question} says
    line = _assert_refused(["--same-memory", "--batch-size", "8"], "batch_size", tmp_path / "out")
    assert "main job" in line and "--no-same-memory" in line
    assert "--do-sample" in _assert_refused(["--temperature", "0.7"], "temperature", tmp_path / "out")
    for argv in (["--same-memory"], ["--same-memory", "--rule", "question"], ["--method", "bm", "--rule", "question"]):
        parse_args(argv)  # what they would be with: fine
    parse_args(["--do-sample", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9"])
    parse_args(["--procedure", "tune", "--memory-budget", "2GiB", "--target", "0.9", "--kv-values", "256"])
    # the methods the tuner chooses among; ED is never a pick (its slots keep one pair)
    tune = ["--procedure", "tune", "--memory-budget", "2GiB"]
    assert parse_args([*tune, "--method", "fkv,bm,snap:window=16"]).sweep.methods == ["fkv", "bm", "snap:window=16"]
    assert "ed is not one to pick" in _assert_refused([*tune, "--method", "ed,bm"], "methods", tmp_path / "out")
    assert "--method" in _assert_refused([*tune, "--batch-size", "8"], "batch_size", tmp_path / "out")


@pytest.mark.parametrize(
    "argv, key, hint",
    [
        (["--max-new-token", "5"], "--max-new-token", "did you mean --max-new-tokens?"),
        (["--batch_size", "3"], "--batch_size", "did you mean --batch-size?"),
        (["--temprature=0.5"], "--temprature", "did you mean --temperature?"),
        (["--zzzzzz"], "--zzzzzz", "--help lists them"),
        (["stray"], "stray", "unexpected argument"),
    ],
)
def test_unknown_flags_get_the_closest_known_one(tmp_path, no_model_load, argv, key, hint):
    assert hint in _assert_refused(argv, key, tmp_path / "out")


def test_out_under_a_regular_file_is_refused_before_the_job(tmp_path, no_model_load):
    (tmp_path / "file").write_text("x")
    rc, _, stderr = _main(["--out", str(tmp_path / "file" / "sub")])
    assert rc == 2 and stderr.count("\n") == 1 and stderr.startswith("error: out: cannot create "), stderr
    assert sorted(os.listdir(tmp_path)) == ["file"]


# ---------------------------------------------------------------------- at the job's set-up, before any weight
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_out_that_cannot_be_created_is_one_line_before_the_model(no_model_load):
    rc, stdout, stderr = _main(["--out", "/proc/batchmax-no-such/x", "--device", "cpu"])
    assert rc == 2 and stdout == "" and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: out: cannot create /proc/batchmax-no-such/x"), stderr


def test_out_that_cannot_be_written_is_one_line_before_the_model(tmp_path, monkeypatch, no_model_load):
    import batchmax_tp.job as job

    monkeypatch.setattr(job.os, "access", lambda path, mode: False)  # as for another user's folder (tests run as root)
    line = _assert_refused(["--device", "cpu"], "out", tmp_path / "new" / "out")
    assert "cannot write into" in line and os.listdir(tmp_path) == []


def test_max_new_tokens_beyond_the_models_context(tmp_path, no_model_load):
    """The model's configuration (no weights) bounds max_new_tokens; the refused job leaves no folder behind."""
    argv = ["--model", "arch:llama-2-7b", "--device", "cpu", "--method", "fkv", "--max-new-tokens", "4096"]
    line = _assert_refused(argv, "max_new_tokens", tmp_path / "a" / "out")
    assert "4096-token context" in line and "at most 4095" in line
    assert os.listdir(tmp_path) == []  # the folders made at set-up are removed again


def test_hub_model_neither_local_nor_cached_with_the_hub_unreachable(tmp_path, monkeypatch, no_model_load):
    """No network: a hub id that is not cached fails in one line within seconds, saying how to point at a copy."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    line = _assert_refused(["--model", "nobody/not-cached-model", "--device", "cpu"], "model", tmp_path / "out")
    assert "not a local directory nor in the local Hugging Face cache" in line and "unreachable" in line
    assert "HF_HUB_OFFLINE=1" in line and "--model /path/to/model" in line


# ---------------------------------------------------------------------- at set-up, on a fresh machine
#: Files of every kind a user may point --data at, by name (``_data_file``).
_DATA = {
    "empty.jsonl": "",
    "blank.jsonl": "\n\n",
    "broken.jsonl": '{"id": 1, "prompt": "x"\n',
    "no-prompt.jsonl": '{"id": 1, "reference": "x"}\n',
    "empty-prompt.jsonl": '{"id": 1, "prompt": ""}\n',
    "number-prompt.jsonl": '{"id": 1, "prompt": 7}\n',
    "list.jsonl": "[1, 2]\n",
    "twice.jsonl": '{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n',
    "no-id.jsonl": '{"prompt": "a"}\n',
}


def _data_file(folder: Path, name: str) -> str:
    if name == "missing.jsonl":
        return str(folder / name)
    if name == "folder":
        (folder / "folder").mkdir(exist_ok=True)
        return str(folder / "folder")
    (folder / name).write_text(_DATA[name])
    return str(folder / name)


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch, no_model_load) -> Path:
    """A machine where the embedded model was never converted (an empty ``BATCHMAX_CACHE``): a check that read more
    than the model's configuration would convert it (30-60 s) into this folder."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("BATCHMAX_CACHE", str(cache))
    return cache


@pytest.mark.parametrize(
    "argv, key, says",
    [
        # data files, read and checked first
        (["--data", "DATA:missing.jsonl"], "data", "not found"),
        (["--data", "DATA:folder"], "data", "not found"),
        (["--data", "DATA:empty.jsonl"], "data", "no samples"),
        (["--data", "DATA:blank.jsonl"], "data", "no samples"),
        (["--data", "DATA:broken.jsonl"], "data", "invalid JSON"),
        (["--data", "DATA:no-prompt.jsonl"], "data", "prompt"),
        (["--data", "DATA:empty-prompt.jsonl"], "data", "prompt"),
        (["--data", "DATA:number-prompt.jsonl"], "data", "prompt"),
        (["--data", "DATA:list.jsonl"], "data", "expected a JSON object"),
        (["--data", "DATA:twice.jsonl"], "data", "duplicate id"),
        (["--data", "DATA:no-id.jsonl"], "data", "missing 'id'"),
        (["--task", "gsm8k", "--data", "DATA:missing.jsonl"], "data", "task gsm8k needs"),
        (["--task", "narrativeqa", "--data", "DATA:folder"], "data", "cannot load task narrativeqa"),
        # rule parameters the model's heads refuse (the embedded model: 3 KV heads; Llama-2-7B: 32)
        (["--method", "bm", "--rule", "question:share=5"], "rule", "share=5 does not divide the 3 KV heads"),
        (["--method", "bm", "--rule", "paper:share=2"], "rule", "share=2 does not divide the 3 KV heads"),
        (["--method", "fkv,bm", "--rule", "snapkv:share=4"], "rule", "share=4 does not divide"),
        (["--rule", "question:share=2"], "rule", "share=2 does not divide"),  # the main job's second BM
        (["--same-memory", "--rule", "pooled:share=2"], "rule", "share=2 does not divide"),
        (["--procedure", "tune", "--memory-budget", "2GiB", "--rule", "paper:share=2"], "rule", "does not divide"),
        (["--procedure", "paper", "--memory-budget", "2GiB", "--rule", "paper:share=2"], "rule", "does not divide"),
        (["--model", "arch:llama-2-7b", "--method", "bm", "--rule", "paper:share=3"], "rule", "the 32 KV heads"),
        # what the model's configuration bounds
        (["--max-new-tokens", "8192"], "max_new_tokens", "8192-token context"),
        (["--do-sample", "--top-k", "100000"], "top_k", "vocabulary"),
        (["--memory-budget", "1MiB"], "memory_budget", "below the"),
        (["--tp-size", "2"], "tp_size", "not a multiple of tp_size 2"),
        (["--dp-size", "2"], "dp_size", "make 1 data-parallel"),
        (["--model", "/no/such/model"], "model", "no such directory"),
        (["--model", "arch:no-such-arch"], "model", "no architecture"),
    ],
)
def test_bad_values_needing_the_model_or_data_are_one_line_before_any_conversion(
    tmp_path, fresh_machine, argv, key, says
):
    """Checked at the job's set-up from the data file and the model's configuration alone: one line, exit 2,
    nothing written (no ``--out`` folder, no converted model)."""
    argv = [_data_file(tmp_path, a.removeprefix("DATA:")) if a.startswith("DATA:") else a for a in argv]
    line = _assert_refused([*argv, "--device", "cpu"], key, tmp_path / "out")
    assert says in line, line
    assert list(fresh_machine.iterdir()) == [], "the embedded model was converted for a refused job"


def test_run_py_refuses_a_share_the_heads_refuse_on_a_fresh_machine(tmp_path):
    """As the issue met it (a 114-line traceback): a real process, the embedded model not converted yet: one line,
    exit 2, nothing written, nothing converted."""
    cache = tmp_path / "cache"
    cache.mkdir()
    args = ["--method", "bm", "--rule", "question:share=5", "--out", str(tmp_path / "out")]
    proc, lines, _ = _run_py(args, tmp_path, importtime=False, env={"BATCHMAX_CACHE": str(cache)})
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: rule: rule 'question': share=5 does not divide the 3 KV heads"), lines
    assert sorted(os.listdir(tmp_path)) == ["cache"] and os.listdir(cache) == []


# ---------------------------------------------------------------------- OUT/config.yaml reruns its job
@pytest.mark.parametrize(
    "argv",
    [
        [],  # the main job
        ["--same-memory"],
        ["--same-memory", "--kv-max", "256", "--rule", "snapkv"],
        ["--method", "bm", "--kv-max", "256"],
        ["--method", "fkv,ed,bm"],  # the default methods, listed
        ["--no-same-memory"],
        ["--procedure", "tune", "--memory-budget", "2GiB", "--target", "0.9"],
    ],
)
def test_saved_config_reruns_the_job_that_wrote_it(tmp_path, argv):
    out = tmp_path / "out"
    cfg = parse_args([*argv, "--out", str(out)]).replace(device="cpu", dtype="float32", tp_size=1, dp_size=1)
    write_config(out, cfg)
    again = parse_args(["--config", str(out / "config.yaml")])
    assert again == cfg and again.main_job == cfg.main_job
    assert results.check_same_config(out, cfg.to_dict()) and results.check_same_config(out, again.to_dict())


def test_main_job_folders_written_before_still_resume(tmp_path):
    """A main job's config.yaml written before kept ``methods`` and ``batch_size``: the resume key is unchanged."""
    cfg = parse_args(["--out", str(tmp_path)]).replace(device="cpu", dtype="float32", tp_size=1, dp_size=1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # the old layout
    assert results.check_same_config(tmp_path, cfg.to_dict())
    write_config(tmp_path, cfg)
    assert "methods" not in yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert results.check_same_config(tmp_path, cfg.to_dict())


# ---------------------------------------------------------------------- real processes
def _run_py(args: list[str], cwd: Path, *, importtime: bool = True, env: dict | None = None):
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), str(RUN_PY), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=180, env=env)
    lines = proc.stderr.splitlines()
    imports = [line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")]
    return proc, [line for line in lines if not line.startswith("import time:")], imports


@pytest.mark.parametrize(
    "args, key",
    [
        (["--config", "CFG"], "temperature"),
        (["--same-memory", "--method", "bm"], "methods"),
        (["--method", "ed", "--rule", "question"], "rule"),
        (["--max-new-token", "5"], "--max-new-token"),
        (["--target", "inf"], "target"),
    ],
)
def test_run_py_refuses_in_one_line_without_torch(tmp_path, args, key):
    (tmp_path / "cfg.yaml").write_text("temperature: .nan\n")
    out = tmp_path / "out"
    args = [str(tmp_path / "cfg.yaml") if a == "CFG" else a for a in args]
    proc, lines, imports = _run_py([*args, "--out", str(out)], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}: "), lines
    assert "yaml" in imports and "torch" not in imports and "transformers" not in imports
    assert sorted(os.listdir(tmp_path)) == ["cfg.yaml"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_run_py_out_that_cannot_be_created(tmp_path):
    """Checked at set-up (torch is imported by then) but before the model: one line, no traceback, exit 2."""
    proc, lines, _ = _run_py(["--out", "/proc/batchmax-no-such/x", "--device", "cpu"], tmp_path, importtime=False)
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: out: cannot create /proc/batchmax-no-such/x") and os.listdir(tmp_path) == []


def test_run_py_hub_model_not_cached_with_the_hub_unreachable(tmp_path):
    """As a user meets it: no HF_HUB_OFFLINE, an endpoint nothing answers on, an empty cache: one line within
    seconds of the set-up (the hub client's retries took 20 s and more), exit 2, nothing written."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}
    env["TRANSFORMERS_OFFLINE"] = ""
    proc, lines, _ = _run_py(
        ["--model", "nobody/not-cached-model", "--device", "cpu", "--out", str(tmp_path / "out")],
        tmp_path,
        importtime=False,
        env=env,
    )
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: model: ") and "unreachable" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------- the whole surface, generated
_FLAGS = sorted(
    flag
    for flag in build_parser()._option_string_actions
    if flag.startswith("--") and flag not in ("--help", "--list-rules", "--list-methods", "--config")
)
_WILD_NUMBERS = st.one_of(
    st.integers(-3, 5000),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e-9, 1e308]),
)
_WORDS = [
    *"bm ed fkv paper question snapkv:window=64 sinks 2GiB 512MiB cpu cuda cuda:0 auto float16 float32 DEBUG".split(),
    *"static continuous tune none default cudagraphs jsonl gsm8k rouge2 contains null true false -1 0 1 4 nan".split(),
    *"inf -inf 1e999 0.5 1.5 128,256 256 x".split(),
    "",
]
_WILD_TEXT = st.one_of(st.sampled_from(_WORDS), st.text(max_size=8))
_SCALARS = st.one_of(st.none(), st.booleans(), _WILD_NUMBERS, _WILD_TEXT)
_RUN_ENTRY = st.fixed_dictionaries(
    {
        "method": st.one_of(st.sampled_from(["bm", "ed", "fkv"]), _SCALARS),
        "batch_size": st.one_of(st.integers(-1, 9), _SCALARS),
    },
    optional={
        "kv_max": st.one_of(st.sampled_from([2, 256, 512, None]), _SCALARS),
        "rule": st.one_of(st.sampled_from(["paper", "question"]), _SCALARS),
        "bogus": _SCALARS,
    },
)
_WILD = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3), st.lists(_RUN_ENTRY, max_size=2))
#: Values each key may well have (so that valid configurations come up as often as wrong ones).
_PLAUSIBLE = {
    "model": [None, "arch:llama-2-7b"],
    "methods": [["bm"], ["fkv", "ed"], "bm", ["fkv", "ed", "bm"]],
    "method": ["bm", "ed"],
    "rule": ["paper", "question", "snapkv:window=64"],
    "kv_max": [None, 2, 256, 512],
    "p": [32, 64],
    "batch_size": [1, 4, 8],
    "runs": [None, [{"method": "bm", "batch_size": 2, "kv_max": 256}], [{"method": "ed", "batch_size": 1}]],
    "same_memory": [None, True, False],
    "scheduler": [None, "static", "continuous"],
    "compile": ["auto", "none", "default", "cudagraphs"],
    "prefill_budget": [None, 16],
    "max_new_tokens": [1, 24, 64],
    "ignore_eos": [True, False],
    "seed": [0, 3],
    "do_sample": [False, True],
    "temperature": [1.0, 0.7, 1],
    "top_k": [0, 5],
    "top_p": [1.0, 0.9],
    "task": ["jsonl", "gsm8k"],
    "data": [None],
    "num_samples": [None, 3],
    "num_shots": [None, 0, 2],
    "max_input_tokens": [3584, None, 100],
    "metric": [None, "contains", "rouge2"],
    "memory_budget": [None, "2GiB", 10**9],
    "procedure": [None, "paper", "tune"],
    "kv_values": [None, [128, 256]],
    "target": [0.95, 0.9],
    "tp_size": [None, 1, 2],
    "dp_size": [None, 1],
    "setup_timeout": [1800, 60],
    "dtype": ["auto", "float32"],
    "device": ["auto", "cpu"],
    "log_level": ["INFO", "debug"],
}
_KEYS = [*RunConfig.keys(), "method", "batchsize", "batch-size", "temprature", "Method"]
_KEYS.remove("out")  # always the test's own folder


def _value(key: str):
    if key not in _PLAUSIBLE:
        return _WILD
    plausible = st.sampled_from(_PLAUSIBLE[key])
    return st.one_of(plausible, plausible, plausible, _WILD)  # mostly plausible: valid configurations come up too


_YAMLS = st.lists(st.sampled_from(_KEYS), unique=True, max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({key: _value(key) for key in keys})
)
_FLAG_TEXT = st.one_of(st.sampled_from(_WORDS), st.text(max_size=6), st.integers(-(2**40), 2**40).map(str))
_WILD_PAIR = st.tuples(
    st.one_of(st.sampled_from(_FLAGS), st.sampled_from(_FLAGS).map(lambda f: f[:-1]), st.just("--bogus")),
    st.one_of(st.none(), _FLAG_TEXT),
).map(lambda pair: [pair[0]] if pair[1] is None else list(pair))
#: Flags with values that are fine on their own (together they may still contradict each other).
_GOOD_PAIR = st.sampled_from(
    [
        *(["--method", m] for m in ("bm", "ed", "fkv", "fkv,bm")),
        *(["--kv-max", k] for k in ("2", "256", "null")),
        ["--batch-size", "8"],
        ["--rule", "question"],
        ["--same-memory"],
        ["--no-same-memory"],
        ["--do-sample"],
        ["--temperature", "0.7"],
        ["--top-k", "5"],
        ["--procedure", "tune"],
        ["--procedure", "paper"],
        ["--memory-budget", "2GiB"],
        ["--kv-values", "256,384"],
        ["--target", "0.9"],
        ["--scheduler", "static"],
        ["--prefill-budget", "16"],
        ["--compile", "none"],
        ["--max-new-tokens", "8"],
        ["--seed", "3"],
        ["--device", "cpu"],
        ["--task", "gsm8k"],
        ["--max-input-tokens", "100"],
    ]
)
_ARGVS = st.lists(st.one_of(_GOOD_PAIR, _GOOD_PAIR, _GOOD_PAIR, _WILD_PAIR), max_size=4).map(
    lambda pairs: [token for pair in pairs for token in pair]
)


def _verdict(argv: list[str], folder: Path) -> RunConfig | None:
    """parse_args' verdict on ``argv`` (+ ``--out``): a valid configuration whose saved config.yaml loads back into
    the same job, or exactly one ``error:`` line and exit status 2 from ``cli.main`` with nothing written."""
    out = folder / "out"
    argv = [*argv, "--out", str(out)]
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        rc, stdout, stderr = _main(argv)
        assert rc == 2 and stdout == "", (argv, rc, stdout, stderr)
        assert stderr == f"error: {' '.join(str(err).split())}\n", (argv, stderr)
        assert not out.exists()
        return None
    assert isinstance(cfg, RunConfig)
    saved = folder / "saved.yaml"
    saved.write_text(cfg.to_yaml())
    again = parse_args(["--config", str(saved)])
    assert again == cfg and again.main_job == cfg.main_job, argv
    assert not out.exists()
    return cfg


_SETTINGS = settings(
    max_examples=250, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@_SETTINGS
@given(data=_YAMLS, argv=_ARGVS)
def test_generated_yaml_and_flags_parse_or_fail_in_one_line(data, argv):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "cfg.yaml"
        path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        _verdict(["--config", str(path), *argv], folder)


@_SETTINGS
@given(argv=_ARGVS)
def test_generated_flags_parse_or_fail_in_one_line(argv):
    with tempfile.TemporaryDirectory() as tmp:
        _verdict(argv, Path(tmp))
