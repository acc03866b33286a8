#!/usr/bin/env python
"""Run batched generation with Batch-Max and its baselines; write run folders and a report.

    python launch/run.py                                  # FKV, ED, BM, BM (best rule), snap at the same memory
    python launch/run.py --config configs/default.yaml    # a listed sweep; --help lists every flag
    torchrun --nproc_per_node 4 launch/run.py --tp-size 2 [flags]     # 2 replicas x 2 tensor-parallel ranks
    deepspeed --num_gpus 4 launch/run.py --config configs/X.yaml      # heads split over the 4 GPUs (where the
                                                                      # KV heads allow; else replicas: run.py logs it)

= ``batchmax_tp.cli.main`` (the job: ``batchmax_tp.job``; docs/architecture.md: The run path and the layers).
"""

import os
import sys

try:  # a source checkout run without `pip install -e .`
    import batchmax_tp  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchmax_tp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
