"""Where a Batch-Max decode step's time goes, beside the model's own step; eager against compiled passes.

    python launch/bench_decode.py                      # embedded model, CPU: b=13, kv_max 512 (~3 min on 2 cores)
    python launch/bench_decode.py --batch 13 --kv-max 512 --rule question --out results/bench_decode.json

Measurements, in one process (a padded batch of ``--batch`` prompts on the engine, ``bench.padded.generate``):

1. **A BM decode pass, split.** One generation (prompts of ``--kv-max + 64`` tokens, so the slots are full and
   decode passes evict every ``p``), timed per decode pass: the "batchmax" attention calls (each writes its pass's
   pairs, attends and adds the score sums), the evictions before the passes, and the rest of the model
   (projections, MLP, norms, lm_head).
2. **FKV's pass** at the same batch on prompts of ``kv_max`` tokens, so its decode passes attend over as many
   pairs as BM keeps.
3. **With ``--compiled``: the decode pass eager against compiled** (``Engine(compile=...)``), BM and FKV:
   ``--batch`` requests of ``--kv-max + 64`` tokens in as many slots, ``--compiled-new`` new tokens each, run
   eager, compiled, compiled, eager in one process; the median of each run's last 100 decode passes, and the first
   compiled run's wall time (its compiling). About 8 minutes on 2 cores at --batch 16.

Every figure is wall time on this machine; run it alone. Results: ``--out`` (JSON) and a table on stdout.
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

from batchmax_tp.bench.padded import generate  # noqa: E402
from batchmax_tp.core import attention, bounded  # noqa: E402
from batchmax_tp.core.engine import Engine  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.core.requests import Request, Sampling  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402


class StepTimer:
    """Seconds spent in the attention calls and the evictions of decode passes."""

    def __init__(self):
        self.attention = self.evict = 0.0
        self.decoding = False

    def wrap(self) -> list[tuple[object, str, object]]:
        """Install timing wrappers; returns what to restore."""
        saved = [
            (attention, "batchmax_attention", attention.batchmax_attention),
            (bounded.BoundedPool, "evict", bounded.BoundedPool.evict),
            (Engine, "_decode", Engine._decode),
        ]
        fn, evict, decode = (s[2] for s in saved)

        def timed(fn, attr):
            def wrapped(*args, **kwargs):
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                if self.decoding:
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)
                return out

            return wrapped

        def in_decode(*args, **kwargs):
            self.decoding = True
            try:
                return decode(*args, **kwargs)
            finally:
                self.decoding = False

        attention.batchmax_attention = timed(fn, "attention")  # use_batchmax_attention registers this module's
        bounded.BoundedPool.evict = timed(evict, "evict")
        Engine._decode = in_decode
        return saved


def decode_split(model, method: Method, batch: int, prompt_len: int, new: int) -> dict:
    """ms per decode pass: total, attention (its writes included), eviction and the model outside them."""
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    timer = StepTimer()
    saved = timer.wrap()
    try:
        out = generate(model, ids, None, method, new, ignore_eos=True)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    steps = new - 1
    ms = lambda s: 1e3 * s / steps  # noqa: E731
    total = ms(out.decode_s)
    return {
        "step_ms": total,
        "attention_ms": ms(timer.attention),
        "evict_ms": ms(timer.evict),
        "model_ms": total - ms(timer.attention) - ms(timer.evict),
        "prefill_s": out.prefill_s,
    }


def model_step(model, batch: int, prompt_len: int, new: int) -> float:
    """ms per decode step of FKV (the model's own attention) on a prompt of ``prompt_len`` tokens."""
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    out = generate(model, ids, None, Method("fkv"), new, ignore_eos=True)
    return 1e3 * out.decode_s / (new - 1)


def compiled_vs_eager(model, methods: list[Method], batch: int, prompt_len: int, new: int) -> list[dict]:
    """Per method: ms per decode pass of the slot pool (median of each run's last 100), eager and compiled, runs
    interleaved eager, compiled, compiled, eager; the wall seconds of the first compiled run and of the eager
    ones."""
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(100, 1000, (prompt_len,), generator=g).tolist(), new)]
    requests = requests * batch
    times: list[float] = []
    decode = Engine._decode

    def timed(self, step):
        t = time.perf_counter()
        out = decode(self, step)
        times.append(time.perf_counter() - t)
        return out

    Engine._decode = timed
    rows = []
    try:
        for m in methods:
            row = {"method": m.label(), "eager_ms": [], "compiled_ms": [], "eager_wall_s": [], "compiled_wall_s": []}
            for mode in ("none", "default", "default", "none"):
                times.clear()
                t0 = time.perf_counter()
                Engine(model, m, batch, compile=mode).run(requests, Sampling(ignore_eos=True))
                key = "eager" if mode == "none" else "compiled"
                row[f"{key}_ms"].append(1e3 * statistics.median(times[-100:]))
                row[f"{key}_wall_s"].append(time.perf_counter() - t0)
            row["eager_over_compiled"] = statistics.mean(row["eager_ms"]) / statistics.mean(row["compiled_ms"])
            rows.append(row)
            print(
                f"{m.label()}: eager {row['eager_ms']} ms, compiled {row['compiled_ms']} ms per pass, "
                f"eager/compiled {row['eager_over_compiled']:.3f}, "
                f"first compiled run {row['compiled_wall_s'][0]:.0f} s",
                flush=True,
            )
    finally:
        Engine._decode = decode
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=13)
    ap.add_argument("--kv-max", type=int, default=512)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--rule", default="paper")
    ap.add_argument("--new", type=int, default=129, help="new tokens (two evictions at the defaults)")
    ap.add_argument("--compiled", action="store_true", help="also part 4: the pool's decode pass, eager vs compiled")
    ap.add_argument("--compiled-new", type=int, default=160, help="part 4: new tokens per request")
    ap.add_argument("--out", default="results/bench_decode.json")
    a = ap.parse_args(argv)

    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    method = Method("bm", kv_max=a.kv_max, p=a.p, rule=a.rule)
    warm = torch.randint(100, 1000, (1, 80))
    generate(model, warm, None, Method("bm", kv_max=max(64, method.scorer.protected() + 16), p=8, rule=a.rule), 4)
    generate(model, warm, None, Method("fkv"), 4)

    split = decode_split(model, method, a.batch, a.kv_max + a.p, a.new)
    own = model_step(model, a.batch, a.kv_max, a.new)
    methods = [method, Method("fkv")]
    compiled = compiled_vs_eager(model, methods, a.batch, a.kv_max + 64, a.compiled_new) if a.compiled else None

    print(
        f"\nmodel={a.model} dtype={a.dtype} threads={torch.get_num_threads()} batch={a.batch} "
        f"kv_max={a.kv_max} rule={a.rule}\n"
    )
    print("| decode step | ms |\n|---|---:|")
    for key, name in (
        ("step_ms", "BM step"),
        ("model_ms", "  model outside attention"),
        ("attention_ms", "  batchmax attention (writes, score sums)"),
        ("evict_ms", "  eviction (every p steps, averaged)"),
    ):
        print(f"| {name} | {split[key]:.1f} |")
    print(f"| FKV step, same batch, {a.kv_max} pairs | {own:.1f} |")
    print(f"\nBM step / FKV step: {split['step_ms'] / own:.3f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(
            {
                "args": vars(a),
                "threads": torch.get_num_threads(),
                "decode_split": split,
                "fkv_step_ms": own,
                "compiled": compiled,
            },
            f,
            indent=2,
        )
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
