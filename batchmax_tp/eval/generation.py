"""From samples to generated text: batches cut in sample order, prompts encoded (left-padded), one batch generated
and decoded (:func:`generate_batch`, the step every run shares) and the untimed warm-up a job makes first.

The engine's ``generate`` and :func:`encode_prompts` are looked up in this module at call time: they are the
defaults of :func:`generate_batch`, :func:`warm_up` and ``context.RunContext``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from ..core.engine import GenerationOutput, generate
from ..core.method import Method
from .tasks import Prompt, Sample, prompt_ids

if TYPE_CHECKING:  # the configuration sits above the evaluation layer; only its type is named here
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import GenerationConfig

logger = logging.getLogger(__name__)

__all__ = [
    "BatchOutput",
    "EncodeFn",
    "GenerateFn",
    "batched",
    "cut_at_eos",
    "encode_prompts",
    "fill_samples",
    "generate_batch",
    "longest_prompt",
    "special_ids",
    "warm_up",
]

T = TypeVar("T")


GenerateFn = Callable[..., GenerationOutput]
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


@dataclass
class BatchOutput:
    """One generated batch: the engine result, the decoded outputs (cut at the first EOS) and token counts."""

    result: GenerationOutput
    outputs: list[str]
    prompt_tokens: list[int]
    num_generated: list[int]
    cuda_max_memory_allocated: int | None


def special_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int | list[int] | None, int | None]:
    """(eos, pad) token ids: pad falls back to a single EOS id."""
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return eos, pad if pad is not None else eos if isinstance(eos, int) else None


def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    method: Method,
    generation: GenerationConfig,
    seed: int,
    *,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
    compile: str = "auto",
    tp_group=None,
) -> BatchOutput:
    """Encode ``prompts``, generate with the ``generation`` settings and decode: the step every run shares
    (``generate_fn``, ``encode_fn``: this module's ``generate`` and ``encode_prompts`` unless given, looked up at
    call time). ``compile`` and ``tp_group``: how decode passes run and the tensor-parallel group (``Engine``),
    as a continuous run gets them."""
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    input_ids, attention_mask = encode_fn(tokenizer, list(prompts))  # [B, s] each, left-padded
    device = getattr(model, "device", None)
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    eos_token_id, pad_token_id = special_ids(tokenizer)
    cuda = getattr(device, "type", None) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = generate_fn(
        model,
        input_ids,
        attention_mask,
        method,
        generation.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        seed=seed,
        compile=compile,
        tp_group=tp_group,
        **generation.sampling(),
    )
    cuda_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    tokens = _as_list(result.tokens)
    num_generated = [int(n) for n in _as_list(result.num_generated)]
    outputs = [
        tokenizer.decode(cut_at_eos(tokens[i], num_generated[i], eos_token_id), skip_special_tokens=True)
        for i in range(len(prompts))
    ]
    prompt_tokens = [int(n) for n in attention_mask.sum(-1).tolist()]
    return BatchOutput(result, outputs, prompt_tokens, num_generated, cuda_peak)


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    methods: Sequence[Method],
    seed: int,
    *,
    generate_fn: GenerateFn | None = None,
    encode_fn: EncodeFn | None = None,
    prompt_tokens: int = 8,
    new_tokens: int = 2,
) -> float:
    """One tiny untimed generate per method (the last ``prompt_tokens`` tokens of the first prompt,
    ``new_tokens`` new tokens), so that the first timed run does not pay one-time costs (lazy imports,
    attention registration, allocator and kernel warm-up). Returns the seconds it took.

    Every rank runs it on the same input, so tensor-parallel collectives stay in lock-step.
    """
    generate_fn, encode_fn = generate_fn or generate, encode_fn or encode_prompts
    start = time.perf_counter()
    input_ids, attention_mask = encode_fn(tokenizer, [samples[0].prompt])
    input_ids, attention_mask = input_ids[:, -prompt_tokens:], attention_mask[:, -prompt_tokens:]  # [1, <=8]
    device = getattr(model, "device", None)
    if device is not None and hasattr(input_ids, "to"):
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    eos_token_id, pad_token_id = special_ids(tokenizer)
    for method in methods:
        generate_fn(
            model,
            input_ids,
            attention_mask,
            method,
            new_tokens,
            ignore_eos=True,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            seed=seed,
        )
    elapsed = time.perf_counter() - start
    logger.info(
        "warm-up (%d methods, %d prompt tokens, %d new tokens): %.2f s",
        len(methods),
        input_ids.shape[-1],
        new_tokens,
        elapsed,
    )
    return elapsed
