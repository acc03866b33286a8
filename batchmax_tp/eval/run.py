"""The one run path: a run (method, rule, batch size, kv_max) over a task's samples -- resumable, crash-safe,
multi-process -- and the pieces every run shares (encoding, generating a batch, the warm-up).

:func:`evaluate_run` generates batch by batch and appends each finished batch to the run's folder
(``OUT/<run>/samples.jsonl`` and ``batches.jsonl``: :class:`batchmax_tp.eval.results.RunLog`); when every batch is
done it writes ``summary.json``. Run again with the same configuration it skips what is already done.

Batches are cut in sample order (``batch_size`` each); batch ``i`` samples with seed ``seed + i`` and runs on
data-parallel replica ``i % dp_size``. With several processes the replicas advance in rounds (round r: each
replica's r-th unfinished batch); after each round rank 0 gathers the round's records and appends them, so a
multi-process run is as crash-safe as a single process and only rank 0 touches the files. A progress bar
(rank 0) counts samples and shows the session's tokens/s.

Memory: before a run starts, the planner predicts its peak per rank (``plan.budget.predict_spec``: the run's batch
size, the longest prompt of its samples); every summary records it (``predicted_peak_bytes``) next to what was
measured (``peak_kv_bytes``, ``peak_workspace_bytes``, on CUDA ``cuda_max_memory_allocated``). A run whose
prediction exceeds ``memory_budget`` (or that has batch size 0: not even one sample fits) is not run: its summary is
an OOM row (``oom_cause: "predicted"``). A batch that raises an out-of-memory error ends the run with ``status:
"oom"`` (``oom_cause: "runtime"``; the paper's OOM rows); the caching allocator is emptied once the exception is
gone, and the sweep goes on with the next run. In a multi-process run the rank that runs out of memory cannot tell
its peers (they may be waiting inside the model's all-reduce): it writes ``oom-rank<R>.json`` into the run's folder
and raises :class:`RankOutOfMemory`, which ends the job at once (peers stuck in a collective time out within
``parallel.GENERATION_TIMEOUT_S`` if the launcher does not stop them first). Running the same command again turns
the marker into the run's OOM row and goes on with the next run.
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
from .tasks import Prompt, Sample, prompt_ids

if TYPE_CHECKING:  # the configuration sits above the evaluation layer; only its type is named here
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["BatchOutput", "Collectives", "RankOutOfMemory", "batched", "free_memory", "budget_fields", "cut_at_eos",
           "encode_prompts", "evaluate_run", "fill_samples", "generate_batch", "is_oom", "longest_prompt",
           "model_shape", "run_settings", "warm_up", "write_config"]

T = TypeVar("T")
GenerateFn = Callable[..., GenerationOutput]
EncodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RankOutOfMemory(RuntimeError):
    """One rank of a multi-process run ran out of memory; its marker is written and the job must end."""


def is_oom(err: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err))


def free_memory(device: torch.device | None) -> None:
    gc.collect()
    if getattr(device, "type", None) == "cuda":
        torch.cuda.empty_cache()


class Collectives:
    """The collectives of a multi-process run (rank 0 decides, everyone follows); no-ops in one process."""

    def __init__(self, layout: Layout | None, group: dist.ProcessGroup | None):
        self.layout, self.group = layout, group
        self.world = 1 if layout is None else layout.world

    def broadcast(self, obj: T) -> T:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: T) -> list[T] | None:
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.layout.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


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
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens, more than max_input_tokens={max_input_tokens}"
            )
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
        "memory_budget_bytes": cfg.budget_bytes(),
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


def generate_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt],
                   method: Method, cfg: RunConfig, seed: int, *, generate_fn: GenerateFn | None = None,
                   encode_fn: EncodeFn | None = None) -> BatchOutput:
    """Encode ``prompts``, generate with ``cfg``'s settings and decode: the step every run shares (``generate_fn``,
    ``encode_fn``: this module's ``generate`` and ``encode_prompts`` unless given, looked up at call time)."""
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    input_ids, attention_mask = encode_fn(tokenizer, list(prompts))
    device = getattr(model, "device", None)
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    eos_token_id, pad_token_id = _special_ids(tokenizer)
    cuda = getattr(device, "type", None) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = generate_fn(
        model, input_ids, attention_mask, method, cfg.max_new_tokens,
        ignore_eos=cfg.ignore_eos, eos_token_id=eos_token_id, pad_token_id=pad_token_id, do_sample=cfg.do_sample,
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed,
    )
    cuda_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    tokens = result.tokens.tolist() if hasattr(result.tokens, "tolist") else list(result.tokens)
    num_generated = [int(n) for n in (result.num_generated.tolist() if hasattr(result.num_generated, "tolist")
                                      else result.num_generated)]
    outputs = [tokenizer.decode(cut_at_eos(tokens[i], num_generated[i], eos_token_id), skip_special_tokens=True)
               for i in range(len(prompts))]
    prompt_tokens = [int(n) for n in attention_mask.sum(-1).tolist()]
    return BatchOutput(result, outputs, prompt_tokens, num_generated, cuda_peak)


def warm_up(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample],
            methods: Sequence[Method], seed: int, *, generate_fn: GenerateFn | None = None,
            encode_fn: EncodeFn | None = None, prompt_tokens: int = 8, new_tokens: int = 2) -> float:
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
        generate_fn(model, input_ids, attention_mask, method, new_tokens, ignore_eos=True,
                    eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed)
    elapsed = time.perf_counter() - start
    logger.info("warm-up (%d methods, %d prompt tokens, %d new tokens): %.2f s",
                len(methods), input_ids.shape[-1], new_tokens, elapsed)
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
        "model": cfg.model,
        "task": cfg.task,
        "data": cfg.data,
        "num_shots": cfg.shots_for_task(),
        "metric": cfg.metric_for_task(),
        "max_input_tokens": cfg.max_input_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "ignore_eos": cfg.ignore_eos,
        "do_sample": cfg.do_sample,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "tp_size": tp_size,
        "dp_size": dp_size,
    }


def evaluate_run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    spec: RunSpec,
    cfg: RunConfig,
    *,
    layout: Layout | None = None,
    group: dist.ProcessGroup | None = None,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
    progress: bool | None = None,
    prompt_len: int | None = None,
    shape: ModelShape | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Run (or finish, or skip) one run into ``cfg.out/<spec.name>``; its summary on rank 0.

    Collective when ``layout.world > 1``: every rank calls it with the same arguments (``group``: a gloo group
    with a long timeout for the result traffic). Returns the ``summary.json`` object on rank 0, None elsewhere.
    ``prompt_len`` (the longest encoded prompt of ``samples``) and ``shape`` (``planner.ModelShape``) are
    computed when not given; a model without a config gets no prediction (and no budget check). ``extra``: more
    fields for the summary (the same-memory run's budget).
    """
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    comm = Collectives(layout, group)
    is_main = layout is None or layout.is_main
    dp, tp = (1, 1) if layout is None else (layout.dp, layout.tp)
    replica, tp_rank = (0, 0) if layout is None else (layout.replica, layout.tp_rank)
    extra = extra or {}

    folder = Path(cfg.out) / spec.name
    log = results.RunLog(folder)
    continuous = cfg.scheduler == "continuous"  # then every sample is a "batch" of its own: done and resumed alone
    batches = [[s] for s in samples] if continuous else list(batched(list(samples), max(spec.batch_size, 1)))
    batch_ids = [[s.id for s in batch] for batch in batches]

    # Rank 0 reads what is done; every rank learns it.
    state = None
    if is_main:
        finished = results.read_summary(folder)
        if finished is not None:
            state = {"finished": finished}
        else:
            state = {"done": sorted(b["batch"] for b in log.load(batch_ids)[1]),
                     "oom": results.read_oom_marker(folder)}
    state = comm.broadcast(state)
    if "finished" in state:
        if is_main:
            logger.info("%s: finished earlier (%s), skipped", spec.name, state["finished"].get("status"))
        return state["finished"] if is_main else None
    done = set(state["done"])

    estimate = _predict(model, tokenizer, batches, spec, cfg, tp, prompt_len, shape, encode_fn)
    budget = cfg.budget_bytes()
    if spec.batch_size < 1 or (estimate is not None and budget is not None and estimate.total > budget):
        # Over the budget on paper: an OOM row, as if the run had failed in its first batch (the same verdict on
        # every rank: the prediction depends only on the config and the samples).
        if not is_main:
            return None
        message = ("not even one sample fits the memory budget; not run" if spec.batch_size < 1
                   else over_budget_message(estimate, budget))
        logger.warning("%s: %s", spec.name, message)
        return _write_oom_row(folder, cfg, spec, tp, dp, estimate, model, log, batch_ids, message, "predicted",
                              time.perf_counter(), extra=extra)
    if state["oom"] is not None:  # a rank of the last multi-process run ran out of memory here
        if not is_main:
            return None
        marker = state["oom"]
        message = f"rank {marker['rank']}, batch {marker['batch']}: {marker['error']}"
        logger.warning("%s: out of memory in the last run (%s); recorded as an OOM row", spec.name, message)
        return _write_oom_row(folder, cfg, spec, tp, dp, estimate, model, log, batch_ids, message, "runtime",
                              time.perf_counter(), extra=extra)

    todo = {r: [i for i in range(len(batches)) if i % dp == r and i not in done] for r in range(dp)}
    mine = todo[replica]
    rounds = max((len(v) for v in todo.values()), default=0)
    device = getattr(model, "device", None)

    done_samples = sum(len(batches[i]) for i in done)
    if is_main:
        logger.info("%s: %s, %d samples in %d batches%s", spec.name, spec.method.label(), len(samples),
                    len(batches), f", resuming after {len(done)} finished batches" if done else "")
    bar = tqdm(total=len(samples), initial=done_samples, desc=spec.name, unit="sample", dynamic_ncols=True,
               disable=(not is_main) if progress is None else not (progress and is_main))
    session_tokens, session_s = 0, 0.0
    started_at, start = utc_now(), time.perf_counter()
    status, stop = "done", None
    try:
        if continuous:
            stop = _serve_replica(model, tokenizer, samples, mine, spec, cfg, encode_fn, layout, comm, log, bar, folder)
            status = "oom" if stop is not None else status
        for r in range(0 if continuous else rounds):
            index = mine[r] if r < len(mine) else None
            message: dict[str, Any] = {"replica": replica, "tp_rank": tp_rank, "samples": None, "batch": None,
                                       "oom": None}
            if index is not None:
                try:
                    message.update(_run_batch(model, tokenizer, batches[index], index, spec, cfg, generate_fn,
                                              encode_fn, replica))
                except Exception as err:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
                    if not is_oom(err):
                        raise
                    message["oom"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                    if comm.world > 1:
                        # Peers may wait inside the model's collectives: nothing can be gathered. Leave the marker
                        # for the next run and end the job.
                        path = results.write_oom_marker(folder, layout.rank, message["oom"], index)
                        raise RankOutOfMemory(
                            f"{spec.name}: rank {layout.rank} ran out of memory in batch {index} ({message['oom']}); "
                            f"recorded in {path}: run the same command again to record the OOM row and go on"
                        ) from None
                if message["oom"]:
                    # Outside the handler: the exception (and the frames holding the batch's tensors) is gone,
                    # so the caching allocator can actually hand their memory back.
                    free_memory(device)
                if tp_rank != 0:
                    message["samples"] = None  # the replica's tp rank 0 reports its (identical) records
            gathered = comm.gather(message)
            if is_main:
                stop, written = _write_round(log, gathered)
                # Progress: this session's tokens/s; the replicas of a round run side by side.
                session_tokens += sum(b["generated_tokens"] for b in written)
                session_s += max((b["prefill_s"] + b["decode_s"] for b in written), default=0.0)
                bar.update(sum(len(b["ids"]) for b in written))
                if session_s > 0:
                    bar.set_postfix_str(f"{session_tokens / session_s:.1f} tokens/s", refresh=False)
            stop = comm.broadcast(stop)
            if stop is not None:
                status = "oom"
                logger.warning("%s: out of memory (%s); run marked OOM", spec.name, stop)
                break
    finally:
        bar.close()

    if not is_main:
        return None
    if status == "oom":
        return _write_oom_row(folder, cfg, spec, tp, dp, estimate, model, log, batch_ids, stop, "runtime", start,
                              started_at, extra=extra)
    summary = run_settings(cfg, spec, tp_size=tp, dp_size=dp)
    summary["status"] = status
    samples_done, batches_done = log.load(batch_ids)
    summary.update(results.summarise(samples_done, batches_done, cfg.metric_for_task()))
    summary.update(budget_fields(cfg, estimate, model))
    summary.update(extra)
    summary.update({"started_at": started_at, "finished_at": utc_now(), "wall_s": time.perf_counter() - start})
    if dp * tp > 1:
        summary["per_replica"] = results.per_replica(batches_done, dp, tp)
    if continuous:
        summary.update(results.latency_fields(batches_done))
    atomic_write_text(folder / results.SUMMARY_FILE, _json(summary))
    logger.info("%s: %d samples, %s %.4f, %.2f tokens/s", spec.name, summary["num_samples"], summary["metric"],
                summary["score"] or 0.0, summary["tokens_per_s"] or 0.0)
    return summary


def _write_oom_row(folder: Path, cfg: RunConfig, spec: RunSpec, tp: int, dp: int, estimate: MemoryEstimate | None,
                   model: torch.nn.Module, log: results.RunLog, batch_ids: list[list[str]], error: str, cause: str,
                   start: float, started_at: str | None = None, *, extra: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the run's summary as an OOM row (``cause``: predicted or runtime), written atomically."""
    summary = run_settings(cfg, spec, tp_size=tp, dp_size=dp)
    summary["status"] = "oom"
    summary.update(results.summarise(*log.load(batch_ids), cfg.metric_for_task()))
    summary.update(budget_fields(cfg, estimate, model))
    summary.update(extra)
    summary.update({"error": error, "oom_cause": cause, "started_at": started_at or utc_now(),
                    "finished_at": utc_now(), "wall_s": time.perf_counter() - start})
    atomic_write_text(folder / results.SUMMARY_FILE, _json(summary))
    return summary


def _predict(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, batches: list[list[Sample]], spec: RunSpec,
             cfg: RunConfig, tp: int, prompt_len: int | None, shape: ModelShape | None,
             encode_fn: EncodeFn) -> MemoryEstimate | None:
    """The planner's peak per rank of this run (None for a model without a config, e.g. a test double)."""
    if shape is None:
        shape = model_shape(model)
    if shape is None or not batches:
        return None
    if prompt_len is None:  # every batch is padded to its longest prompt
        prompt_len = max(int(encode_fn(tokenizer, [s.prompt for s in batch])[0].shape[-1]) for batch in batches)
    if cfg.scheduler == "continuous":
        return predict_pool(shape, spec.method, max(spec.batch_size, 1), prompt_len, cfg.max_new_tokens,
                            tp=tp, dtype=planned_dtype(cfg.dtype))
    return predict_spec(shape, spec.method, max(spec.batch_size, 1), prompt_len, cfg.max_new_tokens, cfg.dtype, tp)


def _serve_replica(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample],
                   mine: list[int], spec: RunSpec, cfg: RunConfig, encode_fn: EncodeFn, layout: Layout | None,
                   comm: Collectives, log: results.RunLog, bar, folder: Path) -> str | None:
    """Continuous batching (``core.serve``) of this replica's samples ``mine`` in ``spec.batch_size`` slots.

    Each sample's records are written as it ends (a single replica; with several, gathered at the end), its
    timing the run's prefill and decode seconds since the previous sample ended, so the sums are the run's. Each
    request samples with its own seed (``cfg.seed`` + its sample index). Returns an out-of-memory message or None.
    """
    eos, pad = _special_ids(tokenizer)
    replica, tp_rank = (0, 0) if layout is None else (layout.replica, layout.tp_rank)
    dp = 1 if layout is None else layout.dp
    requests = [Request(encode_fn(tokenizer, [samples[i].prompt])[0][0].tolist(), cfg.max_new_tokens,
                        seed=cfg.seed + i) for i in mine]
    metric, clock, kept = cfg.metric_for_task(), [0.0, 0.0], []

    def finished(j: int, out: RequestOutput) -> None:
        i, sample = mine[j], samples[mine[j]]
        text = tokenizer.decode(cut_at_eos(out.tokens, out.num_generated, eos), skip_special_tokens=True)
        reference = list(sample.reference) if isinstance(sample.reference, tuple) else sample.reference
        score = metric_score(metric, text, reference)
        record = {"id": sample.id, "prompt_tokens": len(requests[j].input_ids), "output": text,
                  "reference": reference, "correct": None if score is None or metric == "rouge2" else score == 1.0,
                  "generated_tokens": out.num_generated}
        batch = {"batch": i, "replica": replica, "ids": [sample.id], "tokens_cut": [int(sample.tokens_cut)],
                 "generated_tokens": out.num_generated, "prefill_s": out.run_prefill_s - clock[0],
                 "decode_s": out.run_decode_s - clock[1], "peak_kv_bytes": out.kv_bytes,
                 "peak_kv_bytes_per_rank": [out.kv_bytes], "peak_workspace_bytes": out.workspace_bytes,
                 "cuda_max_memory_allocated": None, "slot": out.slot, "first_token_s": out.first_token_s,
                 "latency_s": out.finished_s}
        clock[:] = [out.run_prefill_s, out.run_decode_s]
        if tp_rank != 0:
            return
        if dp == 1:
            log.append([record], [batch])
            bar.update(1)
        else:
            kept.append((record, batch))

    try:
        serve(model, requests, spec.method, spec.batch_size, ignore_eos=cfg.ignore_eos, eos_token_id=eos,
              pad_token_id=pad, do_sample=cfg.do_sample, temperature=cfg.temperature, top_k=cfg.top_k,
              top_p=cfg.top_p, prefill_budget=cfg.prefill_budget, on_finish=finished,
              tp_group=getattr(model, "batchmax_tp_group", None))
    except Exception as err:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
        if not is_oom(err):
            raise
        message = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        if comm.world > 1:
            path = results.write_oom_marker(folder, layout.rank, message, -1)
            raise RankOutOfMemory(f"{spec.name}: rank {layout.rank} ran out of memory ({message}); recorded in "
                                  f"{path}: run the same command again to record the OOM row and go on") from None
        return message
    if dp > 1:
        gathered = comm.gather(kept)
        if gathered is not None:
            rows = [row for part in gathered for row in part]
            log.append([r for r, _ in rows], [b for _, b in rows])
    return None


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _write_round(log: results.RunLog, gathered: list[dict[str, Any]]) -> tuple[str | None, list[dict]]:
    """Rank 0: append one round's records (in batch order, each batch's peak KV summed over its tp ranks).
    Returns ``(out-of-memory message or None, batch records written)``; nothing is written when a rank ran out of
    memory."""
    ooms = [m["oom"] for m in gathered if m["oom"]]
    if ooms:
        return ooms[0], []
    per_rank: dict[int, list[int]] = {}  # replica -> K/V peak of each of its tensor-parallel ranks
    for m in sorted((m for m in gathered if m["batch"] is not None), key=lambda m: m["tp_rank"]):
        per_rank.setdefault(m["replica"], []).append(int(m["batch"]["peak_kv_bytes"]))
    leads = sorted((m for m in gathered if m["samples"] is not None), key=lambda m: m["batch"]["batch"])
    for m in leads:
        m["batch"]["peak_kv_bytes"] = sum(per_rank[m["replica"]])
        m["batch"]["peak_kv_bytes_per_rank"] = per_rank[m["replica"]]
    log.append([rec for m in leads for rec in m["samples"]], [m["batch"] for m in leads])
    return None, [m["batch"] for m in leads]


def _run_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch: list[Sample], index: int,
               spec: RunSpec, cfg: RunConfig, generate_fn: GenerateFn, encode_fn: EncodeFn,
               replica: int) -> dict[str, Any]:
    """Generate one batch: its per-sample records (``results.SAMPLE_KEYS``) and its batch record."""
    out = generate_batch(model, tokenizer, [s.prompt for s in batch], spec.method, cfg, cfg.seed + index,
                         generate_fn=generate_fn, encode_fn=encode_fn)
    result = out.result
    metric = cfg.metric_for_task()
    samples = []
    for i, sample in enumerate(batch):
        reference = list(sample.reference) if isinstance(sample.reference, tuple) else sample.reference
        score = metric_score(metric, out.outputs[i], reference)
        samples.append({
            "id": sample.id,
            "prompt_tokens": out.prompt_tokens[i],
            "output": out.outputs[i],
            "reference": reference,
            "correct": None if score is None or metric == "rouge2" else score == 1.0,
            "generated_tokens": out.num_generated[i],
        })
    record = {
        "batch": index,
        "replica": replica,
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
