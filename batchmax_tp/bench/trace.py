"""What a bounded cache keeps of one prompt, and when it lets go of the pairs its answer needs (issue 68).

``trace_request`` serves one request alone (one slot) and logs every eviction its pool makes: per (layer, KV head),
the position reached (``curr_id``), the ranks and priorities of the slots it held then, and which went. The log keeps
the *watched* positions' fate (the tokens of the facts the answer needs: ``fact_spans``) and, for every eviction, the
highest priority it freed (the bar a slot had to clear). From the log and the slot's final positions it rebuilds the
pairs held when the prompt's prefill ended (decode evictions only remove pairs; decode writes only add positions past
the prompt). Every method whose pool is a ``BoundedPool`` is traced alike (BM under any rule, ``snap``: its compress
pass fills the slot, so only its decode evictions are logged).

The log is taken by wrapping ``BoundedPool._evict_layers`` and ``bounded.free_slots`` for the run's duration
(``watching``): a diagnostic, not a hook on the hot path; ``tests/test_trace.py`` holds the rebuilt final positions to
the engine's own ``kept_positions``, so a change to how the pool evicts that the wrapper does not see fails there.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..core import bounded
from ..core.engine import Engine
from ..core.method import Method
from ..core.requests import Record, Request, Sampling
from .peers import cut_at

#: The facts of a RULER-style document, as its builder states them (``configs/lm_eval/ruler/build.py``): a needle
#: ("... magic numbers for KEY is: VALUE.") or a link of the variable chain ("VAR X = VAR Y." / "VAR X = 12345.").
FACT = {
    "niah": re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\."),
    "vt": re.compile(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d{5})\."),
}


def fact_spans(task: str, text: str, offsets: Sequence[tuple[int, int]]) -> list[dict]:
    """The facts of a RULER-style document of ``task`` in ``text``: one ``{"fact", "chars", "positions"}`` per fact in
    text order, ``positions`` the tokens (``offsets``: each token's character span, as the tokenizer gives it) that
    overlap the fact's characters."""
    pattern = FACT["vt" if task == "vt" else "niah"]
    out = []
    for m in pattern.finditer(text):
        a, b = m.span()
        positions = [i for i, (s, e) in enumerate(offsets) if s < b and e > a and e > s]
        out.append({"fact": m.group(0), "chars": [a, b], "positions": positions})
    return out


@dataclass
class EvictionLog:
    """The evictions of one request's slot (row 0): ``events``, one per (eviction, layer, KV head) where a watched
    position was held: ``(layer, kv_head, curr_id, position, priority, rank, evicted, bar)``, ``rank`` the share of the
    held slots ranked below it (0: the first to go), ``bar`` the highest priority the eviction freed; ``evicted``: per
    (layer, kv_head) the positions every eviction freed, with the ``curr_id`` it freed them at (decode evictions
    too)."""

    watched: torch.Tensor  # int64 [W], sorted
    events: list[tuple] = field(default_factory=list)
    evicted: dict[tuple[int, int], list[tuple[int, list[int]]]] = field(default_factory=dict)

    def observe(self, first: int, curr_id: int, pos, priority, freed, head, share: int) -> None:
        """One eviction over layers ``first`` on: ``pos``/``priority`` [n, Hs, T] as held before it, ``freed`` [n, Hs,
        k] the slots it freed, ``head`` [n, Hs, T] each slot's head within its group of ``share`` (None: 1)."""
        pos, priority, freed = pos.cpu(), priority.float().cpu(), freed.cpu()
        n, Hs, T = pos.shape
        live = pos >= 0
        gone = torch.zeros(n, Hs, T, dtype=torch.bool).scatter_(2, freed.long(), True) & live
        kv = (torch.arange(Hs).view(1, Hs, 1) * share).expand(n, Hs, T) + (
            0 if head is None else head.cpu().long()
        )  # [n, Hs, T]
        bar = priority.masked_fill(~gone, float("-inf")).amax(-1, keepdim=True)  # [n, Hs, 1]
        below = priority.masked_fill(~live, float("inf"))
        order = below.argsort(dim=-1, stable=True).argsort(dim=-1).float()  # [n, Hs, T]: a live slot's place, lowest 0
        rank = order / live.sum(-1, keepdim=True).clamp(min=1)
        for la, hs, t in gone.nonzero().tolist():
            key = (first + la, int(kv[la, hs, t]))
            entries = self.evicted.setdefault(key, [])
            if not entries or entries[-1][0] != curr_id:
                entries.append((curr_id, []))
            entries[-1][1].append(int(pos[la, hs, t]))
        seen = torch.isin(pos, self.watched) & live
        for la, hs, t in seen.nonzero().tolist():
            self.events.append(
                (first + la, int(kv[la, hs, t]), curr_id, int(pos[la, hs, t]), float(priority[la, hs, t]))
                + (float(rank[la, hs, t]), bool(gone[la, hs, t]), float(bar[la, hs, 0]))
            )


@contextlib.contextmanager
def watching(log: EvictionLog) -> Iterator[EvictionLog]:
    """Every ``BoundedPool`` eviction of row 0 inside the block goes to ``log`` (one slot: its pool has one row)."""
    evict_layers, free_slots = bounded.BoundedPool._evict_layers, bounded.free_slots
    at: dict = {}

    def _evict_layers(self, ev, layers):
        if ev.rows.numel() != 1:
            raise ValueError("the eviction trace follows one request alone: serve it in one slot")
        at.update(first=getattr(self, "first_layer", 0) + layers.indices(len(self.layers))[0], share=self.share)
        at["curr_id"] = int(ev.curr_id.reshape(-1)[0])
        return evict_layers(self, ev, layers)

    def _free_slots(priority, pos, score, bias, n, head=None):
        before, ranked = pos.clone(), priority.clone()
        freed = free_slots(priority, pos, score, bias, n, head)
        log.observe(at["first"], at["curr_id"], before, ranked, freed, head, at["share"])
        return freed

    bounded.BoundedPool._evict_layers, bounded.free_slots = _evict_layers, _free_slots
    try:
        yield log
    finally:
        bounded.BoundedPool._evict_layers, bounded.free_slots = evict_layers, free_slots


@dataclass
class Trace:
    """One request under one method: its tokens, the positions its slot held at the end (``kept``, per layer and
    local KV head) and when its prefill ended (``prefill_kept``), and the eviction log."""

    method: Method
    tokens: list[int]
    kept: list[list[list[int]]]
    prefill_kept: list[list[list[int]]]
    log: EvictionLog
    prompt_len: int


def trace_request(
    model, method: Method, input_ids: Sequence[int], max_new_tokens: int, watched: Sequence[int] = ()
) -> Trace:
    """``input_ids`` served alone under ``method`` (greedy, EOS ignored) with its evictions logged."""
    log = EvictionLog(torch.tensor(sorted(set(watched)), dtype=torch.long))
    engine = Engine(model, method, 1, compile="none")
    with watching(log):
        out = engine.run(
            [Request(list(input_ids), max_new_tokens)], Sampling(ignore_eos=True), record=Record(positions=True)
        )
    request = out.outputs[0]
    n = len(input_ids)
    prefill = []
    for layer, heads in enumerate(request.kept_positions):
        prefill.append([])
        for head, kept in enumerate(heads):
            dropped = [p for at, ps in log.evicted.get((layer, head), []) if at >= n - 1 for p in ps if p < n]
            prefill[-1].append(sorted({p for p in kept if p < n} | set(dropped)))
    return Trace(method, request.tokens, request.kept_positions, prefill, log, n)


def held_share(kept: list[list[list[int]]], positions: Sequence[int]) -> float:
    """The share of (layer, KV head, position) triples of ``positions`` that ``kept`` holds."""
    want = set(positions)
    if not want:
        return float("nan")
    heads = [set(h) for layer in kept for h in layer]
    return sum(len(want & h) for h in heads) / (len(want) * len(heads))


def held_by_layer(kept: list[list[list[int]]], positions: Sequence[int]) -> list[float]:
    """:func:`held_share` of each layer alone."""
    return [held_share([layer], positions) for layer in kept]


def overlap(a: list[list[list[int]]], b: list[list[list[int]]]) -> float:
    """The mean over (layer, KV head) of |a & b| / |b|: how much of ``b``'s held set ``a`` holds too."""
    shares = [len(set(x) & set(y)) / max(1, len(y)) for la, lb in zip(a, b) for x, y in zip(la, lb)]
    return sum(shares) / len(shares)


def fate(trace: Trace, positions: Sequence[int]) -> dict:
    """How ``trace``'s prefill treated ``positions`` (one fact's tokens): the share it held when the prefill ended;
    of the (layer, KV head, position) triples it let go, how many tokens after the fact they went (the median of
    ``curr_id - position``), their median rank and priority over the bar at that eviction; the layers that lost
    the most of it; the share held when the request ended and the triples decode evictions took."""
    want, n = set(positions), trace.prompt_len
    gone = [e for e in trace.log.events if e[6] and e[3] in want and e[2] < n - 1]
    decoded = [e for e in trace.log.events if e[6] and e[3] in want and e[2] >= n - 1]
    per_layer = held_by_layer(trace.prefill_kept, positions)
    worst = sorted(range(len(per_layer)), key=lambda i: per_layer[i])[:3]
    out = {"held": held_share(trace.prefill_kept, positions), "evicted": len(gone)}
    out |= {"held_at_end": held_share(trace.kept, positions), "decode_evicted": len(decoded)}
    if gone:
        after = sorted(e[2] - e[3] for e in gone)
        ranks = sorted(e[5] for e in gone)
        gaps = sorted(e[7] - e[4] for e in gone)
        mid = len(gone) // 2
        out |= {"after_tokens": after[mid], "first_after": after[0], "rank": ranks[mid], "bar_gap": gaps[mid]}
    out["weakest_layers"] = {i: round(per_layer[i], 3) for i in worst}
    return out


def trace_document(
    model,
    tokenizer,
    doc: dict,
    methods: Sequence[Method],
    score: Callable[[str, list[str]], float],
    until: Sequence[str] = (),
) -> dict:
    """One RULER-style document (a line of the suite's data files) under each of ``methods``, alone: its answer (cut
    at the first of ``until``, as its lm-eval task stops: ``peers.cut_at``) and its ``score(answer, expected)`` (the
    suite's own ``ruler_utils.string_match_all``), each fact's fate (:func:`fate`) and how much of each other
    method's held set each one's holds when the prefill ends (:func:`overlap`). The prompt is encoded as the
    ``batchmax`` lm-eval model encodes it."""
    text = doc["input"]
    enc = tokenizer(text, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if ids != tokenizer.encode(text):
        raise ValueError("the tokenizer's offsets do not describe the ids the model is fed")
    facts = fact_spans(doc["task"], text, enc["offset_mapping"])
    watched = sorted({p for f in facts for p in f["positions"]})
    traces, out = {}, {"task": doc["task"], "id": doc["id"], "prompt_tokens": len(ids), "expected": doc["outputs"]}
    out["facts"] = [{"fact": f["fact"], "positions": [f["positions"][0], f["positions"][-1]]} for f in facts]
    out["methods"] = {}
    for method in methods:
        trace = traces[method.label()] = trace_request(model, method, ids, doc["max_gen_toks"], watched)
        answer = cut_at(tokenizer.decode(trace.tokens, skip_special_tokens=True), list(until))
        out["methods"][method.label()] = {
            "answer": answer,
            "score": score(answer, doc["outputs"]),
            "facts": [fate(trace, f["positions"]) for f in facts],
            "held_pairs": sum(len(h) for layer in trace.prefill_kept for h in layer),
        }
    for a, ta in traces.items():
        out["methods"][a]["overlap"] = {
            b: overlap(ta.prefill_kept, tb.prefill_kept) for b, tb in traces.items() if b != a
        }
    return out


def format_document(result: dict) -> str:
    """:func:`trace_document`'s result as Markdown: per method its score and answer, then per fact the share of its
    (layer, KV head, token) triples held when the prefill ended, and where a method let it go, when and how."""
    lines = [
        f"### {result['task']} #{result['id']} ({result['prompt_tokens']:,} tokens; expected {result['expected']})",
        "",
    ]
    for label, m in result["methods"].items():
        over = ", ".join(f"{v:.2f} of {k}'s" for k, v in m.get("overlap", {}).items())
        lines.append(
            f"- **{label}**: score {m['score']:.2f}, answer {m['answer'][:80]!r}" + (f"; holds {over}" if over else "")
        )
    lines += [
        "",
        "| fact | tokens | " + " | ".join(result["methods"]) + " |",
        "|---|---:|" + "---:|" * len(result["methods"]),
    ]
    for i, fact in enumerate(result["facts"]):
        cells = []
        for m in result["methods"].values():
            f = m["facts"][i]
            cell = f"{f['held']:.2f}"
            if f["evicted"]:
                cell += f" (lost {f['evicted']}: {f['after_tokens']} tokens after, rank {f['rank']:.2f}"
                cell += f", bar gap {f['bar_gap']:.2g})"
            if f["decode_evicted"]:
                cell += f"; decode took {f['decode_evicted']}, {f['held_at_end']:.2f} at the end"
            cells.append(cell)
        a, b = fact["positions"]
        lines.append(f"| {fact['fact'][:48]} | {a}-{b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
