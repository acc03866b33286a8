"""Continuous batching against static batches at one memory budget: the engine's two policies (``Engine(...,
batching=Batching(policy=...))``).

    python launch/bench_serving.py                        # 12 mixed-length requests, EOS honoured, up to 512 new
    python launch/bench_serving.py --equal                # the guard: equal prompts, EOS ignored, BM only
    python launch/bench_serving.py --requests 3 --new 8 --min-len 128 --max-len 256     # smoke test
    python launch/bench_serving.py --methods cont-bm-paper,static-bm-paper --memory-budget 2GiB

Workload: --requests prompts of real text from the bundled fixture (``fixtures/long_qa.jsonl``: six stories, each
with a short-answer question). Prompt i is cut from the stories (starting at story i mod 6, then the next ones) to
reach its target length, followed by one of three instructions in turn (the story's own question; a three-sentence
summary; a detailed retelling), so that the answers end at the model's own EOS after a few to hundreds of tokens.
Target lengths (chat template included, exact) are spread log-evenly over --min-len..--max-len and shuffled with
--seed; every request arrives at t = 0. --equal: every prompt --prompt-len tokens, EOS ignored, --new tokens each
(default 128), and by default as many requests as the paper rule's static batch, so both sides process everything
in one go and the ratio isolates continuous batching's own overhead (target >= 0.95).

Budget: --memory-budget, or the planner's static FKV peak at --fkv-batch for the longest prompt. Continuous rows run
at ``planner.max_slots`` slots, static rows at ``planner.max_batch`` for the longest prompt (batches cut in request
order, each LEFT-padded to its own longest); both are capped at the number of requests (a decode pass computes every
slot, idle or not) and at --max-batch. tokens/s = generated tokens (through EOS) / wall seconds of the whole row.
Latency: a request's end since t = 0 (``finished_s``: under the static policy a request that ends early is done
then, though its slot waits for its batch); TTFT: its first token (``first_token_s``; static: its batch's prefill).
Peak K/V is measured, the predicted total is the planner's (``predict_pool`` / ``predict``) at the size run.
Markdown tables on stdout, JSON in --out. Time on 2 CPU cores (embedded model, fp32): --requests 6 about 31
minutes (12: roughly twice that); --equal about 10.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchmax_tp.bench import serving as bench  # noqa: E402
from batchmax_tp.models import load_model  # noqa: E402
from batchmax_tp.plan.planner import ModelShape  # noqa: E402

logger = logging.getLogger("bench_serving")


def main(argv=None) -> int:
    a, keys, out_path = bench.parse_args(argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    model, tokenizer = load_model(a.model, dtype=a.dtype, device=a.device)
    shape = ModelShape.from_config(model.config)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    longest = a.prompt_len if a.equal else a.max_len
    budget = bench.budget_bytes(a, shape, longest)
    methods = {k: bench.make_method(k, a.kv_max, a.p) for k in keys}
    fits = bench.fits(budget, shape, methods, longest, a)
    n = bench.num_requests(a, budget, shape, longest)
    lengths = [a.prompt_len] * n if a.equal else bench.target_lengths(n, a.min_len, a.max_len, a.seed)
    prompts = bench.build_prompts(tokenizer, lengths)
    logger.info(
        "%s: %d requests, prompt lengths %s, new %d, budget %.1f MiB", bench.mode(a), n, lengths, a.new, budget / 2**20
    )
    bench.warm_up(model, list({m: None for m in methods.values()}), eos, pad)
    rows = list(bench.run_rows(model, shape, methods, fits, n, prompts, longest, a, eos, pad))

    print(bench.header(a, n, lengths, budget))
    print(bench.format_table(rows))
    ratios = bench.ratios(rows, a.equal)
    print(bench.format_ratios(ratios))

    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {
                "args": vars(a),
                "mode": bench.mode(a),
                "budget_bytes": budget,
                "prompt_lengths": lengths,
                "threads": torch.get_num_threads(),
                "rows": rows,
                "ratios": ratios,
            },
            f,
            indent=2,
        )
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
