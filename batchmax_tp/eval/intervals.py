"""Bootstrap intervals for a method's score as a share of FKV's, over the same documents.

A suite's score is the mean over its cells (task x length) of each cell's mean document score; a configuration's
share is its score over FKV's. The interval resamples each cell's documents with replacement (stratified, so every
resample keeps every cell) and pairs them (the same documents for both: what the method changes is measured on the
same inputs), and reads the percentiles of the resampled shares. Two shares differ for real only where their
intervals do not overlap (``separate``); the difference of two methods' shares has its own paired interval
(``difference_interval``: the same documents for both methods and FKV in each resample), much narrower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ITERS = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Share:
    """A configuration's score over FKV's on the same documents, with its bootstrap interval [low, high]."""

    value: float | None  # None where FKV scores 0
    low: float | None
    high: float | None


def suite_mean(cells: dict[str, list[float]]) -> float:
    """The mean over cells of each cell's mean document score."""
    return float(np.mean([np.mean(scores) for scores in cells.values()]))


def share_interval(
    method: dict[str, list[float]],
    fkv: dict[str, list[float]],
    iters: int = ITERS,
    level: float = LEVEL,
    seed: int = 0,
    totals: bool = False,
) -> Share:
    """``method``'s suite mean over ``fkv``'s, each a dict cell -> per-document scores (the same documents in the
    same order), and the ``level`` percentile interval of ``iters`` paired, stratified bootstrap resamples; a
    resample where FKV's mean is 0 is left out (its share is undefined). ``totals``: the statistic is the sum of
    every document's score instead (a needle set's answers found, each prompt holding its count)."""
    if method.keys() != fkv.keys() or any(len(method[c]) != len(fkv[c]) for c in fkv):
        raise ValueError("the shares pair documents: both need the same cells and documents")
    statistic = _total if totals else suite_mean
    base = statistic(fkv)
    if base == 0:
        return Share(None, None, None)
    rng = np.random.default_rng(seed)
    ours, theirs = np.zeros(iters), np.zeros(iters)
    for cell, scores in fkv.items():
        a, b = np.asarray(method[cell], dtype=float), np.asarray(scores, dtype=float)
        pick = rng.integers(0, len(b), size=(iters, len(b)))  # [iters, n]: each resample's documents
        ours += a[pick].sum(axis=1) if totals else a[pick].mean(axis=1)
        theirs += b[pick].sum(axis=1) if totals else b[pick].mean(axis=1)
    defined = theirs > 0
    shares = ours[defined] / theirs[defined]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(shares, [tail, 100 - tail])
    return Share(statistic(method) / base, float(low), float(high))


def difference_interval(
    method: dict[str, list[float]],
    other: dict[str, list[float]],
    fkv: dict[str, list[float]],
    iters: int = ITERS,
    level: float = LEVEL,
    seed: int = 0,
) -> Share:
    """``method``'s share of FKV minus ``other``'s, on the same documents (each a dict cell -> per-document scores,
    the same cells and documents in the same order), and the ``level`` percentile interval of ``iters`` paired,
    stratified bootstrap resamples: each resample draws one set of documents for all three, so what differs between
    the two methods is measured on the same inputs (two shares' own intervals overlap far more than their difference's
    does). A resample where FKV's mean is 0 is left out; FKV at 0: no difference."""
    if not (method.keys() == other.keys() == fkv.keys()) or any(
        len(method[c]) != len(fkv[c]) or len(other[c]) != len(fkv[c]) for c in fkv
    ):
        raise ValueError("the difference pairs documents: all three need the same cells and documents")
    base = suite_mean(fkv)
    if base == 0:
        return Share(None, None, None)
    rng = np.random.default_rng(seed)
    ours, theirs, fkvs = np.zeros(iters), np.zeros(iters), np.zeros(iters)
    for cell, scores in fkv.items():
        c = np.asarray(scores, dtype=float)
        pick = rng.integers(0, len(c), size=(iters, len(c)))  # [iters, n]: each resample's documents
        ours += np.asarray(method[cell], dtype=float)[pick].mean(axis=1)
        theirs += np.asarray(other[cell], dtype=float)[pick].mean(axis=1)
        fkvs += c[pick].mean(axis=1)
    defined = fkvs > 0
    diffs = (ours[defined] - theirs[defined]) / fkvs[defined]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(diffs, [tail, 100 - tail])
    return Share((suite_mean(method) - suite_mean(other)) / base, float(low), float(high))


def _total(cells: dict[str, list[float]]) -> float:
    """The sum of every document's score."""
    return float(sum(sum(scores) for scores in cells.values()))


def separate(a: Share, b: Share) -> bool:
    """Whether two shares differ beyond their intervals (neither interval reaches the other)."""
    if a.value is None or b.value is None:
        return False
    return a.high < b.low or b.high < a.low
