"""launch/run.py under real launchers on CPU (gloo, embedded model): deepspeed, torchrun, mpiexec, a simulated srun.

Tensor-parallel (tp=2) and data-parallel (dp=2) runs must write the same ``samples.jsonl`` as a single process
(same ids, same order, same outputs), and a summary with the layout and per-replica numbers. Layout errors stop
the run with one line before any weight is loaded. Every run is small (2 samples, batch 1, 4 new tokens, bm with
kv_max 128 / p 32 on ~370-token prompts cut from the bundled fixture, so BM evicts during prefill and decoding)
and uses one thread per process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from multiproc import CHILDREN_PY, ROOT, RUN_PY, clean_env, free_port, tool

from batchmax_tp import parallel as tp
from batchmax_tp.config import ConfigError, parse_args

SMALL = [
    "--method",
    "bm",
    "--num-samples",
    "2",
    "--batch-size",
    "1",
    "--max-new-tokens",
    "4",
    "--kv-max",
    "128",
    "--p",
    "32",
]
SUMMARY_KEYS = (
    "method",
    "batch_size",
    "kv_max",
    "p",
    "tp_size",
    "num_samples",
    "generated_tokens",
    "tokens_per_s",
    "prefill_s",
    "decode_s",
    "peak_kv_bytes",
)
TIMEOUT_S = 240


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT_S) -> SimpleNamespace:
    """Run a launcher in its own process group; on timeout the whole group (launcher + ranks) is killed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env or clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[0]} did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err[-5000:]}")
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err, elapsed=time.monotonic() - start)


def assert_ok(res: SimpleNamespace) -> None:
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-8000:]}"


RUN = "bm-b1-kv128"  #: SMALL's one run: its folder


def samples(out: Path) -> list[dict]:
    folder = out / RUN if (out / RUN).is_dir() else out
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict:
    folder = out / RUN if (out / RUN).is_dir() else out
    return json.loads((folder / "summary.json").read_text())


def _short_data(folder: Path) -> Path:
    """The fixture's first two samples, each document cut to its first 1400 characters + its question."""
    from batchmax_tp.eval.tasks import default_fixture_path

    path = folder / "short.jsonl"
    lines = []
    for line in default_fixture_path().read_text().splitlines()[:2]:
        record = json.loads(line)
        prompt = record["prompt"]
        record["prompt"] = prompt[:1400] + "\n\n" + prompt[prompt.rindex("Question:") :]
        lines.append(json.dumps(record) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> list[str]:
    """The flags of every run: SMALL on the short data file."""
    return [*SMALL, "--data", str(_short_data(tmp_path_factory.mktemp("data")))]


@pytest.fixture(scope="module")
def single(tmp_path_factory, small):
    """The reference: a plain single-process run."""
    out = tmp_path_factory.mktemp("single") / "D0"
    res = run([sys.executable, RUN_PY, *small, "--out", str(out)])
    assert_ok(res)
    return SimpleNamespace(out=out, samples=samples(out), summary=summary(out), stdout=res.stdout)


def check_matches_single(out: Path, single, tp_size: int, dp_size: int) -> dict:
    got = samples(out)
    assert [r["id"] for r in got] == [r["id"] for r in single.samples]  # each sample once, in file order
    assert got == single.samples  # same outputs, prompt lengths, token counts, correctness
    s = summary(out)
    for key in SUMMARY_KEYS:
        assert key in s, key
    assert (s["tp_size"], s["dp_size"]) == (tp_size, dp_size)
    assert (s["method"], s["batch_size"], s["kv_max"], s["p"]) == ("bm", 1, 128, 32)
    assert s["num_samples"] == 2 and s["generated_tokens"] == single.summary["generated_tokens"] == 8
    # A replica's K/V bytes are summed over its TP ranks (each holds its own KV heads): the same as one process.
    assert s["peak_kv_bytes"] == single.summary["peak_kv_bytes"] > 0
    replicas = s["per_replica"]
    assert [r["replica"] for r in replicas] == list(range(dp_size))
    assert [r["ranks"] for r in replicas] == [list(range(i * tp_size, (i + 1) * tp_size)) for i in range(dp_size)]
    for r in replicas:
        for key in ("generated_tokens", "prefill_s", "decode_s", "tokens_per_s"):
            assert key in r, key
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / (r["prefill_s"] + r["decode_s"]))
        assert sum(r["peak_kv_bytes_per_rank"]) == r["peak_kv_bytes"]
    assert sum(r["generated_tokens"] for r in replicas) == s["generated_tokens"]
    slowest = max(r["prefill_s"] + r["decode_s"] for r in replicas)
    assert s["tokens_per_s"] == pytest.approx(s["generated_tokens"] / slowest)
    assert s["prefill_s"] + s["decode_s"] == pytest.approx(slowest)
    return s


def check_stdout_is_one_table(stdout: str) -> None:
    """Only rank 0 prints, and only the report, on stdout (launcher chatter aside)."""
    assert stdout.count("# Batch-Max results") == 1, stdout
    assert stdout.count("| Method | b | kv_max | contains |") == 1 and stdout.count("| BM | 1 | 128 | 0.") == 1, stdout
    assert "AutoTP" not in stdout and "built successfully" not in stdout, stdout


# ---------------------------------------------------------------------- single process
def test_single_process_summary(single):
    s = single.summary
    assert (s["tp_size"], s["dp_size"]) == (1, 1) and "per_replica" not in s
    assert [r["id"] for r in single.samples] == ["lighthouse_dog", "harwick_bridge"]
    assert all(r["generated_tokens"] == 4 and r["output"] for r in single.samples)
    assert single.stdout == (single.out / "report.md").read_text()
    check_stdout_is_one_table(single.stdout)


# ---------------------------------------------------------------------- tensor parallel, 2 ranks
# torchrun's default tp=2 launch runs in test_oom_inside_a_tp_forward_ends_the_job_and_the_rerun_records_it
@pytest.mark.parametrize("launcher", ["deepspeed"])
def test_tp2_equals_single_process(tmp_path, single, launcher, small):
    exe = tool(launcher)
    if exe is None:
        pytest.skip(f"{launcher} is not installed")
    out = tmp_path / ("D1" if launcher == "deepspeed" else "D2")
    nproc = ["--num_gpus", "2"] if launcher == "deepspeed" else ["--nproc_per_node", "2"]
    # No --tp-size: the launch's two processes split the heads (tp_size defaults to the world size).
    res = run([exe, *nproc, "--master_port", str(free_port()), RUN_PY, *small, "--out", str(out)])
    assert_ok(res)
    s = check_matches_single(out, single, tp_size=2, dp_size=1)
    # SmolLM2 has 3 KV heads: AutoTP gives rank 0 two of them and rank 1 one.
    assert s["per_replica"][0]["peak_kv_bytes_per_rank"] == [2 * s["peak_kv_bytes"] // 3, s["peak_kv_bytes"] // 3]
    check_stdout_is_one_table(res.stdout)
    assert sorted(os.listdir(out / RUN)) == ["batches.jsonl", "samples.jsonl", "summary.json"]
    assert parse_args(["--config", str(out / "config.yaml")]).parallel.tp_size == 2


# ---------------------------------------------------------------------- data parallel, 2 replicas
def test_dp2_equals_single_process(tmp_path, single, small):
    exe = tool("torchrun")
    if exe is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "DP"
    res = run(
        [
            exe,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            RUN_PY,
            *small,
            "--tp-size",
            "1",
            "--out",
            str(out),
        ]
    )
    assert_ok(res)
    s = check_matches_single(out, single, tp_size=1, dp_size=2)
    # Batch i went to replica i % 2: one sample each.
    assert [r["num_samples"] for r in s["per_replica"]] == [1, 1]
    assert [r["generated_tokens"] for r in s["per_replica"]] == [4, 4]
    check_stdout_is_one_table(res.stdout)


# ---------------------------------------------------------------------- MPI
def test_mpiexec_tp2_equals_single_process(tmp_path, single, small):
    exe = tool("mpiexec")
    if exe is None:
        pytest.skip("mpiexec is not installed (pip install mpich mpi4py)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (DeepSpeed's MPI support needs it)")
    out = tmp_path / "MPI"
    # The rank's environment reaches each process (MPICH and Open MPI both forward it by default).
    res = run(
        [exe, "-n", "2", sys.executable, RUN_PY, *small, "--tp-size", "2", "--out", str(out)],
        env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
    )
    assert_ok(res)
    check_matches_single(out, single, tp_size=2, dp_size=1)
    check_stdout_is_one_table(res.stdout)


# ---------------------------------------------------------------------- SLURM (no real SLURM here)
# A child process (torch imported once, ``children.world_check``) that, for each case, replaces its whole
# environment with the case's launcher variables and reports tp.world_from_env().
def _worlds_in_subprocess(cases: list[dict[str, str]]) -> list[tuple[int, int, int]]:
    proc = subprocess.run(
        [sys.executable, CHILDREN_PY, "world_check", json.dumps(cases)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [tuple(r) for r in json.loads(proc.stdout)]


def test_slurm_and_mpi_environment_mapping():
    cases = {
        (0, 1, 0): {},
        (5, 8, 1): dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1"),
        # torchrun/deepspeed variables win over SLURM ones (torchrun inside an sbatch allocation).
        (2, 4, 2): dict(
            RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0"
        ),
        (3, 4, 3): dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="3"),
        (1, 2, 1): dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1"),
    }
    assert _worlds_in_subprocess(list(cases.values())) == list(cases)
    # srun --ntasks 8 with tp_size 4: rank 5 is tensor rank 1 of replica 1.
    layout = tp.Layout(rank=5, world=8, local_rank=1, tp=4)
    assert (layout.dp, layout.replica, layout.tp_rank) == (2, 1, 1)


def test_srun_style_environment_end_to_end(tmp_path, single, small):
    """What ``srun --ntasks 2 python launch/run.py --tp-size 2`` gives each task: SLURM_* variables only (and
    MASTER_ADDR/MASTER_PORT from launch/slurm_tp.sbatch). Both ranks are started here by hand."""
    out = tmp_path / "SLURM"
    port = str(free_port())
    procs, start = [], time.monotonic()
    for rank in range(2):
        env = clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, RUN_PY, *small, "--tp-size", "2", "--out", str(out)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    results = []
    try:
        for proc in procs:
            out_text, err_text = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
            results.append((proc.returncode, out_text, err_text))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{err[-8000:]}"
    check_matches_single(out, single, tp_size=2, dp_size=1)
    check_stdout_is_one_table(results[0][1])
    assert results[1][1] == "", "rank 1 printed on stdout"
    assert " INFO " not in results[1][2], "rank 1 logged below WARNING"


# ---------------------------------------------------------------------- layout errors
def test_check_tp_size():
    tp.check_tp_size(1, 1, 3)
    tp.check_tp_size(3, 6, 3)
    tp.check_tp_size(2, 4, 3)
    with pytest.raises(ValueError, match="multiple"):
        tp.check_tp_size(4, 1, 3)
    with pytest.raises(ValueError, match="multiple"):
        tp.check_tp_size(2, 3, 3)
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        tp.check_tp_size(4, 4, 3)
    with pytest.raises(ValueError, match=">= 1"):
        tp.check_tp_size(0, 1, 3)


def test_tp_size_config_key():
    assert parse_args([]).parallel.tp_size is None  # null: the world size where the model's KV heads allow it
    assert parse_args(["--tp-size", "2"]).parallel.tp_size == 2
    assert parse_args(["--tp-size", "null"]).parallel.tp_size is None
    for bad in (["--tp-size", "0"], ["--tp-size", "-1"]):
        with pytest.raises(ConfigError, match="^tp_size:"):
            parse_args(bad)


@pytest.mark.parametrize(
    "world, heads, want",
    [(1, 3, 1), (2, 3, 2), (3, 3, 3), (4, 3, 2), (6, 3, 3), (8, 3, 2), (5, 3, 1), (4, 2, 2), (8, 32, 8), (4, 1, 1)],
)
def test_a_null_tp_size_takes_the_largest_that_splits_the_kv_heads(world, heads, want):
    """No --tp-size: the whole world splits one model where every rank gets a KV head, else the largest size
    dividing the world within the heads, the rest as replicas, and rank 0's one line says so; a given size is kept
    (and judged by check_tp_size)."""
    tp_size = tp.resolve_tp_size(None, world, heads)
    assert tp_size == want
    tp.check_tp_size(tp_size, world, heads)  # always a layout AutoTP can serve
    note = tp.layout_note(None, world, heads)
    if want == world:
        assert note is None
    else:
        assert note == (
            f"tp_size: {world} processes cannot split the model's {heads} KV heads (every rank needs one): running "
            f"{world // want} data-parallel replicas of tp_size {want} (--tp-size K chooses)"
        )
    assert tp.resolve_tp_size(4, world, heads) == 4 and tp.layout_note(4, world, heads) is None


#: The hub models the launch examples name, and their architectures shipped in configs/models (read offline).
HUB_ARCH = {
    "meta-llama/Llama-2-13b-chat-hf": "arch:llama-2-13b",
    "meta-llama/Llama-2-7b-chat-hf": "arch:llama-2-7b",
    "microsoft/Phi-3.5-mini-instruct": "arch:phi-3.5-mini",
}


def _sbatch_defaults() -> tuple[int, dict[str, str]]:
    """launch/slurm_tp.sbatch: its world (nodes x tasks per node) and its variables' defaults."""
    text = (Path(ROOT) / "launch" / "slurm_tp.sbatch").read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text)[1])
    tasks = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text)[1])
    return nodes * tasks, dict(re.findall(r'^(\w+)="\$\{\w+:-([^}]+)\}"', text, re.M))


def _launch_examples() -> list[tuple[str, int, list[str]]]:
    """Every launch of launch/run.py in README's and docs/tensor-parallel.md's bash blocks: (the line, its world,
    the flags run.py gets)."""
    examples = []
    for doc in (Path(ROOT) / "README.md", Path(ROOT) / "docs" / "tensor-parallel.md"):
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = line.split(" #")[0].split()
                if not words or words[0].startswith("#"):
                    continue
                env = {}
                while words and "=" in words[0]:
                    key, value = words.pop(0).split("=", 1)
                    env[key] = value
                if words[0] == "sbatch":
                    world, defaults = _sbatch_defaults()
                    config, tp_size = env.get("CONFIG", defaults["CONFIG"]), env.get("TP_SIZE", defaults["TP_SIZE"])
                    examples.append((line, world, ["--config", config, "--tp-size", tp_size, *words[2:]]))
                    continue
                if "launch/run.py" not in words:
                    continue
                at = words.index("launch/run.py")
                head, flags = words[:at], words[at + 1 :]
                if "&&" in head:  # `bash scripts/setup.sh && python launch/run.py`: the launch after the set-up
                    head = head[len(head) - head[::-1].index("&&") :]

                def value(name, default=None, head=head):
                    return int(head[head.index(name) + 1]) if name in head else default

                if head[0] == "deepspeed" and "--hostfile" in head:
                    hostfile = (Path(ROOT) / "launch" / "hostfile.example").read_text()
                    world = sum(int(n) for n in re.findall(r"^\S+ slots=(\d+)", hostfile, re.M))
                elif head[0] == "deepspeed":
                    world = value("--num_gpus")
                elif head[0] == "torchrun":
                    world = value("--nproc_per_node") * value("--nnodes", 1)
                elif head[0] in ("mpirun", "mpiexec"):
                    world = value("-n")
                else:
                    assert head == ["python"], line
                    world = 1
                examples.append((line, world, flags))
    return examples


def test_every_launch_example_is_a_layout_its_model_can_run(monkeypatch):
    """README's and docs/tensor-parallel.md's launch lines, as written: each settles a layout AutoTP can serve on
    the model it names (KV heads from the model's configuration: the embedded model's, or the shipped architecture
    of the hub model a paper configuration names) and its configuration is valid; the mission's own command is
    among them."""
    from batchmax_tp.models import read_config

    monkeypatch.chdir(ROOT)
    examples = _launch_examples()
    assert any(f == ["--device", "cpu"] and w == 4 and line.startswith("deepspeed") for line, w, f in examples)
    assert len(examples) >= 15, [line for line, _, _ in examples]
    for line, world, flags in examples:
        cfg = parse_args(flags)
        config = read_config(HUB_ARCH.get(cfg.model.name, cfg.model.name))
        heads = config.num_key_value_heads
        size = tp.resolve_tp_size(cfg.parallel.tp_size, world, heads)
        try:
            tp.check_tp_size(size, world, heads)
        except ValueError as err:
            pytest.fail(f"{line!r}: {err} ({cfg.model.name})")


def test_model_kv_heads_come_from_the_config():
    from batchmax_tp.models import read_config

    assert read_config("embedded:smollm2-135m-instruct").num_key_value_heads == 3
    assert read_config("arch:llama-2-13b").num_key_value_heads == 40
    with pytest.raises(ValueError, match="cannot read the configuration of '/no/such/dir'"):
        read_config("/no/such/dir")


def test_single_process_tp4_fails_in_one_line(tmp_path, small):
    out = tmp_path / "E1"
    res = run([sys.executable, RUN_PY, *small, "--tp-size", "4", "--out", str(out)], timeout=120)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: tp_size: world size 1 is not a multiple of tp_size 4"), lines[0]
    assert not out.exists()


def test_an_explicit_tp_larger_than_kv_heads_is_one_line_printed_once(tmp_path, small):
    """4 ranks, a model with 3 KV heads, --tp-size 4: the job stops before loading weights with one line, said by
    rank 0 alone (not once per rank), and writes nothing."""
    exe = tool("torchrun")
    if exe is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "E2"
    res = run(
        [exe, "--nproc_per_node", "4", "--master_port", str(free_port()), RUN_PY, *small]
        + ["--tp-size", "4", "--out", str(out)],
        timeout=180,
    )
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if "error: " in line]
    assert errors == [
        "error: tp_size: tp_size 4 exceeds the model's 3 KV heads: every rank needs one (without --tp-size the "
        "largest size that fits runs, the rest as data-parallel replicas) (embedded:smollm2-135m-instruct)"
    ], res.stderr
    assert not out.exists()


def test_deepspeed_on_4_cpu_processes_runs_the_main_job_on_the_embedded_model(tmp_path, small):
    """The mission's command, ``deepspeed --num_gpus 4 launch/run.py --device cpu``, on the embedded model (3 KV
    heads): with no --tp-size it runs 2 replicas of 2 tensor-parallel ranks, says so once, and completes the main
    job (here on two short prompts and 4 new tokens, flags that keep the main job)."""
    exe = tool("deepspeed")
    if exe is None:
        pytest.skip("deepspeed is not installed")
    out = tmp_path / "DS4"
    data = small[small.index("--data") + 1]
    flags = ["--data", data, "--num-samples", "2", "--max-new-tokens", "4", "--out", str(out)]
    res = run([exe, "--num_gpus", "4", "--master_port", str(free_port()), RUN_PY, "--device", "cpu", *flags])
    assert_ok(res)
    notes = [line for line in res.stderr.splitlines() if "cannot split the model's 3 KV heads" in line]
    assert len(notes) == 1 and "running 2 data-parallel replicas of tp_size 2" in notes[0], res.stderr[-4000:]
    saved = parse_args(["--config", str(out / "config.yaml")]).parallel
    assert (saved.tp_size, saved.dp_size) == (2, 2)
    runs = sorted(d.name for d in out.iterdir() if (d / "summary.json").is_file())
    assert len(runs) >= 5, runs  # the main job's runs (FKV, ED, BM, BM's best rule, snap, the paper's setting)
    for name in runs:
        s = json.loads((out / name / "summary.json").read_text())
        assert (s["tp_size"], s["dp_size"]) == (2, 2), name
        assert s["status"] == "done" and s["num_samples"] >= 2, name
    # the report once on stdout (the launcher's own lines beside it), said by rank 0 alone
    assert res.stdout.count("# Batch-Max results") == 1 and (out / "report.md").read_text() in res.stdout


# ---------------------------------------------------------------------- a failing rank
def test_failing_rank_ends_the_job(tmp_path, small):
    """Rank 1 of a dp=2 run raises in its first method: the job exits non-zero quickly and writes no results,
    although rank 0 would otherwise wait in the result gather (whose timeout is hours)."""
    exe = tool("torchrun")
    if exe is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "F"
    res = run(
        [
            exe,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            CHILDREN_PY,
            "failing_rank_run",
            *small,
            "--tp-size",
            "1",
            "--out",
            str(out),
        ],
        timeout=120,
    )
    assert res.returncode != 0
    assert "injected failure on rank 1" in res.stderr and "rank 1 failed" in res.stderr
    assert not (out / RUN / "samples.jsonl").exists() and not (out / RUN / "summary.json").exists()


def test_oom_inside_a_tp_forward_ends_the_job_and_the_rerun_records_it(tmp_path, small):
    """Rank 1 of a tp=2 run raises out-of-memory in the middle of a forward (rank 0 waits in the model's
    all-reduce): the job exits non-zero with a one-line error and rank 1's marker; the same command
    again records that run's OOM row, runs the next one and writes the report."""
    import yaml

    exe = tool("torchrun")
    if exe is None:
        pytest.skip("torchrun is not installed")
    data = small[small.index("--data") + 1]
    config = tmp_path / "sweep.yaml"
    out = tmp_path / "O"
    config.write_text(
        yaml.safe_dump(
            dict(
                data=data,
                num_samples=2,
                max_new_tokens=4,
                p=32,
                out=str(out),
                scheduler="static",  # the injection arms on a static batch (batches.run_batch); its rerun's
                # ED run is the static scheduler's tp=2 run through the runner (records gathered from both ranks)
                runs=[dict(method="bm", batch_size=1, kv_max=128), dict(method="ed", batch_size=1, kv_max=2)],
            )
        )
    )
    res = run(
        [exe, "--nproc_per_node", "2", "--master_port", str(free_port()), CHILDREN_PY, "oom_rank_run"]
        + ["--config", str(config)],
        timeout=180,
    )
    assert res.returncode != 0
    # rank 0's progress bar may precede the line on the terminal (\r, no newline)
    errors = [line[line.index("error: ") :] for line in re.split(r"[\r\n]", res.stderr) if "error: " in line]
    assert any("rank 1 ran out of memory in batch 0" in line for line in errors), (errors, res.stderr[-3000:])
    marker = json.loads((out / "bm-b1-kv128" / "oom-rank1.json").read_text())
    assert marker["rank"] == 1 and marker["batch"] == 0 and "injected" in marker["error"]
    assert not (out / "bm-b1-kv128" / "summary.json").exists()

    res = run(
        [exe, "--nproc_per_node", "2", "--master_port", str(free_port()), RUN_PY, "--config", str(config)], timeout=240
    )
    assert_ok(res)
    bm, ed = summary(out / "bm-b1-kv128"), summary(out / "ed-b1-kv2")
    assert bm["status"] == "oom" and bm["oom_cause"] == "runtime" and "injected" in bm["error"]
    assert ed["status"] == "done" and ed["num_samples"] == 2 and ed["tp_size"] == 2
    assert "OOM" in (out / "report.md").read_text()


# ---------------------------------------------------------------------- data-parallel bookkeeping (no processes)
def test_per_replica_uses_each_replicas_batches_and_ranks():
    from batchmax_tp.eval.results import BatchRecord, SampleRecord, per_replica, summarise

    def batch(index, replica, ids, tokens, prefill, decode, ranks):
        return BatchRecord.from_json(
            {
                "batch": index,
                "replica": replica,
                "ids": ids,
                "tokens_cut": [0] * len(ids),
                "generated_tokens": tokens,
                "prefill_s": prefill,
                "decode_s": decode,
                "peak_kv_bytes": sum(ranks),
                "peak_kv_bytes_per_rank": ranks,
            }
        )

    batches = [
        batch(0, 0, ["s0", "s1"], 8, 0.5, 1.0, [300, 200]),
        batch(1, 1, ["s2", "s3"], 8, 3.0, 1.5, [400, 300]),
        batch(2, 0, ["s4"], 4, 0.5, 1.0, [100, 50]),
    ]
    reps = per_replica(batches, dp=3, tp=2)
    assert [r["ranks"] for r in reps] == [[0, 1], [2, 3], [4, 5]]
    assert [r["num_samples"] for r in reps] == [3, 2, 0] and [r["num_batches"] for r in reps] == [2, 1, 0]
    assert reps[0]["peak_kv_bytes_per_rank"] == [300, 200] and reps[0]["peak_kv_bytes"] == 500
    assert reps[0]["tokens_per_s"] == pytest.approx(12 / 3.0) and reps[2]["tokens_per_s"] is None
    samples = [
        SampleRecord.from_json(
            {"id": f"s{i}", "output": "x", "reference": None, "correct": None, "generated_tokens": 4}
        )
        for i in range(5)
    ]
    s = summarise(samples, batches, "contains")
    assert (s["prefill_s"], s["decode_s"]) == (3.0, 1.5)  # replica 1 took longest (4.5 s)
    assert s["tokens_per_s"] == pytest.approx(20 / 4.5) and s["peak_kv_bytes"] == 700
