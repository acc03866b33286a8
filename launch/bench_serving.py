"""Continuous batching (``core.serve``) against static batches (``core.engine.generate``) at one memory budget.

    python launch/bench_serving.py                        # 12 mixed-length requests, EOS honoured, up to 512 new
    python launch/bench_serving.py --equal                # the guard: equal prompts, EOS ignored, BM only
    python launch/bench_serving.py --requests 3 --new 8 --min-len 128 --max-len 256     # smoke test
    python launch/bench_serving.py --methods cont-bm-paper,static-bm-paper --memory-budget 2GiB

Workload: --requests prompts of real text from the bundled fixture (``fixtures/long_qa.jsonl``: six stories, each
with a short-answer question). Prompt i is cut from the stories (starting at story i mod 6, then the next ones) to
reach its target length, followed by one of three instructions in turn (the story's own question; a three-sentence
summary; a detailed retelling), so that the answers end at the model's own EOS after a few to hundreds of tokens.
Target lengths (chat template included, exact) are spread log-evenly over --min-len..--max-len and shuffled with
--seed; every request arrives at t = 0. --equal: every prompt --prompt-len tokens, EOS ignored, --new tokens each
(default 128), and by default as many requests as the paper rule's static batch, so both sides process everything
in one go and the ratio isolates continuous batching's own overhead (target >= 0.95).

Budget: --memory-budget, or the planner's static FKV peak at --fkv-batch for the longest prompt. Continuous rows run
at ``planner.max_slots`` slots, static rows at ``planner.max_batch`` for the longest prompt (batches cut in request
order, each LEFT-padded to its own longest); both are capped at the number of requests (a decode pass computes every
slot, idle or not) and at --max-batch. tokens/s = generated tokens (through EOS) / wall seconds of the whole row.
Latency: a request's end since t = 0 (continuous: ``finished_s``; static: the end of its batch); TTFT: its first
token (continuous: ``first_token_s``; static: the end of its batch's prefill). Peak K/V is measured, the predicted
total is the planner's (``predict_pool`` / ``predict``) at the size run. Markdown tables on stdout, JSON in --out.
Time on 2 CPU cores (embedded model, fp32): --requests 6 about 31 minutes (12: roughly twice that); --equal about 10.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.core.engine import generate  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.core.rules import get_rule  # noqa: E402
from batchmax_tp.core.serve import Request, serve  # noqa: E402
from batchmax_tp.eval.results import percentile  # noqa: E402
from batchmax_tp.eval.tasks import default_fixture_path, load_jsonl  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402
from batchmax_tp.plan.planner import ModelShape, max_batch, max_slots, parse_bytes, predict, predict_pool  # noqa: E402

logger = logging.getLogger("bench_serving")

ROWS = (
    "cont-bm-paper",
    "cont-bm-question",
    "static-bm-paper",
    "static-bm-question",
    "cont-fkv",
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


def make_method(key: str, kv_max: int, p: int) -> Method:
    kind = key.split("-", 1)[1]
    if kind.startswith("bm-"):
        return Method("bm", kv_max=kv_max, p=p, rule=kind[3:])
    return Method("ed", kv_max=65) if kind == "ed" else Method("fkv")


def warm_up(model, methods: list[Method], eos, pad) -> None:
    """One tiny untimed generate and serve per method; BM as a small cache that evicts, with its rule."""
    for m in methods:
        if m.name == "bm":
            m = Method("bm", kv_max=max(64, 64 + get_rule(m.rule).protected()), p=32, rule=m.rule)
        n = 2 * m.kv_max if m.name == "bm" else 16
        ids = torch.randint(100, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        generate(model, ids.to(model.device), None, m, 4, ignore_eos=True, eos_token_id=eos, pad_token_id=pad)
        serve(model, [Request(ids[0].tolist(), 4)], m, 1, ignore_eos=True, eos_token_id=eos, pad_token_id=pad)


def run_continuous(model, prompts, method: Method, slots: int, new: int, ignore_eos: bool, eos, pad) -> dict:
    reqs = [Request(p, new) for p in prompts]
    t = time.perf_counter()
    out = serve(model, reqs, method, slots, ignore_eos=ignore_eos, eos_token_id=eos, pad_token_id=pad)
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


def run_static(model, prompts, method: Method, batch: int, new: int, ignore_eos: bool, eos, pad) -> dict:
    lat, ttft, gen, peak, pre, dec = [], [], [], 0, 0.0, 0.0
    start = time.perf_counter()
    for a in range(0, len(prompts), batch):
        chunk = prompts[a : a + batch]
        s = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), s), pad, dtype=torch.long)  # [B, s] LEFT-padded to this batch's longest
        mask = torch.zeros((len(chunk), s), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, s - len(p) :], mask[j, s - len(p) :] = torch.tensor(p), 1
        t = time.perf_counter() - start
        out = generate(
            model,
            ids.to(model.device),
            mask.to(model.device),
            method,
            new,
            ignore_eos=ignore_eos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        end = time.perf_counter() - start
        lat += [end] * len(chunk)
        ttft += [t + out.prefill_s] * len(chunk)
        gen += [int(n) for n in out.num_generated.tolist()]
        peak, pre, dec = max(peak, out.peak_kv_bytes), pre + out.prefill_s, dec + out.decode_s
    return {
        "wall_s": time.perf_counter() - start,
        "generated": sum(gen),
        "prefill_s": pre,
        "decode_s": dec,
        "latency_s": lat,
        "ttft_s": ttft,
        "num_generated": gen,
        "peak_kv_bytes": peak,
    }


def print_table(rows: list[dict]) -> None:
    print(
        "| row | method | slots / batch (fits) | generated | wall s | tokens/s | latency p50 s | latency p99 s | "
        "TTFT p50 s | peak K/V MiB | predicted total MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["size"] == 0:
            print(f"| {r['row']} | {r['label']} | OOM (0) | | | | | | | | |")
            continue
        print(
            f"| {r['row']} | {r['label']} | {r['size']} ({r['fits']}) | {r['generated']} | {r['wall_s']:.1f} | "
            f"{r['tokens_per_s']:.2f} | {r['latency_p50_s']:.1f} | {r['latency_p99_s']:.1f} | "
            f"{r['ttft_p50_s']:.1f} | {r['peak_kv_bytes'] / 2**20:.1f} | {r['predicted_total'] / 2**20:.1f} |"
        )


def ratio_table(rows: list[dict], equal: bool) -> list[dict]:
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
    out = [{"ratio": f"{a} / {b}", "value": tps[a] / tps[b], "target": t} for a, b, t in pairs if a in tps and b in tps]
    print("\n| ratio (tokens/s) | value | target |\n|---|---|---|")
    for r in out:
        mark = "" if r["target"] is None else f">= {r['target']} ({'met' if r['value'] >= r['target'] else 'MISSED'})"
        print(f"| {r['ratio']} | {r['value']:.2f} | {mark} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a = ap.parse_args(argv)
    keys = [k.strip() for k in (a.methods or ",".join(EQUAL_ROWS if a.equal else ROWS)).split(",") if k.strip()]
    if not keys or any(k not in ROWS for k in keys):
        ap.error(
            f"--methods: {', '.join(k for k in keys if k not in ROWS) or 'none given'}; choose from {', '.join(ROWS)}"
        )
    mode = "equal" if a.equal else "mixed"
    a.new = a.new or (128 if a.equal else 512)
    out_path = a.out or os.path.join("results", "bench_serving", f"{mode}.json")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    model, tokenizer = load_model(a.model, dtype=a.dtype, device=a.device)
    shape = ModelShape.from_config(model.config)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    longest = a.prompt_len if a.equal else a.max_len
    budget = (
        parse_bytes(a.memory_budget)
        if a.memory_budget
        else predict(shape, Method("fkv"), a.fkv_batch, longest, a.new, dtype=a.dtype).total
    )
    methods = {k: make_method(k, a.kv_max, a.p) for k in keys}
    fits = {
        k: (max_slots if k.startswith("cont") else max_batch)(budget, shape, m, longest, a.new, dtype=a.dtype)
        for k, m in methods.items()
    }
    n = a.requests or (
        min(
            max_batch(budget, shape, make_method("static-bm-paper", a.kv_max, a.p), longest, a.new, dtype=a.dtype),
            a.max_batch,
        )
        if a.equal
        else 12
    )
    lengths = [a.prompt_len] * n if a.equal else target_lengths(n, a.min_len, a.max_len, a.seed)
    prompts = build_prompts(tokenizer, lengths)
    logger.info("%s: %d requests, prompt lengths %s, new %d, budget %.1f MiB", mode, n, lengths, a.new, budget / 2**20)
    warm_up(model, list({m: None for m in methods.values()}), eos, pad)

    rows = []
    for k, m in methods.items():
        size = min(fits[k], n, a.max_batch)
        row = {"row": k, "label": m.label(), "fits": fits[k], "size": size}
        if size:
            run = run_continuous if k.startswith("cont") else run_static
            row.update(run(model, prompts, m, size, a.new, a.equal, eos, pad))
            est = (predict_pool if k.startswith("cont") else predict)(shape, m, size, longest, a.new, dtype=a.dtype)
            row.update(
                tokens_per_s=row["generated"] / row["wall_s"],
                predicted_total=est.total,
                latency_p50_s=percentile(row["latency_s"], 50),
                latency_p99_s=percentile(row["latency_s"], 99),
                ttft_p50_s=percentile(row["ttft_s"], 50),
            )
            logger.info(
                "%-18s size %2d: %5d tokens in %6.1f s = %6.2f tok/s",
                k,
                size,
                row["generated"],
                row["wall_s"],
                row["tokens_per_s"],
            )
        rows.append(row)

    print(
        f"\nmodel={a.model} device={a.device} dtype={a.dtype} threads={torch.get_num_threads()} mode={mode} "
        f"requests={n} prompt tokens={min(lengths)}..{max(lengths)} (total {sum(lengths)}) new<={a.new} "
        f"eos={'ignored' if a.equal else 'honoured'} budget={budget / 2**20:.1f} MiB kv_max={a.kv_max} p={a.p}\n"
    )
    print_table(rows)
    ratios = ratio_table(rows, a.equal)

    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {
                "args": vars(a),
                "mode": mode,
                "budget_bytes": budget,
                "prompt_lengths": lengths,
                "threads": torch.get_num_threads(),
                "rows": rows,
                "ratios": ratios,
            },
            f,
            indent=2,
        )
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
