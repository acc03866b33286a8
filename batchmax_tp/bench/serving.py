"""Continuous batching against static batches at one memory budget, the library of ``launch/bench_serving.py`` (its
docstring says what one run measures): the command line, the workload, the rows' methods and sizes, the two ways
of running them, and the Markdown tables the script prints.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from collections.abc import Iterator

import torch

from ..core.engine import Engine
from ..core.method import Method, serving_kv_max
from ..core.requests import Batching, Request, Sampling
from ..core.rules import get_rule
from ..embedded import EMBEDDED_MODEL
from ..eval.results import percentile
from ..eval.tasks import default_fixture_path, load_jsonl
from ..plan.budget import fkv_budget
from ..plan.planner import ModelShape, max_batch, max_slots, parse_bytes, predict_pool

logger = logging.getLogger(__name__)

ROWS = (
    "cont-bm-paper",
    "cont-bm-question",
    "static-bm-paper",
    "static-bm-question",
    "cont-fkv",
    "cont-fkv-mixed",
    "cont-ed",
    "static-fkv",
    "static-ed",
)
EQUAL_ROWS = ("cont-bm-paper", "static-bm-paper", "cont-bm-question", "static-bm-question")
INSTRUCTIONS = (
    None,
    "Summarize the text above in three sentences.",
    "Retell the text above in detail, paragraph by paragraph.",
)  # None: the story's own question
CONT_OVER_STATIC_TARGET, EQUAL_TARGET = 1.3, 0.95


# ---------------------------------------------------------------------- command line
def parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--equal", action="store_true", help="the guard: equal prompts, EOS ignored, BM rows only")
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="default 12; --equal: the paper rule's static batch (capped by --max-batch)",
    )
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=3584)
    ap.add_argument("--prompt-len", type=int, default=1536, help="--equal: every prompt's length")
    ap.add_argument("--new", type=int, default=None, help="max new tokens (default 512; --equal 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-budget", default=None, help="bytes or e.g. 2GiB; default: FKV's peak at --fkv-batch")
    ap.add_argument("--fkv-batch", type=int, default=4)
    ap.add_argument("--kv-max", type=int, default=512)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64, help="cap on any batch or slot count")
    ap.add_argument(
        "--methods", default=None, help=f"comma-separated rows of {','.join(ROWS)} (default all; --equal: the BM rows)"
    )
    ap.add_argument("--out", default=None, help="JSON file (default results/bench_serving/<mixed|equal>.json)")
    return ap


def parse_args(argv=None, description: str | None = None) -> tuple[argparse.Namespace, list[str], str]:
    """(settings with ``new`` resolved, the rows to run, the JSON path); an unknown row: one line and exit 2."""
    ap = parser(description)
    a = ap.parse_args(argv)
    keys = [k.strip() for k in (a.methods or ",".join(EQUAL_ROWS if a.equal else ROWS)).split(",") if k.strip()]
    if not keys or any(k not in ROWS for k in keys):
        ap.error(
            f"--methods: {', '.join(k for k in keys if k not in ROWS) or 'none given'}; choose from {', '.join(ROWS)}"
        )
    a.new = a.new or (128 if a.equal else 512)
    return a, keys, a.out or os.path.join("results", "bench_serving", f"{mode(a)}.json")


def mode(a: argparse.Namespace) -> str:
    return "equal" if a.equal else "mixed"


# ---------------------------------------------------------------------- workload
def target_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` prompt lengths spread log-evenly over [lo, hi] (both ends included), shuffled with ``seed``."""
    if n == 1:
        return [hi]
    out = [round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (n - 1))) for i in range(n)]
    random.Random(seed).shuffle(out)
    return out


def build_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Chat-templated prompts of exactly ``lengths[i]`` tokens: story text cut to fit, then an instruction."""
    stories = [s.prompt.rsplit("\n\nQuestion:", 1) for s in load_jsonl(default_fixture_path())]
    mark = "\x00BODY\x00"
    head, tail = tokenizer.apply_chat_template(
        [{"role": "user", "content": mark}], add_generation_prompt=True, tokenize=False
    ).split(mark)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = []
    for i, n in enumerate(lengths):
        k = i % len(stories)
        ask = INSTRUCTIONS[i % len(INSTRUCTIONS)] or "Question:" + stories[k][1]
        start, end = enc(head), enc("\n\n" + ask + tail)
        room = n - len(start) - len(end)
        if room < 1:
            raise ValueError(
                f"prompt {i}: {n} tokens leave no room for text (template + instruction: {len(start) + len(end)})"
            )
        j, text, body = k, "", []
        while len(body) < room:  # the stories from k on, cycled until long enough
            text += ("\n\n" if text else "") + stories[j % len(stories)][0]
            j, body = j + 1, enc(text)
        prompts.append(start + body[:room] + end)
    return prompts


# ---------------------------------------------------------------------- rows: methods and sizes
def make_method(key: str, kv_max: int, p: int) -> Method:
    """A row's method: ``<cont|static>-<method>[-<rule>]``; a row naming a rule runs BM at ``kv_max`` and ``p``, the
    others at their ``core.method.serving_kv_max`` (ED: 65). ``cont-fkv-mixed``: continuous FKV whose prefill passes
    take the decoding rows' steps along, one model call for both (``Batching(mixed=True)``)."""
    name, _, rule = key.removesuffix(MIXED).split("-", 1)[1].partition("-")
    if rule:
        return Method(name, kv_max=kv_max, p=p, rule=rule)
    return Method(name, kv_max=serving_kv_max(name))


def continuous(key: str) -> bool:
    return key.startswith("cont")


#: A row key's suffix: its prefill passes take the decoding rows' steps along (``Batching(mixed=True)``).
MIXED = "-mixed"


def budget_bytes(a: argparse.Namespace, shape: ModelShape, longest: int) -> int:
    """--memory-budget, else the planner's static FKV peak at --fkv-batch for the longest prompt."""
    if a.memory_budget:
        return parse_bytes(a.memory_budget)
    return fkv_budget(shape, longest, a.new, batch=a.fkv_batch, dtype=a.dtype)


def fits(budget: int, shape: ModelShape, methods: dict[str, Method], longest: int, a: argparse.Namespace) -> dict:
    """Each row's largest size: slots (continuous, ``max_slots``) or batch (static, ``max_batch``)."""
    return {k: max_slots(budget, shape, m, longest, a.new, dtype=a.dtype) for k, m in methods.items()}


def num_requests(a: argparse.Namespace, budget: int, shape: ModelShape, longest: int) -> int:
    """--requests, else 12 (mixed) or the paper rule's static batch capped by --max-batch (equal)."""
    if a.requests:
        return a.requests
    if not a.equal:
        return 12
    paper = make_method("static-bm-paper", a.kv_max, a.p)
    return min(max_batch(budget, shape, paper, longest, a.new, dtype=a.dtype), a.max_batch)


# ---------------------------------------------------------------------- running
def warm_up(model, methods: list[Method], eos, pad) -> None:
    """One tiny untimed run per method and policy; BM as a small cache that evicts, with its rule."""
    for m in methods:
        n = 16
        if m.takes_rule:  # a prompt twice its kv_max, so that its prefill evicts with its rule
            m = Method(m.name, kv_max=max(64, 64 + get_rule(m.rule).protected()), p=32, rule=m.rule)
            n = 2 * m.kv_max
        ids = torch.randint(100, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        sampling = Sampling(eos_token_id=eos, ignore_eos=True, pad_token_id=pad)
        for policy in ("static", "continuous"):
            Engine(model, m, 1, batching=Batching(policy=policy)).run([Request(ids[0].tolist(), 4)], sampling)


def run_engine(
    model, prompts, method: Method, slots: int, new: int, ignore_eos: bool, eos, pad, policy: str, mixed: bool = False
) -> dict:
    """The prompts on one engine of ``slots`` slots under ``policy`` (``continuous``, or ``static``: the paper's
    padded batches of ``slots`` prompts, in order; ``mixed``: ``Batching.mixed``): its timings, each request's latency
    and first token."""
    reqs = [Request(p, new) for p in prompts]
    sampling = Sampling(eos_token_id=eos, ignore_eos=ignore_eos, pad_token_id=pad)
    t = time.perf_counter()
    out = Engine(model, method, slots, batching=Batching(policy=policy, mixed=mixed)).run(reqs, sampling)
    wall = time.perf_counter() - t
    return {
        "wall_s": wall,
        "generated": out.generated_tokens,
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "latency_s": [o.finished_s for o in out.outputs],
        "ttft_s": [o.first_token_s for o in out.outputs],
        "num_generated": [o.num_generated for o in out.outputs],
        "peak_kv_bytes": out.peak_kv_bytes,
    }


def run_row(model, shape, key: str, m: Method, size: int, prompts, longest: int, a, eos, pad) -> dict:
    """One row at ``size`` slots (continuous) or batch (static): its timings, latencies and the planner's total."""
    policy = "continuous" if continuous(key) else "static"
    row = run_engine(model, prompts, m, size, a.new, a.equal, eos, pad, policy, mixed=key.endswith(MIXED))
    est = predict_pool(shape, m, size, longest, a.new, dtype=a.dtype)
    row.update(
        tokens_per_s=row["generated"] / row["wall_s"],
        predicted_total=est.total,
        latency_p50_s=percentile(row["latency_s"], 50),
        latency_p99_s=percentile(row["latency_s"], 99),
        ttft_p50_s=percentile(row["ttft_s"], 50),
    )
    logger.info(
        "%-18s size %2d: %5d tokens in %6.1f s = %6.2f tok/s",
        key,
        size,
        row["generated"],
        row["wall_s"],
        row["tokens_per_s"],
    )
    return row


def run_rows(
    model, shape, methods: dict[str, Method], fit: dict, n: int, prompts, longest: int, a, eos, pad
) -> Iterator[dict]:
    """Every row at min(its fit, the requests, --max-batch); a row that fits nothing is yielded unrun (size 0)."""
    for k, m in methods.items():
        size = min(fit[k], n, a.max_batch)
        row = {"row": k, "label": m.label(), "fits": fit[k], "size": size}
        if size:
            row.update(run_row(model, shape, k, m, size, prompts, longest, a, eos, pad))
        yield row


# ---------------------------------------------------------------------- tables (the script prints them)
def format_table(rows: list[dict]) -> str:
    lines = [
        "| row | method | slots / batch (fits) | generated | wall s | tokens/s | latency p50 s | latency p99 s | "
        "TTFT p50 s | peak K/V MiB | predicted total MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["size"] == 0:
            lines.append(f"| {r['row']} | {r['label']} | OOM (0) | | | | | | | | |")
            continue
        lines.append(
            f"| {r['row']} | {r['label']} | {r['size']} ({r['fits']}) | {r['generated']} | {r['wall_s']:.1f} | "
            f"{r['tokens_per_s']:.2f} | {r['latency_p50_s']:.1f} | {r['latency_p99_s']:.1f} | "
            f"{r['ttft_p50_s']:.1f} | {r['peak_kv_bytes'] / 2**20:.1f} | {r['predicted_total'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict], equal: bool) -> list[dict]:
    """Continuous BM over static BM per rule (and, mixed, over continuous FKV and ED), where both rows ran."""
    tps = {r["row"]: r["tokens_per_s"] for r in rows if r["size"]}
    pairs = [
        (f"cont-bm-{rule}", f"static-bm-{rule}", EQUAL_TARGET if equal else CONT_OVER_STATIC_TARGET)
        for rule in ("paper", "question")
    ]
    if not equal:
        pairs += [
            (f"cont-bm-{rule}", other, None) for rule in ("paper", "question") for other in ("cont-fkv", "cont-ed")
        ]
    return [
        {"ratio": f"{a} / {b}", "value": tps[a] / tps[b], "target": t} for a, b, t in pairs if a in tps and b in tps
    ]


def format_ratios(ratios: list[dict]) -> str:
    lines = ["\n| ratio (tokens/s) | value | target |\n|---|---|---|"]
    for r in ratios:
        mark = "" if r["target"] is None else f">= {r['target']} ({'met' if r['value'] >= r['target'] else 'MISSED'})"
        lines.append(f"| {r['ratio']} | {r['value']:.2f} | {mark} |")
    return "\n".join(lines)


def header(a: argparse.Namespace, n: int, lengths: list[int], budget: int) -> str:
    return (
        f"\nmodel={a.model} device={a.device} dtype={a.dtype} threads={torch.get_num_threads()} mode={mode(a)} "
        f"requests={n} prompt tokens={min(lengths)}..{max(lengths)} (total {sum(lengths)}) new<={a.new} "
        f"eos={'ignored' if a.equal else 'honoured'} budget={budget / 2**20:.1f} MiB kv_max={a.kv_max} p={a.p}\n"
    )
