"""The one run path: a run (method, rule, batch size, kv_max) over a task's samples -- resumable, crash-safe,
multi-process -- and the pieces every run shares (encoding, generating a batch, the warm-up).

:func:`evaluate_run` generates batch by batch and appends each finished batch to the run's folder
(``OUT/<run>/samples.jsonl`` and ``batches.jsonl``: :class:`batchmax_tp.eval.results.RunLog`); when every batch is
done it writes ``summary.json``. Run again with the same configuration it skips what is already done.

Batches are cut in sample order (``batch_size`` each); batch ``i`` samples with seed ``seed + i`` and runs on
data-parallel replica ``i % dp_size``. With several replicas each one appends its finished batches to its own
shard (``OUT/<run>/replica<R>/``, written by its tensor-parallel rank 0) at its own pace, and the last replica to
finish merges the shards into the run's files and summary (``results.merge_run``): no replica waits for another
before the end of a run, and none waits for a dead one (``eval.replicas``). A progress bar (rank 0) counts
replica 0's samples and shows the session's tokens/s.

Memory: before a run starts, the planner predicts its peak per rank (``plan.budget.predict_spec``: the run's batch
size, the longest prompt of its samples); every summary records it (``predicted_peak_bytes``) next to what was
measured (``peak_kv_bytes``, ``peak_workspace_bytes``, on CUDA ``cuda_max_memory_allocated``). A run whose
prediction exceeds ``memory_budget`` (or that has batch size 0: not even one sample fits) is not run: its summary is
an OOM row (``oom_cause: "predicted"``). A batch that raises an out-of-memory error ends the run with ``status:
"oom"`` (``oom_cause: "runtime"``; the paper's OOM rows); the caching allocator is emptied once the exception is
gone, and the sweep goes on with the next run. In a multi-process run the rank that runs out of memory cannot tell
its peers (they may be waiting inside the model's all-reduce): it writes ``oom-rank<R>.json`` into the run's folder,
reports the failure through the store (every rank's watchdog then ends it) and raises :class:`RankOutOfMemory`,
which ends the job at once. Running the same command again turns the marker into the run's OOM row, clears it,
and goes on with the next run.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..core.engine import GenerationOutput, generate
from ..core.method import Method
from ..core.serve import Request, RequestOutput, serve
from ..parallel import Layout
from ..plan.budget import RunSpec, over_budget_message, planned_dtype, predict_spec
from ..plan.planner import MemoryEstimate, ModelShape, predict_pool
from . import results
from .files import atomic_write_text, utc_now
from .metrics import score as metric_score
from .replicas import Channel, Watchdog
from .tasks import Prompt, Sample, prompt_ids

if TYPE_CHECKING:  # the configuration sits above the evaluation layer; only its type is named here
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import GenerationConfig, RunConfig

logger = logging.getLogger(__name__)

__all__ = [
    "BatchOutput",
    "Collectives",
    "RankOutOfMemory",
    "RunContext",
    "batched",
    "free_memory",
    "budget_fields",
    "cut_at_eos",
    "encode_prompts",
    "error_line",
    "evaluate_run",
    "fill_samples",
    "generate_batch",
    "is_oom",
    "longest_prompt",
    "model_shape",
    "run_settings",
    "warm_up",
    "write_config",
]

T = TypeVar("T")
GenerateFn = Callable[..., GenerationOutput]
EncodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RankOutOfMemory(RuntimeError):
    """One rank of a multi-process run ran out of memory; its marker is written and the job must end."""


#: Messages of the errors that mean an allocation failed: PyTorch's, the host's, and those of the CUDA libraries
#: (cuBLAS, cuSOLVER, cuSPARSE, cuFFT, cuDNN) and the runtime, which do not raise ``torch.OutOfMemoryError``.
OOM_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
)


def is_oom(err: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m.lower() in text for m in OOM_MESSAGES)


def free_memory(device: torch.device | None) -> None:
    gc.collect()
    if getattr(device, "type", None) == "cuda":
        torch.cuda.empty_cache()


class Collectives:
    """The meetings of a multi-process run, over the launcher's store (``eval.replicas``), never in a collective
    that waits for a dead rank: ``broadcast``/``barrier``/``last_decides`` among every rank, ``replica_share`` and
    ``replica_gather`` among this replica's tensor-parallel ranks. No-ops in one process (no ``layout``)."""

    def __init__(self, layout: Layout | None = None, store: dist.Store | None = None, watchdog: Watchdog | None = None):
        self.layout, self.watchdog = layout, watchdog
        self.world = 1 if layout is None else layout.world
        if self.world > 1:
            self.all = Channel(store, layout.rank, layout.world)
            self.peers = Channel(dist.PrefixStore(f"replica{layout.replica}/", store), layout.tp_rank, layout.tp)

    def broadcast(self, obj: T) -> T:
        return obj if self.world == 1 else self.all.broadcast(obj)

    def barrier(self) -> None:
        if self.world > 1:
            self.all.barrier()

    def last_decides(self, part: T, decide: Callable[[list[T]], Any]) -> Any:
        return decide([part]) if self.world == 1 else self.all.last_decides(part, decide)

    def replica_share(self, obj: T) -> T:
        """The replica's tensor-parallel rank 0's ``obj`` on each of its ranks."""
        return obj if self.world == 1 or self.layout.tp == 1 else self.peers.broadcast(obj)

    def replica_gather(self, obj: T) -> list[T] | None:
        """Each tensor-parallel rank's ``obj`` on the replica's rank 0 (tp rank order), None on the others."""
        return [obj] if self.world == 1 or self.layout.tp == 1 else self.peers.gather(obj)

    def fail(self, why: str) -> None:
        """This rank is ending with an error: every other rank's watchdog ends it too."""
        if self.watchdog is not None:
            self.watchdog.fail(why)


# ---------------------------------------------------------------------- samples and prompts
def batched(items: Sequence[T], batch_size: int) -> Iterator[list[T]]:
    """Consecutive batches of ``batch_size`` items in order; the last one may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(items), batch_size):
        yield list(items[start : start + batch_size])


def fill_samples(samples: Sequence[Sample], n: int) -> list[Sample]:
    """``samples`` repeated in order up to ``n`` (at least all of them); repeats get ids ``<id>~2``, ``~3``, ...
    so that every batch of the largest batch size is full."""
    out = list(samples)
    k = 0
    while len(out) < n:
        s = samples[k % len(samples)]
        out.append(dataclasses.replace(s, id=f"{s.id}~{k // len(samples) + 2}"))
        k += 1
    return out


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    chat_template: bool = True,
    max_input_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts into LEFT-padded ``input_ids [B, s]`` and ``attention_mask [B, s]`` (s = longest).

    A prompt is a string (one user message) or a list of chat messages (``tasks.prompt_ids``). Pads use
    ``tokenizer.pad_token_id``. Prompts are never truncated here (``tasks.build_prompt`` cuts documents): if
    ``max_input_tokens`` is set and an encoded prompt is longer, ``ValueError`` names the prompt's index and
    length.
    """
    if not prompts:
        raise ValueError("encode_prompts needs at least one prompt")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no pad token; load it with batchmax_tp.models.load_model")
    if chat_template and not tokenizer.chat_template:
        raise ValueError("tokenizer has no chat template; pass chat_template=False")

    sequences: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        ids = prompt_ids(tokenizer, prompt, chat_template=chat_template)
        if max_input_tokens is not None and len(ids) > max_input_tokens:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_input_tokens={max_input_tokens}")
        sequences.append(ids)

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, s]
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, s]
    for row, ids in enumerate(sequences):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def longest_prompt(tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample]) -> int:
    """Tokens of the longest encoded prompt (chat template applied; after ``max_input_tokens`` cutting): the
    padded length of the batch that holds it, and so the prompt length every run is planned for."""
    return max(len(prompt_ids(tokenizer, s.prompt)) for s in samples)


def cut_at_eos(tokens: Sequence[int], num_generated: int, eos_token_id: int | Iterable[int] | None) -> list[int]:
    """The first ``num_generated`` tokens, cut before the first EOS token (the EOS itself is dropped)."""
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    out: list[int] = []
    for tok in list(tokens)[: int(num_generated)]:
        if int(tok) in eos:
            break
        out.append(int(tok))
    return out


# ---------------------------------------------------------------------- memory fields of a summary
def model_shape(model: torch.nn.Module) -> ModelShape | None:
    """``planner.ModelShape`` of a loaded model (its text config), or None when it has no usable config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    try:
        return ModelShape.from_config(config)
    except (AttributeError, TypeError):
        return None


def weights_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of the parameters this process holds (after a tensor-parallel split: this rank's share)."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return None
    seen, total = set(), 0
    for p in params():
        if id(p) not in seen:  # tied weights count once
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def peak_host_bytes() -> int:
    """This process's peak resident host memory so far (loading included), in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def budget_fields(cfg: RunConfig, estimate: MemoryEstimate | None, model: torch.nn.Module | None = None) -> dict:
    """The memory part of a summary: the budget and the prediction (per rank), the bytes of the weights this
    process holds (``weights_bytes``; the planner's ``predicted.weights`` is its estimate) and this process's peak
    host memory (``peak_host_bytes``)."""
    return {
        "memory_budget_bytes": cfg.memory.budget_bytes(),
        "predicted_peak_bytes": None if estimate is None else estimate.total,
        "predicted": None if estimate is None else estimate.as_dict(),
        "weights_bytes": None if model is None else weights_bytes(model),
        "peak_host_bytes": peak_host_bytes(),
    }


# ---------------------------------------------------------------------- one batch
@dataclass
class BatchOutput:
    """One generated batch: the engine result, the decoded outputs (cut at the first EOS) and token counts."""

    result: GenerationOutput
    outputs: list[str]
    prompt_tokens: list[int]
    num_generated: list[int]
    cuda_max_memory_allocated: int | None


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int | list[int] | None, int | None]:
    """(eos, pad) token ids: pad falls back to a single EOS id."""
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return eos, pad if pad is not None else eos if isinstance(eos, int) else None


def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    method: Method,
    generation: GenerationConfig,
    seed: int,
    *,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
) -> BatchOutput:
    """Encode ``prompts``, generate with the ``generation`` settings and decode: the step every run shares
    (``generate_fn``, ``encode_fn``: this module's ``generate`` and ``encode_prompts`` unless given, looked up at
    call time)."""
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    input_ids, attention_mask = encode_fn(tokenizer, list(prompts))  # [B, s] each, left-padded
    device = getattr(model, "device", None)
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    eos_token_id, pad_token_id = _special_ids(tokenizer)
    cuda = getattr(device, "type", None) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = generate_fn(
        model,
        input_ids,
        attention_mask,
        method,
        generation.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        seed=seed,
        **generation.sampling(),
    )
    cuda_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    tokens = _as_list(result.tokens)
    num_generated = [int(n) for n in _as_list(result.num_generated)]
    outputs = [
        tokenizer.decode(cut_at_eos(tokens[i], num_generated[i], eos_token_id), skip_special_tokens=True)
        for i in range(len(prompts))
    ]
    prompt_tokens = [int(n) for n in attention_mask.sum(-1).tolist()]
    return BatchOutput(result, outputs, prompt_tokens, num_generated, cuda_peak)


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    methods: Sequence[Method],
    seed: int,
    *,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
    prompt_tokens: int = 8,
    new_tokens: int = 2,
) -> float:
    """One tiny untimed generate per method (the last ``prompt_tokens`` tokens of the first prompt,
    ``new_tokens`` new tokens), so that the first timed run does not pay one-time costs (lazy imports,
    attention registration, allocator and kernel warm-up). Returns the seconds it took.

    Every rank runs it on the same input, so tensor-parallel collectives stay in lock-step.
    """
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    start = time.perf_counter()
    input_ids, attention_mask = encode_fn(tokenizer, [samples[0].prompt])
    input_ids, attention_mask = input_ids[:, -prompt_tokens:], attention_mask[:, -prompt_tokens:]  # [1, <=8]
    device = getattr(model, "device", None)
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    eos_token_id, pad_token_id = _special_ids(tokenizer)
    for method in methods:
        generate_fn(
            model,
            input_ids,
            attention_mask,
            method,
            new_tokens,
            ignore_eos=True,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            seed=seed,
        )
    elapsed = time.perf_counter() - start
    logger.info(
        "warm-up (%d methods, %d prompt tokens, %d new tokens): %.2f s",
        len(methods),
        input_ids.shape[-1],
        new_tokens,
        elapsed,
    )
    return elapsed


# ---------------------------------------------------------------------- one run
def write_config(out: str | Path, cfg: RunConfig) -> None:
    """The resolved configuration as ``OUT/config.yaml`` (loadable again with ``--config``)."""
    header = (
        "# Resolved batchmax_tp run configuration (defaults -> --config YAML -> CLI flags).\n"
        f"# Written {utc_now()}. Re-run with: python launch/run.py --config <this file>\n"
    )
    atomic_write_text(Path(out) / "config.yaml", header + cfg.to_yaml())


def run_settings(cfg: RunConfig, spec: RunSpec, *, tp_size: int = 1, dp_size: int = 1) -> dict[str, Any]:
    """The settings part of a run's ``summary.json`` (everything but the measurements)."""
    return {
        "run": spec.name,
        "method": spec.method.name,
        "rule": spec.rule,
        "batch_size": spec.batch_size,
        "kv_max": spec.kv_max,
        "p": spec.method.p,
        "model": cfg.model.name,
        "task": cfg.data.task,
        "data": cfg.data.path,
        "num_shots": cfg.data.shots_for_task(),
        "metric": cfg.data.metric_for_task(),
        "max_input_tokens": cfg.data.max_input_tokens,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "ignore_eos": cfg.generation.ignore_eos,
        "do_sample": cfg.generation.do_sample,
        "seed": cfg.generation.seed,
        "dtype": cfg.model.dtype,
        "device": cfg.model.device,
        "tp_size": tp_size,
        "dp_size": dp_size,
    }


@dataclass
class RunContext:
    """What every run of a job shares: the model and its tokenizer; where this process sits (``layout``; None: one
    process) and the job's collectives (``comm``; default: those of ``layout`` alone); the engine's functions
    (``generate_fn``, ``encode_fn``: this module's ``generate`` and :func:`encode_prompts` unless given, looked up
    at call time); the planning inputs (``prompt_len``: the longest encoded prompt of the samples, ``shape``: the
    model's ``planner.ModelShape``; found per run when None); ``progress``: show a bar (default: on rank 0)."""

    model: Any
    tokenizer: Any
    layout: Layout | None = None
    comm: Collectives | None = None
    generate_fn: GenerateFn | None = None
    encode_fn: EncodeFn | None = None
    prompt_len: int | None = None
    shape: ModelShape | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = Collectives(self.layout)

    @property
    def generate(self) -> GenerateFn:
        return self.generate_fn or generate

    @property
    def encode(self) -> EncodeFn:
        return self.encode_fn or encode_prompts

    @property
    def is_main(self) -> bool:
        return self.layout is None or self.layout.is_main

    @property
    def dp(self) -> int:
        return 1 if self.layout is None else self.layout.dp

    @property
    def tp(self) -> int:
        return 1 if self.layout is None else self.layout.tp

    @property
    def replica(self) -> int:
        return 0 if self.layout is None else self.layout.replica

    @property
    def lead(self) -> bool:
        """Whether this rank writes its replica's shard (the replica's tensor-parallel rank 0)."""
        return self.layout is None or self.layout.tp_rank == 0


@dataclass
class _Run:
    """One run in progress: its spec and configuration, its folder and this replica's shard of it, its batches
    (one sample each under the continuous scheduler: each is done and resumed alone) and the planner's peak."""

    spec: RunSpec
    cfg: RunConfig
    folder: Path
    shard: results.RunLog
    batches: list[list[Sample]]
    continuous: bool
    extra: dict[str, Any]
    estimate: MemoryEstimate | None = None

    @property
    def batch_ids(self) -> list[list[str]]:
        return [[s.id for s in batch] for batch in self.batches]

    def head(self, ctx: RunContext) -> dict[str, Any]:
        """What the run's summary says besides its measurements (``results.merge_run``)."""
        return {
            "settings": run_settings(self.cfg, self.spec, tp_size=ctx.tp, dp_size=ctx.dp),
            "batch_ids": self.batch_ids,
            "dp": ctx.dp,
            "tp": ctx.tp,
            "continuous": self.continuous,
            "budget": budget_fields(self.cfg, self.estimate, ctx.model),
            "extra": self.extra,
        }


def evaluate_run(
    ctx: RunContext, samples: Sequence[Sample], spec: RunSpec, cfg: RunConfig, *, extra: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Run (or finish, or skip) one run into ``OUT/<spec.name>``; its summary on rank 0.

    Collective when ``ctx.layout.world > 1``: every rank calls it with the same arguments and the job's
    :class:`Collectives`. Each replica writes its own shard as its batches finish; the last replica to finish
    merges the shards into the run's files and summary (``results.merge_run``). Returns the ``summary.json``
    object on rank 0, None elsewhere. A model without a config gets no prediction (and no budget check).
    ``extra``: more fields for the summary (the same-memory run's budget).
    """
    run = _open_run(ctx, samples, spec, cfg, extra)
    state = ctx.comm.broadcast(_run_state(run.folder) if ctx.is_main else None)  # rank 0 reads what is finished
    if "finished" in state:
        if ctx.is_main:
            logger.info("%s: finished earlier (%s), skipped", spec.name, state["finished"].get("status"))
        return state["finished"] if ctx.is_main else None
    run.estimate = _predict(ctx, run)
    refusal = _refusal(spec, run.estimate, cfg.memory.budget_bytes(), state)  # the same verdict on every rank
    if refusal is not None:
        return _record_refusal(ctx, run, *refusal) if ctx.is_main else None
    part = _generate_share(ctx, run, samples)
    summary = ctx.comm.last_decides(part, lambda parts: _merge(run.folder, parts, cfg))
    return summary if ctx.is_main else None


def _open_run(
    ctx: RunContext, samples: Sequence[Sample], spec: RunSpec, cfg: RunConfig, extra: dict[str, Any] | None
) -> _Run:
    folder = Path(cfg.output.dir) / spec.name
    continuous = cfg.sweep.scheduler == "continuous"
    batches = [[s] for s in samples] if continuous else list(batched(list(samples), max(spec.batch_size, 1)))
    shard = results.RunLog(results.shard_folder(folder, ctx.replica, ctx.dp))
    return _Run(spec, cfg, folder, shard, batches, continuous, extra or {})


def _run_state(folder: Path) -> dict[str, Any]:
    """What rank 0 finds of a run: its summary when it has finished, else the out-of-memory marker a rank of the
    last multi-process run left (or None)."""
    finished = results.read_summary(folder)
    return {"finished": finished} if finished is not None else {"oom": results.read_oom_marker(folder)}


def _refusal(
    spec: RunSpec, estimate: MemoryEstimate | None, budget: int | None, state: dict[str, Any]
) -> tuple[str, str] | None:
    """(message, oom_cause) of a run that is recorded as an OOM row without running, or None: over the budget on
    paper ("predicted"), or out of memory in the last run ("runtime": the marker it left)."""
    if spec.batch_size < 1:
        return "not even one sample fits the memory budget; not run", "predicted"
    if estimate is not None and budget is not None and estimate.total > budget:
        return over_budget_message(estimate, budget), "predicted"
    marker = state["oom"]
    if marker is not None:
        return (
            f"rank {marker['rank']}, batch {marker['batch']}: {marker['error']} (out of memory in the last run; "
            "recorded as an OOM row)"
        ), "runtime"
    return None


def _record_refusal(ctx: RunContext, run: _Run, message: str, cause: str) -> dict[str, Any]:
    """Rank 0: the OOM row of a run that does not run (with the batches a runtime OOM left, if any)."""
    logger.warning("%s: %s", run.spec.name, message)
    parts = results.read_parts(run.folder) if cause == "runtime" else []
    metric = run.cfg.data.metric_for_task()
    return results.merge_run(run.folder, run.head(ctx), parts, metric, error=message, cause=cause)


def _generate_share(ctx: RunContext, run: _Run, samples: Sequence[Sample]) -> dict[str, Any] | None:
    """This replica's unfinished batches, each appended to its shard as it ends. Returns the replica's part for
    the merge (on its lead rank; None elsewhere)."""
    shard, dp = run.shard, ctx.dp
    done = ctx.comm.replica_share(sorted(b["batch"] for b in shard.load(run.batch_ids)[1]) if ctx.lead else None)
    share = [i for i in range(len(run.batches)) if i % dp == ctx.replica]
    mine = [i for i in share if i not in done]
    if ctx.lead and dp > 1:
        atomic_write_text(shard.folder / results.HEAD_FILE, _json(run.head(ctx)))
    if ctx.is_main:
        resuming = f", resuming after {len(done)} finished batches" if done else ""
        logger.info(
            "%s: %s, %d samples in %d batches%s",
            run.spec.name,
            run.spec.method.label(),
            len(samples),
            len(run.batches),
            resuming,
        )
    bar = _progress_bar(ctx, run, share, done)
    started_at, start = utc_now(), time.perf_counter()
    try:
        stop = _serve_replica(ctx, run, samples, mine, bar) if run.continuous else _run_batches(ctx, run, mine, bar)
    finally:
        bar.close()
    if not ctx.lead:
        return None
    part = {"replica": ctx.replica, "started_at": started_at, "wall_s": time.perf_counter() - start, "stop": stop}
    if dp > 1:
        atomic_write_text(shard.folder / results.DONE_FILE, _json(part))
    part["head"] = run.head(ctx)
    part["samples"], part["batches"] = shard.load(run.batch_ids)
    return part


def _progress_bar(ctx: RunContext, run: _Run, share: list[int], done: list[int]) -> tqdm:
    """Rank 0's bar over replica 0's samples (``ctx.progress`` False: none)."""
    name = run.spec.name
    return tqdm(
        total=sum(len(run.batches[i]) for i in share),
        initial=sum(len(run.batches[i]) for i in done),
        desc=name if ctx.dp == 1 else f"{name} (replica {ctx.replica} of {ctx.dp})",
        unit="sample",
        dynamic_ncols=True,
        disable=(not ctx.is_main) if ctx.progress is None else not (ctx.progress and ctx.is_main),
    )


def _merge(folder: Path, parts: list[dict[str, Any] | None], cfg: RunConfig) -> dict[str, Any]:
    """The last rank to finish a run: the replicas' shards into the run's files and summary."""
    parts = [p for p in parts if p is not None]
    stops = [p["stop"] for p in parts if p.get("stop")]
    metric = cfg.data.metric_for_task()
    summary = results.merge_run(
        folder, parts[0]["head"], parts, metric, error=stops[0] if stops else None, cause="runtime"
    )
    if summary["status"] == "oom":
        logger.warning("%s: out of memory (%s); run marked OOM", summary["run"], stops[0])
    else:
        logger.info(
            "%s: %d samples, %s %.4f, %.2f tokens/s",
            summary["run"],
            summary["num_samples"],
            summary["metric"],
            summary["score"] or 0.0,
            summary["tokens_per_s"] or 0.0,
        )
    return summary


def error_line(err: BaseException) -> str:
    """An exception as one line: its type and its message, whitespace folded, at most 300 characters."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _end_on_oom(ctx: RunContext, run: _Run, error: str, batch: int) -> None:
    """A rank of a multi-process run out of memory: its peers may wait inside the model's collectives, so nothing
    can be gathered. Leave the marker for the next run, tell every rank, and end the job."""
    rank = ctx.layout.rank
    path = results.write_oom_marker(run.folder, rank, error, batch)
    ctx.comm.fail(f"out of memory in {run.spec.name}")
    where = f"batch {batch}" if batch >= 0 else "its requests"
    raise RankOutOfMemory(
        f"{run.spec.name}: rank {rank} ran out of memory in {where} ({error}); recorded in "
        f"{path}: run the same command again to record the OOM row and go on"
    )


def _oom_error(ctx: RunContext, run: _Run, step: Callable[[], T], batch: int) -> tuple[T | None, str | None]:
    """(``step()``, None), or (None, the error line) when it ran out of memory. Outside the handler the exception
    (and the frames holding the batch's tensors) is gone; a multi-process run then ends (:func:`_end_on_oom`)."""
    error = None
    try:
        return step(), None
    except Exception as err:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
        if not is_oom(err):
            raise
        error = error_line(err)
    if ctx.comm.world > 1:
        _end_on_oom(ctx, run, error, batch)
    return None, error


def _run_batches(ctx: RunContext, run: _Run, mine: list[int], bar) -> str | None:
    """This replica's unfinished batches ``mine``, each appended to its shard as it ends (by its tensor-parallel rank
    0, with the K/V peak of every rank). Returns an out-of-memory message (one process) or None."""
    tokens, seconds = 0, 0.0
    for index in mine:
        message, error = _oom_error(ctx, run, lambda index=index: _run_batch(ctx, run, index), index)
        if error is not None:
            free_memory(getattr(ctx.model, "device", None))
            return error
        record = message["batch"]
        peaks = ctx.comm.replica_gather(int(record["peak_kv_bytes"]))
        if peaks is None:
            continue  # the replica's tensor-parallel rank 0 writes its (identical) records
        record["peak_kv_bytes"], record["peak_kv_bytes_per_rank"] = sum(peaks), peaks
        run.shard.append(message["samples"], [record])
        tokens += record["generated_tokens"]
        seconds += record["prefill_s"] + record["decode_s"]
        bar.update(len(record["ids"]))
        if seconds > 0:
            bar.set_postfix_str(f"{tokens / seconds:.1f} tokens/s", refresh=False)
    return None


def _predict(ctx: RunContext, run: _Run) -> MemoryEstimate | None:
    """The planner's peak per rank of this run (None for a model without a config, e.g. a test double)."""
    shape = ctx.shape if ctx.shape is not None else model_shape(ctx.model)
    if shape is None or not run.batches:
        return None
    prompt_len = ctx.prompt_len
    if prompt_len is None:  # every batch is padded to its longest prompt
        encode = ctx.encode
        prompt_len = max(int(encode(ctx.tokenizer, [s.prompt for s in b])[0].shape[-1]) for b in run.batches)
    spec, cfg = run.spec, run.cfg
    new_tokens, batch = cfg.generation.max_new_tokens, max(spec.batch_size, 1)
    if run.continuous:
        dtype = planned_dtype(cfg.model.dtype)
        return predict_pool(shape, spec.method, batch, prompt_len, new_tokens, tp=ctx.tp, dtype=dtype)
    return predict_spec(shape, spec.method, batch, prompt_len, new_tokens, cfg.model.dtype, ctx.tp)


def _sample_record(sample: Sample, prompt_tokens: int, output: str, generated: int, metric: str) -> dict[str, Any]:
    """One line of ``samples.jsonl`` (``results.SAMPLE_KEYS``), scored with ``metric``."""
    reference = list(sample.reference) if isinstance(sample.reference, tuple) else sample.reference
    score = metric_score(metric, output, reference)
    return {
        "id": sample.id,
        "prompt_tokens": prompt_tokens,
        "output": output,
        "reference": reference,
        "correct": None if score is None or metric == "rouge2" else score == 1.0,
        "generated_tokens": generated,
    }


def _serve_replica(ctx: RunContext, run: _Run, samples: Sequence[Sample], mine: list[int], bar) -> str | None:
    """Continuous batching (``core.serve``) of this replica's samples ``mine`` in ``spec.batch_size`` slots.

    Each sample's records are appended to the replica's shard as it ends, its timing the run's prefill and decode
    seconds since the previous sample ended, so the sums are the run's. Each request samples with its own seed
    (``seed`` + its sample index). Returns an out-of-memory message (one process) or None.
    """
    cfg, tokenizer = run.cfg, ctx.tokenizer
    eos, pad = _special_ids(tokenizer)
    new_tokens, seed = cfg.generation.max_new_tokens, cfg.generation.seed
    requests = [
        Request(ctx.encode(tokenizer, [samples[i].prompt])[0][0].tolist(), new_tokens, seed=seed + i) for i in mine
    ]
    metric, clock = cfg.data.metric_for_task(), [0.0, 0.0]

    def finished(j: int, out: RequestOutput) -> None:
        i, sample = mine[j], samples[mine[j]]
        text = tokenizer.decode(cut_at_eos(out.tokens, out.num_generated, eos), skip_special_tokens=True)
        record = _sample_record(sample, len(requests[j].input_ids), text, out.num_generated, metric)
        batch = _served_batch_record(i, sample, out, clock, ctx.replica)
        clock[:] = [out.run_prefill_s, out.run_decode_s]
        if ctx.lead:
            run.shard.append([record], [batch])
            bar.update(1)

    def serve_all() -> None:
        serve(
            ctx.model,
            requests,
            run.spec.method,
            run.spec.batch_size,
            eos_token_id=eos,
            pad_token_id=pad,
            prefill_budget=cfg.sweep.prefill_budget,
            on_finish=finished,
            tp_group=getattr(ctx.model, "batchmax_tp_group", None),
            **cfg.generation.sampling(),
        )

    return _oom_error(ctx, run, serve_all, -1)[1]


def _served_batch_record(
    index: int, sample: Sample, out: RequestOutput, clock: list[float], replica: int
) -> dict[str, Any]:
    """One line of ``batches.jsonl`` for a request the continuous scheduler finished (``clock``: the run's prefill
    and decode seconds when the previous request finished)."""
    return {
        "batch": index,
        "replica": replica,
        "ids": [sample.id],
        "tokens_cut": [int(sample.tokens_cut)],
        "generated_tokens": out.num_generated,
        "prefill_s": out.run_prefill_s - clock[0],
        "decode_s": out.run_decode_s - clock[1],
        "peak_kv_bytes": out.kv_bytes,
        "peak_kv_bytes_per_rank": [out.kv_bytes],
        "peak_workspace_bytes": out.workspace_bytes,
        "cuda_max_memory_allocated": None,
        "slot": out.slot,
        "first_token_s": out.first_token_s,
        "latency_s": out.finished_s,
    }


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _run_batch(ctx: RunContext, run: _Run, index: int) -> dict[str, Any]:
    """Generate one batch: its per-sample records (``results.SAMPLE_KEYS``) and its batch record."""
    batch, cfg = run.batches[index], run.cfg
    out = generate_batch(
        ctx.model,
        ctx.tokenizer,
        [s.prompt for s in batch],
        run.spec.method,
        cfg.generation,
        cfg.generation.seed + index,
        generate_fn=ctx.generate,
        encode_fn=ctx.encode,
    )
    result, metric = out.result, cfg.data.metric_for_task()
    samples = [
        _sample_record(s, out.prompt_tokens[i], out.outputs[i], out.num_generated[i], metric)
        for i, s in enumerate(batch)
    ]
    record = {
        "batch": index,
        "replica": ctx.replica,
        "ids": [s.id for s in batch],
        "tokens_cut": [int(s.tokens_cut) for s in batch],
        "generated_tokens": sum(out.num_generated),
        "prefill_s": float(result.prefill_s),
        "decode_s": float(result.decode_s),
        "peak_kv_bytes": int(result.peak_kv_bytes),
        "peak_kv_bytes_per_rank": [int(result.peak_kv_bytes)],  # this rank's; rank 0 lists the replica's ranks
        "peak_workspace_bytes": int(getattr(result, "peak_workspace_bytes", 0) or 0),
        "cuda_max_memory_allocated": out.cuda_max_memory_allocated,
    }
    return {"samples": samples, "batch": record}
