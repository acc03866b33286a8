#!/usr/bin/env python
"""Auto-tuner: the fastest BM (b, kv_max) whose task metric reaches ``target`` x FKV's, under a memory budget.

    python launch/tune.py --config X.yaml --memory-budget 1GiB --target 0.95 [--kv-max 128,256,384]
    python launch/run.py --config OUT/tuned.yaml            # then run the chosen configuration

= ``launch/run.py`` with ``procedure: tune`` (``--kv-max K1,K2`` is ``--kv-values K1,K2``; every other flag is
run.py's; ``runs`` in the config are ignored). ``plan.tuner.tune`` picks the trials: FKV once at its largest
fitting batch (the reference metric), a bisection of the kv_max grid for the smallest value reaching the target
(each at its largest fitting batch dividing the number of samples), and a few neighbours above it. Each trial is a
run through the one run path into OUT/tune/<run>/ (run again: finished trials are read back). Writes
OUT/tune.json (every trial and the choice), OUT/tune/report.md and, when a BM configuration reaches the target,
OUT/tuned.yaml (out: OUT/tuned); prints them. Exit status 1 when none does.
"""

import os
import sys

try:  # a source checkout run without `pip install -e .`
    import batchmax_tp  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchmax_tp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(procedure="tune"))
