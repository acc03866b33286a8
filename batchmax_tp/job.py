"""One job, one run path: a validated configuration -> a list of runs over one task -> run folders and a report.

Order: the launcher's world and ``tp_size``; the model's config (no weights: its KV heads and dtype settle the
layout); the task's samples (every rank reads the same, deterministically); ``OUT/config.yaml`` checked (results
made with another configuration are never resumed); torch.distributed (multi-process launches only); the model,
split with AutoTP; then the runs:

- listed runs (``runs``, or each of ``methods`` at ``batch_size``);
- the same-memory comparison (a plain ``python launch/run.py``): FKV, ED, the paper's BM and BM with the best
  rule, each at its largest batch within FKV's memory at batch 4, bounded only by the number of prompts (the
  samples repeated up to the largest fitting batch, at most ``plan.budget.STORY_MAX_PROMPTS``;
  ``plan.budget.same_memory_plan``);
- ``procedure: paper``: the paper's b0 procedure (``plan.budget.paper_specs``; b0 by real ED trials on CUDA);
- ``procedure: tune``: the auto-tuner's trials (``eval.procedures.run_tuner``), into ``OUT/tune/``.

Every run goes through ``eval.run.evaluate_run`` into ``OUT/<run>/`` (resumable, with a progress bar on rank 0);
at the end rank 0 writes ``OUT/report.md``, ``results.csv`` and the plots and prints the report.

Multi-process runs: each replica's first rank writes its shard of every run, the last replica to finish a run
merges it, rank 0 writes the report, prints and shows progress bars; other ranks log warnings and errors only.
The ranks meet only through the launcher's store, watched (``eval.replicas``): a rank that raises tells the
others and exits 1 at once, and a rank that dies silently is noticed within 30 s, so no rank waits for a dead
one.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from . import models, parallel
from .config import RunConfig
from .core.method import Method, min_kv_max
from .eval import procedures, replicas, results, tasks
from .eval.files import atomic_write_text
from .eval.report import write_report
from .eval.run import (
    Collectives,
    RankOutOfMemory,
    error_line,
    evaluate_run,
    fill_samples,
    longest_prompt,
    model_shape,
    warm_up,
    write_config,
)
from .plan.budget import (
    STORY_FKV_BATCH,
    STORY_MAX_PROMPTS,
    RunSpec,
    fmt_bytes,
    paper_specs,
    planned_dtype,
    same_memory_plan,
    story_methods,
)
from .plan.planner import ModelShape, predict

logger = logging.getLogger("batchmax_tp.run")

__all__ = ["fail", "resolve_device", "run"]


def fail(message: str) -> int:
    """One ``error:`` line on stderr; exit status 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` if available else ``cpu``; a cuda request without CUDA is a ValueError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{device} requested but torch.cuda.is_available() is False")
    return device


def _quiet_libraries() -> None:
    """Ranks other than 0: no progress bars and only warnings from transformers and DeepSpeed."""
    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _setup_stdout(is_main: bool) -> contextlib.AbstractContextManager:
    """stdout is for the final report: library prints during setup go to stderr on rank 0, nowhere elsewhere."""
    return contextlib.redirect_stdout(sys.stderr if is_main else io.StringIO())


def _warm_up_methods(cfg: RunConfig, same_memory: bool) -> list[Method]:
    """The methods the untimed warm-up runs: each distinct method of the job once (a procedure's runs are known
    only after planning: one of each kind)."""
    if same_memory:
        return story_methods({"ed": cfg.kv_max_for("ed"), "bm": cfg.kv_max_for("bm")}, cfg.p, cfg.rule)
    if cfg.procedure is not None:
        kv = cfg.kv_values[0] if cfg.kv_values else max(128, cfg.p + 64, min_kv_max(cfg.p, cfg.rule))
        return [
            Method("fkv", p=cfg.p),
            Method("ed", kv_max=2, p=cfg.p),
            Method("bm", kv_max=kv, p=cfg.p, rule=cfg.rule),
        ]
    return list({s.method: None for s in cfg.run_specs()})


def _budget_cannot_hold_one_sample(cfg: RunConfig, model_config) -> str | None:
    """The one-line error when ``memory_budget`` is below the weights plus one sample of the smallest method (ED
    with kv_max 2, a one-token prompt, one new token): then no run can start, whatever the task."""
    budget = cfg.budget_bytes()
    if budget is None:
        return None
    try:
        shape = ModelShape.from_config(model_config)
    except (AttributeError, TypeError):
        return None  # a configuration the planner cannot read: no prediction, the runs' own checks apply
    least = predict(shape, Method("ed", kv_max=2, p=cfg.p), 1, 1, 1, tp=cfg.tp_size, dtype=planned_dtype(cfg.dtype))
    if least.total <= budget:
        return None
    return (
        f"memory_budget: {fmt_bytes(budget)} per rank is below the {fmt_bytes(least.total)} that {cfg.model} needs "
        f"for one sample of the smallest method (ED kv_max 2, {cfg.dtype}; {fmt_bytes(least.weights)} of it "
        "weights): raise memory_budget or leave it unset"
    )


def run(cfg: RunConfig, argv: Sequence[str] | None) -> int:
    """Run the job ``cfg`` describes (``argv``: the command line, empty for a plain run). Returns the exit status."""
    try:
        cfg.device = resolve_device(cfg.device)
    except ValueError as err:
        return fail(f"device: {err}")
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    rank, world, local_rank = parallel.world_from_env()
    explicit_tp = cfg.tp_size is not None
    cfg.tp_size = parallel.resolve_tp_size(cfg.tp_size, world)
    if world % cfg.tp_size:
        return fail(
            f"tp_size: world size {world} is not a multiple of tp_size {cfg.tp_size}; start dp_size x tp_size "
            f"processes, e.g. torchrun --nproc_per_node {cfg.tp_size} launch/run.py --tp-size {cfg.tp_size} ..."
        )
    if cfg.dp_size is not None and cfg.dp_size != world // cfg.tp_size:
        return fail(
            f"dp_size: {cfg.dp_size} set, but {world} processes at tp_size {cfg.tp_size} make "
            f"{world // cfg.tp_size} data-parallel replicas"
        )
    cfg.dp_size = world // cfg.tp_size  # part of OUT/config.yaml: results are resumed only with the same replicas
    # The model's configuration alone (no weights): an unreadable model is one line here, and its KV heads and
    # dtype settle the layout before anything heavy happens.
    try:
        model_config = models.read_config(cfg.model)
    except ValueError as err:
        return fail(f"model: {err}")
    heads = getattr(model_config, "num_key_value_heads", None) or getattr(model_config, "num_attention_heads", 1)
    try:
        parallel.check_tp_size(cfg.tp_size, world, int(heads), explicit=explicit_tp)
    except ValueError as err:
        return fail(f"tp_size: {err} ({cfg.model})")
    device = parallel.local_device(cfg.device, local_rank) if world > 1 else cfg.device
    try:
        cfg.dtype = models.resolve_dtype(cfg.dtype, device, model_config)
    except ValueError as err:
        return fail(f"dtype: {err}")
    too_small = _budget_cannot_hold_one_sample(cfg, model_config)
    if too_small is not None:
        return fail(too_small)

    samples, task_data = None, None
    if cfg.task == "jsonl":
        data = cfg.data if cfg.data is not None else str(tasks.default_fixture_path())
        try:
            samples = tasks.load_jsonl(data)
        except (FileNotFoundError, ValueError) as err:
            return fail(f"data: {err}")
        if not samples:
            return fail(f"data: no samples in {data}")
        if cfg.num_samples is not None and cfg.num_samples > len(samples):
            logger.warning("num_samples=%d but %s has only %d samples", cfg.num_samples, data, len(samples))
        samples = [samples[i] for i in tasks.select_indices(len(samples), cfg.num_samples, cfg.seed)]
    else:
        source = cfg.data if cfg.data is not None else f"the bundled fixture {tasks.fixture_dir(cfg.task)}"
        try:
            task_data = tasks.load_task(
                cfg.task, cfg.data, num_shots=cfg.num_shots, num_samples=cfg.num_samples, seed=cfg.seed
            )
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot read the data"
            return fail(f"data: cannot load task {cfg.task} from {source}: {type(err).__name__}: {err}")
    same_memory = cfg.same_memory_for(argv)
    try:
        resuming = results.check_same_config(cfg.out, cfg.to_dict())
    except ValueError as err:
        return fail(str(err))
    if resuming and world == 1 and not same_memory and cfg.procedure is None:
        finished = [results.read_summary(Path(cfg.out) / s.name) for s in cfg.run_specs()]
        if all(finished):
            logger.info("every run in %s has finished: writing the report only", cfg.out)
            return _report(cfg, finished, [])
    methods = _warm_up_methods(cfg, same_memory)

    if rank != 0:
        _quiet_libraries()
    with _setup_stdout(rank == 0):  # DeepSpeed prints while it initialises: keep stdout for the report
        layout = parallel.init_distributed(cfg.tp_size, device, timeout_s=cfg.setup_timeout)
    if layout.world == 1:  # plain python (or an MPI world of one: then a group of one exists)
        rc = _run(cfg, layout, samples, task_data, methods, device, same_memory, Collectives())
        if dist.is_initialized():
            dist.destroy_process_group()
        return rc
    comm = _meet(layout)
    try:
        rc = _run(cfg, layout, samples, task_data, methods, device, same_memory, comm)
        # Every rank is done (or failed the same check) before any leaves: rank 0's process may host the store.
        comm.barrier()
    except BaseException as err:  # noqa: BLE001 - any failure: tell every rank, then leave at once
        comm.fail(error_line(err))
        if isinstance(err, RankOutOfMemory):
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        else:
            logger.exception("rank %d failed; ending the job (every other rank stops too)", layout.rank)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    comm.watchdog.leave()
    dist.destroy_process_group()
    return rc


def _meet(layout: parallel.Layout) -> Collectives:
    """The job's meetings over the launcher's store, with a watchdog that ends this rank when another dies
    (``eval.replicas``): from here on no rank waits for a dead one."""
    store = replicas.connect(layout.rank, layout.world)
    watchdog = replicas.Watchdog(store, layout.rank, layout.world).start()
    return Collectives(layout, store, watchdog)


def _report(cfg: RunConfig, summaries: list[dict], notes: list[str]) -> int:
    """Rank 0 after the runs: OUT/report.md, results.csv and the plots; the report goes to stdout too."""
    paths = write_report(cfg.out, summaries, notes=notes)
    print(paths["report.md"].read_text(encoding="utf-8"), end="", flush=True)
    return 0


def _run(
    cfg: RunConfig,
    layout: parallel.Layout,
    samples: list[tasks.Sample] | None,
    task_data: tasks.TaskData | None,
    methods: list[Method],
    device: str,
    same_memory: bool,
    comm: Collectives,
) -> int:
    torch.manual_seed(cfg.seed)
    with _setup_stdout(layout.is_main):
        # Under tensor parallelism the checkpoint is read on the host and AutoTP moves only this rank's shard to
        # the accelerator; a single process loads straight onto its device.
        model, tokenizer = models.load_model(cfg.model, dtype=cfg.dtype, device="cpu" if layout.tp > 1 else device)
        model = parallel.apply_tensor_parallel(model, layout, getattr(torch, cfg.dtype), device=device)
    if layout.world > 1:
        dist.barrier()  # every rank has loaded (default group: the long set-up timeout) before generation starts
        logger.info("world %d = dp_size %d x tp_size %d", layout.world, layout.dp, layout.tp)

    if task_data is not None:
        try:
            samples = tasks.build_samples(tokenizer, task_data, cfg.max_input_tokens)
        except ValueError as err:
            return fail(f"max_input_tokens: {err}")
    shape = model_shape(model)  # None for a model without a config (test doubles): no predictions
    if shape is None and (cfg.procedure is not None or same_memory):
        return fail(
            f"model: {cfg.procedure or 'the same-memory run'} needs the model's configuration to plan "
            f"memory ({cfg.model})"
        )
    prompt_len = longest_prompt(tokenizer, samples) if shape is not None else None

    notes: list[str] = []
    extra: dict[RunSpec, dict] = {}
    if cfg.procedure == "tune":
        if layout.is_main:
            write_config(cfg.out, cfg)
        warm_up(model, tokenizer, samples, methods, cfg.seed)
        try:
            info = procedures.run_tuner(
                model, tokenizer, samples, cfg, shape=shape, prompt_len=prompt_len, layout=layout, comm=comm
            )
        except ValueError as err:
            return fail(str(err))  # the tuner's one-line verdicts (budget too small for FKV, no references)
        if layout.is_main:
            print(procedures.write_tune_results(cfg, info), end="", flush=True)
        return 0 if info["best"] is not None else 1
    if cfg.procedure == "paper":
        fits = None
        if str(getattr(model, "device", "cpu")).startswith("cuda"):  # b0 by real trials; on CPU the planner's
            fits = procedures.b0_trials(model, tokenizer, samples, cfg, rank=layout.rank, world=layout.world)
        specs, plan = paper_specs(
            shape,
            prompt_len,
            budget=cfg.budget_bytes(),
            max_new_tokens=cfg.max_new_tokens,
            dtype=cfg.dtype,
            p=cfg.p,
            rule=cfg.rule,
            kv_values=cfg.kv_values,
            num_samples=len(samples),
            tp=layout.tp,
            fits=fits,
        )
        if layout.is_main:
            atomic_write_text(Path(cfg.out) / "plan.json", json.dumps(plan, indent=2) + "\n")
        notes.append(plan["b0_note"])
    elif same_memory:
        budget, plan = same_memory_plan(
            shape,
            methods,
            prompt_len,
            cfg.max_new_tokens,
            num_samples=len(samples),
            budget_bytes=cfg.budget_bytes(),
            tp=layout.tp,
            dtype=cfg.dtype,
            scheduler=cfg.scheduler,
        )
        specs = [r.spec for r in plan]
        extra = {r.spec: {"same_memory_budget_bytes": budget, "largest_fitting_batch": r.largest_fitting} for r in plan}
        samples = fill_samples(samples, max(s.batch_size for s in specs))
        notes.append(
            f"Same memory: a budget of {fmt_bytes(budget)} per rank (the planner's peak of FKV at batch "
            f"{STORY_FKV_BATCH} unless memory_budget is set); every method runs at its largest batch within "
            f"it, bounded by the {len(samples)} prompts every method answers (the samples repeated up to the "
            f"largest fitting batch, at most {STORY_MAX_PROMPTS}): "
            + ", ".join(f"{s.name} (fits {r.largest_fitting})" for s, r in zip(specs, plan))
            + "."
        )
        logger.info("same-memory run: %s", notes[-1])
    else:
        specs = cfg.run_specs()

    if layout.is_main:
        write_config(cfg.out, cfg)
    warm_up(model, tokenizer, samples, methods, cfg.seed)
    summaries = []
    for spec in specs:
        summary = evaluate_run(
            model,
            tokenizer,
            samples,
            spec,
            cfg,
            layout=layout,
            comm=comm,
            prompt_len=prompt_len,
            shape=shape,
            extra=extra.get(spec),
        )
        if summary is not None:  # rank 0
            summaries.append(summary)
    if layout.is_main:
        _report(cfg, summaries, notes)
    return 0
