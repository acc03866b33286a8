"""Scoring of the RULER-style tasks (``process_results: !function ruler_utils.process_results``)."""

from __future__ import annotations


def string_match_all(prediction: str, expected: list[str]) -> float:
    """RULER's ``string_match_all`` for one output: the share of ``expected`` strings found in ``prediction``
    (case-insensitive substrings), in [0, 1]."""
    text = prediction.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's per-document metric: ``results[0]`` (the generated text) against ``doc["outputs"]``."""
    return {"string_match_all": string_match_all(results[0], doc["outputs"])}
