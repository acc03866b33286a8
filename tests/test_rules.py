"""Eviction rules beside the paper's (batchmax_tp.core.rules): the registry and its validation, each rule held to the
naive reference (exact kept positions per (layer, sample, KV head), logits, tokens), the look-ahead probe never
entering the cache, memory equal to the paper rule's, and no collective added by the probe under tp=2."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import (
    PEAKED,
    assert_kept_equal,
    assert_logits_close,
    assert_tokens_equal,
    left_padded_batch,
    requires_deepspeed,
    tiny_llama,
)
from reference import reference_generate, rule_string

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.method import Method
from batchmax_tp.core.rules import RULES, get_rule, rule_candidates, rule_names
from batchmax_tp.core.schedule import plan
from batchmax_tp.core.scheduler import Scheduler

ATOL = 1e-4
LENGTHS = [37, 52, 60]  # s = 60, left paddings 23, 8, 0

# (rule, its parameters): every parameter is spelled out for the reference, which has no defaults of its own.
CASES = [
    ("paper", {}),
    ("pooled", dict(kernel=3, pool="max")),
    ("pooled", dict(kernel=5, pool="avg")),
    ("sinks", dict(sinks=2, recent=4)),
    ("probe", dict(window=8, every=1, weight=1.0)),  # window > p: the second-to-last block gets a shorter probe
    ("probe", dict(window=3, every=1, weight=4.0)),
    ("snapkv", dict(window=8, every=1, weight=2.0, kernel=3, pool="max")),
    ("question", dict(window=8, every=1, kernel=3, pool="max", sinks=1, recent=2)),
    ("question", dict(window=3, every=1, kernel=1, pool="avg", sinks=0, recent=0)),  # the probe alone, unpooled
    # the probe rides every 3rd (2nd) block; the evictions between re-score with its stored queries
    ("question", dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2)),
    ("probe", dict(window=3, every=2, weight=4.0)),
    # decode evictions ranked by the question's stored queries too (issue 68), probing every block and every 3rd
    ("question", dict(window=8, every=1, kernel=3, pool="max", sinks=1, recent=2, decode="probe")),
    ("question", dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2, decode="probe")),
    # the prefill's evicted pairs in a recall tier, ranked with the held ones before the last block (issue 68)
    ("question", dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2, recall="tier")),
    ("question", dict(window=8, every=1, kernel=3, pool="max", sinks=1, recent=2, decode="probe", recall="tier")),
    # the same tier, chosen from after the last block by its window's queries as snap chooses (issue 68); window > p:
    # the window's queries come from the last three blocks
    ("question", dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2, recall="window")),
    ("question", dict(window=6, every=1, kernel=3, pool="avg", sinks=1, recent=2, decode="probe", recall="window")),
]


def case_id(case) -> str:
    return rule_string(*case).replace(":", "-").replace(",", "-")


def run_engine(model, ids, mask, rule, kv_max, p, n):
    return generate(
        model, ids, mask, Method("bm", kv_max=kv_max, p=p, rule=rule), n, ignore_eos=True, return_logits=True
    )


# ------------------------------------------------------------------------------------------- registry / API
def test_registry_names_and_defaults():
    assert rule_names()[0] == "paper" and set(rule_names()) == set(RULES)
    assert {"paper", "pooled", "sinks", "probe", "snapkv", "question"} <= set(rule_names())
    assert Method("bm", kv_max=512).rule == "paper"
    assert get_rule("snapkv") == RULES["snapkv"]()
    assert get_rule("probe:window=64,weight=0.5") == RULES["probe"](window=64, weight=0.5)
    for name in rule_names():  # every rule is a frozen dataclass with a score()
        rule = get_rule(name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            rule.x = 1
        assert callable(rule.score)


@pytest.mark.parametrize(
    "text,match",
    [
        ("nope", "unknown rule 'nope': choose one of paper, pooled"),
        ("pooled:kernel=4", "kernel must be odd"),
        ("pooled:kernel=0", "kernel must be an integer >= 1"),
        ("pooled:pool=min", "pool must be one of max, avg"),
        ("pooled:size=3", "keys: share, taper, kernel, pool"),
        ("probe:window=0", "window must be an integer >= 1"),
        ("probe:weight=-1", "weight must be a finite number >= 0"),
        ("sinks:recent=x", "recent must be int"),
        ("paper:kernel=3", "keys: share, taper$"),
        ("question:recent=-1", "recent must be an integer >= 0"),
        ("question:sinks=1.5", "sinks must be int"),
        ("question:kernel=4", "kernel must be odd"),
        ("question:window=0", "window must be an integer >= 1"),
        ("question:pool=sum", "pool must be one of max, avg"),
        ("question:weight=2", "keys: share, taper, window, every, kernel, pool, sinks, recent"),
        ("paper:share=-1", "share must be an integer >= 0"),
        ("question:share=129", "share must be <= 128"),
        ("snapkv:every=0", "every must be an integer >= 1"),
    ],
)
def test_rule_validation(text, match):
    with pytest.raises(ValueError, match=match):
        get_rule(text)


def test_rule_candidates_are_the_rule_then_its_cheaper_settings_on_top():
    assert rule_candidates("paper") == ["paper"]
    assert rule_candidates("question") == ["question", "question:every=8", "question:window=16"]
    # a key the spec sets itself is left as given; every other setting of the spec is kept in each candidate
    assert rule_candidates("question:every=8") == ["question:every=8", "question:every=8,window=16"]
    assert rule_candidates("question:share=3") == [
        "question:share=3",
        "question:share=3,every=8",
        "question:share=3,window=16",
    ]
    # a cheaper setting that is the spec's own value is no candidate of its own
    assert rule_candidates("question:window=16,every=8") == ["question:window=16,every=8"]
    for spec in rule_candidates("question:taper=20"):
        assert get_rule(spec).taper == 20


def test_method_rule_field():
    assert Method("bm", kv_max=512).label() == "bm(kv_max=512, p=64)"  # the paper's label is unchanged
    assert Method("bm", kv_max=512, rule="snapkv").label() == "bm(kv_max=512, p=64, rule=snapkv)"
    with pytest.raises(ValueError, match="unknown rule 'x'"):
        Method("bm", kv_max=512, rule="x")
    with pytest.raises(ValueError, match="applies to method 'bm' only"):
        Method("ed", kv_max=2, rule="pooled")
    with pytest.raises(ValueError, match="kv_max must be >= p \\+ 36"):
        Method("bm", kv_max=64, p=32, rule="sinks")  # 4 sinks + 32 recent leave < p evictable pairs
    Method("bm", kv_max=68, p=32, rule="sinks")
    with pytest.raises(ValueError, match="kv_max must be >= p \\+ 64"):
        Method("bm", kv_max=95, p=32, rule="question")  # 4 sinks + 60 recent
    Method("bm", kv_max=96, p=32, rule="question")


def test_probe_schedule():
    """A probe pass of its own follows every prefill block but the last, over the prompt's positions
    [max(end, s-w), s); the blocks, evictions and decode steps are the paper rule's."""
    m = Method("bm", kv_max=16, p=4, rule="probe:window=6")
    phases = plan(m, 30, 5)
    assert [(ph.kind, ph.start, ph.end) for ph in phases if ph.kind != "decode"] == [
        ("prefill", 0, 16),
        ("probe", 24, 30),
        ("prefill", 16, 20),
        ("probe", 24, 30),
        ("prefill", 20, 24),
        ("probe", 24, 30),
        ("prefill", 24, 28),
        ("probe", 28, 30),
        ("prefill", 28, 30),
    ]
    assert all(ph.evict == 0 for ph in phases if ph.kind == "probe")
    paper = plan(Method("bm", kv_max=16, p=4), 30, 5)
    unprobed = [(ph.kind, ph.start, ph.end, ph.evict) for ph in phases if ph.kind != "probe"]
    assert unprobed == [(ph.kind, ph.start, ph.end, ph.evict) for ph in paper]
    every = plan(Method("bm", kv_max=16, p=4, rule="probe:window=6,every=2"), 30, 5)  # after blocks 0 and 2 only
    assert [(ph.start, ph.end) for ph in every if ph.kind == "probe"] == [(24, 30), (24, 30)]
    assert [ph.start for i, ph in enumerate(every) if ph.kind == "probe" and every[i - 1].start in (0, 20)] == [24, 24]
    assert [(ph.start, ph.end, ph.evict) for ph in every if ph.kind != "probe"] == [
        (ph.start, ph.end, ph.evict) for ph in paper
    ]


# ---------------------------------------------------------------------------------------- fast vs reference
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rule_matches_reference(case):
    rule, params = case
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    s, kv_max, p, n = ids.shape[1], 16, 4, 14
    ref = reference_generate(model, ids, mask, "bm", kv_max, p, n, rule=rule, rule_params=params)
    assert ref.min_margin > 1e-4, f"near tie in the reference ranking ({ref.min_margin:.2g}); pick another seed"
    out = run_engine(model, ids, mask, rule_string(rule, params), kv_max, p, n)
    tag = rule_string(rule, params)
    assert_logits_close(out.logits, ref.logits, ATOL, what=f"[{tag}] logits")
    assert_tokens_equal(out.tokens, ref.tokens, what=f"[{tag}] tokens")
    assert_kept_equal(out.kept_positions(), ref.kept, what=f"[{tag}] kept positions")
    # evictions in prefill and in decoding
    assert any(e[3] < s - 1 for e in ref.events) and any(e[3] >= s - 1 for e in ref.events)
    # right after prefill (the probe acts there) and after a decode eviction
    for steps in (1, 2 * p + 2):
        out_k = run_engine(model, ids, mask, rule_string(rule, params), kv_max, p, steps)
        assert_kept_equal(
            out_k.kept_positions(),
            ref.kept_history[steps - 1],
            what=f"[{tag}] kept positions after {steps} token(s)",
        )
    if rule != "paper":  # the rule really decides differently from the paper's (the test is not vacuous)
        paper = reference_generate(model, ids, mask, "bm", kv_max, p, n)
        assert ref.kept_history[0] != paper.kept_history[0] or ref.kept != paper.kept


def test_decode_probe_ranks_the_first_decode_eviction_by_the_question():
    """``question:decode=probe`` keeps what the prefill kept until the first decode eviction, which then ranks by the
    question's stored queries and so keeps other pairs than the average attention does (the option is not vacuous);
    with no probe at all (a prompt within kv_max) the two are the same."""
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    base = dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2)
    kv_max, p, n = 16, 4, 14
    want = {
        d: reference_generate(model, ids, mask, "bm", kv_max, p, n, rule="question", rule_params={**base, "decode": d})
        for d in ("attention", "probe")
    }
    assert want["attention"].kept_history[0] == want["probe"].kept_history[0]  # the same prefill
    assert want["attention"].kept_history[1] != want["probe"].kept_history[1]  # the first decode eviction differs
    short = ids[:, -10:], mask[:, -10:].clone().fill_(1)
    same = [
        run_engine(model, *short, rule_string("question", {**base, "decode": d}), 32, p, 30).kept_positions()
        for d in ("attention", "probe")
    ]
    assert same[0] == same[1]
    with pytest.raises(ValueError, match="decode must be one of attention, probe"):
        Method("bm", kv_max=96, p=32, rule="question:decode=window")


@pytest.mark.parametrize(
    "case",
    [
        ("probe", dict(window=8, every=1, weight=1.0)),
        ("snapkv", dict(window=8, every=1, weight=1.0, kernel=3, pool="avg")),
        ("sinks", dict(sinks=3, recent=2)),
        ("question", dict(window=8, every=1, kernel=3, pool="avg", sinks=2, recent=3)),
        ("question", dict(window=8, every=2, kernel=3, pool="avg", sinks=2, recent=3)),
    ],
    ids=case_id,
)
def test_rule_matches_reference_short_samples(case):
    """A 5-token sample padded to 60: its blocks are pads while its probe is partly pads, partly real."""
    rule, params = case
    model = tiny_llama(1, **PEAKED)
    ids, mask = left_padded_batch([5, 60, 45], seed=4)
    kv_max, p, n = 16, 4, 12
    ref = reference_generate(model, ids, mask, "bm", kv_max, p, n, rule=rule, rule_params=params)
    assert ref.min_margin > 1e-4, ref.min_margin
    out = run_engine(model, ids, mask, rule_string(rule, params), kv_max, p, n)
    assert_logits_close(out.logits, ref.logits, ATOL, what="logits")
    assert_tokens_equal(out.tokens, ref.tokens)
    assert_kept_equal(out.kept_positions(), ref.kept)


def test_question_score_terms():
    """question: the probe alone at prefill evictions, average attention at decode ones, both pooled by position
    (over raw neighbours, protected ones included); then sinks and recent positions +inf, empty slots -inf."""
    rule = get_rule("question:kernel=3,sinks=1,recent=1")
    pos = torch.tensor([[[5, 0, 3, -1, 1, 8, 9]]])  # slot order is not position order; one empty slot
    attn = torch.tensor([[[8.0, 9.0, 0.5, 7.0, 7.0, 0.4, 0.2]]])  # average: 1.6, 0.9, 1/14, -, 7/9, 0.2, 0.2
    probe = torch.tensor([[[0.1, 0.0, 0.3, 5.0, 0.05, 0.2, 0.9]]])
    inf = float("inf")
    # |dp| <= 1: position 1 also sees 0 (the sink), 8 sees 9 (the newest, protected); 3 and 5 see only themselves
    torch.testing.assert_close(rule.score(attn, pos, 9, probe), torch.tensor([[[0.1, inf, 0.3, -inf, 0.05, 0.9, inf]]]))
    torch.testing.assert_close(rule.score(attn, pos, 9), torch.tensor([[[1.6, inf, 0.5 / 7, -inf, 0.9, 0.2, inf]]]))


def test_sinks_are_kept():
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    s, n = ids.shape[1], 14
    out = run_engine(model, ids, mask, "sinks:sinks=3,recent=5", 16, 4, n)
    for layer in out.kept_positions():
        for j, heads in enumerate(layer):
            first = s - LENGTHS[j]
            for positions in heads:
                assert set(range(first, first + 3)) <= set(positions)
                assert set(range(s + n - 2 - 4, s + n - 1)) <= set(positions)  # the 5 newest


# ------------------------------------------------------------------------------------- probe and memory
@pytest.mark.parametrize(
    "rule", ["probe:window=8", "snapkv:window=8,kernel=3", "question:window=8,every=3,sinks=1,recent=2"]
)
def test_probe_never_enters_the_cache(rule):
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    s, kv_max, p = ids.shape[1], 16, 4
    paper = run_engine(model, ids, mask, "paper", kv_max, p, 1)
    out = run_engine(model, ids, mask, rule, kv_max, p, 1)
    assert any(ph.kind == "probe" for ph in out.phases)
    for layer in out.kept_positions():
        for j, heads in enumerate(layer):
            for positions in heads:
                assert positions == sorted(set(positions)) and len(positions) <= kv_max
                assert all(s - LENGTHS[j] <= q <= s - 1 for q in positions)  # real prompt tokens only
    assert out.peak_kv_bytes == paper.peak_kv_bytes  # the probe's keys and values are never stored
    assert out.served.kv_bytes_range == paper.served.kv_bytes_range


@pytest.mark.parametrize("rule", [rule_string(*c) for c in CASES])
def test_memory_equals_paper_rule(rule):
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    paper = run_engine(model, ids, mask, "paper", 16, 4, 10)
    out = run_engine(model, ids, mask, rule, 16, 4, 10)
    assert out.peak_kv_bytes == paper.peak_kv_bytes
    # bookkeeping: a probe rule keeps one more float32 per slot (its look-ahead attention), the others nothing; one
    # that probes every few blocks (or ranks decode evictions by its probe) also each row's last probe queries [Hq, w,
    # D] (scaled), their log-sum-exp over the probe's own keys [Hq, w] and the weights [w] (w: the rule's window).
    r = get_rule(rule)
    c, B = model.config, ids.shape[0]
    extra = c.num_hidden_layers * B * c.num_key_value_heads * (16 + 1) * 4 if r.lookahead() else 0
    if r.probe_every() > 1 or r.probe_decodes() or (r.recalls() and not r.recall_window()):
        w = r.lookahead()
        extra += c.num_hidden_layers * B * w * (c.num_attention_heads * (c.head_dim * 4 + 4) + 4)
    # recall=window: each row's last prompt queries [Hq, w, D]
    extra += c.num_hidden_layers * B * c.num_attention_heads * r.recall_window() * c.head_dim * 4
    assert out.peak_meta_bytes == paper.peak_meta_bytes + extra


# ------------------------------------------------------------------------------------------ tensor parallel
RULE_TP = "snapkv:window=8,kernel=3,every=2"  # probed passes and re-scored evictions, both rank-local


def _tp_worker(rank, world, port, outdir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from multiproc import batch, count_collectives, make_model

    from batchmax_tp import parallel as tp

    layout = tp.init_distributed(world)
    model = tp.apply_tensor_parallel(make_model(False), layout, torch.float32)
    ids, mask = batch(0)
    counts = count_collectives()
    res = {}
    for rule in ("paper", RULE_TP):
        counts.clear()
        out = generate(
            model, ids, mask, Method("bm", kv_max=16, p=4, rule=rule), 12, ignore_eos=True, return_logits=True
        )
        res[rule] = dict(
            tokens=out.tokens,
            logits=torch.stack(out.logits),
            kept=out.kept_positions(),
            heads=len(out.kept_positions()[0][0]),
            collectives=dict(counts),
        )
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def passes(method, ids, mask, new) -> tuple[int, int]:
    """The model passes (prefill and decode) the engine runs for the padded batch, and the look-ahead probes folded
    into them: its schedule, a pure function of the inputs."""
    lengths = mask.sum(-1).tolist()
    sched = Scheduler(method, lengths, [new] * len(lengths), len(lengths), static=True, pad_to=ids.shape[1])
    counts = [0, 0]
    while (step := sched.next_step()) is not None:
        counts[0] += 1
        counts[1] += any(w.probe is not None for w in step.work)
        sched.complete(step)
    return counts[0], counts[1]


@requires_deepspeed
def test_probe_passes_add_only_their_own_layers_collectives_under_tp2(tmp_path):
    from multiproc import batch, free_port, make_model, spawn

    spawn(_tp_worker, (2, free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = make_model(False)
    ids, mask = batch(0)
    single = generate(
        model, ids, mask, Method("bm", kv_max=16, p=4, rule=RULE_TP), 12, ignore_eos=True, return_logits=True
    )
    offset = 0
    for res in ranks:
        paper, probe = res["paper"], res[RULE_TP]
        assert paper["collectives"].get("all_reduce", 0) > 0, "the wrapper saw no all-reduce: it cannot count"
        # The probes ride in the prefill passes (their queries are more columns of the pass): they add no pass and
        # no collective; eviction and re-scoring stay rank-local.
        full, probes = passes(Method("bm", kv_max=16, p=4, rule=RULE_TP), ids, mask, 12)
        assert probes > 0 and full == passes(Method("bm", kv_max=16, p=4), ids, mask, 12)[0]
        assert probe["collectives"] == paper["collectives"]
        torch.testing.assert_close(probe["logits"], torch.stack(single.logits), atol=ATOL, rtol=0)
        assert torch.equal(probe["tokens"], single.tokens)
        h = probe["heads"]
        want = [[heads[offset : offset + h] for heads in layer] for layer in single.kept_positions()]
        assert probe["kept"] == want  # rank-local eviction = the single process's, head by head
        offset += h
    assert offset == 3


# ------------------------------------------------------------------------------------------- configuration
def test_run_config_rule(tmp_path):
    from batchmax_tp.config import ConfigError, RunConfig, build_parser, parse_args
    from batchmax_tp.eval.summary import run_settings
    from batchmax_tp.plan.budget import RunSpec

    cfg = parse_args([])
    assert cfg.sweep.rule == "paper" and [m.rule for m in cfg.sweep.method_specs()] == ["paper"] * 3
    assert [s.name for s in cfg.sweep.run_specs()] == ["fkv-b4", "ed-b4-kv2", "bm-b4-kv512"]  # paper names unchanged
    cfg = parse_args(["--rule", "snapkv:window=64", "--kv-max", "256"])
    assert [(m.name, m.rule) for m in cfg.sweep.method_specs()] == [
        ("fkv", "paper"),
        ("ed", "paper"),
        ("bm", "snapkv:window=64"),
    ]
    spec = cfg.sweep.run_specs()[2]
    assert spec.name == "bm-snapkv-window64-b4-kv256"
    assert run_settings(cfg, spec)["rule"] == "snapkv:window=64"
    assert run_settings(cfg, RunSpec(Method("fkv"), 4))["rule"] == "paper"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        "rule: pooled\nruns:\n  - {method: bm, batch_size: 8, kv_max: 256}\n"
        "  - {method: bm, batch_size: 8, kv_max: 256, rule: paper}\n"
    )
    assert [s.name for s in parse_args(["--config", str(yaml_file)]).sweep.run_specs()] == [
        "bm-pooled-b8-kv256",
        "bm-b8-kv256",
    ]
    for argv, start in [
        (["--rule", "nope"], "rule: unknown rule 'nope': choose one of paper, pooled"),
        (["--rule", "pooled:kernel=2"], "rule: rule 'pooled': kernel must be odd"),
        (["--rule", "sinks", "--kv-max", "80", "--p", "64"], "kv_max: rule 'sinks' protects 36"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"runs\[0\].rule: rule 'probe' applies to method bm only"):
        RunConfig(runs=[{"method": "ed", "batch_size": 2, "rule": "probe"}])
    with pytest.raises(ConfigError, match="rule: must be a string"):
        RunConfig(rule=3)
    assert "--rule" in build_parser().format_help() and "--list-rules" in build_parser().format_help()


def test_list_rules_prints_names_and_exits_0(capsys):
    from batchmax_tp.config import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(["--list-rules"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in lines[:-1]] == rule_names() and lines[-1] == ""
    assert all(line.split()[1:3] == ["share=1", "taper=0"] for line in lines[:-1])  # the budget parameters of all
    assert lines[rule_names().index("question")].split()[1:] == [
        "share=1",
        "taper=0",
        "window=32",
        "every=4",
        "kernel=15",
        "pool=max",
        "sinks=4",
        "recent=60",
        "decode=attention",
        "recall=none",
    ]


def test_reports_name_the_rule():
    from batchmax_tp.eval.report import format_csv

    rows = format_csv(
        [
            dict(method="bm", rule="snapkv", batch_size=4, kv_max=256, status="done"),
            dict(method="bm", batch_size=4, kv_max=256, status="done"),
        ]
    ).splitlines()
    rule_col = rows[0].split(",").index("rule")
    assert [r.split(",")[rule_col] for r in rows[1:]] == ["snapkv", "paper"]
