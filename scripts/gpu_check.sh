#!/usr/bin/env bash
# GPU check: on a CUDA machine with NO network, run the tests marked `cuda` and the throughput benchmark on an
# architecture-only Llama-2-7b in float16, and write one JSON report.
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default OUT_DIR: results/gpu_check
#
# The machine needs python3 with torch (CUDA), transformers, pytest, pyyaml, tqdm and matplotlib. Anything else
# the project imports there comes from a local wheel folder `.whl/` in the repository root, installed with
# `pip --no-index` into a private target (nothing system-wide changes). Prepare it on a machine WITH network,
# for the GPU machine's Python (3.12): the list is scripts/gpu_wheels.txt, resolved against that machine's
# packages and proven on a CPU by scripts/gpu_env_check.sh (CI):
#
#   echo /.whl/ >> .git/info/exclude && bash scripts/gpu_wheels.sh .whl      # about 7 MiB
#
# Without it the check still runs on one GPU: the tests that need lm-eval, deepspeed or datasets skip.
set -uo pipefail

# pytest_failed NAME RC: whether a pytest run with exit status RC failed, saying why on stderr. Exit 5 ("no tests
# ran": nothing collected, or every test deselected) is a failure here: a check that ran nothing checked nothing.
pytest_failed() {
  case "$2" in
    0) return 1 ;;
    5) echo "gpu_check.sh: FAILED: pytest ran no tests for $1 (exit 5: nothing collected or all deselected)" >&2 ;;
    *) echo "gpu_check.sh: FAILED: pytest exit $2 for $1" >&2 ;;
  esac
  return 0
}

cd "$(dirname "$0")/.."
OUT="${1:-results/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/batchmax_site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/batchmax_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA device")' || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null || true

# Every part runs, whatever an earlier one did; gpu_check.json says pass/fail per part.
# 1. The tests marked for CUDA (they skip themselves without a GPU elsewhere): both engines against the CPU,
#    the planner's peak against the allocator's.
"$PY" -m pytest -q -m cuda tests --junitxml="$OUT/cuda_tests.xml" 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}

# 2. Throughput: FKV, ED (kv_max 2 and 65) and BM at their largest fitting batch under one budget (at most 256),
#    and FKV/ED against plain HF SDPA at the same batch (the static engine, the paper's
#    padded batch). The budget is fixed (40 GiB: comparable across cards, and the run's time bounded); a card with
#    less free memory stops this part in one line: set GPU_CHECK_BUDGET (and a smaller model, GPU_CHECK_MODEL).
# Slots are capped at 256 (GPU_CHECK_MAX_BATCH): uncapped, ED's 2-pair slots number about 13,000 at 40 GiB and its
# prefill alone takes minutes.
BENCH=(--model "${GPU_CHECK_MODEL:-arch:llama-2-7b}" --dtype float16 --device cuda --memory-budget "${GPU_CHECK_BUDGET:-40GiB}"
  --prompt-len "${GPU_CHECK_PROMPT:-1536}" --new "${GPU_CHECK_NEW:-512}" --max-batch "${GPU_CHECK_MAX_BATCH:-256}")
"$PY" launch/bench_throughput.py "${BENCH[@]}" --out "$OUT/bench_throughput.json" 2>&1 | tee "$OUT/bench_throughput.log"
bench_rc=${PIPESTATUS[0]}

# 3. The same rows on the default engine (continuous: the slot pool, as many requests as slots), and snap's.
"$PY" launch/bench_throughput.py "${BENCH[@]}" --scheduler continuous --no-hf --lengths '' --methods fkv,ed,bm,snap \
  --out "$OUT/bench_continuous.json" 2>&1 | tee "$OUT/bench_continuous.log"
cont_rc=${PIPESTATUS[0]}

# 4. The default engine's decode passes captured once as a CUDA graph and replayed: against part 3's rows.
"$PY" launch/bench_throughput.py "${BENCH[@]}" --scheduler continuous --compile cudagraphs --no-hf \
  --lengths '' --methods fkv,ed,bm,snap --out "$OUT/bench_compiled.json" 2>&1 | tee "$OUT/bench_compiled.log"
comp_rc=${PIPESTATUS[0]}

"$PY" - "$OUT" "$tests_rc" "$bench_rc" "$cont_rc" "$comp_rc" <<'PYEOF'
import json, os, sys, xml.etree.ElementTree as ET
import torch, transformers

out = sys.argv[1]
rcs = dict(zip(("cuda_tests", "bench_throughput", "bench_continuous", "bench_compiled"), map(int, sys.argv[2:6])))
report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": transformers.__version__,
          "parts": {part: rc == 0 for part, rc in rcs.items()}, "rc": rcs}
junit = os.path.join(out, "cuda_tests.xml")
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    report["cuda_tests"] = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
for part in ("bench_throughput", "bench_continuous", "bench_compiled"):
    path = os.path.join(out, f"{part}.json")
    if os.path.exists(path):
        data = json.load(open(path))
        report[part] = {"ratios": data.get("ratios"), "ratios_best_rule": data.get("ratios_best_rule"),
                        "rows": [{k: r.get(k) for k in ("method", "rule", "kv_max", "batch", "status", "tokens_per_s",
                                  "prefill_s", "decode_s", "decode_step_ms", "compile_s", "ours_over_hf")} for r in data["runs"]]}
with open(os.path.join(out, "gpu_check.json"), "w") as fh:
    json.dump(report, fh, indent=2)
print(json.dumps(report, indent=2))
PYEOF
pytest_failed "the tests marked cuda" "$tests_rc" && exit "$tests_rc"
[ "$bench_rc" -ne 0 ] && exit "$bench_rc"
[ "$cont_rc" -ne 0 ] && exit "$cont_rc"
exit "$comp_rc"
