"""Decode step time of the baselines: the engine's fair path against plain HF SDPA.

    python launch/bench_baselines.py                       # embedded model, batch 4, prompt 512, 32 new tokens

For FKV, ED (kv_max 2) and ED (kv_max 65): one untimed warm-up, then --repeats timed generations per path,
interleaved (``bench.padded.generate``, ``bench.hf_reference.hf_reference_generate``); the best decode seconds /
(new - 1) is the step time. Tokens of the two paths are compared. Results: --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.bench.hf_reference import hf_reference_generate  # noqa: E402
from batchmax_tp.bench.padded import generate  # noqa: E402
from batchmax_tp.core.method import Method, ed_settings  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/bench_baselines.json")
    a = ap.parse_args(argv)
    if a.new < 2 or a.repeats < 1:
        print("error: --new must be >= 2 and --repeats >= 1", file=sys.stderr)
        return 2

    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (a.batch, a.prompt_len), generator=g).to(a.device)
    paths = {
        "new": lambda m: generate(model, ids, None, m, a.new, ignore_eos=True),
        "hf": lambda m: hf_reference_generate(model, ids, None, m, a.new),
    }
    rows = []
    for method in (Method("fkv"), *ed_settings()):
        row, tokens, best = {"method": method.name, "kv_max": method.held_kv_max}, {}, {}
        for fn in paths.values():
            fn(method)  # warm-up
        for _ in range(a.repeats):  # interleaved, so slow drifts of the machine hit every path alike
            for name, fn in paths.items():
                res = fn(method)
                tokens[name], _, decode_s = res if name == "hf" else (res.tokens, res.prefill_s, res.decode_s)
                best[name] = min(best.get(name, decode_s), decode_s)
        for name in paths:
            row[f"{name}_step_ms"] = 1e3 * best[name] / (a.new - 1)
        row["tokens_equal"] = all(torch.equal(tokens["new"], t) for t in tokens.values())
        row["new_over_hf"] = row["new_step_ms"] / row["hf_step_ms"]
        rows.append(row)

    print(
        f"\nmodel={a.model} device={a.device} dtype={a.dtype} threads={torch.get_num_threads()} batch={a.batch} "
        f"prompt={a.prompt_len} new={a.new} attention=SDPA prefill, fused decode (best of {a.repeats})"
    )
    print("| method | engine ms/step | plain HF ms/step | engine/HF | tokens equal |")
    print("|---|---|---|---|---|")
    for r in rows:
        label = r["method"].upper() + (f" (kv_max {r['kv_max']})" if r["kv_max"] else "")
        print(
            f"| {label} | {r['new_step_ms']:.1f} | {r['hf_step_ms']:.1f} | {r['new_over_hf']:.3f} | "
            f"{r['tokens_equal']} |"
        )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump({"args": vars(a), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
