#!/usr/bin/env bash
# Lint (ruff), then run the test suite offline. Exits non-zero on a lint error, any failure, and when no test
# actually ran.
#   bash scripts/test.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export HF_HUB_OFFLINE=1
export BATCHMAX_REQUIRE_DEPS=1  # a test skipped for a missing dependency (deepspeed, lm-eval, ...) fails the run
# Two workers (pytest-xdist), one thread each: two OpenMP pools of 2 threads on 2 cores would slow both ~10x. The
# tests that start processes run one after another on one worker (tests/conftest.py: PROCESS_MODULES), the
# in-process tests beside them on both (2026-11-28: 7:35 against 11:11 in one process).
export OMP_NUM_THREADS=1
report="$(mktemp -t batchmax_junit.XXXXXX.xml)"
trap 'rm -f "$report"' EXIT

# Lint and format first (settings: pyproject.toml): a lint error fails the run like a failing test.
"$PY" -m ruff check . || exit 1
"$PY" -m ruff format --check . || exit 1

"$PY" -m pytest -q tests -n 2 --dist loadgroup --durations=15 --junitxml="$report" "$@"
rc=$?
if [ "$rc" -ne 0 ]; then
  exit "$rc"  # failures, errors, or 5 = no tests collected
fi
# pytest exits 0 when every test was skipped: count that as "no test ran".
"$PY" - "$report" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
ran = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
if ran <= 0:
    print("test.sh: no test ran", file=sys.stderr)
    sys.exit(1)
PYEOF
