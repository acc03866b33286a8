"""Where a Batch-Max decode step's time goes, beside the model's own step, and BM's attention beside SDPA's.

    python launch/bench_decode.py                      # embedded model, CPU: b=13, kv_max 512 (~4 min on 2 cores)
    python launch/bench_decode.py --batch 13 --kv-max 512 --rule question --out results/bench_decode.json

Three measurements, in one process:

1. **A BM decode step, split.** One generation (prompt of ``--kv-max + 64`` tokens, so the cache is full and
   decode steps evict every ``p``), timed per decode step: the "batchmax" attention calls, the cache updates (the
   eviction inside them counted apart) and the rest of the model (projections, MLP, norms, lm_head).
2. **The model's own step**: FKV (the model's SDPA, ``core.baseline``) at the same batch on a prompt of ``kv_max``
   tokens, so its decode steps attend over as many pairs as BM keeps.
3. **Attention alone, side by side**: BM's attention (its score sums included) against one SDPA call over the same
   kept K/V ([B, Hkv, kept, D] and [B, Hq, 1, D] queries), interleaved ``--reps`` times; median microseconds per
   call and the median of the per-repeat ratios. The cache update that precedes BM's call is timed apart.

4. **With ``--compiled``: the slot pool's decode pass, eager against compiled** (``serve(compile=...)``), BM and
   FKV: ``--batch`` requests of ``--kv-max + 64`` tokens in as many slots, ``--compiled-new`` new tokens each, run
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
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.core import attention, cache  # noqa: E402
from batchmax_tp.core import serve as serve_mod  # noqa: E402
from batchmax_tp.core.engine import generate  # noqa: E402
from batchmax_tp.core.method import Method  # noqa: E402
from batchmax_tp.core.schedule import Phase  # noqa: E402
from batchmax_tp.core.step import ForwardPass  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402


class StepTimer:
    """Seconds spent in the attention calls, the cache updates and the evictions of decode steps."""

    def __init__(self):
        self.attention = self.update = self.evict = 0.0
        self.decoding = False

    def wrap(self) -> list[tuple[object, str, object]]:
        """Install timing wrappers; returns what to restore."""
        saved = [
            (attention, "batchmax_attention", attention.batchmax_attention),
            (cache.BoundedLayer, "update", cache.BoundedLayer.update),
            (cache.BoundedLayer, "_evict", cache.BoundedLayer._evict),
        ]
        fn, update, evict = (s[2] for s in saved)

        def timed_attention(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.decoding:
                self.attention += time.perf_counter() - t
            return out

        def timed_update(layer, *args, **kwargs):
            self.decoding = layer.cache.phase is not None and layer.cache.phase.kind == "decode"
            t = time.perf_counter()
            out = update(layer, *args, **kwargs)
            if self.decoding:
                self.update += time.perf_counter() - t
            return out

        def timed_evict(layer, *args, **kwargs):
            t = time.perf_counter()
            out = evict(layer, *args, **kwargs)
            if self.decoding:
                self.evict += time.perf_counter() - t
            return out

        attention.batchmax_attention = timed_attention  # use_batchmax_attention registers the module's function
        cache.BoundedLayer.update, cache.BoundedLayer._evict = timed_update, timed_evict
        return saved


def decode_split(model, method: Method, batch: int, prompt_len: int, new: int) -> dict:
    """ms per decode step: total, attention, cache update (eviction apart) and the model outside them."""
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
        "update_ms": ms(timer.update - timer.evict),
        "evict_ms": ms(timer.evict),
        "model_ms": total - ms(timer.attention) - ms(timer.update),
        "prefill_s": out.prefill_s,
    }


def model_step(model, batch: int, prompt_len: int, new: int) -> float:
    """ms per decode step of FKV (the model's own attention) on a prompt of ``prompt_len`` tokens."""
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    out = generate(model, ids, None, Method("fkv"), new, ignore_eos=True)
    return 1e3 * out.decode_s / (new - 1)


def attention_vs_sdpa(config, batch: int, kv_max: int, reps: int, calls: int = 100) -> dict:
    """Median microseconds per call of BM's decode attention (score sums included) and of SDPA over the same kept
    K/V, interleaved; the cache update before BM's call apart."""
    g = torch.Generator().manual_seed(2)
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // Hq
    kept = kv_max - 1
    c = cache.BatchMaxCache(Method("bm", kv_max=kv_max), num_layers=1)
    layer, module = c.layers[0], torch.nn.Module()
    module.layer_idx = 0
    with torch.inference_mode():
        prefill = Phase("prefill", 0, kept, 0)
        c.begin(prefill)
        k = torch.randn(batch, Hkv, kept, D, generator=g)
        keys, values = layer.update(k, torch.randn(batch, Hkv, kept, D, generator=g))
        q = torch.randn(batch, Hq, kept, D, generator=g)
        attention.batchmax_attention(module, q, keys, values, None, batchmax=ForwardPass.static(c, prefill))
        decode = Phase("decode", kept, kept + 1, 0, step=1)
        described = ForwardPass.static(c, decode)  # the engine's description of a decode step
        c.begin(decode)
        q = torch.randn(batch, 1, Hq, D, generator=g).transpose(1, 2)  # [B, Hq, 1, D], laid out as HF's
        k1 = torch.randn(batch, Hkv, 1, D, generator=g)
        layer.update(k1, k1)
        attention.batchmax_attention(module, q, keys, values, None, batchmax=described)
        k_sdpa, v_sdpa = keys[:, :, :kv_max].contiguous(), values[:, :, :kv_max].contiguous()

        def update():  # rewrite the same slot: the same state every call
            layer.filled -= 1
            layer.seen -= 1
            layer.update(k1, k1)
            layer.new_slots = cache._handoff.layer = None

        def bm():
            cache._handoff.layer = layer
            return attention.batchmax_attention(module, q, keys, values, None, batchmax=described)

        def sdpa():
            return F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, enable_gqa=Hq != Hkv, scale=D**-0.5)

        fns = {"update": update, "bm": bm, "sdpa": sdpa}
        for fn in fns.values():
            for _ in range(calls // 2):
                fn()
        us = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                us[name].append(1e6 * (time.perf_counter() - t) / calls)
    return {
        "bm_us": statistics.median(us["bm"]),
        "sdpa_us": statistics.median(us["sdpa"]),
        "update_us": statistics.median(us["update"]),
        "bm_over_sdpa": statistics.median(b / s for b, s in zip(us["bm"], us["sdpa"])),
        "kept": kv_max,
        "batch": batch,
        "q_heads": Hq,
        "kv_heads": Hkv,
        "head_dim": D,
    }


def compiled_vs_eager(model, methods: list[Method], batch: int, prompt_len: int, new: int) -> list[dict]:
    """Per method: ms per decode pass of the slot pool (median of each run's last 100), eager and compiled, runs
    interleaved eager, compiled, compiled, eager; the wall seconds of the first compiled run and of the eager
    ones."""
    g = torch.Generator().manual_seed(0)
    requests = [serve_mod.Request(torch.randint(100, 1000, (prompt_len,), generator=g).tolist(), new)]
    requests = requests * batch
    times: list[float] = []
    decode = serve_mod._Run.decode

    def timed(self, pool, step):
        t = time.perf_counter()
        out = decode(self, pool, step)
        times.append(time.perf_counter() - t)
        return out

    serve_mod._Run.decode = timed
    rows = []
    try:
        for m in methods:
            row = {"method": m.label(), "eager_ms": [], "compiled_ms": [], "eager_wall_s": [], "compiled_wall_s": []}
            for mode in ("none", "default", "default", "none"):
                times.clear()
                t0 = time.perf_counter()
                serve_mod.serve(model, requests, m, batch, ignore_eos=True, compile=mode)
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
        serve_mod._Run.decode = decode
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
    ap.add_argument("--reps", type=int, default=15)
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
    micro = attention_vs_sdpa(model.config, a.batch, a.kv_max, a.reps)
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
        ("attention_ms", "  batchmax attention (+ score sums)"),
        ("update_ms", "  cache writes"),
        ("evict_ms", "  eviction (every p steps, averaged)"),
    ):
        print(f"| {name} | {split[key]:.1f} |")
    print(f"| FKV step, same batch, {a.kv_max} pairs (the model's SDPA) | {own:.1f} |")
    print(f"\nBM step / FKV step: {split['step_ms'] / own:.3f}")
    print(
        f"\nattention alone, {micro['kept']} kept pairs: BM {micro['bm_us']:.0f} us, SDPA {micro['sdpa_us']:.0f} us, "
        f"BM/SDPA {micro['bm_over_sdpa']:.3f} (median of {a.reps} interleaved repeats); cache update before BM's "
        f"call {micro['update_us']:.0f} us"
    )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(
            {
                "args": vars(a),
                "threads": torch.get_num_threads(),
                "decode_split": split,
                "fkv_step_ms": own,
                "attention": micro,
                "compiled": compiled,
            },
            f,
            indent=2,
        )
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
