"""Attention benchmark on the embedded model: prefill and decode time, and each attention call's measured peak
allocation against the workspace it reports (CPU allocation tracker of tests/memtrack.py).

    python launch/bench_attention.py [--batch 4] [--prompt-len 512] [--new 16] [--reps 3]
                                     [--baseline OLD/attention.py] [--out results/bench_attention.json]

``--baseline``: another version of ``batchmax_tp/core/attention.py`` (e.g.
``git show HEAD~1:batchmax_tp/core/attention.py``), timed in alternation with the current one (same process, same
model), so the two are compared under one load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from memtrack import AllocationTracker  # noqa: E402

from batchmax_tp.core import attention, cache  # noqa: E402
from batchmax_tp.core.engine import generate  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.models import load_model  # noqa: E402

METHODS = {"fkv": Method("fkv"), "bm": Method("bm", kv_max=256, p=64)}


def load_attention(path: str):
    """The ``batchmax_attention`` of another attention.py, importing the current package's cache."""
    spec = importlib.util.spec_from_file_location("batchmax_tp.core._baseline_attention", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "batchmax_tp.core"  # its relative imports (.cache, .workspace) resolve in core/
    spec.loader.exec_module(module)
    return module.batchmax_attention


def timed(model, ids, method, new, fn) -> tuple[float, float, torch.Tensor]:
    attention.batchmax_attention = fn  # use_batchmax_attention registers the module's current function
    out = generate(model, ids, None, method, new, ignore_eos=True, return_logits=True)
    return out.prefill_s, out.decode_s / max(1, new - 1), torch.stack(out.logits)


def call_ratios(model, ids, method, new) -> dict:
    """Measured peak / reported workspace of every attention call of one generation."""
    fn, notes, reported = attention.batchmax_attention, [], []
    note = cache.BatchMaxCache.note_workspace

    def recording_note(self, nbytes):
        notes.append(nbytes)
        note(self, nbytes)

    def labelled(*args, **kwargs):
        start = len(notes)
        with torch.profiler.record_function("bench::attention_call"):
            result = fn(*args, **kwargs)
        reported.append(max(notes[start:], default=0))
        return result

    cache.BatchMaxCache.note_workspace = recording_note
    attention.batchmax_attention = labelled
    try:
        with AllocationTracker() as t:
            generate(model, ids, None, method, new, ignore_eos=True)
    finally:
        cache.BatchMaxCache.note_workspace = note
        attention.batchmax_attention = fn
    ratios = [m / r for m, r in zip(t.spans("bench::attention_call"), reported)]
    return {
        "calls": len(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "max_measured": max(t.spans("bench::attention_call")),
        "max_reported": max(reported),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", help="another attention.py to time in alternation")
    ap.add_argument("--out", default="results/bench_attention.json")
    args = ap.parse_args()

    model, _ = load_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (args.batch, args.prompt_len), generator=g)
    current = attention.batchmax_attention
    versions = {"current": current}
    if args.baseline:
        versions["baseline"] = load_attention(args.baseline)
    generate(model, ids[:, :64], None, METHODS["fkv"], 2, ignore_eos=True)  # warm-up
    report = {"batch": args.batch, "prompt_len": args.prompt_len, "new": args.new, "threads": torch.get_num_threads()}
    for name, method in METHODS.items():
        times = {v: [] for v in versions}
        for _ in range(args.reps):
            for v, fn in versions.items():
                times[v].append(timed(model, ids, method, args.new, fn))
        attention.batchmax_attention = current
        row = {
            v: {
                "prefill_s": statistics.median(t[0] for t in ts),
                "decode_step_ms": 1e3 * statistics.median(t[1] for t in ts),
            }
            for v, ts in times.items()
        }
        if args.baseline:  # the same logits, bit for bit
            row["logits_equal"] = all(torch.equal(a[2], b[2]) for a, b in zip(times["current"], times["baseline"]))
        row["current_calls"] = call_ratios(model, ids[:, : min(args.prompt_len, 320)], method, 4)
        if args.baseline:
            fn = versions["baseline"]
            attention.batchmax_attention = fn
            row["baseline_calls"] = call_ratios(model, ids[:, : min(args.prompt_len, 320)], method, 4)
            attention.batchmax_attention = current
        report[name] = row
        print(name, json.dumps(row))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
