"""Generation with a bounded KV cache: runs the schedule (Algorithm 1 or 3) on an unchanged HF causal LM."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .attention import use_batchmax_attention
from .baseline import DenseCache, fastest_attention, use_attention
from .cache import BatchMaxCache
from .method import Method
from .schedule import Phase, plan
from .step import ForwardPass

logger = logging.getLogger(__name__)

# Without ignore_eos, check for "every sample finished" only this often: each check is a host sync.
EOS_CHECK_EVERY = 16


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [B, T] generated ids; after a sample's EOS (unless ignore_eos) pad_token_id
    num_generated: torch.Tensor  # [B] tokens up to and including the first EOS, or T
    prefill_s: float
    decode_s: float
    peak_kv_bytes: int
    peak_meta_bytes: int  # largest per-slot bookkeeping (and probe state) held at once; 0 for the baselines' cache
    peak_workspace_bytes: int
    cache: BatchMaxCache | DenseCache
    phases: list[Phase]
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # per generated token, float32 [B, V]

    @classmethod
    def of(cls, sampler: Sampler, cache, phases: list[Phase], prefill_s: float, decode_s: float) -> GenerationOutput:
        """A finished run's output: the sampler's tokens and logits, the cache's peaks."""
        return cls(
            tokens=sampler.tokens,
            num_generated=sampler.num_generated,
            prefill_s=prefill_s,
            decode_s=decode_s,
            peak_kv_bytes=cache.peak_kv_bytes,
            peak_meta_bytes=cache.peak_meta_bytes,
            peak_workspace_bytes=cache.peak_workspace_bytes,
            cache=cache,
            phases=phases,
            logits=sampler.logits,
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _next_token(logits: torch.Tensor, warpers: LogitsProcessorList | None, gen: torch.Generator | None):
    """logits [B, V] -> [B] greedy, or sampled after temperature/top-k/top-p warping."""
    if warpers is None:
        return logits.argmax(dim=-1)
    scores = warpers(None, logits.float())
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen).squeeze(1)


@torch.no_grad()
def forward_pass(
    model: torch.nn.Module, step: ForwardPass, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor
):
    """One forward pass into ``step.cache``: ids/pos [B, n], mask [B, n] or the baselines' own; ``step``, the
    pass's description, goes to every attention call (a pool pass has no cache: its attention writes the pool). A
    prefill block or decode step returns the last position's logits; a look-ahead probe runs through the decoder
    layers only (its outputs are never used: no logits)."""
    kw = dict(attention_mask=mask, position_ids=pos, past_key_values=step.cache, use_cache=step.cache is not None)
    if step.kind == "probe":
        return model.get_decoder()(input_ids=ids, batchmax=step, **kw)
    return model(input_ids=ids, logits_to_keep=1, batchmax=step, **kw)


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    method: Method,
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    return_logits: bool = False,
    force_tokens: torch.Tensor | None = None,
) -> GenerationOutput:
    """Generate ``max_new_tokens`` tokens for a LEFT-padded batch ``input_ids [B, s]``.

    Prefill runs in the method's blocks (BM: ``min(s, kv_max)`` then ``p`` at a time), decoding one token per
    step; before each pass the cache evicts what the schedule says. Greedy unless ``do_sample``. BM runs on the
    score-collecting "batchmax" attention; the baselines FKV and ED on the model's fastest kernel with a
    ``DenseCache`` (``core.baseline``). ``force_tokens`` [B, >= max_new_tokens]: teacher forcing -- each step feeds
    these tokens instead of the chosen ones, while ``tokens`` still records the model's own choices (how often they
    agree with another run's output measures fidelity without compounding drift).
    """
    attention_mask = _checked_mask(input_ids, attention_mask, max_new_tokens, force_tokens)
    B, s = input_ids.shape
    phases = plan(method, s, max_new_tokens)
    cache, attention = setup_cache(model, method, attention_mask, max_new_tokens)
    sampler = Sampler.start(
        B, max_new_tokens, input_ids.device, eos_token_id, pad_token_id, ignore_eos, return_logits, force_tokens
    )
    if do_sample:
        sampler.sample(temperature, top_k, top_p, seed)
    real_pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, s] RoPE positions (pads counted out)
    with attention:
        t0 = time.perf_counter()
        logits = prefill(model, cache, phases, input_ids, attention_mask.bool(), real_pos)  # [B, V]
        next_input = sampler.emit(0, logits)  # [B, 1]
        next_pos = real_pos[:, -1:] + 1  # [B, 1]
        _sync(input_ids.device)
        t1 = time.perf_counter()
        decode(model, cache, phases, sampler, next_input, next_pos)
        _sync(input_ids.device)
        t2 = time.perf_counter()
        cache.begin(None)

    logger.debug("%s: prefill %.3fs, decode %.3fs, B=%d s=%d", method.label(), t1 - t0, t2 - t1, B, s)
    return GenerationOutput.of(sampler, cache, phases, t1 - t0, t2 - t1)


def _checked_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int, force_tokens: torch.Tensor | None
) -> torch.Tensor:
    """The batch's [B, s] padding mask (long, on the ids' device); ValueError for bad arguments."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    # One check per call (a host sync, never per step): pads must all sit on the left of each row, or the block
    # schedule and the positions would silently treat pads as the prompt's end.
    if not bool((attention_mask[:, 1:] >= attention_mask[:, :-1]).all() and attention_mask[:, -1].all()):
        raise ValueError(
            "input_ids must be LEFT-padded (every pad before the first real token, the last position "
            "real): set tokenizer.padding_side = 'left' (batchmax_tp.eval.generation.encode_prompts does)"
        )
    if force_tokens is not None and (force_tokens.shape[0] != B or force_tokens.shape[1] < max_new_tokens):
        raise ValueError(f"force_tokens must be [{B}, >= {max_new_tokens}], got {list(force_tokens.shape)}")
    return attention_mask


def setup_cache(
    model: torch.nn.Module, method: Method, attention_mask: torch.Tensor, max_new_tokens: int
) -> tuple[BatchMaxCache | DenseCache, contextlib.AbstractContextManager]:
    """The method's cache and the attention the model runs with: BM's score-collecting "batchmax" attention on a
    ``BatchMaxCache``; a method that reads no scores (FKV, ED) the model's fastest kernel on a ``DenseCache``."""
    num_layers, s = model.config.num_hidden_layers, attention_mask.shape[1]
    reserve = method.capacity(s, max_new_tokens)
    if method.reads_scores:
        return BatchMaxCache(method, num_layers=num_layers, reserve=reserve), use_batchmax_attention(model)
    impl = fastest_attention(model, padded_fkv=not method.evicts and not bool(attention_mask.all()))
    return DenseCache(method, num_layers, reserve, attention_mask, impl), use_attention(model, impl)


def _pass_mask(cache: BatchMaxCache | DenseCache, token_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask a pass hands the model: the baselines' cache builds its own (None once no pad is held); BM's
    attention takes the block's padding mask [B, n] (None in a decode step: generated tokens are never pads)."""
    return cache.attention_mask() if isinstance(cache, DenseCache) else token_mask


def prefill(
    model: torch.nn.Module,
    cache: BatchMaxCache | DenseCache,
    phases: list[Phase],
    input_ids: torch.Tensor,
    token_mask: torch.Tensor,
    real_pos: torch.Tensor,
) -> torch.Tensor:
    """The prompt's prefill blocks and look-ahead probes (ids, token_mask, real_pos [B, s]); returns the last
    position's logits [B, V]."""
    for phase in (ph for ph in phases if ph.kind != "decode"):
        cache.begin(phase)
        a, b = phase.start, phase.end
        ids, mask, pos = input_ids[:, a:b], token_mask[:, a:b], real_pos[:, a:b]  # [B, n]
        step = ForwardPass.static(cache, phase)
        if phase.kind == "probe":  # look-ahead probe: the prompt's last tokens as queries, never cached
            forward_pass(model, step, ids, mask, pos)
            cache.note_meta()
            continue
        out = forward_pass(model, step, ids, _pass_mask(cache, mask), pos)
    if isinstance(cache, DenseCache):
        cache.note_workspace(model.config)
    else:
        cache.end_prefill()
    return out.logits[:, -1]


def decode(
    model: torch.nn.Module,
    cache: BatchMaxCache | DenseCache,
    phases: list[Phase],
    sampler: Sampler,
    next_input: torch.Tensor,
    next_pos: torch.Tensor,
) -> None:
    """The decode steps: one token per pass from ``next_input``/``next_pos`` [B, 1] until the schedule ends (or,
    checked every ``EOS_CHECK_EVERY`` steps, every sample has finished)."""
    for phase in (ph for ph in phases if ph.kind == "decode"):
        if sampler.stops_at(phase.step):
            break
        cache.begin(phase)
        step = ForwardPass.static(cache, phase)
        out = forward_pass(model, step, next_input, _pass_mask(cache, None), next_pos)
        next_input = sampler.emit(phase.step, out.logits[:, -1])  # [B, 1]
        next_pos = next_pos + 1


@dataclass
class Sampler:
    """The emit step: chooses each token from last-position logits (greedy or warped sampling), records it and the
    samples' EOS, and returns the next input (the chosen token, or the forced one)."""

    tokens: torch.Tensor  # [B, T], pad after a sample's EOS
    num_generated: torch.Tensor  # [B]
    finished: torch.Tensor  # [B] bool
    eos: torch.Tensor  # [E] EOS ids (empty: none)
    pad: int
    ignore_eos: bool
    logits: list[torch.Tensor] | None  # per token, float32 [B, V], when asked for
    force_tokens: torch.Tensor | None
    warpers: LogitsProcessorList | None = None
    gen: torch.Generator | None = None

    @classmethod
    def start(cls, B, T, device, eos_token_id, pad_token_id, ignore_eos, return_logits, force_tokens) -> Sampler:
        eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=device).long().view(-1)
        pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos.numel() else 0)
        return cls(
            tokens=torch.full((B, T), pad, dtype=torch.long, device=device),  # [B, T]
            num_generated=torch.full((B,), T, dtype=torch.long, device=device),  # [B]
            finished=torch.zeros(B, dtype=torch.bool, device=device),  # [B]
            eos=eos,
            pad=pad,
            ignore_eos=ignore_eos,
            logits=[] if return_logits else None,
            force_tokens=force_tokens,
        )

    def sample(self, temperature: float, top_k: int, top_p: float, seed: int | None) -> None:
        """Sample (after temperature/top-k/top-p warping) instead of the greedy choice, seeded."""
        self.warpers = sampling_warpers(temperature, top_k, top_p)
        self.gen = torch.Generator(device=self.tokens.device)
        self.gen.manual_seed(0 if seed is None else seed)

    def stops_at(self, step: int) -> bool:
        """Whether every sample has finished; checked (a host sync) only every ``EOS_CHECK_EVERY`` steps."""
        return not self.ignore_eos and step % EOS_CHECK_EVERY == 0 and bool(self.finished.all())

    def emit(self, t: int, logits: torch.Tensor) -> torch.Tensor:
        """Record token t (0-based) from last-position logits [B, V]; returns it as the next input [B, 1]."""
        if self.logits is not None:
            self.logits.append(logits.float())
        tok = _next_token(logits, self.warpers, self.gen)  # [B]
        if not self.ignore_eos and self.eos.numel():
            tok = tok.masked_fill(self.finished, self.pad)
            hit = torch.isin(tok, self.eos) & ~self.finished
            self.num_generated.masked_fill_(hit, t + 1)
            self.finished = self.finished | hit
        self.tokens[:, t] = tok
        if self.force_tokens is None:
            return tok[:, None]  # [B, 1]
        return self.force_tokens[:, t : t + 1].to(self.tokens.device)  # [B, 1]
