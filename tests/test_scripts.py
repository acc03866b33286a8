"""The shell scripts' own logic, run with a stand-in Python (no GPU, no torch in the child: seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Stands in for $PYTHON in scripts/gpu_check.sh: the CUDA probe, pip and the benchmark succeed, the report reads its
# stdin, and `-m pytest` exits with $FAKE_PYTEST_RC (5: pytest's "no tests ran"); every call is logged.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1 $2" in
  "-m pytest"*) echo "fake pytest: exit $FAKE_PYTEST_RC"; exit "$FAKE_PYTEST_RC" ;;
  "- "*) cat >/dev/null; exit 0 ;;
  *) exit 0 ;;
esac
"""


def _gpu_check(tmp_path: Path, pytest_rc: int) -> subprocess.CompletedProcess:
    stub = tmp_path / "python"
    stub.write_text(FAKE_PYTHON)
    stub.chmod(0o755)
    out = tmp_path / f"out-{pytest_rc}"
    env = {**os.environ, "PYTHON": str(stub), "FAKE_PYTEST_RC": str(pytest_rc), "FAKE_LOG": str(out) + ".log"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_fails_when_pytest_runs_no_tests(tmp_path):
    ok = _gpu_check(tmp_path, 0)
    assert ok.returncode == 0, ok.stderr  # the stand-in is sound: tests and benchmark passing pass
    none = _gpu_check(tmp_path, 5)
    assert none.returncode != 0, "pytest's exit 5 (no tests ran) must fail the GPU check"
    assert "ran no tests" in none.stderr
    failed = _gpu_check(tmp_path, 1)
    assert failed.returncode == 1 and "pytest exit 1" in failed.stderr
    benches = [c for c in (tmp_path / "out-1.log").read_text().splitlines() if "bench_throughput.py" in c]
    assert len(benches) == 3 and "--scheduler continuous" in benches[1]  # every part runs after a failed one
    assert "--compile cudagraphs" in benches[2]


# Stands in for $PYTHON in scripts/test.sh: `-m ruff check` exits $FAKE_RUFF_RC, every call is logged.
FAKE_LINT_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1 $2 $3" in
  "-m ruff check"*) exit "$FAKE_RUFF_RC" ;;
  *) exit 0 ;;
esac
"""


@pytest.mark.parametrize("ruff_rc", [0, 1])
def test_test_command_fails_on_a_lint_error_before_any_test(tmp_path, ruff_rc):
    stub, log = tmp_path / "python", tmp_path / "calls.log"
    stub.write_text(FAKE_LINT_PYTHON)
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "FAKE_RUFF_RC": str(ruff_rc), "FAKE_LOG": str(log)}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh")], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    calls = log.read_text().splitlines()
    assert calls[0].startswith("-m ruff check")
    if ruff_rc:
        assert run.returncode != 0 and calls == [calls[0]]  # nothing else ran: no format check, no pytest
    else:
        assert any(c.startswith("-m ruff format --check") for c in calls)
        assert any(c.startswith("-m pytest") for c in calls)


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.startswith("bash scripts/setup.sh && ")]
    assert commands == [
        "bash scripts/setup.sh && python launch/run.py",
        "bash scripts/setup.sh && bash scripts/test.sh",
    ]
    assert "bash scripts/setup.sh && bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250  # a README a new user reads in five minutes; deep dives live in docs/


def _wheel_specs() -> list[tuple[str, str]]:
    lines = (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    specs = [line.split("#")[0].split()[0] for line in lines if line.split("#")[0].strip()]
    return [tuple(spec.split("==")) for spec in specs]


def test_the_gpu_environment_check_fails_when_a_needed_wheel_is_missing(tmp_path):
    """The wheel folder's check (run first by scripts/gpu_env_check.sh, before any virtualenv is built): a complete
    folder passes; with one wheel removed the check, and the environment check, fail naming it."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for name, version in _wheel_specs():
        (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
    check = ["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), "--check", str(folder)]
    assert subprocess.run(check, capture_output=True, text=True, timeout=60).returncode == 0
    name, version = _wheel_specs()[1]
    (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").unlink()
    run = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"{name}=={version}" in run.stderr
    env = {**os.environ, "GPU_WHEELS": str(folder), "GPU_ENV": str(tmp_path / "env")}
    whole = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_env_check.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert whole.returncode == 1 and f"{name}=={version}" in whole.stderr and "FAILED" in whole.stderr
    assert not (tmp_path / "env").exists()  # nothing built


def _ci_steps() -> list[str]:
    """The scripts ``.ci/run`` calls (``bash scripts/NAME.sh``), in order."""
    import re

    return re.findall(r"bash (scripts/[\w.-]+\.sh)", (ROOT / ".ci" / "run").read_text(encoding="utf-8"))


@pytest.mark.parametrize("failing", [None, *range(3)], ids=["none", "step0", "step1", "step2"])
def test_ci_fails_when_any_step_fails(tmp_path, failing):
    """``.ci/run`` over stand-in scripts (each logs its name and exits 0, or 3 for the failing one): any step's
    failure is the run's (a failing set-up once skipped the tests and passed on the last step's exit status), and
    no step runs after a failed one."""
    steps = _ci_steps()
    assert steps == ["scripts/setup.sh", "scripts/test.sh", "scripts/gpu_env_check.sh"]
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    for i, step in enumerate(steps):
        (tmp_path / step).write_text(f'echo {step} >> "$CI_LOG"\nexit {3 if i == failing else 0}\n')
    log = tmp_path / "calls.log"
    run = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")],
        env={**os.environ, "CI_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    ran = log.read_text().split()
    if failing is None:
        assert run.returncode == 0 and ran == steps, (run.returncode, ran, run.stderr)
    else:
        assert run.returncode == 3 and ran == steps[: failing + 1], (run.returncode, ran, run.stderr)


SKIPS = """
import pytest
pytestmark = pytest.mark.skipif(True, reason="{reason}")

def test_one():
    pass
"""


@pytest.mark.parametrize(
    "reason, required, fails",
    [
        ("needs deepspeed (tensor parallelism across processes)", "1", True),
        ("torchrun is not installed", "1", True),
        ("needs a CUDA device", "1", False),  # CUDA tests skip on this machine kind: that is not a missing package
        ("could not import 'lm_eval': No module named 'lm_eval'", "1", True),  # pytest.importorskip's words
        ("needs /proc (Linux)", "1", True),
        ("needs kvpress (its interpreter /nowhere/python is missing: run bash scripts/peers.sh)", "1", True),
        # an opt-in model not fetched: the reason names "bash" inside a command, not as a missing dependency
        ("Qwen2.5-Coder-0.5B not fetched: bash scripts/accuracy_model.sh qwen2.5-coder-0.5b", "1", False),
        ("needs bashful (a package the suite does not need)", "1", False),  # a whole name, not a prefix
        ("needs deepspeed (tensor parallelism across processes)", "", False),  # the GPU machine's package set
    ],
)
def test_a_module_skipped_for_a_needed_dependency_fails_the_test_command(tmp_path, reason, required, fails):
    """``tests/require_deps.py`` (scripts/test.sh sets BATCHMAX_REQUIRE_DEPS=1): a module whose tests all skip
    for a dependency the suite needs fails pytest, and names it; other skips, and runs without the variable, pass."""
    run = _gated(tmp_path, reason, required)
    if fails:
        assert run.returncode == 1 and f"test_skipped.py::test_one: Skipped: {reason}" in run.stdout, run.stdout
    else:
        assert run.returncode == 0, run.stdout


def test_the_gate_holds_under_two_workers(tmp_path):
    """As ``scripts/test.sh`` runs the suite (``-n 2``, its workers' skips reported to the controller): a test skipped
    for kvpress's missing interpreter fails the run and names the command that makes it."""
    reason = "needs kvpress (its interpreter /nowhere/python is missing: run bash scripts/peers.sh)"
    run = _gated(tmp_path, reason, "1", "-n", "2")
    assert run.returncode == 1 and "run bash scripts/peers.sh" in run.stdout, run.stdout


def _gated(tmp_path, reason: str, required: str, *flags: str) -> subprocess.CompletedProcess:
    """pytest (``flags``) over a module skipped for ``reason`` and one that runs, under ``tests/require_deps.py`` with
    ``BATCHMAX_REQUIRE_DEPS=required``; one test has run, one skipped."""
    (tmp_path / "test_skipped.py").write_text(SKIPS.format(reason=reason))
    (tmp_path / "test_ran.py").write_text("def test_ran():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "BATCHMAX_REQUIRE_DEPS": required}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *flags, "-p", "require_deps", "-p", "no:cacheprovider", str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "1 passed, 1 skipped" in run.stdout, run.stdout
    return run


def test_the_opt_in_models_unfetched_pass_the_test_command(tmp_path):
    """An empty model cache (a fresh machine: no opt-in model fetched): the tests that need the 0.5B/1.5B skip, for
    that reason, and under the test command's settings (BATCHMAX_REQUIRE_DEPS=1) those skips do not fail the run."""
    env = {**os.environ, "BATCHMAX_CACHE": str(tmp_path / "cache"), "BATCHMAX_REQUIRE_DEPS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + ["tests/test_parted.py::test_fkv_on_qwen_equals_hf_generate"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0 and "2 skipped" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("not fetched: bash scripts/accuracy_model.sh") == 2, run.stdout
