#!/usr/bin/env python
"""Merge a data-parallel job's replica shards into its run files and report, by hand.

    python launch/merge.py OUT        # OUT/<run>/replica<R>/ -> OUT/<run>/summary.json ..., OUT/report.md

= ``batchmax_tp.eval.merge.main`` (the job merges by itself; this is for shards copied from several nodes).
"""

import os
import sys

try:  # a source checkout run without `pip install -e .`
    import batchmax_tp  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchmax_tp.eval.merge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
