"""batchmax_tp.bench.retention (launch/bench_retention.py's library): prompt building, needle scoring, batching and
the table/CSV (behaviour only).

Prompts are measured with the embedded model's tokenizer; one end-to-end test runs the embedded model on two
~200-token prompts (FKV and the paper's BM at kv_max 96, p 32, so BM evicts during prefill).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from types import SimpleNamespace

import pytest
import yaml

from batchmax_tp.bench import retention as br


@pytest.fixture(scope="module")
def count(embedded):
    return br.token_counter(embedded[1])


def test_fixture_is_small_and_complete():
    folder = br.FIXTURE_DIR
    assert sum(p.stat().st_size for p in folder.iterdir()) < 200_000
    fx = br.load_fixture()
    assert len(fx.documents) >= 3 and len(fx.facts) >= 6 and len(fx.topics) >= 5
    assert "{key}" in fx.passkey["statement"]
    for fact in fx.facts:  # every answer is stated in its sentence, so a model that keeps the sentence can answer
        assert fact["answer"] in fact["statement"]


def test_suite_lengths_depths_and_determinism(count):
    suite = br.build_suite(count, lengths=[600, 900], summaries=[260], seed=3)
    assert [s.kind for s in suite] == ["needle"] * 3 + ["multi"] + ["needle"] * 3 + ["multi"] + ["summary"]
    assert len({s.id for s in suite}) == len(suite)
    for s in suite:
        assert s.prompt_tokens == count(s.prompt)
        if s.kind != "summary":  # a summary holds a whole hand-written document, longer than these targets
            assert abs(s.prompt_tokens - s.length) <= 0.2 * s.length, (s.id, s.prompt_tokens)
        for needle in s.needles:
            assert s.prompt.count(needle.statement) == 1
    multi = next(s for s in suite if s.kind == "multi")
    assert len(multi.needles) == 3 and sorted(multi.depths) == ["early", "late", "middle"]
    assert sum(n.kind == "passkey" for n in multi.needles) == 1
    at = {d: multi.prompt.index(n.statement) for d, n in zip(multi.depths, multi.needles)}
    assert at["early"] < at["middle"] < at["late"]
    for n in multi.needles:  # every question is asked, after the text
        assert multi.prompt.index(n.question) > at["late"]
    again = br.build_suite(count, lengths=[600, 900], summaries=[260], seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in suite]
    other = br.build_suite(count, lengths=[600, 900], summaries=[260], seed=4)
    assert [s.prompt for s in other] != [s.prompt for s in suite]


def _word_count(text):
    """A stand-in for the tokenizer (words and punctuation marks), so the suite builds without a model."""
    return len(re.findall(r"\w+|[^\w\s]", text))


#: The default suite as built before --split existed (with ``_word_count``): ids, needle answers, prompts' hash.
FROZEN_ALL = {
    "ids": [
        "passkey-1024-early",
        "fact-1024-middle",
        "passkey-1024-late",
        "multi-1024",
        "fact-2048-early",
        "passkey-2048-middle",
        "fact-2048-late",
        "multi-2048",
        "passkey-3072-early",
        "fact-3072-middle",
        "passkey-3072-late",
        "multi-3072",
        "summary-2048-0",
        "summary-2048-1",
        "summary-2048-2",
    ],
    "answers": [
        "59951",
        "Rotterdam",
        "57965",
        "34348",
        "Skomer",
        "cello",
        "Northern Wren",
        "25154",
        "blue flowerpot",
        "33165",
        "Amber Lantern",
        "Lyon",
        "54405",
        "Midnight Clover",
        "94022",
        "53491",
        "Jasper Quill",
        "Rotterdam",
    ],
    "sha256": "a36a786f50973bf01ea9178f3b62811d59027daef8b837db87e3d647165ab653",
}


def _digest(suite):
    return hashlib.sha256("\x00".join(s.prompt for s in suite).encode()).hexdigest()


def test_split_all_and_tune_are_the_suite_from_before_the_split():
    for split in ("all", "tune"):
        suite = br.build_suite(_word_count, split=split)
        assert [s.id for s in suite] == FROZEN_ALL["ids"]
        assert [a for s in suite for a in s.answers] == FROZEN_ALL["answers"]
        assert _digest(suite) == FROZEN_ALL["sha256"]
    quick = br.build_suite(_word_count, lengths=[768], depths=("middle",), multi=False, summaries=[768])
    assert _digest(quick) == "0955ac2c9031e9269172b6eb727160f52f8216de3c235fc45ebef68ba203eb7e"
    with pytest.raises(ValueError, match="unknown split"):
        br.build_suite(_word_count, split="train")


def _documents(suite, fx):
    docs = fx.documents + fx.heldout.documents
    return {d["title"] for s in suite if s.kind == "summary" for d in docs if d["text"] in s.prompt}


def test_heldout_split_is_disjoint_from_the_tuned_suite_and_deterministic():
    fx = br.load_fixture()
    for seed in range(3):
        tune = br.build_suite(_word_count, seed=seed, split="tune")
        held = br.build_suite(_word_count, seed=seed, split="heldout")
        assert [s.prompt for s in br.build_suite(_word_count, seed=seed, split="heldout")] == [s.prompt for s in held]
        assert br.shared_needles(tune, held) == []  # no statement, no answer (passkeys included)
        assert _documents(tune, fx).isdisjoint(_documents(held, fx)) and len(_documents(held, fx)) == 3
        # the same shape: as many needles, at every depth and length, as the tuned suite
        placed = lambda suite: sorted((s.kind, s.length, d) for s in suite for d in s.depths)  # noqa: E731
        kinds = lambda suite: sorted(n.kind for s in suite for n in s.needles)  # noqa: E731
        assert placed(held) == placed(tune) and len(placed(held)) == 18 and kinds(held) == kinds(tune)
        assert sum(s.length == 2048 for s in held for _ in s.needles) == 6
        keys = [n for s in held for n in s.needles if n.kind == "passkey"]
        assert all(n.statement == fx.heldout.passkey["statement"].format(key=n.answer) for n in keys)
    assert _digest(br.build_suite(_word_count, seed=1, split="heldout")) != _digest(held)
    first = tune[0].needles[0]
    assert br.shared_needles(tune, tune[:1]) == sorted([first.statement, first.answer])
    # no held-out fact was in the tuned fixture at all, not only absent from these prompts
    assert {f["statement"] for f in fx.facts}.isdisjoint(f["statement"] for f in fx.heldout.facts)
    assert {d["title"] for d in fx.documents}.isdisjoint(d["title"] for d in fx.heldout.documents)
    for fact in fx.heldout.facts:
        assert fact["answer"] in fact["statement"]


def test_needle_scoring():
    assert br.passkey_hit("The secret passkey is 48213.", "48213")
    assert br.passkey_hit("passkey: 48,213", "48213")
    assert br.passkey_hit("1. 48213\n2. 7", "48213")  # a list's next number is not glued on
    assert not br.passkey_hit("The passkey is 482135.", "48213")
    assert not br.passkey_hit("The passkey is 4821.", "48213")
    assert not br.passkey_hit("The passkey is 148213", "48213")
    key = br.Needle("passkey", "", "", "48213")
    city = br.Needle("fact", "", "", "Lyon")
    name = br.Needle("fact", "", "", "Northern Wren")
    assert br.needle_hits("1. 48213\n2. lyon.\n3. The northern wren!", [key, city, name]) == [True, True, True]
    assert br.needle_hits("Lyons, the Northern Wrens, 48214", [key, city, name]) == [False, False, False]


def _sample(id_, kind, length, needles=()):
    return br.RetentionSample(id_, kind, length, f"prompt {id_}", list(needles), [], length)


def test_batches_keep_kinds_apart_and_lengths_together():
    samples = [_sample(f"n{i}", "needle", 1000 * (1 + i % 3)) for i in range(7)]
    samples += [_sample(f"s{i}", "summary", 2000) for i in range(3)]
    groups = br.batches(samples, 4)
    assert sorted(s.id for g in groups for s in g) == sorted(s.id for s in samples)
    for g in groups:
        assert 1 <= len(g) <= 4
        assert len({s.kind == "summary" for s in g}) == 1
    lengths = [s.length for g in groups for s in g if s.kind != "summary"]
    assert lengths == sorted(lengths)


def _fake_runs():
    key = br.Needle("passkey", "", "", "11111")
    city = br.Needle("fact", "", "", "Lyon")
    samples = [
        _sample("a", "needle", 2048, [key]),
        _sample("b", "multi", 2048, [key, city]),
        _sample("c", "needle", 1024, [city]),
        _sample("s", "summary", 2048),
    ]
    summary = "the harbour wall was repaired after the storm and the boats came back"
    rows = {
        br.Row("fkv", None, None, 64): {
            "outputs": {"a": "11111", "b": "11111 Lyon", "c": "Lyon", "s": summary},
            "generated_tokens": 100,
            "prefill_s": 1.0,
            "decode_s": 1.0,
            "peak_kv_bytes": 4 * 2**20,
        },
        br.Row("bm", "paper", 512, 64): {
            "outputs": {"a": "no", "b": "11111", "c": "Lyon", "s": "nothing alike"},
            "generated_tokens": 100,
            "prefill_s": 0.5,
            "decode_s": 0.5,
            "peak_kv_bytes": 2**20,
        },
        br.Row("bm", "other", 512, 64): {
            "outputs": {"a": "11111", "b": "11111 Lyon", "c": "Paris", "s": summary},
            "agreement": {"s": 0.5},
            "generated_tokens": 100,
            "prefill_s": 1.0,
            "decode_s": 1.0,
            "peak_kv_bytes": 2**20,
        },
    }
    return samples, rows


def test_score_rows_table_and_csv():
    samples, runs = _fake_runs()
    table, records = br.score_rows(samples, runs, target_length=2048)
    fkv, paper, other = table
    assert (fkv["needle_hits"], fkv["needle_total"], fkv["hits_2k"], fkv["total_2k"]) == (4, 4, 3, 3)
    assert (paper["needle_hits"], paper["hits_2k"]) == (2, 1)
    assert paper["hits_vs_fkv"] == pytest.approx(0.5) and paper["hits_2k_vs_fkv"] == pytest.approx(1 / 3)
    assert (other["needle_hits"], other["hits_2k"]) == (3, 3)
    assert fkv["fidelity_rouge2"] == 1.0 and other["fidelity_rouge2"] == pytest.approx(1.0)
    assert paper["fidelity_rouge2"] == 0.0
    assert (fkv["forced_agreement"], paper["forced_agreement"], other["forced_agreement"]) == (1.0, None, 0.5)
    assert paper["tokens_per_s"] == pytest.approx(100.0) and other["speed_vs_paper"] == pytest.approx(0.5)
    assert fkv["meets_targets"] is None and paper["meets_targets"] is False
    assert other["meets_targets"] is False  # hits and fidelity met, but half the paper rule's speed
    assert len(records) == len(samples) * len(runs)
    assert {r["id"]: r["hits"] for r in records if r["row"] == "bm/paper@512" and "hits" in r} == {
        "a": [False],
        "b": [True, False],
        "c": [True],
    }

    rows = list(csv.DictReader(io.StringIO(br.format_csv(table))))
    assert list(rows[0]) == list(br.CSV_COLUMNS) and len(rows) == 3
    assert [r["rule"] for r in rows] == ["-", "paper", "other"]
    assert float(rows[1]["hits_vs_fkv"]) == pytest.approx(0.5)
    md = br.format_markdown(table, 2048).splitlines()
    assert md[0].startswith("| method | rule | kv_max | needle hits") and len(md) >= 5
    assert "| bm | paper | 512 | 2/4 | 0.50 | 1/3 | 0.33 |" in md[3]
    assert [r["split"] for r in rows] == ["all"] * 3 and md[0].endswith("| targets met | split |")

    held, held_records = br.score_rows(samples, runs, target_length=2048, split="heldout")
    assert {r["split"] for r in held_records} == {"heldout"}
    assert [r["split"] for r in csv.DictReader(io.StringIO(br.format_csv(held)))] == ["heldout"] * 3
    assert br.format_markdown(held, 2048).splitlines()[3].endswith("| no | heldout |")


def test_hits_over_fkv_carry_a_paired_bootstrap_interval():
    """Each row's hits / FKV has its 95% interval (prompts resampled in pairs within kind and length): FKV's has no
    width, the paper rule's (2 of FKV's 4 answers) holds its 0.50 and stays below 1; the table and CSV show it."""
    samples, runs = _fake_runs()
    table, _ = br.score_rows(samples, runs, target_length=2048)
    fkv, paper, _ = table
    assert (fkv["hits_vs_fkv_low"], fkv["hits_vs_fkv_high"]) == (1.0, 1.0)
    assert paper["hits_vs_fkv"] == pytest.approx(0.5)
    assert paper["hits_vs_fkv_low"] <= 0.5 <= paper["hits_vs_fkv_high"] < 1
    md = br.format_markdown(table, 2048).splitlines()
    assert "| hits / FKV, 95% |" in md[0] and "| 0.33 | [" in md[3]
    rows = list(csv.DictReader(io.StringIO(br.format_csv(table))))
    assert float(rows[1]["hits_vs_fkv_low"]) == pytest.approx(paper["hits_vs_fkv_low"], abs=1e-4)


def test_interleaved_timings_give_median_speed_and_ratio():
    samples, runs = _fake_runs()
    paper, other = (r for r in runs if r.evicts)
    runs[paper]["speed"], runs[other]["speed"] = [10.0, 20.0, 30.0], [4.0, 20.0, 27.0]  # ratios 0.4, 1.0, 0.9
    table, _ = br.score_rows(samples, runs, target_length=2048)
    assert table[1]["tokens_per_s"] == 20.0 and table[2]["tokens_per_s"] == 20.0
    assert table[2]["speed_vs_paper"] == pytest.approx(0.9)  # per-repeat ratios, not the ratio of medians (1.0)
    assert table[0]["tokens_per_s"] == pytest.approx(50.0)  # no timings: the whole run's tokens / seconds


def test_end_to_end_tiny(embedded, count, tmp_path):
    model, tokenizer = embedded
    samples = br.build_suite(count, lengths=[200], depths=("early", "late"), summaries=[200], seed=1)
    groups = br.batches(samples, 4)
    runs = {}
    forced = None
    for row in (br.Row("fkv", None, None, 32), br.Row("bm", "paper", 96, 32)):
        runs[row] = br.run_row(model, tokenizer, row, groups, needle_tokens=3, summary_tokens=4, forced=forced)
        assert set(runs[row]["outputs"]) == {s.id for s in samples}
        assert runs[row]["generated_tokens"] == 3 * 3 + 4  # the teacher-forced pass is not counted
        forced = runs[row]["tokens"]
    # fed FKV's own summary, BM agrees where its free run agreed (the same prefix so far), counted per step
    summary = next(s.id for s in samples if s.kind == "summary")
    bm = runs[br.Row("bm", "paper", 96, 32)]
    own, ref = bm["tokens"][summary], runs[br.Row("fkv", None, None, 32)]["tokens"][summary]
    agreement = bm["agreement"][summary]
    assert len(own) == len(ref) == 4 and agreement in (0.0, 0.25, 0.5, 0.75, 1.0)
    first = next((i for i in range(4) if own[i] != ref[i]), 4)  # up to the first difference both runs match
    assert agreement >= first / 4
    fkv = runs[br.Row("fkv", None, None, 32)]
    assert bm["peak_kv_bytes"] < fkv["peak_kv_bytes"]  # bounded at 96 pairs per (sample, KV head)
    table, records = br.score_rows(samples, runs, target_length=200)
    paths = br.write_outputs(tmp_path / "out", table, records, {"target_length": 200})
    for path in paths.values():
        assert path.is_file() and path.stat().st_size > 0
    assert paths["retention.png"].read_bytes()[:4] == b"\x89PNG"
    assert len(paths["samples.jsonl"].read_text().splitlines()) == 2 * len(samples)
    assert json.loads(paths["settings.json"].read_text()) == {"target_length": 200}


def test_cli_rejects_bad_settings(capsys):
    with pytest.raises(SystemExit):
        br.parse_args(["--kv-max", "64", "--p", "64"])
    assert "kv_max must be > p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        br.parse_args(["--rules", "no-such-rule"])
    assert "unknown rule" in capsys.readouterr().err
    a = br.parse_args(["--quick", "--rules", "paper"])
    assert a.kv_max == [256] and a.rules == ["paper"] and a.lengths == [768]
    assert a.kinds == ["needle", "multi", "summary"]
    assert br.parse_args(["--kinds", "summary"]).kinds == ["summary"]
    with pytest.raises(SystemExit):
        br.parse_args(["--kinds", "summary,poems"])
    assert "--kinds: choose from needle, multi, summary" in capsys.readouterr().err
    assert a.split == "all" and br.parse_args(["--split", "heldout"]).split == "heldout"
    with pytest.raises(SystemExit):
        br.parse_args(["--split", "train"])
    assert "invalid choice: 'train'" in capsys.readouterr().err


# ---------------------------------------------------------------------- the main job's same-memory run (runner)
SMOL = dict(
    layers=30,
    hidden=576,
    intermediate=1536,
    heads=9,
    kv_heads=3,
    head_dim=64,
    vocab=49152,
    params=134_515_008,
    tied=True,
)


def test_same_memory_plan_gives_bm_the_larger_batch(caplog):
    from batchmax_tp.core.method import Method
    from batchmax_tp.plan import planner
    from batchmax_tp.plan.budget import STORY_MAX_PROMPTS, same_memory_plan

    shape = planner.ModelShape(**SMOL)
    methods = [Method("fkv"), Method("ed", kv_max=2), Method("bm", kv_max=512), Method("bm", kv_max=512, rule="probe")]
    budget, plan = same_memory_plan(shape, methods, 1800, 64, fkv_batch=4)
    assert budget == planner.predict(shape, Method("fkv"), 4, 1800, 64).total
    fkv, ed, bm, probe = (r.spec.batch_size for r in plan)
    assert fkv == 4 and ed > fkv  # ED's slots never hold their prompt
    assert bm > 2 * fkv
    # same K/V per kv_max; the probe's extra queries only add to a prefill block's activations and score block
    assert 2 * fkv < probe <= bm
    assert [r.spec.name for r in plan] == [
        f"fkv-b{fkv}",
        f"ed-b{ed}-kv2",
        f"bm-b{bm}-kv512",
        f"bm-probe-b{probe}-kv512",
    ]
    for run in plan:
        assert run.predicted_peak_bytes <= budget
        larger = planner.predict(shape, run.spec.method, run.spec.batch_size + 1, 1800, 64).total
        assert larger > budget or run.spec.batch_size == bm  # the largest (ED: capped by the prompts, BM's fit)
    # No cap at 16: in FKV's memory at batch 8 BM fits more than 16 and runs at that batch (the prompts: its fit).
    _, wide = same_memory_plan(shape, methods, 1800, 64, fkv_batch=8)
    bm_fits = [r.largest_fitting for r in wide[2:]]
    assert 16 < max(bm_fits) <= STORY_MAX_PROMPTS
    assert [r.spec.batch_size for r in wide] == [min(r.largest_fitting, max(bm_fits)) for r in wide]
    # The prompts are bounded (STORY_MAX_PROMPTS, logged when it binds); every batch is min(its fit, prompts).
    caplog.set_level("INFO", logger="batchmax_tp.plan.budget")
    _, big = same_memory_plan(shape, methods, 1800, 64, budget_bytes=8 * 2**30, num_samples=6)
    assert big[2].largest_fitting > STORY_MAX_PROMPTS == max(r.spec.batch_size for r in big)
    assert [r.spec.batch_size for r in big] == [min(r.largest_fitting, STORY_MAX_PROMPTS) for r in big]
    assert f"answers {STORY_MAX_PROMPTS} prompts" in caplog.text
    _, given = same_memory_plan(shape, methods, 1800, 64, budget_bytes=8 * 2**30, num_samples=100)
    assert [r.spec.batch_size for r in given] == [min(r.largest_fitting, 100) for r in given]  # samples given: all
    _, capped = same_memory_plan(shape, methods, 1800, 64, fkv_batch=4, max_prompts=6)
    assert [r.spec.batch_size for r in capped] == [4, min(ed, 6), 6, 6] and capped[2].largest_fitting == bm
    _, none = same_memory_plan(shape, methods, 1800, 64, budget_bytes=1000)
    assert [r.spec.batch_size for r in none] == [0, 0, 0, 0]


def test_fill_samples():
    from batchmax_tp.eval.generation import fill_samples
    from batchmax_tp.eval.tasks import Sample

    base = [Sample("a", "p1", "r1"), Sample("b", "p2", "r2")]
    filled = fill_samples(base, 5)
    assert [s.id for s in filled] == ["a", "b", "a~2", "b~2", "a~3"]
    assert [s.prompt for s in filled] == ["p1", "p2", "p1", "p2", "p1"] and filled[4].reference == "r1"
    assert fill_samples(base, 1) == base


def test_same_memory_only_for_plain_runs():
    from batchmax_tp.config import RunConfig, parse_args

    assert RunConfig().main_job and parse_args([]).main_job
    assert parse_args(["--out", "x"]).main_job  # a flag that lists no runs keeps the main job (issue 21)
    assert not parse_args(["--method", "bm"]).main_job
    assert not RunConfig(runs=[{"method": "fkv", "batch_size": 1}]).main_job
    assert not RunConfig(memory_budget="1GiB", procedure="paper").main_job
    assert RunConfig(same_memory=True).main_job
    assert not RunConfig(same_memory=False).main_job


class _Tok:
    """A tokenizer of words: every word one token; every output decodes to "answer"."""

    eos_token_id = pad_token_id = 2
    chat_template = "x"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3] * len(text.split())}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return messages[-1]["content"]

    def decode(self, ids, skip_special_tokens=True):
        return "answer"


def _fake_stack(tmp_path, monkeypatch, engine, samples: int = 3):
    """The job's model and tokenizer replaced by a shape alone and ``_Tok``, its engine by ``engine``; returns a
    data file of ``samples`` prompts of ~200 words whose reference every output contains."""
    from types import SimpleNamespace

    import batchmax_tp.models as models
    from batchmax_tp.eval import context

    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"id": i, "prompt": "w " * (200 + i), "reference": "answer"}) + "\n" for i in range(samples))
    )
    shape = SimpleNamespace(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: shape))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, _Tok()))
    monkeypatch.setattr(context, "Engine", engine)
    return data


def test_same_memory_run_writes_the_one_layout(tmp_path, capsys, monkeypatch):
    """A plain run (same memory) goes through the run path every run takes: run folders named by method, rule,
    batch and kv_max, an OOM row for a method that does not fit, and the report (budget note included)."""
    from fakes import make_fake_engine

    from batchmax_tp import cli

    fake_engine = make_fake_engine([], tokens=lambda j: [5] * 4096, prefill_s=0.1, decode_s=0.2, kv_bytes=100)
    data = _fake_stack(tmp_path, monkeypatch, fake_engine)
    out = tmp_path / "out"
    rc = cli.main(
        [
            "--same-memory",
            "--data",
            str(data),
            "--out",
            str(out),
            "--kv-max",
            "96",
            "--p",
            "32",
            "--max-new-tokens",
            "2",
            "--device",
            "cpu",
            "--log-level",
            "WARNING",
            "--scheduler",
            "static",  # the fake engine's batches
        ]
    )
    assert rc == 0
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders[0].startswith("bm-b") and any(f.startswith("bm-question-b") for f in folders)  # the best rule
    assert any(f.startswith("fkv-b4") for f in folders) and any(f.startswith("ed-b") for f in folders)
    report = (out / "report.md").read_text()
    assert "Same memory: a budget of" in report and "| BM (question) |" in report
    assert capsys.readouterr().out == report
    summaries = [json.loads((out / f / "summary.json").read_text()) for f in folders]
    # the largest fitting batch of a method whose slots hold their prompts is one full batch (ED's fit more)
    prompts = max(s["largest_fitting_batch"] for s in summaries if s["method"] != "ed")
    assert prompts > 3 and all(s["batch_size"] == min(s["largest_fitting_batch"], prompts) for s in summaries)
    # every run answers the prompts, each in whole waves of its slots (the repeats that fill its last wave unscored)
    done = [s for s in summaries if s["status"] == "done"]
    assert all(s["num_samples"] == -(-prompts // s["batch_size"]) * s["batch_size"] for s in done)
    assert all(s["num_checked"] == prompts for s in done)
    # the claim's ratios: BM with the paper's rule and with the best rule over FKV and the fastest ED run
    section = report[report.index("## Same memory: BM's tokens/s over FKV's and ED's") : report.index("## Memory")]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| BM (")]
    assert [r[1].strip() for r in rows] == ["BM (paper)", "BM (question)"], section
    fkv = next(s for s in summaries if s["method"] == "fkv")
    for row, bm in zip(rows, [s for s in summaries if s["method"] == "bm"]):
        assert row[-3].strip() == f"{bm['tokens_per_s'] / fkv['tokens_per_s']:.2f}x"


def _wave_engine(wave_s: float = 1.0):
    """An engine whose time is its waves: ``slots`` requests at a time, each wave ``wave_s`` seconds (a tenth
    prefill), every request 4 tokens; continuous runs hand each request on as its wave ends."""

    class WaveEngine:
        def __init__(self, model, method, slots, tp_group=None, compile="auto", batching=None):
            self.method, self.slots = method, slots

        def run(self, requests, sampling, on_finish=None, record=None):
            outs = []
            for j, r in enumerate(requests):
                wave = j // self.slots + 1
                new = r.max_new_tokens
                out = SimpleNamespace(
                    tokens=[5] * new, num_generated=new, kv_bytes=100, workspace_bytes=0, slot=j % self.slots,
                    run_prefill_s=0.1 * wave_s * wave, run_decode_s=0.9 * wave_s * wave, first_token_s=0.0,
                    finished_s=wave_s * wave,
                )  # fmt: skip
                outs.append(out)
                if on_finish is not None:
                    on_finish(j, out)
            waves = -(-len(requests) // self.slots)
            return SimpleNamespace(
                outputs=outs, prefill_s=0.1 * wave_s * waves, decode_s=0.9 * wave_s * waves, compile_s=0.0,
                peak_kv_bytes=100 * len(requests), peak_workspace_bytes=0, generated_tokens=4 * len(requests),
            )  # fmt: skip

    return WaveEngine


def test_whole_waves_keep_a_one_slot_difference_a_one_slot_difference(tmp_path, monkeypatch):
    """The main job's workload does not hinge on how full each method's last wave is. With every request costing
    the same (an engine whose time is its waves), BM's paper rule at 6 slots, ``question`` at 5 (one fewer) and FKV
    at 4: the report's tokens/s over FKV's are exactly the slot ratios (1.50x, 1.25x), the one-slot difference
    stays ~17% and does not change sign, and each method's answers count the 6 prompts once. (Before whole
    waves, 6 prompts made ``question`` run a second wave for one request: 1.00x FKV's, against BM's 1.50x.)"""
    from batchmax_tp import cli, job
    from batchmax_tp.plan import budget

    slots = {"fkv": 4, "ed": 6, "bm": 6, "bm-question": 5, "snap": 6}
    key = lambda m: "bm-question" if getattr(m, "rule", "paper") == "question" else m.name  # noqa: E731
    monkeypatch.setattr(budget, "max_slots", lambda budget_bytes, shape, method, *a, **k: slots[key(method)])
    monkeypatch.setattr(job, "paper_setting_specs", lambda *a, **k: [])  # the static setting: not this test's
    data = _fake_stack(tmp_path, monkeypatch, _wave_engine())
    out = tmp_path / "out"
    flags = ["--same-memory", "--data", str(data), "--out", str(out), "--kv-max", "96", "--p", "32"]
    assert cli.main([*flags, "--max-new-tokens", "4", "--device", "cpu", "--log-level", "WARNING"]) == 0
    summaries = {s["run"]: s for s in (json.loads(f.read_text()) for f in out.glob("*/summary.json"))}
    served = {name: s["num_samples"] for name, s in summaries.items()}
    assert served == {
        "fkv-b4": 8, "ed-b6-kv96": 6, "bm-b6-kv96": 6, "bm-question-b5-kv96": 10, "snap-b6-kv96": 6
    }  # fmt: skip
    assert all(s["num_checked"] == s["num_correct"] == 6 for s in summaries.values())  # the fills: unscored
    report = (out / "report.md").read_text()
    section = report[report.index("## Same memory: BM's tokens/s over FKV's and ED's") : report.index("## Memory")]
    assert "| BM (paper) | 6 | 96 | 1.000 | 24.0 | 1.50x |" in section, section
    assert "| BM (question) | 5 | 96 | 1.000 | 20.0 | 1.25x |" in section, section
    assert "Whole waves:" in report and "bm-question-b5-kv96 +4" in report and "fkv-b4 +2" in report


@pytest.mark.parametrize("methods", ["fkv,bm", "fkv,ed,bm,snap"])
def test_the_main_job_runs_the_methods_it_is_given(tmp_path, monkeypatch, methods):
    """``--same-memory --method fkv,bm``: FKV and both BMs (paper's and the best rule) in the same budget, no ED and
    no snap, and no paper's setting beside them (its batches are sized by ED's b0); its ``config.yaml`` keeps the
    choice, so the run resumes as the same job. With ED named, the paper's setting runs beside them."""
    from batchmax_tp import cli, job
    from batchmax_tp.core.method import Method
    from batchmax_tp.plan import budget
    from batchmax_tp.plan.budget import RunSpec

    slots = {"fkv": 4, "ed": 6, "bm": 6, "bm-question": 5, "snap": 6}
    key = lambda m: "bm-question" if getattr(m, "rule", "paper") == "question" else m.name  # noqa: E731
    monkeypatch.setattr(budget, "max_slots", lambda budget_bytes, shape, method, *a, **k: slots[key(method)])
    static = [RunSpec(Method("fkv", p=32, block=0), 3, policy="static")]
    monkeypatch.setattr(job, "paper_setting_specs", lambda *a, **k: static)
    data = _fake_stack(tmp_path, monkeypatch, _wave_engine())
    out = tmp_path / "out"
    flags = ["--same-memory", "--method", methods, "--data", str(data), "--out", str(out), "--kv-max", "96"]
    argv = [*flags, "--p", "32", "--max-new-tokens", "4", "--device", "cpu", "--log-level", "WARNING"]
    argv += ["--max-prompts", "7"]  # above the 6 prompts: the fits decide, as with the default 64
    assert cli.main(argv) == 0
    runs = sorted(json.loads(f.read_text())["run"] for f in out.glob("*/summary.json"))
    if methods == "fkv,bm":
        assert runs == ["bm-b6-kv96", "bm-question-b5-kv96", "fkv-b4"]
    else:
        assert len(runs) == 6 and {"ed-b6-kv96", "snap-b6-kv96", "fkv-b4"} < set(runs), runs
    assert yaml.safe_load((out / "config.yaml").read_text())["methods"] == methods.split(",")
    report = (out / "report.md").read_text()
    assert "Same memory: a budget of" in report and "at most 7)" in report
    assert cli.main(argv) == 0  # resumed: the same job


@pytest.mark.parametrize("n, slots", [(48, 18), (48, 21), (6, 4), (6, 5), (14, 12), (5, 12), (3, 3)])
def test_whole_waves_fill_with_prompts_spread_over_the_set(n, slots):
    """The repeats fill the last wave with whole passes over the samples, then ones spread evenly over the list
    (on a list ordered by length, their lengths are the set's, not its shortest), each once per pass, unscored."""
    from batchmax_tp.eval.generation import whole_waves
    from batchmax_tp.eval.tasks import Sample

    samples = [Sample(id=f"s{i}", prompt=f"p{i}", reference="r") for i in range(n)]
    out = whole_waves(samples, slots)
    assert out[:n] == samples and len(out) % slots == 0 and len(out) - n < slots
    fills = out[n:]
    assert all(s.reference is None for s in fills) and len({s.id for s in out}) == len(out)
    picked = [int(s.prompt[1:]) for s in fills]
    whole, r = divmod(len(fills), n)
    assert sorted(picked[: whole * n]) == sorted(list(range(n)) * whole)
    spread = picked[whole * n :]
    assert len(set(spread)) == r
    for k, i in enumerate(spread):  # one in each of r equal stretches of the list
        assert k * n <= i * r < (k + 1) * n
    if r:
        assert abs(sum(spread) / r - (n - 1) / 2) <= n / (2 * r)
