"""A pytest plugin: under ``scripts/test.sh`` (``BATCHMAX_REQUIRE_DEPS=1``) a test or test module skipped for the
lack of a dependency the CPU suite needs fails the run, so a suite whose tensor-parallel or lm-eval tests all skip
cannot pass. Elsewhere (the GPU machine's package set has no lm-eval) such skips stay skips; CUDA skips always do.
"""

from __future__ import annotations

import os
import re

import pytest

#: What the CPU suite's tests need and ``scripts/setup.sh`` installs, as a skip reason names it.
REQUIRED_DEPS = ("deepspeed", "lm_eval", "torchrun", "mpiexec", "mpi4py", "bash", "/proc", "kvpress")
_missing: list[str] = []

#: The forms in which a skip reason names the dependency it lacks: ``needs NAME ...``, ``NAME is not installed``
#: and pytest.importorskip's ``could not import 'NAME'``. Only a whole name in one of them counts: a reason that
#: merely contains a dependency's name ("... not fetched: bash scripts/accuracy_model.sh") is another skip.
_FORMS = (
    re.compile(r"^needs (?P<dep>[^\s(:,;]+)"),
    re.compile(r"^(?P<dep>\S+) is not installed\b"),
    re.compile(r"^could not import '(?P<dep>[^']+)'"),
)


def missing_dependency(reason: str) -> str | None:
    """The required dependency a skip reason says is missing (one of ``REQUIRED_DEPS``, by its whole name), or
    None. pytest writes skip-mark reasons behind "Skipped: "."""
    reason = reason.strip().removeprefix("Skipped: ")
    for form in _FORMS:
        found = form.match(reason)
        if found is not None and found["dep"] in REQUIRED_DEPS:
            return found["dep"]
    return None


def _note(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[-1])
        if missing_dependency(reason) is not None:
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
