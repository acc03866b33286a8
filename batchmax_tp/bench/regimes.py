"""Where each method wins: a map over prompt length x memory budget x output length.

Each cell is one memory budget ("tight": FKV's peak at 2 requests of the cell's prompt length, "ample": at 8) in
which every method runs at its own largest batch (the planner's ``max_slots``), as the main job does. A cell's
winner is the fastest method whose answers reach 90% of FKV's (``ACCURACY_LINE``); without answers, the fastest.

- **Measured** (``launch/bench_regimes.py --measure``, CPU): each cell is the main job on needle prompts of that
  length (passkeys and facts at 3 depths), in that budget, with that many new tokens; tokens/s and answers are the
  runs' own.
- **Predicted from shapes alone** (``predict_map``): the planner's batches on the paper's settings (Llama-2-7B on
  4 x V100 32 GB, Phi-3.5-mini on 4 x TITAN V 12 GB, float16, tensor parallel over the 4 cards) and a roofline
  time: a prompt token costs its FLOPs (linear layers, and attention over the keys the method's prefill attends
  to) at ``PREFILL_EFFICIENCY`` of the cards' peak; a decode step moves the weights and every held pair once at
  ``DECODE_EFFICIENCY`` of their bandwidth. Communication, kernel launches and the CPU are left out, so these are
  ceilings for every method alike; answers come from the measured map at the same prompt length, where there is
  one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.method import METHODS, Method, is_full_cache, method_type, wide_parameters
from ..plan.planner import DTYPE_BYTES, ModelShape, max_slots, predict_pool

#: A method wins a cell only if its answers reach this share of FKV's.
ACCURACY_LINE = 0.9
#: Requests of the cell's prompt length FKV fits in each budget.
BUDGETS = {"tight": 2, "ample": 8}
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
OUTPUTS = (64, 512)
#: Roofline efficiencies of the predicted map (what a good kernel reaches: dense GEMMs, streaming reads).
PREFILL_EFFICIENCY = 0.5
DECODE_EFFICIENCY = 0.7


@dataclass(frozen=True)
class Cards:
    """``count`` cards, tensor parallel, each with ``memory`` bytes, ``bandwidth`` B/s and ``flops`` (float16), of
    which a prefill reaches ``prefill_efficiency`` and a decode step ``decode_efficiency`` (peaks from a data sheet:
    :data:`PREFILL_EFFICIENCY`, :data:`DECODE_EFFICIENCY`; rates measured on the device itself: 1), and the
    attention's ``attention_flops`` (None: ``flops``)."""

    name: str
    count: int
    memory: int
    bandwidth: float
    flops: float
    prefill_efficiency: float = PREFILL_EFFICIENCY
    decode_efficiency: float = DECODE_EFFICIENCY
    attention_flops: float | None = None  #: the attention's own FLOP/s where it differs from ``flops``


#: The paper's settings (section 4): the model and the cards it ran on.
SETTINGS: dict[str, tuple[ModelShape, Cards]] = {
    "llama-2-7b on 4 x V100 32 GB": (
        ModelShape(32, 4096, 11008, 32, 32, 128, 32000, 6_738_415_616),
        Cards("V100 32 GB", 4, 32 * 2**30, 900e9, 125e12),
    ),
    "phi-3.5-mini on 4 x TITAN V 12 GB": (
        ModelShape(32, 3072, 8192, 32, 32, 96, 32064, 3_821_079_552),
        Cards("TITAN V 12 GB", 4, 12 * 2**30, 653e9, 110e12),
    ),
}


def methods(p: int = 64, kv_max: int = 512, bm_chunk: int = 0) -> list[Method]:
    """The main job's methods: FKV (by real length), ED (kv_max 2), BM paper and ``question``, snap (``kv_max``);
    ``bm_chunk``: BM's wide passes (the main job's ``--bm-chunk``; 0: passes of one block)."""
    wide = wide_parameters("bm", bm_chunk)
    return [
        Method("fkv", p=p),
        Method("ed", kv_max=2, p=p),
        Method("bm", kv_max=kv_max, p=p, **wide),
        Method("bm", kv_max=kv_max, p=p, rule="question", **wide),
        Method("snap", kv_max=kv_max, p=p),
    ]


def kv_max_at(length: int, share: float | None, p: int = 64) -> int:
    """The cell's kv_max: ``share`` of its prompt length, to a whole number of blocks of ``p`` (at least 2 blocks);
    512 (the main job's) when ``share`` is None."""
    if share is None:
        return 512
    return max(2 * p, round(share * length / p) * p)


def label(method: Method) -> str:
    """``FKV``, ``ED``, ``BM``, ``snap``; ``BM (question)`` for a rule other than the paper's."""
    return run_label(method.name, method.rule)


def run_label(name: str, rule: str = "paper") -> str:
    """:func:`label` of the method called ``name`` (a run's summary) under ``rule``."""
    short = method_type(name).short_name
    return short if rule == "paper" else f"{short} ({rule})"


def budget_bytes(shape: ModelShape, prompt_len: int, new: int, budget: str, tp: int, dtype: str) -> int:
    """The cell's budget per rank: FKV's peak at ``BUDGETS[budget]`` requests of ``prompt_len`` tokens."""
    return predict_pool(shape, Method("fkv"), BUDGETS[budget], prompt_len, new, tp=tp, dtype=dtype).total


def attended_keys(method: Method, prompt_len: int) -> float:
    """Keys one prompt token attends to, on average over the prompt: the causal prefix for FKV, ED and snap; for BM
    at most ``kv_max`` + a block (the first ``kv_max`` tokens causal), and its look-ahead probes' queries (a rule's
    ``lookahead`` tokens every ``probe_every`` blocks, over ``kv_max`` slots) counted as more prompt tokens."""
    L = prompt_len
    if not method.bounded_prefill or L <= method.kv_max:
        return (L + 1) / 2
    k, p = method.kv_max, method.p
    keys = k * (k + 1) / 2 + (L - k) * (k + (p + 1) / 2)
    blocks = math.ceil((L - k) / p)
    probes = method.lookahead * math.ceil(blocks / method.probe_every) if method.lookahead else 0
    return (keys + probes * (k + method.lookahead / 2)) / L


def prompt_token_flops(shape: ModelShape, method: Method, prompt_len: int) -> float:
    """FLOPs of one prompt token: 2 per weight of the blocks (not the embedding's or the output head's: a pass
    computes logits for its last position only), 4 per attended key per query head and head dimension per layer
    (QK^T and PV); BM's probes add their linear layers too."""
    return sum(prompt_token_flops_parts(shape, method, prompt_len))


def prompt_token_flops_parts(shape: ModelShape, method: Method, prompt_len: int) -> tuple[float, float]:
    """(linear, attention): :func:`prompt_token_flops` in its two parts, which a device may run at different
    rates (on a CPU the attention's kernels reach a fraction of a matrix product's FLOP/s). A prompt token's linear
    layers are the blocks' weights: the input embedding is a lookup, and the output head runs for a pass's last
    position only (``logits_to_keep=1``)."""
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)  # the input's, and an untied head's
    linear = 2 * (shape.params - embeddings)
    attention = 4 * shape.layers * shape.heads * shape.head_dim * attended_keys(method, prompt_len)
    probe_share = 0.0
    if method.bounded_prefill and method.lookahead and prompt_len > method.kv_max:
        blocks = math.ceil((prompt_len - method.kv_max) / method.p)
        probe_share = method.lookahead * math.ceil(blocks / method.probe_every) / prompt_len
    return linear * (1 + probe_share), attention


def held_pairs(method: Method, prompt_len: int, new: int) -> float:
    """Pairs per (request, KV head) a decode step reads, on average over the generation."""
    if not method.evicts:
        return prompt_len + new / 2
    if method.keeps_newest:  # from 1 pair to kv_max, then back to the newest
        return (1 + method.kv_max) / 2
    return min(method.kv_max, prompt_len + new / 2)


def predict_cell(
    shape: ModelShape,
    cards: Cards,
    method: Method,
    prompt_len: int,
    new: int,
    budget: int,
    dtype: str = "float16",
    batch: int | None = None,
) -> dict:
    """One method in one budget on ``cards``: its batch (the planner's, or ``batch`` as a run had it) and roofline
    tokens/s of a continuous run in steady state (each batch of requests: their prefills one after another, then
    ``new`` decode steps shared)."""
    tp, nbytes = cards.count, DTYPE_BYTES[dtype]
    if batch is None:
        batch = max_slots(budget, shape, method, prompt_len, new, tp=tp, dtype=dtype, limit=4096)
    if batch == 0:
        return {"batch": 0, "tokens_per_s": None}
    linear, attention = prompt_token_flops_parts(shape, method, prompt_len)
    flops = cards.flops * tp * cards.prefill_efficiency
    attention_flops = (cards.attention_flops or cards.flops) * tp * cards.prefill_efficiency
    prefill = prompt_len * (linear / flops + attention / attention_flops)
    _, kv_heads = shape.local_heads(tp)
    kv = batch * held_pairs(method, prompt_len, new) * 2 * shape.layers * kv_heads * shape.head_dim * nbytes
    step = (shape.weights_per_rank(tp) * nbytes + kv) / (cards.bandwidth * cards.decode_efficiency)
    seconds = batch * prefill + new * step
    return {"batch": batch, "tokens_per_s": batch * new / seconds, "prefill_s": prefill, "step_s": step}


def winner(cells: Mapping[str, Mapping], line: float = ACCURACY_LINE) -> tuple[str | None, str]:
    """(method, why) of one cell's runs {label: {tokens_per_s, answers}}: the fastest whose answers reach ``line``
    x FKV's; a method whose answers were not measured where FKV's were cannot win (ED in a map whose answers come
    from runs without it); with FKV's not measured either, every method counts. None when none ran."""
    fkv = cells.get("FKV", {}).get("answers")
    ok = {
        name: run
        for name, run in cells.items()
        if run.get("tokens_per_s")
        and (fkv is None or (run.get("answers") is not None and run["answers"] >= line * fkv))
    }
    if not ok:
        return None, "nothing ran"
    best = max(ok, key=lambda name: ok[name]["tokens_per_s"])
    base = cells.get("FKV", {}).get("tokens_per_s")
    ratio = f"{ok[best]['tokens_per_s'] / base:.2f}x FKV" if base else "FKV did not run"
    return best, ratio + ("" if fkv is not None else ", answers not measured")


def predict_map(
    setting: str,
    lengths: Sequence[int] = LENGTHS,
    outputs: Sequence[int] = OUTPUTS,
    answers: Mapping[tuple[str, int], float] | None = None,
    p: int = 64,
    kv_share: float | None = None,
    bm_chunk: int = 0,
) -> list[dict]:
    """Every cell of ``SETTINGS[setting]``: each method's batch and predicted tokens/s (the bounded ones at
    :func:`kv_max_at` the cell's length and ``kv_share``; BM in wide passes of ``bm_chunk`` columns, whose
    activations the planner counts), the measured answers ({(label, length): share of FKV's}) at the measured prompt
    length nearest the cell's, and the winner."""
    shape, cards = SETTINGS[setting]
    out = []
    for new in outputs:
        for budget in BUDGETS:
            for length in lengths:
                b = budget_bytes(shape, length, new, budget, cards.count, "float16")
                fits = b <= cards.memory
                runs = {}
                measured = nearest_length(answers or {}, length)
                for m in methods(p, kv_max_at(length, kv_share, p), bm_chunk):
                    run = predict_cell(shape, cards, m, length, new, b) if fits else {"batch": 0, "tokens_per_s": None}
                    run["answers"] = (answers or {}).get((label(m), measured))
                    runs[label(m)] = run
                best, why = winner(runs) if fits else (None, f"the budget ({b / 2**30:.1f} GiB) passes the card's")
                if measured is not None and measured != length:
                    why += f", answers as measured at {measured} tokens"
                cell = {"new": new, "budget": budget, "length": length, "budget_bytes": b, "runs": runs}
                out.append({**cell, "winner": best, "why": why})
    return out


def answers_from_ruler(tables: Sequence[Mapping], kv_share: float) -> dict[tuple[str, int], float]:
    """{(label, prompt length): share of FKV's score} from ``launch/bench_ruler.py`` tables (``table.json``): at each
    length, the configurations whose kv_max is :func:`kv_max_at` that length and ``kv_share`` (FKV: 1); a later
    table's value replaces an earlier one's."""
    out: dict[tuple[str, int], float] = {}
    for table in tables:
        for config in table["configs"]:
            args = config["model_args"]
            name, rule = args["method"], args.get("rule", "paper")
            for length, share in config.get("share_by_length", {}).items():
                tokens = int(length.rstrip("k")) * 1024
                if share is None or (not is_full_cache(name) and args.get("kv_max") != kv_max_at(tokens, kv_share)):
                    continue
                out[run_label(name, rule), tokens] = float(share)
    return out


def nearest_length(answers: Mapping[tuple[str, int], float], length: int) -> int | None:
    """The measured prompt length nearest ``length`` (the shorter on a tie), None when nothing was measured."""
    lengths = sorted({n for _, n in answers})
    return min(lengths, key=lambda n: (abs(n - length), n)) if lengths else None


def plot_map(cells: Sequence[Mapping], title: str, path) -> None:
    """A heatmap of the winners: a row per (output length, budget), a column per prompt length, each cell coloured
    by its winner and labelled with it and its speed over FKV's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted({(c["new"], c["budget"]) for c in cells}, key=lambda r: (r[0], list(BUDGETS).index(r[1])))
    cols = sorted({c["length"] for c in cells})
    fig = Figure(figsize=(1.8 + 1.9 * len(cols), 0.9 + 0.75 * len(rows)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, row in enumerate(rows):
        for j, length in enumerate(cols):
            cell = next((c for c in cells if (c["new"], c["budget"]) == row and c["length"] == length), None)
            best = cell["winner"] if cell else None
            ax.add_patch(_rect(j, len(rows) - 1 - i, *_style(best)))
            text = "n/a" if cell is None else f"{best or '-'}\n{cell['why'].split(',')[0]}"
            ax.text(j + 0.5, len(rows) - 0.5 - i, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(0, len(rows))
    ax.set_xticks([j + 0.5 for j in range(len(cols))], [f"{n} tokens" for n in cols])
    ax.set_yticks(
        [len(rows) - 0.5 - i for i in range(len(rows))], [f"{new} new, {budget}" for new, budget in rows], fontsize=8
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _style(winner: str | None) -> tuple[str, str | None, float]:
    """A cell's colour, hatch and alpha from its winner's run label (:func:`run_label`): the method's own colour
    (``Method.colour``), hatched under a rule other than the paper's; no winner: light grey."""
    if winner is None:
        return "#dddddd", None, 1.0
    short, _, rule = winner.partition(" (")
    kind = next(k for k in METHODS.values() if k.short_name == short)
    return kind.colour, "//" if rule else None, 0.45


def _rect(x: float, y: float, colour: str, hatch: str | None, alpha: float):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="white", hatch=hatch, alpha=alpha)
