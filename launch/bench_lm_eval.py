"""lm-eval's own numbers for FKV, ED and Batch-Max side by side, at one memory budget, on the bundled tasks.

    python launch/bench_lm_eval.py                       # embedded model, both bundled tasks, results/lm_eval_bench
    python launch/bench_lm_eval.py --limit 4 --out /tmp/x  # a quick look

Each method runs lm-eval's ``simple_evaluate`` on the ``batchmax`` model with ``batch_size=auto``: the planner gives
it the most slots its pool fits in the budget (default: what FKV needs for 4 slots of the tasks' longest request).
Accuracy is lm-eval's metric; tokens/s is the requests' prompt + scored/generated tokens over the model's seconds
(``get_model_info()["batchmax"]``), per task. Writes ``OUT/<method>/<task>.json`` (lm-eval's results) and
``OUT/table.md``. Run it alone on the machine: the methods are compared inside this one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = {
    "batchmax_needle_mc": ("acc,none", "needle_mc.jsonl"),
    "batchmax_passkey": ("exact_match,first_number", "passkey.jsonl"),
}
METHODS = {  # label -> model_args
    "fkv": "method=fkv",
    "ed": "method=ed",  # the batchmax model's ED default: its serving_kv_max (65)
    "bm paper 512": "method=bm,kv_max=512",
    "bm question 512": "method=bm,kv_max=512,rule=question",
    "bm question 256": "method=bm,kv_max=256,rule=question",
}
MAX_GEN = 16  # the passkey task's max_gen_toks


def longest_request(tokenizer) -> int:
    """Tokens of the longest prompt + continuation of the bundled tasks (their doc_to_text, no chat template)."""
    longest = 0
    for _, data in TASKS.values():
        for line in (ROOT / "configs" / "lm_eval" / "data" / data).read_text().splitlines():
            doc = json.loads(line)
            text = f"{doc['context']}\n\nQuestion: {doc['question']}\nAnswer:"
            extra = max((len(tokenizer.encode(" " + c)) for c in doc.get("choices", [])), default=MAX_GEN)
            longest = max(longest, len(tokenizer.encode(text)) + max(extra, MAX_GEN))
    return longest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--memory-budget", default=None, help="bytes (default: FKV's pool for 4 slots)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all 20)")
    parser.add_argument("--out", default="results/lm_eval_bench")
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from batchmax_tp.harness import BatchMaxLM
    from batchmax_tp.plan.budget import fmt_bytes
    from batchmax_tp.plan.planner import parse_bytes, predict_pool

    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manager = TaskManager(include_path=str(ROOT / "configs" / "lm_eval"), include_defaults=False)
    pretrained = {"pretrained": args.pretrained} if args.pretrained else {}
    rows, budget = [], args.memory_budget
    for label in args.methods.split(","):
        model_args = dict(kv.split("=") for kv in METHODS[label].split(","))
        model_args = {k: int(v) if v.isdigit() else v for k, v in model_args.items()}
        if budget is None:  # FKV's pool for 4 slots of the longest request
            probe = BatchMaxLM(method="fkv", **pretrained)
            fkv = predict_pool(
                probe.shape, probe.method, 4, longest_request(probe.tokenizer), MAX_GEN, dtype=probe.dtype
            )
            budget = str(fkv.total)
            del probe
        lm = BatchMaxLM(batch_size="auto", memory_budget=budget, **pretrained, **model_args)
        row = {"method": label, "model_args": METHODS[label]}
        for task, (metric, _) in TASKS.items():
            lm.stats.clear()
            lm.batch_sizes.clear()
            start = time.perf_counter()
            res = simple_evaluate(
                model=lm, tasks=[task], limit=args.limit, task_manager=manager, cache_requests=False, bootstrap_iters=0
            )
            wall = time.perf_counter() - start
            (out / label.replace(" ", "_")).mkdir(exist_ok=True)
            (out / label.replace(" ", "_") / f"{task}.json").write_text(
                json.dumps(res, indent=2, default=str), encoding="utf-8"
            )
            info = res["config"]["batchmax"]
            row[task] = {
                "score": res["results"][task][metric],
                "tokens_per_s": info["tokens_per_s"],
                "slots": int(info["slots"]),
                "wall_s": wall,
                "peak_kv_bytes": int(info["peak_kv_bytes"]),
            }
            print(
                f"{label:>16} {task:>20}: {metric} {row[task]['score']:.3f}, {info['tokens_per_s']:.1f} tok/s, "
                f"{int(info['slots'])} slots, {wall:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        rows.append(row)
        del lm
    table = format_table(rows, fmt_bytes(parse_bytes(budget)), args.limit)
    (out / "table.md").write_text(table, encoding="utf-8")
    (out / "rows.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    print(table, end="")
    return 0


def format_table(rows: list[dict], budget: str, limit: int | None) -> str:
    head = (
        f"Memory budget {budget} (FKV's pool for 4 slots of the longest request); "
        f"{limit or 'all'} documents per task; accuracy: lm-eval's metric.\n\n"
        "| method | needle MC acc | tok/s | slots | passkey exact match | tok/s | slots |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    for r in rows:
        mc, pk = r["batchmax_needle_mc"], r["batchmax_passkey"]
        body += (
            f"| {r['method']} | {mc['score']:.2f} | {mc['tokens_per_s']:.0f} | {mc['slots']} | "
            f"{pk['score']:.2f} | {pk['tokens_per_s']:.0f} | {pk['slots']} |\n"
        )
    return head + body


if __name__ == "__main__":
    sys.exit(main())
