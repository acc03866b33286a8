"""Throughput at a fixed memory budget, the library of ``launch/bench_throughput.py`` (its docstring says what one
run measures): the command line, the methods and their largest fitting batches, the timed rows (ours and plain HF),
the ratios, the memory-by-length part, and the Markdown tables the script prints.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable, Iterator

import torch

from ..core.engine import Engine
from ..core.method import METHODS, Method, ed_settings, has, takes_rule
from ..core.requests import Batching, Request, Sampling
from ..core.rules import get_rule
from ..core.step import COMPILE_MODES
from ..embedded import EMBEDDED_MODEL
from ..eval.oom import free_memory
from ..plan.budget import fkv_budget, fmt_bytes
from ..plan.planner import DTYPE_BYTES, ModelShape, max_slots, parse_bytes, predict, predict_pool
from .hf_reference import has_hf_reference, hf_reference_generate
from .padded import generate

logger = logging.getLogger(__name__)

# BM/ED and BM/FKV measured with FKV and ED on the score-collecting attention (README, before the fair baselines).
OLD_RATIOS = {"bm_over_ed": 2.06, "bm_over_fkv": 2.55}
HF_TARGET = 0.95  # ours / plain HF tokens/s the fair baselines should reach
BM_OVER_ED_FLOOR = 1.6  # below this the report says so


# ---------------------------------------------------------------------- command line
def parse_rules(text: str) -> list[str]:
    """Rule specs (``core.rules`` syntax), comma-separated, or ';'-separated once a rule has parameters
    (``paper;snapkv:window=64,kernel=5``); each one validated. ValueError names a bad one."""
    sep = ";" if ";" in text or ":" in text else ","
    rules = [r.strip() for r in text.split(sep) if r.strip()]
    if not rules:
        raise ValueError("--rules: give at least one rule")
    for r in rules:
        get_rule(r)
    return rules


def lengths_arg(text: str) -> list[int]:
    """``--lengths``: comma-separated prompt lengths; empty = none (skip the memory-by-length part)."""
    return [int(x) for x in text.split(",") if x.strip()]


def parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument(
        "--memory-budget",
        default=None,
        help="bytes or e.g. 24GiB; default: on CUDA 90%% of the card's free memory before the model loads, on the "
        "CPU FKV's peak at --fkv-batch",
    )
    ap.add_argument("--fkv-batch", type=int, default=4)
    ap.add_argument("--kv-max", default="512", help="comma-separated BM kv_max values to try")
    ap.add_argument(
        "--rules",
        default="paper,question",
        help="BM's eviction rules, each run at every --kv-max (core.rules names; ';'-separated when a "
        "rule has parameters, e.g. 'paper;question:every=1'); the first non-paper one is the best "
        "rule whose ratios are shown beside the paper rule's",
    )
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument(
        "--max-batch", type=int, default=None, help="cap on any batch (default: 64 on the CPU, for time; none on CUDA)"
    )
    ap.add_argument(
        "--lengths", default="512,1024,2048,4096", help="prompt lengths of the memory-by-length part ('' skips it)"
    )
    ap.add_argument("--length-batch", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the plain-HF runs of FKV and ED")
    ap.add_argument(
        "--scheduler",
        choices=("static", "continuous"),
        default="static",
        help="static: one left-padded batch (bench.padded); continuous: the slot pool (core.engine), as many requests "
        "as slots, each row at the planner's max_slots",
    )
    ap.add_argument("--methods", default="fkv,ed,bm", help="which of fkv, ed, bm, snap to run (comma-separated)")
    ap.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="continuous: decode passes eager (none), through torch.compile (default) or captured as a CUDA graph "
        "(cudagraphs; auto: cudagraphs on CUDA); the compile or capture time is the row's compile_s, apart from its "
        "tokens/s and inside its wall_s",
    )
    ap.add_argument(
        "--pass-tokens",
        type=int,
        default=None,
        help="continuous BM: most prompt tokens per prefill pass (default: Method.pass_tokens(slots))",
    )
    ap.add_argument("--out", default="results/bench_throughput.json")
    return ap


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The settings, ``rules`` parsed into a list; a bad rule or length is one line and exit 2 (argparse)."""
    ap = parser(description)
    a = ap.parse_args(argv)
    try:
        a.rules = parse_rules(a.rules)
        lengths_arg(a.lengths)  # kept as given (the results' "args"): lengths_arg(a.lengths) reads it
        unknown = sorted(set(a.methods.split(",")) - set(METHODS))
        if unknown:
            raise ValueError(f"--methods: unknown {', '.join(unknown)} (give some of {', '.join(METHODS)})")
        if a.compile not in ("none", "auto") and a.scheduler != "continuous":
            raise ValueError("--compile compiles the continuous scheduler's decode passes: add --scheduler continuous")
    except ValueError as err:
        ap.error(str(err))
    return a


# ---------------------------------------------------------------------- methods, budget, rows
def label(method: str, kv_max, rule: str | None = None) -> str:
    """``FKV``, ``ED (kv_max 2)``, ``BM (paper, kv_max 512)``: BM rows name their rule (other rows have none)."""
    inside = [x for x in (rule, None if kv_max is None else f"kv_max {kv_max}") if x]
    return method.upper() + (f" ({', '.join(inside)})" if inside else "")


def best_rule(rules: list[str]) -> str | None:
    """The rule compared beside the paper's: the first non-paper rule given (None if only the paper's)."""
    return next((r for r in rules if r != "paper"), None)


def prompts(vocab: int, batch: int, length: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).to(device)


#: The share of a card's free memory the default budget takes (the allocator's rounding and the CUDA context).
CARD_FRACTION = 0.9


def budget_bytes(a: argparse.Namespace, shape: ModelShape, free: int | None = None) -> int:
    """--memory-budget; else on a card ``free`` bytes (its free memory before the model loads) x CARD_FRACTION;
    else (the CPU) the planner's peak of FKV at --fkv-batch (FKV fits exactly that many)."""
    if a.memory_budget:
        return parse_bytes(a.memory_budget)
    if free is not None:
        return int(CARD_FRACTION * free)
    return fkv_budget(shape, a.prompt_len, a.new, batch=a.fkv_batch, dtype=a.dtype)


def check_fits(shape: ModelShape, budget: int, a: argparse.Namespace, free: int | None = None) -> None:
    """ValueError (one line) when the budget exceeds the card's ``free`` memory, or the model's weights alone
    exceed the budget: nothing can run as planned, say so before loading them."""
    if free is not None and budget > free:
        raise ValueError(
            f"the budget of {fmt_bytes(budget)} exceeds the {fmt_bytes(free)} free on {a.device}: give a smaller "
            "--memory-budget (default: 90% of the free memory)"
        )
    weights = shape.weights_per_rank(1) * DTYPE_BYTES[a.dtype]
    if weights > budget:
        raise ValueError(
            f"{a.model} in {a.dtype} has {fmt_bytes(weights)} of weights, more than the budget of {fmt_bytes(budget)}: "
            "give a smaller model (e.g. --model arch:PATH.json) or a larger --memory-budget"
        )


def batch_cap(a: argparse.Namespace) -> int:
    """--max-batch, else 64 on the CPU (time) and no cap on CUDA (the budget decides)."""
    if a.max_batch is not None:
        return a.max_batch
    return 1 << 16 if a.device.startswith("cuda") else 64


def methods(a: argparse.Namespace) -> list[Method]:
    """The methods --methods names, in the registry's order (FKV, ED, BM, snap), each from its class's facts: one that
    never evicts as it is, ED's two runs (kv_max 2 and 65, ``ed_settings``), one with rules at every --kv-max with every
    rule, any other at every --kv-max."""
    named, out = set(a.methods.split(",")), []
    for name, kind in METHODS.items():
        if name not in named:
            continue
        if not kind.evicts:
            out.append(kind())
        elif kind.keeps_newest:
            out += ed_settings()
        else:
            rules = [{"rule": r} for r in a.rules] if kind.takes_rule else [{}]
            out += [kind(kv_max=int(k), p=a.p, **r) for k in a.kv_max.split(",") for r in rules]
    return out


def warm_method(rule: str) -> Method:
    """A small BM that evicts with ``rule`` (p 32, room for the pairs the rule protects, in its smallest layer too
    under a taper) for the warm-up."""
    p, scorer = 32, get_rule(rule)
    least = max(64, 2 * p + scorer.protected())
    kv_max = math.ceil(least / (1 - abs(scorer.taper) / 100) / p + 1) * p  # the smallest layer: at least ``least``
    return Method("bm", kv_max=kv_max if scorer.taper else least, p=p, rule=rule)


def warm_up(model, rules: list[str], device: str, hf: bool) -> None:
    """One untimed run of every path: FKV, ED, a small snap and a small BM per rule, the evicting ones on prompts
    twice their kv_max (plain HF too for FKV and ED with ``hf``)."""
    small = [Method("snap", kv_max=64, p=32, window=16)] + [warm_method(r) for r in rules]
    for m, length in [(Method("fkv"), 16), (Method("ed", kv_max=2), 16)] + [(m, 2 * m.kv_max) for m in small]:
        warm = prompts(model.config.vocab_size, 1, length, device)
        generate(model, warm, None, m, 4)
        if hf and has_hf_reference(m):
            hf_reference_generate(model, warm, None, m, 4)


def _hf_row(model, ids: torch.Tensor, method: Method, new: int, device: str, ours: torch.Tensor) -> dict:
    """The same prompts through plain HF on the model's own attention (``hf_reference_generate``)."""
    batch = ids.shape[0]
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    tokens, prefill_s, decode_s = hf_reference_generate(model, ids, None, method, new)
    row = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_step_ms": 1e3 * decode_s / max(new - 1, 1),
        "tokens_per_s": batch * new / (prefill_s + decode_s),
        "tokens_equal": torch.equal(tokens, ours),
    }
    if device.startswith("cuda"):
        row["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return row


def _served(model, ids: torch.Tensor, method: Method, new: int, pass_tokens: int | None, compile: str = "none"):
    """``ids``' rows served in as many slots (EOS ignored), the tokens as a [B, new] tensor like ``generate``'s."""
    requests = [Request(row.tolist(), new) for row in ids]
    engine = Engine(model, method, ids.shape[0], compile=compile, batching=Batching(pass_tokens=pass_tokens))
    out = engine.run(requests, Sampling(ignore_eos=True))
    out.tokens = torch.tensor([o.tokens for o in out.outputs], device=ids.device)
    return out


def timed(
    model,
    method: Method,
    batch: int,
    length: int,
    new: int,
    device: str,
    hf: bool = False,
    scheduler: str = "static",
    pass_tokens: int | None = None,
    compile: str = "none",
) -> dict:
    """One timed generation of ``new`` tokens (EOS ignored) at ``batch`` (static) or in ``batch`` slots
    (continuous); with ``hf``, FKV and ED through plain HF too (``hf`` and ``ours_over_hf``)."""
    ids = prompts(model.config.vocab_size, batch, length, device)
    if device.startswith("cuda"):
        free_memory(torch.device(device))  # the last row's buffers are not in this row's peak
        torch.cuda.reset_peak_memory_stats()
    if scheduler == "continuous":
        out = _served(model, ids, method, new, pass_tokens if method.bounded_prefill else None, compile)
    else:
        out = generate(model, ids, None, method, new, ignore_eos=True)
    row = {
        "batch": batch,
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        # a compiled or captured run's first decode pass is in compile_s
        "decode_step_ms": 1e3 * out.decode_s / max(new - 1 - (getattr(out, "compile_s", 0.0) > 0), 1),
        "tokens_per_s": batch * new / (out.prefill_s + out.decode_s),
        "peak_kv_bytes": out.peak_kv_bytes,
        "peak_workspace_bytes": out.peak_workspace_bytes,
        "compile_s": getattr(out, "compile_s", 0.0),
    }
    if device.startswith("cuda"):
        row["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    if hf and has_hf_reference(method):  # plain HF has neither Batch-Max nor snap
        row["hf"] = _hf_row(model, ids, method, new, device, out.tokens)
        row["ours_over_hf"] = row["tokens_per_s"] / row["hf"]["tokens_per_s"]
    return row


def run_rows(model, shape: ModelShape, a: argparse.Namespace, budget: int) -> Iterator[tuple[Method, dict]]:
    """Each method at its largest fitting batch (capped at --max-batch), timed: yields (method, row) as each ends;
    a method that does not fit at all is an OOM row."""
    s, T = a.prompt_len, a.new
    pool = a.scheduler == "continuous"
    for m in methods(a):
        kw = dict(dtype=a.dtype)  # the planner's settings; a pool's BM passes take --pass-tokens
        if pool and m.bounded_prefill:
            kw["pass_tokens"] = a.pass_tokens
        fit = max_slots(budget, shape, m, s, T, **kw)
        b = min(fit, batch_cap(a))
        head = {"method": m.name, "rule": m.rule if takes_rule(m) else None, "kv_max": m.kv_max}
        if b == 0:
            yield m, {**head, "batch": 0, "status": "OOM", "oom_cause": "planned"}
            continue
        t = time.perf_counter()
        try:
            timed_row = timed(model, m, b, s, T, a.device, not a.no_hf, a.scheduler, kw.get("pass_tokens"), a.compile)
        except torch.OutOfMemoryError as err:  # the planner under-counted on this card: a row, and the next method
            logger.warning("%s at batch %d: out of memory (%s)", m.label(), b, str(err).split(".")[0])
            free_memory(torch.device(a.device))
            yield m, {**head, "batch": b, "largest_fitting_batch": fit, "status": "OOM", "oom_cause": "runtime"}
            continue
        row = {
            **head,
            "largest_fitting_batch": fit,
            "status": "ok",
            "scheduler": a.scheduler,
            "pass_tokens": kw.get("pass_tokens"),
            "predicted": predict_pool(shape, m, b, s, T, **kw).as_dict(),
            **timed_row,
        }
        row["wall_s"] = time.perf_counter() - t
        yield m, row


def row_line(m: Method, row: dict) -> str:
    """A finished row in one line (the script's progress output)."""
    hf = (
        ""
        if "hf" not in row
        else f"  plain HF {row['hf']['tokens_per_s']:7.1f} tok/s (ours/HF {row['ours_over_hf']:.3f})"
    )
    return (
        f"{m.label():<40} b={row['batch']:<3} {row['tokens_per_s']:7.1f} tok/s  prefill {row['prefill_s']:7.1f}s  "
        f"decode {row['decode_s']:7.1f}s ({row['decode_step_ms']:.0f} ms/step){hf}"
    )


# ---------------------------------------------------------------------- ratios and memory
def fastest(rows: list[dict], kind: Callable[[type[Method]], bool], rule: str | None = None) -> dict | None:
    """The fastest finished row of a method ``kind`` picks by its facts (BM: of ``rule``), or None."""
    ok = [r for r in rows if has(r["method"], kind) and r["status"] == "ok" and (rule is None or r.get("rule") == rule)]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def ratios(rows: list[dict], rule: str | None) -> dict:
    """BM with ``rule`` (its fastest kv_max) over the fastest ED row and over FKV: tokens/s ratios, None where a
    row is missing (``rule`` None: no BM row)."""
    bm = fastest(rows, lambda m: m.takes_rule, rule) if rule else None
    ed, fkv = fastest(rows, lambda m: m.keeps_newest), fastest(rows, lambda m: not m.evicts)
    return {
        "rule": rule,
        "bm_kv_max": bm and bm["kv_max"],
        "bm_batch": bm and bm["batch"],
        "bm_over_ed": bm["tokens_per_s"] / ed["tokens_per_s"] if bm and ed else None,
        "bm_over_fkv": bm["tokens_per_s"] / fkv["tokens_per_s"] if bm and fkv else None,
    }


def measure_memory(
    model, shape, bm: Method, fkv: Method, lengths: list[int], batch: int, device: str, dtype: str
) -> list[dict]:
    """Measured (and predicted) peak K/V + workspace bytes of ``bm`` and ``fkv`` at ``batch`` per prompt length."""
    memory = []
    for L in lengths:
        for m in (bm, fkv):
            ids = prompts(model.config.vocab_size, batch, L, device, seed=1)
            out = generate(model, ids, None, m, 2, ignore_eos=True)
            est = predict(shape, m, batch, L, 2, dtype=dtype)
            memory.append(
                {
                    "method": m.name,
                    "prompt_len": L,
                    "batch": batch,
                    "measured_kv_plus_workspace": out.peak_kv_bytes + out.peak_workspace_bytes,
                    "predicted_kv_plus_workspace": est.kv + est.workspace,
                    "predicted_total": est.total,
                }
            )
    return memory


def peak_growth(memory: list[dict], lengths: list[int]) -> float | None:
    """BM's measured peak at the longest length over its peak at 1024 (None without both)."""
    bm_at = {r["prompt_len"]: r["measured_kv_plus_workspace"] for r in memory if has(r["method"], lambda m: m.evicts)}
    return bm_at[max(lengths)] / bm_at[1024] if 1024 in bm_at and max(lengths) in bm_at else None


# ---------------------------------------------------------------------- tables (the script prints them)
def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def format_runs(rows: list[dict]) -> str:
    lines = [
        "| method | batch | tokens/s | prefill s | decode s | ms/step | peak KV MiB | plain HF tokens/s | HF ms/step "
        "| ours/HF | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = label(r["method"], r["kv_max"], r.get("rule"))
        if r["status"] != "ok":
            lines.append(f"| {name} | OOM | | | | | | | | | |")
            continue
        h = r.get("hf")
        hf_cols = (
            (
                f"{h['tokens_per_s']:.1f} | {h['decode_step_ms']:.0f} | {r['ours_over_hf']:.3f} | "
                f"{'yes' if h['tokens_equal'] else 'NO'}"
            )
            if h
            else " | | |"
        )
        lines.append(
            f"| {name} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['prefill_s']:.1f} | {r['decode_s']:.1f} | "
            f"{r['decode_step_ms']:.0f} | {r['peak_kv_bytes'] / 2**20:.1f} | {hf_cols} |"
        )
    return "\n".join(lines)


def format_ratios(paper: dict, best: dict) -> str:
    """The paper rule's BM/ED and BM/FKV beside the figures before the fair baselines, then the best rule's."""
    where = lambda r: "-" if r["bm_batch"] is None else f"b {r['bm_batch']}, kv_max {r['bm_kv_max']}"  # noqa: E731
    lines = [
        "\n| ratio | now (fair baselines) | before (score-collecting baselines) | BM row |\n|---|---|---|---|",
        f"| BM/ED | {_fmt(paper['bm_over_ed'])} | {OLD_RATIOS['bm_over_ed']:.2f} | {where(paper)} |",
        f"| BM/FKV | {_fmt(paper['bm_over_fkv'])} | {OLD_RATIOS['bm_over_fkv']:.2f} | {where(paper)} |",
    ]
    if best["rule"]:
        lines.append(f"| BM ({best['rule']})/ED | {_fmt(best['bm_over_ed'])} | - | {where(best)} |")
        lines.append(f"| BM ({best['rule']})/FKV | {_fmt(best['bm_over_fkv'])} | - | {where(best)} |")
    lines.append(
        "BM/...: the paper rule's BM; BM (rule)/...: that rule's; each its fastest kv_max row. ED: the fastest ED row."
    )
    return "\n".join(lines)


def warnings(rows: list[dict], paper: dict) -> list[str]:
    """Lines for rows below the plain-HF target and for a paper-rule BM/ED below its floor."""
    out = []
    below = [label(r["method"], r["kv_max"]) for r in rows if r.get("ours_over_hf", HF_TARGET) < HF_TARGET]
    if below:
        out.append(f"ours/HF below {HF_TARGET}: {', '.join(below)}")
    if paper["bm_over_ed"] is not None and paper["bm_over_ed"] < BM_OVER_ED_FLOOR:
        out.append(f"BM/ED = {paper['bm_over_ed']:.2f} is below {BM_OVER_ED_FLOOR}")
    return out


def format_memory(memory: list[dict], lengths: list[int], batch: int, growth) -> str:
    lines = [f"\npeak K/V + workspace (MiB) at batch {batch}:", "prompt " + " ".join(f"{L:>8}" for L in lengths)]
    for name in dict.fromkeys(r["method"] for r in memory):  # as measured: BM, then FKV
        vals = [r["measured_kv_plus_workspace"] / 2**20 for r in memory if r["method"] == name]
        lines.append(f"{name:<6} " + " ".join(f"{v:>8.1f}" for v in vals))
    lines.append(f"BM peak at {max(lengths)} / at 1024 = {_fmt(growth)}")
    return "\n".join(lines)


def header(a: argparse.Namespace, budget: int, attention: str) -> str:
    """The settings line and the attentions the rows ran on."""
    return (
        f"\nmodel={a.model} device={a.device} dtype={a.dtype} threads={torch.get_num_threads()} prompt={a.prompt_len} "
        f"new={a.new} budget={budget / 2**30:.3f} GiB (planner total: weights + activations + K/V + workspace)\n"
        f"FKV/ED attention: {attention} (no score bookkeeping); BM: batchmax\n"
    )


def results(a, budget: int, attention: str, rows: list[dict], rules: dict, memory: list[dict], growth) -> dict:
    """What --out holds (``rules``: ``ratios`` per rule of --rules)."""
    best = best_rule(a.rules)
    return {
        "args": vars(a),
        "budget_bytes": budget,
        "attention": {"fkv_ed": attention, "bm": "batchmax"},
        "threads": torch.get_num_threads(),
        "runs": rows,
        "ratios": rules.get("paper", ratios(rows, None)),
        "best_rule": best,
        "ratios_best_rule": rules.get(best, ratios(rows, None)),
        "ratios_by_rule": rules,
        "ratios_before": OLD_RATIOS,
        "memory": memory,
        "bm_peak_growth_4096_over_1024": growth,
    }
