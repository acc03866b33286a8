"""The entry for users: prompts in, one output per prompt out, on the one engine in the memory FKV would need.

    from batchmax_tp import Method, run_prompts

    outs = run_prompts(model, ["Question one?", "Question two?"], Method("bm", kv_max=512), 64, tokenizer=tok)
    outs[0].tokens, outs[0].text

``run_prompts`` serves the prompts (token-id lists, or strings with ``tokenizer``) continuously
(``core.engine.Engine``) in as many slots as fit one memory budget: by default what FKV needs for
``plan.budget.STORY_FKV_BATCH`` (4) of these prompts, the comparison the project makes (``memory_budget``: bytes per
rank instead; ``slots``: a number of slots instead). ``sampling``, ``batching``, ``record`` and ``compile`` pass
through to the engine (``core.requests``' ``Sampling``, ``Batching`` and ``Record``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .core.engine import Engine
from .core.method import Method
from .core.requests import Batching, Record, Request, RequestOutput, Sampling
from .plan.budget import fkv_budget
from .plan.planner import ModelShape, max_slots

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class PromptOutput:
    """One prompt's result: the engine's output (``output.tokens``, timings, logits on request) and, with a
    tokenizer, its text (special tokens dropped)."""

    output: RequestOutput
    text: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.output.tokens


def same_memory_slots(
    model: torch.nn.Module, method: Method, prompt_len: int, max_new_tokens: int, memory_budget: int | None = None
) -> int:
    """The slots of ``method`` that fit ``memory_budget`` bytes (None: FKV's peak at ``STORY_FKV_BATCH`` prompts of
    ``prompt_len`` tokens), for the model's shapes and dtype, in one process; at least 1."""
    shape = ModelShape.from_config(model.config)
    dtype = _DTYPES.get(next(model.parameters()).dtype, "float32")
    if memory_budget is None:
        memory_budget = fkv_budget(shape, prompt_len, max_new_tokens, dtype=dtype)
    return max(1, max_slots(memory_budget, shape, method, prompt_len, max_new_tokens, dtype=dtype))


def run_prompts(
    model: torch.nn.Module,
    prompts: Sequence[str | Sequence[int]],
    method: Method,
    max_new_tokens: int,
    *,
    tokenizer=None,
    slots: int | None = None,
    memory_budget: int | None = None,
    sampling: Sampling | None = None,
    batching: Batching = Batching(),
    record: Record = Record(),
    compile: str = "auto",
) -> list[PromptOutput]:
    """Generate ``max_new_tokens`` for each prompt (at most; EOS ends one unless ``Sampling(ignore_eos=True)``), in
    order. Strings are encoded with ``tokenizer`` (its special tokens added, as the model expects). ``slots`` None:
    as many as fit the same memory (``same_memory_slots``), at most the prompts. ``sampling`` (None: greedy) gets
    the tokenizer's EOS and pad ids where it gives none; ``batching``, ``record`` and ``compile``: the engine's
    (``Engine``, ``Engine.run``)."""
    if not prompts:
        return []
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text: pass tokenizer= to encode it (or give token ids)")
            prompt = tokenizer(prompt)["input_ids"]
        ids.append(list(prompt))
    if slots is None:
        longest = max(len(p) for p in ids)
        slots = min(len(ids), same_memory_slots(model, method, longest, max_new_tokens, memory_budget))
    sampling = Sampling() if sampling is None else sampling
    if tokenizer is not None:
        eos = tokenizer.eos_token_id if sampling.eos_token_id is None else sampling.eos_token_id
        pad = tokenizer.pad_token_id if sampling.pad_token_id is None else sampling.pad_token_id
        sampling = replace(sampling, eos_token_id=eos, pad_token_id=pad)
    engine = Engine(model, method, slots, compile=compile, batching=batching)
    served = engine.run([Request(p, max_new_tokens) for p in ids], sampling, record=record)
    texts = [None] * len(ids)
    if tokenizer is not None:
        texts = [tokenizer.decode(out.tokens, skip_special_tokens=True) for out in served.outputs]
    return [PromptOutput(out, text) for out, text in zip(served.outputs, texts)]
