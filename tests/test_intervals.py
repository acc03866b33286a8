"""The bootstrap interval of a share of FKV (``eval.intervals``) against cases whose answer is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchmax_tp.eval.intervals import Share, difference_interval, separate, share_interval


def test_the_same_scores_are_a_share_of_one_with_no_width():
    cells = {"a 2k": [1.0, 0.0, 0.5], "b 2k": [0.25, 1.0]}
    assert share_interval(cells, cells) == Share(1.0, 1.0, 1.0)


def test_resamples_keep_every_cell():
    """Stratified: cell a always scores 1 for both, cell b 1 for FKV and 0 for the method, so every resample's
    share is exactly 0.5 (pooling the documents across cells would spread it)."""
    share = share_interval({"a": [1.0, 1.0, 1.0], "b": [0.0, 0.0, 0.0]}, {"a": [1.0] * 3, "b": [1.0] * 3})
    assert share == Share(0.5, 0.5, 0.5)


def test_a_proportion_matches_its_normal_interval():
    """One cell, FKV right on every document, the method on a share p of n: the percentile interval of the share is
    p +- 1.96 sqrt(p (1 - p) / n) (the normal approximation, close at n = 400)."""
    n = 400
    method = (np.random.default_rng(1).random(n) < 0.7).astype(float).tolist()
    p = sum(method) / n
    share = share_interval({"c": method}, {"c": [1.0] * n}, iters=4000)
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    assert share.value == pytest.approx(p)
    assert share.low == pytest.approx(p - half, abs=0.01) and share.high == pytest.approx(p + half, abs=0.01)


def test_fkv_at_zero_has_no_share_and_unpaired_documents_are_refused():
    assert share_interval({"c": [1.0]}, {"c": [0.0]}) == Share(None, None, None)
    with pytest.raises(ValueError, match="same cells and documents"):
        share_interval({"c": [1.0, 0.0]}, {"c": [1.0]})


def test_differences_are_real_only_when_the_intervals_separate():
    assert separate(Share(0.9, 0.85, 0.95), Share(0.7, 0.6, 0.8))
    assert not separate(Share(0.9, 0.75, 0.95), Share(0.7, 0.6, 0.8))
    assert not separate(Share(None, None, None), Share(0.7, 0.6, 0.8))


def test_totals_pool_the_documents_counts_and_resample_them_in_pairs():
    """``totals``: the share is the summed counts over FKV's (a needle set's answers found per prompt), not the mean
    of the cells' means; resampling cell a's two prompts in pairs gives 4, 5 or 6 answers against FKV's 6."""
    fkv = {"a": [1, 1], "b": [4]}
    method = {"a": [0, 1], "b": [4]}
    pooled, by_cell = share_interval(method, fkv, totals=True), share_interval(method, fkv)
    assert pooled.value == pytest.approx(5 / 6) and by_cell.value == pytest.approx(0.9)
    assert (pooled.low, pooled.high) == (pytest.approx(4 / 6), 1.0)
    same = share_interval(fkv, fkv, totals=True)
    assert (same.value, same.low, same.high) == (1.0, 1.0, 1.0)


def test_a_paired_difference_is_exact_where_the_methods_differ_by_a_constant_and_refuses_unpaired_documents():
    """The second method scores 0.5 below the first on each document of cell b and the same on cell a, FKV 1
    everywhere: every resample's difference is 0.25 of FKV's score (cell b's 0.5 over two cells); a method against
    itself differs by exactly 0; FKV at 0 gives none; unpaired documents are refused."""
    fkv = {"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0]}
    first = {"a": [1.0, 0.0, 1.0], "b": [1.0, 0.5]}
    second = {"a": [1.0, 0.0, 1.0], "b": [0.5, 0.0]}
    diff = difference_interval(first, second, fkv)
    assert (diff.value, diff.low, diff.high) == tuple(pytest.approx(0.25) for _ in range(3))
    assert difference_interval(first, first, fkv) == Share(0.0, 0.0, 0.0)
    assert difference_interval(first, second, {"a": [0.0] * 3, "b": [0.0] * 2}) == Share(None, None, None)
    with pytest.raises(ValueError, match="same cells and documents"):
        difference_interval(first, {"a": [1.0], "b": [1.0, 1.0]}, fkv)


def test_a_paired_difference_is_narrower_than_the_shares_intervals_when_the_methods_agree_on_most_documents():
    """Two methods that answer the same on 95 of 100 documents, FKV on all: their shares' intervals are each about
    +-0.09 wide and overlap, the paired difference's (5 documents apart, all one way) lies wholly above 0."""
    rng = np.random.default_rng(2)
    base = (rng.random(100) < 0.5).astype(float)
    better = base.copy()
    better[np.flatnonzero(base == 0)[:5]] = 1.0
    fkv = {"c": [1.0] * 100}
    a, b = {"c": better.tolist()}, {"c": base.tolist()}
    diff = difference_interval(a, b, fkv)
    assert diff.value == pytest.approx(0.05) and 0 < diff.low < diff.value < diff.high
    assert not separate(share_interval(a, fkv), share_interval(b, fkv))
