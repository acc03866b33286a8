#!/usr/bin/env python
"""Run batched generation with one or more KV-cache methods and write the results.

    python launch/run.py [--config configs/default.yaml] [flags]      # --help lists the flags

Order: parse + validate the configuration (any error: ``error: <one line>`` on stderr, exit 2, before a model
is loaded or a file written); load the samples; load the model; for each method generate in batches, then
write OUT/[<method>/]summary.json + samples.jsonl, OUT/config.yaml and (several methods) OUT/table.md; print
one table to stdout.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Sequence

try:  # a source checkout run without `pip install -e .`
    import batchmax_tp  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchmax_tp import runner  # noqa: E402
from batchmax_tp.config import ConfigError, parse_args, resolve_device  # noqa: E402

logger = logging.getLogger("batchmax_tp.run")


def _fail(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        cfg.device = resolve_device(cfg.device)
    except ConfigError as err:
        return _fail(str(err))
    except SystemExit as done:  # --help
        return int(done.code or 0)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )

    tasks = importlib.import_module("batchmax_tp.tasks")
    data = cfg.data if cfg.data is not None else str(tasks.default_fixture_path())
    try:
        samples = tasks.load_jsonl(data)
    except (FileNotFoundError, ValueError) as err:
        return _fail(f"data: {err}")
    if not samples:
        return _fail(f"data: no samples in {data}")
    if cfg.num_samples is not None:
        if cfg.num_samples > len(samples):
            logger.warning("num_samples=%d but %s has only %d samples", cfg.num_samples, data, len(samples))
        samples = samples[: cfg.num_samples]
    methods = cfg.method_specs()

    import torch

    torch.manual_seed(cfg.seed)
    models = importlib.import_module("batchmax_tp.models")
    model, tokenizer = models.load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)

    several = len(methods) > 1
    runner.write_config(cfg.out, cfg)
    summaries = []
    for method in methods:
        run = runner.run_method(model, tokenizer, samples, method, cfg)
        summary = runner.summary_row(run, cfg, tp_size=1)
        folder = runner.method_out_dir(cfg.out, method.name, several)
        runner.write_method_results(folder, summary, run.records)
        logger.info(
            "%s: %d tokens in %.2f s (%.2f tokens/s) -> %s",
            method.name, summary["generated_tokens"], summary["total_s"], summary["tokens_per_s"] or 0.0, folder,
        )
        summaries.append(summary)
    table = runner.write_table(cfg.out, summaries) if several else runner.format_table(summaries)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
