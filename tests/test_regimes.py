"""The regime map (``bench.regimes``): its arithmetic, its budgets, how a cell's winner is chosen, its picture."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchmax_tp.bench import regimes
from batchmax_tp.core.method import Method

LLAMA = "llama-2-7b on 4 x V100 32 GB"


def test_bm_attends_to_a_bounded_prefix_and_its_prompt_tokens_cost_less_as_prompts_grow():
    shape, _ = regimes.SETTINGS[LLAMA]
    fkv, bm, question = Method("fkv"), Method("bm", kv_max=512), Method("bm", kv_max=512, rule="question")
    assert regimes.attended_keys(fkv, 8191) == 4096
    assert regimes.attended_keys(bm, 512) == regimes.attended_keys(fkv, 512)  # nothing evicted yet
    assert 512 < regimes.attended_keys(bm, 8192) < 512 + 64  # kv_max + at most a block
    ratios = [
        regimes.prompt_token_flops(shape, bm, n) / regimes.prompt_token_flops(shape, fkv, n)
        for n in (1024, 8192, 32768)
    ]
    assert ratios[0] > ratios[1] > ratios[2] and ratios[2] < 0.7  # the arithmetic: 0.61x at 32k
    assert regimes.prompt_token_flops(shape, question, 8192) > regimes.prompt_token_flops(shape, bm, 8192)


def test_budgets_fit_fkv_two_and_eight_requests_and_a_budget_past_the_card_is_said():
    cells = regimes.predict_map(LLAMA, lengths=[2048], outputs=[64])
    assert [(c["budget"], c["runs"]["FKV"]["batch"]) for c in cells] == [("tight", 2), ("ample", 8)]
    for c in cells:  # every bounded method fits more requests than FKV in the same budget
        assert all(c["runs"][m]["batch"] > c["runs"]["FKV"]["batch"] for m in ("ED", "BM", "snap"))
    phi = regimes.predict_map("phi-3.5-mini on 4 x TITAN V 12 GB", lengths=[32768], outputs=[512])
    ample = next(c for c in phi if c["budget"] == "ample")
    assert ample["winner"] is None and "passes the card's" in ample["why"]


def test_a_cells_winner_is_the_fastest_at_90_percent_of_fkvs_answers():
    runs = {
        "FKV": {"tokens_per_s": 10.0, "answers": 1.0},
        "ED": {"tokens_per_s": 30.0, "answers": 0.0},
        "BM": {"tokens_per_s": 20.0, "answers": 0.85},
        "snap": {"tokens_per_s": 15.0, "answers": 0.9},
    }
    assert regimes.winner(runs) == ("snap", "1.50x FKV")
    assert regimes.winner(runs, line=0.8) == ("BM", "2.00x FKV")
    unmeasured = {k: {**v, "answers": None} for k, v in runs.items()}
    assert regimes.winner(unmeasured) == ("ED", "3.00x FKV, answers not measured")
    assert regimes.winner({"FKV": {"tokens_per_s": None, "answers": None}}) == (None, "nothing ran")
    # answers measured for FKV but not for ED (a map whose answers come from runs without ED): ED cannot win
    partly = {**runs, "ED": {"tokens_per_s": 30.0, "answers": None}}
    assert regimes.winner(partly) == ("snap", "1.50x FKV")


def test_predicted_cells_take_answers_from_the_nearest_measured_length_and_draw(tmp_path):
    answers = {("FKV", 1024): 1.0, ("ED", 1024): 0.0, ("BM", 1024): 0.5, ("BM (question)", 1024): 1.0}
    answers |= {("snap", 1024): 0.95, **{(k, 2048): v for (k, _), v in answers.items()}}
    assert regimes.nearest_length(answers, 8192) == 2048 and regimes.nearest_length({}, 10) is None
    cells = regimes.predict_map(LLAMA, lengths=[2048, 8192], outputs=[64], answers=answers)
    for c in cells:
        assert c["winner"] not in ("ED", "BM")  # below the line
        assert ("as measured at 2048" in c["why"]) == (c["length"] == 8192)
    path = tmp_path / "map.png"
    regimes.plot_map(cells, "test", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("setting", list(regimes.SETTINGS))
def test_the_roofline_is_decode_bound_at_small_batches(setting):
    """FKV at 2 requests of 2,048 tokens on 4 cards: a decode step moves the weights (~3.4 GB / 1.9 GB per card) at
    70% of the bandwidth, milliseconds; a prompt's prefill takes tens of milliseconds."""
    shape, cards = regimes.SETTINGS[setting]
    b = regimes.budget_bytes(shape, 2048, 64, "tight", cards.count, "float16")
    cell = regimes.predict_cell(shape, cards, Method("fkv"), 2048, 64, b)
    weights = shape.weights_per_rank(cards.count) * 2 / (cards.bandwidth * regimes.DECODE_EFFICIENCY)
    assert cell["batch"] == 2 and weights < cell["step_s"] < 2 * weights and 0.005 < cell["prefill_s"] < 0.2


def test_a_cells_kv_max_is_a_share_of_its_length_in_whole_blocks():
    assert [regimes.kv_max_at(n, 0.125) for n in (2048, 8192, 16384, 32768)] == [256, 1024, 2048, 4096]
    assert regimes.kv_max_at(16384, 0.0625) == 1024 and regimes.kv_max_at(1000, 0.1) == 128  # at least 2 blocks
    assert regimes.kv_max_at(32768, None) == 512  # the main job's
    # the predicted map sizes each cell's bounded methods at that kv_max: the planner's batch for it
    shape, cards = regimes.SETTINGS[LLAMA]
    (cell,) = regimes.predict_map(LLAMA, lengths=[16384], outputs=[512], kv_share=0.125)[:1]
    for label, method in (("BM", Method("bm", kv_max=2048)), ("snap", Method("snap", kv_max=2048))):
        want = regimes.max_slots(cell["budget_bytes"], shape, method, 16384, 512, tp=4, dtype="float16", limit=4096)
        assert cell["runs"][label]["batch"] == want > cell["runs"]["FKV"]["batch"]
    small = regimes.predict_map(LLAMA, lengths=[16384], outputs=[512])[0]  # kv_max 512: more of them fit
    assert small["runs"]["BM"]["batch"] > cell["runs"]["BM"]["batch"]


def test_the_predicted_map_prices_bm_in_wide_passes_when_told():
    """``bm_chunk``: both BM rows are BM in wide passes of that many columns (the planner's batch for that method,
    whose pass holds that many columns of activations); the other methods are as without it."""
    shape, cards = regimes.SETTINGS[LLAMA]
    narrow, wide = (
        regimes.predict_map(LLAMA, lengths=[16384], outputs=[64], kv_share=0.125, bm_chunk=c)[0] for c in (0, 8192)
    )
    assert [m.chunk for m in regimes.methods(kv_max=2048, bm_chunk=8192) if m.name == "bm"] == [8192, 8192]
    for label, rule in (("BM", "paper"), ("BM (question)", "question")):
        method = Method("bm", kv_max=2048, rule=rule, chunk=8192)
        want = regimes.max_slots(wide["budget_bytes"], shape, method, 16384, 64, tp=4, dtype="float16", limit=4096)
        assert wide["runs"][label]["batch"] == want < narrow["runs"][label]["batch"]  # a wide pass's activations
    for label in ("FKV", "ED", "snap"):
        assert wide["runs"][label] == narrow["runs"][label]


def test_a_run_at_its_own_batch_on_a_measured_device_is_its_flops_and_bytes_at_the_measured_rates():
    shape, _ = regimes.SETTINGS[LLAMA]
    cards = regimes.Cards("cpu", 1, 0, 100e9, 1e12, prefill_efficiency=1.0, decode_efficiency=1.0)
    bm = Method("bm", kv_max=1024, rule="question")
    cell = regimes.predict_cell(shape, cards, bm, 8192, 64, budget=0, dtype="bfloat16", batch=3)
    assert cell["batch"] == 3  # the run's, not the planner's (a budget of 0 fits nothing)
    assert cell["prefill_s"] == pytest.approx(8192 * regimes.prompt_token_flops(shape, bm, 8192) / 1e12)
    # the attention at its own rate (a fifth of the products', as a CPU's fused kernel): only its part slows
    linear, attention = regimes.prompt_token_flops_parts(shape, bm, 8192)
    assert linear + attention == pytest.approx(regimes.prompt_token_flops(shape, bm, 8192)) and attention > 0
    slow = regimes.predict_cell(
        shape, replace(cards, attention_flops=0.2e12), bm, 8192, 64, budget=0, dtype="bfloat16", batch=3
    )
    assert slow["prefill_s"] == pytest.approx(8192 * (linear / 1e12 + attention / 0.2e12))
    kv = 3 * 1024 * 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    assert cell["step_s"] == pytest.approx((shape.weights_per_rank(1) * 2 + kv) / 100e9)
    seconds = 3 * cell["prefill_s"] + 64 * cell["step_s"]
    assert cell["tokens_per_s"] == pytest.approx(3 * 64 / seconds)


def test_answers_come_from_ruler_tables_at_the_share_of_each_length():
    def config(method, share_by_length, **args):
        return {"model_args": {"method": method, **args}, "share_by_length": share_by_length}

    table = {
        "configs": [
            config("fkv", {"8k": 1.0, "16k": 1.0}),
            config("bm", {"8k": 0.95, "16k": 0.7}, kv_max=1024, rule="question"),  # 12.5% of 8k; 6.25% of 16k
            config("bm", {"8k": 0.5, "16k": 0.9}, kv_max=2048, rule="question"),  # 25% of 8k; 12.5% of 16k
            config("snap", {"8k": 0.8}, kv_max=1024),
            config("bm", {"8k": 0.2}, kv_max=1024),
        ]
    }
    later = {"configs": [config("snap", {"8k": 0.85}, kv_max=1024)]}
    assert regimes.answers_from_ruler([table, later], 0.125) == {
        ("FKV", 8192): 1.0,
        ("FKV", 16384): 1.0,
        ("BM (question)", 8192): 0.95,
        ("BM (question)", 16384): 0.9,
        ("snap", 8192): 0.85,
        ("BM", 8192): 0.2,
    }
