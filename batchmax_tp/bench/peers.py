"""kvpress's presses beside the project's methods on the RULER-style documents (``launch/bench_ruler.py --kvpress``).

kvpress (0.5.5, the registry's) compresses a prompt's pairs once after a full prefill. It pins transformers < 5.3 and
this package needs >= 5.17, so its presses run in their own environment (``scripts/peers.sh``: a virtual
environment that sees this one's packages, with kvpress and its transformers on top) through
``launch/kvpress_rows.py``, a script that imports only kvpress, transformers and torch. This module is this side
of that line: a press's spec, the interpreter's check (before any load), the documents split where the question
starts, and the answers scored by the suite's own ``string_match_all`` (each answer cut at the task's stop strings
as ``generate_until`` cuts it) into a row of ``bench_ruler``'s table.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..parted import cache_root

#: The kvpress version the rows are measured with (``scripts/peers.sh`` installs it).
KVPRESS_VERSION = "0.5.5"
#: Press names (``launch/kvpress_rows.py``'s): SnapKV, its per-head-budget wrapper (AdaKV), ExpectedAttention,
#: KVzip, TOVA, StreamingLLM.
PRESSES = ("snapkv", "adasnapkv", "expected", "kvzip", "tova", "streaming")
#: Where the question sits: inside the compressed context (kvpress's query-aware setting: the answer's start read
#: after it), read after it, or ``all``: the whole prompt compressed but its last word, as the project's methods
#: compress it (the answer's start inside too).
PLACEMENTS = ("in", "out", "all")
QUESTION, ANSWER = "\n\nQuestion:", "\nAnswer:"


@dataclass(frozen=True)
class PressRun:
    """One kvpress row: press ``name``, the share ``kept`` of each context's pairs, the question ``placement``."""

    name: str
    kept: float
    placement: str

    @property
    def label(self) -> str:
        return f"kvpress {self.name} {self.kept:.1%} q-{self.placement}".replace(".0%", "%")

    @property
    def args(self) -> dict:
        return {"kvpress": self.name, "kept": self.kept, "question": self.placement}


def parse_press(text: str) -> tuple[str, float]:
    """``PRESS:KEPT``: a press of :data:`PRESSES` and the share of each prompt's pairs it keeps (0 < KEPT < 1, as
    kv_max is a share of the prompt: ``snapkv:0.25`` keeps a quarter; kvpress's ``compression_ratio`` is 1 - KEPT).
    ValueError with one line otherwise."""
    name, _, kept = text.strip().partition(":")
    if name not in PRESSES:
        raise ValueError(f"--kvpress {text!r}: the press must be one of {', '.join(PRESSES)}")
    try:
        share = float(kept)
    except ValueError:
        raise ValueError(
            f"--kvpress {text!r}: expected PRESS:KEPT, the share of each prompt kept, e.g. snapkv:0.25"
        ) from None
    if not 0 < share < 1:
        raise ValueError(f"--kvpress {text!r}: KEPT is a share of the prompt's pairs, between 0 and 1")
    return name, share


def press_runs(specs: list[str], placements: list[str]) -> list[PressRun]:
    """Each spec at each question placement, in order (ValueError, one line, for a bad one)."""
    bad = [p for p in placements if p not in PLACEMENTS]
    if bad or not placements:
        raise ValueError(f"--kvpress-question: comma list of {', '.join(PLACEMENTS)}, got {','.join(placements)!r}")
    return [PressRun(*parse_press(s), p) for s in specs for p in placements]


def default_python() -> Path:
    """``$BATCHMAX_PEERS_PYTHON``, else the interpreter ``scripts/peers.sh`` makes under the cache root."""
    env = os.environ.get("BATCHMAX_PEERS_PYTHON")
    return Path(env) if env else cache_root() / "peers-venv" / "bin" / "python"


def check_python(python: Path, script: Path) -> dict:
    """The versions ``python`` runs ``script --check`` with, or ValueError (one line) when it is missing, fails or
    has another kvpress than :data:`KVPRESS_VERSION`: checked before any model loads."""
    setup = "set it up with: bash scripts/peers.sh (or name one with --peers-python)"
    if not Path(python).is_file():
        raise ValueError(f"--kvpress: no interpreter {python} for kvpress's presses; {setup}")
    done = subprocess.run([str(python), str(script), "--check"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"--kvpress: {python} cannot run kvpress ({last}); {setup}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if found.get("kvpress") != KVPRESS_VERSION:
        raise ValueError(
            f"--kvpress: {python} has kvpress {found.get('kvpress')}, the rows are measured with {KVPRESS_VERSION}; "
            f"{setup}"
        )
    return found


def split(text: str, placement: str) -> tuple[str, str]:
    """(the part a press compresses, the part read after it) of a RULER-style prompt: the question stays in the
    compressed part (``in``) or is read after it (``out``), the answer's start (``Answer: ...``) read after it either
    way, as kvpress's pipeline reads its ``answer_prefix``; ``all``: everything but the last word is compressed (the
    pipeline needs a question to read), the text the project's methods compress. ``context + rest == text``."""
    mark = {"out": QUESTION, "in": ANSWER, "all": " "}[placement]
    cut = text.rfind(mark)
    if cut <= 0 or (placement == "all" and text.rfind(ANSWER) <= 0):
        raise ValueError(f"a prompt without {ANSWER if placement == 'all' else mark!r}: cannot place its question")
    return text[:cut], text[cut:]


def cut_at(text: str, until: list[str]) -> str:
    """``text`` up to the first of ``until`` (lm-eval's ``generate_until`` cut)."""
    for stop in until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


def documents(cells: dict[str, tuple[Path, Path]], limit: int | None, placement: str) -> list[dict]:
    """The documents of each cell ("<task> <length>" -> (its data JSONL, its task yaml)), the first ``limit`` of
    each, as ``kvpress_rows.py`` reads them: ``key`` ("<cell> <index>"), ``context``, ``rest``, ``max_gen_toks``,
    and, for scoring here, ``outputs`` and ``until``."""
    out = []
    for cell, (data, task) in cells.items():
        gen = yaml.safe_load(task.read_text(encoding="utf-8")).get("generation_kwargs", {})
        lines = data.read_text(encoding="utf-8").splitlines()[:limit]
        for i, line in enumerate(lines):
            doc = json.loads(line)
            context, rest = split(doc["input"], placement)
            out.append(
                {
                    "key": f"{cell} {i}",
                    "context": context,
                    "rest": rest,
                    "max_gen_toks": int(gen.get("max_gen_toks", doc["max_gen_toks"])),
                    "outputs": doc["outputs"],
                    "until": list(gen.get("until") or []),
                }
            )
    return out


def row(run: PressRun, docs: list[dict], answers: list[dict], wall_s: float, score) -> dict:
    """``bench_ruler``'s row of ``run`` from its documents and the answers ``kvpress_rows.py`` wrote, each scored by
    ``score(prediction, expected)`` (the suite's own ``ruler_utils.string_match_all``): each
    cell's mean score and each document's (in document order, for the paired intervals), tokens/s (prompt and
    generated tokens over the seconds kvpress spent), 1 slot (kvpress runs one prompt at a time), the most K/V bytes
    its cache held over a request (each layer's whole prompt before that layer is compressed)."""
    by_key = {a["key"]: a for a in answers}
    missing = [d["key"] for d in docs if d["key"] not in by_key]
    if missing:
        raise ValueError(f"{run.label}: no answer for {len(missing)} documents (first: {missing[0]})")
    documents: dict[str, list[float]] = {}
    for d in docs:
        cell = d["key"].rsplit(" ", 1)[0]
        answer = cut_at(by_key[d["key"]]["answer"], d["until"])
        documents.setdefault(cell, []).append(score(answer, d["outputs"]))
    used = [by_key[d["key"]] for d in docs]
    tokens = sum(a["prompt_tokens"] + a["generated_tokens"] for a in used)
    return {
        "label": run.label,
        "model_args": run.args,
        "scores": {cell: sum(v) / len(v) for cell, v in documents.items()},
        "documents": documents,
        "tokens_per_s": tokens / sum(a["seconds"] for a in used),
        "slots": 1,
        "peak_kv_bytes": max(a["peak_kv_bytes"] for a in used),
        "wall_s": wall_s,
        "prefill": "whole prompt",
    }
