"""One job, one run path: a validated configuration -> a list of runs over one task -> run folders and a report.

Order: the launcher's world and ``tp_size``; the model's config (no weights: its KV heads and dtype settle the
layout); the task's samples (every rank reads the same, deterministically); ``OUT/config.yaml`` checked (results
made with another configuration are never resumed); torch.distributed (multi-process launches only); the model,
split with AutoTP; then the runs:

- listed runs (``runs``, or each of ``methods`` at ``batch_size``);
- the main job, the same-memory comparison (unless the configuration lists its runs: ``RunConfig.main_job``):
  FKV, ED, the paper's BM, BM with the best rule and snap (or those ``methods`` names), each at its largest batch
  within FKV's memory at batch 4, bounded only by the number of prompts (the samples repeated up to the largest
  fitting batch, at most ``max_prompts``, default ``plan.budget.STORY_MAX_PROMPTS``; ``plan.budget.same_memory_plan``);
- ``procedure: paper``: the paper's b0 procedure (``plan.budget.paper_specs``; b0 from the planner: where the paper's ED
  runs out of the budget);
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from . import models, parallel
from .config import DataConfig, RunConfig
from .core.method import BLOCK, Method, min_kv_max, takes_rule
from .eval import procedures, replicas, results, tasks
from .eval.batches import warm_up
from .eval.collectives import Collectives
from .eval.context import RunContext
from .eval.files import atomic_write_text
from .eval.generation import fill_samples, longest_prompt, whole_waves
from .eval.oom import RankOutOfMemory, error_line
from .eval.report import write_report
from .eval.run import evaluate_run
from .eval.summary import model_shape, write_config
from .plan.budget import (
    STORY_FKV_BATCH,
    RunSpec,
    fmt_bytes,
    largest_kv_max,
    paper_setting_specs,
    paper_specs,
    planned_dtype,
    predict_spec,
    prompts_held,
    same_memory_plan,
)
from .plan.planner import ModelShape, predict

logger = logging.getLogger("batchmax_tp.run")

__all__ = ["fail", "run"]


class JobError(ValueError):
    """A problem found while setting the job up: one line that starts with the key it is about (exit status 2)."""


def fail(message: str) -> int:
    """One ``error:`` line on stderr; exit status 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2


def _quiet_libraries() -> None:
    """Ranks other than 0: no progress bars and only warnings from transformers and DeepSpeed."""
    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _setup_stdout(is_main: bool) -> contextlib.AbstractContextManager:
    """stdout is for the final report: library prints during setup go to stderr on rank 0, nowhere elsewhere."""
    return contextlib.redirect_stdout(sys.stderr if is_main else io.StringIO())


@dataclass
class Job:
    """What the set-up settled before any weight loads: the resolved configuration, this process's device, the
    task's samples (or the task's data, turned into samples once the tokenizer is loaded) and the warm-up's
    methods."""

    cfg: RunConfig
    device: str
    samples: list[tasks.Sample] | None
    task_data: tasks.TaskData | None
    methods: list[Method] = field(default_factory=list)

    @property
    def main_job(self) -> bool:
        return self.cfg.main_job


# ---------------------------------------------------------------------- set-up (no weights)
def _resolve(cfg: RunConfig, rank: int, world: int, local_rank: int) -> tuple[RunConfig, str, Any]:
    """The configuration with ``device``, ``tp_size``, ``dp_size`` and ``dtype`` resolved (as ``OUT/config.yaml``
    records them), this process's device and the model's configuration. That configuration alone (no weights) is
    read here: an unreadable model is one line, and its KV heads and dtype settle the layout before anything heavy
    happens."""
    try:
        cfg = cfg.replace(device=parallel.resolve_device(cfg.model.device))
    except ValueError as err:
        raise JobError(f"device: {err}") from None
    try:
        model_config = models.read_config(cfg.model.name)
    except ValueError as err:
        raise JobError(f"model: {err}") from None
    heads = int(getattr(model_config, "num_key_value_heads", None) or getattr(model_config, "num_attention_heads", 1))
    tp = parallel.resolve_tp_size(cfg.parallel.tp_size, world, heads)
    if world % tp:
        raise JobError(
            f"tp_size: world size {world} is not a multiple of tp_size {tp}; start dp_size x tp_size "
            f"processes, e.g. torchrun --nproc_per_node {tp} launch/run.py --tp-size {tp} ..."
        )
    if cfg.parallel.dp_size is not None and cfg.parallel.dp_size != world // tp:
        raise JobError(
            f"dp_size: {cfg.parallel.dp_size} set, but {world} processes at tp_size {tp} make "
            f"{world // tp} data-parallel replicas"
        )
    try:
        parallel.check_tp_size(tp, world, heads)
    except ValueError as err:
        raise JobError(f"tp_size: {err} ({cfg.model.name})") from None
    note = parallel.layout_note(cfg.parallel.tp_size, world, heads)
    if note is not None and rank == 0:
        logger.warning("%s (%s)", note, cfg.model.name)
    _check_methods(cfg, heads, tp)
    # dp_size is part of OUT/config.yaml: results are resumed only with the same replicas
    cfg = cfg.replace(tp_size=tp, dp_size=world // tp)
    device = parallel.process_device(cfg.model.device, world, local_rank)
    try:
        cfg = cfg.replace(dtype=models.resolve_dtype(cfg.model.dtype, device, model_config))
    except ValueError as err:
        raise JobError(f"dtype: {err}") from None
    _check_model_limits(cfg, model_config)
    _check_budget_holds_one_sample(cfg, model_config)
    return cfg, device, model_config


def _check_methods(cfg: RunConfig, kv_heads: int, tp: int) -> None:
    """JobError for a method the model's heads refuse: a rule's ``share`` must divide the KV heads of every rank
    (AutoTP gives rank r ``kv_heads // tp`` heads, one more for the first ``kv_heads % tp``)."""
    per_rank = sorted({kv_heads // tp + (r < kv_heads % tp) for r in range(tp)})
    for method in _warm_up_methods(cfg):
        for heads in per_rank:
            try:
                method.group(heads)
            except ValueError as err:
                where = f"{cfg.model.name}, {kv_heads} KV heads" + (f" over tp_size {tp}" if tp > 1 else "")
                raise JobError(f"rule: {err} ({where})") from None


def _check_model_limits(cfg: RunConfig, model_config) -> None:
    """JobError for the settings the model bounds (its configuration, no weights): ``max_new_tokens`` below its
    context length (one prompt token at least), a sampled ``top_k`` within its vocabulary."""
    context = getattr(model_config, "max_position_embeddings", None)
    new = cfg.generation.max_new_tokens
    if isinstance(context, int) and new >= context:
        raise JobError(
            f"max_new_tokens: {new} new tokens leave no room for a prompt in the {context}-token context of "
            f"{cfg.model.name}: at most {context - 1}"
        )
    vocab, top_k = getattr(model_config, "vocab_size", None), cfg.generation.top_k
    if cfg.generation.do_sample and isinstance(vocab, int) and top_k > vocab:
        raise JobError(f"top_k: {top_k} is more than the {vocab} tokens of {cfg.model.name}'s vocabulary")


def _make_out(out: str) -> list[Path]:
    """Create the output folder before anything is read or loaded (JobError ``out: ...`` when it cannot be); the
    folders it created, deepest last, for :func:`_unmake_out`."""
    path = Path(out).absolute()
    made = [p for p in (path, *path.parents) if not p.exists()][::-1]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise JobError(f"out: cannot create {out}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):  # an existing folder this process cannot write (or read-only)
        _unmake_out(made)
        raise JobError(f"out: cannot write into {out}: permission denied or a read-only file system")
    return made


def _unmake_out(made: list[Path]) -> None:
    """Remove the folders :func:`_make_out` created, if still empty: a job refused at set-up leaves nothing."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return


def _check_budget_holds_one_sample(cfg: RunConfig, model_config) -> None:
    """JobError when ``memory_budget`` is below the weights plus one sample of the smallest method (ED with kv_max
    2, a one-token prompt, one new token): then no run can start, whatever the task."""
    budget = cfg.memory.budget_bytes()
    if budget is None:
        return
    try:
        shape = ModelShape.from_config(model_config)
    except (AttributeError, TypeError):
        return  # a configuration the planner cannot read: no prediction, the runs' own checks apply
    ed2 = Method("ed", kv_max=2, p=cfg.sweep.p)
    least = predict(shape, ed2, 1, 1, 1, tp=cfg.parallel.tp_size, dtype=planned_dtype(cfg.model.dtype))
    if least.total > budget:
        raise JobError(
            f"memory_budget: {fmt_bytes(budget)} per rank is below the {fmt_bytes(least.total)} that "
            f"{cfg.model.name} needs for one sample of the smallest method (ED kv_max 2, {cfg.model.dtype}; "
            f"{fmt_bytes(least.weights)} of it weights): raise memory_budget or leave it unset"
        )


def _check_a_run_holds_the_prompts(
    cfg: RunConfig, model_config, samples: list[tasks.Sample] | None, task_data: tasks.TaskData | None
) -> None:
    """JobError, before the model loads, when ``memory_budget`` holds none of the listed runs for the job's longest
    prompt (its tokenizer read alone): one line with each run's bytes needed and the longest prompt its method fits
    in the budget, and BM's need where a bounded prefill fits. A run that does not fit beside one that does is an
    OOM row of the job (``eval.run``); a procedure and the main job plan their batches within the budget."""
    budget = cfg.memory.budget_bytes()
    if budget is None or cfg.main_job or cfg.memory.procedure is not None:
        return
    try:
        shape = ModelShape.from_config(model_config)
    except (AttributeError, TypeError):
        return  # a configuration the planner cannot read: the runs' own checks apply
    try:
        tokenizer = models.load_tokenizer(cfg.model.name)
    except (OSError, ValueError):
        return  # no tokenizer to read before the load: loading the model says what is wrong
    if tokenizer is None:
        return
    if task_data is not None:
        try:
            samples = tasks.build_samples(tokenizer, task_data, cfg.data.max_input_tokens)
        except ValueError as err:
            raise JobError(f"max_input_tokens: {err}") from None
    prompt_len = longest_prompt(tokenizer, samples)
    new, dtype, tp = cfg.generation.max_new_tokens, cfg.model.dtype, cfg.parallel.tp_size
    needs = []
    for spec in cfg.sweep.run_specs():
        slots = max(spec.batch_size, 1)
        estimate = predict_spec(shape, spec.method, slots, prompt_len, new, dtype, tp)
        if estimate.total <= budget:
            return
        held = prompts_held(shape, spec.method, budget, new, slots=slots, dtype=dtype, tp=tp)
        needs.append(f"{spec.name} needs {fmt_bytes(estimate.total)} ({held})")
    rule = cfg.sweep.rule_for("bm")
    kv = largest_kv_max(shape, budget, prompt_len, new, p=cfg.sweep.p, rule=rule, dtype=dtype, tp=tp)
    hint = (
        f"; BM's prefill is bounded: it fits one slot with kv_max up to {kv} (--method bm --kv-max {kv})" if kv else ""
    )
    raise JobError(
        f"memory_budget: {fmt_bytes(budget)} per rank holds none of the runs for the longest prompt "
        f"({prompt_len:,} tokens): {'; '.join(needs)}{hint}"
    )


def _load_data(data: DataConfig, seed: int) -> tuple[list[tasks.Sample] | None, tasks.TaskData | None]:
    """(samples, None) of a JSONL file; (None, the task's data) of a paper task (prompts need the tokenizer)."""
    if data.task != "jsonl":
        source = data.path if data.path is not None else f"the bundled fixture {tasks.fixture_dir(data.task)}"
        try:
            return None, tasks.load_task(
                data.task, data.path, num_shots=data.num_shots, num_samples=data.num_samples, seed=seed
            )
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot read the data"
            raise JobError(f"data: cannot load task {data.task} from {source}: {type(err).__name__}: {err}") from None
    path = data.path if data.path is not None else str(tasks.default_fixture_path())
    try:
        samples = tasks.load_jsonl(path)
    except (FileNotFoundError, ValueError) as err:
        raise JobError(f"data: {err}") from None
    if not samples:
        raise JobError(f"data: no samples in {path}")
    if data.num_samples is not None and data.num_samples > len(samples):
        logger.warning("num_samples=%d but %s has only %d samples", data.num_samples, path, len(samples))
    return [samples[i] for i in tasks.select_indices(len(samples), data.num_samples, seed)], None


def _warm_up_methods(cfg: RunConfig) -> list[Method]:
    """The methods the untimed warm-up runs: each distinct method of the job once (a procedure's runs are known
    only after planning: one of each kind)."""
    sweep = cfg.sweep
    if cfg.main_job:
        return cfg.main_job_methods()
    if cfg.memory.procedure is not None:
        kv_values = cfg.memory.kv_values
        kv = kv_values[0] if kv_values else max(128, sweep.p + 64, min_kv_max(sweep.p, sweep.rule))
        paper = cfg.memory.procedure == "paper"  # the paper's FKV: a fixed-capacity slot per sample
        return [
            Method("fkv", p=sweep.p, block=0, chunk=0) if paper else Method("fkv", p=sweep.p, block=BLOCK),
            Method("ed", kv_max=2, p=sweep.p),
            Method("bm", kv_max=kv, p=sweep.p, rule=sweep.rule),
        ]
    return list({s.method: None for s in sweep.run_specs()})


def _prepare(cfg: RunConfig, rank: int, world: int, local_rank: int) -> Job | list[dict]:
    """The job, or the summaries of its runs when every one has finished earlier (a single process resumes a
    listed sweep by writing the report only). The output folder exists from the start (a folder that cannot be made
    is one line before any model is read); a set-up that fails removes what it made."""
    made = _make_out(cfg.output.dir)
    try:
        return _prepare_job(cfg, rank, world, local_rank)
    except JobError:
        _unmake_out(made)
        raise


def _prepare_job(cfg: RunConfig, rank: int, world: int, local_rank: int) -> Job | list[dict]:
    samples, task_data = _load_data(cfg.data, cfg.generation.seed)  # first: a bad data file costs no model read
    cfg, device, model_config = _resolve(cfg, rank, world, local_rank)
    _check_a_run_holds_the_prompts(cfg, model_config, samples, task_data)
    try:
        resuming = results.check_same_config(cfg.output.dir, cfg.to_dict())
    except ValueError as err:
        raise JobError(str(err)) from None
    if resuming and world == 1 and not cfg.main_job and cfg.memory.procedure is None:
        finished = [results.read_summary(Path(cfg.output.dir) / s.name) for s in cfg.sweep.run_specs()]
        if all(finished):
            logger.info("every run in %s has finished: writing the report only", cfg.output.dir)
            return finished
    return Job(cfg, device, samples, task_data, _warm_up_methods(cfg))


# ---------------------------------------------------------------------- the job
def run(cfg: RunConfig, argv: Sequence[str] | None = None) -> int:
    """Run the job ``cfg`` describes (``argv``: unused; which job runs is the configuration's, ``cfg.main_job``).
    Returns the exit status."""
    logging.basicConfig(
        level=cfg.output.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    rank, world, local_rank = parallel.world_from_env()
    # several ranks: the set-up under one bound, each step named, and a watchdog from the first moment, so no rank
    # ever waits for a lost one or in a step that never ends (eval.replicas.Setup, as the lm-eval model starts)
    try:
        setup = replicas.Setup(rank, world, cfg.parallel.setup_timeout)
    except (RuntimeError, ValueError) as err:
        return fail(str(err))
    try:
        with setup.step("reading the model's configuration and the data"):
            job = _prepare(cfg, rank, world, local_rank)
    except JobError as err:
        # every rank finds the same set-up error: rank 0 says it, once (a rank alone in its error tells rank 0,
        # whose watchdog says it)
        setup.tell(str(err))
        return fail(str(err)) if rank == 0 else 2
    if isinstance(job, list):
        if setup.early is not None:
            setup.early[1].leave()
        return _report(cfg.output.dir, job, [])
    if rank != 0:
        _quiet_libraries()
    try:
        with _setup_stdout(rank == 0):  # DeepSpeed prints while it initialises: keep stdout for the report
            layout = setup.join(job.cfg.parallel.tp_size, job.device, timeout_s=job.cfg.parallel.setup_timeout)
    except BaseException as err:  # tell every rank at once (they wait in the same set-up), then fail here
        setup.tell(error_line(err))
        raise
    if layout.world == 1:  # plain python (or an MPI world of one: then a group of one exists)
        rc = _run(job, layout, Collectives(), setup)
        if dist.is_initialized():
            dist.destroy_process_group()
        return rc
    return _run_ranks(job, layout, setup)


def _run_ranks(job: Job, layout: parallel.Layout, setup: replicas.Setup) -> int:
    """A multi-process job: every rank is done (or failed the same check) before any leaves -- rank 0's process
    may host the store; a rank that fails tells every other and leaves at once."""
    with setup.step("connecting to the job's store"):
        comm = _meet(layout, setup.early)
    setup.bound.tell = comm.watchdog.fail
    try:
        rc = _run(job, layout, comm, setup)
        comm.barrier()
    except BaseException as err:  # noqa: BLE001 - any failure: tell every rank, then leave at once
        # a collective broken by a lost peer (a closed connection): name it, its beat stopped
        lost = [] if isinstance(err, RankOutOfMemory) else comm.watchdog.silent_peers()
        comm.fail(error_line(err))
        if isinstance(err, RankOutOfMemory):
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        else:
            logger.exception("rank %d failed; ending the job (every other rank stops too)", layout.rank)
        if lost:
            print(
                f"error: rank {layout.rank}: {', '.join(f'rank {r}' for r in lost)} has not answered (killed or "
                "hung): ending this rank (finished samples are on disk: run the same command again to complete "
                "the missing ones)",
                file=sys.stderr,
                flush=True,
            )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    comm.watchdog.leave()
    dist.destroy_process_group()
    return rc


def _meet(layout: parallel.Layout, early: tuple[dist.Store, replicas.Watchdog] | None) -> Collectives:
    """The job's meetings over the launcher's store, with the watchdog that ends this rank when another dies
    (``eval.replicas``): the one started at the first moment, or (MPI) one started now."""
    if early is not None:
        return Collectives(layout, *early)
    store = replicas.connect(layout.rank, layout.world)
    watchdog = replicas.Watchdog(store, layout.rank, layout.world).start()
    return Collectives(layout, store, watchdog)


def _report(out: str, summaries: list[results.RunSummary], notes: list[str]) -> int:
    """Rank 0 after the runs: OUT/report.md, results.csv and the plots; the report goes to stdout too."""
    paths = write_report(out, summaries, notes=notes)
    print(paths["report.md"].read_text(encoding="utf-8"), end="", flush=True)
    return 0


def _load(job: Job, layout: parallel.Layout, comm: Collectives, setup: replicas.Setup) -> RunContext:
    """The model (split with AutoTP) and its tokenizer, with the job's layout and collectives; the planning inputs
    are filled in once the samples are known. The end of the set-up (``setup``)."""
    cfg = job.cfg
    torch.manual_seed(cfg.generation.seed)
    with _setup_stdout(layout.is_main):
        step = f"loading the model {cfg.model.name} and splitting it over {layout.tp} ranks (DeepSpeed AutoTP)"
        with setup.step(step):
            model, tokenizer = models.load_on_ranks(cfg.model.name, layout, cfg.model.dtype, job.device)
    if layout.world > 1:
        with setup.step("waiting for every rank to load the model (a barrier of the default group)"):
            dist.barrier()  # every rank has loaded (default group: the long set-up timeout) before generation starts
        logger.info("world %d = dp_size %d x tp_size %d", layout.world, layout.dp, layout.tp)
    setup.done()
    return RunContext(model, tokenizer, layout=layout, comm=comm)


def _run(job: Job, layout: parallel.Layout, comm: Collectives, setup: replicas.Setup) -> int:
    cfg = job.cfg
    ctx = _load(job, layout, comm, setup)
    samples = job.samples
    if job.task_data is not None:
        try:
            samples = tasks.build_samples(ctx.tokenizer, job.task_data, cfg.data.max_input_tokens)
        except ValueError as err:
            return fail(f"max_input_tokens: {err}")
    ctx.shape = model_shape(ctx.model)  # None for a model without a config (test doubles): no predictions
    if ctx.shape is None and (cfg.memory.procedure is not None or job.main_job):
        return fail(
            f"model: {cfg.memory.procedure or 'the same-memory run'} needs the model's configuration to plan "
            f"memory ({cfg.model.name})"
        )
    ctx.prompt_len = longest_prompt(ctx.tokenizer, samples) if ctx.shape is not None else None
    if cfg.memory.procedure == "tune":
        return _tune(job, ctx, samples)
    plan = _plan(job, ctx, samples)
    if layout.is_main:
        write_config(cfg.output.dir, cfg)
    warm_up(ctx, plan.samples, job.methods, cfg.generation.seed)
    summaries = []
    for spec in plan.specs:
        run_cfg = cfg if spec.policy is None else cfg.replace(scheduler=spec.policy, compile="auto")
        summary = evaluate_run(ctx, plan.requests(spec), spec, run_cfg, extra=plan.extra.get(spec))
        if summary is not None:  # rank 0
            summaries.append(summary)
    if layout.is_main:
        _report(cfg.output.dir, summaries, plan.notes)
    return 0


def _tune(job: Job, ctx: RunContext, samples: list[tasks.Sample]) -> int:
    """``procedure: tune``: the auto-tuner's trials into ``OUT/tune/``, its choice into ``OUT/tuned.yaml``."""
    cfg, is_main = job.cfg, ctx.layout.is_main
    if is_main:
        write_config(cfg.output.dir, cfg)
    warm_up(ctx, samples, job.methods, cfg.generation.seed)
    try:
        info = procedures.run_tuner(ctx, samples, cfg)
    except ValueError as err:
        return fail(str(err))  # the tuner's one-line verdicts (budget too small for FKV, no references)
    if is_main:
        print(procedures.write_tune_results(cfg, info), end="", flush=True)
    return 0 if info["best"] is not None else 1


# ---------------------------------------------------------------------- which runs
@dataclass
class Plan:
    """The runs of a job, the samples they answer, notes for the report and extra summary fields per run;
    ``workload``: a run's own requests where they are more than ``samples`` (the main job's whole waves)."""

    specs: list[RunSpec]
    samples: list[tasks.Sample]
    notes: list[str] = field(default_factory=list)
    extra: dict[RunSpec, dict] = field(default_factory=dict)
    workload: dict[RunSpec, list[tasks.Sample]] = field(default_factory=dict)

    def requests(self, spec: RunSpec) -> list[tasks.Sample]:
        """What run ``spec`` serves: ``samples``, then its whole waves' unscored repeats if it has any."""
        return self.workload.get(spec, self.samples)


def _plan(job: Job, ctx: RunContext, samples: list[tasks.Sample]) -> Plan:
    """The listed runs, the paper's procedure's or the main job's (the same-memory comparison)."""
    if job.cfg.memory.procedure == "paper":
        return _paper_plan(job.cfg, ctx, samples)
    if job.main_job:
        return _main_job_plan(job, ctx, samples)
    return Plan(job.cfg.sweep.run_specs(), samples)


def _paper_plan(cfg: RunConfig, ctx: RunContext, samples: list[tasks.Sample]) -> Plan:
    """The paper's b0 procedure (``plan.budget.paper_specs``): b0 from the planner, where the paper's ED (which caches
    every prompt through its prefill, ``planner.paper_ed_bytes``) runs out of the budget. No real trial: this
    engine's ED holds only its slots, so it does not run out of memory where the paper's does."""
    layout = ctx.layout
    specs, plan = paper_specs(
        ctx.shape,
        ctx.prompt_len,
        budget=cfg.memory.budget_bytes(),
        max_new_tokens=cfg.generation.max_new_tokens,
        dtype=cfg.model.dtype,
        p=cfg.sweep.p,
        rule=cfg.sweep.rule,
        kv_values=cfg.memory.kv_values,
        num_samples=len(samples),
        tp=layout.tp,
    )
    if layout.is_main:
        atomic_write_text(Path(cfg.output.dir) / "plan.json", json.dumps(plan, indent=2) + "\n")
    return Plan(specs, samples, [plan["b0_note"]])


def _main_job_plan(job: Job, ctx: RunContext, samples: list[tasks.Sample]) -> Plan:
    """The same-memory comparison (``plan.budget.same_memory_plan``): every method at its largest batch within FKV's
    memory at batch 4 (or ``memory_budget``), the samples repeated up to the largest fitting batch."""
    cfg = job.cfg
    budget, runs = same_memory_plan(
        ctx.shape,
        job.methods,
        ctx.prompt_len,
        cfg.generation.max_new_tokens,
        num_samples=len(samples),
        budget_bytes=cfg.memory.budget_bytes(),
        max_prompts=cfg.sweep.max_prompts,
        tp=ctx.layout.tp,
        dtype=cfg.model.dtype,
    )
    specs = [r.spec for r in runs]
    extra = {r.spec: {"same_memory_budget_bytes": budget, "largest_fitting_batch": r.largest_fitting} for r in runs}
    samples = fill_samples(samples, max(s.batch_size for s in specs))
    bm = next((s for s in specs if takes_rule(s.method) and s.rule == "paper"), None)
    ed = any(m.keeps_newest for m in job.methods)  # the paper's setting is sized by its ED's b0
    if cfg.scheduler == "continuous" and bm is not None and ed:  # the paper's setting beside it: static batches
        paper = paper_setting_specs(
            ctx.shape, ctx.prompt_len, cfg.generation.max_new_tokens, budget, bm, p=cfg.sweep.p,
            tp=ctx.layout.tp, dtype=cfg.model.dtype,
        )  # fmt: skip
        specs += paper
        extra |= {s: {"same_memory_budget_bytes": budget, "paper_setting": True} for s in paper}
    # Whole waves: each run serves the prompts, then unscored repeats of them (spread over the set) up to a whole
    # number of waves of its slots, so no method's tokens/s depends on how empty its last wave is.
    workload = {s: whole_waves(samples, s.batch_size) for s in specs if s.batch_size > 0}
    fills = [f"{s.name} +{len(w) - len(samples)}" for s, w in workload.items() if len(w) > len(samples)]
    note = (
        f"Same memory: a budget of {fmt_bytes(budget)} per rank (the planner's peak of FKV at batch "
        f"{STORY_FKV_BATCH} unless memory_budget is set); every method runs at its largest batch within "
        f"it, bounded by the {len(samples)} prompts every method answers (the samples repeated up to the "
        f"largest fitting batch, at most {cfg.sweep.max_prompts}): "
        + ", ".join(f"{s.name} (fits {r.largest_fitting})" for s, r in zip(specs, runs))
        + ". Whole waves: a run whose slots do not divide the prompts also serves repeats of them, spread over the "
        "set, unscored, up to a whole number of waves of its slots (its tokens/s counts every request it served, its "
        "answers each prompt once), so no method's tokens/s depends on how full its last wave is"
        + (f" ({', '.join(fills)} requests)." if fills else ".")
    )
    logger.info("same-memory run: %s", note)
    return Plan(specs, samples, [note], extra, workload)
