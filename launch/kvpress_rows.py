"""kvpress's presses on the RULER-style documents, in kvpress's own environment (run by ``bench_ruler.py --kvpress``).

kvpress 0.5.5 pins transformers < 5.3 and this package needs >= 5.17, so the two cannot share one environment: this
script imports only torch, transformers and kvpress (never ``batchmax_tp``), and runs under the interpreter
``scripts/peers.sh`` sets up. It is kvpress's code that compresses and generates: a press's context manager around
the prefill and the pipeline's own ``_forward`` (prefill under the press, then its greedy ``generate_answer`` on the
rest of the prompt); only kvpress's ``preprocess`` (its chat template) is skipped, so the model reads the same plain
text the ``batchmax`` model reads through lm-eval.

    PEERS_PYTHON launch/kvpress_rows.py --model DIR --dtype bfloat16 --press snapkv --kept 0.25 \
        --documents docs.jsonl --out answers.jsonl

``--documents``: JSONL, one document per line: ``key``, ``context`` (the part the press compresses), ``rest`` (read
after it, uncompressed), ``max_gen_toks``. Each answer is appended to ``--out`` as it ends (``key``, ``answer``,
token counts, seconds, the K/V bytes the cache held at most over the request: the prompt read, compressed, and
answered): a run stopped part-way and
started again serves only the documents not yet answered. ``--check`` prints kvpress's version and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

#: The presses by name: the kvpress class (``adasnapkv``: its per-head-budget wrapper around SnapKV).
PRESSES = ("snapkv", "adasnapkv", "expected", "kvzip", "tova", "streaming")


def make_press(name: str, ratio: float):
    """kvpress's press ``name`` at ``compression_ratio`` ``ratio`` (the share of a prompt's pairs it removes)."""
    import kvpress

    if name == "adasnapkv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    cls = {
        "snapkv": kvpress.SnapKVPress,
        "expected": kvpress.ExpectedAttentionPress,
        "kvzip": kvpress.KVzipPress,
        "tova": kvpress.TOVAPress,
        "streaming": kvpress.StreamingLLMPress,
    }[name]
    return cls(compression_ratio=ratio)


def ratio_for(kept: float, tokens: int) -> float:
    """kvpress's ``compression_ratio`` that keeps ``round(kept * tokens)`` of a ``tokens``-token context: its
    ``compute_n_kept`` keeps ``int(tokens * (1 - ratio))``, so the ratio aims half a pair above the target."""
    want = max(1, round(kept * tokens))
    return min(max(1 - (want + 0.5) / tokens, 0.0), 0.999)


class PeakCache:
    """The most K/V bytes the cache held over a request: a hook on every attention layer that runs before the
    press's own (``prepend``), so that while the prompt is read it sees each layer's pairs before they are
    compressed."""

    def __init__(self, model):
        self.peak = 0
        self.handles = [
            module.register_forward_hook(self._seen, prepend=True, with_kwargs=True)
            for name, module in model.named_modules()
            if name.endswith("self_attn")
        ]

    def _seen(self, module, args, kwargs, output):
        import torch

        cache = kwargs.get("past_key_values") or kwargs.get("past_key_value")
        if cache is not None:
            pairs = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
            held = sum(x.nbytes for x in pairs if isinstance(x, torch.Tensor))
            self.peak = max(self.peak, held)

    def close(self):
        for handle in self.handles:
            handle.remove()


def done_keys(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    return {json.loads(line)["key"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="print kvpress's and transformers' versions and exit")
    ap.add_argument("--model", help="a model folder (Hugging Face layout)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--press", choices=PRESSES)
    ap.add_argument("--kept", type=float, help="the share of each context's pairs kept (0-1)")
    ap.add_argument("--documents", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.check:
        print(json.dumps({"kvpress": version("kvpress"), "transformers": version("transformers")}))
        return 0
    import kvpress  # noqa: F401  (registers its pipeline, patches the attention functions its presses mask in)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    if a.threads:
        torch.set_num_threads(a.threads)
    docs = [json.loads(x) for x in a.documents.read_text(encoding="utf-8").splitlines() if x.strip()]
    todo = [d for d in docs if d["key"] not in done_keys(a.out)]
    if not todo:
        return 0
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype), attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(todo):
        context = tokenizer.encode(doc["context"], return_tensors="pt", add_special_tokens=False)
        rest = tokenizer.encode(doc["rest"], return_tensors="pt", add_special_tokens=False)
        press = make_press(a.press, ratio_for(a.kept, context.shape[1]))
        peak = PeakCache(model)
        start = time.perf_counter()
        with torch.inference_mode():
            (answer,) = pipe._forward(
                {"context_ids": context, "questions_ids": [rest]}, max_new_tokens=doc["max_gen_toks"], press=press
            )
        seconds = time.perf_counter() - start
        peak.close()
        generated = len(tokenizer.encode(answer, add_special_tokens=False))
        line = {
            "key": doc["key"],
            "answer": answer,
            "context_tokens": context.shape[1],
            "prompt_tokens": context.shape[1] + rest.shape[1],
            "generated_tokens": generated,
            "seconds": seconds,
            "peak_kv_bytes": peak.peak,
        }
        with a.out.open("a", encoding="utf-8") as f:  # one whole line per answered document
            f.write(json.dumps(line) + "\n")
        print(f"  kvpress {a.press} {i + 1}/{len(todo)}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
