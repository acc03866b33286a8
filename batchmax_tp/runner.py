"""The reusable parts of ``launch/run.py``: batching, decoding, aggregation, result files and the table.

``run_method`` takes the ``generate`` function as a parameter (default: ``batchmax_tp.engine.generate``) so
tests can drive it with a fake engine. Every file is written atomically (temp file + rename), so an
interrupted run never leaves a half-written result behind.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "MethodRun",
    "RESULTS_TIMEOUT_S",
    "atomic_write_text",
    "batched",
    "aggregate",
    "gather_runs",
    "merge_replica_runs",
    "replica_batches",
    "cut_at_eos",
    "StoryRun",
    "STORY_BEST_RULE",
    "STORY_MAX_BATCH",
    "fill_samples",
    "format_story_table",
    "same_memory_plan",
    "story_methods",
    "story_requested",
    "format_table",
    "method_out_dir",
    "run_method",
    "summary_row",
    "utc_now",
    "warm_up",
    "write_config",
    "write_method_results",
    "write_table",
]


# ---------------------------------------------------------------------- small helpers
def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def batched(items: Sequence[Any], batch_size: int) -> Iterator[list[Any]]:
    """Consecutive batches of ``batch_size`` items in order; the last one may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(items), batch_size):
        yield list(items[start : start + batch_size])


def replica_batches(
    items: Sequence[Any], batch_size: int, replica: int = 0, num_replicas: int = 1
) -> Iterator[tuple[int, int, list[Any]]]:
    """``(batch_index, first_item_index, batch)`` of the batches data-parallel replica ``replica`` runs.

    Batches are cut in file order (:func:`batched`) and dealt round-robin: batch i goes to replica
    ``i % num_replicas``. With one replica this is every batch.
    """
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica must be in [0, {num_replicas}), got {replica}")
    for index, batch in enumerate(batched(items, batch_size)):
        if index % num_replicas == replica:
            yield index, index * batch_size, batch


def _eos_ids(eos_token_id: int | Iterable[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def cut_at_eos(tokens: Sequence[int], num_generated: int, eos_token_id: int | Iterable[int] | None) -> list[int]:
    """The first ``num_generated`` tokens, cut before the first EOS token (the EOS itself is dropped)."""
    eos = _eos_ids(eos_token_id)
    out: list[int] = []
    for tok in list(tokens)[: int(num_generated)]:
        if int(tok) in eos:
            break
        out.append(int(tok))
    return out


def _to_list(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


# ---------------------------------------------------------------------- aggregation
@dataclass
class MethodRun:
    """What one method produced over all batches (before it is turned into a summary)."""

    method: str
    kv_max: int | None
    p: int
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_kv_bytes: int = 0
    peak_workspace_bytes: int = 0  #: largest attention-score block (engine ``peak_workspace_bytes``), one rank
    cuda_max_memory_allocated: int | None = None  #: largest ``torch.cuda.max_memory_allocated`` of a batch (CUDA)
    num_batches: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  #: file index of each record (restores file order)
    started_at: str = ""
    finished_at: str = ""
    wall_s: float = 0.0

    def add_batch(self, result: Any, cuda_max_memory_allocated: int | None = None) -> None:
        """Fold one engine result (``.num_generated``, ``.prefill_s``, ``.decode_s``, ``.peak_kv_bytes``,
        ``.peak_workspace_bytes``) in, with the batch's CUDA peak when measured."""
        self.generated_tokens += int(sum(int(n) for n in _to_list(result.num_generated)))
        self.prefill_s += float(result.prefill_s)
        self.decode_s += float(result.decode_s)
        self.peak_kv_bytes = max(self.peak_kv_bytes, int(result.peak_kv_bytes))
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, int(getattr(result, "peak_workspace_bytes", 0) or 0))
        if cuda_max_memory_allocated is not None:
            self.cuda_max_memory_allocated = max(self.cuda_max_memory_allocated or 0, int(cuda_max_memory_allocated))
        self.num_batches += 1


def aggregate(run: MethodRun) -> dict[str, Any]:
    """Throughput and accuracy numbers of a finished :class:`MethodRun`."""
    total_s = run.prefill_s + run.decode_s
    checked = [r["correct"] for r in run.records if r.get("correct") is not None]
    num_correct = sum(1 for c in checked if c)
    return {
        "num_samples": len(run.records),
        "num_batches": run.num_batches,
        "generated_tokens": run.generated_tokens,
        "prefill_s": run.prefill_s,
        "decode_s": run.decode_s,
        "total_s": total_s,
        "tokens_per_s": run.generated_tokens / total_s if total_s > 0 else None,
        "peak_kv_bytes": run.peak_kv_bytes,
        "peak_kv_mib": run.peak_kv_bytes / 2**20,
        "peak_workspace_bytes": run.peak_workspace_bytes,
        "cuda_max_memory_allocated": run.cuda_max_memory_allocated,
        "num_checked": len(checked),
        "num_correct": num_correct,
        "accuracy": num_correct / len(checked) if checked else None,
    }


def summary_row(
    run: MethodRun,
    cfg: Any,
    *,
    tp_size: int = 1,
    dp_size: int = 1,
    per_replica: list[dict[str, Any]] | None = None,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``summary.json`` object of one method (``per_replica`` only for multi-process runs; ``memory``: the
    budget and the planner's prediction, ``batchmax_tp.budget.budget_fields``)."""
    summary: dict[str, Any] = {
        "method": run.method,
        "model": cfg.model,
        "batch_size": cfg.batch_size,
        "kv_max": run.kv_max,
        "p": run.p,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "max_new_tokens": cfg.max_new_tokens,
        "ignore_eos": cfg.ignore_eos,
        "do_sample": cfg.do_sample,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "data": cfg.data,
    }
    summary.update(aggregate(run))
    if memory is not None:
        summary.update(memory)
    summary.update({"started_at": run.started_at, "finished_at": run.finished_at, "wall_s": run.wall_s})
    if per_replica is not None:
        summary["per_replica"] = per_replica
    return summary


# ---------------------------------------------------------------------- one method
def _default_generate() -> Callable[..., Any]:
    return importlib.import_module("batchmax_tp.engine").generate


@dataclass
class BatchOutput:
    """One generated batch: the engine result, the decoded outputs (cut at the first EOS) and token counts."""

    result: Any
    outputs: list[str]
    prompt_tokens: list[int]
    num_generated: list[int]
    cuda_max_memory_allocated: int | None


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    method: Any,
    cfg: Any,
    seed: int,
    *,
    generate_fn: Callable[..., Any],
    encode_fn: Callable[..., Any],
    eos_token_id: Any,
    pad_token_id: int | None,
    device: Any,
) -> BatchOutput:
    """Encode ``prompts``, generate with ``cfg``'s settings and decode: the step every run mode shares."""
    input_ids, attention_mask = encode_fn(tokenizer, list(prompts))
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    cuda = getattr(device, "type", None) == "cuda"
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    result = generate_fn(
        model,
        input_ids,
        attention_mask,
        method,
        cfg.max_new_tokens,
        ignore_eos=cfg.ignore_eos,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        do_sample=cfg.do_sample,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        seed=seed,
    )
    cuda_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    tokens = _to_list(result.tokens)
    num_generated = [int(n) for n in _to_list(result.num_generated)]
    outputs = [
        tokenizer.decode(cut_at_eos(tokens[i], num_generated[i], eos_token_id), skip_special_tokens=True)
        for i in range(len(prompts))
    ]
    prompt_tokens = [int(sum(_to_list(row))) for row in _to_list(attention_mask)]
    return BatchOutput(result, outputs, prompt_tokens, num_generated, cuda_peak)


def run_method(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Any],
    method: Any,
    cfg: Any,
    *,
    generate_fn: Callable[..., Any] | None = None,
    encode_fn: Callable[..., Any] | None = None,
    is_correct_fn: Callable[[str, Any], bool | None] | None = None,
    progress: bool | None = None,
    replica: int = 0,
    num_replicas: int = 1,
) -> MethodRun:
    """Generate for every sample with ``method`` (a ``policy.Method``) in batches of ``cfg.batch_size``.

    Samples are batched in file order, encoded (chat template, left padding), generated with the engine,
    decoded up to the first EOS and checked against their reference. With ``num_replicas > 1`` only the batches
    of data-parallel replica ``replica`` run (:func:`replica_batches`); batch i always samples with seed
    ``cfg.seed + i``, so the outputs do not depend on the number of replicas.
    """
    from tqdm.auto import tqdm

    tasks = importlib.import_module("batchmax_tp.tasks")
    generate_fn = generate_fn or _default_generate()
    encode_fn = encode_fn or tasks.encode_prompts
    is_correct_fn = is_correct_fn or tasks.is_correct

    eos_token_id = getattr(tokenizer, "eos_token_id", None)
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos_token_id if isinstance(eos_token_id, int) else None
    device = getattr(model, "device", None)

    run = MethodRun(method=method.name, kv_max=None if method.name == "fkv" else method.kv_max, p=method.p)
    run.started_at = utc_now()
    start = time.perf_counter()
    label = method.label() if hasattr(method, "label") else method.name
    mine = list(replica_batches(samples, cfg.batch_size, replica, num_replicas))
    total = sum(len(batch) for _, _, batch in mine)
    if num_replicas > 1:
        logger.info(
            "running %s on %d of %d samples (replica %d of %d), batch size %d",
            label, total, len(samples), replica, num_replicas, cfg.batch_size,
        )
    else:
        logger.info("running %s on %d samples, batch size %d", label, len(samples), cfg.batch_size)
    bar = tqdm(total=total, desc=method.name, unit="sample", disable=None if progress is None else not progress)
    try:
        for index, first, batch in mine:
            out = generate_batch(
                model, tokenizer, [s.prompt for s in batch], method, cfg, cfg.seed + index,
                generate_fn=generate_fn, encode_fn=encode_fn, eos_token_id=eos_token_id,
                pad_token_id=pad_token_id, device=device,
            )
            result = out.result
            run.add_batch(result, out.cuda_max_memory_allocated)
            for i, sample in enumerate(batch):
                run.records.append(
                    {
                        "id": sample.id,
                        "prompt_tokens": out.prompt_tokens[i],
                        "output": out.outputs[i],
                        "reference": sample.reference,
                        "correct": is_correct_fn(out.outputs[i], sample.reference),
                        "generated_tokens": out.num_generated[i],
                    }
                )
                run.positions.append(first + i)
            logger.debug(
                "%s batch %d: %d samples, prefill %.3f s, decode %.3f s",
                method.name, index, len(batch), float(result.prefill_s), float(result.decode_s),
            )
            bar.update(len(batch))
    finally:
        bar.close()
    run.wall_s = time.perf_counter() - start
    run.finished_at = utc_now()
    return run


def warm_up(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Any],
    methods: Sequence[Any],
    cfg: Any,
    *,
    generate_fn: Callable[..., Any] | None = None,
    encode_fn: Callable[..., Any] | None = None,
    prompt_tokens: int = 8,
    new_tokens: int = 2,
) -> float:
    """One tiny untimed generate per method (the last ``prompt_tokens`` tokens of the first prompt,
    ``new_tokens`` new tokens), so that the first timed method does not pay one-time costs (lazy imports,
    attention registration, allocator and kernel warm-up). Returns the seconds it took.

    Every rank runs it on the same input, so tensor-parallel collectives stay in lock-step.
    """
    tasks = importlib.import_module("batchmax_tp.tasks")
    generate_fn = generate_fn or _default_generate()
    encode_fn = encode_fn or tasks.encode_prompts
    start = time.perf_counter()
    input_ids, attention_mask = encode_fn(tokenizer, [samples[0].prompt])
    input_ids, attention_mask = input_ids[:, -prompt_tokens:], attention_mask[:, -prompt_tokens:]
    device = getattr(model, "device", None)
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    eos_token_id = getattr(tokenizer, "eos_token_id", None)
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    for method in methods:
        generate_fn(
            model, input_ids, attention_mask, method, new_tokens,
            ignore_eos=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=cfg.seed,
        )
    elapsed = time.perf_counter() - start
    logger.info("warm-up (%d methods, %d prompt tokens, %d new tokens): %.2f s",
                len(methods), input_ids.shape[-1], new_tokens, elapsed)
    return elapsed


# ---------------------------------------------------------------------- data parallel: merging replicas
#: Timeout of the group that gathers results: data-parallel replicas finish a method up to a batch apart, which
#: can take much longer than the 60 s collective timeout of the model's groups (``tp.DEFAULT_TIMEOUT_S``).
RESULTS_TIMEOUT_S = 4 * 3600


def merge_replica_runs(runs: Sequence[MethodRun]) -> tuple[MethodRun, list[dict[str, Any]]]:
    """Fold the :class:`MethodRun` of every data-parallel replica (index = replica) into one, plus the
    ``per_replica`` list of ``summary.json``.

    Records are put back in file order. The replicas run concurrently, so the merged ``prefill_s`` and
    ``decode_s`` are those of the slowest replica (largest ``prefill_s + decode_s``) and the merged
    ``tokens_per_s`` = all generated tokens / that replica's time. ``peak_kv_bytes`` is the largest over
    replicas (each replica's value is already the total over its tensor-parallel ranks).
    """
    if not runs:
        raise ValueError("merge_replica_runs needs at least one run")
    first = runs[0]
    merged = MethodRun(method=first.method, kv_max=first.kv_max, p=first.p)
    per_replica = []
    for replica, run in enumerate(runs):
        if run.method != first.method:
            raise ValueError(f"replica {replica} ran {run.method}, replica 0 ran {first.method}")
        total_s = run.prefill_s + run.decode_s
        per_replica.append({
            "replica": replica,
            "num_samples": len(run.records),
            "num_batches": run.num_batches,
            "generated_tokens": run.generated_tokens,
            "prefill_s": run.prefill_s,
            "decode_s": run.decode_s,
            "tokens_per_s": run.generated_tokens / total_s if total_s > 0 else None,
            "peak_kv_bytes": run.peak_kv_bytes,
            "wall_s": run.wall_s,
        })
        merged.generated_tokens += run.generated_tokens
        merged.num_batches += run.num_batches
        merged.peak_kv_bytes = max(merged.peak_kv_bytes, run.peak_kv_bytes)
        merged.peak_workspace_bytes = max(merged.peak_workspace_bytes, run.peak_workspace_bytes)
        if run.cuda_max_memory_allocated is not None:
            merged.cuda_max_memory_allocated = max(merged.cuda_max_memory_allocated or 0, run.cuda_max_memory_allocated)
        merged.wall_s = max(merged.wall_s, run.wall_s)
    slowest = max(runs, key=lambda r: r.prefill_s + r.decode_s)
    merged.prefill_s, merged.decode_s = slowest.prefill_s, slowest.decode_s
    started = [r.started_at for r in runs if r.started_at]
    finished = [r.finished_at for r in runs if r.finished_at]
    merged.started_at = min(started) if started else ""
    merged.finished_at = max(finished) if finished else ""
    pairs = sorted(
        ((pos, rec) for run in runs for pos, rec in zip(run.positions, run.records, strict=True)),
        key=lambda pair: pair[0],
    )
    seen = [pos for pos, _ in pairs]
    if len(set(seen)) != len(seen):
        raise ValueError("a sample was generated by more than one replica")
    merged.positions = seen
    merged.records = [rec for _, rec in pairs]
    return merged, per_replica


def gather_runs(run: MethodRun, layout: Any, group: Any = None) -> tuple[MethodRun, list[dict[str, Any]]] | None:
    """Collect every rank's :class:`MethodRun` on rank 0 (``torch.distributed.gather_object``) and merge them.

    Collective: every rank calls it. Only the records and timings of each replica's tensor-parallel rank 0
    count (its peers computed the same tokens); ``peak_kv_bytes`` of a replica is the sum over its ranks,
    since each rank holds only its own KV heads. Returns ``(merged run, per_replica)`` on rank 0, else None.
    """
    import torch.distributed as dist

    mine = {"replica": layout.replica, "tp_rank": layout.tp_rank, "peak_kv_bytes": run.peak_kv_bytes,
            "run": run if layout.tp_rank == 0 else None}
    gathered = [None] * layout.world if layout.is_main else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if not layout.is_main:
        return None
    runs: list[MethodRun] = []
    per_rank: list[list[int]] = [[0] * layout.tp for _ in range(layout.dp)]
    for item in gathered:
        per_rank[item["replica"]][item["tp_rank"]] = int(item["peak_kv_bytes"])
    for replica in range(layout.dp):
        lead = next(item["run"] for item in gathered if item["replica"] == replica and item["tp_rank"] == 0)
        lead.peak_kv_bytes = sum(per_rank[replica])
        runs.append(lead)
    merged, per_replica = merge_replica_runs(runs)
    for replica, entry in enumerate(per_replica):
        entry["ranks"] = list(range(replica * layout.tp, (replica + 1) * layout.tp))
        entry["peak_kv_bytes_per_rank"] = per_rank[replica]
    return merged, per_replica


# ---------------------------------------------------------------------- files
def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and an atomic rename."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are ordinary files
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def method_out_dir(out: str | os.PathLike, method: str, several: bool) -> str:
    """``OUT`` for a single-method run, ``OUT/<method>`` when several methods run."""
    return os.path.join(os.fspath(out), method) if several else os.fspath(out)


def write_method_results(folder: str | os.PathLike, summary: dict[str, Any], records: Sequence[dict]) -> None:
    """``folder/summary.json`` and ``folder/samples.jsonl`` (one JSON object per sample)."""
    folder = os.fspath(folder)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write_text(os.path.join(folder, "samples.jsonl"), lines)
    atomic_write_text(os.path.join(folder, "summary.json"), json.dumps(summary, indent=2) + "\n")


def write_config(out: str | os.PathLike, cfg: Any) -> None:
    """The resolved configuration as ``OUT/config.yaml`` (loadable again with ``--config``)."""
    header = (
        "# Resolved batchmax_tp run configuration (defaults -> --config YAML -> CLI flags).\n"
        f"# Written {utc_now()}. Re-run with: python launch/run.py --config <this file>\n"
    )
    atomic_write_text(os.path.join(os.fspath(out), "config.yaml"), header + cfg.to_yaml())


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _method_cell(summary: dict[str, Any]) -> str:
    rule = summary.get("rule")
    return summary["method"] if rule in (None, "-", "paper") else f"{summary['method']} ({rule})"


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """Markdown table: method | batch | kv_max | tokens/s | peak KV MiB | correct (k/n). A BM row with a rule other
    than the paper's names it in the method cell, e.g. ``bm (probe)``."""
    lines = [
        "| method | batch | kv_max | tokens/s | peak KV MiB | correct (k/n) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        kv = "-" if s.get("kv_max") is None else str(s["kv_max"])
        correct = f"{s['num_correct']}/{s['num_checked']}" if s.get("num_checked") else "n/a"
        lines.append(
            f"| {_method_cell(s)} | {s['batch_size']} | {kv} | {_fmt(s.get('tokens_per_s'), '.2f')} | "
            f"{_fmt(s['peak_kv_bytes'] / 2**20, '.2f')} | {correct} |"
        )
    return "\n".join(lines) + "\n"


def write_table(out: str | os.PathLike, summaries: Sequence[dict[str, Any]]) -> str:
    table = format_table(summaries)
    atomic_write_text(os.path.join(os.fspath(out), "table.md"), table)
    return table


# ---------------------------------------------------------------------- the paper's story: same memory, larger batch
#: The rule the plain run shows beside the paper's: the best of ``launch/bench_retention.py`` (README: Retention).
STORY_BEST_RULE = "probe"
#: Largest batch the plain run uses for any method (CPU time); the planner's largest fitting batch is reported too.
STORY_MAX_BATCH = 16
#: FKV's batch whose predicted peak sets the default memory budget of the plain run.
STORY_FKV_BATCH = 4


def story_requested(cfg: Any, argv: Sequence[str] | None) -> bool:
    """Whether ``launch/run.py`` runs the same-memory comparison (:func:`same_memory_plan`).

    With a ``same_memory`` config key, that key decides (it is ignored for sweeps: ``runs``, a paper task, a
    budget or a procedure). Without one, only a plain ``python launch/run.py`` (no arguments at all) does.
    """
    if getattr(cfg, "sweep", False):
        return False
    flag = getattr(cfg, "same_memory", None)
    if flag is not None:
        return bool(flag)
    return argv is not None and len(argv) == 0


def story_methods(cfg: Any, best_rule: str | None = None) -> list[Any]:
    """FKV, ED, the paper's BM and BM with ``best_rule`` (default: ``cfg.rule`` when it is not the paper's, else
    :data:`STORY_BEST_RULE`), with ``cfg``'s kv_max and p."""
    policy = importlib.import_module("batchmax_tp.policy")
    rule = best_rule or (cfg.rule if cfg.rule != "paper" else STORY_BEST_RULE)
    kv = cfg.kv_max_for
    return [policy.Method("fkv", p=cfg.p), policy.Method("ed", kv_max=kv("ed"), p=cfg.p),
            policy.Method("bm", kv_max=kv("bm"), p=cfg.p), policy.Method("bm", kv_max=kv("bm"), p=cfg.p, rule=rule)]


def method_rule(method: Any) -> str:
    """The eviction rule a method runs with: BM's ``rule`` (default the paper's), '-' for FKV and ED."""
    return getattr(method, "rule", "paper") if getattr(method, "name", None) == "bm" else "-"


def method_key(method: Any) -> str:
    """A folder name per method of the same-memory run: ``fkv``, ``ed``, ``bm``, ``bm-<rule>``."""
    rule = method_rule(method)
    return method.name if rule in ("-", "paper") else f"{method.name}-{rule.split(':')[0]}"


@dataclass
class StoryRun:
    """One method of the same-memory run: the batch it runs at and the planner's numbers behind it."""

    method: Any
    batch: int  #: min(largest fitting batch, cap)
    largest_fitting: int  #: the planner's largest batch within the budget
    predicted_peak_bytes: int  #: the planner's peak per rank at ``batch``


def same_memory_plan(
    shape: Any,
    methods: Sequence[Any],
    prompt_len: int,
    max_new_tokens: int,
    *,
    budget_bytes: int | None = None,
    fkv_batch: int = STORY_FKV_BATCH,
    cap: int = STORY_MAX_BATCH,
    tp: int = 1,
    dtype: str = "float32",
) -> tuple[int, list[StoryRun]]:
    """(budget, runs): every method at its largest batch whose predicted peak per rank fits one memory budget.

    ``budget_bytes`` None = the planner's peak of FKV at ``fkv_batch`` for prompts of ``prompt_len`` tokens (so
    FKV runs at exactly that batch). Batches are capped at ``cap``; a method that does not fit even one sample
    gets batch 0 (reported as OOM, not run).
    """
    planner = importlib.import_module("batchmax_tp.planner")
    policy = importlib.import_module("batchmax_tp.policy")
    if budget_bytes is None:
        budget_bytes = planner.predict(shape, policy.Method("fkv"), fkv_batch, prompt_len, max_new_tokens,
                                       tp=tp, dtype=dtype).total
    runs = []
    for method in methods:
        fit = planner.max_batch(budget_bytes, shape, method, prompt_len, max_new_tokens, tp=tp, dtype=dtype,
                                limit=max(cap, 1) * 4)
        batch = min(fit, cap)
        peak = planner.predict(shape, method, max(batch, 1), prompt_len, max_new_tokens, tp=tp, dtype=dtype).total
        runs.append(StoryRun(method, batch, fit, peak))
    return budget_bytes, runs


def fill_samples(samples: Sequence[Any], n: int) -> list[Any]:
    """``samples`` repeated in order up to ``n`` (at least all of them); repeats get ids ``<id>~2``, ``~3``, ...
    so that every batch of the largest batch size is full."""
    import dataclasses as _dc

    out = list(samples)
    k = 0
    while len(out) < n:
        s = samples[k % len(samples)]
        out.append(_dc.replace(s, id=f"{s.id}~{k // len(samples) + 2}"))
        k += 1
    return out


def format_story_table(summaries: Sequence[dict[str, Any]], budget_bytes: int | None = None) -> str:
    """method | rule | batch | kv_max | tokens/s | peak KV MiB | predicted peak MiB | correct (k/n): each method at
    its largest batch within one memory budget (the paper's claim on one screen)."""
    lines = []
    if budget_bytes is not None:
        lines.append(f"Memory budget {budget_bytes / 2**20:.1f} MiB per rank (planner: weights + activations + K/V "
                     "+ score block); every method at its largest batch that fits.\n")
    lines += [
        "| method | rule | batch | kv_max | tokens/s | peak KV MiB | predicted peak MiB | correct (k/n) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        kv = "-" if s.get("kv_max") is None else str(s["kv_max"])
        pred = s.get("predicted_peak_bytes")
        if s.get("status") == "OOM":
            lines.append(f"| {s['method']} | {s.get('rule', '-')} | OOM | {kv} | - | - | {_fmt(pred and pred / 2**20, '.1f')} | - |")
            continue
        correct = f"{s['num_correct']}/{s['num_checked']}" if s.get("num_checked") else "n/a"
        lines.append(
            f"| {s['method']} | {s.get('rule', '-')} | {s['batch_size']} | {kv} | {_fmt(s.get('tokens_per_s'), '.2f')} | "
            f"{s['peak_kv_bytes'] / 2**20:.1f} | {_fmt(pred and pred / 2**20, '.1f')} | {correct} |"
        )
    return "\n".join(lines) + "\n"
