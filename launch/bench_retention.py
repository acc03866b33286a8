"""Retention benchmark: what each eviction rule keeps under the same bounded memory (issue 9).

    python launch/bench_retention.py                       # every registered rule at kv_max 512 and 256 (~12 min CPU)
    python launch/bench_retention.py --quick               # smoke run: one short prompt per kind, kv_max 256
    python launch/bench_retention.py --rules paper,pooled --kv-max 512 --out results/retention_512
    python launch/bench_retention.py --split heldout --kinds needle,multi --rules 'paper;question' --kv-max 512,256,128

The prompts are built from the project's own texts (``batchmax_tp/fixtures/retention/``: filler templates drawn
with a fixed seed, four hand-written documents, hand-written facts) and measured with the model's tokenizer,
chat template applied:

- **single needles**: a 5-digit passkey or a multi-token fact (a code name, a person's city, ...) placed early
  (10%), in the middle (50%) or late (85%) of the filler, in prompts of about 1k, 2k and 3k tokens;
- **multi-fact questions**: 2-3 facts (one may be a passkey) at different depths of one prompt, asked together;
- **summaries**: a hand-written document inside filler, summarised; scored by ROUGE-2 against the full cache's
  own summary of the same prompt (fidelity: 1.0 = the full cache's output), and by teacher-forced agreement:
  each rule is fed FKV's summary token by token and the share of steps where its own next token is FKV's is
  counted (1.0 = the same greedy choices). Greedy text drifts once one token differs, so ROUGE-2 alone mostly
  measures where the first difference falls; the forced agreement scores every step on the same prefix.

**Splits** (``--split``): the ``question`` rule's defaults were tuned on this benchmark's own prompts, so they are
checked on prompts they were not tuned on.

- ``all`` (default) and ``tune`` are the same prompts: the suite as it was before the split (the nine facts of
  ``needles.json``, its passkey wording, ``documents.json``, filler and passkeys from the seed stream
  ``retention-SEED``), so results from before the split stay comparable. A split of these prompts by fact cannot
  give a held-out half: every rule was tuned on the whole suite (all nine facts appear in its needles, the
  first three documents in its summaries), so no half of it is untouched by the tuning.
- ``heldout`` is new content, written after the tuning and used by no tuned-on prompt: ``heldout.json``'s ten
  facts, its own passkey wording and three documents of its own; the filler (the shared templates of
  ``filler.json``) is drawn from the stream ``retention-heldout-SEED`` and the passkeys from their own stream
  ``retention-heldout-passkeys-SEED``. It has the same shape as ``all`` (per length three single needles at the
  three depths and one multi-fact prompt: 18 needles at 1k/2k/3k, 6 at ~2k; three ~2k summaries), so needle hits
  per kv_max compare. The two share no fact, passkey statement or document; a passkey value could repeat only by
  chance (two independent draws of 5 digits), which the tests check does not happen at the default seeds.

Every needle answer found in the output is a hit (passkey: the five digits as one number; fact: the answer as
whole words, case and punctuation ignored). FKV (full cache) runs once; every rule runs as Batch-Max
(Algorithm 1, same ``kv_max`` and ``p``) at each ``kv_max``. Samples run in batches of ``--batch-size`` prompts
of the same length bucket (left padding), greedy, ignoring EOS. tokens/s = generated tokens / (prefill +
decode seconds) over all batches of a row.

Writes into ``--out`` (default results/retention): table.md, results.csv, retention.png, samples.jsonl (every
output with its score) and settings.json (resolved settings, the split and what it holds, the prompts' measured
lengths, wall time); table.md, results.csv and samples.jsonl name the split on every row.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tqdm.auto import tqdm  # noqa: E402

from batchmax_tp.bench import retention  # noqa: E402
from batchmax_tp.bench.retention import cli  # noqa: E402
from batchmax_tp.embedded import EMBEDDED_MODEL  # noqa: E402
from batchmax_tp.models import load_model  # noqa: E402

logger = logging.getLogger("batchmax_tp.bench_retention")


def main(argv: Sequence[str] | None = None) -> int:
    a = cli.parse_args(argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    start = time.perf_counter()
    model, tokenizer = load_model(a.model or EMBEDDED_MODEL, dtype=a.dtype, device=a.device)
    samples, shared = cli.prompts(retention.token_counter(tokenizer), a)
    target = cli.target_length(a.lengths)
    groups = retention.batches(samples, a.batch_size)
    rows = cli.make_rows(a)
    logger.info(
        "split %s: %d prompts (%s tokens), %d batches, %d rows: %s",
        a.split,
        len(samples),
        ",".join(str(s.prompt_tokens) for s in samples),
        len(groups),
        len(rows),
        ", ".join(r.label for r in rows),
    )
    cli.warm_up(model, tokenizer, samples[0], rows, a.rules)
    timed = next((g for g in groups if g[0].kind != "summary" and g[0].length == target), groups[0])
    with tqdm(total=len(rows) * (len(groups) + a.speed_repeats), desc="retention", unit="batch") as bar:
        runs = cli.run_rows(model, tokenizer, rows, groups, timed, a, bar)
    table, records = retention.score_rows(samples, runs, target, a.split)
    wall = time.perf_counter() - start
    settings = cli.settings(a, argv, samples, groups, timed, target, shared, wall)
    paths = retention.write_outputs(a.out, table, records, settings)
    print(retention.format_markdown(table, target), end="")
    print(f"\nwall {wall:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
