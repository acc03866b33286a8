"""The RULER-style suite (``configs/lm_eval/ruler``) through lm-eval on the ``batchmax`` model: FKV and Batch-Max
configurations side by side, each scored as a share of FKV's.

    python launch/bench_ruler.py      # tuning half, 2k + 4k, 7 tasks: FKV, BM paper/question at kv_max 512/256/128
    python launch/bench_ruler.py --half heldout --kv-max 256,128 --rules 'question;question:share=0'
    python launch/bench_ruler.py --configs fkv bm:512:paper bm:256:question --tasks niah_single,vt --limit 2

Configurations: ``--configs`` takes one per argument: ``fkv``; ``ed`` or ``ed:KV_MAX``; ``bm:KV_MAX`` or
``bm:KV_MAX:RULE``, where RULE is everything after the second ':' (``bm:256:snapkv:window=64,kernel=5``). ``--kv-max``
x ``--rules`` adds a Batch-Max grid (rules separated by ';', as they may hold ',' ':' '='); with neither ``--configs``
nor a grid flag the grid is kv_max 512,256,128 x rules paper;question. FKV always runs first: every share is of its
score.

The model loads once: each configuration is a view of it with its own method (``BatchMaxLM`` settings, method and
measurements; the same weights and tokenizer) and runs one ``simple_evaluate`` over the chosen tasks, one lm-eval
task per task and length (``batchmax_ruler_<task>_<2k|4k>_<half>``; greedy, plain text, lm-eval's own
``string_match_all``: the share of expected strings found in the output, averaged over the documents). Batch:
``--batch-size N`` slots, or ``auto`` (default): the most slots the planner fits in ``--memory-budget`` (default:
FKV's pool for 4 slots of the longest chosen request, measured with the model's tokenizer).

Writes into ``--out`` (default results/ruler_<half>): ``<NN>_<config>/results.json`` (lm-eval's results; its
samples too with ``--log-samples``), then ``table.json`` and ``table.md`` after every configuration, so a crash
loses only the configuration running. ``table.md``: per task and length each configuration's score, the means per
length and overall, each mean as a share of FKV's (per length and overall), tokens/s (prompt + generated tokens
over the model's prefill + decode seconds), slots, peak K/V and wall seconds. Progress goes to stderr. Run it
alone on the machine: the configurations' speeds are compared inside this one process.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "configs" / "lm_eval" / "ruler"
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
LENGTHS = ("2k", "4k")
HALVES = ("tune", "heldout")
METRIC = "string_match_all,none"
DEFAULT_KV_MAX, DEFAULT_RULES = "512,256,128", "paper;question"


@dataclass(frozen=True)
class Config:
    """One configuration: its label and its ``BatchMaxLM`` model_args (method, kv_max, rule)."""

    label: str
    args: dict = field(hash=False)


def parse_config(text: str) -> Config:
    """``fkv``, ``ed[:KV_MAX]`` or ``bm:KV_MAX[:RULE]`` (RULE: the rest, ':' ',' '=' included)."""
    method, _, rest = text.strip().partition(":")
    kv, _, rule = rest.partition(":")
    if method == "fkv" and not rest:
        return Config("fkv", {"method": "fkv"})
    if method == "ed" and not rest:
        return Config("ed", {"method": "ed"})
    if method == "ed" and kv.isdigit() and not rule:
        return Config(f"ed {kv}", {"method": "ed", "kv_max": int(kv)})
    if method == "bm" and kv.isdigit():
        rule = rule or "paper"
        return Config(f"bm {kv} {rule}", {"method": "bm", "kv_max": int(kv), "rule": rule})
    raise argparse.ArgumentTypeError(f"bad configuration {text!r}: expected fkv, ed[:KV_MAX] or bm:KV_MAX[:RULE]")


def configs_from_args(args: argparse.Namespace) -> list[Config]:
    """FKV, then ``--configs``, then the ``--kv-max`` x ``--rules`` grid; repeats dropped."""
    grid = args.kv_max is not None or args.rules is not None or not args.configs
    listed = [Config("fkv", {"method": "fkv"}), *(args.configs or [])]
    if grid:
        kv_maxes = (args.kv_max or DEFAULT_KV_MAX).split(",")
        rules = [r.strip() for r in (args.rules or DEFAULT_RULES).split(";") if r.strip()]
        listed += [parse_config(f"bm:{kv.strip()}:{rule}") for kv in kv_maxes for rule in rules]
    out: dict[str, Config] = {}
    for c in listed:
        out.setdefault(c.label, c)
    return list(out.values())


def task_names(half: str, tasks: list[str], lengths: list[str]) -> list[str]:
    return [f"batchmax_ruler_{t}_{n}_{half}" for n in lengths for t in tasks]


# -- the tables -----------------------------------------------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(rows: list[dict], tasks: list[str], lengths: list[str]) -> list[dict]:
    """Each row (``scores``: "<task> <length>" -> score; the first row is FKV's) with ``mean``, ``mean_by_length``,
    ``share_of_fkv`` and ``share_by_length`` (None where FKV's mean is 0)."""
    share = lambda a, b: a / b if b else None  # noqa: E731
    out = []
    for row in rows:
        by_length = {n: _mean([row["scores"][f"{t} {n}"] for t in tasks]) for n in lengths}
        out.append({**row, "mean": _mean(list(by_length.values())), "mean_by_length": by_length})
    fkv = out[0]
    for row in out:
        row["share_of_fkv"] = share(row["mean"], fkv["mean"])
        row["share_by_length"] = {n: share(row["mean_by_length"][n], fkv["mean_by_length"][n]) for n in lengths}
    return out


def format_table(rows: list[dict], tasks: list[str], lengths: list[str], about: str) -> str:
    """``about`` (a paragraph), then one column per configuration: per-task scores, means, shares of FKV's mean,
    tokens/s, slots, peak K/V, wall seconds."""
    num = lambda x, f=".3f": "-" if x is None else format(x, f)  # noqa: E731
    line = lambda name, cells: f"| {name} | " + " | ".join(cells) + " |\n"  # noqa: E731
    text = about + "\n\n" + line("task", [r["label"] for r in rows]) + line("---", ["---:"] * len(rows))
    for n in lengths:
        for t in tasks:
            text += line(f"{t} {n}", [num(r["scores"][f"{t} {n}"], ".2f") for r in rows])
    for n in lengths:
        text += line(f"**mean {n}**", [num(r["mean_by_length"][n]) for r in rows])
    text += line("**mean**", [f"**{num(r['mean'])}**" for r in rows])
    for n in lengths:
        text += line(f"share of FKV, {n}", [num(r["share_by_length"][n]) for r in rows])
    text += line("**share of FKV**", [f"**{num(r['share_of_fkv'])}**" for r in rows])
    text += line("tokens/s", [num(r["tokens_per_s"], ".0f") for r in rows])
    text += line("slots", [str(r["slots"]) for r in rows])
    text += line("peak K/V MiB", [num(r["peak_kv_bytes"] / 2**20, ".1f") for r in rows])
    text += line("wall s", [num(r["wall_s"], ".0f") for r in rows])
    return text


def write_tables(out: Path, rows: list[dict], tasks: list[str], lengths: list[str], settings: dict) -> str:
    """``table.json`` (the settings and the summarized rows) and ``table.md``; returns the markdown."""
    rows = summarize(rows, tasks, lengths)
    budget = settings["memory_budget"]
    about = (
        f"RULER-style suite, {settings['half']} half ({settings['suite']}), "
        f"{settings['limit'] or 'all'} documents per task, model {settings['model']}; batch "
        + (f"auto in {budget}" if settings["batch_size"] == "auto" else f"{settings['batch_size']} slots")
        + ". Scores: string_match_all (share of the expected strings in the output), mean over documents; "
        "shares: each mean over FKV's."
    )
    table = format_table(rows, tasks, lengths, about)
    (out / "table.json").write_text(json.dumps({**settings, "configs": rows}, indent=2), encoding="utf-8")
    (out / "table.md").write_text(table, encoding="utf-8")
    return table


# -- the run --------------------------------------------------------------------------------------------------------
def configured(base, model_args: dict):
    """A view of the loaded ``BatchMaxLM`` ``base`` (same weights and tokenizer) that runs ``model_args``: its own
    settings, method and measurements."""
    from batchmax_tp.harness import Settings

    lm = copy.copy(base)
    lm.settings = Settings.parse(model_args)
    lm.method = lm.settings.method_()
    lm.stats = defaultdict(float)
    lm.batch_sizes = {}
    return lm


def longest_request(tokenizer, suite: Path, names: list[str], limit: int | None) -> tuple[int, int]:
    """(most prompt tokens, most max_gen_toks) of the chosen documents, with ``tokenizer``."""
    prompt = gen = 0
    for name in names:
        path = suite / "data" / (name.removeprefix("batchmax_ruler_") + ".jsonl")
        for line in path.read_text(encoding="utf-8").splitlines()[:limit]:
            doc = json.loads(line)
            prompt, gen = max(prompt, len(tokenizer.encode(doc["input"]))), max(gen, doc["max_gen_toks"])
    return prompt, gen


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--half", choices=HALVES, default="tune", help="which half of the suite (default tune)")
    ap.add_argument("--lengths", default=",".join(LENGTHS), help="comma list of 2k, 4k (default both)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)} (default all)")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default all)")
    ap.add_argument("--configs", nargs="+", type=parse_config, default=None, metavar="CONFIG", help="see above")
    ap.add_argument("--kv-max", default=None, help=f"grid: comma list of kv_max (default {DEFAULT_KV_MAX})")
    ap.add_argument("--rules", default=None, help=f"grid: rules separated by ';' (default '{DEFAULT_RULES}')")
    ap.add_argument("--p", type=int, default=64, help="BM's eviction amount and prefill block (default 64)")
    ap.add_argument("--pretrained", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default=None, help="auto (default), float32, float16, bfloat16")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if present)")
    ap.add_argument("--batch-size", default="auto", help="slots, or auto (default): the planner's in the budget")
    ap.add_argument("--memory-budget", default=None, help="bytes for auto (default: FKV's pool for 4 slots)")
    ap.add_argument("--suite", type=Path, default=SUITE, help="task folder (default configs/lm_eval/ruler)")
    ap.add_argument("--log-samples", action="store_true", help="keep lm-eval's samples in results.json")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default results/ruler_<half>)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    lengths = [n.strip() for n in args.lengths.split(",") if n.strip()]
    for kind, got, known in (("task", tasks, TASKS), ("length", lengths, LENGTHS)):
        bad = [x for x in got if x not in known] or ([] if got else ["(none)"])
        if bad:
            ap.error(f"unknown {kind} {bad[0]!r}: choose from {', '.join(known)}")
    try:
        configs = configs_from_args(args)
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    if args.batch_size != "auto" and not args.batch_size.isdigit():
        ap.error(f"--batch-size must be an integer or auto, got {args.batch_size!r}")
    out = (args.out or ROOT / "results" / f"ruler_{args.half}").resolve()
    suite = args.suite.resolve()
    names = task_names(args.half, tasks, lengths)

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from batchmax_tp.harness import BatchMaxLM, ModelArgsError, Settings
    from batchmax_tp.plan.budget import fmt_bytes
    from batchmax_tp.plan.planner import parse_bytes, predict_pool

    common = {
        k: v
        for k, v in {"pretrained": args.pretrained, "dtype": args.dtype, "device": args.device, "p": args.p}.items()
        if v is not None
    }
    batch = {"batch_size": int(args.batch_size) if args.batch_size.isdigit() else "auto"}
    try:
        for c in configs:  # every configuration's model_args checked before the model loads
            Settings.parse({**common, **c.args, **batch})
    except ModelArgsError as err:
        ap.error(str(err))
    os.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"loading {args.pretrained or 'the embedded model'} ...")
    base = BatchMaxLM(**common, method="fkv", batch_size=1)
    if batch["batch_size"] == "auto":
        budget = args.memory_budget
        if budget is None:  # FKV's pool for 4 slots of the longest chosen request
            prompt, gen = longest_request(base.tokenizer, suite, names, args.limit)
            budget = str(predict_pool(base.shape, base.method, 4, prompt, gen, dtype=base.dtype).total)
        batch["memory_budget"] = budget
    settings = {
        "half": args.half,
        "suite": os.path.relpath(suite, ROOT),
        "tasks": tasks,
        "lengths": lengths,
        "limit": args.limit,
        "model": args.pretrained or "embedded SmolLM2-135M-Instruct",
        "dtype": base.dtype,
        "p": args.p,
        "batch_size": batch["batch_size"],
        "memory_budget": fmt_bytes(parse_bytes(batch["memory_budget"])) if "memory_budget" in batch else None,
    }
    manager = TaskManager(include_path=str(suite), include_defaults=False)
    rows: list[dict] = []
    for k, config in enumerate(configs):
        log(f"[{k + 1}/{len(configs)}] {config.label}: {len(names)} tasks ...")
        lm = configured(base, {**common, **config.args, **batch})
        start = time.perf_counter()
        res = simple_evaluate(
            model=lm,
            tasks=names,
            limit=args.limit,
            task_manager=manager,
            cache_requests=False,
            bootstrap_iters=0,
            log_samples=args.log_samples,
        )
        wall = time.perf_counter() - start
        folder = out / f"{k:02d}_{re.sub(r'[^A-Za-z0-9.=-]+', '_', config.label)}"
        folder.mkdir(exist_ok=True)
        (folder / "results.json").write_text(json.dumps(res, indent=2, default=str), encoding="utf-8")
        info = res["config"]["batchmax"]
        rows.append(
            {
                "label": config.label,
                "model_args": config.args,
                "results": os.path.relpath(folder / "results.json", out),
                "scores": {
                    f"{t} {n}": res["results"][f"batchmax_ruler_{t}_{n}_{args.half}"][METRIC]
                    for n in lengths
                    for t in tasks
                },
                "tokens_per_s": info["tokens_per_s"],
                "slots": int(info["slots"]),
                "peak_kv_bytes": int(info["peak_kv_bytes"]),
                "wall_s": wall,
            }
        )
        table = write_tables(out, rows, tasks, lengths, settings)
        row = summarize(rows, tasks, lengths)[-1]
        share = "-" if row["share_of_fkv"] is None else f"{row['share_of_fkv']:.3f}"
        log(
            f"[{k + 1}/{len(configs)}] {config.label}: mean {row['mean']:.3f}, share of FKV {share}, "
            f"{row['tokens_per_s']:.0f} tok/s, {row['slots']} slots, {wall:.0f} s"
        )
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
