"""Fakes of the model stack for the job's tests: a tokenizer that decodes ids as words, an encoder that left-pads
word counts, and a generate that records its calls."""

from __future__ import annotations

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


def make_fake_generate(calls):
    def fake_generate(model, input_ids, attention_mask, method, max_new_tokens, **kw):
        calls.append({"batch": input_ids.shape[0], "method": method, "max_new_tokens": max_new_tokens, **kw})
        bsz = input_ids.shape[0]
        tokens = torch.tensor([[10 + j, 11, 2, 12][:max_new_tokens] for j in range(bsz)])
        return SimpleNamespace(
            tokens=tokens,
            num_generated=torch.full((bsz,), max_new_tokens),
            prefill_s=0.5,
            decode_s=1.5,
            peak_kv_bytes=1024 * bsz,
        )

    return fake_generate
