"""Child processes of the multi-process tests, as importable functions (no code in strings).

A test starts one as ``tests/children.py NAME [ARGS]``, under a launcher (``torchrun --nproc_per_node 2``) or alone;
the killed-rank children print one line per step they reached (``rank R: ...``), so the test asserts what the child
itself did, never only that the launcher exited non-zero (a child that cannot even import exits non-zero too); the
others write or print their results for the test to compare.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny.py beside this file
from tiny import tiny_random_model  # noqa: E402

from batchmax_tp import parallel  # noqa: E402
from batchmax_tp.bench.padded import generate  # noqa: E402
from batchmax_tp.core.engine import Engine  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.core.requests import Request, Sampling  # noqa: E402

#: 9 query / 3 KV heads, as the embedded model (tests/test_tp.py's GQA_9_3).
LLAMA_9_3 = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16, initializer_range=0.2)
QWEN2_6_2 = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, initializer_range=0.2)


def say(line: str) -> None:
    print(line, flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def killed_rank_mid_generation() -> None:
    """tp=2: both ranks generate once, then rank 1 is killed and rank 0 generates again (it must not hang)."""
    layout = parallel.init_distributed(2)
    model = parallel.apply_tensor_parallel(tiny_random_model("llama", seed=0, **LLAMA_9_3), layout, torch.float32)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    method = Method("bm", kv_max=16, p=4)
    out = generate(model, ids, None, method, 4, ignore_eos=True)
    say(f"rank {layout.rank}: generated {int(out.num_generated.sum())} tokens")
    dist.barrier()  # both ranks have said so before rank 1 dies (else the launcher may end rank 0 first)
    if layout.rank == 1:
        say("rank 1: killed")
        die()
    generate(model, ids, None, method, 64, ignore_eos=True)
    say(f"rank {layout.rank}: generated again")


def killed_rank_mid_serving() -> None:
    """tp=2 continuous serving: rank 1 is killed when its first request finishes; rank 0 must not hang."""
    layout = parallel.init_distributed(2)
    model = parallel.apply_tensor_parallel(tiny_random_model("qwen2", seed=0, **QWEN2_6_2), layout, torch.float32)
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(3, 128, (n,), generator=g).tolist(), 40) for n in (5, 63, 97, 160)]

    def finished(i: int, out) -> None:
        say(f"rank {layout.rank}: request {i} finished")
        dist.barrier()  # both ranks have said so before rank 1 dies
        if layout.rank == 1:
            say("rank 1: killed")
            die()

    engine = Engine(model, Method("bm", 32, 8), 2, tp_group=model.batchmax_tp_group)
    engine.run(requests, Sampling(eos_token_id=7), on_finish=finished)
    say(f"rank {layout.rank}: served every request")


def lm_eval_worker(tiny: str, tp: str, out: str) -> None:
    """The lm-eval model (BM, ``tp`` ranks per replica) on two bundled tasks; writes each task's (doc, responses)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from batchmax_tp.harness import BatchMaxLM

    lm = BatchMaxLM(pretrained=tiny, method="bm", kv_max=256, p=64, batch_size=4, tp_size=int(tp))
    res = simple_evaluate(
        model=lm,
        tasks=["batchmax_needle_mc", "batchmax_passkey"],
        limit=3,
        log_samples=True,
        task_manager=TaskManager(include_path="configs/lm_eval", include_defaults=False),
    )
    if res is not None:  # the replica that gathers the results
        got = {t: sorted([s["doc_id"], s["resps"]] for s in res["samples"][t]) for t in res["samples"]}
        pathlib.Path(out).write_text(json.dumps(got))


def world_check(cases: str) -> None:
    """For each case (JSON: a list of launcher-variable mappings), this process's whole environment replaced by the
    case's, and ``parallel.world_from_env()`` printed (one JSON list)."""
    base = dict(os.environ)
    results = []
    for case in json.loads(cases):
        os.environ.clear()
        os.environ.update({**base, **case})
        results.append(list(parallel.world_from_env()))
    print(json.dumps(results))


def _held(real, at: int = 1):
    """``real``, except that rank 1 holds at its ``at``-th call when ``HOLD_STAGE`` is set: it writes its pid to
    ``HOLD_MARKER`` and waits there, as a node does while it loads or meets the others (the test then loses it)."""
    calls = []

    def call(*a, **k):
        calls.append(1)
        if os.environ.get("RANK") == "1" and os.environ.get("HOLD_STAGE") and len(calls) == at:
            pathlib.Path(os.environ["HOLD_MARKER"]).write_text(str(os.getpid()))
            time.sleep(3600)
        return real(*a, **k)

    return call


def hold() -> None:
    """Install the hold at ``HOLD_STAGE``: ``load`` (loading the model's weights), ``setup`` (inside the first
    process-group set-up: DeepSpeed calls torch's), ``build`` (where DeepSpeed builds its shared-memory op, before
    the group) or ``batch3`` (rank 1's third finished batch, before it is written: two are on disk)."""
    from batchmax_tp import models
    from batchmax_tp.eval import results

    stage = os.environ.get("HOLD_STAGE")
    if stage == "load":
        models.load_model = _held(models.load_model)
    elif stage == "setup":
        dist.init_process_group = _held(dist.init_process_group)
    elif stage == "build":
        import deepspeed.comm.torch  # noqa: F401

        backend = sys.modules["deepspeed.comm.torch"]  # (deepspeed.comm.torch reads as the torch package)
        backend.build_shm_op = _held(backend.build_shm_op)
    elif stage == "batch3":
        results.RunLog.append = _held(results.RunLog.append, at=3)


def held_run(*argv: str) -> None:
    """``launch/run.py ARGV`` with the hold installed."""
    hold()
    _run(argv)


def held_lm_eval_worker(tiny: str, tp: str, out: str) -> None:
    """``lm_eval_worker`` with the hold installed."""
    hold()
    lm_eval_worker(tiny, tp, out)


def _run(argv: tuple[str, ...]) -> None:
    from batchmax_tp.cli import main

    sys.exit(main(list(argv)))


def failing_rank_run(*argv: str) -> None:
    """``launch/run.py ARGV`` where rank 1 raises in its first run."""
    from batchmax_tp import job

    if os.environ.get("RANK") == "1":

        def boom(*args, **kwargs):
            raise RuntimeError("injected failure on rank 1")

        job.evaluate_run = boom
    _run(argv)


def oom_rank_run(*argv: str) -> None:
    """``launch/run.py ARGV`` where rank 1 raises CUDA's out-of-memory error in layer 10's MLP of the first prefill
    block of its first static batch (rank 0 then waits in that layer's all-reduce)."""
    from transformers.models.llama import modeling_llama

    from batchmax_tp.eval import batches

    if os.environ.get("RANK") == "1":
        state = {"armed": False, "calls": 0}
        run_batch, mlp_forward = batches.run_batch, modeling_llama.LlamaMLP.forward

        def arm(*a, **k):
            state["armed"] = True
            return run_batch(*a, **k)

        def forward(self, x):
            state["calls"] += state["armed"]
            if state["calls"] == 40:  # layer 10 of the first prefill block of the first run
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
            return mlp_forward(self, x)

        batches.run_batch, modeling_llama.LlamaMLP.forward = arm, forward
    _run(argv)


CHILDREN = {
    f.__name__: f
    for f in (
        killed_rank_mid_generation,
        killed_rank_mid_serving,
        lm_eval_worker,
        world_check,
        held_run,
        held_lm_eval_worker,
        failing_rank_run,
        oom_rank_run,
    )
}

if __name__ == "__main__":
    CHILDREN[sys.argv[1]](*sys.argv[2:])
