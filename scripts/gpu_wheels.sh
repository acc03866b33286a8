#!/usr/bin/env bash
# The wheel folder for the GPU machine (no network there): every line of scripts/gpu_wheels.txt as a wheel for its
# Python 3.12, manylinux x86_64 (GPU_WHEELS_PYTHON=3.11: for another Python, as scripts/gpu_env_check.sh does).
#   bash scripts/gpu_wheels.sh [DIR]            # download/build into DIR (default .whl), then check it
#   bash scripts/gpu_wheels.sh --check [DIR]    # only check: exit 1 naming each listed wheel DIR lacks
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
check_only=0
if [ "${1:-}" = "--check" ]; then check_only=1; shift; fi
DIR="${1:-.whl}"
LIST=scripts/gpu_wheels.txt

# name==version [build] per line; comments and blank lines skipped
specs() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$LIST"; }

if [ "$check_only" -eq 0 ]; then
  mkdir -p "$DIR"
  specs | while read -r spec how; do
    if [ "$how" = build ]; then
      "$PY" -m pip wheel -q --no-deps -w "$DIR" "$spec" || exit 1
    else
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_WHEELS_PYTHON:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR" "$spec" || exit 1
    fi
  done || exit 1
fi

# Every listed package must be in DIR at its version (wheel file names: the name with - and . as _).
missing=()
while read -r spec how; do
  name="${spec%%==*}" version="${spec#*==}"
  stem="$(echo "$name" | tr 'A-Z.-' 'a-z__')-${version}-"
  ls "$DIR" 2>/dev/null | tr 'A-Z' 'a-z' | grep -q "^${stem}.*\.whl$" || missing+=("$spec")
done < <(specs)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "gpu_wheels.sh: $DIR lacks the wheels of: ${missing[*]} (run: bash scripts/gpu_wheels.sh $DIR)" >&2
  exit 1
fi
