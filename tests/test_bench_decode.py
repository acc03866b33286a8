"""launch/bench_decode.py runs end to end on a tiny architecture (it broke once unnoticed: it times the engine's
internals) and writes its JSON: the decode split and FKV's step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny import tiny_arch

SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "bench_decode.py"


def test_bench_decode_runs_on_a_tiny_architecture(tmp_path):
    out = tmp_path / "d.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--model",
        tiny_arch(tmp_path, vocab=2048),
        "--batch",
        "2",
        "--kv-max",
        "128",
        "--p",
        "16",
    ]
    cmd += ["--new", "20", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    split = data["decode_split"]
    assert split["step_ms"] > 0 and data["fkv_step_ms"] > 0 and split["attention_ms"] > 0 and split["evict_ms"] > 0
    assert data["compiled"] is None  # part 4 only with --compiled
