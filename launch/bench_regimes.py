"""Where each method wins: the regime map (``batchmax_tp.bench.regimes``), measured on this machine and predicted for
the paper's settings from shapes alone.

    python launch/bench_regimes.py                       # predicted maps only (seconds, no model)
    python launch/bench_regimes.py --measure      # + the CPU map at 1k and 2k tokens, 64 new (~20 min, 2 cores)
    python launch/bench_regimes.py --measure --model qwen2.5-coder-0.5b --dtype bfloat16 --methods fkv,bm,snap \
        --kv-share 0.125 --max-prompts 4 --cpu-lengths 8192,16384 --budgets tight --out results/regimes_05b

``--measure`` runs the main job once per cell (``launch/run.py --data <needles> --memory-budget <cell's budget>
--max-new-tokens <n>``, one process at a time, each into ``OUT/cpu/<cell>/``; a cell already run is read back, a
cell stopped part-way resumes its runs), on needle prompts of the cell's length (3 depths, passkeys and facts, the
retention suite's held-out split, counted with ``--model``'s tokenizer), and draws ``OUT/regimes_cpu.png``. Each
cell's runs carry the prediction for this machine beside the measurement: ``predict_cell`` at the run's own batch
with this device's measured FLOP/s of a product and of causal attention and the rate a decode-shaped product streams
weights (``rates.this_device``), as a ratio over FKV's.
``--methods`` (the main job's ``--method``: fkv, ed, bm, snap), ``--kv-share`` (each bounded method's kv_max: that
share of the cell's length, in blocks of 64) and ``--max-prompts`` (the prompts a cell fills up to: long prompts
cost minutes each here) pass to each cell's main job.

The predicted maps (``OUT/regimes_<setting>.png``, ``--lengths``, default 1k to 32k) take their answers from the
measured cells of the nearest prompt length, or with ``--answers TABLE.json ...`` from ``launch/bench_ruler.py``
tables (each configuration's share of FKV's score at the length whose kv_max is ``--kv-share`` of it; a table
given later wins). Everything: ``OUT/regimes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.bench import rates, regimes  # noqa: E402
from batchmax_tp.eval.files import atomic_write_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/regimes")
    ap.add_argument("--measure", action="store_true", help="run the CPU map (the main job per cell)")
    ap.add_argument("--lengths", default=",".join(map(str, regimes.LENGTHS)), help="prompt lengths (tokens)")
    ap.add_argument("--outputs", default=",".join(map(str, regimes.OUTPUTS)), help="new tokens per request")
    ap.add_argument("--cpu-lengths", default="1024,2048", help="--measure: the measured map's prompt lengths")
    ap.add_argument("--cpu-outputs", default="64", help="--measure: the measured map's new tokens")
    ap.add_argument("--budgets", default=",".join(regimes.BUDGETS), help="--measure: tight, ample or both")
    ap.add_argument("--model", default=None, help="--measure: the model (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="--measure: the model's dtype (default auto: float32 on CPU)")
    ap.add_argument("--methods", default=None, help="--measure: the main job's methods (default: all five)")
    ap.add_argument("--kv-share", type=float, default=None, help="bounded methods' kv_max as a share of the length")
    ap.add_argument("--max-prompts", type=int, default=None, help="--measure: the prompts each cell fills up to")
    ap.add_argument(
        "--bm-chunk", type=int, default=0, help="BM's wide passes (columns a pass; 0: none), measured and predicted"
    )
    ap.add_argument("--answers", nargs="*", default=[], help="bench_ruler table.json files: the predicted answers")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.budgets.split(",")) - set(regimes.BUDGETS))
    if unknown:
        ap.error(f"--budgets: not {', '.join(unknown)} (tight, ample)")
    if a.kv_share is not None and not 0 < a.kv_share < 1:
        ap.error(f"--kv-share: a share between 0 and 1, got {a.kv_share}")
    for path in a.answers:
        if not Path(path).is_file():
            ap.error(f"--answers: no file {path}")
    return a


def _needles(length: int, path: Path, model: str | None) -> int:
    """Needle prompts of about ``length`` tokens at 3 depths into ``path`` (JSONL), counted with ``model``'s
    tokenizer; returns the longest's tokens."""
    from batchmax_tp.bench.retention.suite import build_suite, token_counter
    from batchmax_tp.models import EMBEDDED_MODEL, load_tokenizer

    tokenizer = load_tokenizer(model or EMBEDDED_MODEL)
    samples = build_suite(token_counter(tokenizer), lengths=[length], multi=False, summaries=[], split="heldout")
    lines = [json.dumps({"id": s.id, "prompt": s.prompt, "reference": s.answers[0]}) for s in samples]
    path.write_text("\n".join(lines) + "\n")
    return max(s.prompt_tokens for s in samples)


def _method_of(summary, bm_chunk: int = 0):
    """The run's method as its summary names it (``bm_chunk``: the cell's BM ran in wide passes of that many)."""
    from batchmax_tp.core.method import Method, wide_parameters

    own = wide_parameters(summary.method, bm_chunk)
    return Method(summary.method, kv_max=summary.kv_max, p=summary.p or 64, rule=summary.rule or "paper", **own)


def measure(out: Path, lengths: list[int], outputs: list[int], a: argparse.Namespace) -> list[dict]:
    """The CPU map: the main job per cell (a child process each, one at a time), its summaries read back, and each
    run's predicted tokens/s on this device at its own batch."""
    from batchmax_tp.eval.results import read_summary
    from batchmax_tp.models import EMBEDDED_MODEL, read_config, resolve_dtype
    from batchmax_tp.plan.planner import ModelShape

    model = a.model or EMBEDDED_MODEL
    config = read_config(model)
    shape = ModelShape.from_config(config.get_text_config())
    dtype = resolve_dtype(a.dtype, "cpu", config)
    budgets = [b for b in regimes.BUDGETS if b in a.budgets.split(",")]
    cards = rates.this_device("cpu", dtype, shape)
    print(
        f"this machine ({dtype}): products {cards.flops / 1e9:.0f} GFLOP/s, attention {cards.attention_flops / 1e9:.0f}"
        f" GFLOP/s, weights streamed at {cards.bandwidth / 1e9:.1f} GB/s",
        flush=True,
    )
    cells = []
    for new in outputs:
        for length in lengths:
            data = out / "cpu" / f"needles-{length}.jsonl"
            data.parent.mkdir(parents=True, exist_ok=True)
            longest = _needles(length, data, a.model)
            kv_max = regimes.kv_max_at(length, a.kv_share)
            for budget in budgets:
                b = regimes.budget_bytes(shape, longest, new, budget, 1, dtype)
                cell_out = out / "cpu" / f"{length}-{budget}-{new}"
                if not (cell_out / "report.md").is_file():
                    args = ["--data", str(data), "--memory-budget", str(b), "--max-new-tokens", str(new)]
                    args += ["--max-input-tokens", "null", "--dtype", dtype, "--model", model]
                    if a.methods:
                        args += ["--same-memory", "--method", a.methods]
                    if a.kv_share is not None:
                        args += ["--kv-max", str(kv_max)]
                    if a.max_prompts:
                        args += ["--max-prompts", str(a.max_prompts)]
                    if a.bm_chunk:
                        args += ["--bm-chunk", str(a.bm_chunk)]
                    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), *args, "--out", str(cell_out)]
                    print(f"cpu {length:>5} tokens, {budget:>5}, {new:>3} new: running ({cell_out})", flush=True)
                    subprocess.run([*cmd, "--log-level", "WARNING"], check=True, stdout=subprocess.DEVNULL)
                runs = {}
                for summary in sorted(cell_out.glob("*/summary.json")):
                    s = read_summary(summary.parent)
                    if s.paper_setting:  # the paper's static batches: beside the map, not a cell's method
                        continue
                    name = regimes.run_label(s.method, s.rule)
                    ok = s.status == "done"
                    run = {
                        "batch": s.batch_size,
                        "kv_max": s.kv_max,
                        "tokens_per_s": s.tokens_per_s if ok else None,
                        "answers": s.score if ok else None,
                    }
                    if ok:
                        method = _method_of(s, a.bm_chunk)
                        run["predicted_tokens_per_s"] = regimes.predict_cell(
                            shape, cards, method, longest, new, b, dtype=dtype, batch=s.batch_size
                        )["tokens_per_s"]
                    runs[name] = run
                _ratios(runs)
                best, why = regimes.winner(runs)
                cells.append(
                    {"new": new, "budget": budget, "length": length, "budget_bytes": b, "runs": runs}
                    | {"winner": best, "why": why, "longest": longest, "kv_max": kv_max}
                )
                print(f"cpu {length:>5} tokens, {budget:>5}, {new:>3} new: {best} ({why})", flush=True)
                for name, run in runs.items():
                    if run.get("ratio") is not None:
                        print(
                            f"    {name:<14} batch {run['batch']:>3}  {run['tokens_per_s']:.1f} tokens/s  "
                            f"{run['ratio']:.2f}x FKV (predicted {run['predicted_ratio']:.2f}x)  "
                            f"answers {run['answers']}",
                            flush=True,
                        )
    return cells


def _ratios(runs: dict) -> None:
    """Each run's measured and predicted tokens/s over FKV's, in place (None where FKV or the run did not run)."""
    fkv = runs.get("FKV", {})
    for run in runs.values():
        ok = fkv.get("tokens_per_s") and run.get("tokens_per_s")
        run["ratio"] = run["tokens_per_s"] / fkv["tokens_per_s"] if ok else None
        run["predicted_ratio"] = run["predicted_tokens_per_s"] / fkv["predicted_tokens_per_s"] if ok else None


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    outputs = [int(x) for x in a.outputs.split(",") if x]
    result: dict = {"accuracy_line": regimes.ACCURACY_LINE, "budgets": regimes.BUDGETS, "kv_share": a.kv_share}
    answers: dict[tuple[str, int], float] = {}
    ruler: dict[tuple[str, int], float] = {}
    if a.answers:
        tables = [json.loads(Path(path).read_text(encoding="utf-8")) for path in a.answers]
        ruler = regimes.answers_from_ruler(tables, a.kv_share if a.kv_share is not None else 0.125)
    if a.measure:
        cpu_lengths = [int(x) for x in a.cpu_lengths.split(",") if x]
        result["cpu"] = measure(out, cpu_lengths, [int(x) for x in a.cpu_outputs.split(",") if x], a)
        name = a.model or "SmolLM2-135M"
        source = "the cells' prompts"
        if ruler:  # a cell's winner by the tables' answers at its length (many documents), where they have it
            source = "the RULER tables where measured"
            for cell in result["cpu"]:
                shares = {label: ruler.get((label, cell["length"])) for label in cell["runs"]}
                if shares.get("FKV") is not None:
                    runs = {label: {**run, "answers": shares[label]} for label, run in cell["runs"].items()}
                    cell["winner"], cell["why"] = regimes.winner(runs)
                    cell["why"] += ", answers: RULER"
                    where = f"cpu {cell['length']:>5} tokens, {cell['budget']:>5}"
                    print(f"{where}: by RULER {cell['winner']} ({cell['why']})", flush=True)
        regimes.plot_map(
            result["cpu"], f"Winner at >= 90% of FKV's answers ({source}): {name}, CPU (measured)",
            out / "regimes_cpu.png",
        )  # fmt: skip
        for cell in result["cpu"]:
            fkv = cell["runs"].get("FKV", {}).get("answers")
            for label, run in cell["runs"].items():
                if fkv and run.get("answers") is not None:  # the share of FKV's answers, at this prompt length
                    share = run["answers"] / fkv
                    answers[label, cell["length"]] = min(answers.get((label, cell["length"]), 1.0), share)
    if ruler:
        answers |= ruler
        result["answers"] = {f"{label} @ {n}": share for (label, n), share in sorted(answers.items())}
    for setting in regimes.SETTINGS:
        # answers: each method's least share of FKV's measured at that prompt length (FKV's own: 1)
        cells = regimes.predict_map(setting, lengths, outputs, answers, kv_share=a.kv_share, bm_chunk=a.bm_chunk)
        result[setting] = cells
        slug = setting.split(" on ")[0]
        regimes.plot_map(
            cells, f"Predicted winner: {setting} (float16, planner + roofline)", out / f"regimes_{slug}.png"
        )
        for c in cells:
            print(
                f"{setting}: {c['length']:>5} tokens, {c['budget']:>5}, {c['new']:>3} new: {c['winner']} ({c['why']})"
            )
    atomic_write_text(out / "regimes.json", json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
