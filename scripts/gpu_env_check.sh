#!/usr/bin/env bash
# The GPU machine's package set, proven on this CPU machine before a GPU ever runs it: a virtualenv with that
# machine's packages (scripts/gpu_machine.txt: its transformers 5.17, none of lm-eval, deepspeed, datasets,
# rouge-score, gguf), the wheel list (scripts/gpu_wheels.txt) installed offline from a folder the way
# scripts/gpu_check.sh installs it, then the GPU check's collection and the CPU tests of the core and engine.
#   bash scripts/gpu_env_check.sh          # CI runs it after the test command; ~4 minutes on 2 cores
# A wheel missing from the folder, a package the list forgot, or an API that transformers 5.17 lacks fails here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
ENV="${GPU_ENV:-/tmp/batchmax_gpu_env}"
WHL="${GPU_WHEELS:-$ENV/whl}"
fail() { echo "gpu_env_check.sh: FAILED: $*" >&2; exit 1; }

# 1. The wheel folder, built for this Python (the GPU machine's is 3.12), unless GPU_WHEELS names one to check.
if [ -z "${GPU_WHEELS:-}" ]; then
  pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" || fail "no $PY"
  GPU_WHEELS_PYTHON="$pyver" PYTHON="$PY" bash scripts/gpu_wheels.sh "$WHL" || fail "could not make the wheel folder"
fi
bash scripts/gpu_wheels.sh --check "$WHL" || fail "the wheel folder $WHL is incomplete"

# 2. A virtualenv of the GPU machine's packages only (torch: the CPU build, as setup.sh installs it).
if [ ! -x "$ENV/bin/python" ]; then
  "$PY" -m venv "$ENV" || fail "could not create $ENV"
fi
VPY="$ENV/bin/python"
"$VPY" -m pip install -q "torch==2.13.0" -r scripts/gpu_machine.txt || fail "could not install scripts/gpu_machine.txt"

# 3. The wheels, as gpu_check.sh installs them: into a private target, no index, no dependencies.
SITE="$ENV/wheel_site"
rm -rf "$SITE"
"$VPY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHL"/*.whl || fail "wheel install"
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
"$VPY" - <<'PYEOF' || fail "a package of the wheel list does not import (a dependency missing from the list?)"
import importlib, sys
for name in ("deepspeed", "rouge_score.rouge_scorer", "gguf", "nltk", "pydantic"):
    importlib.import_module(name)
for name in ("lm_eval", "datasets"):  # absent there: their tests must skip, not break collection
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name} is installed in the GPU machine's environment, where it is not")
import transformers
print("gpu_env_check.sh: transformers", transformers.__version__, file=sys.stderr)
PYEOF

# 4. The GPU check's collection (every test marked cuda, no collection error), then the CPU tests of the core
#    and engine under this transformers.
"$VPY" -m pytest -q --collect-only -m cuda tests >"$ENV/collect.log" 2>&1 || { cat "$ENV/collect.log" >&2; fail "collecting the cuda tests"; }
grep -q "tests collected" "$ENV/collect.log" || fail "no cuda test collected"
"$VPY" -m pytest -q -p no:cacheprovider tests/test_core.py tests/test_baseline.py tests/test_memory.py \
  tests/test_continuous.py tests/test_rules.py tests/test_reference.py tests/test_planner.py \
  tests/test_arch_models.py tests/test_cuda.py tests/test_gpu_settings.py || fail "the core and engine tests"
echo "gpu_env_check.sh: passed" >&2
