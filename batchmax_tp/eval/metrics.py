"""Task metrics: ROUGE-2 (CNN/DailyMail, NarrativeQA), GSM8K answer accuracy, exact match and "contains".

Every metric scores one output against one or more references and returns a float in [0, 1]; a run's metric
is the mean over its samples.

- ``rouge2``: ROUGE-2 F-measure of the ``rouge-score`` package, ``RougeScorer(["rouge2"], use_stemmer=True)``:
  its default tokenizer lower-cases, replaces every character other than a-z and 0-9 by a space, splits on
  whitespace, and the Porter stemmer is applied to tokens longer than 3 characters. With several references
  (NarrativeQA has two answers per question) the best F-measure counts.
- ``accuracy`` (GSM8K): 1.0 when the model's answer (:func:`gsm8k_output_answer`) equals the number after
  ``####`` in the reference (:func:`gsm8k_reference_answer`) as a number ("18", "18.00" and "$18" are equal).
- ``exact``: 1.0 when the normalised output equals a normalised reference (case-folded, punctuation removed,
  whitespace collapsed).
- ``contains``: 1.0 when a normalised reference occurs in the normalised output as whole words
  (:func:`is_correct`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from functools import lru_cache

from ..config.tasks import METRICS

__all__ = [
    "METRICS",
    "METRIC_LABELS",
    "contains",
    "exact_match",
    "gsm8k_accuracy",
    "gsm8k_output_answer",
    "gsm8k_reference_answer",
    "is_correct",
    "normalise_number",
    "normalise_text",
    "rouge2",
    "score",
]

#: How a metric is named in reports (the paper's column titles).
METRIC_LABELS = {"rouge2": "rouge-2", "accuracy": "accuracy", "exact": "exact match", "contains": "contains"}


# ---------------------------------------------------------------------- ROUGE-2
@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge2"], use_stemmer=True)


def rouge2(output: str, references: str | Sequence[str]) -> float:
    """ROUGE-2 F-measure of ``output`` against the best of ``references`` (0.0 when nothing overlaps)."""
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("rouge2 needs at least one reference")
    scorer = _rouge_scorer()
    return max(scorer.score(ref, output)["rouge2"].fmeasure for ref in refs)


# ---------------------------------------------------------------------- GSM8K
# A number: an optional minus sign (not right after a letter or digit: "10-3" holds 10 and 3), an optional
# dollar sign, then thousands groups ("1,234,567") or plain digits, an optional decimal part, and no digit
# after it; or a bare decimal part (".5").
_NUMBER = re.compile(r"(?:(?<!\w)-)?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)|\.\d+)")


def normalise_number(text: str) -> str | None:
    """Canonical form of one number: commas, dollar signs and trailing zeros dropped ("$1,200.50" -> "1200.5",
    "-3.0" -> "-3", "-0" -> "0"). None when ``text`` is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _numbers(text: str) -> list[str]:
    found = []
    for match in _NUMBER.finditer(text):
        number = normalise_number(match.group())
        if number is not None:
            found.append(number)
    return found


def gsm8k_reference_answer(reference: str) -> str | None:
    """The number after the last ``####`` of a GSM8K reference solution, normalised; None without one."""
    if "####" not in reference:
        return None
    numbers = _numbers(reference.rsplit("####", 1)[1])
    return numbers[0] if numbers else None


def gsm8k_output_answer(output: str) -> str | None:
    """The model's answer: the first number after the first ``####`` when the output has that marker (the
    few-shot solutions end with ``#### <answer>``), else the last number in the output; None without a number.
    """
    if "####" in output:
        numbers = _numbers(output.split("####", 1)[1])
        if numbers:
            return numbers[0]
    numbers = _numbers(output)
    return numbers[-1] if numbers else None


def gsm8k_accuracy(output: str, references: str | Sequence[str]) -> float:
    """1.0 when the output's answer equals a reference's ``####`` answer, else 0.0."""
    refs = [references] if isinstance(references, str) else list(references)
    answer = gsm8k_output_answer(output)
    if answer is None:
        return 0.0
    wanted = {gsm8k_reference_answer(ref) for ref in refs} - {None}
    return 1.0 if answer in wanted else 0.0


# ---------------------------------------------------------------------- text matching
_NON_WORD = re.compile(r"[\W_]+")


def normalise_text(text: str) -> str:
    """Lower case, punctuation and underscores turned into spaces, whitespace collapsed."""
    return " ".join(_NON_WORD.sub(" ", text.casefold()).split())


def is_correct(output: str, reference: str | None) -> bool | None:
    """Whether the normalised reference occurs in the normalised output as whole words; None without reference.

    Normalisation: case-folded, punctuation replaced by spaces, whitespace collapsed ("St. Ives!" -> "st ives").
    Whole words: reference "12" is not found in "125".
    """
    if reference is None:
        return None
    ref = normalise_text(reference)
    if not ref:
        raise ValueError(f"reference {reference!r} has no letters or digits")
    return f" {ref} " in f" {normalise_text(output)} "


def exact_match(output: str, references: str | Sequence[str]) -> float:
    refs = [references] if isinstance(references, str) else list(references)
    return 1.0 if normalise_text(output) in {normalise_text(ref) for ref in refs} else 0.0


def contains(output: str, references: str | Sequence[str]) -> float:
    refs = [references] if isinstance(references, str) else list(references)
    return 1.0 if any(is_correct(output, ref) for ref in refs) else 0.0


_SCORERS = {"rouge2": rouge2, "accuracy": gsm8k_accuracy, "exact": exact_match, "contains": contains}


def score(metric: str, output: str, references: str | Sequence[str] | None) -> float | None:
    """``metric``'s score of ``output`` in [0, 1]; None when there is no reference."""
    if metric not in _SCORERS:
        raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    if references is None or (not isinstance(references, str) and len(references) == 0):
        return None
    return float(_SCORERS[metric](output, references))
