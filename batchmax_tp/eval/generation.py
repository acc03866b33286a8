"""From samples to token ids and back: batches cut in sample order, prompts encoded (:func:`encode_prompts`,
left-padded; ``context.RunContext``'s default encoder, looked up here at call time), outputs cut at their first EOS,
the tokenizer's special ids. The runs themselves go through the engine (``batches``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from .tasks import Prompt, Sample, prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "EncodeFn",
    "batched",
    "cut_at_eos",
    "encode_prompts",
    "fill_samples",
    "longest_prompt",
    "special_ids",
    "whole_waves",
]

T = TypeVar("T")


EncodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def batched(items: Sequence[T], batch_size: int) -> Iterator[list[T]]:
    """Consecutive batches of ``batch_size`` items in order; the last one may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(items), batch_size):
        yield list(items[start : start + batch_size])


def fill_samples(samples: Sequence[Sample], n: int) -> list[Sample]:
    """``samples`` repeated in order up to ``n`` (at least all of them); repeats get ids ``<id>~2``, ``~3``, ...
    so that every batch of the largest batch size is full."""
    out = list(samples)
    k = 0
    while len(out) < n:
        s = samples[k % len(samples)]
        out.append(dataclasses.replace(s, id=f"{s.id}~{k // len(samples) + 2}"))
        k += 1
    return out


def whole_waves(samples: Sequence[Sample], slots: int) -> list[Sample]:
    """``samples`` and then repeats of them up to a whole number of waves of ``slots`` requests, so that a run's last
    wave is as full as the others (a comparison of methods with different slot counts then does not hinge on how
    empty each one's last wave is). The repeats carry no reference: they are timed, never scored (ids ``<id>~fill1``,
    ``~fill2``, ...). They are whole passes over the samples and then ``r`` of them spread evenly (the one nearest
    the middle of each of ``r`` equal stretches of the list), so that their prompts are like the set's, not its
    first ones (a list ordered by length would otherwise fill with its shortest prompts, and a method with more
    repeats would gain)."""
    n, slots = len(samples), max(slots, 1)
    fill = -(-n // slots) * slots - n
    whole, r = divmod(fill, n)
    picks = [(c + 1, k) for c in range(whole) for k in range(n)] + [
        (whole + 1, ((2 * k + 1) * n + r) // (2 * r)) for k in range(r)
    ]
    out = list(samples)
    for cycle, k in picks:
        s = samples[k]
        out.append(dataclasses.replace(s, id=f"{s.id}~fill{cycle}", reference=None))
    return out


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    chat_template: bool = True,
    max_input_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts into LEFT-padded ``input_ids [B, s]`` and ``attention_mask [B, s]`` (s = longest).

    A prompt is a string (one user message) or a list of chat messages (``tasks.prompt_ids``). Pads use
    ``tokenizer.pad_token_id``. Prompts are never truncated here (``tasks.build_prompt`` cuts documents): if
    ``max_input_tokens`` is set and an encoded prompt is longer, ``ValueError`` names the prompt's index and
    length.
    """
    if not prompts:
        raise ValueError("encode_prompts needs at least one prompt")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no pad token; load it with batchmax_tp.models.load_model")
    if chat_template and not tokenizer.chat_template:
        raise ValueError("tokenizer has no chat template; pass chat_template=False")

    sequences: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        ids = prompt_ids(tokenizer, prompt, chat_template=chat_template)
        if max_input_tokens is not None and len(ids) > max_input_tokens:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_input_tokens={max_input_tokens}")
        sequences.append(ids)

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, s]
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, s]
    for row, ids in enumerate(sequences):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def longest_prompt(tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample]) -> int:
    """Tokens of the longest encoded prompt (chat template applied; after ``max_input_tokens`` cutting): the
    padded length of the batch that holds it, and so the prompt length every run is planned for."""
    return max(len(prompt_ids(tokenizer, s.prompt)) for s in samples)


def cut_at_eos(tokens: Sequence[int], num_generated: int, eos_token_id: int | Iterable[int] | None) -> list[int]:
    """The first ``num_generated`` tokens, cut before the first EOS token (the EOS itself is dropped)."""
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    out: list[int] = []
    for tok in list(tokens)[: int(num_generated)]:
        if int(tok) in eos:
            break
        out.append(int(tok))
    return out


def special_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int | list[int] | None, int | None]:
    """(eos, pad) token ids: pad falls back to a single EOS id."""
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return eos, pad if pad is not None else eos if isinstance(eos, int) else None
