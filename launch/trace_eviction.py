"""The eviction trace of RULER-style documents (``batchmax_tp.bench.trace``): for each document, each method's answer
and, per fact the answer needs, the share of its pairs held when the prefill ended, and when and how the rest went.

    python launch/trace_eviction.py --model qwen2.5-coder-0.5b --dtype bfloat16 \
        --docs ~/.cache/batchmax_tp/ruler-long/data/vt_16k_tune.jsonl:0,1 --methods bm:2048:question snap:2048

``--docs FILE:I,J,...`` (repeatable): documents of a data file of the suite (``configs/lm_eval/ruler/build.py``; the
8k-32k files are built by ``launch/bench_ruler.py`` into ``$BATCHMAX_CACHE/ruler-long``). ``--methods``: ``fkv``,
``NAME:KV_MAX`` or ``bm:KV_MAX:RULE`` (a rule with its settings, ``bm:2048:question:every=1``). Each document is
served alone under each method, one after another in one process; the Markdown goes to stdout as each document ends,
everything to ``--out`` (JSON, rewritten after each document).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_ruler import BUILD, _script  # noqa: E402  (the suite's builder and scorer, loaded by path)

from batchmax_tp.bench.trace import format_document, trace_document  # noqa: E402
from batchmax_tp.core.method import make_method  # noqa: E402
from batchmax_tp.eval.files import atomic_write_text  # noqa: E402
from batchmax_tp.models import EMBEDDED_MODEL, load_model  # noqa: E402


def method_of(spec: str):
    """``bm:2048:question`` -> BM at kv_max 2048 under ``question``; ``snap:2048``; ``fkv`` (its answer beside them);
    one line for anything else."""
    name, _, rest = spec.partition(":")
    kv, _, rule = rest.partition(":")
    if name == "fkv" and not rest:
        return make_method("fkv")
    if not kv.isdigit():
        raise ValueError(f"--methods: {spec!r} is not NAME:KV_MAX or bm:KV_MAX:RULE")
    return make_method(name, kv_max=int(kv), **({"rule": rule} if rule else {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--docs", action="append", required=True, help="FILE:I,J,... (repeatable)")
    ap.add_argument("--methods", nargs="+", default=["bm:2048:question", "snap:2048"])
    ap.add_argument("--out", default="results/trace_eviction.json")
    a = ap.parse_args(argv)
    try:
        methods = [method_of(s) for s in a.methods]
        docs = []
        for spec in a.docs:
            path, _, picks = spec.rpartition(":")
            lines = Path(os.path.expanduser(path)).read_text(encoding="utf-8").splitlines()
            docs += [json.loads(lines[int(i)]) for i in picks.split(",")]
    except (ValueError, OSError, IndexError) as err:
        ap.error(str(err))
    model, tokenizer = load_model(a.model, dtype=a.dtype)
    score, results = _script("ruler_utils").string_match_all, []
    for doc in docs:
        until = ["\n\n"] if doc["task"] in BUILD.STOP_AT_BLANK_LINE else []  # as the task's yaml stops it
        results.append(trace_document(model, tokenizer, doc, methods, score, until))
        print(format_document(results[-1]), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(a.out), json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
