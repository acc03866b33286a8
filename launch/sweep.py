#!/usr/bin/env python
"""The paper's procedure (section 4.1) under a memory budget per rank, as a resumable sweep with a Table-1 report.

    python launch/sweep.py --config configs/paper/llama2_cnn_dailymail.yaml --memory-budget 30GiB
    python launch/sweep.py --config X.yaml --memory-budget 2GiB --kv-max 896,1024   # BM's kv_max values

= ``launch/run.py`` with ``procedure: paper`` (``--kv-max K1,K2`` is ``--kv-values K1,K2``; every other flag is
run.py's). After loading the model and building the prompts it plans, with ``plan.budget.paper_specs`` and the
planner's predictions for the longest prompt: b0 = the smallest batch at which ED (kv_max 2) does not fit
(recorded as an OOM row, not run; on CUDA found by real ED trials), ED (kv_max 2 and 65) and FKV at b0 - 1, and BM
for each kv_max (default: multiples of 128 below the longest prompt) at its largest fitting batch that divides the
number of samples. The plan goes to OUT/plan.json; the runs go through the one run path (OUT/<run>/), then
OUT/report.md, results.csv and the plots. Run it again to resume.
"""

import os
import sys

try:  # a source checkout run without `pip install -e .`
    import batchmax_tp  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchmax_tp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(procedure="paper"))
