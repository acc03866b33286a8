"""``question:recall=tier`` (issue 68): the pairs a prefill evicts wait in a slower tier and, before the prompt's last
block, are ranked with the pairs held by the question's stored queries. Against the naive reference (which sets every
evicted entry aside and re-ranks all of them: ``tests/reference.py``) in ``test_rules.py``'s cases and at tp 2 in
``test_tp.py``'s matrix; here: that it brings pairs back (not vacuous), that the pool's fast memory does not grow
with the prompt while the tier does, that a tier is a nameless file, gone when its request ends and when the run is
killed, and the rule's checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import PEAKED, left_padded_batch, tiny_llama
from reference import reference_generate, rule_string

from batchmax_tp.bench.padded import generate
from batchmax_tp.core import tier as tier_mod
from batchmax_tp.core.method import Method

BASE = dict(window=8, every=3, kernel=3, pool="max", sinks=1, recent=2)
RECALL = {**BASE, "recall": "tier"}


def _evicted_in_prefill(ref, s):
    out = {}
    for sample, layer, head, curr_id, positions in ref.events:
        if curr_id < s - 1:
            out.setdefault((sample, layer, head), set()).update(positions)
    return out


def test_recall_brings_back_pairs_the_prefill_evicted():
    """After the prompt, the recall holds pairs an earlier prefill eviction removed (without it none), and the engine
    holds exactly those (the reference's kept sets: the top of all the prompt's pairs by the stored question)."""
    model = tiny_llama(0, **PEAKED)
    ids, mask = left_padded_batch([37, 52, 60], seed=1)
    s, kv_max, p = ids.shape[1], 16, 4
    back = {}
    for name, params in (("none", BASE), ("tier", RECALL)):
        ref = reference_generate(model, ids, mask, "bm", kv_max, p, 1, rule="question", rule_params=params)
        evicted = _evicted_in_prefill(ref, s)
        held = ref.kept_history[0]  # [layer][sample][head]
        back[name] = sum(
            len(set(held[layer][sample][head]) & evicted.get((sample, layer, head), set()))
            for layer in range(len(held))
            for sample in range(len(held[layer]))
            for head in range(len(held[layer][sample]))
        )
        if name == "tier":
            out = generate(model, ids, mask, Method("bm", kv_max=kv_max, p=p, rule=rule_string("question", params)), 1)
            assert out.kept_positions() == held
    assert back["none"] == 0 and back["tier"] > 10, back


def _run(model, length, rule, kv_max=16, p=4):
    ids, mask = left_padded_batch([length, length - 5], seed=2)
    return generate(model, ids, mask, Method("bm", kv_max=kv_max, p=p, rule=rule), 3, ignore_eos=True)


def test_fast_memory_is_the_pools_and_the_tier_grows_with_the_prompt():
    """The pool's K/V peak is the bounded pool's at every prompt length, recall or not; the tier (slower memory) holds
    every pair the prefill can evict, so it grows with the prompt."""
    model = tiny_llama(0, **PEAKED)
    peaks, tiers = set(), {}
    for length in (40, 120):
        for name, params in (("none", BASE), ("tier", RECALL)):
            out = _run(model, length, rule_string("question", params))
            peaks.add(out.peak_kv_bytes)
            tiers[(length, name)] = out.served.tier_bytes
    assert len(peaks) == 1, peaks
    assert tiers[(40, "none")] == tiers[(120, "none")] == 0
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_pair = cfg.num_hidden_layers * cfg.num_key_value_heads * (2 * dim * 4 + 8 + 4)  # float32 K/V, position, sum
    assert tiers[(40, "tier")] == 40 * per_pair and tiers[(120, "tier")] == 120 * per_pair


def _maps_with(prefix: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if prefix in line]


def test_a_tier_is_a_nameless_file_gone_with_its_request(tmp_path, monkeypatch):
    """On the CPU a tier is a file in ``$BATCHMAX_TIER_DIR``, mapped and unlinked at once (the folder stays empty);
    it is unmapped once its request's recall has run, and at the end nothing of it is left."""
    monkeypatch.setenv(tier_mod.DIR_ENV, str(tmp_path))
    seen = []
    store = tier_mod.Tier.store

    def watched(self, row, *args, **kwargs):
        store(self, row, *args, **kwargs)
        seen.append((sorted(os.listdir(tmp_path)), len(_maps_with(str(tmp_path))), self.held_bytes()))

    monkeypatch.setattr(tier_mod.Tier, "store", watched)
    model = tiny_llama(0, **PEAKED)
    _run(model, 60, rule_string("question", RECALL))
    assert seen and all(names == [] for names, _, _ in seen)  # no name in the folder, ever
    assert all(maps >= 1 and held > 0 for _, maps, held in seen)  # mapped from disk while it is used
    assert _maps_with(str(tmp_path)) == [] and os.listdir(tmp_path) == []


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from conftest import PEAKED, left_padded_batch, tiny_llama
from batchmax_tp.bench.padded import generate
from batchmax_tp.core import tier
from batchmax_tp.core.method import Method
store = tier.Tier.store
def killed(self, *a, **k):
    store(self, *a, **k)
    if {kill}:
        print("mapped", sum(os.environ[tier.DIR_ENV] in line for line in open("/proc/self/maps")), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
tier.Tier.store = killed
ids, mask = left_padded_batch([60, 55], seed=2)
out = generate(tiny_llama(0, **PEAKED), ids, mask, Method("bm", kv_max=16, p=4, rule={rule!r}), 3, ignore_eos=True)
print("done", out.tokens.tolist(), flush=True)
"""


def test_a_killed_run_leaves_no_tier_behind(tmp_path):
    """A run killed while its tier is mapped leaves the folder empty (and its disk space freed: the file had no
    name); the same run again, resumed, completes and leaves nothing either."""
    folder = tmp_path / "tier"
    folder.mkdir()
    env = {**os.environ, tier_mod.DIR_ENV: str(folder), "OMP_NUM_THREADS": "1"}
    tests = os.path.dirname(os.path.abspath(__file__))
    rule = rule_string("question", RECALL)
    for kill in (True, False):
        code = KILLED.format(tests=tests, kill=kill, rule=rule)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        if kill:
            assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
            assert "mapped 1" in proc.stdout or "mapped 2" in proc.stdout, proc.stdout
        else:
            assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
        assert os.listdir(folder) == []


def test_recall_checks_its_rule():
    with pytest.raises(ValueError, match="recall must be one of none, tier"):
        Method("bm", kv_max=96, p=32, rule="question:recall=disk")
    with pytest.raises(ValueError, match="recall=tier ranks each head's own budget at kv_max: share must be 1"):
        Method("bm", kv_max=96, p=32, rule="question:recall=tier,share=0")
    with pytest.raises(ValueError, match="taper 0"):
        Method("bm", kv_max=512, p=32, rule="question:recall=tier,taper=50")
    assert Method("bm", kv_max=96, p=32, rule="question:recall=tier").stores_probe  # even probing every block
    assert Method("bm", kv_max=96, p=32, rule="question:recall=tier,every=1").stores_probe
    assert not Method("bm", kv_max=96, p=32, rule="question:every=1").stores_probe
