"""batchmax_tp.bench.serving (launch/bench_serving.py's library): the workload's prompt lengths, the percentile
helper, row methods, and a row's run on both of the engine's policies (a tiny model)."""

from __future__ import annotations

import pytest

from batchmax_tp.bench import serving as bs


def test_target_lengths_spread_deterministic():
    lengths = bs.target_lengths(12, 256, 3584, seed=0)
    assert len(lengths) == 12 and min(lengths) == 256 and max(lengths) == 3584
    assert lengths == bs.target_lengths(12, 256, 3584, seed=0)
    assert sorted(lengths) == sorted(bs.target_lengths(12, 256, 3584, seed=1))  # the seed only shuffles
    ratios = [b / a for a, b in zip(sorted(lengths), sorted(lengths)[1:])]
    assert max(ratios) / min(ratios) < 1.05  # log-even
    assert bs.target_lengths(1, 256, 3584, seed=0) == [3584]


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bs.percentile(xs, 50) == pytest.approx(2.5)
    assert bs.percentile(xs, 0) == 1.0 and bs.percentile(xs, 100) == 4.0
    assert bs.percentile(xs, 99) == pytest.approx(3.97)
    assert bs.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        bs.percentile([], 50)


def test_rows_make_their_methods():
    for key in bs.ROWS:
        m = bs.make_method(key, 512, 64)
        assert m.name == key.split("-")[1]
    assert bs.make_method("cont-bm-question", 512, 64).rule == "question"
    assert bs.make_method("static-ed", 512, 64).kv_max == 65
    assert bs.make_method("cont-fkv-mixed", 512, 64) == bs.make_method("cont-fkv", 512, 64)


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_a_row_runs_on_the_engine_under_its_policy(policy):
    """Both kinds of row run on one ``Engine`` (static: the paper's padded batches of ``slots`` prompts in order),
    each request with its own latency and first token."""
    import torch
    from tiny import tiny_llama

    from batchmax_tp.core.method import Method

    model, method = tiny_llama(0), Method("bm", kv_max=24, p=8)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 33, 9)]
    row = bs.run_engine(model, prompts, method, 2, 5, True, None, 0, policy)
    assert row["generated"] == 15 and row["num_generated"] == [5, 5, 5] and row["peak_kv_bytes"] > 0
    assert all(0 < t <= end <= row["wall_s"] for t, end in zip(row["ttft_s"], row["latency_s"]))
    if policy == "static":  # the second batch starts once the first has ended
        assert min(row["ttft_s"][2:]) >= max(row["latency_s"][:2])
