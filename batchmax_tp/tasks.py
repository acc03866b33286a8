"""Task data: JSONL samples, the bundled long-document QA fixture, prompt encoding and correctness.

JSONL format, one object per line: ``{"id": ..., "prompt": ..., "reference": ...}``. ``id`` (int or str,
stored as str) and ``prompt`` (non-empty str) are required; ``reference`` (str, or int/float stored as str)
is optional; other keys (e.g. the fixture's ``answer_location``) are ignored. Blank lines are skipped.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sample:
    id: str
    prompt: str
    reference: str | None = None


def default_fixture_path() -> Path:
    """The bundled fixture: 6 long documents (1-2k tokens) each ending with a short-answer question."""
    return Path(__file__).resolve().parent / "fixtures" / "long_qa.jsonl"


def load_jsonl(path: str | os.PathLike[str]) -> list[Sample]:
    """Read samples from a JSONL file.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError("FILE:LINE: ...")`` for a malformed line,
    a missing/invalid field or a duplicate id; ``ValueError`` also for a file without samples.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file not found: {path}")
    samples: list[Sample] = []
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            sample = _parse_line(line, where)
            if sample.id in first_line:
                raise ValueError(f"{where}: duplicate id {sample.id!r} (first on line {first_line[sample.id]})")
            first_line[sample.id] = lineno
            samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no samples (empty file)")
    return samples


def _parse_line(line: str, where: str) -> Sample:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")

    if "id" not in record:
        raise ValueError(f"{where}: missing 'id'")
    raw_id = record["id"]
    if isinstance(raw_id, bool) or not isinstance(raw_id, (int, str)) or str(raw_id) == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {raw_id!r}")

    prompt = record.get("prompt")
    if "prompt" not in record:
        raise ValueError(f"{where}: missing 'prompt'")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")

    reference = record.get("reference")
    if reference is not None:
        if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
            raise ValueError(f"{where}: 'reference' must be a string, got {type(reference).__name__}")
        reference = str(reference)
        if not _normalise(reference):
            raise ValueError(f"{where}: 'reference' has no letters or digits")
    return Sample(id=str(raw_id), prompt=prompt, reference=reference)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    chat_template: bool = True,
    max_input_tokens: int | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Tokenize prompts into LEFT-padded ``input_ids [B, s]`` and ``attention_mask [B, s]`` (s = longest).

    With ``chat_template`` each prompt becomes one user message rendered by the tokenizer's chat template with
    ``add_generation_prompt=True`` (the template supplies the special tokens, so none are added on top);
    without it the raw text is tokenized with the tokenizer's default special tokens. Pads use
    ``tokenizer.pad_token_id``. Prompts are never truncated: if ``max_input_tokens`` is set and an encoded
    prompt is longer, ``ValueError`` names the prompt's index and length.
    """
    if not prompts:
        raise ValueError("encode_prompts needs at least one prompt")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no pad token; load it with batchmax_tp.models.load_model")
    if chat_template and not tokenizer.chat_template:
        raise ValueError("tokenizer has no chat template; pass chat_template=False")

    sequences: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        if max_input_tokens is not None and len(ids) > max_input_tokens:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens, more than max_input_tokens={max_input_tokens}"
            )
        sequences.append(list(ids))

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


_NON_WORD = re.compile(r"[\W_]+")


def _normalise(text: str) -> str:
    """Lower case, punctuation and underscores turned into spaces, whitespace collapsed."""
    return " ".join(_NON_WORD.sub(" ", text.casefold()).split())


def is_correct(output: str, reference: str | None) -> bool | None:
    """Whether the normalised reference occurs in the normalised output as whole words; None without reference.

    Normalisation: case-folded, punctuation replaced by spaces, whitespace collapsed ("St. Ives!" -> "st ives").
    Whole words: reference "12" is not found in "125".
    """
    if reference is None:
        return None
    ref = _normalise(reference)
    if not ref:
        raise ValueError(f"reference {reference!r} has no letters or digits")
    return f" {ref} " in f" {_normalise(output)} "
