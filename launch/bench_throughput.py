"""Throughput at a fixed memory budget: FKV, ED and BM each at the largest batch that fits (the paper's claim).

    python launch/bench_throughput.py                      # embedded model, CPU, budget = what FKV needs for 4
    python launch/bench_throughput.py --model arch:llama-2-7b --dtype float16 --device cuda --memory-budget 40GiB
    python launch/bench_throughput.py --rules 'paper;question:every=1' --lengths ''   # another rule, no memory part

One run: (1) the budget (given, or the planner's peak of FKV at --fkv-batch, so FKV fits exactly that many);
(2) for each method the largest fitting batch (planner), one timed generation of --new tokens ignoring EOS
from prompts of --prompt-len tokens, tokens/s = generated tokens / (prefill + decode) seconds; FKV and ED run as
the fair baselines (the model's SDPA on their prompts, no score bookkeeping, ``dense.DensePool``), BM on
its own attention, once per eviction rule of --rules (default ``paper,question``) at each --kv-max, each rule at
its own largest batch (a probe rule's extra state fits fewer samples); (3) FKV and ED again as plain HF at the same
batch (``bench.hf_reference``: HF generate with its default cache; a DynamicCache cut to its newest
pair), ratio ours/HF (target >= 0.95) and whether the tokens are identical; (4) the ratios BM/ED and BM/FKV of the
paper rule next to the figures measured before the fair baselines, and the same ratios for the best rule (the first
non-paper rule of --rules); BM is a rule's fastest kv_max, ED the fastest ED row; (5) measured peak K/V + workspace
bytes of the paper rule's BM and of FKV for --lengths at a fixed batch (``--lengths ''`` skips it).
Prefill and decode seconds and the per-step decode time are printed too, to show where time goes.
Results: --out (JSON) and Markdown tables on stdout.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.bench import throughput as bench  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.models import load_model, read_config  # noqa: E402
from batchmax_tp.plan.planner import ModelShape  # noqa: E402


def main(argv=None) -> int:
    a = bench.parse_args(argv, description=__doc__)
    lengths = bench.lengths_arg(a.lengths)
    try:  # the budget and whether the weights fit it, before any weight loads
        shape = ModelShape.from_config(read_config(a.model))
        free = torch.cuda.mem_get_info(torch.device(a.device))[0] if a.device.startswith("cuda") else None
        budget = bench.budget_bytes(a, shape, free)
        bench.check_fits(shape, budget, a, free)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)

    bench.warm_up(model, a.rules, a.device, hf=not a.no_hf)
    rows = []
    for m, row in bench.run_rows(model, shape, a, budget):
        rows.append(row)
        if row["status"] == "ok":
            print(bench.row_line(m, row), flush=True)
    by_rule = {r: bench.ratios(rows, r) for r in a.rules}
    bm = Method("bm", kv_max=int(a.kv_max.split(",")[0]), p=a.p)
    memory = bench.measure_memory(model, shape, bm, Method("fkv"), lengths, a.length_batch, a.device, a.dtype)
    growth = bench.peak_growth(memory, lengths)

    attention = "SDPA prompts, fused decode passes"
    out = bench.results(a, budget, attention, rows, by_rule, memory, growth)
    print(bench.header(a, budget, attention))
    print(bench.format_runs(rows))
    print(bench.format_ratios(out["ratios"], out["ratios_best_rule"]))
    for line in bench.warnings(rows, out["ratios"]):
        print(line)
    if lengths:
        print(bench.format_memory(memory, lengths, a.length_batch, growth))

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
