"""batchmax_tp.bench.throughput (launch/bench_throughput.py's library): rule parsing, row labels and the ratio /
best-rule selection (no model runs), and the script's refusal of a bad rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import tiny_arch

from batchmax_tp.bench import throughput as bt

SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "bench_throughput.py"


def _row(method, tokens_per_s, kv_max=None, rule=None, batch=4, status="ok"):
    return {
        "method": method,
        "rule": rule,
        "kv_max": kv_max,
        "batch": batch,
        "status": status,
        "tokens_per_s": tokens_per_s,
    }


ROWS = [
    _row("fkv", 10.0),
    _row("ed", 12.0, kv_max=2),
    _row("ed", 16.0, kv_max=65),  # the fastest ED row is the reference, whatever its kv_max
    _row("bm", 20.0, kv_max=512, rule="paper", batch=13),
    _row("bm", 24.0, kv_max=256, rule="paper", batch=16),
    _row("bm", 18.0, kv_max=512, rule="question", batch=11),
    _row("bm", 30.0, kv_max=256, rule="question", status="OOM"),  # not run: never the fastest
]


def test_ratios_use_each_rules_fastest_bm_and_the_fastest_ed():
    paper = bt.ratios(ROWS, "paper")
    assert paper["bm_over_ed"] == pytest.approx(24.0 / 16.0) and paper["bm_over_fkv"] == pytest.approx(2.4)
    assert (paper["rule"], paper["bm_kv_max"], paper["bm_batch"]) == ("paper", 256, 16)
    question = bt.ratios(ROWS, "question")
    assert question["bm_over_ed"] == pytest.approx(18.0 / 16.0) and question["bm_over_fkv"] == pytest.approx(1.8)
    assert (question["bm_kv_max"], question["bm_batch"]) == (512, 11)
    assert bt.ratios(ROWS, "snapkv") == {
        "rule": "snapkv",
        "bm_kv_max": None,
        "bm_batch": None,
        "bm_over_ed": None,
        "bm_over_fkv": None,
    }
    assert bt.ratios(ROWS, None)["bm_over_ed"] is None
    no_ed = [r for r in ROWS if r["method"] != "ed"]
    assert bt.ratios(no_ed, "paper")["bm_over_ed"] is None and bt.ratios(no_ed, "paper")["bm_over_fkv"] == 2.4


def test_best_rule_is_the_first_non_paper_rule():
    assert bt.best_rule(["paper", "question"]) == "question"
    assert bt.best_rule(["question:every=1", "paper", "probe"]) == "question:every=1"
    assert bt.best_rule(["paper"]) is None


def test_rules_lengths_and_labels():
    assert bt.parse_rules("paper,question") == ["paper", "question"]
    assert bt.parse_rules("paper;snapkv:window=64,kernel=5") == ["paper", "snapkv:window=64,kernel=5"]
    with pytest.raises(ValueError, match="unknown rule"):
        bt.parse_rules("paper,nope")
    with pytest.raises(ValueError, match="at least one"):
        bt.parse_rules(" , ")
    assert bt.lengths_arg("") == [] and bt.lengths_arg("512, 1024") == [512, 1024]
    assert bt.label("bm", 512, "question") == "BM (question, kv_max 512)"
    assert bt.label("ed", 2) == "ED (kv_max 2)" and bt.label("fkv", None) == "FKV"
    for rule in ("paper", "question", "sinks:recent=200"):  # the warm-up's small BM is valid for every rule
        m = bt.warm_method(rule)
        assert m.rule == rule and m.kv_max - m.p >= m.scorer.protected()


def test_bad_rules_stop_before_the_model_loads(capsys, tmp_path):
    with pytest.raises(SystemExit):
        bt.parse_args(["--rules", "paper,nope", "--device", "cpu"])
    assert "unknown rule 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bt.parse_args(["--lengths", "512,x"])
    assert "invalid literal" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bt.parse_args(["--methods", "bm,hf"])
    assert "--methods: unknown hf" in capsys.readouterr().err
    a = bt.parse_args(["--rules", "paper;question:every=1", "--lengths", "512, 1024"])
    assert a.rules == ["paper", "question:every=1"] and a.lengths == "512, 1024"  # the results' args: as given
    # the script: one line on stderr, exit 2, no model loaded and no file written
    out = tmp_path / "b.json"
    cmd = [sys.executable, str(SCRIPT), "--rules", "paper,nope", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown rule 'nope'" in proc.stderr and not out.exists(), proc.stderr


def _tiny_arch(tmp_path) -> str:
    return tiny_arch(tmp_path)


def _bench(tmp_path, budget: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "b.json"
    cmd = [sys.executable, str(SCRIPT), "--model", _tiny_arch(tmp_path), "--device", "cpu", "--dtype", "float32"]
    cmd += ["--memory-budget", budget, "--lengths", "", "--no-hf", "--new", "4", "--prompt-len", "64"]
    cmd += ["--rules", "paper", "--kv-max", "32", "--p", "16", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300), out


def test_a_budget_below_one_sample_is_a_json_of_oom_rows_and_exit_0(tmp_path):
    from batchmax_tp.models import architecture_config
    from batchmax_tp.plan.planner import ModelShape

    shape = ModelShape.from_config(architecture_config(_tiny_arch(tmp_path)))
    proc, out = _bench(tmp_path, str(4 * shape.weights_per_rank(1) + 1000))  # any sample needs more than 1000 bytes
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["status"] for r in runs] == ["OOM"] * 4 and {r["oom_cause"] for r in runs} == {"planned"}


def test_weights_beyond_the_budget_are_one_line_before_loading(tmp_path):
    proc, out = _bench(tmp_path, "1000")
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.count("\n") == 1 and "of weights, more than the budget of 1000 bytes" in proc.stderr


def test_on_a_card_the_budget_is_its_free_memory_and_no_cap_below_it():
    a = bt.parse_args(["--device", "cuda"])
    assert bt.budget_bytes(a, None, free=80 << 30) == int(bt.CARD_FRACTION * (80 << 30))
    assert bt.batch_cap(a) >= 1 << 16 and bt.batch_cap(bt.parse_args(["--device", "cpu"])) == 64
    assert bt.batch_cap(bt.parse_args(["--device", "cuda", "--max-batch", "8"])) == 8
    with pytest.raises(ValueError, match="exceeds the 11.00 GiB free on cuda"):  # a 12 GB card, a 40 GiB budget
        bt.check_fits(None, 40 << 30, a, free=11 << 30)


def test_an_out_of_memory_error_in_a_row_is_an_oom_row_and_the_next_method_runs(monkeypatch):
    """The planner under-counted on a card: that method's row says OOM (runtime) and the benchmark goes on."""
    import torch
    from tiny import tiny_random_model

    from batchmax_tp.plan.planner import ModelShape

    model = tiny_random_model("llama", seed=0)

    def timed(model, m, b, *args):
        if m.name == "ed":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB.")
        return {"batch": b, "tokens_per_s": 1.0}

    monkeypatch.setattr(bt, "timed", timed)
    a = bt.parse_args(["--device", "cpu", "--prompt-len", "64", "--new", "4", "--rules", "paper", "--kv-max", "32"])
    a.p = 16
    rows = [row for _, row in bt.run_rows(model, ModelShape.from_config(model.config), a, 64 << 20)]
    assert [(r["method"], r["status"]) for r in rows] == [("fkv", "ok"), ("ed", "OOM"), ("ed", "OOM"), ("bm", "ok")]
    assert rows[1]["oom_cause"] == "runtime" and rows[1]["batch"] > 0


def test_the_methods_come_from_their_classes_facts():
    """--methods names which methods run; each comes out as its class's facts say: FKV as it is, ED's two runs
    (kv_max 2 and 65), BM at every --kv-max with every rule, snap at every --kv-max; in the registry's order."""
    a = bt.parse_args(["--methods", "snap,bm,fkv,ed", "--kv-max", "256,512", "--rules", "paper;question"])
    got = [(m.name, m.kv_max if m.evicts else None, getattr(m, "rule", None)) for m in bt.methods(a)]
    assert got == [
        ("fkv", None, "paper"),
        ("ed", 2, "paper"),
        ("ed", 65, "paper"),
        ("bm", 256, "paper"),
        ("bm", 256, "question"),
        ("bm", 512, "paper"),
        ("bm", 512, "question"),
        ("snap", 256, "paper"),
        ("snap", 512, "paper"),
    ]
    a = bt.parse_args(["--methods", "bm", "--kv-max", "128"])
    assert [m.name for m in bt.methods(a)] == ["bm"] * len(a.rules)
