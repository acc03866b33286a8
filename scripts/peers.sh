#!/usr/bin/env bash
# kvpress's environment, for `launch/bench_ruler.py --kvpress` and the snap oracle test (safe to run again).
#   bash scripts/peers.sh            # after scripts/setup.sh; PYTHON=... as there
# kvpress 0.5.5 pins transformers >=4.56,<5.3 and this package needs >=5.17, so they cannot share one environment
# (a `peers` extra of this package would make pip refuse the install). This makes a virtual environment that sees
# the active one's packages (torch, numpy, ...) with kvpress and its own transformers on top:
# $BATCHMAX_CACHE/peers-venv (default ~/.cache/batchmax_tp/peers-venv; BATCHMAX_PEERS_PYTHON names another
# interpreter to the bench and the test). pip says batchmax-tp wants another transformers there: expected, as the
# scripts run there (launch/kvpress_rows.py) import only kvpress, transformers and torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VENV="${BATCHMAX_CACHE:-$HOME/.cache/batchmax_tp}/peers-venv"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q "kvpress==0.5.5" "transformers>=4.56,<5.3" 2>&1 | grep -v "batchmax-tp\|dependency resolver\|dependency conflicts\|WARNING: Location" >&2 || true
"$VENV/bin/python" launch/kvpress_rows.py --check
echo "peers.sh: kvpress ready in $VENV" >&2
