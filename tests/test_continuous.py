"""Continuous batching (``core.engine``): every request's tokens, logits and kept positions equal ``generate()`` of
its prompt alone, whatever shares its passes; admission is exact, memory constant and predicted; tensor-parallel
ranks stay in lock-step."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from conftest import requires_deepspeed
from multiproc import FAMILIES, ROOT, assert_rank1_killed_and_nobody_finished, free_port, run_child, spawn
from tiny import tiny_random_model

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import BatchMax, Method
from batchmax_tp.core.requests import Batching, Record, Request, Sampling, check_requests
from batchmax_tp.core.scheduler import Scheduler
from batchmax_tp.core.slots import kv_layout
from batchmax_tp.plan.planner import ModelShape, pool_bookkeeping_bytes, predict_pool

P, KV = 16, 96
# 5 tokens to 3 x kv_max: kv_max - 1, kv_max, kv_max + 1, multiples of p and not, and one more than a block.
LENGTHS = [5, 16, 63, 95, 96, 97, 100, 160, 191, 192, 250, 288]
NEW = [7, 1, 12, 20, 3, 15, 9, 11, 2, 18, 6, 14]
METHODS = {
    "fkv": Method("fkv", block=0),  # a fixed-capacity slot per request
    "fkv-paged": Method("fkv", block=16),  # admitted by real length, in blocks of 16 positions
    "ed": Method("ed", kv_max=65),
    "bm": Method("bm", KV, P, chunk=0),  # the paper's passes: a block of each row a pass
    "bm-question": Method("bm", KV, P, rule="question", chunk=0),
    "bm-taper": Method("bm", KV, P, rule="paper:taper=50", chunk=0),  # budgets across layers: 144, 48 slots (2 layers)
    "bm-wide": Method("bm", KV, P, rule="question", chunk=3 * P + 32),  # wide passes: 3 blocks of a row a pass
}


def model_of(family: str):
    kw = dict(FAMILIES[family])
    return tiny_random_model(kw.pop("family"), seed=0, **kw)


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def alone(model, prompt, method, new, eos=None):
    """``generate()`` of one unpadded prompt: (tokens through EOS, logits per token [V], kept positions)."""
    out = generate(
        model, torch.tensor([prompt]), None, method, new, ignore_eos=eos is None, eos_token_id=eos, return_logits=True
    )
    n = int(out.num_generated[0])
    kept = [layer[0] for layer in out.kept_positions()]
    return out.tokens[0, :n].tolist(), [x[0] for x in out.logits[:n]], kept


@pytest.fixture(scope="module")
def references():
    """Per (family, method): every prompt generated alone (computed once, checked against every pool size)."""
    cache = {}

    def get(family, key):
        if (family, key) not in cache:
            model = model_of(family)
            cache[family, key] = [alone(model, p, METHODS[key], n) for p, n in zip(prompts(), NEW)]
        return cache[family, key]

    return get


def check_against_alone(out, refs):
    for i, (o, (tokens, logits, kept)) in enumerate(zip(out.outputs, refs)):
        assert o.tokens == tokens, f"request {i} ({LENGTHS[i]} tokens): tokens differ from generate() alone"
        torch.testing.assert_close(
            torch.stack(o.logits), torch.stack(logits), atol=1e-4, rtol=0, msg=lambda m, i=i: f"request {i}: {m}"
        )
        assert o.kept_positions == kept, f"request {i}: kept positions differ from generate() alone"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("key", list(METHODS))
def test_every_request_equals_generate_alone(family, key, references):
    model, refs = model_of(family), references(family, key)
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    for slots in (1, 2, 3, 12):
        # prefill whole before decoding, or one block between decode steps (one slot: the same passes either way)
        for budget in (None,) if slots == 1 else (None, P):
            engine = Engine(model, METHODS[key], slots, batching=Batching(prefill_budget=budget))
            out = engine.run(requests, Sampling(ignore_eos=True), record=Record(logits=True, positions=True))
            check_against_alone(out, refs)
            used = len({slot for _, slot, _ in out.admissions})
            if getattr(METHODS[key], "paged", False):
                assert used >= min(slots, len(requests))  # the memory of ``slots`` rows holds as many or more
            else:
                assert used == min(slots, len(requests))


@pytest.mark.parametrize("key", list(METHODS))
def test_requests_of_one_length_prefill_together_and_still_equal_generate_alone(key):
    """FKV/ED: adjacent slots admitted together with prompts of one length run their prefill blocks in one pass. BM:
    every prefilling row's chunk runs in one pass (up to ``pass_tokens``), each at its own position."""
    model = model_of("llama")
    g = torch.Generator().manual_seed(4)
    # three of 40 tokens fit one pass of the longest prompt's 150 tokens; two of 97 do not (the planner counts one)
    lengths, new = [40, 40, 40, 97, 97, 150, 5], [6, 1, 9, 4, 7, 3, 5]
    ps = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    refs = [alone(model, p, METHODS[key], n) for p, n in zip(ps, new)]
    sched = Scheduler(METHODS[key], lengths, new, 4)
    step = sched.next_step()
    if METHODS[key].pass_tokens(4) is None:
        assert [w.row for w in step.work] == [0, 1, 2]
        assert [rows for rows, _ in step.admitted] == [range(3), range(3, 4)]
        for lens, groups in (
            ([97, 97, 150], [range(1), range(1, 2), range(2, 3)]),
            ([50, 50, 50, 150], [range(3), range(3, 4)]),
        ):
            first = Scheduler(METHODS[key], lens, [1] * len(lens), len(lens)).next_step()
            assert [rows for rows, _ in first.admitted] == groups, lens  # at most the longest prompt's tokens
    elif not METHODS[key].bounded_prefill:  # FKV in chunks: 4 whole prompts fit a chunk's pass, rows admitted alone
        assert [w.row for w in step.work] == [0, 1, 2, 3] and [w.phase.size for w in step.work] == lengths[:4]
        assert [rows for rows, _ in step.admitted] == [range(r, r + 1) for r in range(4)]
    else:  # 4 rows x a first chunk of p tokens <= kv_max: one pass, rows admitted alone
        assert [w.row for w in step.work] == [0, 1, 2, 3] and [w.phase.size for w in step.work] == [P] * 4
        assert [rows for rows, _ in step.admitted] == [range(r, r + 1) for r in range(4)]
    out = Engine(model, METHODS[key], 4).run(
        [Request(p, n) for p, n in zip(ps, new)],
        Sampling(ignore_eos=True),
        record=Record(logits=True, positions=True),
    )
    check_against_alone(out, refs)


@pytest.mark.parametrize("key", list(METHODS))
def test_no_request_is_no_pass(key):
    """A replica whose share is already done (a resumed run) schedules nothing, for every method."""
    assert Scheduler(METHODS[key], [], [], 3).next_step() is None
    assert Engine(model_of("llama"), METHODS[key], 3).run([]).outputs == []


def test_admission_is_a_pure_function_of_the_inputs():
    model = model_of("llama")
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    engine = Engine(model, METHODS["bm"], 3, batching=Batching(prefill_budget=P))
    runs = [engine.run(requests, Sampling(ignore_eos=True)) for _ in range(2)]
    assert runs[0].admissions == runs[1].admissions
    sched = Scheduler(METHODS["bm"], LENGTHS, NEW, 3, P)  # the schedule alone, no model: the same admissions
    while (step := sched.next_step()) is not None:
        sched.complete(step)
    assert sched.log == runs[0].admissions


@pytest.mark.parametrize("key", ["bm", "fkv"])
def test_eos_honoured_frees_the_slot_and_tokens_match_through_eos(key):
    model = model_of("llama")
    method = METHODS[key]
    ps = prompts(2)
    # An EOS id the model does produce: the token that prompt 0, alone, generates at its 4th step.
    eos = alone(model, ps[0], method, 20)[0][3]
    requests = [Request(p, 20) for p in ps]
    out = Engine(model, method, 2).run(requests, Sampling(eos_token_id=eos), record=Record(logits=True, positions=True))
    ended_early = 0
    for i, (p, o) in enumerate(zip(ps, out.outputs)):
        tokens, logits, _ = alone(model, p, method, 20, eos=eos)  # alone decodes on past EOS: kept sets differ
        assert o.tokens == tokens, f"request {i}: tokens through EOS differ"
        torch.testing.assert_close(torch.stack(o.logits), torch.stack(logits), atol=1e-4, rtol=0)
        ended_early += tokens[-1] == eos and len(tokens) < 20
    assert ended_early >= 1
    assert len(out.admissions) == len(requests) > 2  # more requests admitted than slots exist


@pytest.mark.parametrize("key", list(METHODS))
def test_kv_bytes_equal_the_prediction_and_stay_constant(key):
    model = model_of("llama")
    method = METHODS[key]
    requests = [Request(p, 8) for p in prompts()]
    out = Engine(model, method, 3).run(requests, Sampling(ignore_eos=True))
    want = predict_pool(ModelShape.from_config(model.config), method, 3, max(LENGTHS), 8)
    assert out.peak_kv_bytes == want.kv
    if key != "ed":  # ED's staging buffer comes and goes with each slot's prefill (counted in the peak)
        assert out.kv_bytes_range == (want.kv, want.kv)
    if isinstance(method, BatchMax):  # BM's pool: per-slot bookkeeping
        held = pool_bookkeeping_bytes(ModelShape.from_config(model.config), method, 3, max(LENGTHS))
        assert out.peak_meta_bytes == held >= want.slot_meta


@pytest.mark.parametrize("key", ["bm", "bm-question"])
def test_attention_calls_hold_what_they_report(monkeypatch, key):
    """Every attention call of a pool run (slot prefills, decode passes over the pool): the allocations measured on
    CPU equal the workspace it reports (a look-ahead probe's report is an upper bound, as in a static run)."""
    from memtrack import AllocationTracker

    from batchmax_tp.core import attention, slots

    label, reported, notes, kinds = "pool-attention", [], [], []

    def recording(self, nbytes, _note=slots.SlotPool.note_workspace):
        notes.append(nbytes)
        _note(self, nbytes)

    monkeypatch.setattr(slots.SlotPool, "note_workspace", recording)

    # The attention proper of each pass (after the pass's evictions and writes, whose few [rows, H, C] temporaries
    # are not workspace the planner counts, as in a static run's cache update). The pool counts each pass's
    # workspace on the host before the pass (``pass_workspace``): a chunk's or a probe's own count is the pool's
    # for that part of the pass; a decode step's is the pass's.
    def chunks(layer, step, *args):
        return step.pool.pass_workspace(dataclasses.replace(step, probe=None))

    def probes(layer, step, *args):
        return step.pool.pass_workspace(step)

    parts = (("_rows_block", "prefill", chunks), ("_rows_probe", "probe", probes), ("decode_attention", "decode", None))
    for name, kind, count in parts:
        original = getattr(attention, name)

        def labelled(*args, _fn=original, _kind=kind, _count=count, **kwargs):
            kinds.append(_kind)
            said = notes[-1] if _count is None else _count(*args)
            with torch.profiler.record_function(label):
                out = _fn(*args, **kwargs)
            reported.append(said)
            return out

        monkeypatch.setattr(attention, name, labelled)
    model = model_of("llama")
    with AllocationTracker() as t:
        out = Engine(model, METHODS[key], 3).run([Request(p, 6) for p in prompts()[:6]], Sampling(ignore_eos=True))
    measured = t.spans(label)
    assert len(measured) == len(reported) == len(kinds) > 0
    assert "decode" in kinds and "prefill" in kinds
    for kind, got, said in zip(kinds, measured, reported):  # a probe pass reports an upper bound
        assert got == said if kind != "probe" else got <= said, f"{kind} pass: measured {got}, reported {said}"
    assert max(measured) <= out.peak_workspace_bytes == max(reported)  # a probe's bound may be the largest
    est = predict_pool(ModelShape.from_config(model.config), METHODS[key], 3, max(LENGTHS[:6]), 6)
    assert out.peak_workspace_bytes <= est.workspace


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(slots=0), "slots must be"),
        (dict(new=0), "max_new_tokens must be"),
        (dict(length=2000), "run past the model's context"),
        (dict(length=0), "prompt is empty"),
    ],
)
def test_bad_input_is_one_line(bad, message):
    reqs = [Request([5] * bad.get("length", 10), bad.get("new", 4))]
    with pytest.raises(ValueError, match=message) as err:
        check_requests(reqs, bad.get("slots", 2), 1024)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--scheduler", "continuous", "--batch-size", "0"], "batch_size"),
        (["--scheduler", "continuous", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--scheduler", "sometimes"], "scheduler"),
        (["--scheduler", "continuous", "--prefill-budget", "0"], "prefill_budget"),
        (["--scheduler", "static", "--compile", "default"], "compile"),
        (["--compile", "fast"], "compile"),
    ],
)
def test_bad_scheduler_settings_exit_2_before_loading(argv, key):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "run.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and key in proc.stderr


# -- tensor parallel --------------------------------------------------------------------------------------------------
#: What the tensor-parallel tests serve: BM, ED, snap (SnapKV after the prompt: rank-local per KV head, as BM) and
#: FKV by real length (each rank's blocks hold its own heads; every rank admits by the same counts).
TP_METHODS = {
    "bm": METHODS["bm"],
    "ed": METHODS["ed"],
    "snap": Method("snap", KV, P, window=16, kernel=5),
    "fkv-paged": METHODS["fkv-paged"],
}


def _tp_requests():
    return [Request(p, n) for p, n in zip(prompts(3)[:6], [9, 4, 12, 6, 10, 3])]


def _tp_worker(rank, world, port, outdir, family, eos, compile="none"):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from batchmax_tp import parallel as tp
    from batchmax_tp.core import replay

    layout = tp.init_distributed(world)
    model = tp.apply_tensor_parallel(model_of(family), layout, torch.float32)
    compiled = torch.compile(replay.eager_decode, fullgraph=True, backend="aot_eager")  # a graph break: an error
    replay.compiled_decode = lambda: compiled
    results = {}
    for key, method in TP_METHODS.items():
        engine = Engine(model, method, 2, tp_group=model.batchmax_tp_group, compile=compile)
        out = engine.run(_tp_requests(), Sampling(eos_token_id=eos, ignore_eos=eos is None), record=Record(logits=True))
        results[key] = dict(
            tokens=[o.tokens for o in out.outputs],
            admissions=out.admissions,
            logits=[torch.stack(o.logits) for o in out.outputs],
            graphs=counters["stats"]["unique_graphs"],
        )
        counters.clear()
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("tp_size, eos, compile", [(2, None, "none"), (3, 7, "none"), (2, 7, "default")])
@requires_deepspeed
def test_tp_serves_the_tokens_of_one_process(tmp_path, tp_size, eos, compile):
    """Every rank's tokens, admissions and logits equal one process's. Compiled (``fullgraph``, so a graph break
    would be an error), DeepSpeed AutoTP's all-reduces trace into the decode pass: one graph per rank and method."""
    args = (tp_size, free_port(), str(tmp_path), "phi3", eos, compile)
    spawn(_tp_worker, args, tp_size)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp_size)]
    for key in TP_METHODS:
        assert [got[key]["graphs"] for got in ranks] == [1 if compile == "default" else 0] * tp_size
    model = model_of("phi3")  # 6 KV heads: split 3+3 or 2+2+2
    for key, method in TP_METHODS.items():
        sampling = Sampling(eos_token_id=eos, ignore_eos=eos is None)
        single = Engine(model, method, 2).run(_tp_requests(), sampling, record=Record(logits=True))
        for got in ranks:
            assert got[key]["tokens"] == [o.tokens for o in single.outputs]
            assert got[key]["admissions"] == single.admissions
            for a, b in zip(got[key]["logits"], single.outputs):
                torch.testing.assert_close(a, torch.stack(b.logits), atol=1e-4, rtol=0)


def _agree_worker(rank, world, port, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    from batchmax_tp.core.engine import _agree

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _agree(dist.group.WORLD, 5 + rank, torch.device("cpu"))  # rank 1's schedule differs
        result = "agreed"
    except RuntimeError as err:
        result = str(err)
    with open(os.path.join(outdir, f"agree{rank}.txt"), "w") as fh:
        fh.write(result)
    dist.destroy_process_group()


def test_diverged_ranks_stop_with_an_error(tmp_path):
    spawn(_agree_worker, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        assert "ranks diverged" in (tmp_path / f"agree{rank}.txt").read_text()


def test_killed_rank_ends_continuous_serving():
    """Rank 1 killed when its first request finishes (tp=2, continuous): the launcher returns non-zero, rank 0 never
    finishes serving and does not hang (the call's timeout guards)."""
    assert_rank1_killed_and_nobody_finished(run_child("killed_rank_mid_serving"), "request")


def test_a_pass_computes_its_rows_real_tokens_and_at_most_chunk_minus_one_masked_columns_each():
    """BM's pool prefills many rows' chunks in one pass, each at its own position and prompt length: the model sees
    no more token columns than the rows' real tokens plus, per prefilling row, at most (chunk - 1) masked ones."""
    model = model_of("llama")
    g = torch.Generator().manual_seed(6)
    lengths = [150, 23, 99, 300, 5, 64, 131]
    ps = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    fed = []  # (rows, columns) of every prefill pass the model computed
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, o: fed.append(tuple(a[0].shape)))
    try:
        engine = Engine(model, METHODS["bm"], 5)
        out = engine.run([Request(p, 3) for p in ps], Sampling(ignore_eos=True), record=Record(logits=True))
    finally:
        hook.remove()
    prefill = [(r, n) for r, n in fed if n > 1]
    assert sum(r for r, _ in prefill) > len(prefill)  # rows of different lengths did share passes
    real = sum(lengths)
    assert real <= sum(r * n for r, n in prefill) <= real + sum(r * (P - 1) for r, _ in prefill)
    assert all(r * n <= METHODS["bm"].pass_tokens(5) for r, n in prefill)
    for p, o in zip(ps, out.outputs):  # and each answer is its own
        assert o.tokens == alone(model, p, METHODS["bm"], 3)[0]


@pytest.mark.parametrize("key", ["bm", "bm-question"])
def test_a_lone_rows_first_block_runs_in_one_pass(key, references):
    """A request prefilling alone runs its first block (kv_max tokens) in one pass, not in chunks of p; beside other
    rows, in chunks of p; its answer is the same either way (nothing is evicted inside the first block)."""
    model, i = model_of("llama"), LENGTHS.index(288)
    fed = []  # columns of every prefill pass the model computed
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, o: fed.append(a[0].shape[1]))
    sampling, record = Sampling(ignore_eos=True), Record(logits=True, positions=True)
    try:
        lone = Engine(model, METHODS[key], 1).run([Request(prompts()[i], NEW[i])], sampling, record=record)
    finally:
        hook.remove()
    window = METHODS[key].lookahead
    assert fed[0] == window + KV  # the first block and the probe after it, one pass
    assert len([n for n in fed if n > 1]) == 1 + -(-(288 - KV) // P)  # then one pass per later block
    check_against_alone(lone, [references("llama", key)[i]])


@pytest.mark.parametrize("key", ["bm", "bm-question"])
def test_the_pass_size_changes_no_answer(key, references):
    """One row per pass (``pass_tokens`` = p) and every row in one pass: each request equals generate() alone."""
    model, refs = model_of("llama"), references("llama", key)
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    for tokens in (P, 10**6):
        engine = Engine(model, METHODS[key], 12, batching=Batching(pass_tokens=tokens))
        out = engine.run(requests, Sampling(ignore_eos=True), record=Record(logits=True, positions=True))
        check_against_alone(out, refs)


WIDE = {
    "bm": METHODS["bm"],
    "bm-question": METHODS["bm-question"],
    "bm-taper": METHODS["bm-taper"],
    "bm-share": Method("bm", KV, P, rule="question:share=0", chunk=0),  # one budget for a layer's KV heads
}


@pytest.mark.parametrize("key", list(WIDE))
def test_wide_passes_keep_what_passes_of_one_block_keep(key):
    """BM with ``chunk`` (wide passes: several blocks of each row in one model call, each layer evicting before each
    block inside its attention): every request's tokens, logits and kept positions equal ``generate()`` of its prompt
    alone in passes of one block, with the smallest chunk (a block and its probe a pass), a middling one and one
    that takes a whole prompt (a lone row's prompt in one model call), alone and beside other rows."""
    model, narrow = model_of("llama"), WIDE[key]
    refs = [alone(model, p, narrow, n) for p, n in zip(prompts(), NEW)]
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    window = narrow.lookahead
    for slots, chunk in ((1, 10**4), (3, P + window), (3, 3 * P + window), (12, 10**4)):
        wide = dataclasses.replace(narrow, chunk=chunk)
        fed = []  # (rows, columns) of every pass the model computed
        hook = model.model.embed_tokens.register_forward_hook(lambda m, a, o, fed=fed: fed.append(tuple(a[0].shape)))
        try:
            record = Record(logits=True, positions=True)
            out = Engine(model, wide, slots).run(requests, Sampling(ignore_eos=True), record=record)
        finally:
            hook.remove()
        check_against_alone(out, refs)
        assert max(r * n for r, n in fed) <= chunk
        if slots == 1:  # a lone row's prompt in one model call: its blocks and its probes
            assert max(n for _, n in fed) >= max(LENGTHS)
        elif chunk > P + window:  # several blocks of each row in one call
            assert max(n for _, n in fed) > P + window


@pytest.mark.parametrize("key", ["bm", "bm-question"])
def test_wide_passes_keep_the_padded_batchs_positions(key):
    """The paper's padded batch (``generate``, static) in wide passes keeps what it keeps in passes of one block."""
    model, narrow = model_of("llama"), METHODS[key]
    lengths = [40, 250, 288, 170]
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):  # left-padded
        ids[i, -n:] = torch.randint(3, 128, (n,), generator=g)
        mask[i, -n:] = 1
    runs = [
        generate(model, ids, mask, m, 9, ignore_eos=True, return_logits=True)
        for m in (narrow, dataclasses.replace(narrow, chunk=4 * P + narrow.lookahead))
    ]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert runs[0].kept_positions() == runs[1].kept_positions()
    for a, b in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@pytest.mark.parametrize("key", list(METHODS))
def test_a_decode_pass_reads_the_host_only_for_its_tokens(monkeypatch, key):
    """Every decode pass of a run with evictions and slots refilled, counted: one host read (one ``tolist``: the
    tokens of the pass before, read a pass late since nothing here ends on a token), one host-to-device copy of the
    pass's description plus one per kind of eviction in it, and no other synchronisation (HF's look for packed
    sequences in the position ids is avoided by an all-true mask; BM ``question``'s pooled scores need no width read
    back: ``rules.pool_by_position`` pools in sorted order)."""
    from batchmax_tp.core import slots as slots_mod
    from batchmax_tp.core.engine import Engine as EngineClass

    reads, copies, expected, inside = [], [0], [0], [False]
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _f=original, **k):
            if inside[0]:
                reads.append(_name)
            return _f(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    to_device = slots_mod.to_device

    def copy(data, device):
        copies[0] += inside[0]
        return to_device(data, device)

    monkeypatch.setattr(slots_mod, "to_device", copy)
    decode, passes = EngineClass._decode, [0]

    def watched(self, step):
        pool = self.pool
        real = pool.decode_pass

        def described(state, work, device):
            d = real(state, work, device)
            expected[0] += sum(1 + len(part.evictions) for part in d.each())  # one copy per layer group's part
            return d

        pool.decode_pass, inside[0] = described, True
        try:
            passes[0] += 1
            return decode(self, step)
        finally:
            inside[0] = False
            del pool.decode_pass

    monkeypatch.setattr(EngineClass, "_decode", watched)
    requests = [Request(p, n) for p, n in zip(prompts(), [30, 2, 25, 40, 3, 20])]
    Engine(model_of("llama"), METHODS[key], 3).run(requests, Sampling(eos_token_id=None, ignore_eos=True))
    paged = getattr(METHODS[key], "paged", False)  # more requests at once: fewer passes
    assert passes[0] >= (30 if paged else 40) and copies[0] == expected[0]
    assert (expected[0] > passes[0]) == METHODS[key].evicts  # decode passes evicted (every method but FKV)
    assert reads.count("tolist") == passes[0]
    assert [r for r in reads if r != "tolist"] == []


@pytest.mark.parametrize("key", ["bm", "fkv-paged"])
def test_tokens_are_read_a_pass_late_when_no_request_ends_on_them(monkeypatch, key):
    """Without EOS, stops or a continuation, each pass's tokens are read only after the next pass has been launched
    (on a GPU the host then describes a pass while the one before runs); a request is handed to ``on_finish`` once
    its last token is read, and before the run ends. Tokens, logits and hand-offs equal reading every pass at once
    (a run with an EOS id that no request emits)."""
    from batchmax_tp.core import engine as engine_mod
    from batchmax_tp.core import replay

    events = []
    real_to_host, real_read, real_forward, real_runner = (
        engine_mod._to_host,
        engine_mod._read,
        engine_mod.forward_pass,
        replay.decode_runner,
    )

    def to_host(tokens):  # the copy's event, tagged with its number (serve hands it back to ``_read`` untouched)
        host, event = real_to_host(tokens)
        tag = sum(1 for e in events if e[0] == "copy")
        events.append(("copy", tag))
        return host, (tag, event)

    def read(host, tagged):
        events.append(("read", tagged[0]))
        return real_read(host, tagged[1])

    def launched(run):
        def call(*args):
            events.append(("pass", None))
            return run(*args)

        return call

    monkeypatch.setattr(engine_mod, "_to_host", to_host)
    monkeypatch.setattr(engine_mod, "_read", read)
    monkeypatch.setattr(engine_mod, "forward_pass", launched(real_forward))
    monkeypatch.setattr(replay, "decode_runner", lambda mode: launched(real_runner(mode)))
    model, method = model_of("llama"), METHODS[key]
    requests = [Request(p, n) for p, n in zip(prompts(), [30, 2, 25, 40, 3, 20])]

    def run(sampling):
        handed = []

        def on_finish(i, out):
            handed.append((i, list(out.tokens)))
            events.append(("finish", i))

        out = Engine(model, method, 3).run(requests, sampling, on_finish=on_finish, record=Record(logits=True))
        return out, handed

    lagged, handed = run(Sampling(ignore_eos=True))
    copies = {key: at for at, (kind, key) in enumerate(events) if kind == "copy"}
    reads = {key: at for at, (kind, key) in enumerate(events) if kind == "read"}
    last_pass = max(at for at, (kind, _) in enumerate(events) if kind == "pass")
    assert copies.keys() == reads.keys() and len(copies) > 40, len(copies)
    for key_, at in copies.items():  # read after the next pass was launched, or after the last pass
        assert ("pass", None) in events[at : reads[key_]] or reads[key_] > last_pass
    assert sum(1 for at, (kind, _) in enumerate(events) if kind == "finish" and at < last_pass) >= 4
    assert [len(t) for _, t in sorted(handed)] == [30, 2, 25, 40, 3, 20]
    unused = sorted(set(range(model.config.vocab_size)) - {t for o in lagged.outputs for t in o.tokens})[0]
    events.clear()
    at_once, handed_at_once = run(Sampling(eos_token_id=unused))
    assert not [e for e in events if e[0] == "copy"]  # an EOS to watch: read at once, no copy left in flight
    assert [o.tokens for o in at_once.outputs] == [o.tokens for o in lagged.outputs]
    for a, b in zip(at_once.outputs, lagged.outputs):
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=0, rtol=0)
    assert sorted(handed_at_once) == sorted(handed)


@pytest.mark.parametrize("key", list(METHODS))
def test_compiled_decode_passes_are_one_graph_and_give_the_eager_answers(monkeypatch, key):
    """``Engine(compile="default")``: every decode pass through ``torch.compile(..., fullgraph=True)`` (so a graph
    break is an error), over 200+ passes with evictions and slots refilled: the pool is static (every pass one
    shape, evictions run before the model call), so the whole run is ONE graph, never recompiled. Tokens, logits
    (1e-4) and kept positions equal the eager run's. AOT autograd's functionalisation runs here too; inductor's code
    generation (the default backend, minutes on this CPU) is measured in docs/performance.md instead."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from batchmax_tp.core import replay

    compiled = torch.compile(replay.eager_decode, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(replay, "compiled_decode", lambda: compiled)
    torch._dynamo.reset()
    counters.clear()
    model = model_of("llama")
    requests = [Request(p, n) for p, n in zip(prompts()[3:9], [130, 90, 140, 110, 80, 120])]  # 670 tokens, 3 slots
    sampling, record = Sampling(ignore_eos=True), Record(logits=True, positions=True)
    eager = Engine(model, METHODS[key], 3).run(requests, sampling, record=record)
    got = Engine(model, METHODS[key], 3, compile="default").run(requests, sampling, record=record)
    assert got.passes >= 670 // 3  # decode passes alone
    assert got.compile_s > 0 and eager.compile_s == 0
    check_against_alone(got, [(o.tokens, o.logits, o.kept_positions) for o in eager.outputs])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    with pytest.raises(ValueError, match="compile must be one of auto, none, default, cudagraphs"):
        Engine(model, METHODS[key], 3, compile="max-autotune").run(requests)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(model, METHODS[key], 3, compile="cudagraphs").run(requests)


@pytest.mark.parametrize("key", list(METHODS))
def test_the_idle_pass_a_capture_runs_changes_nothing_a_later_pass_reads(monkeypatch, key):
    """``replay.CapturedDecode`` warms up and captures on ``replay.idle_pass`` (it cannot capture a real pass: the
    warm-up runs it). Run before every real decode pass of a served run (static pool, CPU), it leaves every slot
    [0, C) of every stacked tensor unchanged, and the run's tokens, logits and kept positions equal a plain run's."""
    from batchmax_tp.core import replay

    real = replay.eager_decode
    checked = [0]

    def with_idle_first(model, step, ids, mask):
        pools = [part.pool for part in step.each()]  # budgets across layers: every layer group's pool
        before, layers = [], []
        for pool in pools:
            C = pool.capacity
            before.append(
                {
                    k: v[..., :C, :].clone() if k in ("keys", "values") else v[..., :C].clone()
                    for k, v in pool.stacks.items()
                }
            )
            N = getattr(pool, "num_blocks", None)  # FKV paged: blocks [0, N) (N: the scratch block)
            layers += [t[:N] if N is not None else t[..., :C, :] for layer in pool.layers for t in layer.row_tensors()]
        held = [t.clone() for t in layers]
        real(model, replay.idle_pass(step), torch.zeros_like(ids), mask)
        for pool, was in zip(pools, before):
            for k, v in pool.stacks.items():
                now = v[..., : pool.capacity, :] if k in ("keys", "values") else v[..., : pool.capacity]
                assert torch.equal(now, was[k]), k
        assert all(torch.equal(t, h) for t, h in zip(layers, held)), "a layer's K/V changed"
        checked[0] += 1
        return real(model, step, ids, mask)

    model = model_of("llama")
    requests = [Request(p, n) for p, n in zip(prompts()[3:8], [30, 70, 5, 40, 50])]
    sampling, record = Sampling(ignore_eos=True), Record(logits=True, positions=True)
    want = Engine(model, METHODS[key], 2).run(requests, sampling, record=record)
    monkeypatch.setattr(replay, "compiled_decode", lambda: with_idle_first)
    got = Engine(model, METHODS[key], 2, compile="default").run(requests, sampling, record=record)
    assert checked[0] >= (80 if getattr(METHODS[key], "paged", False) else 100)
    check_against_alone(got, [(o.tokens, o.logits, o.kept_positions) for o in want.outputs])


def test_evicting_one_layer_at_a_time_keeps_what_evicting_every_layer_at_once_keeps(monkeypatch):
    """The pool evicts in every layer at once unless the gathered slot state would pass
    ``workspace.EVICT_CHUNK_BYTES``, then in groups of layers: the kept positions and tokens do not depend on it."""
    from batchmax_tp.core import workspace

    model = model_of("llama")
    requests = [Request(p, n) for p, n in zip(prompts()[3:8], [30, 70, 5, 40, 50])]
    sampling, record = Sampling(ignore_eos=True), Record(logits=True, positions=True)
    for key in ("bm", "bm-question"):
        whole = Engine(model, METHODS[key], 3).run(requests, sampling, record=record)
        monkeypatch.setattr(workspace, "EVICT_CHUNK_BYTES", 1)  # one layer per call
        assert workspace.eviction_layers(4, 3, 2, 96, 4) == 1
        layered = Engine(model, METHODS[key], 3).run(requests, sampling, record=record)
        monkeypatch.undo()
        check_against_alone(layered, [(o.tokens, o.logits, o.kept_positions) for o in whole.outputs])


def test_auto_compile_is_what_measured_fastest_on_each_device():
    """``compile="auto"`` (the default): CUDA graphs on a GPU (2.0x BM's eager step on an H200), eager on a CPU
    (compiled passes measured slower there) and under tensor parallelism (NCCL collectives were never captured)."""
    from batchmax_tp.core.replay import resolve

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve("auto", cpu) == "none"
    assert resolve("auto", gpu) == "cudagraphs"
    assert resolve("auto", gpu, tensor_parallel=True) == "none"
    assert resolve("cudagraphs", gpu, tensor_parallel=True) == "cudagraphs"  # asked for: the user's call
    assert resolve("default", cpu) == "default"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve("cudagraphs", cpu)


def test_run_prompts_serves_text_or_ids_in_the_memory_fkv_needs():
    """The users' entry: token ids or text (with a tokenizer) in, one output per prompt out, in order; by default
    in as many slots as fit FKV's memory at batch 4 of these prompts (the planner's), and the tokens are the
    engine's."""
    from batchmax_tp.api import run_prompts, same_memory_slots
    from batchmax_tp.plan.planner import max_slots, predict

    model = tiny_random_model("llama", seed=0)
    method = Method("bm", kv_max=32, p=8)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (40, 9, 70, 33, 51)]
    shape = ModelShape.from_config(model.config)
    budget = predict(shape, Method("fkv", p=8), 4, 70, 6).total
    want_slots = max(1, max_slots(budget, shape, method, 70, 6))
    assert same_memory_slots(model, method, 70, 6) == want_slots
    outs = run_prompts(model, prompts, method, 6, sampling=Sampling(ignore_eos=True))
    served = Engine(model, method, min(5, want_slots)).run([Request(p, 6) for p in prompts], Sampling(ignore_eos=True))
    assert [o.tokens for o in outs] == [o.tokens for o in served.outputs]
    assert all(o.text is None and len(o.tokens) == 6 for o in outs)

    class Tok:  # words as token ids
        eos_token_id, pad_token_id = 2, 0

        def __call__(self, text):
            return {"input_ids": [int(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(i) for i in ids)

    texts = [" ".join(map(str, p)) for p in prompts[:2]]
    outs = run_prompts(model, texts, method, 6, tokenizer=Tok(), slots=2, sampling=Sampling(ignore_eos=True))
    again = Engine(model, method, 2).run([Request(p, 6) for p in prompts[:2]], Sampling(ignore_eos=True))
    assert [o.tokens for o in outs] == [o.tokens for o in again.outputs]
    assert [o.text for o in outs] == [" ".join(map(str, o.tokens)) for o in again.outputs]
    with pytest.raises(ValueError, match="tokenizer"):
        run_prompts(model, texts, method, 6)


def _same(a, b) -> bool:
    """Whether two pass descriptions (or parts of one) are equal: tensors by value, the pool by identity."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        pairs = [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
        return type(a) is type(b) and all(x is y if name == "pool" else _same(x, y) for name, x, y in pairs)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("key", list(METHODS))
def test_describing_a_pass_changes_nothing_until_the_pool_runs_it(monkeypatch, key):
    """A pool's ``prefill_pass`` and ``decode_pass`` only describe: the host state they are handed (each row's, FKV
    paged's blocks) is the same after one, describing again gives the same pass (its rows' new states included),
    and the rows advance when the engine takes it; the run's tokens are unchanged."""
    from batchmax_tp.core.bounded import BoundedPool, SnapPool
    from batchmax_tp.core.dense import DensePool, PagedPool

    described = []

    def pure(fn):
        def describe(self, state, *args):
            before = copy.deepcopy(state)
            first = fn(self, state, *args)
            assert state == before, f"{fn.__name__} changed the host state it was handed"
            assert _same(first, fn(self, state, *args)), f"{fn.__name__} described the same pass twice differently"
            step = first[0] if isinstance(first, tuple) else first
            described.append((step.kind, len(step.after)))
            assert state.changed(step.change()) != state  # its rows advance once taken
            return first

        return describe

    model, method = model_of("llama"), METHODS[key]
    requests = [Request(p, n) for p, n in zip(prompts()[:6], NEW[:6])]
    want = Engine(model, method, 3).run(requests, Sampling(ignore_eos=True))
    for cls in (BoundedPool, SnapPool, DensePool, PagedPool):
        for name in ("prefill_pass", "decode_pass"):
            if name in vars(cls):
                monkeypatch.setattr(cls, name, pure(vars(cls)[name]))
    got = Engine(model, method, 3).run(requests, Sampling(ignore_eos=True))
    assert [o.tokens for o in got.outputs] == [o.tokens for o in want.outputs]
    kinds = {kind for kind, _ in described}
    assert "decode" in kinds and kinds & {"prefill", "compress"}, kinds
    assert all(advanced > 0 for _, advanced in described)  # every pass carries its rows' new states


def _attributes(pool) -> list:
    """Every attribute of a pool and of its layers, tensors by identity (their contents may change in place)."""

    def value(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v))
        if isinstance(v, dict):
            return tuple(sorted((k, value(x)) for k, x in v.items()))
        if isinstance(v, (list, tuple)):
            return tuple(value(x) for x in v)
        return repr(v)

    return [(type(o).__name__, sorted((k, value(v)) for k, v in vars(o).items())) for o in (pool, *pool.layers)]


@pytest.mark.parametrize("key", [*METHODS, "snap"])
def test_the_attention_assigns_nothing_on_a_pool_or_its_layers(monkeypatch, key):
    """Inside the attention function a pass only writes storage tensors in place: no attribute of the pool or of
    its layers is assigned (no tensor allocated or replaced, no peak noted, no row state advanced), in any pass of
    any method; the tokens are unchanged."""
    from batchmax_tp.core import attention

    original, calls, changed = attention.batchmax_attention, [0], []

    def watched(module, query, key, value, attention_mask, scaling=None, dropout=0.0, batchmax=None, **kwargs):
        before = _attributes(batchmax.pool)
        out = original(module, query, key, value, attention_mask, scaling, dropout, batchmax=batchmax, **kwargs)
        calls[0] += 1
        if _attributes(batchmax.pool) != before:
            changed.append(batchmax.kind)
        return out

    model = model_of("llama")
    method = Method("snap", KV, P, window=16, kernel=5) if key == "snap" else METHODS[key]
    requests = [Request(p, n) for p, n in zip(prompts()[:6], NEW[:6])]
    want = Engine(model, method, 3).run(requests, Sampling(ignore_eos=True))
    monkeypatch.setattr(attention, "batchmax_attention", watched)  # (registered anew by the engine's context)
    got = Engine(model, method, 3).run(requests, Sampling(ignore_eos=True))
    assert calls[0] > 0 and changed == []
    assert [o.tokens for o in got.outputs] == [o.tokens for o in want.outputs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_pool_is_allocated_from_the_models_shape_before_its_first_pass(monkeypatch, family):
    """``kv_layout`` (read from the model's projections) is the shape of the keys and values the model hands the
    attention, for every supported family; the pool exists before the first pass (the attention allocates nothing)."""
    from batchmax_tp.core import attention

    model, seen = model_of(family), []
    original = attention._rows_attention

    def looking(module, step, query, key, value, scaling):
        seen.append((step.pool.allocated, key.shape[1], key.shape[-1], value.shape[-1], key.dtype, query.shape[1]))
        return original(module, step, query, key, value, scaling)

    monkeypatch.setattr(attention, "_rows_attention", looking)
    Engine(model, METHODS["bm"], 2).run([Request(p, 3) for p in prompts()[:2]], Sampling(ignore_eos=True))
    lay = kv_layout(model)
    want = (True, lay.kv_heads, lay.k_dim, lay.v_dim, lay.dtype, lay.query_heads)
    assert seen and all(s == want for s in seen), (seen[:2], lay)


@pytest.mark.parametrize("key", ["bm-question", "fkv-paged"])
def test_a_run_stepped_by_hand_is_the_run(key):
    """``start``, ``step`` until it says the run is over, ``finish`` (the loop ``run`` is): the same tokens,
    kept positions, admissions and passes as ``run``, one ``step`` per pass; a second ``start`` before ``finish``
    is an error, ``close`` ends a run part-way, freeing its pool, and a run that cannot start holds nothing."""
    model, method = model_of("llama"), METHODS[key]
    requests = [Request(p, n) for p, n in zip(prompts()[:6], NEW[:6])]
    sampling, record = Sampling(ignore_eos=True), Record(positions=True)
    want = Engine(model, method, 3).run(requests, sampling, record=record)
    engine = Engine(model, method, 3)
    engine.start(requests, sampling, record=record)
    with pytest.raises(RuntimeError, match="already running"):
        engine.start(requests, sampling)
    steps = 0
    while engine.step():
        steps += 1
    got = engine.finish()
    assert steps == got.passes == want.passes and got.admissions == want.admissions
    assert [o.tokens for o in got.outputs] == [o.tokens for o in want.outputs]
    assert [o.kept_positions for o in got.outputs] == [o.kept_positions for o in want.outputs]
    assert engine.pool is None
    engine.start(requests, sampling)  # the engine runs again once the last run is over
    assert engine.step() and engine.pool is not None
    pool = engine.pool
    engine.close()
    assert engine.pool is None and pool.layers == []
    broken = Engine(model, method, 3, batching=Batching(pass_tokens=0))  # the scheduler refuses it, after the pool
    with pytest.raises(ValueError, match="pass_tokens"):
        broken.start(requests, sampling)
    assert broken.pool is None and broken.sched is None  # nothing held: a run that cannot start


WATCHED = {  # every pool: BM (a probing rule's stored queries, heads sharing a budget, budgets across layers), snap
    **METHODS,
    "bm-share": Method("bm", KV, P, rule="question:every=2,share=0"),
    "snap": Method("snap", kv_max=KV, p=P),
}


@pytest.mark.parametrize("key", list(WATCHED))
def test_between_passes_a_pools_host_state_changes_only_as_described(monkeypatch, key):
    """Once a run has started (its pool allocated), a pool is storage: the only attributes of a pool or of its
    layers assigned until it ends are the peaks it notes and, once, a probing rule's stored queries (storage,
    ``_allocate_probe_store``); the host state (each row's, FKV paged's blocks) is the engine's, assigned only where
    it takes a described change or pass (``_change``, ``_ready``): admissions into used slots, prompts shared by a
    group (a fork) and ended requests (blocks given back) change nothing else; the shared run's tokens and kept
    positions are those of a run that shares nothing."""
    from batchmax_tp.core.engine import Engine as EngineClass
    from batchmax_tp.core.layered import LayeredPool
    from batchmax_tp.core.slots import SlotLayer, SlotPool

    assigned, watching = set(), [False]
    for cls in (SlotPool, SlotLayer, LayeredPool, EngineClass):

        def setattr_(self, name, value, _original=cls.__setattr__, _engine=cls is EngineClass):
            if watching[0] and (not _engine or name == "state"):
                assigned.add((name, sys._getframe(1).f_code.co_name))  # (the attribute, the method assigning it)
            _original(self, name, value)

        monkeypatch.setattr(cls, "__setattr__", setattr_)
    forks, apply = [], SlotPool.apply

    def applying(self, change):
        forks.extend([change.fork] if change.fork is not None else [])
        apply(self, change)

    monkeypatch.setattr(SlotPool, "apply", applying)
    model, shared = model_of("llama"), prompts()[2]
    requests = [Request(p, n) for p, n in zip([shared, shared, *prompts()[3:8]], NEW[:7])]
    engine = Engine(model, WATCHED[key], 2, batching=Batching(share_prompts=True))
    engine.start(requests, Sampling(ignore_eos=True), record=Record(positions=True))
    watching[0] = True
    while engine.step():
        pass
    watching[0] = False
    got = engine.finish()
    alone = Engine(model, WATCHED[key], 2).run(requests, Sampling(ignore_eos=True), record=Record(positions=True))
    assert [o.tokens for o in got.outputs] == [o.tokens for o in alone.outputs]  # a shared prefill is each one's
    assert [o.kept_positions for o in got.outputs] == [o.kept_positions for o in alone.outputs]
    allowed = {("state", "_change"), ("state", "_ready"), ("peak_kv_bytes", "note"), ("peak_meta_bytes", "note")}
    allowed |= {("peak_workspace_bytes", "note_workspace")}
    allowed |= {(name, "_allocate_probe_store") for name in ("probe_q", "probe_lse", "probe_w")}
    # the watch sees the engine's and the pool's assignments; the group was shared
    assert {("state", "_change"), ("state", "_ready"), ("peak_workspace_bytes", "note_workspace")} <= assigned
    assert forks
    assert assigned <= allowed, sorted(assigned - allowed)
