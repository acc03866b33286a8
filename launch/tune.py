#!/usr/bin/env python
"""Auto-tuner: the fastest BM (b, kv_max) whose task metric reaches ``target`` x FKV's, under a memory budget.

    python launch/tune.py --config X.yaml --memory-budget 1GiB --target 0.95 [--kv-max 128,256,384]
    python launch/run.py --config OUT/tuned.yaml            # then run the chosen configuration

= ``launch/run.py`` with ``procedure: tune`` (``--kv-max K1,K2`` is ``--kv-values K1,K2``; every other flag is
run.py's; ``runs`` in the config are ignored). ``batchmax_tp.tuner.tune`` picks the trials: FKV once at its
largest fitting batch (the reference metric), a bisection of the kv_max grid for the smallest value reaching the
target (each at its largest fitting batch dividing the number of samples), and a few neighbours above it. Each
trial is a run of the task's samples through the resumable harness into OUT/tune/<run>/ (run again: finished
trials are read back). Writes OUT/tune.json (every trial and the choice), OUT/tune/report.md and, when a BM
configuration reaches the target, OUT/tuned.yaml (out: OUT/tuned); prints them. Exit status 1 when none does.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Sequence


def _sweep_module():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sweep.py")
    spec = importlib.util.spec_from_file_location("batchmax_launch_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    sweep = _sweep_module()
    return sweep.run_module().main(sweep.procedure_argv(sys.argv[1:] if argv is None else argv, "tune"))


if __name__ == "__main__":
    sys.exit(main())
