"""Fakes of the model stack for the job's tests: a tokenizer that decodes ids as words, an encoder that left-pads
word counts, and an engine that records its runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch


class FakeTokenizer:
    eos_token_id = 2
    pad_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def fake_encode(tokenizer, prompts, chat_template=True):
    lengths = [len(p.split()) for p in prompts]
    width = max(lengths)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return torch.full((len(prompts), width), 3) * mask + 2 * (1 - mask), mask


def make_fake_engine(calls, tokens=None, prefill_s=0.5, decode_s=1.5, kv_bytes=1024):
    """A stand-in for ``core.engine.Engine``: each run records one call (its requests as a batch, the method, the
    first request's seed and new tokens, the sampling, ``compile`` and the tensor-parallel group), and gives request
    ``j`` the tokens ``tokens(j)`` (default ``[10 + j, 11, 2, 12]``; 2 is the EOS), cut to its new tokens, the
    run ``prefill_s`` and ``decode_s`` seconds and ``kv_bytes`` of K/V per request."""
    tokens = tokens or (lambda j: [10 + j, 11, 2, 12])

    @dataclass(frozen=True)
    class FakeEngine:
        model: object
        method: object
        slots: int
        tp_group: object = None
        compile: str = "auto"
        batching: object = None

        def run(self, requests, sampling, on_finish=None, record=None):
            new = requests[0].max_new_tokens
            calls.append(
                {
                    "batch": len(requests),
                    "method": self.method,
                    "max_new_tokens": new,
                    "seed": requests[0].seed,
                    "compile": self.compile,
                    "tp_group": self.tp_group,
                    **dataclasses.asdict(sampling),
                }
            )
            n = len(requests)
            outputs = [SimpleNamespace(tokens=tokens(j)[:new], num_generated=new) for j in range(n)]
            measured = dict(prefill_s=prefill_s, decode_s=decode_s, compile_s=0.0, peak_workspace_bytes=0)
            return SimpleNamespace(outputs=outputs, peak_kv_bytes=kv_bytes * n, **measured)

    return FakeEngine


@dataclass(frozen=True)
class _Counted:
    engine: object
    on_run: object

    def run(self, requests, *args, **kwargs):
        self.on_run(self.engine, requests)
        return self.engine.run(requests, *args, **kwargs)


def counting_engine(on_run):
    """A factory like ``core.engine.Engine`` (``RunContext.engine_fn``, or ``eval.context.Engine`` patched) whose
    runs call ``on_run(engine, requests)`` first (which may record them, or raise), then run on the real engine."""
    from batchmax_tp.core.engine import Engine

    return lambda *args, **kwargs: _Counted(Engine(*args, **kwargs), on_run)
