"""Replicas that never wait for a dead one (``eval.replicas``), shards merged (``results.merge_run``,
``launch/merge.py``) and the OOM bookkeeping around them.

The end-to-end test runs two ``torchrun`` "nodes" of one rank each (2 replicas x 1 rank, gloo, a tiny model),
kills one replica mid-run and checks that the other ends the job on its own (its watchdog's line), that both replicas'
finished samples are on disk, and that the same command again completes only the missing samples and writes the
report an uninterrupted run writes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch.distributed as dist
from fakes import FakeTokenizer, fake_encode, make_fake_engine
from multiproc import CHILDREN_PY, LOSE_AFTER_S, RUN_PY, free_port, lose_node_1, tool, torchrun_nodes

from batchmax_tp.config import RunConfig
from batchmax_tp.eval import merge, replicas, results
from batchmax_tp.eval.context import RunContext
from batchmax_tp.eval.oom import is_oom
from batchmax_tp.eval.replicas import Channel, SetupBound, Watchdog
from batchmax_tp.eval.run import evaluate_run
from batchmax_tp.eval.summary import run_settings, write_config


def local_store(world: int) -> tuple[dist.TCPStore, int]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=None,
        is_master=True,
        timeout=datetime.timedelta(seconds=5),
        wait_for_workers=False,
    )
    return server, port


def client(port: int, timeout_s: float = replicas._STORE_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


# ---------------------------------------------------------------------- the watchdog
def watch(store, rank: int, world: int, dead_after_s: float = 1.0) -> tuple[Watchdog, threading.Event, list[str]]:
    dead, why = threading.Event(), []

    def on_dead(message: str) -> None:
        why.append(message)
        dead.set()

    return Watchdog(store, rank, world, beat_s=0.1, dead_after_s=dead_after_s, on_dead=on_dead).start(), dead, why


def test_watchdog_ends_a_rank_whose_peer_stops_beating():
    server, port = local_store(2)
    w0, dead0, why0 = watch(client(port), 0, 2)
    w1, dead1, _ = watch(client(port), 1, 2)
    w1._stop.set()  # rank 1 stops beating without leaving (as a killed process does)
    assert dead0.wait(60), "rank 0 never noticed that rank 1 stopped"  # 60 s: a guard; ~1 s when it works
    assert "rank 1 has not answered" in why0[0]


def test_watchdog_ends_every_rank_when_one_fails_and_spares_ranks_that_left():
    server, port = local_store(3)
    dogs = [watch(client(port), r, 3, dead_after_s=30) for r in range(3)]
    dogs[2][0].leave(wait_s=0)  # rank 2 is done: its silence is no death
    time.sleep(0.5)
    assert not any(d[1].is_set() for d in dogs)  # every rank beats or left: nobody is dead
    dogs[1][0].fail("RuntimeError: injected")
    assert dogs[0][1].wait(60) and "rank 1: RuntimeError: injected" in dogs[0][2][0]


def test_watchdog_ends_a_rank_when_the_store_is_gone():
    server, port = local_store(2)
    _, dead, why = watch(client(port, timeout_s=1), 1, 2, dead_after_s=30)
    del server  # rank 0's host is gone, and its store with it
    assert dead.wait(60) and "store does not answer" in why[0]


def test_setup_bound_names_the_step_and_the_lock_it_waits_on(tmp_path):
    """A rank stuck in a real ``FileBaton.wait`` on a lock a killed build left (10 minutes old): when the bound passes,
    one line names the step, the lock's path and its age; the peers are told the same."""
    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (time.time() - 600,) * 2)
    ended, told = [], []
    expired = threading.Event()

    def rank() -> None:
        bound = SetupBound(1, 0.3, check_s=0.05, on_expire=lambda line: (ended.append(line), expired.set()))
        bound.tell = told.append
        with bound.step("DeepSpeed's set-up (gloo, 127.0.0.1:1)"):
            FileBaton(str(lock), wait_seconds=0.02).wait()

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    assert expired.wait(60)  # a guard; ~0.3 s when it works
    lock.unlink()  # lets the waiting thread go
    thread.join(60)
    assert len(ended) == 1 and told == [ended[0].removeprefix("rank 1: ")], (ended, told)
    assert ended[0].startswith(
        "rank 1: set-up did not finish within 0.3 s (setup_timeout): waiting in DeepSpeed's set-up (gloo, 127.0.0.1:1)"
    ), ended[0]
    assert re.search(rf"on the lock file {re.escape(str(lock))} \(6\d\d s old", ended[0]), ended[0]


def test_setup_bound_ends_nothing_once_done_or_inactive():
    ended = []
    done = SetupBound(0, 0.2, check_s=0.02, on_expire=ended.append)
    done.done()
    SetupBound(0, 0.2, check_s=0.02, active=False, on_expire=ended.append)  # a world of one: nothing watched
    expired = SetupBound(0, 0.2, check_s=0.02, on_expire=ended.append)
    with expired.step("a step"):
        deadline = time.monotonic() + 60  # a guard; ~0.2 s when it works
        while not ended and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(0.3)  # the other two had their chance too
    assert len(ended) == 1 and "waiting in a step" in ended[0], ended


def test_channel_broadcast_gather_and_last_decides():
    server, port = local_store(3)
    channels = [Channel(client(port), r, 3) for r in range(3)]
    out: dict[int, list] = {}

    def rank(r: int) -> None:
        c = channels[r]
        time.sleep(0.1 * (2 - r))  # ranks arrive in reverse order
        got = [c.broadcast(f"from0-{r}" if r == 0 else None), c.gather(r * 10)]
        got.append(c.last_decides(r, lambda parts: {"parts": parts, "decider": r}))
        c.barrier()
        out[r] = got

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [out[r][0] for r in range(3)] == ["from0-0"] * 3
    assert out[0][1] == [0, 10, 20] and out[1][1] is None and out[2][1] is None
    decisions = [out[r][2] for r in range(3)]
    assert decisions[0] == decisions[1] == decisions[2] and decisions[0]["parts"] == [0, 1, 2]
    assert decisions[0]["decider"] == 0  # rank 0 slept longest: it arrived last and decided


# ---------------------------------------------------------------------- OOM bookkeeping
@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuSOLVER error: CUSOLVER_STATUS_ALLOC_FAILED",
        "CUDA driver error: cudaErrorMemoryAllocation",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
    ],
)
def test_cuda_library_allocation_failures_are_out_of_memory(message):
    assert is_oom(RuntimeError(message))
    assert not is_oom(RuntimeError("CUDA error: device-side assert triggered"))


def test_an_oom_marker_becomes_the_row_once_and_a_later_success_stands(tmp_path):
    """A marker left by a rank that ran out of memory becomes the run's OOM row and is cleared; run again after
    that row is removed (more memory free), the run succeeds and no stale marker turns it back into an OOM."""
    samples = [SimpleNamespace(id=str(i), prompt="a " * (i + 1), reference="w10", tokens_cut=0) for i in range(3)]
    cfg = RunConfig(  # static batches: the fake engine generates them
        methods=["bm"], kv_max=128, p=16, batch_size=2, max_new_tokens=4, out=str(tmp_path), scheduler="static"
    )
    spec = cfg.sweep.run_specs()[0]
    folder = tmp_path / spec.name
    results.write_oom_marker(folder, 1, "CUDA out of memory (injected)", 0)
    calls = []
    run = dict(engine_fn=make_fake_engine(calls), encode_fn=fake_encode, progress=False)
    first = evaluate_run(RunContext(SimpleNamespace(), FakeTokenizer(), **run), samples, spec, cfg)
    assert first.status == "oom" and first.oom_cause == "runtime" and "injected" in first.error
    assert calls == [] and not list(folder.glob("oom-rank*.json"))
    (folder / results.SUMMARY_FILE).unlink()
    second = evaluate_run(RunContext(SimpleNamespace(), FakeTokenizer(), **run), samples, spec, cfg)
    assert second.status == "done" and second.num_samples == 3 and len(calls) == 2


def test_resuming_with_another_dp_size_is_refused(tmp_path):
    cfg = RunConfig(out=str(tmp_path), dp_size=2, tp_size=1)
    write_config(tmp_path, cfg)
    assert results.check_same_config(tmp_path, cfg.to_dict())
    with pytest.raises(ValueError, match="dp_size=2, this run has dp_size=1"):
        results.check_same_config(tmp_path, RunConfig(out=str(tmp_path), dp_size=1, tp_size=1).to_dict())


# ---------------------------------------------------------------------- merging shards by hand
def _shard(folder: Path, replica: int, batches: list[int], ids: list[list[str]], done: bool) -> None:
    method, kv = folder.name.split("-b1-kv")
    cfg = RunConfig(methods=[method], kv_max=int(kv), batch_size=1, out=str(folder.parent))
    settings = run_settings(cfg, cfg.sweep.run_specs()[0], dp_size=2)
    assert settings["run"] == folder.name
    head = {"settings": settings, "batch_ids": ids, "dp": 2, "tp": 1, "continuous": False, "budget": {}, "extra": {}}
    shard = folder / f"replica{replica}"
    log = results.RunLog(shard)
    shard.mkdir(parents=True)
    (shard / results.HEAD_FILE).write_text(json.dumps(head))
    for b in batches:
        n = len(ids[b])
        samples = [results.SampleRecord(i, 3, "w10", "w10", True, 4) for i in ids[b]]
        log.append(samples, [results.BatchRecord(b, replica, ids[b], [0] * n, 4 * n, 1.0, 1.0, 8, [8], 0, None)])
    if done:
        (shard / results.DONE_FILE).write_text(json.dumps({"started_at": "2026-01-01T00:00:00Z", "wall_s": 2.0}))


def test_merge_py_merges_complete_runs_and_names_the_rest(tmp_path, capsys):
    ids = [["a"], ["b"], ["c"]]
    _shard(tmp_path / "bm-b1-kv128", 0, [0, 2], ids, done=True)
    _shard(tmp_path / "bm-b1-kv128", 1, [1], ids, done=True)
    _shard(tmp_path / "ed-b1-kv65", 0, [0, 2], ids, done=True)
    _shard(tmp_path / "ed-b1-kv65", 1, [], ids, done=False)  # replica 1 died before its batch
    assert merge.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "not merged: ed-b1-kv65: 2 of 3 batches done" in err
    merged = tmp_path / "bm-b1-kv128"
    assert [json.loads(x)["id"] for x in (merged / "samples.jsonl").read_text().splitlines()] == ["a", "b", "c"]
    summary = json.loads((merged / "summary.json").read_text())
    assert summary["status"] == "done" and summary["num_samples"] == 3 and summary["accuracy"] == 1.0
    assert [r["wall_s"] for r in summary["per_replica"]] == [2.0, 2.0]
    assert (tmp_path / "report.md").is_file() and not (tmp_path / "ed-b1-kv65" / "summary.json").exists()


# ---------------------------------------------------------------------- a killed replica, end to end
def launch_nodes(
    checkpoint: str,
    out: Path,
    held: bool = False,
    flags: tuple[str, ...] = (),
    node_flags: tuple[tuple[str, ...], ...] = ((), ()),
    **env_vars: str,
) -> list[subprocess.Popen]:
    """The job on two nodes (``torchrun_nodes``): replica 0 on node 0, replica 1 on node 1 (``held``: with the hold
    of ``children.hold`` installed, ``HOLD_STAGE`` and ``HOLD_MARKER`` in ``env_vars``; ``node_flags``: each node's
    own flags after the shared ``flags``). Each run gets a torch extensions folder of its own unless
    ``TORCH_EXTENSIONS_DIR`` is given (as on a fresh machine: nothing built)."""
    args = ["--model", checkpoint, "--method", "bm", "--kv-max", "64", "--p", "16", "--batch-size", "1"]
    args += ["--num-samples", "6", "--max-new-tokens", "32", "--ignore-eos", "--tp-size", "1", "--out", str(out)]
    env_vars.setdefault("TORCH_EXTENSIONS_DIR", str(out.parent / "torch_extensions"))
    if held:
        return torchrun_nodes(CHILDREN_PY, ["held_run", *args, *flags], node_args=node_flags, **env_vars)
    return torchrun_nodes(RUN_PY, [*args, *flags], node_args=node_flags, **env_vars)


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str, str]]:
    got = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:  # each node's agent and its workers (a worker may sit in a process group of its own)
                for victim in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        victim.kill()
            pytest.fail(f"a node did not finish in {timeout} s")
        got.append((proc.returncode, out, err))
    return got


RUN = "bm-b1-kv64"


def shard_lines(out: Path, replica: int) -> list[str]:
    path = out / RUN / f"replica{replica}" / results.BATCHES_FILE
    return path.read_text().splitlines() if path.is_file() else []


#: Where DeepSpeed would build its CPU shared-memory op: a killed build leaves this lock behind.
SHM_LOCK = Path("deepspeed_shm_comm") / "lock"


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_dir) -> SimpleNamespace:
    """The uninterrupted run of 2 replicas, on a machine where a killed DeepSpeed op build left its lock behind (one
    hour old): no job builds the op, so none waits on it."""
    folder = tmp_path_factory.mktemp("whole")
    extensions, out = folder / "torch_extensions", folder / "out"
    (extensions / SHM_LOCK).parent.mkdir(parents=True)
    (extensions / SHM_LOCK).write_text("")
    os.utime(extensions / SHM_LOCK, (time.time() - 3600,) * 2)
    errs = []
    for code, _, err in finish(launch_nodes(tiny_dir, out, TORCH_EXTENSIONS_DIR=str(extensions))):
        assert code == 0, err[-4000:]
        errs.append(err)
    return SimpleNamespace(out=out, errs=errs, extensions=extensions)


@pytest.mark.skipif(tool("torchrun") is None, reason="torchrun is not installed")
def test_a_stale_extension_lock_is_named_on_every_rank_and_never_waited_on(whole):
    """The lock a killed build left: every rank names it in one line (path and age) and the job completes without
    building anything (the folder holds that lock alone)."""
    lock = whole.extensions / SHM_LOCK
    for rank, err in enumerate(whole.errs):
        lines = [line for line in err.splitlines() if str(lock) in line]
        assert len(lines) == 1, err[-3000:]
        assert re.search(
            rf"rank {rank}: {re.escape(str(lock))} \(36\d\d s old\) is the lock of a torch extension", lines[0]
        )
    assert sorted(p.relative_to(whole.extensions) for p in whole.extensions.rglob("*")) == [SHM_LOCK.parent, SHM_LOCK]


@pytest.mark.skipif(tool("torchrun") is None, reason="torchrun is not installed")
def test_a_dead_replica_ends_the_job_and_the_rerun_completes_only_what_is_missing(tmp_path, tiny_dir, whole):
    """Replica 1 held before its third batch is written (two of three on disk: ``children.hold``'s ``batch3``), then
    SIGSTOP: a hung rank or a lost node, whose sockets stay open and whose torchrun waits forever (before the
    watchdog, the other replica waited in the 4-hour result gather). (victim 0, SIGKILL: rank 0 and the store it
    hosts gone, ran by hand: the other node exits in ~2 s; its watchdog is tested on a store that goes away above.)"""
    out, marker = tmp_path / "dead", tmp_path / "held.pid"
    procs = launch_nodes(
        tiny_dir, out, held=True, HOLD_STAGE="batch3", HOLD_MARKER=str(marker), BATCHMAX_DEAD_AFTER_S=LOSE_AFTER_S
    )
    worker, _ = lose_node_1(procs, marker, "stop")  # held before its third batch is written: two of three on disk
    code, _, err = finish([procs[0]], timeout=150)[0]  # a guard: the watchdog's line is the assertion
    with contextlib.suppress(psutil.NoSuchProcess):
        worker.kill()  # a stopped worker holds its node's pipes open: end it before reading them
    procs[1].communicate(timeout=60)
    assert code != 0
    assert "rank 1 has not answered" in err, err[-3000:]
    kept = [shard_lines(out, r) for r in range(2)]
    assert len(kept[1]) == 2 and kept[0], kept  # every finished batch of both replicas is on disk
    assert not (out / RUN / results.SUMMARY_FILE).exists()

    for code, _, err in finish(launch_nodes(tiny_dir, out)):
        assert code == 0, err[-4000:]
    for r in range(2):  # the batches finished before the kill were not run again: their lines are unchanged
        assert shard_lines(out, r)[: len(kept[r])] == kept[r]
    assert results.comparable(out) == results.comparable(whole.out)
    assert json.loads((out / RUN / results.SUMMARY_FILE).read_text())["num_samples"] == 6


# ---------------------------------------------------------------------- a node lost while the job starts
# A hold on node 1 (rank 1, ``children.hold``): at HOLD_STAGE it writes its pid to HOLD_MARKER and waits there, as a
# node does while it loads or meets the others; the test then loses that node. Nothing is held without HOLD_STAGE.
@pytest.mark.skipif(tool("torchrun") is None, reason="torchrun is not installed")
@pytest.mark.parametrize(
    "stage, lose",
    [("load", "kill"), ("load", "stop"), ("build", "kill"), ("setup", "stop")],
    ids=["load-node-killed", "load-worker-stopped", "build-node-killed", "setup-worker-stopped"],
)
def test_a_node_lost_while_the_job_starts_ends_the_other(tmp_path, tiny_dir, whole, stage, lose):
    """Node 1 lost while it loads the model, where DeepSpeed would build its shared-memory op on a machine where it
    is not built (a fresh extensions folder), or inside the first process-group set-up (where node 0 waits for it):
    SIGKILL of its torchrun agent and worker (a lost node), or SIGSTOP of its worker (a hung one). Node 0's watchdog
    runs from the first moment (``replicas.watch_from_start``), so it exits non-zero naming rank 1 (in ~10 s here),
    where it used to wait out ``setup_timeout`` (30 minutes). The same command again on both nodes completes the
    job with the results of an uninterrupted run, and nothing was built (no lock a killed build could leave)."""
    marker = tmp_path / "held.pid"
    out = tmp_path / "out"
    procs = launch_nodes(
        tiny_dir, out, held=True, HOLD_STAGE=stage, HOLD_MARKER=str(marker), BATCHMAX_DEAD_AFTER_S=LOSE_AFTER_S
    )
    worker, _ = lose_node_1(procs, marker, lose)
    code, _, err = finish([procs[0]], timeout=150)[0]  # a guard: the watchdog's line is the assertion
    with contextlib.suppress(psutil.NoSuchProcess):
        worker.kill()
    procs[1].communicate(timeout=60)
    assert code != 0, (code, err[-3000:])
    assert "rank 1 has not answered" in err, err[-3000:]
    if (stage, lose) != ("build", "kill"):
        return
    for code, _, err in finish(launch_nodes(tiny_dir, out)):
        assert code == 0, err[-4000:]
    assert results.comparable(out) == results.comparable(whole.out)
    assert not any((tmp_path / "torch_extensions").rglob("*")), "a DeepSpeed op was built"


@pytest.mark.skipif(tool("torchrun") is None, reason="torchrun is not installed")
def test_a_live_rank_stuck_in_set_up_ends_every_rank_at_the_set_up_bound(tmp_path, tiny_dir):
    """Node 1 alive but stuck while it loads the model (its watchdog beats on, so no peer can call it dead): at
    ``--setup-timeout 15`` it ends with one line naming that step, and node 0 (waiting for it to load, its own bound
    120 s, so that node 1's always passes first) ends too, with node 1's line."""
    marker = tmp_path / "held.pid"
    procs = launch_nodes(
        tiny_dir,
        tmp_path / "out",
        held=True,
        node_flags=(("--setup-timeout", "120"), ("--setup-timeout", "15")),
        HOLD_STAGE="load",
        HOLD_MARKER=str(marker),
    )
    (code0, _, err0), (code1, _, err1) = finish(procs, timeout=150)  # a guard: the lines below are the assertion
    assert code0 != 0 and code1 != 0, (err0[-3000:], err1[-3000:])
    stuck = "set-up did not finish within 15 s (setup_timeout): waiting in loading the model"
    assert f"error: rank 1: {stuck}" in err1, err1[-3000:]
    assert f"rank 1: {stuck}" in err0, err0[-3000:]
