"""Plain HF references for benchmarks: the simplest HF versions of the baselines, timed.

``hf_reference_generate`` runs FKV through ``model.generate`` with its default cache and ED (Algorithm 3) as a
loop over a ``DynamicCache`` cut to its newest pair: what ``bench.padded.generate`` is compared against in
``launch/bench_throughput.py`` and ``launch/bench_baselines.py``, and a test oracle (``tests/test_baseline.py``).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from ..core.method import Method, ranks_by_attention


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock(BaseStreamer):
    """Times HF generate's tokens: ``put`` gets the prompt first, then each new token."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_reference_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    method: Method,
    max_new_tokens: int,
) -> tuple[torch.Tensor, float, float]:
    """Greedy ``max_new_tokens`` (EOS ignored) by plain HF on the model's current attention, for benchmarks.

    FKV: ``model.generate`` with its default cache (``min_new_tokens`` ignores EOS). ED: a loop over a
    ``DynamicCache`` prefilled with the whole prompt and cut to its newest pair at the first step and whenever it
    holds ``kv_max`` pairs (Algorithm 3). Returns (tokens [B, T], prefill seconds, decode seconds).
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not has_hf_reference(method):
        raise ValueError(f"no plain HF reference for method {method.name!r}")
    if not method.evicts:  # the full cache: HF generate as it is
        return _full_cache(model, input_ids, attention_mask, max_new_tokens)
    return _extreme_decoding(model, input_ids, attention_mask, method.kv_max, max_new_tokens)


def has_hf_reference(method: Method) -> bool:
    """Whether plain HF runs ``method`` (:func:`hf_reference_generate`): the full cache, and ED (a cache cut to its
    newest pair); neither Batch-Max nor snap."""
    return not ranks_by_attention(method)


def _full_cache(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
) -> tuple[torch.Tensor, float, float]:
    """FKV: ``model.generate`` with its default cache, timed per token by a streamer."""
    device, T = input_ids.device, max_new_tokens
    clock = _Clock(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=T,
        min_new_tokens=T,
        do_sample=False,
        pad_token_id=0,
        streamer=clock,
    )
    _sync(device)
    t2 = time.perf_counter()
    t1 = clock.times[1] if len(clock.times) > 1 else t2
    return out[:, input_ids.shape[1] :], t1 - t0, t2 - t1


def _extreme_decoding(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, kv_max: int, max_new_tokens: int
) -> tuple[torch.Tensor, float, float]:
    """ED (Algorithm 3): the whole prompt into a ``DynamicCache``, then cut to the newest pair at the first step
    and whenever it holds ``kv_max`` pairs."""
    device, (B, s), T = input_ids.device, input_ids.shape, max_new_tokens
    padded = not bool(attention_mask.all())
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, s]
    tokens = torch.empty(B, T, dtype=torch.long, device=device)  # [B, T]
    cache = DynamicCache(config=model.config)
    _sync(device)
    t0 = time.perf_counter()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask if padded else None,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    tokens[:, 0] = out.logits[:, -1].argmax(-1)
    _sync(device)
    t1 = time.perf_counter()
    held, next_pos = s, pos[:, -1:] + 1  # [B, 1]
    for t in range(1, T):
        if t == 1 or held >= kv_max:  # keep only the newest pair
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, -1:], layer.values[:, :, -1:]  # [B, H, 1, D]
            held = 1
        out = model(
            input_ids=tokens[:, t - 1 : t],
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens[:, t] = out.logits[:, -1].argmax(-1)
        held, next_pos = held + 1, next_pos + 1
    _sync(device)
    return tokens, t1 - t0, time.perf_counter() - t1
