"""Build the two offline lm-eval example tasks' data (``data/*.jsonl``) from the retention benchmark's fixtures.

    python configs/lm_eval/build_data.py      # deterministic: rewrites the same files

- ``needle_mc.jsonl`` (task ``batchmax_needle_mc``, multiple choice by loglikelihood): ~1000 tokens of filler with
  one fact placed at a random depth; the question asks for it; four choices (its answer and three other facts').
- ``passkey.jsonl`` (task ``batchmax_passkey``, ``generate_until`` + exact match): the same filler with a five-digit
  passkey placed at a random depth.

Every text is the project's own (``batchmax_tp/fixtures/retention``: hand-written facts and seeded filler).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import bench_retention as br  # noqa: E402

DOCS, TARGET, SEED = 20, 1000, 0
HEAD = "Read the text below carefully; a question about it follows."


def main() -> None:
    from transformers import AutoTokenizer

    from batchmax_tp.models import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    count = lambda text: len(tok.encode(text))  # noqa: E731 - the task's context, no template
    fx = br.load_fixture()
    facts = fx.facts + (fx.heldout.facts if fx.heldout else [])
    rng = random.Random(f"lm-eval-tasks-{SEED}")
    mc, keys = [], []
    for i in range(DOCS):
        fact = facts[i % len(facts)]
        depth = rng.choice([0.1, 0.3, 0.5, 0.7, 0.9])
        text, _ = br.build_prompt(count, rng, fx, TARGET, HEAD, "", [(depth, fact["statement"])])
        others = rng.sample([f["answer"] for f in facts if f["answer"] != fact["answer"]], 3)
        choices = [fact["answer"], *others]
        rng.shuffle(choices)
        mc.append(
            {
                "id": i,
                "context": text.strip(),
                "question": fact["question"],
                "choices": choices,
                "label": choices.index(fact["answer"]),
                "depth": depth,
            }
        )
        needle = br.passkey_needle(rng, fx.passkey)
        text, _ = br.build_prompt(count, rng, fx, TARGET, HEAD, "", [(depth, needle.statement)])
        keys.append(
            {"id": i, "context": text.strip(), "question": needle.question, "answer": needle.answer, "depth": depth}
        )
    out = Path(__file__).resolve().parent / "data"
    out.mkdir(exist_ok=True)
    for name, rows in (("needle_mc.jsonl", mc), ("passkey.jsonl", keys)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{out / name}: {len(rows)} documents")


if __name__ == "__main__":
    main()
