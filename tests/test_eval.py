"""The evaluation harness: tasks and prompts, metrics, seeded selection, crash-safe results, reports, configs.

Offline and fast: the bundled fixtures, the embedded model's tokenizer (no weights) and, for whole runs, a tiny
random Llama with the tokenizer's vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import sys
from pathlib import Path

import pytest
from fakes import counting_engine

from batchmax_tp import cli
from batchmax_tp.config import ConfigError, RunConfig, parse_args
from batchmax_tp.eval import metrics, report, results, tasks
from batchmax_tp.eval.generation import encode_prompts
from batchmax_tp.plan.budget import run_dir_name

ROOT = Path(__file__).resolve().parent.parent


def _render(tokenizer, prompt) -> str:
    return tokenizer.apply_chat_template(tasks.as_messages(prompt), add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------------- fixtures in the datasets' own schema
def test_fixtures_load_through_datasets_in_the_real_schemas():
    import datasets

    for name, keys in [
        ("cnn_dailymail", {"article", "highlights", "id"}),
        ("gsm8k", {"question", "answer"}),
        ("narrativeqa", {"document", "question", "answers"}),
    ]:
        folder = tasks.fixture_dir(name)
        for split in ("train", "test"):
            data = datasets.load_dataset("json", data_files=str(folder / f"{split}.jsonl"), split="train")
            assert set(data.column_names) == keys and len(data) >= 3, (name, split)
    nqa = tasks.load_split(tasks.TASKS["narrativeqa"], tasks.fixture_dir("narrativeqa"), "test")[0]
    assert nqa["document"]["summary"]["text"] and nqa["question"]["text"] and nqa["answers"][1]["text"]
    gsm = tasks.load_split(tasks.TASKS["gsm8k"], tasks.fixture_dir("gsm8k"), "train")
    assert len(gsm) >= 16 and all("\n#### " in r["answer"] for r in gsm)


# ---------------------------------------------------------------------- prompts
@pytest.mark.parametrize("name, shots", [("cnn_dailymail", 1), ("narrativeqa", 2), ("gsm8k", 16)])
def test_prompt_has_the_paper_shots_as_chat_turns(tokenizer, name, shots):
    data = tasks.load_task(name, num_samples=2)
    assert len(data.shots) == shots == tasks.TASKS[name].shots
    samples = tasks.build_samples(tokenizer, data)
    messages = samples[0].prompt
    assert [m["role"] for m in messages] == ["user", "assistant"] * shots + ["user"]
    text = _render(tokenizer, messages)
    # The chat template wraps every turn and ends with the assistant's generation prompt.
    assert text.count("<|im_start|>user\n") == shots + 1 and text.endswith("<|im_start|>assistant\n")
    turn = data.examples[0][1]
    assert messages[-1]["content"] == turn.user_text() and samples[0].tokens_cut == 0
    assert samples[0].reference == turn.references
    assert tasks.load_task(name, num_samples=2, num_shots=0).shots == []


def test_task_specific_prompt_parts():
    cnn = tasks.load_task("cnn_dailymail", num_samples=1)
    assert cnn.shots[0].answer.count("\n") == 0  # highlights joined into one reply
    assert cnn.examples[0][1].references[0].count("\n") == 2  # the reference keeps its lines
    nqa = tasks.load_task("narrativeqa", num_samples=1).examples[0][1]
    assert nqa.question.startswith("Question: ") and len(nqa.references) == 2
    gsm = tasks.load_task("gsm8k", num_samples=1)
    assert all("<<" not in t.answer and "####" in t.answer for t in gsm.shots)  # calculator notes dropped
    assert "<<" in gsm.examples[0][1].references[0]  # reference untouched
    assert gsm.examples[0][1].document == ""


def test_truncation_cuts_only_the_document(tokenizer):
    data = tasks.load_task("narrativeqa", num_samples=1)
    turn = data.examples[0][1]
    full, cut = tasks.build_prompt(tokenizer, data.shots, turn, None)
    n_full = len(tasks.prompt_ids(tokenizer, full))
    limit = n_full - 60
    messages, cut = tasks.build_prompt(tokenizer, data.shots, turn, limit)
    assert len(tasks.prompt_ids(tokenizer, messages)) <= limit and 60 <= cut < 80
    last = messages[-1]["content"]
    assert last.startswith(turn.instruction + "\n\n") and last.endswith("\n\n" + turn.question)
    kept = last[len(turn.instruction) + 2 : -len(turn.question) - 2]
    assert turn.document.startswith(kept) and len(kept) < len(turn.document)  # the end of the document went
    assert messages[:-1] == full[:-1]  # the shots are untouched while the sample's document suffices


def test_truncation_moves_on_to_shot_documents_and_fails_without_documents(tokenizer):
    data = tasks.load_task("narrativeqa", num_samples=1)
    turn = data.examples[0][1]
    doc_tokens = len(tokenizer(turn.document, add_special_tokens=False)["input_ids"])
    full, _ = tasks.build_prompt(tokenizer, data.shots, turn, None)
    limit = len(tasks.prompt_ids(tokenizer, full)) - doc_tokens - 40
    messages, cut = tasks.build_prompt(tokenizer, data.shots, turn, limit)
    assert len(tasks.prompt_ids(tokenizer, messages)) <= limit and cut > doc_tokens  # all of it and more
    assert messages[-1]["content"] == f"{turn.instruction}\n\n{turn.question}"  # document gone entirely
    assert messages[-3]["content"] != full[-3]["content"] and messages[-2] == full[-2]  # last shot's doc cut
    assert messages[0] == full[0]  # the first shot is untouched

    gsm = tasks.load_task("gsm8k", num_samples=1)
    with pytest.raises(ValueError, match="only documents are cut"):
        tasks.build_samples(tokenizer, gsm, max_input_tokens=500)


def test_cut_counts_are_recorded(tokenizer):
    data = tasks.load_task("cnn_dailymail")
    samples = tasks.build_samples(tokenizer, data, max_input_tokens=420)
    assert all(len(tasks.prompt_ids(tokenizer, s.prompt)) <= 420 for s in samples)
    assert all(s.tokens_cut > 0 for s in samples)
    assert tasks.build_samples(tokenizer, data)[0].tokens_cut == 0


def test_encode_prompts_accepts_chats_and_strings(tokenizer):
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    ids, mask = encode_prompts(tokenizer, [chat, "Q2"])
    text = tokenizer.decode(ids[0][mask[0].bool()])
    assert "<|im_start|>assistant\nA1<|im_end|>" in text and text.endswith(
        "user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert int(mask[1].sum()) < int(mask[0].sum())


# ---------------------------------------------------------------------- seeded selection
def test_sample_selection_is_seeded_and_independent_of_everything_else():
    a = tasks.select_indices(11490, 960, seed=0)
    assert a == tasks.select_indices(11490, 960, seed=0) and len(set(a)) == 960 and a == sorted(a)
    assert a != tasks.select_indices(11490, 960, seed=1)
    assert tasks.select_indices(5, 960, seed=0) == [0, 1, 2, 3, 4]
    assert tasks.select_indices(5, None, seed=3) == [0, 1, 2, 3, 4]
    first = [i for i, _ in tasks.load_task("gsm8k", num_samples=4, seed=7).examples]
    assert first == [i for i, _ in tasks.load_task("gsm8k", num_samples=4, seed=7).examples]
    assert first == [str(i) for i in tasks.select_indices(6, 4, seed=7)]
    assert tasks.select_shots(18, 16, 0) == tasks.select_shots(18, 16, 0)
    with pytest.raises(ValueError, match="16 shots needed"):
        tasks.select_shots(10, 16, 0)


# ---------------------------------------------------------------------- metrics
@pytest.mark.parametrize(
    "output, references, expected",
    [
        ("the cat sat on the mat", "the cat sat", 2 * (2 / 5) * 1 / (2 / 5 + 1)),  # 2 of 5 bigrams, 2 of 2
        ("The Cat SAT.", "the cat sat", 1.0),  # lower-cased, punctuation dropped
        ("cats sitting", "cat sits", 1.0),  # Porter stemmer: cats->cat, sitting/sits->sit
        ("a b c", "x y z", 0.0),
        ("", "the cat sat", 0.0),
        ("the dog barked", ["the cat sat", "the dog barked loudly"], 2 * 1 * (2 / 3) / (1 + 2 / 3)),  # best ref
    ],
)
def test_rouge2_hand_computed(output, references, expected):
    assert metrics.rouge2(output, references) == pytest.approx(expected)
    assert metrics.score("rouge2", output, references) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 1,234 apples.", "1234"),
        ("It costs $5.", "5"),
        ("The total is $1,200.50 in all", "1200.5"),
        ("The temperature is -5 degrees", "-5"),
        ("Answer: 3.50", "3.5"),
        ("18.00", "18"),
        ("10-3=7 so 7", "7"),  # "10-3": 10 and 3, not -3
        ("between 3,4 and 5", "5"),  # "3,4" is not a thousands group
        ("half is .5", "0.5"),
        ("first 4, then 12, finally 30.", "30"),
        ("#### 72\nQuestion: next one has 5", "72"),  # the answer marker wins over a later number
        ("####", None),
        ("no number at all", None),
        ("", None),
    ],
)
def test_gsm8k_output_answer(text, expected):
    assert metrics.gsm8k_output_answer(text) == expected


def test_gsm8k_reference_and_accuracy():
    ref = "Tickets: 5 * 9 = $<<5*9=45>>45.\nTotal: 45 + 9 = $<<45+9=54>>54.\n#### 54"
    assert metrics.gsm8k_reference_answer(ref) == "54"
    assert metrics.gsm8k_reference_answer("#### 1,495") == "1495"
    assert metrics.gsm8k_reference_answer("#### -5") == "-5"
    assert metrics.gsm8k_reference_answer("no marker 12") is None
    assert metrics.score("accuracy", "So they spend $54.00 in total.", ref) == 1.0
    assert metrics.score("accuracy", "45 + 9 = 54\n#### 54", ref) == 1.0
    assert metrics.score("accuracy", "They spend 45.", ref) == 0.0
    assert metrics.score("accuracy", "I do not know.", ref) == 0.0
    assert metrics.score("accuracy", "anything", None) is None


def test_exact_and_contains():
    assert metrics.score("exact", "  Pepper! ", "pepper") == 1.0
    assert metrics.score("exact", "It was Pepper", "pepper") == 0.0
    assert metrics.score("contains", "It was Pepper.", "pepper") == 1.0
    assert metrics.score("contains", "It was Peppers.", "pepper") == 0.0
    assert metrics.score("contains", "Mara's brother Jonah", ("Jonah.", "x")) == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        metrics.score("bleu", "a", "a")


# ---------------------------------------------------------------------- crash-safe run log
def _samples(ids):
    return [results.SampleRecord(i, 5, f"out {i}", "out", True, 3) for i in ids]


def _batch(index, ids, decode_s=0.2):
    n = len(ids)
    return results.BatchRecord(index, 0, list(ids), [0] * n, 3 * n, 0.1, decode_s, 64, [64])


def test_run_log_drops_a_torn_line_and_an_incomplete_batch(tmp_path):
    log = results.RunLog(tmp_path)
    batches = [["0", "1"], ["2", "3"], ["4"]]
    assert log.load(batches) == ([], [])
    log.append(_samples(["0", "1"]), [_batch(0, ["0", "1"])])
    log.append(_samples(["2"]), [])  # batch 1 half written...
    with open(log.samples_path, "a", encoding="utf-8") as fh:
        fh.write('{"id": "3", "outp')  # ...and its last line torn by a SIGKILL
    samples, done = log.load(batches)
    assert [r.id for r in samples] == ["0", "1"] and [b.batch for b in done] == [0]
    assert log.samples_path.read_text().count("\n") == 2  # the file was repaired: appends continue cleanly
    log.append(_samples(["2", "3"]), [_batch(1, ["2", "3"])])
    assert [r.id for r in log.load(batches)[0]] == ["0", "1", "2", "3"]
    # A batch line whose samples never made it (not possible in order, but a foreign edit) does not count.
    with open(log.batches_path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(_batch(2, ["4"]).to_json()) + "\n")
    assert [b.batch for b in log.load(batches)[1]] == [0, 1]
    assert not list(tmp_path.glob(".*tmp"))


def test_run_log_rejects_a_foreign_file(tmp_path):
    (tmp_path / "samples.jsonl").write_text('{"output": "a line without an id"}\n')
    with pytest.raises(ValueError, match="not a batchmax_tp sample log"):
        results.RunLog(tmp_path).load([["0"]])
    (tmp_path / "samples.jsonl").write_text('{"id": "0"}\n')
    (tmp_path / "batches.jsonl").write_text('{"legacy": "a line without batch and ids"}\n')
    with pytest.raises(ValueError, match="not a batchmax_tp batch log"):
        results.RunLog(tmp_path).load([["0"]])


def test_summarise_counts_batches_once():
    samples = _samples(["0", "1", "2"])
    samples[2] = dataclasses.replace(samples[2], reference=None)
    s = results.summarise(samples, [_batch(0, ["0", "1"]), _batch(1, ["2"])], "contains")
    assert s["num_samples"] == 3 and s["num_batches"] == 2 and s["generated_tokens"] == 9
    assert s["prefill_s"] == pytest.approx(0.2) and s["decode_s"] == pytest.approx(0.4)
    assert s["tokens_per_s"] == pytest.approx(9 / 0.6) and s["score"] == pytest.approx(1.0)
    assert s["num_scored"] == 2 and s["peak_kv_bytes"] == 64


def test_a_summary_reads_back_typed_and_gives_back_the_object_it_read():
    """``summary.json`` as a ``RunSummary``: a key the object holds keeps its value (None too), a missing one takes
    its default, and a key no reader names is kept, so ``to_json`` is the object read."""
    obj = {"run": "bm-b2-kv128", "method": "bm", "rule": None, "batch_size": 2, "kv_max": 128, "status": "oom"}
    obj |= {"error": "CUDA out of memory", "tokens_per_s": None, "largest_fitting_batch": 9}
    s = results.RunSummary.from_json(obj)
    assert (s.method, s.batch_size, s.kv_max, s.rule, s.oom, s.error) == ("bm", 2, 128, None, True, obj["error"])
    assert (s.tp_size, s.samples_cut, s.oom_cause, s.paper_setting) == (1, 0, None, False)  # defaults
    assert s.to_json() == obj and results.RunSummary.from_json(s) is s
    assert results.RunSummary.from_json({"method": "fkv"}).rule == "paper"  # written before rules existed


def test_run_dir_names():
    assert run_dir_name("fkv", 4, None) == "fkv-b4"
    assert run_dir_name("fkv", 4, 512) == "fkv-b4"
    assert run_dir_name("bm", 32, 1024) == "bm-b32-kv1024"
    assert run_dir_name("bm", 32, 1024, "snapkv:window=64") == "bm-snapkv-window64-b32-kv1024"


# ---------------------------------------------------------------------- report
def _paper_table1_cnn():
    rows = [
        ("ed", 5, 2, None, None),
        ("ed", 4, 2, 0.0, 42.0),
        ("ed", 4, 65, 0.003, 41.5),
        ("fkv", 4, None, 0.145, 30.3),
        ("bm", 32, 1024, 0.146, 73.8),
        ("bm", 40, 896, 0.142, 80.3),
    ]
    return [
        dict(
            method=m,
            batch_size=b,
            kv_max=kv,
            score=sc,
            tokens_per_s=t,
            status="oom" if sc is None else "done",
            task="cnn_dailymail",
            metric="rouge2",
            model="meta-llama/Llama-2-13b-chat-hf",
            num_samples=960,
            max_new_tokens=512,
            peak_kv_mib=1.0,
            samples_cut=3,
        )
        for m, b, kv, sc, t in rows
    ]


def test_report_is_laid_out_like_the_paper(tmp_path):
    summaries = _paper_table1_cnn()
    text = report.format_report(summaries)
    lines = text.splitlines()
    head = lines.index(
        "| Method | b | kv_max | rouge-2 | correct | tokens/s | peak KV MiB | predicted peak MiB | prompts cut |"
    )
    assert lines[head + 2] == "| ED | 5 | 2 | OOM | - | OOM | OOM | n/a | |"
    assert lines[head + 4] == "| ED | 4 | 65 | 0.003 | - | 41.5 | 1.0 | n/a | 3/960 |"
    assert lines[head + 5] == "| FKV | 4 | N/A | 0.145 | - | 30.3 | 1.0 | n/a | 3/960 |"
    # The paper: BM b=32 is 75.7% faster than ED (73.8 / 42.0) at 100.7% of FKV's rouge-2; the spread of each run's
    # own batches is shown next to the ratio (one batch each here: none measured).
    assert (
        "- BM b=32 kv_max=1024: throughput +75.7% vs ED (spread BM 1 full batch, ED 1 full batch), rouge-2 "
        "100.7% of FKV"
    ) in lines
    masked = report.mask_timings(text)
    assert "41.5" not in masked and "+75.7%" not in masked and "0.003" in masked and "OOM | OOM" in masked
    noisy = report.format_report([dict(s, tokens_per_s_spread=0.8, num_batches=4) for s in summaries]).splitlines()
    assert (
        "- BM b=32 kv_max=1024: throughput +75.7% vs ED (spread BM +/-80% over 4 batches, ED +/-80% over 4 "
        "batches -- within that noise), rouge-2 100.7% of FKV"
    ) in noisy

    paths = report.write_report(tmp_path, summaries)
    assert sorted(os.listdir(tmp_path)) == sorted(report.REPORT_FILES)
    for name in ("throughput.png", "metric_vs_kv.png"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = paths["results.csv"].read_text().splitlines()
    assert rows[0].split(",") == list(report.CSV_COLUMNS) and len(rows) == 7
    assert rows[1].split(",")[report.CSV_COLUMNS.index("status")] == "oom"


def _same_memory_runs(speed: float = 1.0):
    """The plain run's rows (docs/performance.md: The main job): FKV, ED, BM with the paper's rule and with question."""
    rows = [
        ("fkv", "paper", 4, None, 1.0, 12.0),
        ("ed", "paper", 4, 2, 0.0, 12.5),
        ("ed", "paper", 2, 2, 0.0, 9.0),
        ("bm", "paper", 13, 512, 0.385, 17.0),
        ("bm", "question", 11, 512, 0.846, 12.6),
    ]
    return [
        dict(
            method=m,
            rule=r,
            batch_size=b,
            kv_max=kv,
            score=sc,
            tokens_per_s=tps * speed,
            status="done",
            metric="contains",
            task="jsonl",
            model="embedded:smollm2-135m-instruct",
            num_samples=13,
            max_new_tokens=64,
            peak_kv_mib=1.0,
            same_memory_budget_bytes=2**30,
            largest_fitting_batch=b,
        )
        for m, r, b, kv, sc, tps in rows
    ]


def test_the_claims_labels_do_not_overlap_where_points_sit_close(tmp_path):
    """FKV and BM ``question`` at the same answers and nearly the same speed (the main job's picture): every label
    of ``claim.png`` is drawn clear of every other, each still joined to its own point."""
    runs = _same_memory_runs()
    runs[4].update(score=1.0, tokens_per_s=12.3)  # question beside FKV (1.0, 12.0)
    runs[2].update(tokens_per_s=12.4)  # and ED b=2 right under both
    fig = report.plot_claim(runs, tmp_path / "claim.png")
    renderer = fig.canvas.get_renderer()
    texts = [a for a in fig.axes[0].texts if a.get_text()]
    assert len(texts) == 5
    boxes = [t.get_window_extent(renderer) for t in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    for t, r in zip(texts, [r for r in runs if r["tokens_per_s"]]):
        assert t.xy == (r["tokens_per_s"], r["score"])  # the line starts at the label's own point


def test_same_memory_report_shows_every_method_its_seconds_and_the_ceiling_and_draws_the_claim(tmp_path):
    """The same-memory run: one table of every method (answers beside tokens/s, prefill ms per prompt token, decode
    seconds, the ratio to FKV), the ceiling (FKV's prefill with the fastest bounded decode: BM's 5 s, not ED's
    2 s), and ``claim.png``; a run that is not the same-memory one has neither."""
    runs = _same_memory_runs()
    seconds = {"fkv": (30.0, 20.0), "ed": (28.0, 2.0), "bm": (32.0, 5.0)}
    for r in runs:
        r["prefill_s"], r["decode_s"] = seconds[r["method"]]
        r.update(prompt_tokens=12000, generated_tokens=600, num_checked=13, num_correct=round(13 * r["score"]))
    text = report.format_report(runs)
    section = text[text.index("## Every method at its own fastest, one budget") :]
    lines = section.splitlines()
    assert "| FKV | 4 | N/A | 1.000 | 13/13 | 12.0 | 1.00x | 2.50 | 20.0 |" in lines
    assert "| BM (question) | 11 | 512 | 0.846 | 11/13 | 12.6 | 1.05x | 2.67 | 5.0 |" in lines
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "---" not in line][1:] == [
        "ED",
        "ED",
        "FKV",
        "BM",
        "BM (question)",
    ]
    assert "Ceiling: FKV's prefill (30.0 s) with BM's decode (5.0 s) would make 17.1 tokens/s (1.43x FKV)." in lines
    paths = report.write_report(tmp_path, runs)
    assert paths["claim.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = [{k: v for k, v in r.items() if k != "same_memory_budget_bytes"} for r in runs]
    assert "Every method at its own fastest" not in report.format_report(plain)
    (tmp_path / "plain").mkdir()
    assert "claim.png" not in report.write_report(tmp_path / "plain", plain)


def test_same_memory_report_shows_each_rules_ratios_over_fkv_and_ed(tmp_path):
    text = report.format_report(_same_memory_runs())
    lines = text.splitlines()
    head = lines.index("| method | b | kv_max | contains | tokens/s | tokens/s / FKV | tokens/s / ED |")
    assert lines[head - 2].startswith(
        "Each BM rule's tokens/s, and snap's, divided by those of the fastest FKV run (b=4, continuous) and of the "
        "fastest ED run (b=4, kv_max=2)"
    )
    assert lines[head + 2 : head + 4] == [
        "| BM (paper) | 13 | 512 | 0.385 | 17.0 | 1.42x | 1.36x |",
        "| BM (question) | 11 | 512 | 0.846 | 12.6 | 1.05x | 1.01x |",
    ]
    masked = report.mask_timings(text).splitlines()
    assert masked[head + 3] == "| BM (question) | 11 | 512 | 0.846 | t/s | t/s | t/s |"
    assert report.mask_timings(text) == report.mask_timings(report.format_report(_same_memory_runs(speed=3.0)))
    plain = [{k: v for k, v in s.items() if k != "same_memory_budget_bytes"} for s in _same_memory_runs()]
    assert "tokens/s / FKV" not in report.format_report(plain)  # only the same-memory run has the table


def test_same_memory_ratios_divide_by_the_faster_fkv_and_say_which():
    """The paper's static FKV beside the continuous one: every same-memory ratio divides by the faster of the two and
    names it; a slower static FKV leaves the continuous one the reference."""
    static = dict(_same_memory_runs()[0], batch_size=3, tokens_per_s=15.0, paper_setting=True)
    lines = report.format_report([*_same_memory_runs(), static]).splitlines()
    head = lines.index("| method | b | kv_max | contains | tokens/s | tokens/s / FKV | tokens/s / ED |")
    assert "the fastest FKV run (b=3, the paper's static padded batch)" in lines[head - 2]
    assert lines[head + 3] == "| BM (question) | 11 | 512 | 0.846 | 12.6 | 0.84x | 1.01x |"
    assert any("| BM (question) | 11 | 512 | 0.846 |" in x and "| 0.84x |" in x for x in lines[head + 4 :])
    slower = dict(static, tokens_per_s=10.0)
    lines = report.format_report([*_same_memory_runs(), slower]).splitlines()
    head = lines.index("| method | b | kv_max | contains | tokens/s | tokens/s / FKV | tokens/s / ED |")
    assert "the fastest FKV run (b=4, continuous)" in lines[head - 2]
    assert lines[head + 3] == "| BM (question) | 11 | 512 | 0.846 | 12.6 | 1.05x | 1.01x |"


def test_metric_plot_tells_the_rules_apart(tmp_path):
    fig = report.plot_metric_vs_kv(_same_memory_runs(), tmp_path / "m.png")
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["ED (decoding-only eviction)", "FKV (full KV cache), b=4", "BM (Batch-Max)", "BM (question)"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    styles = {label: (h.get_marker(), h.get_color()) for h, label in zip(handles, labels) if label.startswith("BM")}
    assert styles["BM (Batch-Max)"] != styles["BM (question)"]
    assert styles["BM (Batch-Max)"][0] != styles["BM (question)"][0]  # a marker of its own, not only a colour
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparable_ignores_only_timings(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, seconds in ((a, 1.0), (b, 9.0)):
        summaries = _paper_table1_cnn()
        for s in summaries:
            s["tokens_per_s"] = None if s["status"] == "oom" else s["tokens_per_s"] * seconds
            s["wall_s"] = seconds
        report.write_report(folder, summaries)
        results.RunLog(folder / "run").append(_samples(["0"]), [_batch(0, ["0"], decode_s=seconds)])
    assert results.comparable(a) == results.comparable(b)
    assert set(results.comparable(a)) == {"report.md", "results.csv", "run/samples.jsonl", "run/batches.jsonl"}
    results.RunLog(b / "run").append(_samples(["1"]), [_batch(1, ["1"])])
    assert results.comparable(a) != results.comparable(b)


# ---------------------------------------------------------------------- configs
def _yaml(tmp_path, data) -> str:
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"runs": [{"method": "bm", "batch_size": 4, "kv_max": 64}]}, "runs[0].kv_max"),  # kv_max must be > p
        ({"runs": [{"method": "fkv", "batch_size": 1}, {"method": "bm", "batch_size": 0}]}, "runs[1].batch_size"),
        ({"runs": [{"method": "bm", "batch_size": "8"}]}, "runs[0].batch_size"),
        ({"runs": [{"method": "ed", "batch_size": 2, "kv_max": True}]}, "runs[0].kv_max"),
        ({"runs": [{"method": "lru", "batch_size": 2}]}, "runs[0].method"),
        ({"runs": [{"method": "bm", "batch_size": 2, "kvmax": 128}]}, "runs[0].kvmax"),  # unknown key
        ({"runs": [{"batch_size": 2}]}, "runs[0].method"),  # missing
        ({"runs": ["bm"]}, "runs[0]"),
        ({"runs": [{"method": "fkv", "batch_size": 2}, {"method": "fkv", "batch_size": 2, "kv_max": 9}]}, "runs[1]"),
        ({"runs": []}, "runs"),
        ({"runs": {"method": "bm"}}, "runs"),
        ({"task": "squad"}, "task"),
        ({"metric": "bleu"}, "metric"),
        ({"task": "gsm8k", "num_shots": -1}, "num_shots"),
        ({"num_shots": 2}, "num_shots"),  # JSONL prompts have no shots
        ({"max_input_tokens": 0}, "max_input_tokens"),
        ({"task": "gsm8k", "data": "/nonexistent/folder"}, "data"),
        ({"task": "gsm8k", "data": "not a hub id"}, "data"),
        ({"task": "gsm8k", "max_input_tokens": "4k"}, "max_input_tokens"),
    ],
)
def test_bad_configs_are_rejected_naming_the_key(tmp_path, data, key):
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", _yaml(tmp_path, data)])
    message = str(info.value)
    assert message.startswith(f"{key}:") and "\n" not in message, message


def test_good_task_configs(tmp_path):
    cfg = parse_args(
        [
            "--config",
            _yaml(
                tmp_path,
                {
                    "task": "narrativeqa",
                    "data": "deepmind/narrativeqa",
                    "runs": [
                        {"method": "ed", "batch_size": 5, "kv_max": 2},
                        {"method": "fkv", "batch_size": 4},
                        {"method": "bm", "batch_size": 16},
                    ],
                },
            ),
        ]
    )
    assert [s.name for s in cfg.sweep.run_specs()] == ["ed-b5-kv2", "fkv-b4", "bm-b16-kv512"]
    assert cfg.data.shots_for_task() == 2 and cfg.data.metric_for_task() == "rouge2" and not cfg.main_job
    assert cfg.data.max_input_tokens == 3584 and RunConfig().data.task == "jsonl" and RunConfig().main_job
    assert (
        parse_args(["--task", "gsm8k", "--data", str(tasks.fixture_dir("gsm8k"))]).data.metric_for_task() == "accuracy"
    )
    resolved = _yaml(tmp_path, cfg.to_dict())
    assert parse_args(["--config", resolved]) == cfg  # the written config.yaml loads back


def test_default_yaml_is_the_builtin_defaults_plus_the_default_sweep():
    import yaml

    from batchmax_tp.config.run import SETTINGS

    path = ROOT / "configs" / "default.yaml"
    assert set(yaml.safe_load(path.read_text())) == set(SETTINGS)  # it says it spells out every key
    cfg = RunConfig.from_yaml(path)
    # ... and its own out: the plain run (results/main) and this sweep never write into one folder.
    assert cfg == RunConfig().replace(max_new_tokens=24, runs=cfg.sweep.runs, out="results/default")
    assert not cfg.main_job and cfg.listed_by == ["methods", "batch_size", "runs"]  # a listed sweep
    assert RunConfig().output.dir != cfg.output.dir and [s.name for s in cfg.sweep.run_specs()] == [
        "fkv-b3",
        "ed-b1-kv2",
        "ed-b3-kv2",
        "bm-b3-kv256",
        "bm-b3-kv512",
        "bm-b6-kv512",
    ]


def test_paper_configs_match_the_paper_tables():
    from batchmax_tp.config import TASK_NAMES

    assert TASK_NAMES == tasks.TASK_NAMES and metrics.METRICS == ("rouge2", "accuracy", "exact", "contains")
    expected = {  # Tables 1 and 2: (method, b, kv_max)
        "llama2_cnn_dailymail": ("ed-b5-kv2 ed-b4-kv2 ed-b4-kv65 fkv-b4 bm-b32-kv1024 bm-b40-kv896", 4),
        "llama2_narrativeqa": ("ed-b5-kv2 ed-b4-kv2 ed-b4-kv65 fkv-b4 bm-b15-kv1792 bm-b16-kv1728", 4),
        "llama2_gsm8k": ("ed-b4-kv2 ed-b3-kv2 ed-b3-kv65 fkv-b3 bm-b8-kv1536 bm-b10-kv1408", 2),
        "phi35_cnn_dailymail": ("ed-b3-kv2 ed-b2-kv2 fkv-b2 bm-b5-kv2176", 4),
        "phi35_narrativeqa": ("ed-b3-kv2 ed-b2-kv2 fkv-b2 bm-b6-kv1984", 4),
        "phi35_gsm8k": ("ed-b3-kv2 ed-b2-kv2 fkv-b2 bm-b8-kv1664", 4),
    }
    import yaml

    assert sorted(p.stem for p in (ROOT / "configs" / "paper").glob("*.yaml")) == sorted(expected)
    for name, (runs, tp) in expected.items():
        raw = yaml.safe_load((ROOT / "configs" / "paper" / f"{name}.yaml").read_text())
        raw["device"] = "cpu"  # validation only: no GPU here
        cfg = RunConfig.from_dict(raw)
        assert " ".join(s.name for s in cfg.sweep.run_specs()) == runs, name
        assert (
            cfg.parallel.tp_size,
            cfg.data.num_samples,
            cfg.generation.max_new_tokens,
            cfg.data.max_input_tokens,
            cfg.sweep.p,
        ) == (
            tp,
            960,
            512,
            3584,
            64,
        )
        assert (
            cfg.generation.ignore_eos and cfg.data.task in name and cfg.data.path == tasks.TASKS[cfg.data.task].hub_id
        )
        assert cfg.model.name == (
            "meta-llama/Llama-2-13b-chat-hf" if "llama2" in name else "microsoft/Phi-3.5-mini-instruct"
        )
        assert all(960 % s.batch_size == 0 for s in cfg.sweep.run_specs())


# ---------------------------------------------------------------------- whole runs (tiny model, real tokenizer)
RUN_PY = ROOT / "launch" / "run.py"


@pytest.fixture
def tiny_stack(monkeypatch, tokenizer):
    """launch/run.py with a tiny random Llama (the embedded tokenizer's vocabulary) and a counting engine."""
    from tiny import tiny_llama

    import batchmax_tp.eval.context as context  # the run path looks its ``Engine`` up here at call time
    import batchmax_tp.models as models

    model = tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=2048)
    calls = []

    def counting(engine, requests):
        if requests[0].max_new_tokens <= 2:
            calls.append(0)  # the warm-up
        elif engine.batching.policy == "static":
            calls.append(len(requests))  # a timed batch's size
            if stack.fail_at is not None and len([c for c in calls if c]) == stack.fail_at:
                raise stack.error

    stack = type("Stack", (), {})()
    stack.calls, stack.fail_at, stack.error = calls, None, None
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, tokenizer))
    monkeypatch.setattr(context, "Engine", counting_engine(counting))
    return stack


def _sweep_args(out, **extra):
    args = {
        "task": "narrativeqa",
        "max_input_tokens": 420,
        "max_new_tokens": 3,
        "p": 32,
        "device": "cpu",
        "log_level": "WARNING",
        "out": str(out),
        "scheduler": "static",  # batches of batch_size: what the counting engine counts
        "num_samples": 5,
        "runs": [
            {"method": "fkv", "batch_size": 2},
            {"method": "ed", "batch_size": 2, "kv_max": 2},
            {"method": "bm", "batch_size": 2, "kv_max": 128},
            {"method": "bm", "batch_size": 5, "kv_max": 128},
        ],
    }
    args.update(extra)
    return args


def test_sweep_writes_results_report_and_plots(tmp_path, tiny_stack, capsys):
    out = tmp_path / "res"
    rc = cli.main(["--config", _yaml(tmp_path, _sweep_args(out))])
    assert rc == 0
    runs = ["fkv-b2", "ed-b2-kv2", "bm-b2-kv128", "bm-b5-kv128"]
    assert sorted(os.listdir(out)) == sorted(["config.yaml", *report.REPORT_FILES, *runs])
    printed = capsys.readouterr().out
    assert (
        printed == (out / "report.md").read_text()
        and "| Method | b | kv_max | rouge-2 | correct | tokens/s |" in printed
    )
    ids = None
    for name in runs:
        assert sorted(os.listdir(out / name)) == ["batches.jsonl", "samples.jsonl", "summary.json"]
        rows = [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]
        assert all(tuple(r) == results.SAMPLE_KEYS for r in rows)
        # The same seeded samples, in the same order, whatever the method and batch size.
        assert ids is None or [r["id"] for r in rows] == ids
        ids = [r["id"] for r in rows]
        assert all(r["prompt_tokens"] <= 420 and isinstance(r["reference"], list) for r in rows)
        batches = [json.loads(line) for line in (out / name / "batches.jsonl").read_text().splitlines()]
        assert all(tuple(b) == results.BATCH_KEYS and all(n > 0 for n in b["tokens_cut"]) for b in batches)
        assert [i for b in batches for i in b["ids"]] == ids
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["status"] == "done" and summary["num_samples"] == 5 and summary["samples_cut"] == 5
        assert summary["metric"] == "rouge2" and summary["num_shots"] == 2 and 0.0 <= summary["score"] <= 1.0
    assert ids == [str(i) for i in tasks.select_indices(6, 5, seed=0)]
    assert [c for c in tiny_stack.calls if c] == [2, 2, 1] * 3 + [5]
    assert (out / "results.csv").read_text().count("\n") == 5


def test_resume_after_a_crash_gives_the_same_files(tmp_path, tiny_stack):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run_py = cli
    assert run_py.main(["--config", _yaml(tmp_path, _sweep_args(whole))]) == 0
    timed_whole = [c for c in tiny_stack.calls if c]
    tiny_stack.calls.clear()

    # Crash in the 5th timed batch: the 2nd batch of ed-b2-kv2 (fkv-b2 has 3 batches, done and summarised).
    tiny_stack.fail_at, tiny_stack.error = 5, KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        run_py.main(["--config", _yaml(tmp_path, _sweep_args(crashed))])
    log = crashed / "ed-b2-kv2" / "samples.jsonl"
    assert log.read_text().count("\n") == 2 and not (crashed / "ed-b2-kv2" / "summary.json").exists()
    with open(log, "a", encoding="utf-8") as fh:  # as if killed while writing batch 1
        fh.write(log.read_text().splitlines()[0].replace('"batch": 0', '"batch": 1')[:40])

    tiny_stack.calls.clear()
    tiny_stack.fail_at = None
    assert run_py.main(["--config", _yaml(tmp_path, _sweep_args(crashed))]) == 0
    # Only what was missing ran: ed's batches 1 and 2, then the two bm runs.
    assert [c for c in tiny_stack.calls if c] == [2, 1, 2, 2, 1, 5] and len(timed_whole) == 10
    assert results.comparable(crashed) == results.comparable(whole)
    assert len(results.comparable(whole)) == 14  # 4 x (samples.jsonl, batches.jsonl, summary.json), report, csv

    # A finished sweep run again: nothing is generated, the report is rewritten.
    tiny_stack.calls.clear()
    (crashed / "report.md").unlink()
    assert run_py.main(["--config", _yaml(tmp_path, _sweep_args(crashed))]) == 0
    assert tiny_stack.calls == [] and results.comparable(crashed) == results.comparable(whole)


def test_resume_refuses_another_configuration(tmp_path, tiny_stack, capsys, monkeypatch):
    out = tmp_path / "res"
    run_py = cli
    assert run_py.main(["--config", _yaml(tmp_path, _sweep_args(out))]) == 0
    capsys.readouterr()
    import batchmax_tp.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("must stop before loading the model"))
    rc = run_py.main(["--config", _yaml(tmp_path, _sweep_args(out, max_new_tokens=4))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: out: ") and "max_new_tokens=3" in err and "\n" not in err


def test_out_of_memory_is_an_oom_row_and_the_sweep_goes_on(tmp_path, tiny_stack, capsys):
    import torch

    out = tmp_path / "res"
    tiny_stack.fail_at, tiny_stack.error = 10, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert cli.main(["--config", _yaml(tmp_path, _sweep_args(out))]) == 0
    summary = json.loads((out / "bm-b5-kv128" / "summary.json").read_text())
    assert summary["status"] == "oom" and "out of memory" in summary["error"] and summary["num_samples"] == 0
    assert "| BM | 5 | 128 | OOM | - | OOM | OOM |" in (out / "report.md").read_text()
    assert "bm,5,128,32,oom" in (out / "results.csv").read_text()


def test_data_errors_stop_before_the_model(tmp_path, tiny_stack, capsys, monkeypatch):
    import batchmax_tp.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("must stop before loading the model"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"question": "q", "answer": "a #### 1"}\n' * 16)
    (bad / "test.jsonl").write_text('{"text": "wrong schema"}\n')
    rc = cli.main(["--config", _yaml(tmp_path, _sweep_args(tmp_path / "o", task="gsm8k", data=str(bad)))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: data: cannot load task gsm8k") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_sigkill_loses_at_most_the_batch_in_flight(tmp_path, tokenizer):
    """A real process killed with SIGKILL mid-run, then resumed: the same files as an uninterrupted run."""
    import signal
    import subprocess
    import time

    from tiny import tiny_llama

    model_dir = tmp_path / "tiny"
    tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=2048).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"Question {i}: say something about the number {i}.", "reference": str(i)})
            + "\n"
            for i in range(12)
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def cmd(out):
        return [
            sys.executable,
            str(RUN_PY),
            "--config",
            _yaml(
                tmp_path,
                {
                    "model": str(model_dir),
                    "data": str(data),
                    "device": "cpu",
                    "max_new_tokens": 32,
                    "p": 4,
                    "out": str(out),
                    "log_level": "WARNING",
                    "runs": [{"method": "bm", "batch_size": 1, "kv_max": 8}],
                },
            ),
        ]

    def batches_done(out):
        log = out / "bm-b1-kv8" / "batches.jsonl"
        return log.read_text().count("\n") if log.exists() else 0

    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while batches_done(killed) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = batches_done(killed)
    assert 3 <= done_at_kill < 12 and not (killed / "bm-b1-kv8" / "summary.json").exists()

    assert subprocess.run(cmd(killed), env=env, capture_output=True, timeout=300).returncode == 0
    whole = tmp_path / "whole"
    assert subprocess.run(cmd(whole), env=env, capture_output=True, timeout=300).returncode == 0
    assert results.comparable(killed) == results.comparable(whole)
    assert len(results.comparable(whole)["bm-b1-kv8/samples.jsonl"]) == 12


def test_the_main_jobs_paper_setting_runs_static_beside_continuous_and_is_reported_apart(tmp_path):
    """``plan.budget.paper_setting_specs``: ED (kv_max 2) and FKV in fixed slots at the paper's b0 - 1, BM paper at
    its continuous batch, all static and named so; the report puts them in their own section (with BM's gain over ED
    in each setting) and leaves them out of the same-memory tables and the claim."""
    from batchmax_tp.core.method import Method
    from batchmax_tp.plan.budget import RunSpec, paper_setting_specs
    from batchmax_tp.plan.planner import ModelShape, paper_ed_bytes, predict_pool
    from batchmax_tp.plan.tuner import planned_b0

    shape = ModelShape(30, 576, 1536, 9, 3, 64, 49152, 134_515_008)
    budget = predict_pool(shape, Method("fkv"), 4, 1024, 64).total
    bm = RunSpec(Method("bm", kv_max=512), 13)
    specs = paper_setting_specs(shape, 1024, 64, budget, bm, p=64)
    b0 = planned_b0(budget, shape, 1024, 64, dtype="float32", p=64)
    assert paper_ed_bytes(shape, b0 - 1, 1024, 64) <= budget < paper_ed_bytes(shape, b0, 1024, 64)
    assert [(s.name, s.policy) for s in specs] == [
        (f"static-ed-b{b0 - 1}-kv2", "static"),
        (f"static-fkv-block0-chunk0-b{specs[1].batch_size}", "static"),
        ("static-bm-b13-kv512", "static"),
    ]
    assert 0 < specs[1].batch_size <= b0 - 1 and specs[1].method.block == 0
    assert paper_setting_specs(shape, 1024, 64, paper_ed_bytes(shape, 1, 1024, 64) - 1, bm, p=64) == []

    runs = _same_memory_runs()
    runs += [
        {**runs[1], "batch_size": 3, "tokens_per_s": 10.0, "paper_setting": True},  # ED static
        {**runs[0], "batch_size": 3, "tokens_per_s": 9.0, "paper_setting": True},  # FKV static
        {**runs[3], "batch_size": 13, "tokens_per_s": 15.0, "paper_setting": True},  # BM static
    ]
    text = report.format_report(runs)
    section = text[text.index("## The paper's setting beside the continuous engine") :].splitlines()
    assert "| ED | 3 | 10.0 | 4 | 12.5 |" in section and "| BM | 13 | 15.0 | 13 | 17.0 |" in section
    assert "BM (paper) over ED: static (the paper's setting) +50%, continuous +36%." in section
    assert "| ED, static | 3 |" in text  # the first table lists every run
    same = text[text.index("## Same memory") : text.index("## Every method")]
    assert "ED, static" not in same and "b=4, kv_max=2" in same  # the fastest continuous ED, not the static one
    assert report.format_report(runs[:5]).count("paper's setting") == 0
