"""What the engine is asked and what it returns: a ``Request`` (a prompt's ids and how many tokens to generate), how
tokens are chosen and requests end (``Sampling``), how requests share passes (``Batching``), what each output keeps
(``Record``), and the outputs (``RequestOutput`` per request, ``ServeOutput`` per run). Plain data: the engine
(``core.engine.Engine``) runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

POLICIES = ("continuous", "static")  # ``Batching(policy=...)``: see ``core.scheduler``


@dataclass(frozen=True)
class Request:
    """One prompt (token ids, unpadded) and how many tokens to generate for it; ``seed`` for sampling.

    ``continuation``: teacher forcing, for scoring. After the prompt these tokens are fed instead of the chosen
    ones (at least ``max_new_tokens`` of them), the output's ``logprobs[t]`` is the float32 log-probability of
    ``continuation[t]`` given the prompt and ``continuation[:t]``, and ``tokens`` still records the model's own
    choices (greedy: whether the continuation is the greedy one)."""

    input_ids: Sequence[int]
    max_new_tokens: int
    seed: int | None = None
    continuation: Sequence[int] | None = None


@dataclass
class RequestOutput:
    """A request's generated ids (through its first EOS or stop when those are honoured), where and when it ran
    (seconds since the run started), and on request its logits and the positions its slot held at the end."""

    tokens: list[int]
    slot: int
    admitted_pass: int
    first_token_s: float = 0.0
    finished_s: float = 0.0
    run_prefill_s: float = 0.0  # the run's prefill and decode seconds so far when this request ended
    run_decode_s: float = 0.0
    kv_bytes: int = 0  # the pool's K/V bytes when it ended (constant for BM and FKV)
    workspace_bytes: int = 0  # the largest attention workspace of the run so far when it ended
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # per token, float32 [V]
    kept_positions: list[list[list[int]]] | None = field(default=None, repr=False)  # per layer, local KV head
    logprobs: list[float] | None = None  # with a ``continuation``: each of its tokens' log-probability

    @property
    def num_generated(self) -> int:
        return len(self.tokens)


@dataclass
class ServeOutput:
    outputs: list[RequestOutput]  # in request order
    admissions: list[tuple[int, int, int]]  # (pass, slot, request), in admission order
    passes: int
    prefill_s: float
    decode_s: float
    peak_kv_bytes: int
    kv_bytes_range: tuple[int, int]  # smallest and largest K/V bytes held after any pass
    peak_meta_bytes: int
    peak_workspace_bytes: int
    compile_s: float = 0.0  # the first decode pass when compiled or captured (compilation or capture and one pass)
    tier_bytes: int = (
        0  # ``question:recall=tier|window``: the most one request's recall tier held (slower memory: disk/host)
    )

    @property
    def generated_tokens(self) -> int:
        return sum(o.num_generated for o in self.outputs)


@dataclass(frozen=True)
class Sampling:
    """How each request's tokens are chosen and when it ends: greedy unless ``do_sample`` (each request samples from
    its own generator, seeded with its ``seed``, warped by ``temperature``, ``top_k`` and ``top_p``). A request ends at
    its ``max_new_tokens``, at an ``eos_token_id`` unless ``ignore_eos``, or when ``stop(i, tokens)`` says so (stop
    strings). ``pad_token_id``: the input of a row with nothing to feed (None: the smallest EOS id, else 0)."""

    eos_token_id: int | Sequence[int] | None = None
    ignore_eos: bool = False
    pad_token_id: int | None = None
    stop: Callable[[int, list[int]], bool] | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def eos(self) -> set[int]:
        """The token ids that end a request (none when ``ignore_eos``)."""
        if self.ignore_eos or self.eos_token_id is None:
            return set()
        return set([self.eos_token_id] if isinstance(self.eos_token_id, int) else self.eos_token_id)

    def pad(self) -> int:
        eos = self.eos()
        return self.pad_token_id if self.pad_token_id is not None else (min(eos) if eos else 0)

    def warpers(self) -> LogitsProcessorList | None:
        return sampling_warpers(self.temperature, self.top_k, self.top_p) if self.do_sample else None


@dataclass(frozen=True)
class Batching:
    """How requests share the passes. ``policy``: ``"continuous"`` refills a slot as soon as it frees; ``"static"``
    runs the paper's padded batches (``core.scheduler``), left-padded to their longest prompt or to ``pad_to``
    tokens. ``prefill_budget``: prompt tokens prefilled between two decode steps (None: a new request is prefilled
    whole first). ``pass_tokens``: BM's most prompt tokens (rows x columns) in one prefill pass (None:
    ``Method.pass_tokens(slots)``, every row's next chunk; the planner counts what is given:
    ``predict_pool(pass_tokens=...)``). ``share_prompts``: adjacent requests with identical prompts admitted
    together prefill once, on one row copied into the others (the choices of a multiple-choice question).
    ``mixed``: under the continuous policy, FKV's prefill passes (in chunks) take every decoding row's next step
    along, one model call for both (vLLM's chunked prefill; ``dense.DensePool.mixed_pass``); False (the default, the
    faster on a CPU: 0.97x its tokens/s mixed, docs/performance.md): a prefill pass and a decode step are two
    calls."""

    policy: str = "continuous"
    prefill_budget: int | None = None
    pass_tokens: int | None = None
    share_prompts: bool = False
    pad_to: int = 0
    mixed: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class Record:
    """What each output keeps beyond its tokens: ``logits`` (per token, float32 [V]) and ``positions`` (the
    positions its slot held when it ended, per layer and local KV head)."""

    logits: bool = False
    positions: bool = False


def check_requests(requests: Sequence[Request], slots: int, context: int | None) -> None:
    """One ``ValueError`` line for input the engine cannot run: no slot, an empty prompt, ``max_new_tokens`` < 1, or
    a prompt whose positions would run past the model's context."""
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    for i, r in enumerate(requests):
        n = len(r.input_ids)
        if n < 1:
            raise ValueError(f"request {i}: the prompt is empty")
        if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
            raise ValueError(f"request {i}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
        if context is not None and n + r.max_new_tokens - 1 > context:
            raise ValueError(
                f"request {i}: a {n}-token prompt + {r.max_new_tokens} new tokens run past the model's "
                f"context of {context} positions"
            )
        if r.continuation is not None and len(r.continuation) < r.max_new_tokens:
            raise ValueError(
                f"request {i}: a continuation of {len(r.continuation)} tokens cannot be scored over "
                f"{r.max_new_tokens} new tokens"
            )


def sampling_warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """Temperature, top-k and top-p warping, each only where it changes anything."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers
