"""Throughput at a fixed memory budget: FKV, ED and BM each at the largest batch that fits (the paper's claim).

    python launch/bench_throughput.py                      # embedded model, CPU, budget = what FKV needs for 4
    python launch/bench_throughput.py --model arch:llama-2-7b --dtype float16 --device cuda --memory-budget 40GiB

One run: (1) the budget (given, or the planner's peak of FKV at --fkv-batch, so FKV fits exactly that many);
(2) for each method the largest fitting batch (planner), one timed generation of --new tokens ignoring EOS
from prompts of --prompt-len tokens, tokens/s = generated tokens / (prefill + decode) seconds; FKV and ED run as
the fair baselines (the model's SDPA / FlashAttention-2, no score bookkeeping, ``batchmax_tp.core.baseline``), BM on
its own attention; (3) FKV and ED again as plain HF at the same batch (``baseline.hf_reference_generate``: HF
generate with its default cache; a DynamicCache cut to its newest pair), ratio ours/HF (target >= 0.95) and
whether the tokens are identical; (4) the ratios BM/ED and BM/FKV next to the figures measured before the fair
baselines; (5) measured peak K/V + workspace bytes of BM and FKV for prompt lengths 512..4096 at a fixed batch.
Prefill and decode seconds and the per-step decode time are printed too, to show where time goes.
Results: --out (JSON) and Markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.core.baseline import fastest_attention, hf_reference_generate  # noqa: E402
from batchmax_tp.core.engine import generate  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402
from batchmax_tp.plan.planner import ModelShape, max_batch, parse_bytes, predict  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402


def prompts(vocab: int, batch: int, length: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).to(device)


# BM/ED and BM/FKV measured with FKV and ED on the score-collecting attention (README, before the fair baselines).
OLD_RATIOS = {"bm_over_ed": 2.06, "bm_over_fkv": 2.55}
HF_TARGET = 0.95  # ours / plain HF tokens/s the fair baselines should reach
BM_OVER_ED_FLOOR = 1.6  # below this the report says so


def label(method: str, kv_max) -> str:
    return method.upper() + ("" if kv_max is None else f" (kv_max {kv_max})")


def timed(model, method: Method, batch: int, length: int, new: int, device: str, hf: bool = False) -> dict:
    ids = prompts(model.config.vocab_size, batch, length, device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    out = generate(model, ids, None, method, new, ignore_eos=True)
    row = {
        "batch": batch,
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "decode_step_ms": 1e3 * out.decode_s / max(new - 1, 1),
        "tokens_per_s": batch * new / (out.prefill_s + out.decode_s),
        "peak_kv_bytes": out.peak_kv_bytes,
        "peak_workspace_bytes": out.peak_workspace_bytes,
    }
    if device.startswith("cuda"):
        row["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    if hf and method.name != "bm":  # the same prompts through plain HF on the model's own attention
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        tokens, prefill_s, decode_s = hf_reference_generate(model, ids, None, method, new)
        row["hf"] = {"prefill_s": prefill_s, "decode_s": decode_s, "decode_step_ms": 1e3 * decode_s / max(new - 1, 1),
                     "tokens_per_s": batch * new / (prefill_s + decode_s),
                     "tokens_equal": torch.equal(tokens, out.tokens)}
        if device.startswith("cuda"):
            row["hf"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        row["ours_over_hf"] = row["tokens_per_s"] / row["hf"]["tokens_per_s"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--memory-budget", default=None, help="bytes or e.g. 24GiB; default: FKV's peak at --fkv-batch")
    ap.add_argument("--fkv-batch", type=int, default=4)
    ap.add_argument("--kv-max", default="512", help="comma-separated BM kv_max values to try")
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64, help="cap on any batch (time on a CPU)")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--length-batch", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the plain-HF runs of FKV and ED")
    ap.add_argument("--out", default="results/bench_throughput.json")
    a = ap.parse_args(argv)

    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    shape = ModelShape.from_config(model.config)
    s, T = a.prompt_len, a.new
    fkv = Method("fkv")
    budget = parse_bytes(a.memory_budget) if a.memory_budget else predict(shape, fkv, a.fkv_batch, s, T, dtype=a.dtype).total
    methods = [fkv, Method("ed", kv_max=2), Method("ed", kv_max=65)]
    methods += [Method("bm", kv_max=int(k), p=a.p) for k in a.kv_max.split(",")]

    warm = prompts(model.config.vocab_size, 1, 16, a.device)
    for m in (Method("bm", kv_max=8, p=4), fkv, Method("ed", kv_max=2)):  # warm-up, every path
        generate(model, warm, None, m, 4)
        if m.name != "bm" and not a.no_hf:
            hf_reference_generate(model, warm, None, m, 4)
    rows = []
    for m in methods:
        fit = max_batch(budget, shape, m, s, T, dtype=a.dtype)
        b = min(fit, a.max_batch)
        if b == 0:
            rows.append({"method": m.name, "kv_max": m.kv_max, "batch": 0, "status": "OOM"})
            continue
        t = time.perf_counter()
        row = {"method": m.name, "kv_max": m.kv_max, "largest_fitting_batch": fit, "status": "ok",
               "predicted": predict(shape, m, b, s, T, dtype=a.dtype).as_dict(),
               **timed(model, m, b, s, T, a.device, hf=not a.no_hf)}
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        hf = "" if "hf" not in row else (
            f"  plain HF {row['hf']['tokens_per_s']:7.1f} tok/s (ours/HF {row['ours_over_hf']:.3f})")
        print(f"{m.label():<28} b={b:<3} {row['tokens_per_s']:7.1f} tok/s  prefill {row['prefill_s']:7.1f}s  "
              f"decode {row['decode_s']:7.1f}s ({row['decode_step_ms']:.0f} ms/step){hf}", flush=True)

    def best(name):
        ok = [r for r in rows if r["method"] == name and r["status"] == "ok"]
        return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None

    b_bm, b_ed, b_fkv = best("bm"), best("ed"), best("fkv")
    ratios = {
        "bm_over_ed": b_bm["tokens_per_s"] / b_ed["tokens_per_s"] if b_bm and b_ed else None,
        "bm_over_fkv": b_bm["tokens_per_s"] / b_fkv["tokens_per_s"] if b_bm and b_fkv else None,
    }

    lengths = [int(x) for x in a.lengths.split(",")]
    bm_mem = Method("bm", kv_max=int(a.kv_max.split(",")[0]), p=a.p)
    memory = []
    for L in lengths:
        for m in (bm_mem, fkv):
            ids = prompts(model.config.vocab_size, a.length_batch, L, a.device, seed=1)
            out = generate(model, ids, None, m, 2, ignore_eos=True)
            est = predict(shape, m, a.length_batch, L, 2, dtype=a.dtype)
            memory.append({"method": m.name, "prompt_len": L, "batch": a.length_batch,
                           "measured_kv_plus_workspace": out.peak_kv_bytes + out.peak_workspace_bytes,
                           "predicted_kv_plus_workspace": est.kv + est.workspace,
                           "predicted_total": est.total})
    bm_at = {r["prompt_len"]: r["measured_kv_plus_workspace"] for r in memory if r["method"] == "bm"}
    growth = bm_at[max(lengths)] / bm_at[1024] if 1024 in bm_at else None

    print(f"\nmodel={a.model} device={a.device} dtype={a.dtype} threads={torch.get_num_threads()} prompt={s} new={T} "
          f"budget={budget / 2**30:.3f} GiB (planner total: weights + activations + K/V + workspace)")
    attn = fastest_attention(model)
    print(f"FKV/ED attention: {attn} (no score bookkeeping); BM: batchmax\n")
    print("| method | batch | tokens/s | prefill s | decode s | ms/step | peak KV MiB | plain HF tokens/s | HF ms/step "
          "| ours/HF | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {label(r['method'], r['kv_max'])} | OOM | | | | | | | | | |")
            continue
        h = r.get("hf")
        hf_cols = (f"{h['tokens_per_s']:.1f} | {h['decode_step_ms']:.0f} | {r['ours_over_hf']:.3f} | "
                   f"{'yes' if h['tokens_equal'] else 'NO'}") if h else " | | |"
        print(f"| {label(r['method'], r['kv_max'])} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['prefill_s']:.1f} | "
              f"{r['decode_s']:.1f} | {r['decode_step_ms']:.0f} | {r['peak_kv_bytes'] / 2**20:.1f} | {hf_cols} |")
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    print("\n| ratio | now (fair baselines) | before (score-collecting baselines) |\n|---|---|---|")
    print(f"| BM/ED | {fmt(ratios['bm_over_ed'])} | {OLD_RATIOS['bm_over_ed']:.2f} |")
    print(f"| BM/FKV | {fmt(ratios['bm_over_fkv'])} | {OLD_RATIOS['bm_over_fkv']:.2f} |")
    below = [label(r["method"], r["kv_max"]) for r in rows if r.get("ours_over_hf", HF_TARGET) < HF_TARGET]
    if below:
        print(f"ours/HF below {HF_TARGET}: {', '.join(below)}")
    if ratios["bm_over_ed"] is not None and ratios["bm_over_ed"] < BM_OVER_ED_FLOOR:
        print(f"BM/ED = {ratios['bm_over_ed']:.2f} is below {BM_OVER_ED_FLOOR}")
    print(f"\npeak K/V + workspace (MiB) at batch {a.length_batch}:")
    print("prompt " + " ".join(f"{L:>8}" for L in lengths))
    for name in ("bm", "fkv"):
        vals = [r["measured_kv_plus_workspace"] / 2**20 for r in memory if r["method"] == name]
        print(f"{name:<6} " + " ".join(f"{v:>8.1f}" for v in vals))
    print(f"BM peak at {max(lengths)} / at 1024 = {fmt(growth)}")

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump({"args": vars(a), "budget_bytes": budget, "attention": {"fkv_ed": attn, "bm": "batchmax"},
                   "threads": torch.get_num_threads(), "runs": rows, "ratios": ratios, "ratios_before": OLD_RATIOS,
                   "memory": memory, "bm_peak_growth_4096_over_1024": growth}, f, indent=2)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
