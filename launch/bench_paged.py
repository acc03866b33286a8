"""FKV by real length (paged blocks) against FKV in fixed-capacity slots, side by side in one process.

    python launch/bench_paged.py                  # embedded model, CPU: about 8 minutes on 2 cores
    python launch/bench_paged.py --device cuda --model arch:llama-2-7b --dtype float16 --compile cudagraphs

Two workloads, each served by both pools in the memory of ``--slots`` fixed slots of the longest request (random
token prompts, EOS ignored: both pools give the same tokens, so only time and concurrency differ):

1. **Equal lengths** (``--equal`` prompts of ``--length`` tokens): each pool holds ``--slots`` requests at once, so
   a decode pass attends over the same pairs; the paged pass must not be slower (decode ms per pass).
2. **Mixed lengths** (the needle set's lengths, ``--mixed``): the paged pool admits by real length, so it holds more
   requests at once than ``--slots`` (its rows); tokens/s, decode and prefill seconds, the most requests at once.

Each workload runs fixed, paged, paged, fixed (the machine's drift cancels in the mean of each pair). Results:
``--out`` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.core.engine import Engine  # noqa: E402
from batchmax_tp.core.method import BLOCK, Method  # noqa: E402
from batchmax_tp.core.requests import Request, Sampling  # noqa: E402
from batchmax_tp.eval.files import atomic_write_text  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402

#: The mixed-length needle set's prompt lengths (docs/performance.md, 2026-11-25: 25 prompts of 801-2,774 tokens).
NEEDLE_LENGTHS = [801, 863, 1100, 1350, 1600, 1850, 2100, 2400, 2710, 2774, 1000, 1250]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", default="auto")
    ap.add_argument("--slots", type=int, default=3, help="the memory of this many fixed slots of the longest request")
    ap.add_argument("--block", type=int, default=BLOCK)
    ap.add_argument("--length", type=int, default=1536)
    ap.add_argument("--equal", type=int, default=6, help="equal-length prompts")
    ap.add_argument("--mixed", type=str, default=",".join(map(str, NEEDLE_LENGTHS)), help="mixed prompt lengths")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default="results/bench_paged.json")
    return ap.parse_args(argv)


def run(model, requests, method, slots: int, compile: str) -> dict:
    t0 = time.perf_counter()
    out = Engine(model, method, slots, compile=compile).run(requests, Sampling(ignore_eos=True))
    wall = time.perf_counter() - t0
    decodes = out.passes - len(requests)  # one prefill pass per request (a group of one length: one pass)
    at_once = _most_at_once(out)
    return {
        "wall_s": wall,
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "decode_passes": decodes,
        "tokens_per_s": out.generated_tokens / (out.prefill_s + out.decode_s),
        "most_at_once": at_once,
        "peak_kv_bytes": out.peak_kv_bytes,
        "tokens": [o.tokens for o in out.outputs],
    }


def _most_at_once(out) -> int:
    """The most requests decoding at once (from each one's first token to its end)."""
    ends = sorted(o.finished_s for o in out.outputs)
    starts = sorted(o.first_token_s for o in out.outputs)
    held = most = 0
    for _, kind in sorted([(s, 1) for s in starts] + [(e, -1) for e in ends], key=lambda x: (x[0], x[1])):
        held += kind
        most = max(most, held)
    return most


def workload(model, name: str, lengths: list[int], a) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    requests = [Request(torch.randint(10, vocab - 10, (n,), generator=g).tolist(), a.new) for n in lengths]
    methods = {"fixed": Method("fkv", block=0), "paged": Method("fkv", block=a.block)}
    runs: dict[str, list[dict]] = {"fixed": [], "paged": []}
    for key in ("fixed", "paged", "paged", "fixed"):
        runs[key].append(run(model, requests, methods[key], a.slots, a.compile))
        r = runs[key][-1]
        print(
            f"{name:>6} {key:>5}: {r['tokens_per_s']:6.2f} tok/s  prefill {r['prefill_s']:6.1f}s  decode "
            f"{r['decode_s']:6.1f}s ({1e3 * r['decode_s'] / max(1, r['decode_passes']):6.1f} ms/pass x "
            f"{r['decode_passes']})  at once {r['most_at_once']}",
            flush=True,
        )
    same = all(r["tokens"] == runs["fixed"][0]["tokens"] for rs in runs.values() for r in rs)
    summary = {}
    for key, rs in runs.items():
        summary[key] = {
            "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rs),
            "prefill_s": statistics.mean(r["prefill_s"] for r in rs),
            "decode_s": statistics.mean(r["decode_s"] for r in rs),
            "decode_ms_per_pass": statistics.mean(1e3 * r["decode_s"] / max(1, r["decode_passes"]) for r in rs),
            "decode_passes": rs[0]["decode_passes"],
            "most_at_once": rs[0]["most_at_once"],
            "peak_kv_bytes": rs[0]["peak_kv_bytes"],
        }
    for rs in runs.values():
        for r in rs:
            del r["tokens"]
    return {"lengths": lengths, "same_tokens": same, "summary": summary, "runs": runs}


def main(argv=None) -> int:
    a = parse(argv)
    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    result = {
        "model": a.model,
        "device": a.device,
        "dtype": a.dtype,
        "threads": torch.get_num_threads(),
        "slots": a.slots,
        "block": a.block,
        "new": a.new,
    }
    mixed = [int(x) for x in a.mixed.split(",") if x]
    for name, lengths in (("equal", [a.length] * a.equal), ("mixed", mixed)):
        if lengths:  # --equal 0 or --mixed '': that workload is left out
            result[name] = workload(model, name, lengths, a)
    print("\n| workload | pool | tokens/s | prefill s | decode s | decode ms/pass | passes | at once | K/V MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in [n for n in ("equal", "mixed") if n in result]:
        for key, s in result[name]["summary"].items():
            print(
                f"| {name} | {key} | {s['tokens_per_s']:.2f} | {s['prefill_s']:.1f} | {s['decode_s']:.1f} | "
                f"{s['decode_ms_per_pass']:.1f} | {s['decode_passes']} | {s['most_at_once']} | "
                f"{s['peak_kv_bytes'] / 2**20:.1f} |"
            )
        print(f"same tokens ({name}): {result[name]['same_tokens']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    atomic_write_text(a.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
