"""What a prompt token costs each method, against prompt length: prefill seconds per real prompt token, side by side in
one process, with each method's FLOP ratio to FKV's beside it.

    python launch/bench_prefill.py                        # embedded model, CPU: about 21 minutes on 2 cores
    python launch/bench_prefill.py --lengths 1536,6144 --rows 8
    python launch/bench_prefill.py --device cuda --model arch:llama-2-7b --dtype float16
    python launch/bench_prefill.py --model qwen2.5-coder-0.5b --dtype bfloat16 --lengths 2048,4096,8192 --rows 1 \
        --methods "fkv:chunk=0,fkv:chunk=512,fkv:chunk=1024,fkv:chunk=2048,fkv:chunk=4096,hf,hf:chunk=2048"

For each prompt length, ``--rows`` random-token prompts of that length are served by each method with one new
token (so the time is the prefill's, the first token included), each method at its own fastest: FKV by real length
on the model's SDPA, BM paper and BM ``question`` (kv_max 512, p 64), snap (512). The methods run in the order given,
then again in reverse (the machine's drift cancels in the mean of each pair). Results: ``--out`` (JSON) and a table
on stdout: ms per prompt token, each method's ratio to FKV's time and its FLOP ratio (``bench.regimes``'
arithmetic), and how each method's cost per token moves from the shortest length to the longest. ``fkv:chunk=N`` and
``snap:chunk=N`` prefill in chunks of N tokens (0: one pass); ``hf`` is the model's own Hugging Face forward over the
same prompts, in one pass (``hf``) or in chunks over a ``DynamicCache`` (``hf:chunk=N``), the reference the engine's
FKV is held to.
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

from batchmax_tp.bench.regimes import label, prompt_token_flops  # noqa: E402
from batchmax_tp.core.engine import Engine  # noqa: E402
from batchmax_tp.core.method import Method, method_type  # noqa: E402
from batchmax_tp.core.requests import Request, Sampling  # noqa: E402
from batchmax_tp.eval.files import atomic_write_text  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402
from batchmax_tp.plan.planner import ModelShape  # noqa: E402

METHODS = ("fkv", "bm", "bm:rule=question", "snap")


def parser(doc: str, lengths: str, methods: tuple[str, ...], out: str) -> argparse.ArgumentParser:
    """The flags of a prefill benchmark (this one's, ``launch/profile_prefill.py``'s): model, device, dtype, prompt
    lengths, rows, methods and the output file, with these defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default=lengths, help=f"prompt lengths, comma-separated (default {lengths})")
    ap.add_argument("--rows", type=int, default=4, help="prompts per length (served at once)")
    ap.add_argument("--methods", default=",".join(methods), help="method specs, comma-separated (';' inside one)")
    ap.add_argument("--out", default=out)
    return ap


def parsed(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``ap``'s flags, the lengths as ints (a one-line error for none, or for a length or ``--rows`` below 1)."""
    a = ap.parse_args(argv)
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    if not a.lengths or min(a.lengths) < 1 or a.rows < 1:
        ap.error("--lengths must name positive lengths and --rows be at least 1")
    return a


def parse(argv=None) -> argparse.Namespace:
    return parsed(parser(__doc__, "1024,2048,4096,8192", METHODS, "results/bench_prefill.json"), argv)


def method_of(spec: str) -> Method | int:
    """``bm:rule=question`` -> Method("bm", kv_max=512, rule="question"); kv_max 512 unless the spec says. ``hf`` /
    ``hf:chunk=N``: the model's own forward, the chunk (0: one pass)."""
    name, _, args = spec.partition(":")
    kwargs = dict(kv.split("=", 1) for kv in args.split(";") if kv)
    if name == "hf":
        return int(kwargs.get("chunk", 0))
    if method_type(name).evicts:
        kwargs.setdefault("kv_max", "512")
    return Method(name, **{k: int(v) if v.isdigit() else v for k, v in kwargs.items()})


def timed(model, requests: list[Request], method: Method | int) -> float:
    """Prefill seconds (the engine's own clock: prompts and first tokens) of ``requests``, served at once; an int: the
    model's own forward over them as one batch (``hf_timed``)."""
    if isinstance(method, int):
        return hf_timed(model, requests, method)
    out = Engine(model, method, len(requests)).run(requests, Sampling(ignore_eos=True))
    return out.prefill_s


def hf_timed(model, requests: list[Request], chunk: int) -> float:
    """Seconds of the model's own Hugging Face forward over ``requests`` (one length, one batch) and their first
    token's logits: in one pass (``chunk`` 0) or in chunks of ``chunk`` tokens over a ``DynamicCache``."""
    from transformers import DynamicCache

    ids = torch.tensor([r.input_ids for r in requests], device=model.device)  # [rows, s]
    s = ids.shape[1]
    start = time.perf_counter()
    with torch.no_grad():
        cache = DynamicCache()
        for a in range(0, s, chunk or s):
            model(input_ids=ids[:, a : a + (chunk or s)], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def main(argv=None) -> int:
    a = parse(argv)
    methods = {spec: method_of(spec) for spec in a.methods.split(",")}
    model, _ = load_model(a.model, dtype=a.dtype, device=a.device)
    shape = ModelShape.from_config(model.config)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    warm = [Request(torch.randint(10, vocab - 10, (600,), generator=g).tolist(), 1)]
    for m in methods.values():  # first calls (allocator, kernels) out of the timings
        timed(model, warm, m)
    result = {"model": a.model, "device": a.device, "dtype": a.dtype, "threads": torch.get_num_threads()}
    result.update({"rows": a.rows, "lengths": {}})
    for length in a.lengths:
        requests = [Request(torch.randint(10, vocab - 10, (length,), generator=g).tolist(), 1) for _ in range(a.rows)]
        runs: dict[str, list[float]] = {spec: [] for spec in methods}
        for spec in [*methods, *reversed(methods)]:
            seconds = timed(model, requests, methods[spec])
            runs[spec].append(seconds)
            ms = 1e3 * seconds / (length * a.rows)
            print(f"{length:>6} {spec:>18}: {seconds:7.2f} s  {ms:6.3f} ms/token", flush=True)
        fkv_flops = prompt_token_flops(shape, Method("fkv"), length)
        flops = {
            spec: prompt_token_flops(shape, Method("fkv") if isinstance(m, int) else m, length)
            for spec, m in methods.items()
        }
        result["lengths"][length] = {
            spec: {
                "seconds": runs[spec],
                "ms_per_token": 1e3 * statistics.mean(runs[spec]) / (length * a.rows),
                "flop_ratio": flops[spec] / fkv_flops,
            }
            for spec in methods
        }
    print(table(result, methods))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    atomic_write_text(a.out, json.dumps(result, indent=1))
    return 0


def _name(spec: str, method: Method | int) -> str:
    """A row's method: its label, and its spec's settings when it has any (``FKV (chunk=2048)``)."""
    if isinstance(method, int):
        return f"HF forward, chunks of {method}" if method else "HF forward, one pass"
    settings = spec.partition(":")[2]
    return f"{label(method)} ({settings})" if settings else label(method)


def table(result: dict, methods: dict[str, Method | int]) -> str:
    """Markdown: per length, each method's ms per prompt token, its time and FLOP ratios to FKV; then each
    method's cost at the longest length over its cost at the shortest."""
    lines = ["| length | method | ms / prompt token | time / FKV | FLOPs / FKV |", "|---:|---|---:|---:|---:|"]
    by_length = result["lengths"]
    for length, cells in by_length.items():
        fkv = next((c["ms_per_token"] for spec, c in cells.items() if spec.partition(":")[0] == "fkv"), None)
        for spec, cell in cells.items():
            ratio = f"{cell['ms_per_token'] / fkv:.2f}x" if fkv else "-"
            name = _name(spec, methods[spec])
            lines.append(f"| {length} | {name} | {cell['ms_per_token']:.3f} | {ratio} | {cell['flop_ratio']:.2f}x |")
    lengths = list(by_length)
    if len(lengths) > 1:
        first, last = by_length[lengths[0]], by_length[lengths[-1]]
        lines.append("")
        lines.append(
            f"cost per token at {lengths[-1]} over {lengths[0]}: "
            + ", ".join(
                f"{_name(s, methods[s])} {last[s]['ms_per_token'] / first[s]['ms_per_token']:.2f}x" for s in methods
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
