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


def test_the_profile_gives_each_op_to_the_project_function_that_called_it():
    """``launch/profile_prefill.py``: an op's region is the innermost project function among its callers (the
    engine's pass-through ones skipped; none: the model's own code), its bytes its tensor inputs'; its flags are the
    prefill benchmark's with its own defaults."""
    from types import SimpleNamespace

    import profile_prefill

    def frame(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent)

    top = frame("launch/run.py(1): main")
    model = frame(
        "torch/nn/modules/module.py(1775): _call_impl", frame("../batchmax_tp/core/replay.py(60): forward_pass", top)
    )
    attention = frame("../batchmax_tp/core/attention.py(140): _rows_attention", model)
    pooling = frame(
        "../batchmax_tp/core/rules.py(120): pool_by_position",
        frame("../batchmax_tp/core/pool.py(530): _evict_layers", top),
    )
    assert (
        profile_prefill.region(
            frame("aten::bmm", frame("../batchmax_tp/core/attention.py(260): _rows_block", attention))
        )
        == "_rows_block"
    )
    assert profile_prefill.region(frame("aten::sub", pooling)) == "pool_by_position"
    assert profile_prefill.region(frame("aten::mm", frame("torch/nn/functional.py(1): linear", model))) == "model"
    assert (
        profile_prefill.region(frame("aten::mm", frame("<built-in method mm>", attention))) == "model"
    )  # pass-through
    assert profile_prefill.op_bytes([[2, 3, 4], [], [5], "x", None], 4) == (24 + 5) * 4
    a = profile_prefill.parse([])
    assert (a.lengths, a.rows, a.passes, a.methods) == ([1408, 6144], 4, 8, "fkv,bm,bm:rule=question")
