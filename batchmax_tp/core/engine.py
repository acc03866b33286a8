"""Generation with a bounded KV cache: runs the schedule (Algorithm 1 or 3) on an unchanged HF causal LM."""

from __future__ import annotations

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
from .schedule import Phase, capacity, plan
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


@torch.inference_mode()
def forward_pass(
    model: torch.nn.Module, step: ForwardPass, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor
):
    """One forward pass into ``step.cache``: ids/pos [B, n], mask [B, n] or the baselines' own; ``step``, the
    pass's description, goes to every attention call. A prefill block or decode step returns the last position's
    logits; a look-ahead probe runs through the decoder layers only (its outputs are never used: no logits)."""
    if step.kind == "probe":
        return model.get_decoder()(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=step.cache,
            use_cache=True,
            batchmax=step,
        )
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=step.cache,
        use_cache=True,
        logits_to_keep=1,
        batchmax=step,
    )


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
    fast_baselines: bool = True,
    force_tokens: torch.Tensor | None = None,
) -> GenerationOutput:
    """Generate ``max_new_tokens`` tokens for a LEFT-padded batch ``input_ids [B, s]``.

    Prefill runs in the method's blocks (BM: ``min(s, kv_max)`` then ``p`` at a time), decoding one token per
    step; before each pass the cache evicts what the schedule says. Greedy unless ``do_sample``. BM runs on the
    score-collecting "batchmax" attention; the baselines FKV and ED on the model's fastest kernel with a
    ``DenseCache`` (``core.baseline``); ``fast_baselines=False`` runs them through the "batchmax" attention
    too (the slower path they used before, kept for comparisons). ``force_tokens`` [B, >= max_new_tokens]: teacher
    forcing -- each step feeds these tokens instead of the chosen ones, while ``tokens`` still records the model's
    own choices (how often they agree with another run's output measures fidelity without compounding drift).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = input_ids.device
    B, s = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=device, dtype=torch.long)
    # One check per call (a host sync, never per step): pads must all sit on the left of each row, or the block
    # schedule and the positions below would silently treat pads as the prompt's end.
    if not bool((attention_mask[:, 1:] >= attention_mask[:, :-1]).all() and attention_mask[:, -1].all()):
        raise ValueError(
            "input_ids must be LEFT-padded (every pad before the first real token, the last position "
            "real): set tokenizer.padding_side = 'left' (batchmax_tp.eval.run.encode_prompts does)"
        )
    if force_tokens is not None and (force_tokens.shape[0] != B or force_tokens.shape[1] < max_new_tokens):
        raise ValueError(f"force_tokens must be [{B}, >= {max_new_tokens}], got {list(force_tokens.shape)}")
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=device).long().view(-1)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos.numel() else 0)

    phases = plan(method, s, max_new_tokens)
    num_layers, reserve = model.config.num_hidden_layers, capacity(method, s, max_new_tokens)
    dense = fast_baselines and method.name != "bm"
    if dense:
        impl = fastest_attention(model)
        cache = DenseCache(method, num_layers, reserve, attention_mask, impl)
        attention = use_attention(model, impl)
    else:
        cache = BatchMaxCache(method, num_layers=num_layers, reserve=reserve)
        attention = use_batchmax_attention(model)
    real_pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, s] RoPE positions (pads counted out)
    token_mask = attention_mask.bool()  # [B, s]

    warpers, gen = None, None
    if do_sample:
        warpers = sampling_warpers(temperature, top_k, top_p)
        gen = torch.Generator(device=device)
        gen.manual_seed(0 if seed is None else seed)

    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)  # [B, T]
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
    num_generated = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)  # [B]
    all_logits = [] if return_logits else None

    def emit(t: int, logits: torch.Tensor) -> torch.Tensor:
        """Record token t (0-based) from last-position logits [B, V]; returns it as the next input [B, 1]."""
        nonlocal finished
        if return_logits:
            all_logits.append(logits.float())
        tok = _next_token(logits, warpers, gen)  # [B]
        if not ignore_eos and eos.numel():
            tok = tok.masked_fill(finished, pad)
            hit = torch.isin(tok, eos) & ~finished
            num_generated.masked_fill_(hit, t + 1)
            finished = finished | hit
        tokens[:, t] = tok
        return tok[:, None] if force_tokens is None else force_tokens[:, t : t + 1].to(device)  # [B, 1]

    with attention:
        t0 = time.perf_counter()
        for phase in (ph for ph in phases if ph.kind != "decode"):
            cache.begin(phase)
            a, b = phase.start, phase.end
            ids, mask, pos = input_ids[:, a:b], token_mask[:, a:b], real_pos[:, a:b]  # [B, n]
            step = ForwardPass.static(cache, phase)
            if phase.kind == "probe":  # look-ahead probe: the prompt's last tokens as queries, never cached
                forward_pass(model, step, ids, mask, pos)
                cache.note_meta()
                continue
            out = forward_pass(model, step, ids, cache.attention_mask() if dense else mask, pos)
        if dense:
            cache.note_workspace(model.config)
        else:
            cache.end_prefill()
        next_input = emit(0, out.logits[:, -1])
        next_pos = real_pos[:, -1:] + 1  # [B, 1]
        _sync(device)
        t1 = time.perf_counter()
        for phase in (ph for ph in phases if ph.kind == "decode"):
            if not ignore_eos and phase.step % EOS_CHECK_EVERY == 0 and bool(finished.all()):
                break
            cache.begin(phase)
            # generated tokens are never pads; the baselines mask prompt pads they still hold
            out = forward_pass(
                model, ForwardPass.static(cache, phase), next_input, cache.attention_mask() if dense else None, next_pos
            )
            next_input = emit(phase.step, out.logits[:, -1])
            next_pos = next_pos + 1
        _sync(device)
        t2 = time.perf_counter()
        cache.begin(None)

    logger.debug("%s: prefill %.3fs, decode %.3fs, B=%d s=%d", method.label(), t1 - t0, t2 - t1, B, s)
    return GenerationOutput(
        tokens=tokens,
        num_generated=num_generated,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        peak_kv_bytes=cache.peak_kv_bytes,
        peak_meta_bytes=cache.peak_meta_bytes,
        peak_workspace_bytes=cache.peak_workspace_bytes,
        cache=cache,
        phases=phases,
        logits=all_logits,
    )
