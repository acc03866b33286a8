"""The eviction trace (``bench.trace``, issue 68): what it rebuilds of a slot when the prefill ended is what a run of
one new token holds; every prompt position of a bounded prefill is held or logged as evicted, once; an evicted
watched pair ranked at or under the eviction's bar and a kept one at or over it; a document's facts are found."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_random_model

from batchmax_tp.bench import trace
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import Method
from batchmax_tp.core.requests import Record, Request, Sampling

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ruler_utils", ROOT / "configs" / "lm_eval" / "ruler" / "ruler_utils.py")
scoring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scoring)  # the suite's own score
P, KV, N, NEW = 16, 96, 250, 20
METHODS = {
    "bm": Method("bm", KV, P),
    "bm-question": Method("bm", KV, P, rule="question"),
    "bm-question-wide": Method("bm", KV, P, rule="question", chunk=3 * P + 32),
    "bm-shared": Method("bm", KV, P, rule="question:share=0"),  # a layer's heads share a budget
    "bm-taper": Method("bm", KV, P, rule="paper:taper=50"),  # budgets across layers
    "snap": Method("snap", kv_max=KV, p=P),  # its compress pass is not an eviction: only decode's are logged
}


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", seed=0)


def prompt() -> list[int]:
    return torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("key", list(METHODS))
def test_the_trace_rebuilds_the_prefills_held_pairs_and_logs_each_eviction_once(model, key):
    method, ids = METHODS[key], prompt()
    watched = list(range(0, N, 7))
    t = trace.trace_request(model, method, ids, NEW, watched)

    def run(new):
        record = Record(positions=True)
        return Engine(model, method, 1).run([Request(ids, new)], Sampling(ignore_eos=True), record=record).outputs[0]

    whole, one = run(NEW), run(1)
    assert t.tokens == whole.tokens and t.kept == whole.kept_positions
    assert t.prefill_kept == one.kept_positions  # rebuilt from the log: decode evictions put back, its writes taken
    assert t.kept != t.prefill_kept  # the decode evicted (else the rebuild is not tested)
    prefill = lambda at: at < N - 1  # noqa: E731
    for layer, heads in enumerate(t.prefill_kept):
        for head, held in enumerate(heads):
            gone = [p for at, ps in t.log.evicted.get((layer, head), []) if prefill(at) for p in ps]
            assert len(gone) == len(set(gone)) and not set(gone) & set(held)
            if key != "snap":  # a bounded prefill: each prompt position held or evicted, once
                assert sorted(gone + held) == list(range(N))
    events = [e for e in t.log.events if prefill(e[2])]
    if key == "snap":
        assert not events
        return
    assert any(e[6] for e in events) and any(not e[6] for e in events)
    went = [(e[0], e[1], e[3]) for e in events if e[6]]
    assert len(went) == len(set(went))
    for layer, head, _curr, pos, priority, rank, evicted, bar in events:
        assert (priority <= bar) if evicted else (priority >= bar)
        assert 0 <= rank < 1
        assert not evicted or pos not in t.prefill_kept[layer][head]
    # the watched positions a bounded prefill held at its end are exactly those no eviction took
    for layer, heads in enumerate(t.prefill_kept):
        for head, held in enumerate(heads):
            lost = {p for la, h, p in went if (la, h) == (layer, head)}
            assert set(watched) - lost == set(watched) & set(held)


def test_a_documents_facts_are_found_and_traced(tiny_dir):
    """A 2k niah_multivalue and vt document of the committed suite: its 4 needles / 5 links found, each fact's tokens
    decoding to a text that holds the fact; on a tiny model each method's fact shares agree with its log (a held
    share and the log's evicted triples make up every triple of the fact)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    data = ROOT / "configs" / "lm_eval" / "ruler" / "data"
    for task, facts in (("niah_multivalue", 4), ("vt", 5)):
        doc = json.loads((data / f"{task}_2k_tune.jsonl").read_text().splitlines()[0])
        enc = tokenizer(doc["input"], return_offsets_mapping=True)
        spans = trace.fact_spans(task, doc["input"], enc["offset_mapping"])
        assert len(spans) == facts
        for s in spans:
            assert s["fact"] in tokenizer.decode([enc["input_ids"][p] for p in s["positions"]])
        doc["max_gen_toks"] = 4
        score = scoring.string_match_all
        result = trace.trace_document(model, tokenizer, doc, [Method("bm", 256, 64, rule="question")], score)
        (m,) = result["methods"].values()
        assert 0 <= m["score"] <= 1 and len(m["facts"]) == facts
        triples = model.config.num_hidden_layers * model.config.num_key_value_heads
        for s, f in zip(spans, m["facts"]):
            total = triples * len(s["positions"])
            assert round(f["held"] * total) + f["evicted"] == total
