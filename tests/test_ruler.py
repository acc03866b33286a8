"""The offline RULER-style suite (``configs/lm_eval/ruler``, issue 32): its generator is deterministic and its halves
disjoint, its prompts hold their answers and fill their lengths, its score is RULER's ``string_match_all``, its
tasks load in lm-eval and run through lm-eval's command line with ``--model batchmax`` (FKV) as with ``--model hf``,
and ``launch/bench_ruler.py`` runs and tabulates them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "configs" / "lm_eval" / "ruler"
sys.path.insert(0, str(ROOT / "launch"))

import bench_ruler  # noqa: E402


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _script(SUITE / "build.py")
scoring = _script(SUITE / "ruler_utils.py")
NAMES = [build.task_name(t, n, h) for h in build.HALVES for n in build.SHORT for t in build.TASKS]


def suite_docs() -> dict[tuple[str, str, str], list[dict]]:
    """The committed documents: (task, length, half) -> documents."""
    return folder_docs(SUITE, build.SHORT)


def folder_docs(folder: Path, lengths) -> dict[tuple[str, str, str], list[dict]]:
    """A built suite's documents at ``lengths``: (task, length, half) -> documents."""
    return {
        (t, n, h): [json.loads(x) for x in (folder / "data" / f"{t}_{n}_{h}.jsonl").read_text().splitlines()]
        for h in build.HALVES
        for n in lengths
        for t in build.tasks_at(n)
    }


@pytest.fixture(scope="module")
def count():
    return build.embedded_counter()


# -- the generator --------------------------------------------------------------------------------------------------
def test_the_generator_is_deterministic_and_wrote_the_committed_suite(tmp_path, count):
    """Two builds (one document per task, length and half) write the same bytes, their documents are the
    committed files' first ones (each document has its own stream), and the task yamls equal the committed ones
    but for the data folder; another seed draws other documents."""
    a, b = tmp_path / "a", tmp_path / "b"
    build.build(a, count, per_half=1)
    build.build(b, count, per_half=1)
    names = sorted(p.name for p in (a / "data").iterdir())
    assert len(names) == 28 and names == sorted(p.name for p in (SUITE / "data").iterdir())
    for name in names:
        got = (a / "data" / name).read_bytes()
        assert got == (b / "data" / name).read_bytes(), name
        assert got == (SUITE / "data" / name).read_bytes().splitlines(keepends=True)[0], name
    yamls = sorted(p.name for p in SUITE.glob("*.yaml"))
    assert len(yamls) == 28 + 6 and yamls == sorted(p.name for p in a.glob("*.yaml"))
    for name in yamls:
        mine = (a / name).read_text().replace(str(a / "data"), "configs/lm_eval/ruler/data")
        assert mine == (SUITE / name).read_text(), name
    assert (a / build.UTILS).read_bytes() == (SUITE / build.UTILS).read_bytes()
    fx = build.load_fixture()
    words = build.split_vocabulary(build.vocabulary(fx), 0)["tune"]
    one = build.document("niah_single", "2k", "tune", 0, 0, fx, words, count)
    assert one == json.loads((a / "data" / "niah_single_2k_tune.jsonl").read_text())
    other = build.document("niah_single", "2k", "tune", 0, 1, fx, words, count)
    assert other["outputs"] != one["outputs"] and other["input"] != one["input"]


def test_halves_share_no_key_value_or_word():
    docs = suite_docs()
    seen = {h: set() for h in build.HALVES}
    for (task, _, half), ds in docs.items():
        for d in ds:
            assert d["task"] == task and d["half"] == half
            words = set(d["needles"])
            if task == "cwe":  # every listed word
                words |= set(re.findall(r"\d+\. ([a-z]+)", d["input"]))
            if task == "fwe":  # every coded word
                words |= set(d["input"].split("\n\n")[1].split()) - {"..."}
            seen[half] |= words
    assert len(seen["tune"]) > 500 and len(seen["heldout"]) > 500
    assert not seen["tune"] & seen["heldout"]


def holds_its_answers(task: str, length: str, d: dict) -> None:
    """Needles stated once in the text; the variable chain in order; cwe's 10 words the only frequent ones; fwe's 3
    words strictly the most frequent coded words."""
    text, out = d["input"], d["outputs"]
    assert set(out) <= set(d["needles"])
    if task.startswith("niah"):
        stated = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)
        assert sorted(v for _, v in stated) == sorted(v for v in d["needles"] if v.isdigit())
        asked = text.rsplit("Question:", 1)[1]
        assert sorted(v for k, v in stated if k in asked) == sorted(out)
        assert len(out) == {"niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
    elif task == "vt":
        chain = re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d{5})\.", text)
        assert [x for x, _ in chain] == out and [y for _, y in chain] == [d["needles"][-1], *out[:-1]]
    elif task == "cwe":
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", text)).most_common()
        top = 6 if length == "2k" else 30
        assert sorted(w for w, _ in counts[:10]) == sorted(out) and counts[9][1] == top > counts[10][1]
    else:
        counts = Counter(text.split("\n\n")[1].split()).most_common(5)
        assert [w for w, _ in counts[1:4]] == out and counts[0][0] == "..."
        assert counts[1][1] > counts[2][1] > counts[3][1] > counts[4][1]


def fills_its_length(task: str, length: str, d: dict, count) -> None:
    """The prompt plus its max_gen_toks fits the length, the prompt within 2 % of it (the embedded tokenizer)."""
    budget = build.LENGTHS[length] - build.TASKS[task]
    assert d["max_gen_toks"] == build.TASKS[task] and d["length"] == build.LENGTHS[length]
    assert count(d["input"]) == d["tokens"]
    assert 0.98 * budget <= d["tokens"] <= budget, (task, length, d["id"], d["tokens"])


def test_every_prompt_holds_its_answers():
    for (task, length, _), ds in suite_docs().items():
        assert len(ds) == build.DEFAULT_PER_HALF
        for d in ds:
            holds_its_answers(task, length, d)


def test_prompts_fill_their_lengths_under_the_embedded_tokenizer(count):
    for (task, length, _), ds in suite_docs().items():
        for d in ds:
            fills_its_length(task, length, d, count)


def test_the_long_documents_are_built_alike_twice_and_hold_their_answers(tmp_path, count):
    """8k, 16k and 32k: the needle tasks that ask one key and vt, in both halves, one document each here (the
    default builds 8 to tune on and 16 held out at 8k and 16k, 2 and 2 at 32k: ``build.PER_HALF``); two builds write
    the same bytes, every answer is inside its document, every prompt fills its length, and no key or value is in both
    halves."""
    a, b = tmp_path / "a", tmp_path / "b"
    heard = []
    build.build(a, count, per_half=1, lengths=build.LONG, progress=heard.append)
    build.build(b, count, per_half=1, lengths=build.LONG)
    names = sorted(p.name for p in (a / "data").iterdir())
    assert len(names) == len(heard) == 2 * 3 * len(build.LONG_TASKS) == 24
    for name in names:
        assert (a / "data" / name).read_bytes() == (b / "data" / name).read_bytes(), name
    seen = {h: set() for h in build.HALVES}
    for (task, length, half), ds in folder_docs(a, build.LONG).items():
        assert len(ds) == 1 and task in build.LONG_TASKS
        for d in ds:
            holds_its_answers(task, length, d)
            fills_its_length(task, length, d, count)
            seen[half] |= set(d["needles"])
    assert not seen["tune"] & seen["heldout"]
    assert [build.documents_at(n, "heldout") for n in build.LONG] == [16, 16, 2]
    assert [build.documents_at(n, "tune") for n in build.LONG] == [8, 8, 2]
    assert [build.documents_at(n, "heldout", 4) for n in build.LONG] == [4, 4, 2]  # a smaller suite: its first ones
    assert build.documents_at("2k", "heldout") == build.DEFAULT_PER_HALF
    assert (a / "batchmax_ruler_tune_32k.yaml").is_file() and not (a / "batchmax_ruler_tune.yaml").exists()


def test_the_larger_halves_last_documents_hold_their_answers_and_are_built_alike_twice(count):
    """Issue 68's larger halves: the last held-out document (16th) and the last tuning one (8th) of each long task at
    8k hold their answers and fill their length, each from its own stream (built twice: the same document), and the
    held-out one shares no key or value with the tuning one."""
    fx = build.load_fixture()
    words = build.split_vocabulary(build.vocabulary(fx), build.DEFAULT_SEED)
    for task in build.LONG_TASKS:
        last = {h: build.documents_at("8k", h) - 1 for h in build.HALVES}
        docs = {h: build.document(task, "8k", h, i, build.DEFAULT_SEED, fx, words[h], count) for h, i in last.items()}
        for half, d in docs.items():
            assert d["id"] == last[half] and d["half"] == half
            holds_its_answers(task, "8k", d)
            fills_its_length(task, "8k", d, count)
        assert not set(docs["tune"]["needles"]) & set(docs["heldout"]["needles"])
    again = build.document("vt", "8k", "heldout", 15, build.DEFAULT_SEED, fx, words["heldout"], count)
    assert again == build.document("vt", "8k", "heldout", 15, build.DEFAULT_SEED, fx, words["heldout"], count)


# -- scoring and lm-eval --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "outputs, text, want",
    [
        (["1234567", "7654321"], " 1234567, 7654321.", 1.0),
        (["1234567", "7654321"], ": 7654321 and 1234568", 0.5),
        (["1234567", "7654321"], " none of them", 0.0),
        (["KDDBG", "ARPTI", "AUEKV", "HUFZR"], " kddbg, arpti (and so on)", 0.5),
        (["spell"], "1. Spell 2. violin", 1.0),
    ],
)
def test_score_is_the_share_of_expected_strings_found(outputs, text, want):
    assert scoring.process_results({"outputs": outputs}, [text]) == {"string_match_all": want}


def test_every_task_and_group_loads_in_lm_eval(monkeypatch):
    """Both halves' groups load their 14 tasks each (two length groups of 7); each task reads its documents, shows
    the prompt as is, generates greedily within max_gen_toks and scores through ruler_utils."""
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # data_files are relative to the repository root
    manager = TaskManager(include_path=str(SUITE), include_defaults=False)
    loaded = manager.load(["batchmax_ruler_tune", "batchmax_ruler_heldout"])
    assert sorted(loaded["tasks"]) == sorted(NAMES)
    assert loaded["group_map"]["batchmax_ruler_tune"] == ["batchmax_ruler_tune_2k", "batchmax_ruler_tune_4k"]
    assert sorted(loaded["group_map"]["batchmax_ruler_heldout_4k"]) == sorted(n for n in NAMES if "_4k_heldout" in n)
    for name, task in loaded["tasks"].items():
        docs = list(task.test_docs())
        assert len(docs) == build.DEFAULT_PER_HALF
        kwargs = task.config.generation_kwargs
        assert kwargs["max_gen_toks"] == docs[0]["max_gen_toks"] and kwargs["do_sample"] is False
        assert kwargs["until"] == (["\n\n"] if name.startswith("batchmax_ruler_niah") else [])
        assert task.doc_to_text(docs[0]) == docs[0]["input"]
        assert task.process_results(docs[0], [", ".join(docs[0]["outputs"])]) == {"string_match_all": 1.0}
        assert task.process_results(docs[0], [""]) == {"string_match_all": 0.0}


# -- lm-eval's command line and the bench ---------------------------------------------------------------------------
def _samples(folder: Path, task: str) -> list[dict]:
    return [json.loads(x) for x in next(folder.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]


def test_cli_batchmax_fkv_equals_hf_and_the_bench_tabulates(tiny_dir, tmp_path):
    """One document of two tasks (one stopping at a blank line, one not) through ``batchmax-lm-eval`` with
    ``--model batchmax`` (FKV) and through lm-eval's own ``hf`` model (``simple_evaluate`` in this process, as its
    command line runs it): the same texts and scores. ``bench_ruler`` (FKV and BM on the loaded model) gives FKV's
    text again, and writes its tables from lm-eval's results."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from multiproc import ROOT, lm_eval_cli

    tasks = ["batchmax_ruler_niah_multivalue_2k_tune", "batchmax_ruler_vt_2k_heldout"]
    common = ["--tasks", ",".join(tasks), "--include_path", "configs/lm_eval/ruler", "--limit", "1", "--log_samples"]
    args = ["--model", "batchmax", "--model_args", f"pretrained={tiny_dir},method=fkv"]
    done = lm_eval_cli(*args, *common, "--output_path", str(tmp_path / "batchmax"))
    assert done.returncode == 0, done.stderr[-3000:]
    hf = simple_evaluate(
        model="hf",
        model_args=f"pretrained={tiny_dir},dtype=float32",
        device="cpu",
        tasks=tasks,
        limit=1,
        log_samples=True,
        task_manager=TaskManager(include_path=str(Path(ROOT) / "configs" / "lm_eval" / "ruler")),
    )
    runs = {"batchmax": {t: _samples(tmp_path / "batchmax", t) for t in tasks}, "hf": hf["samples"]}
    for t in tasks:
        hf, ours = runs["hf"][t], runs["batchmax"][t]
        assert len(hf) == 1 and hf[0]["resps"][0][0], t  # one document, a non-empty text
        assert [s["resps"] for s in ours] == [s["resps"] for s in hf], t
        assert [s["string_match_all"] for s in ours] == [s["string_match_all"] for s in hf], t

    out = tmp_path / "bench"
    argv = ["--pretrained", tiny_dir, "--tasks", "niah_multivalue", "--lengths", "2k", "--limit", "1"]
    argv += ["--configs", "fkv", "bm:128:paper", "--p", "32", "--batch-size", "2", "--log-samples", "--out", str(out)]
    assert bench_ruler.main(argv) == 0
    table = json.loads((out / "table.json").read_text())
    assert [c["label"] for c in table["configs"]] == ["fkv", "bm 128 paper"]
    for config in table["configs"]:
        res = json.loads((out / config["results"]).read_text())
        assert config["scores"] == {"niah_multivalue 2k": res["results"][tasks[0]]["string_match_all,none"]}
        assert config["tokens_per_s"] > 0 and config["peak_kv_bytes"] > 0
    fkv = json.loads((out / table["configs"][0]["results"]).read_text())["samples"][tasks[0]]
    assert [s["resps"] for s in fkv] == [s["resps"] for s in runs["hf"][tasks[0]]]
    bm = table["configs"][1]
    assert bm["peak_kv_bytes"] < table["configs"][0]["peak_kv_bytes"]  # kv_max 128 of a ~2k prompt
    assert "| niah_multivalue 2k |" in (out / "table.md").read_text()

    again = tmp_path / "again"  # FKV's row read back from that run: only BM runs
    argv = [
        "--pretrained",
        tiny_dir,
        "--tasks",
        "niah_multivalue",
        "--lengths",
        "2k",
        "--limit",
        "1",
        "--out",
        str(again),
    ]
    argv += ["--configs", "bm:128:question", "--p", "32", "--batch-size", "2", "--fkv-from", str(out / "table.json")]
    assert bench_ruler.main(argv) == 0
    rows = json.loads((again / "table.json").read_text())["configs"]
    assert [r["label"] for r in rows] == ["fkv", "bm 128 question"] and rows[0]["reused_from"]
    assert (rows[0]["scores"], rows[0]["documents"]) == (
        table["configs"][0]["scores"],
        table["configs"][0]["documents"],
    )
    assert sorted(p.name for p in again.iterdir() if p.is_dir()) == ["01_bm_128_question"]  # FKV did not run
    assert "fkv's row is from" in (again / "table.md").read_text()

    picked = tmp_path / "pick"
    argv = ["--pretrained", tiny_dir, "--tasks", "niah_multivalue", "--lengths", "2k", "--limit", "2", "--pick"]
    argv += ["--configs", "bm:128:paper", "bm:128:question", "--p", "32", "--batch-size", "2", "--out", str(picked)]
    assert bench_ruler.main(argv) == 0
    report = json.loads((picked / "pick.json").read_text())
    tuned = {r["label"]: r for r in report["tuned"]}
    choice = max(["bm 128 paper", "bm 128 question"], key=lambda label: tuned[label]["mean"])
    assert [r["label"] for r in report["heldout"]] == ["fkv", choice]  # only the pick runs on the held-out half
    assert all(len(docs) == 2 for r in report["heldout"] for docs in r["documents"].values())
    assert f"| 128 | {choice} |" in (picked / "pick.md").read_text()


def test_the_bench_resumes_per_document(tiny_dir, tmp_path, monkeypatch):
    """A run stopped after BM's first answered document, started again with the same flags: FKV's row is read back,
    BM answers that document from its response cache and serves only the other, and the table equals that of a run
    never stopped (scores and each document's)."""
    from batchmax_tp.harness import BatchMaxLM

    argv = ["--pretrained", tiny_dir, "--tasks", "niah_multivalue", "--lengths", "2k", "--limit", "2"]
    argv += ["--configs", "bm:128:paper", "--p", "32", "--batch-size", "1"]
    whole = tmp_path / "whole"
    assert bench_ruler.main([*argv, "--out", str(whole)]) == 0

    class Stop(Exception):
        pass

    serve = BatchMaxLM._serve

    def stopping(self, requests, slots, on_finish, *rest):
        def first_then_stop(i, output):
            on_finish(i, output)
            if self.method.evicts:
                raise Stop

        return serve(self, requests, slots, first_then_stop, *rest)

    out = tmp_path / "stopped"
    monkeypatch.setattr(BatchMaxLM, "_serve", stopping)
    with pytest.raises(Stop):
        bench_ruler.main([*argv, "--out", str(out)])
    monkeypatch.setattr(BatchMaxLM, "_serve", serve)
    assert (out / "00_fkv" / "row.json").is_file() and not (out / "01_bm_128_paper" / "row.json").exists()
    assert bench_ruler.main([*argv, "--out", str(out)]) == 0
    rows = json.loads((out / "table.json").read_text())["configs"]
    full = json.loads((whole / "table.json").read_text())["configs"]
    assert [(r["scores"], r["documents"]) for r in rows] == [(r["scores"], r["documents"]) for r in full]
    assert "resumed_documents" not in rows[0] and rows[1]["resumed_documents"] == 1
    assert "bm 128 paper was resumed: 1 documents were answered before a restart" in (out / "table.md").read_text()


def test_the_pick_is_the_best_tuning_share_at_each_budget_and_reports_held_out():
    def row(label, kv, share, interval=None):
        mean = 0.5 * (share or 0)  # FKV's mean: 0.5
        return {"label": label, "model_args": {"kv_max": kv}, "mean": mean, "share_of_fkv": share, "interval": interval}

    tuned = [row("fkv", None, 1.0), row("a 512", 512, 0.8), row("b 512", 512, 0.9), row("a 256", 256, 0.7)]
    tuned += [row("b 256", 256, 0.7), row("c 256", 256, 0.6)]
    picks = bench_ruler.pick(tuned)
    assert {kv: r["label"] for kv, r in picks.items()} == {512: "b 512", 256: "a 256"}  # a tie: the first listed
    held = [{**row("fkv", None, 1.0), "mean": 0.8, "tokens_per_s": 10.0}]
    held += [row("b 512", 512, 0.95, [0.9, 1.02]), row("a 256", 256, 0.6, [0.5, 0.7]), row("a 512", 512, 1.0)]
    text = bench_ruler.format_pick(picks, held, "about")
    assert "| 512 | b 512 | 0.900 | **0.950** [0.90, 1.02] | not beyond its interval |" in text
    assert "| 256 | a 256 | 0.700 | **0.600** [0.50, 0.70] | yes |" in text


def test_fkv_from_reads_an_earlier_fkv_row_and_refuses_another_run(tmp_path, capsys):
    """``--fkv-from``: FKV's row of an earlier ``table.json`` with the same half, suite, tasks, lengths, limit and
    model; anything else is one line and exit 2 before a model loads (the model named here does not exist)."""
    fkv = {"label": "fkv", "model_args": {"method": "fkv"}, "results": "00_fkv/results.json", "scores": {"vt 2k": 0.5}}
    fkv |= {"documents": {"vt 2k": [1.0, 0.0]}, "tokens_per_s": 9.0, "slots": 4, "peak_kv_bytes": 8, "wall_s": 3.0}
    same = {"half": "tune", "suite": "configs/lm_eval/ruler", "tasks": ["vt"], "lengths": ["2k"], "limit": None}
    same |= {"model": "no-such-model"}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({**same, "dtype": "float32", "configs": [fkv]}))
    got = bench_ruler.earlier_fkv(path, same)
    assert got["dtype"] == "float32" and got["row"]["reused_from"] == str(path)
    assert {k: got["row"][k] for k in ("scores", "documents", "slots")} == {
        k: fkv[k] for k in ("scores", "documents", "slots")
    }
    with pytest.raises(ValueError, match="was run with lengths \\['2k'\\], this run has \\['4k'\\]"):
        bench_ruler.earlier_fkv(path, {**same, "lengths": ["4k"]})
    bm = {**fkv, "label": "bm 512 paper", "model_args": {"method": "bm", "kv_max": 512}}
    (tmp_path / "bm.json").write_text(json.dumps({**same, "dtype": "float32", "configs": [bm]}))
    with pytest.raises(ValueError, match="holds no FKV row"):
        bench_ruler.earlier_fkv(tmp_path / "bm.json", same)
    base = ["--pretrained", "no-such-model", "--tasks", "vt", "--lengths", "2k", "--out", str(tmp_path / "o")]
    for extra, said in ((["--half", "heldout"], "was run with half 'tune'"), (["--pick"], "not with --pick")):
        with pytest.raises(SystemExit) as stop:
            bench_ruler.main([*base, "--fkv-from", str(path), *extra])
        assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_bench_shares_of_fkv_and_configurations():
    rows = [
        {"label": "fkv", "scores": {"a 2k": 1.0, "b 2k": 0.5, "a 4k": 0.5, "b 4k": 0.0}},
        {"label": "bm", "scores": {"a 2k": 0.5, "b 2k": 0.25, "a 4k": 0.25, "b 4k": 0.0}},
    ]
    fkv, bm = bench_ruler.summarize(rows, ["a", "b"], ["2k", "4k"])
    assert fkv["mean_by_length"] == {"2k": 0.75, "4k": 0.25} and fkv["mean"] == 0.5
    assert bm["mean"] == 0.25 and bm["share_of_fkv"] == 0.5 and bm["share_by_length"] == {"2k": 0.5, "4k": 0.5}
    documents = [{"a 2k": [1.0, 1.0], "b 2k": [0.5, 0.5]}, {"a 2k": [0.5, 0.5], "b 2k": [0.25, 0.25]}]
    with_docs = bench_ruler.summarize([{**r, "documents": d} for r, d in zip(rows, documents)], ["a", "b"], ["2k"])
    assert with_docs[1]["interval"] == [0.5, 0.5]  # every resample halves every document
    # a third configuration against the second, paired: it finds cell a's whole score where bm finds half
    third = {
        "label": "bm2",
        "scores": {"a 2k": 1.0, "b 2k": 0.25},
        "documents": {"a 2k": [1.0, 1.0], "b 2k": [0.25] * 2},
    }
    rows3 = bench_ruler.summarize(
        [*({**r, "documents": d} for r, d in zip(rows, documents)), third], ["a", "b"], ["2k"]
    )
    assert "differences" not in rows3[1] and rows3[2]["differences"]["bm"] == [pytest.approx(1 / 3)] * 3
    speeds = dict(tokens_per_s=1.0, slots=1, peak_kv_bytes=2**20, wall_s=1.0)
    table = bench_ruler.format_table([{**r, **speeds} for r in rows3], ["a", "b"], ["2k"], "About.")
    assert "- bm2 - bm: **+0.333** [+0.33, +0.33]" in table
    zero = [{**rows[0], "scores": dict.fromkeys(rows[0]["scores"], 0.0)}, rows[1]]
    assert bench_ruler.summarize(zero, ["a", "b"], ["2k", "4k"])[1]["share_of_fkv"] is None
    parse = bench_ruler.parse_config
    assert parse("bm:256:snapkv:window=64,kernel=5").args == {
        "method": "bm",
        "kv_max": 256,
        "rule": "snapkv:window=64,kernel=5",
    }
    assert parse("bm:512").args["rule"] == "paper" and parse("ed:65").args == {"method": "ed", "kv_max": 65}
    assert parse("snap:256").args == {"method": "snap", "kv_max": 256}
    args = bench_ruler.parser().parse_args(["--configs", "bm:512", "--kv-max", "256", "--rules", "paper;question:x=1"])
    labels = [c.label for c in bench_ruler.configs_from_args(args)]
    assert labels == ["fkv", "bm 512 paper", "bm 256 paper", "bm 256 question:x=1"]
