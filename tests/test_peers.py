"""kvpress beside the project (issue 56): ``bench_ruler --kvpress``'s checks before any load, its documents split
where the question starts, its rows scored as lm-eval scores the tasks and joined to the table with intervals, and
kvpress's own ``SnapKVPress`` as an outside oracle for ``snap``'s kept positions.

The oracle runs kvpress's code in kvpress's environment (``scripts/peers.sh``: kvpress pins transformers < 5.3,
this package needs >= 5.17); without that interpreter it is skipped, and says so.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import PEAKED
from tiny import tiny_random_model

from batchmax_tp.bench import peers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
SCORE = __import__("bench_ruler")._script("ruler_utils").string_match_all  # the suite's own score


# -- this side: specs, the split, the scoring -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, says",
    [
        ("h2o:0.25", "the press must be one of"),
        ("snapkv", "expected PRESS:KEPT"),
        ("snapkv:0.75x", "expected PRESS:KEPT"),
        ("snapkv:1.5", "between 0 and 1"),
        ("snapkv:0", "between 0 and 1"),
    ],
)
def test_a_bad_press_spec_is_one_line(spec, says):
    with pytest.raises(ValueError, match=says) as err:
        peers.press_runs([spec], ["in"])
    assert "\n" not in str(err.value)


def test_press_runs_are_each_spec_at_each_placement_and_labelled_by_the_share_kept():
    runs = peers.press_runs(["snapkv:0.25", "expected:0.125"], ["in", "out"])
    assert [r.label for r in runs] == [
        "kvpress snapkv 25% q-in",
        "kvpress snapkv 25% q-out",
        "kvpress expected 12.5% q-in",
        "kvpress expected 12.5% q-out",
    ]
    with pytest.raises(ValueError, match="comma list of in, out, all"):
        peers.press_runs(["snapkv:0.25"], ["inside"])


def test_the_split_keeps_the_question_in_or_out_and_the_text_whole():
    """Every committed document: context + rest is the prompt; ``in`` compresses the question (the rest is the
    answer's start), ``out`` reads it after the compressed text, ``all`` compresses the answer's start too (the rest
    is the prompt's last word)."""
    for path in sorted((ROOT / "configs" / "lm_eval" / "ruler" / "data").glob("*_2k_heldout.jsonl")):
        text = json.loads(path.read_text().splitlines()[0])["input"]
        for placement in ("in", "out"):
            context, rest = peers.split(text, placement)
            assert context + rest == text
            question_in_context = peers.QUESTION.strip() in context[-2000:]
            assert question_in_context == (placement == "in"), (path.name, placement)
            assert rest.lstrip().startswith("Answer:" if placement == "in" else "Question:"), (path.name, placement)
        context, rest = peers.split(text, "all")
        assert context + rest == text and peers.ANSWER in context[-500:] and rest == " " + text.split()[-1]
    with pytest.raises(ValueError, match="cannot place its question"):
        peers.split("no question here", "out")
    with pytest.raises(ValueError, match="cannot place its question"):
        peers.split("no answer's start here", "all")


def test_a_row_scores_each_document_as_lm_eval_does_in_document_order():
    docs = [
        {"key": "vt 2k 0", "outputs": ["AB", "CD"], "until": ["\n\n"]},
        {"key": "vt 2k 1", "outputs": ["EF"], "until": []},
        {"key": "niah_single 2k 0", "outputs": ["123"], "until": []},
    ]
    answers = [  # out of order, as a resumed run may append them; the stop string cuts "CD" off
        {"key": "niah_single 2k 0", "answer": " 123.", "prompt_tokens": 10, "generated_tokens": 3, "seconds": 1.0,
         "peak_kv_bytes": 5},
        {"key": "vt 2k 0", "answer": " ab\n\ncd", "prompt_tokens": 10, "generated_tokens": 5, "seconds": 2.0,
         "peak_kv_bytes": 9},
        {"key": "vt 2k 1", "answer": " none", "prompt_tokens": 10, "generated_tokens": 2, "seconds": 1.0,
         "peak_kv_bytes": 7},
    ]  # fmt: skip
    row = peers.row(peers.PressRun("snapkv", 0.25, "in"), docs, answers, 4.5, SCORE)
    assert row["documents"] == {"vt 2k": [0.5, 0.0], "niah_single 2k": [1.0]}
    assert row["scores"] == {"vt 2k": 0.25, "niah_single 2k": 1.0}
    assert row["tokens_per_s"] == pytest.approx(40 / 4.0) and row["slots"] == 1 and row["peak_kv_bytes"] == 9
    with pytest.raises(ValueError, match="no answer for 1 documents"):
        peers.row(peers.PressRun("snapkv", 0.25, "in"), docs, answers[1:], 4.5, SCORE)


# -- the bench: checks before load, rows joined -----------------------------------------------------------------------
FAKE = """#!{python}
# A stand-in for kvpress's interpreter: --check prints a version; otherwise it answers each document with {what}.
import json, sys
args = sys.argv[2:]
if "--check" in args:
    print(json.dumps({{"kvpress": "{version}", "transformers": "5.2.0"}}))
    sys.exit(0)
get = lambda flag: args[args.index(flag) + 1]
with open(get("--out"), "a") as f:
    for line in open(get("--documents")):
        d = json.loads(line)
        answer = {answer}
        f.write(json.dumps({{"key": d["key"], "answer": answer, "prompt_tokens": 100, "generated_tokens": 4,
                            "seconds": 0.5, "peak_kv_bytes": 1000}}) + "\\n")
"""


def fake_python(folder: Path, version: str = peers.KVPRESS_VERSION, answer: str = '" " + ", ".join(d["outputs"])'):
    path = folder / "fake-python"
    path.write_text(FAKE.format(python=sys.executable, version=version, what=answer, answer=answer))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda tmp: tmp / "no-such-python", "no interpreter"),
        (lambda tmp: fake_python(tmp, version="0.5.4"), "has kvpress 0.5.4, the rows are measured with 0.5.5"),
    ],
)
def test_kvpress_without_its_interpreter_or_with_another_pin_is_one_line_before_load(tmp_path, capsys, make, says):
    import bench_ruler

    out = tmp_path / "out"
    argv = ["--lengths", "2k", "--tasks", "vt", "--limit", "1", "--configs", "fkv", "--out", str(out)]
    argv += ["--kvpress", "snapkv:0.25", "--peers-python", str(make(tmp_path))]
    with pytest.raises(SystemExit) as stop:
        bench_ruler.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and says in err[-1] and "bash scripts/peers.sh" in err[-1]
    assert not out.exists()  # nothing loaded, nothing written


def test_kvpress_rows_join_the_table_with_intervals_and_resume(tiny_dir, tmp_path):
    """FKV on the tiny model through lm-eval, then two kvpress rows from a stand-in interpreter that answers every
    expected string (score 1 on every document): the rows sit after FKV's with each document's score, a paired
    interval, 1 slot and "whole prompt"; a second run reads them back without running them."""
    pytest.importorskip("lm_eval")
    import bench_ruler

    out = tmp_path / "bench"
    python = fake_python(tmp_path)
    argv = ["--pretrained", tiny_dir, "--tasks", "niah_single,vt", "--lengths", "2k", "--limit", "2"]
    argv += ["--configs", "fkv", "--batch-size", "2", "--out", str(out), "--peers-python", str(python)]
    argv += ["--kvpress", "snapkv:0.25", "--kvpress-question", "in,out"]
    assert bench_ruler.main(argv) == 0
    table = json.loads((out / "table.json").read_text())
    labels = [r["label"] for r in table["configs"]]
    assert labels == ["fkv", "kvpress snapkv 25% q-in", "kvpress snapkv 25% q-out"]
    for row in table["configs"][1:]:
        assert row["documents"] == {"niah_single 2k": [1.0, 1.0], "vt 2k": [1.0, 1.0]}
        assert row["slots"] == 1 and row["prefill"] == "whole prompt" and "interval" in row  # paired with FKV's
    docs = [json.loads(x) for x in (out / "01_kvpress_snapkv_25_q-in" / "documents.jsonl").read_text().splitlines()]
    assert [d["key"] for d in docs] == ["niah_single 2k 0", "niah_single 2k 1", "vt 2k 0", "vt 2k 1"]
    assert all(d["rest"].startswith("\nAnswer:") for d in docs)
    text = (out / "table.md").read_text()
    assert "| prompt read | whole prompt | whole prompt | whole prompt |" in text

    # read back: a stand-in that fails on any document is not asked again (only --check runs)
    python.write_text(FAKE.format(python=sys.executable, version="0.5.5", what="a failure", answer='"" + 1'))
    assert bench_ruler.main(argv) == 0
    again = json.loads((out / "table.json").read_text())
    assert [r["documents"] for r in again["configs"]] == [r["documents"] for r in table["configs"]]


# -- the oracle: kvpress's SnapKVPress and the project's snap ---------------------------------------------------------
ORACLE = textwrap.dedent(
    """
    import json, sys
    import torch, kvpress
    from transformers import AutoModelForCausalLM, DynamicCache
    sys.path.insert(0, {launch!r})
    from kvpress_rows import ratio_for

    model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([{prompt}])
    press = kvpress.SnapKVPress(compression_ratio=ratio_for({kv} / ids.shape[1], ids.shape[1]),
                                window_size={window}, kernel_size={kernel})
    kept = []
    compress = press.compress

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        k, v = compress(module, hidden_states, keys, values, attentions, kwargs)
        # each kept key is a copy of one of the layer's keys: its position is where it equals one exactly
        same = (k[0][:, :, None, :] == keys[0][:, None, :, :]).all(-1)  # [Hkv, kept, s]
        assert (same.sum(-1) == 1).all(), "a kept key matches no single position"
        at = same.float().argmax(-1)  # [Hkv, kept]: each kept pair's position
        kept.append([sorted(at[h].tolist()) for h in range(at.shape[0])])
        return k, v

    press.compress = recording
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    print(json.dumps(kept))
    """
)


def peers_python() -> Path | None:
    path = peers.default_python()
    return path if path.is_file() else None


@pytest.mark.skipif(
    peers_python() is None,
    reason=f"needs kvpress (its interpreter {peers.default_python()} is missing: run bash scripts/peers.sh)",
)
def test_real_kvpress_rows_join_the_table(tiny_dir, tmp_path):
    """The join above with kvpress itself (its own interpreter and pipeline, a press that removes nothing): its row
    sits after FKV's, scored on FKV's documents by the suite's own metric, with 1 slot, "whole prompt" and a paired
    interval."""
    pytest.importorskip("lm_eval")
    import bench_ruler

    out = tmp_path / "bench"
    argv = ["--pretrained", tiny_dir, "--tasks", "niah_single", "--lengths", "2k", "--limit", "2"]
    argv += ["--configs", "fkv", "--batch-size", "2", "--out", str(out), "--peers-python", str(peers_python())]
    argv += ["--kvpress", "streaming:0.9999", "--kvpress-question", "in"]
    assert bench_ruler.main(argv) == 0
    fkv, row = json.loads((out / "table.json").read_text())["configs"]
    assert fkv["label"] == "fkv" and row["label"].startswith("kvpress streaming") and row["label"].endswith("q-in")
    assert list(row["documents"]) == list(fkv["documents"]) == ["niah_single 2k"]
    assert len(row["documents"]["niah_single 2k"]) == 2 and all(0 <= x <= 1 for x in row["documents"]["niah_single 2k"])
    assert row["slots"] == 1 and row["prefill"] == "whole prompt" and "interval" in row


@pytest.mark.skipif(
    peers_python() is None,
    reason=f"needs kvpress (its interpreter {peers.default_python()} is missing: run bash scripts/peers.sh)",
)
@pytest.mark.parametrize("family,chunk", [("llama", 0), ("qwen2", 0), ("llama", 48)])
def test_kvpress_snapkv_keeps_the_positions_snap_keeps(tmp_path, family, chunk):
    """On the same model and prompt, kvpress's ``SnapKVPress`` and ``snap`` configured alike (window 12, kernel 5,
    per KV head, the window's attention pooled over positions) keep the same positions in every (layer, KV head).

    Where they cannot be alike: kvpress keeps ``int(s * (1 - ratio))`` pairs (the ratio is set so that is kv_max);
    it averages the window's and the group's attention where snap sums them (the same order); its top-k orders ties
    as it likes (the sets are compared); it compresses a layer after its forward pass as snap does, and never
    decodes (one prompt, no generated token). ``chunk`` 48: snap prefilled in chunks (its last one holding the window)
    keeps what kvpress keeps after its one-pass prefill."""
    from batchmax_tp.core.engine import Engine
    from batchmax_tp.core.method import Method
    from batchmax_tp.core.requests import Record, Request

    kv, window, kernel = 40, 12, 5
    shape = {"llama": dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), "qwen2": {}}[family]
    model = tiny_random_model(family, seed=0, head_dim=16, **shape, **PEAKED)
    model.save_pretrained(tmp_path / "model")
    prompt = torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    method = Method("snap", kv_max=kv, p=8, window=window, kernel=kernel, chunk=chunk)
    (out,) = Engine(model, method, 1).run([Request(prompt, 1)], record=Record(positions=True)).outputs
    ours = [[sorted(head) for head in layer] for layer in out.kept_positions]
    assert all(len(head) == kv for layer in ours for head in layer)
    assert any(min(head) < len(prompt) - kv for layer in ours for head in layer)  # not merely the newest pairs

    code = ORACLE.format(
        launch=str(ROOT / "launch"), folder=str(tmp_path / "model"), prompt=prompt, kv=kv, window=window, kernel=kernel
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(peers_python()), "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs == ours


@pytest.mark.skipif(
    peers_python() is None,
    reason=f"needs kvpress (its interpreter {peers.default_python()} is missing: run bash scripts/peers.sh)",
)
def test_kvpress_rows_uncompressed_answers_as_greedy_decoding_and_resumes(tiny_dir, tmp_path):
    """``launch/kvpress_rows.py`` through kvpress's pipeline: a press that removes nothing (StreamingLLM keeping
    every pair) answers each document as transformers' greedy ``generate`` does on the same tokens, its cache holding
    every layer's pairs at most; with a quarter kept it holds less. Run again, it answers nothing twice."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    data = ROOT / "configs" / "lm_eval" / "ruler" / "data" / "niah_single_2k_tune.jsonl"
    texts = [json.loads(x)["input"][-1500:] for x in data.read_text().splitlines()[:2]]  # ~300-token tails
    docs = []
    for i, text in enumerate(texts):
        context, rest = peers.split(text, "out")
        docs.append({"key": f"niah_single 2k {i}", "context": context, "rest": rest, "max_gen_toks": 8})
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))

    def run(press: str, kept: float, out: Path) -> list[dict]:
        cmd = [str(peers_python()), str(ROOT / "launch" / "kvpress_rows.py"), "--model", tiny_dir, "--press", press]
        cmd += ["--kept", str(kept), "--documents", str(tmp_path / "docs.jsonl"), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(x) for x in out.read_text().splitlines()]

    whole = run("streaming", 0.9999, tmp_path / "whole.jsonl")
    assert [a["key"] for a in whole] == [d["key"] for d in docs]
    config = model.config
    per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2 * 4  # K and V, float32
    for doc, answer in zip(docs, whole):
        parts = [tokenizer.encode(doc[k], return_tensors="pt", add_special_tokens=False) for k in ("context", "rest")]
        ids = torch.cat(parts, dim=1)  # [1, s]: the context's tokens, then the rest's, as kvpress_rows reads them
        greedy = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=config.eos_token_id)
        assert answer["answer"] == tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
        assert answer["prompt_tokens"] == ids.shape[1]
        # every layer's pairs of the prompt and of the tokens fed back while it answered (at most 7 of its 8)
        assert ids.shape[1] * per_token <= answer["peak_kv_bytes"] <= (ids.shape[1] + 7) * per_token
    quarter = run("snapkv", 0.25, tmp_path / "quarter.jsonl")
    assert all(q["peak_kv_bytes"] < w["peak_kv_bytes"] for q, w in zip(quarter, whole))
    assert run("snapkv", 0.25, tmp_path / "quarter.jsonl") == quarter  # resumed: nothing answered twice
