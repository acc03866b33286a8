"""Running the retention benchmark: one row (FKV, or BM with a rule at a kv_max) over every batch of prompts, with
its outputs, timings, peak K/V bytes and, for summaries, its agreement with FKV's tokens when fed them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...bench.padded import generate
from ...core.method import Method, is_full_cache
from ...core.rules import rule_names
from ...eval.generation import cut_at_eos, encode_prompts
from .suite import RetentionSample


@dataclass(frozen=True)
class Row:
    """One configuration: FKV (rule None) or BM with ``rule`` at ``kv_max``."""

    method: str
    rule: str | None
    kv_max: int | None
    p: int

    @property
    def evicts(self) -> bool:
        """False for the full cache: the reference every other row is scored against."""
        return not is_full_cache(self.method)

    @property
    def label(self) -> str:
        return f"{self.method}/{self.rule}@{self.kv_max}" if self.evicts else self.method


def make_method(row: Row) -> Method:
    if not row.evicts:
        return Method(row.method)
    return Method(row.method, kv_max=row.kv_max, p=row.p, rule=row.rule or "paper")


def available_rules() -> list[str]:
    return list(rule_names())


def _generate(generate_fn, model, tokenizer, ids, mask, method: Method, new: int, **kwargs):
    """Greedy ``new`` tokens, EOS ignored, with the tokenizer's EOS and pad ids."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    return generate_fn(model, ids, mask, method, new, ignore_eos=True, eos_token_id=eos, pad_token_id=pad, **kwargs)


def _forced_agreement(generate_fn, model, tokenizer, ids, mask, method, new, group, forced, first):
    """Run ``group`` again teacher-forced on ``forced``'s ids (FKV's summaries): (that run, the share of steps per
    sample id whose own next token is the forced one)."""
    want = first.tokens.new_tensor([forced[s.id] for s in group])  # [b, summary_tokens], on the run's device
    res = _generate(generate_fn, model, tokenizer, ids, mask, method, new, force_tokens=want)
    return res, {s.id: float((res.tokens[i] == want[i]).float().mean()) for i, s in enumerate(group)}


def run_row(
    model: Any,
    tokenizer: Any,
    row: Row,
    groups: Sequence[list[RetentionSample]],
    *,
    needle_tokens: int,
    summary_tokens: int,
    generate_fn: Callable[..., Any] | None = None,
    on_batch: Callable[[], None] | None = None,
    forced: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Generate every batch with one configuration: outputs per sample id, timings and the peak K/V bytes.

    ``tokens``: each summary's generated ids. With ``forced`` (FKV's summary ids per sample id), each summary
    batch runs once more teacher-forced on them: ``agreement`` per id = share of steps whose own next token is the
    forced one (that run's counts and timings are the batch's, as they always were)."""
    generate_fn = generate_fn or generate
    method = make_method(row)
    out: dict[str, Any] = {"outputs": {}, "tokens": {}, "agreement": {}}
    gen_tokens, prefill_s, decode_s, peak = 0, 0.0, 0.0, 0
    device = getattr(model, "device", None)
    for group in groups:
        summary = group[0].kind == "summary"
        new = summary_tokens if summary else needle_tokens
        ids, mask = encode_prompts(tokenizer, [s.prompt for s in group])
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        res = _generate(generate_fn, model, tokenizer, ids, mask, method, new)
        for i, s in enumerate(group):
            toks = cut_at_eos(res.tokens[i].tolist(), int(res.num_generated[i]), tokenizer.eos_token_id)
            out["outputs"][s.id] = tokenizer.decode(toks, skip_special_tokens=True)
            if s.kind == "summary":
                out["tokens"][s.id] = res.tokens[i].tolist()
        if forced is not None and summary:
            res, agreement = _forced_agreement(
                generate_fn, model, tokenizer, ids, mask, method, new, group, forced, res
            )
            out["agreement"].update(agreement)
        gen_tokens += int(res.num_generated.sum())
        prefill_s += float(res.prefill_s)
        decode_s += float(res.decode_s)
        peak = max(peak, int(res.peak_kv_bytes))
        if on_batch:
            on_batch()
    return {**out, "generated_tokens": gen_tokens, "prefill_s": prefill_s, "decode_s": decode_s, "peak_kv_bytes": peak}
