"""The RULER-style suite (``configs/lm_eval/ruler``) through lm-eval on the ``batchmax`` model: FKV and Batch-Max
configurations side by side, each scored as a share of FKV's.

    python launch/bench_ruler.py      # tuning half, 2k + 4k, 7 tasks: FKV, BM paper/question at kv_max 512/256/128
    python launch/bench_ruler.py --half heldout --kv-max 256,128 --rules 'question;question:share=0'
    python launch/bench_ruler.py --configs fkv bm:512:paper bm:256:question --tasks niah_single,vt --limit 2
    python launch/bench_ruler.py --pretrained qwen2.5-coder-0.5b --lengths 8k,16k --half heldout \
        --configs fkv bm:1024:question bm:2048:question snap:1024

Lengths: 2k and 4k (every task, ``configs/lm_eval/ruler``), and 8k, 16k and 32k for a model with a 32k context (the
needle tasks that ask one key and ``vt``; per task 8 to tune on and 16 held out at 8k and 16k, 2 and 2 at 32k),
built on first use into ``--long-suite`` (default ``$BATCHMAX_CACHE/ruler-long``; deterministic, a few minutes) by
the suite's builder.
Before each half runs, its predicted time is logged (each configuration's FLOPs per document, ``bench.regimes``,
at a share of a matrix product's FLOP/s measured on the device), and after each configuration the time left,
scaled by what the ones run so far took. Resumable per document: every configuration answers through lm-eval's
response cache in its folder (each answer written as its request ends), so a run stopped part-way and started again
with the same flags serves only the documents not yet answered, and a finished configuration (its ``row.json``) is
read back; a resumed configuration's tokens/s are of the documents it served after the restart.

Configurations: ``--configs`` takes one per argument: a method's name (``fkv``, ``ed``: the ``batchmax`` model's
default kv_max, ED's 65), ``NAME:KV_MAX`` for a method that evicts (``ed:2``, ``snap:256``, ``bm:512``) or, for one
with rules, ``bm:KV_MAX:RULE``, where RULE is everything after the second ':' (``bm:256:snapkv:window=64,kernel=5``).
``--kv-max`` x ``--rules`` adds a Batch-Max grid (rules separated by ';', as they may hold ',' ':' '='); with
neither ``--configs`` nor a grid flag the grid is kv_max 512,256,128 x rules paper;question. FKV always runs first:
every share is of its score.

The model loads once: each configuration is a view of it with its own method (``BatchMaxLM`` settings, method and
measurements; the same weights and tokenizer) and runs one ``simple_evaluate`` over the chosen tasks, one lm-eval
task per task and length (``batchmax_ruler_<task>_<2k|4k>_<half>``; greedy, plain text, lm-eval's own
``string_match_all``: the share of expected strings found in the output, averaged over the documents). Batch:
``--batch-size N`` slots, or ``auto`` (default): the most slots the planner fits in ``--memory-budget`` (default:
FKV's pool for 4 slots of the longest chosen request, measured with the model's tokenizer).

``--fkv-from DIR/table.json``: FKV's row (its scores and each document's) from an earlier run of the same half,
suite, tasks, lengths, limit, model and dtype, checked against this run's before the model loads; FKV does not run
again (greedy: its texts do not change; ~12 minutes per half at 4k on the 0.5B, ~20 at 2k on the 1.5B). Its speed
columns are that run's, and the table says so. Not with ``--pick``.

``--pick``: choose on one half, report on the other. The configurations run on the tuning half; at each kv_max the
one with the highest share of FKV there is picked; FKV and the picks then run on the held-out half, and ``pick.md``
gives each pick's held-out share with its interval (never the best held-out configuration's). Every share carries
a paired, stratified bootstrap 95% interval over the documents (``batchmax_tp.eval.intervals``); a difference is
marked real only where intervals separate. ``table.md`` also gives each configuration's share minus each one's listed
before it (FKV aside) with its own paired interval (the same documents for both and FKV in every resample, much
narrower than the shares' intervals: ``difference_interval``), in ``table.json`` as ``differences``.

``--kvpress PRESS:KEPT...``: kvpress's presses (``snapkv``, ``adasnapkv``: its per-head budgets around SnapKV,
``expected``, ``kvzip``, ``tova``, ``streaming``) after the configurations, on the same documents, model and dtype,
each keeping the share KEPT of each prompt's pairs (``snapkv:0.25``: kvpress's ``compression_ratio`` 0.75), with the
question inside the compressed text (``q-in``, kvpress's query-aware setting) and read after it (``q-out``;
``--kvpress-question in|out|all|in,out``; ``all``: the whole prompt but its last word compressed, the answer's
start too, as the project's methods compress it). kvpress's code compresses and generates
(``launch/kvpress_rows.py`` in its own environment, ``bash scripts/peers.sh``: it pins transformers < 5.3;
``--peers-python`` or ``$BATCHMAX_PEERS_PYTHON`` names another interpreter, checked with its kvpress version
before any load). Its rows join the table with each document's score and the same paired intervals; 1 slot
(kvpress reads one prompt at a time, whole: the table's "prompt read" line) and the K/V its cache held at most over
a request.

Writes into ``--out`` (default results/ruler_<half>; ``--pick``: results/ruler_pick, a folder per half and
``pick.md``/``pick.json``): ``<NN>_<config>/results.json`` (lm-eval's results; its samples too with
``--log-samples``), then ``table.json`` (with each document's score) and ``table.md`` after every configuration, so
a crash loses only the configuration running. ``table.md``: per task and length each configuration's score, the
means per length and overall, each mean as a share of FKV's (per length and overall) with the overall share's
interval, tokens/s (prompt + generated tokens over the model's prefill + decode seconds), slots, peak K/V and wall
seconds. Progress goes to stderr. Run it
alone on the machine: the configurations' speeds are compared inside this one process.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
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
KVPRESS_ROWS = ROOT / "launch" / "kvpress_rows.py"


def _script(name: str):
    """A module of the suite's folder loaded by path: ``build.py`` (its lengths, the tasks at each), ``ruler_utils.py``
    (its score)."""
    spec = importlib.util.spec_from_file_location(f"ruler_{name}", SUITE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _script("build")
TASKS = tuple(BUILD.TASKS)
LENGTHS = tuple(BUILD.LENGTHS)  # 2k and 4k in the suite's folder; 8k, 16k, 32k built on demand (``long_suite``)
HALVES = tuple(BUILD.HALVES)
METRIC = "string_match_all,none"
DOC_METRIC = "string_match_all"  # each lm-eval sample's own score
DEFAULT_KV_MAX, DEFAULT_RULES = "512,256,128", "paper;question"
#: The share of a measured matrix product's FLOP/s a configuration's time is predicted at (prefill on this CPU runs at
#: ~0.7 of it on the 0.5B at 4k; the prediction is refined by the configurations already run).
EFFICIENCY = 0.7


@dataclass(frozen=True)
class Config:
    """One configuration: its label and its ``BatchMaxLM`` model_args (method, kv_max, rule)."""

    label: str
    args: dict = field(hash=False)


def parse_config(text: str) -> Config:
    """``NAME`` (at the ``batchmax`` model's default kv_max), ``NAME:KV_MAX`` (a method that evicts) or
    ``NAME:KV_MAX:RULE`` (one with rules, BM; RULE: the rest, ':' ',' '=' included; default the paper's), e.g. ``fkv``,
    ``ed``, ``ed:2``, ``snap:256`` (SnapKV-style compression once after prefill), ``bm:512:question``."""
    from batchmax_tp.core.method import METHODS

    method, _, rest = text.strip().partition(":")
    kv, _, rule = rest.partition(":")
    kind = METHODS.get(method)
    if kind is not None and not rest:
        return Config(method, {"method": method})
    if kind is not None and kind.evicts and kv.isdigit() and kind.takes_rule:
        rule = rule or "paper"
        return Config(f"{method} {kv} {rule}", {"method": method, "kv_max": int(kv), "rule": rule})
    if kind is not None and kind.evicts and kv.isdigit() and not rule:
        return Config(f"{method} {kv}", {"method": method, "kv_max": int(kv)})
    forms = [n if not k.evicts else f"{n}[:KV_MAX{'[:RULE]' if k.takes_rule else ''}]" for n, k in METHODS.items()]
    raise argparse.ArgumentTypeError(f"bad configuration {text!r}: expected {', '.join(forms[:-1])} or {forms[-1]}")


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


def at(length: str, tasks: list[str]) -> list[str]:
    """Those of ``tasks`` the suite has at ``length`` (every task at 2k and 4k; ``LONG_TASKS`` beyond; a name the
    suite does not know, as tests use, at every length)."""
    return [t for t in tasks if t not in TASKS or t in BUILD.tasks_at(length)]


def task_names(half: str, tasks: list[str], lengths: list[str]) -> list[str]:
    return [f"batchmax_ruler_{t}_{n}_{half}" for n in lengths for t in at(n, tasks)]


# -- the tables -----------------------------------------------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(rows: list[dict], tasks: list[str], lengths: list[str]) -> list[dict]:
    """Each row (``scores``: "<task> <length>" -> score; the first row is FKV's) with ``mean``, ``mean_by_length``,
    ``share_of_fkv`` and ``share_by_length`` (None where FKV's mean is 0), and, where the rows carry their documents'
    scores (``documents``: cell -> per-document scores), ``interval``: the share's bootstrap 95% interval [low,
    high] (``eval.intervals``), and ``differences``: per configuration listed before it (but FKV), its share minus
    that one's with their paired bootstrap 95% interval [difference, low, high]."""
    from batchmax_tp.eval.intervals import difference_interval, share_interval

    share = lambda a, b: a / b if b else None  # noqa: E731
    out = []
    for row in rows:
        by_length = {n: _mean([row["scores"][f"{t} {n}"] for t in at(n, tasks)]) for n in lengths}
        out.append({**row, "mean": _mean(list(by_length.values())), "mean_by_length": by_length})
    fkv = out[0]
    for row in out:
        row["share_of_fkv"] = share(row["mean"], fkv["mean"])
        row["share_by_length"] = {n: share(row["mean_by_length"][n], fkv["mean_by_length"][n]) for n in lengths}
        if "documents" in row and "documents" in fkv:
            found = share_interval(row["documents"], fkv["documents"])
            row["interval"] = None if found.value is None else [found.low, found.high]
    for i, row in enumerate(out[2:], 2):  # each configuration against each one before it (FKV's aside), paired
        earlier = [r for r in out[1:i] if "documents" in r and "documents" in row and "documents" in fkv]
        found = {r["label"]: difference_interval(row["documents"], r["documents"], fkv["documents"]) for r in earlier}
        row["differences"] = {k: [d.value, d.low, d.high] for k, d in found.items() if d.value is not None}
    return out


def pick(rows: list[dict]) -> dict[int, dict]:
    """Per kv_max, the configuration with the highest mean score (so the highest share of FKV) among ``rows``
    (summarized; FKV's first and left out; the first listed wins a tie)."""
    best: dict[int, dict] = {}
    for row in rows[1:]:
        kv = row["model_args"].get("kv_max")
        if kv is not None and (kv not in best or row["mean"] > best[kv]["mean"]):
            best[kv] = row
    return dict(sorted(best.items(), reverse=True))


def format_pick(tuned: dict[int, dict], held: list[dict], about: str) -> str:
    """Each kv_max's pick: its share of FKV on the tuning half (where it was chosen) and on the held-out half, each
    with its interval, and whether the held-out share is below FKV's beyond its interval (``separate``: FKV's own
    share is exactly 1 in every paired resample)."""
    from batchmax_tp.eval.intervals import Share, separate

    ival = lambda r: "" if not r.get("interval") else f" [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    by_label = {r["label"]: r for r in held}
    text = about + "\n\n| kv_max | pick (tuning half) | tuning share | held-out share | below FKV? |\n"
    text += "|---:|---|---:|---:|---|\n"
    for kv, row in tuned.items():
        out = by_label[row["label"]]
        share = Share(out["share_of_fkv"], *out["interval"]) if out.get("interval") else None
        real = share is not None and share.value < 1.0 and separate(share, Share(1.0, 1.0, 1.0))
        below = "yes" if real else "not beyond its interval"
        text += (
            f"| {kv} | {row['label']} | {num(row['share_of_fkv'])}{ival(row)} | "
            f"**{num(out['share_of_fkv'])}**{ival(out)} | {below} |\n"
        )
    fkv = held[0]
    return text + f"\nFKV's held-out score: {fkv['mean']:.3f} (tokens/s {fkv['tokens_per_s']:.0f}).\n"


def format_table(rows: list[dict], tasks: list[str], lengths: list[str], about: str) -> str:
    """``about`` (a paragraph), then one column per configuration: per-task scores, means, shares of FKV's mean,
    tokens/s, slots, peak K/V, wall seconds."""
    num = lambda x, f=".3f": "-" if x is None else format(x, f)  # noqa: E731
    line = lambda name, cells: f"| {name} | " + " | ".join(cells) + " |\n"  # noqa: E731
    reused = [
        f"{r['label']}'s row is from {r['reused_from']} (its tokens/s, slots and seconds are that run's)"
        for r in rows
        if r.get("reused_from")
    ]
    reused += [
        f"{r['label']} was resumed: {r['resumed_documents']} documents were answered before a restart (its tokens/s "
        "are of the rest)"
        for r in rows
        if r.get("resumed_documents")
    ]
    about = " ".join([about, *(f"{x}." for x in reused)])
    text = about + "\n\n" + line("task", [r["label"] for r in rows]) + line("---", ["---:"] * len(rows))
    for n in lengths:
        for t in at(n, tasks):
            text += line(f"{t} {n}", [num(r["scores"][f"{t} {n}"], ".2f") for r in rows])
    for n in lengths:
        text += line(f"**mean {n}**", [num(r["mean_by_length"][n]) for r in rows])
    text += line("**mean**", [f"**{num(r['mean'])}**" for r in rows])
    for n in lengths:
        text += line(f"share of FKV, {n}", [num(r["share_by_length"][n]) for r in rows])
    text += line("**share of FKV**", [f"**{num(r['share_of_fkv'])}**" for r in rows])
    if any(r.get("interval") for r in rows):
        cell = lambda r: "-" if not r.get("interval") else f"[{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]"  # noqa: E731
        text += line("share's 95% interval", [cell(r) for r in rows])
    text += line("tokens/s", [num(r["tokens_per_s"], ".0f") for r in rows])
    text += line("slots", [str(r["slots"]) for r in rows])
    if any(r.get("prefill") for r in rows):  # what each needs in memory while it reads a prompt
        text += line("prompt read", [prefill_of(r) for r in rows])
    text += line("peak K/V MiB", [num(r["peak_kv_bytes"] / 2**20, ".1f") for r in rows])
    text += line("wall s", [num(r["wall_s"], ".0f") for r in rows])
    pairs = [(r["label"], other, d) for r in rows for other, d in (r.get("differences") or {}).items()]
    if pairs:
        text += (
            "\nPaired differences (a share of FKV minus another's, on the same documents; paired bootstrap 95%):\n\n"
        )
        text += "".join(f"- {a} - {b}: **{d:+.3f}** [{lo:+.2f}, {hi:+.2f}]\n" for a, b, (d, lo, hi) in pairs)
    return text


def prefill_of(row: dict) -> str:
    """How a row's method reads a prompt: in blocks (BM: its memory bounded while it reads) or whole (FKV, snap and
    kvpress's presses: the whole prompt's pairs and activations at once)."""
    from batchmax_tp.core.method import METHODS

    if row.get("prefill"):
        return row["prefill"]
    kind = METHODS.get(row.get("model_args", {}).get("method"))
    return "blocks" if kind is not None and kind.bounded_prefill else "whole prompt"


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


def row_folder(out: Path, k: int, label: str) -> Path:
    """The folder of the table's ``k``-th row: its number and its label in safe characters."""
    return out / f"{k:02d}_{re.sub(r'[^A-Za-z0-9.=-]+', '_', label)}"


def task_file(suites: list[Path], name: str) -> Path:
    """The task yaml of ``name`` in the first of ``suites`` that holds it."""
    return next((folder / f"{name}.yaml" for folder in suites if (folder / f"{name}.yaml").is_file()), suites[0])


def data_file(suites: list[Path], name: str) -> Path:
    """The documents of task ``name`` in the first of ``suites`` that holds them."""
    stem = "data/" + name.removeprefix("batchmax_ruler_") + ".jsonl"
    return next((folder / stem for folder in suites if (folder / stem).is_file()), suites[0] / stem)


def requests(tokenizer, suites: list[Path], names: list[str], limit: int | None) -> list[tuple[int, int]]:
    """(prompt tokens with ``tokenizer``, max_gen_toks) of each chosen document."""
    out = []
    for name in names:
        for line in data_file(suites, name).read_text(encoding="utf-8").splitlines()[:limit]:
            doc = json.loads(line)
            out.append((len(tokenizer.encode(doc["input"])), doc["max_gen_toks"]))
    return out


def longest_request(tokenizer, suites: list[Path], names: list[str], limit: int | None) -> tuple[int, int]:
    """(most prompt tokens, most max_gen_toks) of the chosen documents, with ``tokenizer``."""
    found = requests(tokenizer, suites, names, limit)
    return max(p for p, _ in found), max(g for _, g in found)


def long_suite(folder: Path, lengths: list[str]) -> Path:
    """``folder`` holding the suite at the long ``lengths`` (``build.LONG``): built there first where a data file
    is missing (deterministic; the 32k documents take the longest, ~1 min), each file logged as it is written."""
    long = [n for n in lengths if n not in BUILD.SHORT]
    missing = [
        n
        for n in long
        for h in HALVES
        for t in BUILD.tasks_at(n)
        if not (folder / "data" / f"{t}_{n}_{h}.jsonl").is_file()
        or len((folder / "data" / f"{t}_{n}_{h}.jsonl").read_text(encoding="utf-8").splitlines())
        < BUILD.documents_at(n, h)
    ]
    if missing:
        log(f"building the suite at {', '.join(long)} into {folder} (once; deterministic) ...")
        BUILD.build(folder, BUILD.embedded_counter(), lengths=tuple(long), progress=lambda text: log(f"  {text}"))
    return folder


def predicted_seconds(shape, method, found: list[tuple[int, int]], flops_per_s: float) -> float:
    """A configuration's time from its FLOPs (``bench.regimes.prompt_token_flops``: linear layers and the keys each
    prompt token attends to under ``method``; a generated token as a prompt token of its request) at
    ``flops_per_s``."""
    from batchmax_tp.bench.regimes import prompt_token_flops

    work = sum((p + g) * prompt_token_flops(shape, method, p) for p, g in found)
    return work / flops_per_s


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--half", choices=HALVES, default="tune", help="which half of the suite (default tune)")
    ap.add_argument(
        "--lengths",
        default=",".join(BUILD.SHORT),
        help=f"comma list of {', '.join(LENGTHS)} (default 2k,4k; 8k-32k: {', '.join(BUILD.LONG_TASKS)})",
    )
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
    ap.add_argument(
        "--long-suite",
        type=Path,
        default=None,
        help="where the 8k-32k documents are built on first use (default $BATCHMAX_CACHE/ruler-long)",
    )
    ap.add_argument("--log-samples", action="store_true", help="keep lm-eval's samples in results.json")
    ap.add_argument("--pick", action="store_true", help="choose on the tuning half, report on the held-out half")
    ap.add_argument(
        "--fkv-from", type=Path, default=None, help="FKV's row from an earlier run's table.json (see above)"
    )
    ap.add_argument(
        "--kvpress",
        nargs="+",
        default=[],
        metavar="PRESS:KEPT",
        help="kvpress's presses after the configurations (see above), e.g. snapkv:0.25 expected:0.125",
    )
    ap.add_argument(
        "--kvpress-question", default="in,out", help="--kvpress: in, out, all or a comma list (default in,out)"
    )
    ap.add_argument("--peers-python", type=Path, default=None, help="--kvpress: kvpress's interpreter (see above)")
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
    for n in lengths:
        if not at(n, tasks):
            ap.error(f"no chosen task at {n}: the suite has {', '.join(BUILD.tasks_at(n))} there")
    try:
        configs = configs_from_args(args)
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    if args.batch_size != "auto" and not args.batch_size.isdigit():
        ap.error(f"--batch-size must be an integer or auto, got {args.batch_size!r}")
    out = (args.out or ROOT / "results" / ("ruler_pick" if args.pick else f"ruler_{args.half}")).resolve()
    suite = args.suite.resolve()
    suites = [suite]
    if any(n not in BUILD.SHORT for n in lengths):
        from batchmax_tp.parted import cache_root

        suites.append(long_suite((args.long_suite or cache_root() / "ruler-long").resolve(), lengths))
    halves = list(HALVES) if args.pick else [args.half]
    model = args.pretrained or "embedded SmolLM2-135M-Instruct"
    presses, python = [], None
    if args.kvpress:
        from batchmax_tp.bench import peers

        if args.pick:
            ap.error("--kvpress: not with --pick (kvpress's rows are reported on the half run)")
        python = args.peers_python or peers.default_python()
        try:
            presses = peers.press_runs(args.kvpress, args.kvpress_question.split(","))
            peers.check_python(python, KVPRESS_ROWS)
        except ValueError as err:
            ap.error(str(err))
    reused = None
    if args.fkv_from is not None:
        if args.pick:
            ap.error("--fkv-from: not with --pick (it is one half's FKV row)")
        same = {"half": args.half, "suite": os.path.relpath(suite, ROOT), "tasks": tasks, "lengths": lengths}
        same |= {"limit": args.limit, "model": model} | (
            {"dtype": args.dtype} if args.dtype not in (None, "auto") else {}
        )
        try:
            reused = earlier_fkv(args.fkv_from, same)
        except ValueError as err:
            ap.error(f"--fkv-from: {err}")

    from batchmax_tp.harness import BatchMaxLM, ModelArgsError, Settings
    from batchmax_tp.plan.budget import fkv_budget, fmt_bytes
    from batchmax_tp.plan.planner import parse_bytes

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
    log(f"loading {args.pretrained or 'the embedded model'} ...")
    base = BatchMaxLM(**common, method="fkv", batch_size=1)
    if batch["batch_size"] == "auto":
        budget = args.memory_budget
        if budget is None:  # FKV's pool for 4 slots of the longest chosen request (of every half run)
            names = [n for half in halves for n in task_names(half, tasks, lengths)]
            prompt, gen = longest_request(base.tokenizer, suites, names, args.limit)
            budget = str(fkv_budget(base.shape, prompt, gen, batch=4, dtype=base.dtype))
        batch["memory_budget"] = budget
    settings = {
        "suite": os.path.relpath(suite, ROOT),
        "tasks": tasks,
        "lengths": lengths,
        "limit": args.limit,
        "model": model,
        "dtype": base.dtype,
        "p": args.p,
        "batch_size": batch["batch_size"],
        "memory_budget": fmt_bytes(parse_bytes(batch["memory_budget"])) if "memory_budget" in batch else None,
    }
    rate = None
    if base.shape is not None:
        from batchmax_tp.bench.rates import measured_flops

        rate = measured_flops(str(base._device), base.dtype, base.shape.hidden) * EFFICIENCY
    run = Half(base, tasks, lengths, {**common, **batch}, suites, args.limit, args.log_samples, settings, rate)
    if reused is not None and reused["dtype"] != base.dtype:
        log(f"error: --fkv-from: {args.fkv_from} has dtype {reused['dtype']!r}, this run {base.dtype!r}")
        return 2
    if not args.pick:
        first = [] if reused is None else [reused["row"]]
        rows = run(configs[len(first) :], args.half, out, first)
        if presses:
            rows = run.kvpress(presses, args.half, out, rows, python, args.pretrained)
        table = write_tables(out, rows, tasks, lengths, {**settings, "half": args.half})
        print(table, end="")
        return 0
    tuned = summarize(run(configs, "tune", out / "tune"), tasks, lengths)
    picks = pick(tuned)
    log("picked on the tuning half: " + ", ".join(f"kv_max {kv}: {r['label']}" for kv, r in picks.items()))
    chosen = [configs[0], *(c for c in configs if c.label in {r["label"] for r in picks.values()})]
    held = summarize(run(chosen, "heldout", out / "heldout"), tasks, lengths)
    about = (
        f"Picked on the tuning half, reported on the held-out half: model {settings['model']}, lengths "
        f"{', '.join(lengths)}, {args.limit or 'all'} documents per task, length and half. Shares of FKV's mean with "
        "paired, stratified bootstrap 95% intervals over the documents."
    )
    text = format_pick(picks, held, about)
    (out / "pick.md").write_text(text, encoding="utf-8")
    (out / "pick.json").write_text(json.dumps({**settings, "tuned": tuned, "heldout": held}, indent=2), "utf-8")
    print(text, end="")
    return 0


def earlier_fkv(path: Path, same: dict) -> dict:
    """``--fkv-from``: {"row": FKV's row of the earlier run's ``table.json`` at ``path`` (its scores, each document's
    score, its speed; ``reused_from`` names the file), "dtype": that run's}. ValueError (one line) when the file
    cannot be read, holds no FKV row with its documents' scores, or differs from ``same`` (half, suite, tasks,
    lengths, limit, model and, when given, dtype)."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None
    for key, want in same.items():
        if table.get(key) != want:
            raise ValueError(f"{path} was run with {key} {table.get(key)!r}, this run has {want!r}")
    from batchmax_tp.core.method import METHODS

    row = (table.get("configs") or [{}])[0]
    kind = METHODS.get(row.get("model_args", {}).get("method"))
    if kind is None or kind.evicts or "documents" not in row:
        raise ValueError(f"{path} holds no FKV row with each document's score")
    keep = ("label", "model_args", "scores", "documents", "tokens_per_s", "slots", "peak_kv_bytes", "wall_s")
    results = str(path.resolve().parent / row["results"])
    return {"row": {k: row[k] for k in keep} | {"results": results, "reused_from": str(path)}, "dtype": table["dtype"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Half:
    """Runs configurations on one half of the suite with the loaded model ``base``, each into its own folder,
    its tables rewritten after each (a crash loses only the configuration running)."""

    base: object
    tasks: list[str]
    lengths: list[str]
    model_args: dict  # common and batch settings
    suites: list[Path]
    limit: int | None
    keep_samples: bool
    settings: dict
    flops_per_s: float | None = None  #: the rate a configuration's time is predicted at (None: no prediction)

    def predicted(self, configs: list[Config], half: str) -> list[float]:
        """Each configuration's predicted seconds on this half (``predicted_seconds``), 0 without a rate."""
        from batchmax_tp.harness import Settings

        if self.flops_per_s is None:
            return [0.0] * len(configs)
        found = requests(self.base.tokenizer, self.suites, task_names(half, self.tasks, self.lengths), self.limit)
        return [
            predicted_seconds(
                self.base.shape, Settings.parse({**self.model_args, **c.args}).method_(), found, self.flops_per_s
            )
            for c in configs
        ]

    def __call__(self, configs: list[Config], half: str, out: Path, first: list[dict] | None = None) -> list[dict]:
        """The configurations' rows after ``first`` (FKV's, read from an earlier run). Resumable: a configuration
        whose row was written (``<NN>_<config>/row.json``) is read back, and one that stopped part-way answers its
        finished documents from its response cache (lm-eval's ``use_cache``: each answer is written as it ends)."""
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from batchmax_tp.eval.files import atomic_write_text

        names = task_names(half, self.tasks, self.lengths)
        manager = TaskManager(include_path=[str(x) for x in self.suites], include_defaults=False)
        out.mkdir(parents=True, exist_ok=True)
        rows: list[dict] = list(first or [])
        predicted = self.predicted(configs, half)
        if any(predicted):
            log(
                f"[{half}] predicted: {sum(predicted) / 60:.1f} min for {len(configs)} configurations x "
                f"{len(names)} tasks (FLOPs at {self.flops_per_s / 1e9:.0f} GFLOP/s: "
                f"{EFFICIENCY} x a product measured here)"
            )
        spent = expected = 0.0  # the measured and predicted seconds of the configurations run so far
        for i, config in enumerate(configs):
            k = len(rows)  # the folder's number: the configuration's place in the table
            folder = row_folder(out, k, config.label)
            if (folder / "row.json").is_file():
                rows.append(json.loads((folder / "row.json").read_text(encoding="utf-8")))
                log(f"[{half} {i + 1}/{len(configs)}] {config.label}: done earlier ({folder.name}/row.json)")
                continue
            folder.mkdir(exist_ok=True)
            log(f"[{half} {i + 1}/{len(configs)}] {config.label}: {len(names)} tasks ...")
            lm = configured(self.base, {**self.model_args, **config.args})
            start = time.perf_counter()
            res = simple_evaluate(
                model=lm,
                tasks=names,
                limit=self.limit,
                task_manager=manager,
                cache_requests=False,
                use_cache=str(folder / f"answers-{lm.settings.fingerprint()}"),  # per document: resumable
                bootstrap_iters=0,
                log_samples=True,  # each document's score, for the intervals
            )
            wall = time.perf_counter() - start
            cell = {f"batchmax_ruler_{t}_{n}_{half}": f"{t} {n}" for n in self.lengths for t in at(n, self.tasks)}
            documents = {
                cell[name]: [s[DOC_METRIC] for s in sorted(res["samples"][name], key=lambda s: s["doc_id"])]
                for name in names
            }
            if not self.keep_samples:
                res.pop("samples", None)
            (folder / "results.json").write_text(json.dumps(res, indent=2, default=str), encoding="utf-8")
            info = res["config"]["batchmax"]
            served = int(info.get("requests", 0))  # the rest came from the response cache of an earlier, stopped run
            row = {
                "label": config.label,
                "model_args": config.args,
                "results": os.path.relpath(folder / "results.json", out),
                "scores": {cell[name]: res["results"][name][METRIC] for name in names},
                "documents": documents,
                "tokens_per_s": info["tokens_per_s"],
                "slots": int(info["slots"]),
                "peak_kv_bytes": int(info["peak_kv_bytes"]),
                "wall_s": wall,
            }
            cached = sum(len(d) for d in documents.values()) - served
            if cached:
                row["resumed_documents"] = cached  # its speed is of the documents served after the restart
            atomic_write_text(folder / "row.json", json.dumps(row, indent=2))  # whole or not at all
            rows.append(row)
            write_tables(out, rows, self.tasks, self.lengths, {**self.settings, "half": half})
            row = summarize(rows, self.tasks, self.lengths)[-1]
            share = "-" if row["share_of_fkv"] is None else f"{row['share_of_fkv']:.3f}"
            spent, expected = spent + wall, expected + predicted[i]
            left = sum(predicted[i + 1 :]) * (spent / expected if expected and not cached else 1.0)
            log(
                f"[{half} {i + 1}/{len(configs)}] {config.label}: mean {row['mean']:.3f}, share of FKV {share}, "
                f"{row['tokens_per_s']:.0f} tok/s, {row['slots']} slots, {wall:.0f} s"
                + (f" (predicted {predicted[i]:.0f} s); ~{left / 60:.1f} min left" if predicted[i] else "")
            )
        return rows

    def kvpress(self, presses: list, half: str, out: Path, rows: list[dict], python: Path, pretrained) -> list[dict]:
        """kvpress's rows after ``rows``, one per press and question placement (``bench.peers.PressRun``), each run
        by ``launch/kvpress_rows.py`` under kvpress's interpreter ``python`` (a child process; this one waits) on the
        same documents, model and dtype. Resumable: answers are appended per document, a written row is read back."""
        import subprocess

        from batchmax_tp.bench import peers
        from batchmax_tp.eval.files import atomic_write_text
        from batchmax_tp.models import EMBEDDED_MODEL, model_path

        cells = {
            f"{t} {n}": (data_file(self.suites, name), task_file(self.suites, name))
            for n in self.lengths
            for t in at(n, self.tasks)
            for name in [f"batchmax_ruler_{t}_{n}_{half}"]
        }
        rows = list(rows)
        for i, press in enumerate(presses):
            folder = row_folder(out, len(rows), press.label)
            if (folder / "row.json").is_file():
                rows.append(json.loads((folder / "row.json").read_text(encoding="utf-8")))
                log(f"[{half} kvpress {i + 1}/{len(presses)}] {press.label}: done earlier ({folder.name}/row.json)")
                continue
            folder.mkdir(parents=True, exist_ok=True)
            docs = peers.documents(cells, self.limit, press.placement)
            atomic_write_text(folder / "documents.jsonl", "".join(json.dumps(d) + "\n" for d in docs))
            log(f"[{half} kvpress {i + 1}/{len(presses)}] {press.label}: {len(docs)} documents ...")
            cmd = [str(python), str(KVPRESS_ROWS), "--model", model_path(pretrained or EMBEDDED_MODEL)]
            cmd += ["--dtype", self.settings["dtype"], "--press", press.name, "--kept", str(press.kept)]
            cmd += ["--documents", str(folder / "documents.jsonl"), "--out", str(folder / "answers.jsonl")]
            start = time.perf_counter()
            if subprocess.run(cmd).returncode != 0:
                raise SystemExit(f"error: kvpress {press.label} stopped; its answers so far are in {folder}")
            answers = [json.loads(x) for x in (folder / "answers.jsonl").read_text(encoding="utf-8").splitlines() if x]
            row = peers.row(press, docs, answers, time.perf_counter() - start, _script("ruler_utils").string_match_all)
            atomic_write_text(folder / "row.json", json.dumps(row, indent=2))
            rows.append(row)
            write_tables(out, rows, self.tasks, self.lengths, {**self.settings, "half": half})
            got = summarize(rows, self.tasks, self.lengths)[-1]
            share = "-" if got["share_of_fkv"] is None else f"{got['share_of_fkv']:.3f}"
            log(f"[{half} kvpress {i + 1}/{len(presses)}] {press.label}: mean {got['mean']:.3f}, share of FKV {share}")
        return rows


if __name__ == "__main__":
    sys.exit(main())
