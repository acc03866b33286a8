#!/usr/bin/env python
"""Run batched generation with one or more KV-cache methods and write the results.

    python launch/run.py [--config configs/default.yaml] [flags]      # --help lists the flags
    torchrun --nproc_per_node 4 launch/run.py --tp-size 2 [flags]      # 2 replicas x 2 tensor-parallel ranks

Order: parse + validate the configuration (any error: ``error: <one line>`` on stderr, exit 2, before a model
is loaded or a file written); check that ``tp_size`` divides the launcher's world size; load the samples (every
rank reads the same file, deterministically); initialise torch.distributed (multi-process launches only); check
``tp_size`` against the KV heads in the model's config (before any weight is loaded); load the model and split
it with AutoTP; an untimed warm-up; for each method generate in batches (batch i on data-parallel replica
i % dp_size), gather the per-sample records on rank 0, which writes OUT/[<method>/]summary.json + samples.jsonl,
OUT/config.yaml and (several methods) OUT/table.md, and prints one table to stdout.

Sweeps (a ``runs`` list or a paper task): the task's data is read before the model (and OUT/config.yaml is
checked: results made with another configuration are never resumed); prompts are built with the tokenizer;
each run appends its finished batches to OUT/<run>/samples.jsonl and ends with OUT/<run>/summary.json
(``batchmax_tp.evaluate``); finished runs and batches are skipped when the same config runs again. At the end
rank 0 writes OUT/report.md, results.csv, throughput.png and metric_vs_kv.png and prints the report.

Memory (``batchmax_tp.budget``): every run's peak per rank is predicted by the planner from the model's config,
the batch size and the longest prompt, and recorded in its summary; with ``memory_budget`` a run predicted over
it becomes an OOM row without running. ``procedure: paper`` (``launch/sweep.py``) builds the runs with the
paper's b0 procedure (OUT/plan.json) and runs them as a sweep; ``procedure: tune`` (``launch/tune.py``) runs the
auto-tuner's trials into OUT/tune/ and writes OUT/tune.json and OUT/tuned.yaml.

Multi-process runs: only rank 0 writes files, prints the table and shows progress bars; other ranks log warnings
and errors only. A rank that raises logs the traceback and exits 1 at once, so that the launcher stops the other
ranks instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

try:  # a source checkout run without `pip install -e .`
    import batchmax_tp  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchmax_tp import runner  # noqa: E402
from batchmax_tp.config import ConfigError, parse_args, resolve_device  # noqa: E402

logger = logging.getLogger("batchmax_tp.run")


def _fail(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2


def _quiet_libraries() -> None:
    """Ranks other than 0: no progress bars and only warnings from transformers and DeepSpeed."""
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _setup_stdout(is_main: bool):
    """stdout is for the final table: library prints during setup go to stderr on rank 0, nowhere elsewhere."""
    return contextlib.redirect_stdout(sys.stderr if is_main else io.StringIO())


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)  # none at all: the same-memory run (runner.story_requested)
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

    tp = importlib.import_module("batchmax_tp.tp")
    models = importlib.import_module("batchmax_tp.models")
    rank, world, local_rank = tp.world_from_env()
    explicit_tp = cfg.tp_size is not None
    cfg.tp_size = tp.resolve_tp_size(cfg.tp_size, world)
    if world % cfg.tp_size:
        return _fail(
            f"tp_size: world size {world} is not a multiple of tp_size {cfg.tp_size}; start dp_size x tp_size "
            f"processes, e.g. torchrun --nproc_per_node {cfg.tp_size} launch/run.py --tp-size {cfg.tp_size} ..."
        )
    # The model's configuration alone (no weights): an unreadable model is one line here, and its KV heads and
    # dtype settle the layout before anything heavy happens.
    try:
        model_config = models.read_config(cfg.model)
    except ValueError as err:
        return _fail(f"model: {err}")
    heads = getattr(model_config, "num_key_value_heads", None) or getattr(model_config, "num_attention_heads", 1)
    try:
        tp.check_tp_size(cfg.tp_size, world, int(heads), explicit=explicit_tp)
    except ValueError as err:
        return _fail(f"tp_size: {err} ({cfg.model})")
    device = tp.local_device(cfg.device, local_rank) if world > 1 else cfg.device
    cfg.dtype = models.resolve_dtype(cfg.dtype, device, model_config)

    tasks = importlib.import_module("batchmax_tp.tasks")
    samples, task_data = None, None
    if cfg.task == "jsonl":
        data = cfg.data if cfg.data is not None else str(tasks.default_fixture_path())
        try:
            samples = tasks.load_jsonl(data)
        except (FileNotFoundError, ValueError) as err:
            return _fail(f"data: {err}")
        if not samples:
            return _fail(f"data: no samples in {data}")
        if cfg.num_samples is not None and cfg.num_samples > len(samples):
            logger.warning("num_samples=%d but %s has only %d samples", cfg.num_samples, data, len(samples))
        samples = [samples[i] for i in tasks.select_indices(len(samples), cfg.num_samples, cfg.seed)]
    else:
        source = cfg.data if cfg.data is not None else f"the bundled fixture {tasks.fixture_dir(cfg.task)}"
        try:
            task_data = _load_task(cfg, tasks)
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot read the data"
            return _fail(f"data: cannot load task {cfg.task} from {source}: {type(err).__name__}: {err}")
    if cfg.sweep:
        results = importlib.import_module("batchmax_tp.results")
        try:
            resuming = results.check_same_config(cfg.out, cfg.to_dict())
        except ValueError as err:
            return _fail(str(err))
        if cfg.procedure is not None:  # the runs depend on the model and the prompts: known after loading them
            methods = importlib.import_module("batchmax_tp.budget").warm_up_methods(cfg)
        else:
            specs = cfg.run_specs()
            if resuming and world == 1 and all(results.read_summary(os.path.join(cfg.out, s.name)) for s in specs):
                logger.info("every run in %s has finished: writing the report only", cfg.out)
                return _report(cfg, [results.read_summary(os.path.join(cfg.out, s.name)) for s in specs])
            methods = list({s.method: None for s in specs})  # for the warm-up: each distinct method once
    story = runner.story_requested(cfg, args)
    if not cfg.sweep:
        methods = runner.story_methods(cfg) if story else cfg.method_specs()

    if rank != 0:
        _quiet_libraries()
    with _setup_stdout(rank == 0):  # DeepSpeed prints while it initialises: keep stdout for the table
        layout = tp.init_distributed(cfg.tp_size, device, timeout_s=cfg.setup_timeout)
    import torch.distributed as dist

    if layout.world == 1:  # plain python (or an MPI world of one: then a group of one exists)
        rc = _run(cfg, layout, samples, methods, device, task_data, story)
        if dist.is_initialized():
            dist.destroy_process_group()
        return rc
    try:
        rc = _run(cfg, layout, samples, methods, device, task_data, story)
    except BaseException as err:  # noqa: BLE001 - any failure: tell, then leave at once (no collective may wait on us)
        if isinstance(err, importlib.import_module("batchmax_tp.evaluate").RankOutOfMemory):
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        else:
            logger.exception("rank %d failed; exiting so that the launcher stops the other ranks", layout.rank)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        if rc != 0:
            # Every rank failed the same check. Meet once more before leaving: a rank that exits while a slower
            # one is still connecting its gloo/nccl mesh makes that one fail with a traceback instead.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        dist.destroy_process_group()
    return rc


def _load_task(cfg: Any, tasks: Any) -> Any:
    """A paper task's shots and selected test examples (``tasks.TaskData``), read through ``datasets``."""
    import datasets

    datasets.disable_progress_bars()
    return tasks.load_task(cfg.task, cfg.data, num_shots=cfg.num_shots, num_samples=cfg.num_samples, seed=cfg.seed)


def _report(cfg: Any, summaries: list[dict]) -> int:
    """Rank 0 after a sweep: OUT/report.md, results.csv and the plots; the report goes to stdout too."""
    report = importlib.import_module("batchmax_tp.report")
    plan = Path(cfg.out) / "plan.json"
    notes = [json.loads(plan.read_text(encoding="utf-8"))["b0_note"]] if cfg.procedure == "paper" else []
    paths = report.write_report(cfg.out, summaries, notes=notes)
    print(paths["report.md"].read_text(encoding="utf-8"), end="", flush=True)
    return 0


def _run_sweep(cfg: Any, layout: Any, model: Any, tokenizer: Any, samples: list, results_group: Any,
               shape: Any = None, prompt_len: int | None = None) -> int:
    """Every run of the sweep (finished ones are skipped, unfinished ones resumed), then the report. With
    ``procedure: paper`` the runs are the paper's plan (OUT/plan.json); ``procedure: tune`` runs the auto-tuner."""
    evaluate = importlib.import_module("batchmax_tp.evaluate")
    budget = importlib.import_module("batchmax_tp.budget")
    if cfg.procedure == "tune":
        info = budget.run_tuner(model, tokenizer, samples, cfg, shape=shape, prompt_len=prompt_len, layout=layout,
                                group=results_group)
        if layout.is_main:
            print(budget.write_tune_results(cfg, info), end="", flush=True)
        return 0 if info["best"] is not None else 1
    if cfg.procedure == "paper":
        fits = None
        if str(getattr(model, "device", "cpu")).startswith("cuda"):  # b0 by real trials; on CPU the planner's
            tasks = importlib.import_module("batchmax_tp.tasks")
            longest = max(samples, key=lambda s: len(tasks.prompt_ids(tokenizer, s.prompt)))
            ids, mask = tasks.encode_prompts(tokenizer, [longest.prompt])
            fits = budget.ed_trials(model, ids.to(model.device), mask.to(model.device), cfg, rank=layout.rank,
                                    world=layout.world)
        specs, plan = budget.paper_specs(cfg, shape, prompt_len, num_samples=len(samples), tp=layout.tp, fits=fits)
        if layout.is_main:
            runner.atomic_write_text(os.path.join(cfg.out, "plan.json"), json.dumps(plan, indent=2) + "\n")
    else:
        specs = cfg.run_specs()
    summaries = []
    for spec in specs:
        summary = evaluate.evaluate_run(model, tokenizer, samples, spec, cfg, layout=layout, group=results_group,
                                        prompt_len=prompt_len, shape=shape)
        if summary is not None:  # rank 0
            summaries.append(summary)
    if layout.is_main:
        _report(cfg, summaries)
    return 0


def _run(cfg: Any, layout: Any, samples: list | None, methods: list, device: str, task_data: Any = None,
         story: bool = False) -> int:
    import torch

    tp = importlib.import_module("batchmax_tp.tp")
    models = importlib.import_module("batchmax_tp.models")
    torch.manual_seed(cfg.seed)
    with _setup_stdout(layout.is_main):
        # Under tensor parallelism the checkpoint is read on the host and AutoTP moves only this rank's shard to
        # the accelerator; a single process loads straight onto its device.
        model, tokenizer = models.load_model(cfg.model, dtype=cfg.dtype, device="cpu" if layout.tp > 1 else device)
        model = tp.apply_tensor_parallel(model, layout, getattr(torch, cfg.dtype), device=device)
    if layout.world > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank has loaded (default group: the long set-up timeout) before generation starts
    results_group = None
    if layout.world > 1:
        import torch.distributed as dist

        # Replicas reach the per-method gather up to a batch apart: give it a long timeout of its own.
        results_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=runner.RESULTS_TIMEOUT_S))
        logger.info("world %d = dp_size %d x tp_size %d", layout.world, layout.dp, layout.tp)

    if task_data is not None:
        tasks = importlib.import_module("batchmax_tp.tasks")
        try:
            samples = tasks.build_samples(tokenizer, task_data, cfg.max_input_tokens)
        except ValueError as err:
            return _fail(f"max_input_tokens: {err}")

    budget = importlib.import_module("batchmax_tp.budget")
    shape = budget.model_shape(model)  # None for a model without a config (test doubles): no predictions
    if shape is None and cfg.procedure is not None:
        return _fail(f"model: procedure {cfg.procedure} needs the model's configuration to plan memory ({cfg.model})")
    prompt_len = budget.longest_prompt(tokenizer, samples) if shape is not None else None

    batches = {id(m): cfg.batch_size for m in methods}
    budget_bytes = None
    if story and shape is not None:  # same memory: each method at its largest fitting batch (runner.same_memory_plan)
        budget_bytes, plan = runner.same_memory_plan(shape, methods, prompt_len, cfg.max_new_tokens,
                                                     budget_bytes=cfg.budget_bytes(), tp=layout.tp, dtype=cfg.dtype)
        batches = {id(r.method): r.batch for r in plan}
        samples = runner.fill_samples(samples, max(batches.values()))
        logger.info("same-memory run: budget %.1f MiB per rank; batches %s; %d samples", budget_bytes / 2**20,
                    ", ".join(f"{runner.method_key(r.method)} {r.batch} (fits {r.largest_fitting})" for r in plan),
                    len(samples))

    if layout.is_main:
        runner.write_config(cfg.out, cfg)
    runner.warm_up(model, tokenizer, samples, methods, cfg)
    rc = 0
    if cfg.sweep:
        try:
            rc = _run_sweep(cfg, layout, model, tokenizer, samples, results_group, shape, prompt_len)
        except ValueError as err:
            if cfg.procedure != "tune":
                raise
            return _fail(str(err))  # the tuner's one-line verdicts (budget too small for FKV, no references)
        methods = []  # the per-method path below is the plain JSONL layout
    several = len(methods) > 1
    summaries = []
    for method in methods:
        mcfg = cfg if batches[id(method)] == cfg.batch_size else dataclasses.replace(cfg, batch_size=batches[id(method)])
        if mcfg.batch_size < 1:  # same-memory run: not even one sample fits the budget
            if layout.is_main:
                estimate = budget.predict_spec(shape, method, 1, prompt_len, cfg, layout.tp)
                summaries.append({"method": method.name, "rule": runner.method_rule(method), "status": "OOM",
                                  "kv_max": None if method.name == "fkv" else method.kv_max, "batch_size": 0,
                                  "predicted_peak_bytes": estimate.total})
            continue
        run = runner.run_method(
            model, tokenizer, samples, method, mcfg,
            progress=None if layout.is_main else False, replica=layout.replica, num_replicas=layout.dp,
        )
        per_replica = None
        if layout.world > 1:
            gathered = runner.gather_runs(run, layout, results_group)
            if gathered is None:  # not rank 0
                continue
            run, per_replica = gathered
        estimate = None if shape is None else budget.predict_spec(shape, method, mcfg.batch_size, prompt_len, cfg,
                                                                  layout.tp)
        summary = runner.summary_row(run, mcfg, tp_size=layout.tp, dp_size=layout.dp, per_replica=per_replica,
                                     memory=budget.budget_fields(cfg, estimate, model))
        summary.setdefault("rule", runner.method_rule(method))
        if budget_bytes is not None:
            summary["same_memory_budget_bytes"] = budget_bytes
        folder = runner.method_out_dir(cfg.out, runner.method_key(method) if story else method.name, several)
        runner.write_method_results(folder, summary, run.records)
        logger.info(
            "%s: %d tokens in %.2f s (%.2f tokens/s) -> %s",
            method.name, summary["generated_tokens"], summary["total_s"], summary["tokens_per_s"] or 0.0, folder,
        )
        summaries.append(summary)
    if layout.is_main and summaries and story:
        table = runner.format_story_table(summaries, budget_bytes)
        runner.atomic_write_text(os.path.join(cfg.out, "table.md"), table)
        print(table, end="", flush=True)
    elif layout.is_main and summaries:
        table = runner.write_table(cfg.out, summaries) if several else runner.format_table(summaries)
        print(table, end="", flush=True)
    if results_group is not None:
        import torch.distributed as dist

        dist.barrier(group=results_group)  # nobody leaves while rank 0 may still be reading from it
    return rc


if __name__ == "__main__":
    sys.exit(main())
