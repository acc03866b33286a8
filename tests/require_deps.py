"""A pytest plugin: under ``scripts/test.sh`` (``BATCHMAX_REQUIRE_DEPS=1``) a test or test module skipped for the
lack of a dependency the CPU suite needs fails the run, so a suite whose tensor-parallel or lm-eval tests all skip
cannot pass. Elsewhere (the GPU machine's package set has no lm-eval) such skips stay skips; CUDA skips always do.
"""

from __future__ import annotations

import os

import pytest

#: What the CPU suite's tests need and ``scripts/setup.sh`` installs, as a skip reason names it.
REQUIRED_DEPS = ("deepspeed", "lm_eval", "torchrun", "mpiexec", "mpi4py", "bash", "/proc")
_missing: list[str] = []


def _note(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[-1])
        if any(dep in reason for dep in REQUIRED_DEPS):
            _missing.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    _note(report)


def pytest_runtest_logreport(report):
    _note(report)


def pytest_sessionfinish(session, exitstatus):
    if _missing and os.environ.get("BATCHMAX_REQUIRE_DEPS") == "1":
        print(f"\nerror: {len(_missing)} skipped for a dependency the suite needs (scripts/setup.sh installs it):")
        for line in _missing[:20]:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
