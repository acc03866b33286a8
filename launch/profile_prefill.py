"""Where a prompt token's time goes, op by op: ``torch.profiler`` over the prefill of FKV, BM (paper) and BM
(``question``), each op's time set against its FLOPs and bytes, grouped by the code that called it.

    python launch/profile_prefill.py                            # embedded model, CPU, ~1.4k and ~6k tokens
    python launch/profile_prefill.py --lengths 1408 --rows 4 --methods fkv,bm:rule=question

For each prompt length, ``--rows`` random-token prompts of that length are served at once by each method with one
new token (as ``launch/bench_prefill.py`` times them): once to count the prefill's passes (and warm), then again with
the profiler (Python stacks on) over the prefill's last ``--passes`` passes only, the prompt's end: for BM its last
blocks of ``p`` tokens, each with its evictions, probes and re-scoring (``question`` probes every 4th block: 8 passes
hold two of its cycles); for FKV its one pass. Every op's self time (the thread that runs the model) is given to the
innermost project function among its callers (``_rows_block``, ``_rows_probe``, ``_rescored``, ``pool_by_position``,
...; the model's own code, its linear layers and norms, is ``model``), with its FLOPs (the profiler's, for the
products) and bytes (its inputs' sizes: the least it reads). The table gives, per method, each region's
milliseconds per prompt token of the passes profiled, GFLOP/s and GB/s, and its excess over the paper rule's;
``--out`` keeps the rows (JSON). Run it alone on the machine: the profiler's own cost (a few us per op, more with
stacks) is in every row alike, so set the rows against each other, and the whole prefill's unprofiled clock beside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.bench.regimes import label  # noqa: E402
from batchmax_tp.core import engine as serve  # noqa: E402
from batchmax_tp.core.engine import Engine  # noqa: E402
from batchmax_tp.core.requests import Request, Sampling  # noqa: E402
from batchmax_tp.eval.files import atomic_write_text  # noqa: E402
from batchmax_tp.models import load_model  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_prefill import method_of, parsed, parser  # noqa: E402

METHODS = ("fkv", "bm", "bm:rule=question")
PACKAGE = os.sep + "batchmax_tp" + os.sep
#: The project's functions that only pass a pass along (their ops belong to what they call, or to the model).
PASS_THROUGH = {
    "batchmax_attention",
    "_rows_attention",
    "_folded",
    "forward_pass",
    "run",
    "step",
    "forward",
    "__call__",
}


def parse(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, "1408,6144", METHODS, "results/profile_prefill.json")
    ap.add_argument("--passes", type=int, default=8, help="the prefill's last passes profiled (default 8)")
    ap.add_argument("--top", type=int, default=8, help="ops listed per region (default 8)")
    return parsed(ap, argv)


def region(event) -> str:
    """The innermost project function among an op's callers (its parents in the profile's tree: the Python tracer's
    frames, ``path(line): name``), ``model`` when none but the engine's pass-through ones is there (the model's own
    code: linear layers, norms, RoPE, its SDPA)."""
    parent = event.cpu_parent
    while parent is not None:
        frame = parent.name
        if PACKAGE in frame and "): " in frame:
            func = frame.rsplit("): ", 1)[-1].strip()
            if func not in PASS_THROUGH:
                return func
        parent = parent.cpu_parent
    return "model"


def op_bytes(shapes: list, elem: int) -> int:
    """Bytes of an op's tensor inputs (each shape's elements x ``elem``): what it must read at least."""
    total = 0
    for shape in shapes or []:
        if isinstance(shape, (list, tuple)) and shape and all(isinstance(d, int) for d in shape):
            total += math.prod(shape) * elem
    return total


class Passes:
    """``engine.forward_pass`` counted: each call's real prompt tokens (``tokens``), and ``after`` called once each
    call returns (the profiler's ``step``: a profiled step is a pass's description, its evictions and its model
    call)."""

    def __init__(self):
        self.real, self.tokens, self.kinds, self.after = serve.forward_pass, [], [], None

    def __call__(self, model, step, ids, mask, keep=1):
        out = self.real(model, step, ids, mask, keep)
        blocks = step.subs or (step,)  # a wide pass: each block's
        self.tokens.append(sum(int((b.qpos >= 0).sum()) for b in blocks))  # the pass's prompt tokens (probes aside)
        self.kinds.append(step.kind)
        if self.after is not None:
            self.after()
        return out


def profiled(model, requests: list[Request], method, elem: int, last: int) -> dict:
    """{region: {op: [seconds, flops, bytes, calls]}} over the last ``last`` passes of one prefill of ``requests``
    (the prompt's end: for BM its last blocks, each with its evictions, probes and re-scoring; for FKV its one pass),
    after a warm prefill that counts the passes; the wall seconds of the whole prefill by the engine's clock, and the
    prompt tokens of the passes profiled."""
    passes = serve.forward_pass = Passes()
    try:
        Engine(model, method, len(requests)).run(requests, Sampling(ignore_eos=True))  # warm; counts the passes
        n = max(i for i, kind in enumerate(passes.kinds) if kind != "decode") + 1  # the prefill's passes
        active = min(last, n - 1) if n > 1 else 1  # a warm-up pass before the window (one pass: the whole run)
        tokens = sum(passes.tokens[n - active : n])
        when = schedule(wait=n - active - 1, warmup=1, active=active, repeat=1) if n > 1 else None
        caught = []
        with profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            with_flops=True,
            with_stack=True,
            schedule=when,
            on_trace_ready=(lambda prof: caught.extend(prof.events())) if when else None,
        ) as prof:
            passes.after = prof.step if when else None
            out = Engine(model, method, len(requests)).run(requests, Sampling(ignore_eos=True))
        if when is None:
            caught = prof.events()
    finally:
        serve.forward_pass = passes.real
    events = [ev for ev in caught if ev.self_cpu_time_total > 0 and ev.name.startswith("aten::")]
    by_thread: dict = defaultdict(float)
    for ev in events:
        by_thread[ev.thread] += ev.self_cpu_time_total
    main = max(by_thread, key=by_thread.get)  # the thread that runs the model (others: tqdm's monitor, ...)
    table: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0, 0]))
    for ev in events:
        if ev.thread != main:
            continue
        cell = table[region(ev)][ev.name]
        cell[0] += ev.self_cpu_time_total / 1e6
        cell[1] += ev.flops or 0
        cell[2] += op_bytes(ev.input_shapes, elem)
        cell[3] += 1
    regions = {r: dict(ops) for r, ops in table.items()}
    return {"prefill_s": out.prefill_s, "passes": n, "profiled_passes": active, "tokens": tokens, "regions": regions}


def summary(regions: dict, tokens: int) -> dict[str, dict]:
    """Per region: ms per prompt token, GFLOP/s and GB/s over its own time."""
    out = {}
    for name, ops in regions.items():
        s = sum(c[0] for c in ops.values())
        f, b = sum(c[1] for c in ops.values()), sum(c[2] for c in ops.values())
        out[name] = {
            "ms_per_token": 1e3 * s / tokens,
            "gflops": f / s / 1e9 if s else 0.0,
            "gbs": b / s / 1e9 if s else 0,
        }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms_per_token"]))


def format_tables(result: dict, top: int) -> str:
    lines = []
    for length, runs in result["lengths"].items():
        base = runs.get("bm") or next(iter(runs.values()))
        base_sum = summary(base["regions"], base["tokens"])
        lines += [f"\n## {length} tokens x {result['rows']} rows", ""]
        lines += ["| method | region | ms / prompt token | GFLOP/s | GB/s | over BM paper's (ms/token) |"]
        lines += ["|---|---|---:|---:|---:|---:|"]
        for run in runs.values():
            regions = summary(run["regions"], run["tokens"])
            profiled_ms = sum(r["ms_per_token"] for r in regions.values())
            whole = 1e3 * run["prefill_s"] / (length * result["rows"])
            lines.append(
                f"| {run['label']} | **all**: last {run['profiled_passes']} of {run['passes']} passes "
                f"(engine clock of the whole prefill, profiled: {whole:.3f}) | **{profiled_ms:.3f}** | | | |"
            )
            for name, r in regions.items():
                over = r["ms_per_token"] - base_sum.get(name, {"ms_per_token": 0.0})["ms_per_token"]
                lines.append(
                    f"| {run['label']} | {name} | {r['ms_per_token']:.3f} | {r['gflops']:.1f} | {r['gbs']:.1f} | "
                    f"{over:+.3f} |"
                )
        lines += ["", "Top ops of each region (ms / prompt token, GFLOP/s, GB/s, calls):", ""]
        for run in runs.values():
            tokens = run["tokens"]
            for name, ops in sorted(run["regions"].items(), key=lambda kv: -sum(c[0] for c in kv[1].values())):
                best = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
                cells = ", ".join(
                    f"{op} {1e3 * c[0] / tokens:.3f} ({c[1] / c[0] / 1e9 if c[0] else 0:.0f}, "
                    f"{c[2] / c[0] / 1e9 if c[0] else 0:.1f}, {c[3]})"
                    for op, c in best
                )
                lines.append(f"- {run['label']} / {name}: {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse(argv)
    methods = {spec: method_of(spec) for spec in a.methods.split(",")}
    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    elem = next(model.parameters()).element_size()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    result = {"model": a.model, "device": a.device, "dtype": a.dtype, "threads": torch.get_num_threads()}
    result.update({"rows": a.rows, "lengths": {}})
    for length in a.lengths:
        requests = [Request(torch.randint(10, vocab - 10, (length,), generator=g).tolist(), 1) for _ in range(a.rows)]
        runs = {}
        for spec, method in methods.items():
            run = profiled(model, requests, method, elem, a.passes)
            runs[spec] = {"label": label(method), **run}
            print(f"{length:>6} {spec:>18}: {run['prefill_s']:7.2f} s prefill (profiled)", file=sys.stderr, flush=True)
        result["lengths"][length] = runs
    text = format_tables(result, a.top)
    print(text)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    atomic_write_text(a.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
