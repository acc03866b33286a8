#!/usr/bin/env python
"""The paper's procedure (section 4.1) under a memory budget per rank, as a resumable sweep with a Table-1 report.

    python launch/sweep.py --config configs/paper/llama2_cnn_dailymail.yaml --memory-budget 30GiB
    python launch/sweep.py --config X.yaml --memory-budget 2GiB --kv-max 896,1024   # BM's kv_max values

= ``launch/run.py`` with ``procedure: paper`` (``--kv-max K1,K2`` is ``--kv-values K1,K2``; every other flag is
run.py's). After loading the model and building the prompts it plans, with ``batchmax_tp.tuner.paper_plan`` and
the planner's predictions for the longest prompt: b0 = the smallest batch at which ED (kv_max 2) does not fit
(recorded as an OOM row, not run), ED (kv_max 2 and 65) and FKV at b0 - 1, and BM for each kv_max (default:
multiples of 128 below the longest prompt) at its largest fitting batch that divides the number of samples. The
plan goes to OUT/plan.json; the runs go through the same resumable harness as any sweep (OUT/<run>/), then
OUT/report.md, results.csv and the plots. Run it again to resume.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))


def procedure_argv(argv: Sequence[str], procedure: str) -> list[str]:
    """run.py's arguments: ``--kv-max LIST`` becomes ``--kv-values LIST``, then ``--procedure <procedure>``."""
    out = []
    for arg in argv:
        if arg == "--kv-max":
            out.append("--kv-values")
        elif arg.startswith("--kv-max="):
            out.append("--kv-values=" + arg.split("=", 1)[1])
        else:
            out.append(arg)
    return [*out, "--procedure", procedure]


def run_module():
    """launch/run.py as a module (the launch folder is not a package)."""
    spec = importlib.util.spec_from_file_location("batchmax_launch_run_main", os.path.join(_HERE, "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    return run_module().main(procedure_argv(sys.argv[1:] if argv is None else argv, "paper"))


if __name__ == "__main__":
    sys.exit(main())
