"""Child processes of the multi-process tests, as importable functions (no code in strings).

A test starts one under a launcher, ``torchrun --nproc_per_node 2 tests/children.py NAME``; each child prints one
line per step it reached (``rank R: ...``), so the test asserts what the child itself did, never only that the
launcher exited non-zero (a child that cannot even import exits non-zero too).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny.py beside this file
from tiny import tiny_random_model  # noqa: E402

from batchmax_tp import parallel  # noqa: E402
from batchmax_tp.core.engine import generate  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.core.serve import Request, serve  # noqa: E402

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

    serve(model, requests, Method("bm", 32, 8), 2, eos_token_id=7, on_finish=finished, tp_group=model.batchmax_tp_group)
    say(f"rank {layout.rank}: served every request")


CHILDREN = {f.__name__: f for f in (killed_rank_mid_generation, killed_rank_mid_serving)}

if __name__ == "__main__":
    CHILDREN[sys.argv[1]]()
