"""Where each method wins: the regime map (``batchmax_tp.bench.regimes``), measured on this machine and predicted for
the paper's settings from shapes alone.

    python launch/bench_regimes.py                       # predicted maps only (seconds, no model)
    python launch/bench_regimes.py --measure      # + the CPU map at 1k and 2k tokens, 64 new (~20 min, 2 cores)

``--measure`` runs the main job once per cell (``launch/run.py --data <needles> --memory-budget <cell's budget>
--max-new-tokens <n>``, one process at a time, each into ``OUT/cpu/<cell>/``; a cell already run is read back),
on needle prompts of the cell's length (3 depths, passkeys and facts, the retention suite's held-out split), and
draws ``OUT/regimes_cpu.png``. The predicted maps (``OUT/regimes_<setting>.png``) take their answers from the
measured cells of the same prompt length. Everything: ``OUT/regimes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.bench import regimes  # noqa: E402
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
    return ap.parse_args(argv)


def _needles(length: int, path: Path) -> int:
    """Needle prompts of about ``length`` tokens at 3 depths into ``path`` (JSONL); returns the longest's tokens."""
    from batchmax_tp.bench.retention.suite import build_suite, token_counter
    from batchmax_tp.models import load_model

    _, tokenizer = load_model()
    samples = build_suite(token_counter(tokenizer), lengths=[length], multi=False, summaries=[], split="heldout")
    lines = [json.dumps({"id": s.id, "prompt": s.prompt, "reference": s.answers[0]}) for s in samples]
    path.write_text("\n".join(lines) + "\n")
    return max(s.prompt_tokens for s in samples)


def measure(out: Path, lengths: list[int], outputs: list[int]) -> list[dict]:
    """The CPU map: the main job per cell (a child process each, one at a time), its summaries read back."""
    from batchmax_tp.eval.results import read_summary
    from batchmax_tp.models import EMBEDDED_MODEL, load_model
    from batchmax_tp.plan.planner import ModelShape

    shape = ModelShape.from_config(load_model(EMBEDDED_MODEL)[0].config)
    cells = []
    for new in outputs:
        for length in lengths:
            data = out / "cpu" / f"needles-{length}.jsonl"
            data.parent.mkdir(parents=True, exist_ok=True)
            longest = _needles(length, data)
            for budget in regimes.BUDGETS:
                b = regimes.budget_bytes(shape, longest, new, budget, 1, "float32")
                cell_out = out / "cpu" / f"{length}-{budget}-{new}"
                if not (cell_out / "report.md").is_file():
                    args = ["--data", str(data), "--memory-budget", str(b), "--max-new-tokens", str(new)]
                    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), *args, "--out", str(cell_out)]
                    subprocess.run([*cmd, "--log-level", "WARNING"], check=True, stdout=subprocess.DEVNULL)
                runs = {}
                for summary in sorted(cell_out.glob("*/summary.json")):
                    s = read_summary(summary.parent)
                    name = regimes.run_label(s.method, s.rule)
                    ok = s.status == "done"
                    runs[name] = {
                        "batch": s.batch_size,
                        "tokens_per_s": s.tokens_per_s if ok else None,
                        "answers": s.score if ok else None,
                    }
                best, why = regimes.winner(runs)
                cells.append(
                    {"new": new, "budget": budget, "length": length, "budget_bytes": b, "runs": runs}
                    | {"winner": best, "why": why}
                )
                print(f"cpu {length:>5} tokens, {budget:>5}, {new:>3} new: {best} ({why})", flush=True)
    return cells


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    outputs = [int(x) for x in a.outputs.split(",") if x]
    result: dict = {"accuracy_line": regimes.ACCURACY_LINE, "budgets": regimes.BUDGETS}
    answers: dict[tuple[str, int], float] = {}
    if a.measure:
        cpu_lengths = [int(x) for x in a.cpu_lengths.split(",") if x]
        result["cpu"] = measure(out, cpu_lengths, [int(x) for x in a.cpu_outputs.split(",") if x])
        regimes.plot_map(
            result["cpu"], "Winner at >= 90% of FKV's answers: SmolLM2-135M, CPU (measured)", out / "regimes_cpu.png"
        )
        for cell in result["cpu"]:
            fkv = cell["runs"].get("FKV", {}).get("answers")
            for name, run in cell["runs"].items():
                if fkv and run.get("answers") is not None:  # the share of FKV's answers, at this prompt length
                    answers[name, cell["length"]] = min(answers.get((name, cell["length"]), 1.0), run["answers"] / fkv)
    for setting in regimes.SETTINGS:
        # answers: each method's least share of FKV's measured at that prompt length (FKV's own: 1)
        cells = regimes.predict_map(setting, lengths, outputs, answers)
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
