"""The retention benchmark's command line and run: its settings, the prompts it runs, the warm-up, the rows' runs
(every batch, then the interleaved timings) and what settings.json records. ``launch/bench_retention.py`` puts them
together and prints the table.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from ...bench.padded import generate
from ...core.rules import get_rule
from ...embedded import EMBEDDED_MODEL
from ...eval.generation import encode_prompts
from .run import Row, available_rules, make_method, run_row
from .score import TARGETS
from .suite import (
    DEFAULT_LENGTHS,
    KINDS,
    SPLIT_ABOUT,
    SPLITS,
    TARGET_LENGTH,
    RetentionSample,
    build_suite,
    shared_needles,
)

logger = logging.getLogger(__name__)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF id or local checkpoint (default: the embedded SmolLM2-135M)")
    ap.add_argument(
        "--rules",
        default=None,
        help="comma-separated rule names (default: every registered rule); rules with parameters, e.g. "
        "'paper;snapkv:window=64,kernel=5', are separated by ';'",
    )
    ap.add_argument("--kv-max", type=_ints, default=None, help="comma-separated kv_max values (default 512,256)")
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--lengths", type=_ints, default=None, help="prompt lengths in tokens (default 1024,2048,3072)")
    ap.add_argument(
        "--kinds",
        default="needle,multi,summary",
        help="prompt kinds to run, comma-separated (default all: needle,multi,summary); the prompts are "
        "drawn as for the whole suite, then filtered",
    )
    ap.add_argument(
        "--split",
        default="all",
        choices=SPLITS,
        help="prompt set: all (default, today's suite, = tune: the prompts the rules were tuned on) or "
        "heldout (new facts, passkey wording, documents and seeds; see the module docstring)",
    )
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--needle-tokens",
        type=int,
        default=None,
        help="new tokens for needle prompts (default 40: multi-fact answers need room)",
    )
    ap.add_argument("--summary-tokens", type=int, default=None, help="new tokens for summaries (default 64)")
    ap.add_argument(
        "--speed-repeats",
        type=int,
        default=0,
        help="after the run, time one batch of the target length k more times per row, rows interleaved "
        "(drift on a shared machine hits every row alike); tokens/s and its ratio become medians",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="smoke run: 768-token prompts, kv_max 256, short outputs")
    ap.add_argument("--out", default="results/retention")
    return ap


def parse_args(argv: Sequence[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The settings, --quick's defaults filled in, the kinds and rules parsed; a bad one: one line, exit 2."""
    ap = parser(description)
    a = ap.parse_args(argv)
    _defaults(a)
    _check(ap, a)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not a.kinds or set(a.kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}, got {','.join(a.kinds) or '(none)'}")
    a.rules = _rules(ap, a.rules)
    return a


def _defaults(a: argparse.Namespace) -> None:
    q = a.quick
    a.kv_max = a.kv_max or ([256] if q else [512, 256])
    a.lengths = a.lengths or ([768] if q else list(DEFAULT_LENGTHS))
    a.needle_tokens = a.needle_tokens or (24 if q else 40)
    a.summary_tokens = a.summary_tokens or (16 if q else 64)


def _check(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for k in a.kv_max:
        if k <= a.p:
            ap.error(f"--kv-max: every kv_max must be > p={a.p}, got {k}")
    for name in ("p", "batch_size", "needle_tokens", "summary_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    if a.speed_repeats < 0:
        ap.error("--speed-repeats: must be >= 0")


def _rules(ap: argparse.ArgumentParser, text: str | None) -> list[str]:
    """--rules as a list (default: every registered rule), each one validated."""
    known = available_rules()
    # Rules with parameters ("snapkv:window=64,kernel=5") hold commas themselves: then separate rules with ";".
    sep = ";" if text and (";" in text or ":" in text) else ","
    rules = [r.strip() for r in text.split(sep) if r.strip()] if text else known
    unknown = [r for r in rules if r.partition(":")[0] not in known]
    if unknown or not rules:
        ap.error(f"--rules: unknown rule(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    for r in rules:
        try:
            get_rule(r)
        except ValueError as err:
            ap.error(f"--rules: {err}")
    return rules


def cli_suite(count: Callable[[str], int], a: argparse.Namespace, split: str) -> list[RetentionSample]:
    """The command line's prompts of ``split`` (every kind; ``--kinds`` filters later)."""
    if not a.quick:
        return build_suite(count, lengths=a.lengths, seed=a.seed, split=split)
    samples = build_suite(
        count, lengths=a.lengths, depths=("middle",), multi=False, summaries=a.lengths, seed=a.seed, split=split
    )
    samples.insert(
        1,
        build_suite(
            count, lengths=a.lengths, depths=("early", "late"), multi=True, summaries=[], seed=a.seed + 1, split=split
        )[-1],
    )
    return samples


def prompts(count: Callable[[str], int], a: argparse.Namespace) -> tuple[list[RetentionSample], list[str]]:
    """(the prompts of --split and --kinds, the needles a held-out suite shares with the tuned one: none expected)."""
    samples = cli_suite(count, a, a.split)
    shared = []
    if a.split == "heldout":  # its passkeys are drawn apart from the tuned suite's: a repeat would be chance
        shared = shared_needles(samples, cli_suite(count, a, "tune"))
        if shared:
            logger.warning("held-out needles also in the tuned suite at seed %d: %s", a.seed, ", ".join(shared))
    return [s for s in samples if s.kind in a.kinds], shared


def target_length(lengths: Sequence[int]) -> int:
    """The length the targets are checked at: ``TARGET_LENGTH`` if run, else the middle length."""
    return TARGET_LENGTH if TARGET_LENGTH in lengths else sorted(lengths)[len(lengths) // 2]


def make_rows(a: argparse.Namespace) -> list[Row]:
    """FKV first (the reference), then every rule at every kv_max."""
    return [Row("fkv", None, None, a.p)] + [Row("bm", r, k, a.p) for k in a.kv_max for r in a.rules]


def warm_up(model, tokenizer, sample: RetentionSample, rows: list[Row], rules: list[str]) -> None:
    """Untimed warm-up of every code path: FKV and each rule once, on the last 128 tokens of ``sample``."""
    ids, mask = encode_prompts(tokenizer, [sample.prompt])
    for r in [rows[0]] + [Row("bm", rule, 96, 32) for rule in rules]:
        generate(model, ids[:, -128:], mask[:, -128:], make_method(r), 2, ignore_eos=True)


def run_rows(model, tokenizer, rows: list[Row], groups, timed, a: argparse.Namespace, bar) -> dict[Row, dict[str, Any]]:
    """Every row over every batch (FKV first: the others are fed its summaries), then ``--speed-repeats`` timings of
    the ``timed`` batch per row, rows interleaved. ``bar``: a progress bar (``update``, ``set_postfix_str``)."""
    runs: dict[Row, dict[str, Any]] = {}
    kw = dict(needle_tokens=a.needle_tokens, summary_tokens=a.summary_tokens, on_batch=lambda: bar.update(1))
    for row in rows:
        bar.set_postfix_str(row.label)
        forced = runs[rows[0]]["tokens"] if row.evicts else None  # FKV runs first
        runs[row] = run_row(model, tokenizer, row, groups, forced=forced, **kw)
    for _ in range(a.speed_repeats):  # rows interleaved: a slow minute on the machine hits every row alike
        for row in rows:
            bar.set_postfix_str(f"timing {row.label}")
            r = run_row(model, tokenizer, row, [timed], **kw)
            runs[row].setdefault("speed", []).append(r["generated_tokens"] / (r["prefill_s"] + r["decode_s"]))
    return runs


def settings(a, argv, samples: list[RetentionSample], groups, timed, target: int, shared, wall: float) -> dict:
    """What settings.json records: the resolved settings, the split, every prompt and batch, the wall time."""
    return {
        "command": " ".join([os.path.basename(sys.executable), "launch/bench_retention.py", *(argv or sys.argv[1:])]),
        "model": a.model or EMBEDDED_MODEL,
        "rules": a.rules,
        "kv_max": a.kv_max,
        "p": a.p,
        "lengths": a.lengths,
        "target_length": target,
        "kinds": a.kinds,
        "split": a.split,
        "split_about": SPLIT_ABOUT[a.split],
        "shared_with_tune": shared,
        "batch_size": a.batch_size,
        "needle_tokens": a.needle_tokens,
        "summary_tokens": a.summary_tokens,
        "speed_repeats": a.speed_repeats,
        "timed_batch": [x.id for x in timed],
        "decoding": "greedy, ignore_eos",
        "seed": a.seed,
        "dtype": a.dtype,
        "device": a.device,
        "quick": a.quick,
        "threads": torch.get_num_threads(),
        "targets": TARGETS,
        "wall_s": round(wall, 1),
        "samples": [
            {
                "id": s.id,
                "kind": s.kind,
                "length": s.length,
                "prompt_tokens": s.prompt_tokens,
                "depths": s.depths,
                "needles": [asdict(n) for n in s.needles],
            }
            for s in samples
        ],
        "batches": [[s.id for s in g] for g in groups],
    }
