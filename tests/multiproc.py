"""What the multi-process tests share (no test module imports another): tiny models of every family, the prompt
batch, tensor-parallel ranks started from a fork server (``spawn``) compared with a single process, collective
counting, and child processes under torchrun (``children.py``)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp
from tiny import tiny_random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_PY = os.path.join(ROOT, "launch", "run.py")
CHILDREN_PY = os.path.join(ROOT, "tests", "children.py")  # child processes as importable functions
# 9 query / 3 KV heads, like the embedded model: AutoTP splits them unevenly on tp=2 (6/2 and 3/1).
GQA_9_3 = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16, initializer_range=0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 60), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :23] = 0
    mask[1, :8] = 0
    return ids.masked_fill(mask == 0, 0), mask


# Every family of the paper and two more: Phi-3 has a fused qkv_proj / gate_up_proj and no GQA (6 heads, 6 KV
# heads); Qwen2 has q/k/v biases; Mistral is Llama-like with its own classes. 6 heads allow tp 2 and 3.
FAMILIES = {
    "llama": dict(family="llama", **GQA_9_3),
    "phi3": dict(
        family="phi3", hidden_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=16, initializer_range=0.2
    ),
    "qwen2": dict(
        family="qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, initializer_range=0.2
    ),
    "mistral": dict(
        family="mistral",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.2,
    ),
}


def make_model(embedded: bool | str):
    """``False``: the 9/3 GQA Llama (the embedded model's heads); a family name: that tiny model; ``arch:NAME``: that
    architecture with random weights."""
    if isinstance(embedded, str) and embedded.startswith("arch:"):
        from batchmax_tp.models import load_model

        return load_model(embedded, dtype="float32", device="cpu")[0]
    return tiny_random_model(seed=0, **FAMILIES[embedded or "llama"])


def prompt_batch(embedded: bool | str, replica: int = 0):
    return batch(seed=replica)


def count_collectives() -> dict[str, int]:
    """Wrap torch.distributed's collectives in this process; returns the live call counts by name."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "barrier"):
        orig = getattr(dist, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _orig(*a, **k)

        setattr(dist, name, wrapped)
    return counts


def _worker(rank, world, tp_size, port, outdir, method, new, embedded, count_collectives_):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from batchmax_tp import parallel as tp
    from batchmax_tp.bench.padded import generate

    layout = tp.init_distributed(tp_size)
    model = tp.apply_tensor_parallel(make_model(embedded), layout, torch.float32)
    ids, mask = prompt_batch(embedded, layout.replica)
    counts = count_collectives() if count_collectives_ else {}
    results = {}
    for m in method:
        counts.clear()
        out = generate(model, ids, mask, m, new, ignore_eos=True, return_logits=True)
        results[m.name] = results[m.label()] = dict(
            tokens=out.tokens,
            logits=torch.stack(out.logits),
            kept=out.kept_positions(),
            local_kv_heads=len(out.kept_positions()[0][0]),
            collectives=dict(counts),
            forwards=out.served.passes,
            params=sum(p.numel() for p in model.parameters()),
            host_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


#: What every rank imports, imported once per test session by the fork server the ranks start from (``spawn``
#: imported them again in every rank: ~5 s of CPU each on this machine, most of a small test's time).
PRELOAD = [
    "torch",
    "transformers",
    "deepspeed",
    *(f"transformers.models.{f}.modeling_{f}" for f in ("llama", "phi3", "qwen2", "mistral")),
    "batchmax_tp.core.engine",
    "batchmax_tp.parallel",
    "tiny",
    "multiproc",
]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined (``mp.spawn``'s contract: a rank's exception fails the
    call), each forked from a server that has imported ``PRELOAD`` (a fresh single-threaded process: no parent
    state, no OpenMP pool, no process group is inherited)."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_tp(tmp_path, world, tp_size, methods, new=12, embedded=False, count_collectives=False):
    spawn(_worker, (world, tp_size, free_port(), str(tmp_path), methods, new, embedded, count_collectives), world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def single_process(methods, new=12, embedded=False, replica=0):
    from batchmax_tp.bench.padded import generate

    model = make_model(embedded)
    ids, mask = prompt_batch(embedded, replica)
    out = {}
    for m in methods:
        o = generate(model, ids, mask, m, new, ignore_eos=True, return_logits=True)
        out[m.name] = dict(tokens=o.tokens, logits=torch.stack(o.logits), kept=o.kept_positions())
    return out


def assert_matches_single(ranks, single, method: str, tp_size: int):
    """Logits and tokens equal on every rank; rank r's kept sets equal the single run's for r's KV heads."""
    offset = 0
    for r, res in enumerate(ranks[:tp_size]):
        got = res[method]
        torch.testing.assert_close(got["logits"], single[method]["logits"], atol=1e-4, rtol=0)
        assert torch.equal(got["tokens"], single[method]["tokens"])
        h = got["local_kv_heads"]
        want = [[heads[offset : offset + h] for heads in layer] for layer in single[method]["kept"]]
        assert got["kept"] == want, f"rank {r}: kept positions differ from heads {offset}..{offset + h - 1}"
        offset += h
    total_heads = len(single[method]["kept"][0][0])
    assert offset == total_heads


def run_child(name: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """``tests/children.py NAME`` on 2 ranks under torchrun; ``timeout`` guards the test, never asserted."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # kept: the GPU package set's wheels
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    return subprocess.run(
        [*command, str(free_port()), os.path.join(ROOT, "tests", "children.py"), name],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_rank1_killed_and_nobody_finished(proc: subprocess.CompletedProcess, reached: str) -> None:
    """Both ranks reached ``reached`` (the child ran), rank 1 was killed there, rank 0 ended without finishing. (The
    ranks share one pipe: a line of one may land inside another's, so the text is searched, not its lines.)"""
    out = proc.stdout
    assert proc.returncode != 0, out
    for rank in range(2):
        assert f"rank {rank}: {reached}" in out, (out, proc.stderr[-3000:])
    assert "rank 1: killed" in out and "generated again" not in out and "served every request" not in out, out
    assert "Signal 9 (SIGKILL)" in proc.stderr or "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]


# Launcher/rank variables that must not leak from the environment pytest runs in.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def tool(name: str) -> str | None:
    """The launcher installed next to this Python (so it runs the same interpreter), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)


#: The watchdog's limit for a test that loses a node on purpose (its peers must notice within the test's time); a run
#: that must complete keeps the production limit (``replicas.DEAD_AFTER_S``, 30 s), which a loaded machine's slow
#: start-up cannot trip.
LOSE_AFTER_S = "6"


def torchrun_nodes(
    script: str, args: list[str], node_args: tuple[tuple[str, ...], ...] = ((), ()), **env_vars: str
) -> list[subprocess.Popen]:
    """``script args`` on two torchrun "nodes" of one rank each (static rendezvous on this host; the watchdog's limit
    the production one unless ``env_vars`` sets ``BATCHMAX_DEAD_AFTER_S``, as a test losing a node does:
    ``LOSE_AFTER_S``), each in a session of its own; ``node_args``: each node's own arguments after ``args``."""
    port, env = free_port(), clean_env(**env_vars)
    node = ["--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    return [
        subprocess.Popen(
            [tool("torchrun"), *node, "--node_rank", str(n), script, *args, *node_args[n]],
            env=env,
            cwd=Path(RUN_PY).parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for n in range(2)
    ]


def lose_node_1(nodes: list[subprocess.Popen], marker: Path, lose: str) -> tuple[psutil.Process, float]:
    """Wait until node 1 holds (``children.hold``), then lose it: "kill" (SIGKILL of its torchrun agent and worker: a
    lost node) or "stop" (SIGSTOP of its worker: a hung one, or a lost node whose sockets stay open). Returns its
    worker and when it was lost."""
    deadline = time.monotonic() + 120
    while not marker.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in nodes):
            for p in nodes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for victim in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                        victim.kill()
            errs = [p.communicate()[1][-2000:] for p in nodes]
            raise AssertionError(f"node 1 never got there: {errs}")
        time.sleep(0.05)
    worker = psutil.Process(int(marker.read_text()))
    if lose == "kill":
        for victim in (psutil.Process(nodes[1].pid), worker):
            victim.kill()
    else:
        worker.send_signal(signal.SIGSTOP)
    return worker, time.monotonic()


def lm_eval_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``batchmax-lm-eval ARGS`` (the installed console script; its entry function where none is installed)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    script = shutil.which("batchmax-lm-eval")
    command = [script] if script else [sys.executable, "-m", "batchmax_tp.harness"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
