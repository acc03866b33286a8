"""``launch/bench_prefill.py``'s own logic (its timings are measured, never asserted): the method specs it parses
and the table it writes."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "launch"))

import bench_prefill  # noqa: E402

from batchmax_tp.core.method import Method  # noqa: E402


def test_method_specs_default_to_kv_max_512():
    assert bench_prefill.method_of("fkv") == Method("fkv")
    assert bench_prefill.method_of("bm") == Method("bm", kv_max=512)
    assert bench_prefill.method_of("bm:rule=question") == Method("bm", kv_max=512, rule="question")
    assert bench_prefill.method_of("snap:kv_max=256;window=16") == Method("snap", kv_max=256, window=16)


def test_table_gives_each_methods_ratio_to_fkv_and_its_growth_with_length():
    methods = {s: bench_prefill.method_of(s) for s in ("fkv", "bm")}
    result = {
        "lengths": {
            1024: {"fkv": dict(ms_per_token=2.0, flop_ratio=1.0), "bm": dict(ms_per_token=2.2, flop_ratio=0.97)},
            8192: {"fkv": dict(ms_per_token=4.0, flop_ratio=1.0), "bm": dict(ms_per_token=2.0, flop_ratio=0.55)},
        }
    }
    lines = bench_prefill.table(result, methods).splitlines()
    assert "| 1024 | BM | 2.200 | 1.10x | 0.97x |" in lines
    assert "| 8192 | BM | 2.000 | 0.50x | 0.55x |" in lines
    assert lines[-1] == "cost per token at 8192 over 1024: FKV 2.00x, BM 0.91x"
