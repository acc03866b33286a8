"""Throughput at a fixed memory budget: FKV, ED and BM each at the largest batch that fits (the paper's claim).

    python launch/bench_throughput.py                      # embedded model, CPU, budget = what FKV needs for 4
    python launch/bench_throughput.py --model arch:llama-2-7b --dtype float16 --device cuda --memory-budget 40GiB
    python launch/bench_throughput.py --rules 'paper;question:every=1' --lengths ''   # another rule, no memory part

One run: (1) the budget (given, or the planner's peak of FKV at --fkv-batch, so FKV fits exactly that many);
(2) for each method the largest fitting batch (planner), one timed generation of --new tokens ignoring EOS
from prompts of --prompt-len tokens, tokens/s = generated tokens / (prefill + decode) seconds; FKV and ED run as
the fair baselines (the model's SDPA / FlashAttention-2, no score bookkeeping, ``batchmax_tp.core.baseline``), BM on
its own attention, once per eviction rule of --rules (default ``paper,question``) at each --kv-max, each rule at
its own largest batch (a probe rule's extra state fits fewer samples); (3) FKV and ED again as plain HF at the same
batch (``baseline.hf_reference_generate``: HF generate with its default cache; a DynamicCache cut to its newest
pair), ratio ours/HF (target >= 0.95) and whether the tokens are identical; (4) the ratios BM/ED and BM/FKV of the
paper rule next to the figures measured before the fair baselines, and the same ratios for the best rule (the first
non-paper rule of --rules); BM is a rule's fastest kv_max, ED the fastest ED row; (5) measured peak K/V + workspace
bytes of the paper rule's BM and of FKV for --lengths at a fixed batch (``--lengths ''`` skips it).
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
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402
from batchmax_tp.plan.planner import ModelShape, max_batch, parse_bytes, predict  # noqa: E402


def prompts(vocab: int, batch: int, length: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).to(device)


# BM/ED and BM/FKV measured with FKV and ED on the score-collecting attention (README, before the fair baselines).
OLD_RATIOS = {"bm_over_ed": 2.06, "bm_over_fkv": 2.55}
HF_TARGET = 0.95  # ours / plain HF tokens/s the fair baselines should reach
BM_OVER_ED_FLOOR = 1.6  # below this the report says so


def label(method: str, kv_max, rule: str | None = None) -> str:
    """``FKV``, ``ED (kv_max 2)``, ``BM (paper, kv_max 512)``: BM rows name their rule."""
    inside = [x for x in (rule if method == "bm" else None, None if kv_max is None else f"kv_max {kv_max}") if x]
    return method.upper() + (f" ({', '.join(inside)})" if inside else "")


def parse_rules(text: str) -> list[str]:
    """Rule specs (``core.rules`` syntax), comma-separated, or ';'-separated once a rule has parameters
    (``paper;snapkv:window=64,kernel=5``); each one validated. ValueError names a bad one."""
    from batchmax_tp.core.rules import get_rule

    sep = ";" if ";" in text or ":" in text else ","
    rules = [r.strip() for r in text.split(sep) if r.strip()]
    if not rules:
        raise ValueError("--rules: give at least one rule")
    for r in rules:
        get_rule(r)
    return rules


def best_rule(rules: list[str]) -> str | None:
    """The rule compared beside the paper's: the first non-paper rule given (None if only the paper's)."""
    return next((r for r in rules if r != "paper"), None)


def fastest(rows: list[dict], method: str, rule: str | None = None) -> dict | None:
    """The fastest finished row of ``method`` (BM: of ``rule``), or None."""
    ok = [r for r in rows if r["method"] == method and r["status"] == "ok" and (rule is None or r.get("rule") == rule)]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def ratios(rows: list[dict], rule: str | None) -> dict:
    """BM with ``rule`` (its fastest kv_max) over the fastest ED row and over FKV: tokens/s ratios, None where a
    row is missing (``rule`` None: no BM row)."""
    bm = fastest(rows, "bm", rule) if rule else None
    ed, fkv = fastest(rows, "ed"), fastest(rows, "fkv")
    return {
        "rule": rule,
        "bm_kv_max": bm and bm["kv_max"],
        "bm_batch": bm and bm["batch"],
        "bm_over_ed": bm["tokens_per_s"] / ed["tokens_per_s"] if bm and ed else None,
        "bm_over_fkv": bm["tokens_per_s"] / fkv["tokens_per_s"] if bm and fkv else None,
    }


def lengths_arg(text: str) -> list[int]:
    """``--lengths``: comma-separated prompt lengths; empty = none (skip the memory-by-length part)."""
    return [int(x) for x in text.split(",") if x.strip()]


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
        row["hf"] = {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "decode_step_ms": 1e3 * decode_s / max(new - 1, 1),
            "tokens_per_s": batch * new / (prefill_s + decode_s),
            "tokens_equal": torch.equal(tokens, out.tokens),
        }
        if device.startswith("cuda"):
            row["hf"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        row["ours_over_hf"] = row["tokens_per_s"] / row["hf"]["tokens_per_s"]
    return row


def warm_method(rule: str) -> Method:
    """A small BM that evicts with ``rule`` (p 32, room for the pairs the rule protects) for the warm-up."""
    from batchmax_tp.core.rules import get_rule

    p = 32
    return Method("bm", kv_max=max(64, 2 * p + get_rule(rule).protected()), p=p, rule=rule)


def measure_memory(
    model, shape, bm: Method, fkv: Method, lengths: list[int], batch: int, device: str, dtype: str
) -> list[dict]:
    """Measured (and predicted) peak K/V + workspace bytes of ``bm`` and ``fkv`` at ``batch`` per prompt length."""
    memory = []
    for L in lengths:
        for m in (bm, fkv):
            ids = prompts(model.config.vocab_size, batch, L, device, seed=1)
            out = generate(model, ids, None, m, 2, ignore_eos=True)
            est = predict(shape, m, batch, L, 2, dtype=dtype)
            memory.append(
                {
                    "method": m.name,
                    "prompt_len": L,
                    "batch": batch,
                    "measured_kv_plus_workspace": out.peak_kv_bytes + out.peak_workspace_bytes,
                    "predicted_kv_plus_workspace": est.kv + est.workspace,
                    "predicted_total": est.total,
                }
            )
    return memory


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def print_runs(rows: list[dict]) -> None:
    print(
        "| method | batch | tokens/s | prefill s | decode s | ms/step | peak KV MiB | plain HF tokens/s | HF ms/step "
        "| ours/HF | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = label(r["method"], r["kv_max"], r.get("rule"))
        if r["status"] != "ok":
            print(f"| {name} | OOM | | | | | | | | | |")
            continue
        h = r.get("hf")
        hf_cols = (
            (
                f"{h['tokens_per_s']:.1f} | {h['decode_step_ms']:.0f} | {r['ours_over_hf']:.3f} | "
                f"{'yes' if h['tokens_equal'] else 'NO'}"
            )
            if h
            else " | | |"
        )
        print(
            f"| {name} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['prefill_s']:.1f} | {r['decode_s']:.1f} | "
            f"{r['decode_step_ms']:.0f} | {r['peak_kv_bytes'] / 2**20:.1f} | {hf_cols} |"
        )


def print_ratios(paper: dict, best: dict) -> None:
    """The paper rule's BM/ED and BM/FKV beside the figures before the fair baselines, then the best rule's."""
    print("\n| ratio | now (fair baselines) | before (score-collecting baselines) | BM row |\n|---|---|---|---|")
    where = lambda r: "-" if r["bm_batch"] is None else f"b {r['bm_batch']}, kv_max {r['bm_kv_max']}"  # noqa: E731
    print(f"| BM/ED | {_fmt(paper['bm_over_ed'])} | {OLD_RATIOS['bm_over_ed']:.2f} | {where(paper)} |")
    print(f"| BM/FKV | {_fmt(paper['bm_over_fkv'])} | {OLD_RATIOS['bm_over_fkv']:.2f} | {where(paper)} |")
    if best["rule"]:
        print(f"| BM ({best['rule']})/ED | {_fmt(best['bm_over_ed'])} | - | {where(best)} |")
        print(f"| BM ({best['rule']})/FKV | {_fmt(best['bm_over_fkv'])} | - | {where(best)} |")
    print(
        "BM/...: the paper rule's BM; BM (rule)/...: that rule's; each its fastest kv_max row. ED: the fastest ED row."
    )


def print_memory(memory: list[dict], lengths: list[int], batch: int, growth) -> None:
    print(f"\npeak K/V + workspace (MiB) at batch {batch}:")
    print("prompt " + " ".join(f"{L:>8}" for L in lengths))
    for name in ("bm", "fkv"):
        vals = [r["measured_kv_plus_workspace"] / 2**20 for r in memory if r["method"] == name]
        print(f"{name:<6} " + " ".join(f"{v:>8.1f}" for v in vals))
    print(f"BM peak at {max(lengths)} / at 1024 = {_fmt(growth)}")


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
    ap.add_argument(
        "--rules",
        default="paper,question",
        help="BM's eviction rules, each run at every --kv-max (core.rules names; ';'-separated when a "
        "rule has parameters, e.g. 'paper;question:every=1'); the first non-paper one is the best "
        "rule whose ratios are shown beside the paper rule's",
    )
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64, help="cap on any batch (time on a CPU)")
    ap.add_argument(
        "--lengths", default="512,1024,2048,4096", help="prompt lengths of the memory-by-length part ('' skips it)"
    )
    ap.add_argument("--length-batch", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the plain-HF runs of FKV and ED")
    ap.add_argument("--out", default="results/bench_throughput.json")
    a = ap.parse_args(argv)
    try:
        a.rules = parse_rules(a.rules)
        lengths = lengths_arg(a.lengths)
    except ValueError as err:
        ap.error(str(err))
    best = best_rule(a.rules)

    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    shape = ModelShape.from_config(model.config)
    s, T = a.prompt_len, a.new
    fkv = Method("fkv")
    budget = (
        parse_bytes(a.memory_budget) if a.memory_budget else predict(shape, fkv, a.fkv_batch, s, T, dtype=a.dtype).total
    )
    methods = [fkv, Method("ed", kv_max=2), Method("ed", kv_max=65)]
    methods += [Method("bm", kv_max=int(k), p=a.p, rule=r) for k in a.kv_max.split(",") for r in a.rules]

    for m in [fkv, Method("ed", kv_max=2)] + [warm_method(r) for r in a.rules]:  # warm-up, every path and rule
        warm = prompts(model.config.vocab_size, 1, 16 if m.name != "bm" else 2 * m.kv_max, a.device)
        generate(model, warm, None, m, 4)
        if m.name != "bm" and not a.no_hf:
            hf_reference_generate(model, warm, None, m, 4)
    rows = []
    for m in methods:
        fit = max_batch(budget, shape, m, s, T, dtype=a.dtype)
        b = min(fit, a.max_batch)
        rule = m.rule if m.name == "bm" else None
        if b == 0:
            rows.append({"method": m.name, "rule": rule, "kv_max": m.kv_max, "batch": 0, "status": "OOM"})
            continue
        t = time.perf_counter()
        row = {
            "method": m.name,
            "rule": rule,
            "kv_max": m.kv_max,
            "largest_fitting_batch": fit,
            "status": "ok",
            "predicted": predict(shape, m, b, s, T, dtype=a.dtype).as_dict(),
            **timed(model, m, b, s, T, a.device, hf=not a.no_hf),
        }
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        hf = (
            ""
            if "hf" not in row
            else (f"  plain HF {row['hf']['tokens_per_s']:7.1f} tok/s (ours/HF {row['ours_over_hf']:.3f})")
        )
        print(
            f"{m.label():<40} b={b:<3} {row['tokens_per_s']:7.1f} tok/s  prefill {row['prefill_s']:7.1f}s  "
            f"decode {row['decode_s']:7.1f}s ({row['decode_step_ms']:.0f} ms/step){hf}",
            flush=True,
        )

    by_rule = {r: ratios(rows, r) for r in a.rules}
    paper, by_best = by_rule.get("paper", ratios(rows, None)), by_rule.get(best, ratios(rows, None))
    memory = measure_memory(
        model,
        shape,
        Method("bm", kv_max=int(a.kv_max.split(",")[0]), p=a.p),
        fkv,
        lengths,
        a.length_batch,
        a.device,
        a.dtype,
    )
    bm_at = {r["prompt_len"]: r["measured_kv_plus_workspace"] for r in memory if r["method"] == "bm"}
    growth = bm_at[max(lengths)] / bm_at[1024] if 1024 in bm_at and max(lengths) in bm_at else None

    print(
        f"\nmodel={a.model} device={a.device} dtype={a.dtype} threads={torch.get_num_threads()} prompt={s} new={T} "
        f"budget={budget / 2**30:.3f} GiB (planner total: weights + activations + K/V + workspace)"
    )
    attn = fastest_attention(model)
    print(f"FKV/ED attention: {attn} (no score bookkeeping); BM: batchmax\n")
    print_runs(rows)
    print_ratios(paper, by_best)
    below = [label(r["method"], r["kv_max"]) for r in rows if r.get("ours_over_hf", HF_TARGET) < HF_TARGET]
    if below:
        print(f"ours/HF below {HF_TARGET}: {', '.join(below)}")
    if paper["bm_over_ed"] is not None and paper["bm_over_ed"] < BM_OVER_ED_FLOOR:
        print(f"BM/ED = {paper['bm_over_ed']:.2f} is below {BM_OVER_ED_FLOOR}")
    if lengths:
        print_memory(memory, lengths, a.length_batch, growth)

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(
            {
                "args": vars(a),
                "budget_bytes": budget,
                "attention": {"fkv_ed": attn, "bm": "batchmax"},
                "threads": torch.get_num_threads(),
                "runs": rows,
                "ratios": paper,
                "best_rule": best,
                "ratios_best_rule": by_best,
                "ratios_by_rule": by_rule,
                "ratios_before": OLD_RATIOS,
                "memory": memory,
                "bm_peak_growth_4096_over_1024": growth,
            },
            f,
            indent=2,
        )
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
