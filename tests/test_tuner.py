"""Auto-tuner and the paper's sweep plan: against exhaustive search on a toy throughput model, and a real run."""

from __future__ import annotations

import pytest
import torch

from batchmax_tp.core.method import BatchMax, Method
from batchmax_tp.plan.planner import ModelShape, max_batch, paper_ed_bytes, predict
from batchmax_tp.plan.tuner import Trial, divisor_batches, kv_grid, largest_batch, paper_plan, tune

SHAPE = ModelShape(
    layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, params=134_515_008
)
S, T = 2048, 256


def toy(method: Method, b: int) -> Trial:
    """Throughput: prefill per sample + decode steps that get cheaper per token with batch, dearer with kv.
    Metric: grows with kv_max, saturating at FKV's 0.30."""
    kv = S + T if not method.evicts else method.kv_max
    step = 0.02 + 0.0005 * b + 1e-6 * b * kv
    tps = b * T / (b * S / 300 + T * step)
    metric = 0.30 if not method.evicts else 0.30 * min(1.0, (kv / 1536) ** 0.5)
    return Trial(method.name, method.kv_max, b, tps, metric)


@pytest.mark.parametrize("target", [0.9, 0.95, 1.0])
def test_tuner_finds_the_exhaustive_optimum_in_fewer_trials(target):
    budget = predict(SHAPE, Method("fkv"), 4, S, T).total
    calls = []

    def evaluate(method, b):
        calls.append((method.kv_max, b))
        return toy(method, b)

    res = tune(evaluate, budget, SHAPE, S, T, target=target)
    # Exhaustive: every kv_max on the grid at every fitting batch.
    goal = target * 0.30
    everything = []
    for k in kv_grid(S):
        m = Method("bm", kv_max=k, p=64)
        for b in range(1, max_batch(budget, SHAPE, m, S, T) + 1):
            everything.append(toy(m, b))
    best = max((t for t in everything if t.metric >= goal), key=lambda t: t.tokens_per_s)
    assert (res.best.kv_max, res.best.batch) == (best.kv_max, best.batch)
    assert res.best.metric >= goal
    assert len(calls) == len(set(calls)) <= 8 < len(everything)


def test_tune_sizes_bm_with_the_rule_it_runs():
    """``--procedure tune --rule question``: every BM trial runs the question rule at a batch sized with it (its probe
    tokens and stored probe queries), within the budget where the paper rule's sizing would overflow it."""
    batches = divisor_batches(960, 960)
    paper, question = Method("bm", kv_max=512, p=64), Method("bm", kv_max=512, p=64, rule="question")
    budget = predict(SHAPE, paper, 32, S, T).total  # the paper's rule fits b=32 (a divisor of 960) exactly
    assert largest_batch(budget, SHAPE, paper, S, T, dtype="float32", batches=batches) == 32
    assert predict(SHAPE, question, 32, S, T).total > budget  # premise: the paper's sizing overflows question
    asked = []

    def evaluate(method, b):
        asked.append((method, b))
        return toy(method, b)

    res = tune(evaluate, budget, SHAPE, S, T, target=0.5, kv_values=[512, 640, 768], batches=batches, rule="question")
    bm = [(m, b) for m, b in asked if isinstance(m, BatchMax)]
    assert bm and all(m.rule == "question" and m.p == 64 for m, _ in bm)
    for m, b in bm:
        above = min(x for x in batches if x > b)  # the largest divisor batch that fits, for this rule
        assert predict(SHAPE, m, b, S, T).total <= budget < predict(SHAPE, m, above, S, T).total
    assert res.best is not None and res.best.batch < 32 and (question, res.best.batch) in bm


def test_kv_grid_leaves_out_what_the_rule_cannot_run_with():
    assert kv_grid(600, p=64, rule="question") == [128, 256, 384, 512, 640]  # 64 + 4 sinks + 60 recent = 128
    assert kv_grid(600, p=100, rule="question") == [256, 384, 512, 640]
    assert kv_grid(600, p=100) == [128, 256, 384, 512, 640]


def test_tuner_returns_none_when_no_bm_config_reaches_the_target():
    budget = predict(SHAPE, Method("fkv"), 2, S, T).total
    res = tune(toy, budget, SHAPE, S, T, target=1.0, kv_values=[128, 256])
    assert res.best is None and res.fkv.metric == pytest.approx(0.30)


def test_tuner_rejects_a_budget_without_fkv():
    with pytest.raises(ValueError, match="FKV at batch 1"):
        tune(toy, 10**6, SHAPE, S, T)


def test_paper_plan_follows_the_procedure():
    budget = paper_ed_bytes(SHAPE, 5, S, T) + 1  # the paper's ED fits 5, not 6
    runs = paper_plan(budget, SHAPE, S, T, dtype="float32")
    head = [(m.name, m.kv_max, b) for m, b in runs[:4]]
    # FKV also holds the generated tokens: at b0 - 1 = 5 it does not fit, so it runs at its own largest batch.
    b_fkv = max_batch(budget, SHAPE, Method("fkv"), S, T)
    assert b_fkv < 5
    assert head == [("ed", 2, 6), ("ed", 2, 5), ("ed", 65, 5), ("fkv", None, b_fkv)]
    assert paper_ed_bytes(SHAPE, 6, S, T) > budget  # the paper's OOM row (this engine's ED fits it)
    bm = [(m.kv_max, b) for m, b in runs[4:]]
    assert [k for k, _ in bm] == [k for k in kv_grid(S)]
    for k, b in bm:
        assert 960 % b == 0 and predict(SHAPE, Method("bm", kv_max=k, p=64), b, S, T).total <= budget
    assert bm[0][1] > 5  # BM fits more than ED at the same budget


def test_grids():
    assert kv_grid(600) == [128, 256, 384, 512, 640]
    assert divisor_batches(960, 50)[-5:] == [24, 30, 32, 40, 48]


def test_tuner_on_the_embedded_model_with_a_small_budget(embedded):
    from batchmax_tp.bench.padded import generate
    from batchmax_tp.eval.generation import encode_prompts
    from batchmax_tp.eval.tasks import default_fixture_path, load_jsonl

    model, tok = embedded
    samples = load_jsonl(default_fixture_path())[:2]
    ids, mask = encode_prompts(tok, [s.prompt[:1200] for s in samples])
    s, new = ids.shape[1], 6
    shape = ModelShape.from_config(model.config)
    ref = generate(model, ids, mask, Method("fkv"), new).tokens

    def evaluate(method, b):
        # Metric: greedy-token agreement with FKV (b rows of the 2 prompts; throughput measured on that batch).
        rows = torch.arange(b) % ids.shape[0]
        out = generate(model, ids[rows], mask[rows], method, new, ignore_eos=True)
        agree = (
            (out.tokens[: ids.shape[0]] == ref).float().mean().item()
            if b >= ids.shape[0]
            else (out.tokens == ref[:b]).float().mean().item()
        )
        return Trial(method.name, method.kv_max, b, b * new / (out.prefill_s + out.decode_s), agree)

    budget = predict(shape, Method("fkv"), 2, s, new).total
    res = tune(evaluate, budget, shape, s, new, target=0.5, p=32, kv_values=[64, 128])
    assert res.fkv.metric == 1.0
    assert res.best is not None and res.best.metric >= 0.5
    assert res.best.batch >= 2 and res.best.kv_max in (64, 128)


@pytest.mark.parametrize("true_b0, start", [(7, 7), (7, 3), (7, 20), (1, 5), (40, 1), (2, 2)])
def test_find_b0_searches_real_trials_from_the_planners_guess(true_b0, start):
    from batchmax_tp.plan.tuner import find_b0

    asked = []

    def fits(b):
        asked.append(b)
        return b < true_b0

    assert find_b0(start, fits) == true_b0
    assert len(asked) == len(set(asked)) and len(asked) <= 2 * max(1, abs(true_b0 - start)).bit_length() + 2


def test_paper_specs_use_a_measured_b0_and_say_so():
    from batchmax_tp.config import parse_args
    from batchmax_tp.plan import budget

    shape = ModelShape(
        layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, params=134_515_008
    )
    cfg = parse_args(
        ["--procedure", "paper", "--memory-budget", "2GiB", "--max-new-tokens", "64", "--kv-values", "512"]
    )
    kw = dict(
        budget=cfg.memory.budget_bytes(),
        max_new_tokens=64,
        dtype="float32",
        p=64,
        rule="paper",
        kv_values=[512],
        num_samples=960,
    )
    planned, info = budget.paper_specs(shape, 1024, **kw)
    assert info["b0_source"] == "planner" and "planner" in info["b0_note"]
    guess = info["b0_planned"]
    assert planned[0].batch_size == guess
    specs, info = budget.paper_specs(shape, 1024, **kw, fits=lambda b: b < guess - 2)
    assert info["b0_source"] == "measured" and info["b0"] == guess - 2 and "real ED trials" in info["b0_note"]
    assert [(s.method.name, s.batch_size) for s in specs[:4]] == [
        ("ed", guess - 2),
        ("ed", guess - 3),
        ("ed", guess - 3),
        ("fkv", guess - 3),
    ]


def test_tune_picks_the_method_as_well_and_says_why():
    """``methods=("fkv", "bm", "snap")``: each method is tuned as BM is (its own kv_max grid, batches sized with it);
    the pick is the fastest run of any of them that meets the goal, FKV included; ``why`` names it, its tokens/s
    and metric against the goal, and the others' best. A snap that keeps more per kv_max (the toy: twice BM's
    metric at a kv_max) wins at a smaller kv_max, a larger batch; with snap's metric below the goal at every
    kv_max, BM wins; with neither, FKV."""
    budget = predict(SHAPE, Method("fkv"), 4, S, T).total

    def evaluate(scale):
        def run(method, b):
            t = toy(method, b)
            if method.name == "snap":
                t.metric = min(0.30, t.metric * scale)
            return t

        return run

    res = tune(evaluate(2.0), budget, SHAPE, S, T, target=0.9, methods=("fkv", "bm", "snap"))
    bm_only = tune(evaluate(2.0), budget, SHAPE, S, T, target=0.9)
    assert res.best.method == "snap" and res.best.metric >= 0.9 * 0.30
    assert res.best.tokens_per_s > bm_only.best.tokens_per_s > res.fkv.tokens_per_s
    assert res.why.startswith(f"snap kv_max={res.best.kv_max} b={res.best.batch}: ") and "bm kv_max=" in res.why
    assert {t.method for t in res.trials} == {"fkv", "bm", "snap"}
    worse = tune(evaluate(0.1), budget, SHAPE, S, T, target=0.9, methods=("fkv", "bm", "snap"))
    assert (worse.best.method, worse.best.kv_max, worse.best.batch) == ("bm", bm_only.best.kv_max, bm_only.best.batch)
    none = tune(
        evaluate(0.1), budget, SHAPE, S, T, target=1.0, kv_values=[128, 256, 512], methods=("fkv", "bm", "snap")
    )
    assert (none.best.method, none.best.batch) == ("fkv", res.fkv.batch)
    assert none.why.startswith("fkv b=")
    assert tune(toy, budget, SHAPE, S, T, target=1.0, kv_values=[128, 256]).why.startswith("no configuration")


def test_tune_offers_the_rules_cheaper_settings_as_candidates_of_their_own():
    """``--rule question``: question and each of its cheaper settings (every=8, window=16) are tuned as candidates
    of their own (each at its own smallest kv_max that meets the goal); the fastest that meets it wins and keeps its
    rule, and a cheaper setting that loses answers is passed over. Without ``cheaper``, question alone."""
    budget = predict(SHAPE, Method("fkv"), 4, S, T).total
    speed = {"question": 1.0, "question:every=8": 1.2, "question:window=16": 1.1}

    def evaluate(every8_keeps):
        def run(method, b):
            t = toy(method, b)
            if method.evicts:
                t.rule, t.tokens_per_s = method.rule, t.tokens_per_s * speed[method.rule]
                t.metric *= every8_keeps if method.rule == "question:every=8" else 1.0
            return t

        return run

    common = dict(target=0.9, kv_values=[1024, 1280, 1536], rule="question")
    res = tune(evaluate(1.0), budget, SHAPE, S, T, cheaper=True, **common)
    assert {t.rule for t in res.trials if t.method == "bm"} == set(speed)
    assert (res.best.rule, res.best.metric >= 0.9 * 0.30) == ("question:every=8", True)
    assert res.why.startswith(f"bm rule=question:every=8 kv_max={res.best.kv_max} ")
    assert "bm rule=question:window=16 kv_max=" in res.why and "bm rule=question kv_max=" in res.why
    loses = tune(evaluate(0.5), budget, SHAPE, S, T, cheaper=True, **common)
    assert loses.best.rule == "question:window=16"
    alone = tune(evaluate(1.0), budget, SHAPE, S, T, **common)
    assert {t.rule for t in alone.trials if t.method == "bm"} == {"question"} and alone.best.rule == "question"
    assert res.best.tokens_per_s > alone.best.tokens_per_s
