"""The paper's padded batch as a tensor call: ``generate`` runs a left-padded batch ``input_ids [B, s]`` on the engine
(``core.engine.Engine``) under its ``static`` policy, in B slots, and returns the batch's tokens as tensors: the
paper's procedure, and the tests' adapter to the naive reference.

Every row runs Algorithm 1 (BM) or 3 (ED) on the batch's padded prompt, at padded positions: its pads are counted
as held, never written, and go first at the first evictions, so its kept positions and tokens are those of the
paper's padded batch (``tests/reference.py`` checks them). FKV and ED keep no pad and never rank by score, so their
rows are their prompts' own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..core.engine import Engine
from ..core.method import Method
from ..core.requests import Batching, Record, Request, Sampling, ServeOutput
from ..core.schedule import Phase, plan

logger = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [B, T] generated ids; after a sample's EOS (unless ignore_eos) pad_token_id
    num_generated: torch.Tensor  # [B] tokens up to and including the first EOS, or T
    prefill_s: float
    decode_s: float
    peak_kv_bytes: int
    peak_meta_bytes: int  # the pool's per-slot bookkeeping (and probe state); 0 for the baselines
    peak_workspace_bytes: int
    phases: list[Phase]  # the padded batch's schedule, every row's
    served: ServeOutput = field(repr=False)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # per generated token, float32 [B, V]

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """Per layer, sample and local KV head: the sorted positions each row held when it ended (padded
        positions: a row with ``k`` pads holds its token ``j`` at ``k + j``)."""
        per_row = [out.kept_positions for out in self.served.outputs]  # [B][layer][head]
        return [[row[layer] for row in per_row] for layer in range(len(per_row[0]))]


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
    compile: str = "auto",
    tp_group=None,
) -> GenerationOutput:
    """Generate ``max_new_tokens`` tokens for a LEFT-padded batch ``input_ids [B, s]`` (``attention_mask`` [B, s],
    1 for real tokens; None: no pad) as the paper's padded batch, in B slots of the one engine. Greedy unless
    ``do_sample`` (row b samples from its own generator, seeded ``seed + b``). ``force_tokens`` [B, >= T]: teacher
    forcing -- each step feeds these tokens instead of the chosen ones, while ``tokens`` still records the model's
    own choices. ``compile``: how decode passes run (``Engine``); ``tp_group``: the tensor-parallel group, when there
    is one."""
    mask = _checked_mask(input_ids, attention_mask, max_new_tokens, force_tokens)
    B = input_ids.shape[0]
    lengths = mask.sum(-1).tolist()
    ids, forced = input_ids.tolist(), None if force_tokens is None else force_tokens.tolist()
    requests = [
        Request(
            ids[b][len(ids[b]) - lengths[b] :],
            max_new_tokens,
            seed=None if seed is None else seed + b,
            continuation=None if forced is None else forced[b],
        )
        for b in range(B)
    ]
    static = Batching(policy="static", pad_to=input_ids.shape[1])
    engine = Engine(model, method, B, tp_group=tp_group, compile=compile, batching=static)
    sampling = Sampling(
        eos_token_id=eos_token_id,
        ignore_eos=ignore_eos,
        pad_token_id=pad_token_id,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    served = engine.run(requests, sampling, record=Record(logits=return_logits, positions=True))
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long)  # [B, T]
    for b, out in enumerate(served.outputs):
        tokens[b, : out.num_generated] = torch.tensor(out.tokens)
    logits = None
    if return_logits:  # [T] x [B, V]; a row that ended early has zeros after its end
        vocab = served.outputs[0].logits[0].shape[-1]
        full = torch.zeros(max_new_tokens, B, vocab, device=input_ids.device)  # [T, B, V]
        for b, out in enumerate(served.outputs):
            full[: len(out.logits), b] = torch.stack(out.logits)  # [T_b, V]
        logits = list(full.unbind(0))
    logger.debug("%s: prefill %.3fs, decode %.3fs, B=%d", method.label(), served.prefill_s, served.decode_s, B)
    return GenerationOutput(
        tokens=tokens.to(input_ids.device),
        num_generated=torch.tensor([o.num_generated for o in served.outputs], device=input_ids.device),
        prefill_s=served.prefill_s,
        decode_s=served.decode_s + served.compile_s,
        peak_kv_bytes=served.peak_kv_bytes,
        peak_meta_bytes=served.peak_meta_bytes,
        peak_workspace_bytes=served.peak_workspace_bytes,
        phases=plan(method, input_ids.shape[1], max_new_tokens),
        served=served,
        logits=logits,
    )


def _checked_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int, force_tokens: torch.Tensor | None
) -> torch.Tensor:
    """The batch's [B, s] padding mask (long, on the host); ValueError for bad arguments."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    mask = mask.to(device="cpu", dtype=torch.long)
    # Pads must all sit on the left of each row, or the block schedule and the positions would silently treat pads
    # as the prompt's end.
    if not bool((mask[:, 1:] >= mask[:, :-1]).all() and mask[:, -1].all()):
        raise ValueError(
            "input_ids must be LEFT-padded (every pad before the first real token, the last position "
            "real): set tokenizer.padding_side = 'left' (batchmax_tp.eval.generation.encode_prompts does)"
        )
    if force_tokens is not None and (force_tokens.shape[0] != B or force_tokens.shape[1] < max_new_tokens):
        raise ValueError(f"force_tokens must be [{B}, >= {max_new_tokens}], got {list(force_tokens.shape)}")
    return mask
