"""The retention benchmark's prompts: the fixture's texts, needles placed at depths in filler, summaries, the splits
(``launch/bench_retention.py``'s docstring says what each split holds), and batches of similar prompts.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...eval.tasks import prompt_ids

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "retention"
#: Needle depths: fraction of the filler's paragraphs before the needle.
DEPTHS = {"early": 0.1, "middle": 0.5, "late": 0.85}
DEFAULT_LENGTHS = (1024, 2048, 3072)
#: The length the issue's targets are stated at (~2k-token prompts).
TARGET_LENGTH = 2048
KINDS = ("needle", "multi", "summary")
#: Prompt sets (launch/bench_retention.py's docstring): ``all`` = ``tune`` = the suite the rules were tuned on;
#: ``heldout`` = new content.
SPLITS = ("all", "tune", "heldout")
SPLIT_ABOUT = {
    "all": "the suite the rules were tuned on (facts of needles.json, documents.json, seed stream retention-SEED); "
    "the same prompts as tune",
    "tune": "the suite the rules were tuned on (facts of needles.json, documents.json, seed stream retention-SEED); "
    "the same prompts as all",
    "heldout": "held out: heldout.json's facts, passkey wording and documents (none in any tuned-on prompt), filler "
    "from seed stream retention-heldout-SEED, passkeys from retention-heldout-passkeys-SEED",
}
NEEDLE_INSTRUCTION = "Read the text below carefully. A question about it follows the text."
SUMMARY_INSTRUCTION = "Read the following collection of local news."
SUMMARY_QUESTION = "Summarize the text above in three sentences."


@dataclass(frozen=True)
class Content:
    """What one split's needles and summaries are made of: facts, the passkey's wording, documents."""

    facts: list[dict[str, str]]
    passkey: dict[str, str]
    documents: list[dict[str, str]]


@dataclass(frozen=True)
class Fixture:
    slots: dict[str, list[str]]
    topics: dict[str, list[str]]
    documents: list[dict[str, str]]
    facts: list[dict[str, str]]
    passkey: dict[str, str]
    heldout: Content | None = None  #: ``heldout.json``: content no rule was tuned on

    def content(self, split: str) -> Content:
        """The split's facts, passkey wording and documents (``all`` and ``tune``: the tuned-on suite's)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
        if split != "heldout":
            return Content(self.facts, self.passkey, self.documents)
        if self.heldout is None:
            raise ValueError("this fixture has no heldout.json: the heldout split needs it")
        return self.heldout


def load_fixture(folder: str | os.PathLike[str] = FIXTURE_DIR) -> Fixture:
    folder = Path(folder)
    read = lambda name: json.loads((folder / name).read_text(encoding="utf-8"))  # noqa: E731
    filler, needles, documents = read("filler.json"), read("needles.json"), read("documents.json")
    heldout = None
    if (folder / "heldout.json").is_file():
        h = read("heldout.json")
        heldout = Content(h["facts"], h["passkey"], h["documents"])
    return Fixture(filler["slots"], filler["topics"], documents, needles["facts"], needles["passkey"], heldout)


_SLOT = re.compile(r"\{(\w+)\}")


def filler_paragraph(rng: random.Random, fx: Fixture) -> str:
    """One paragraph: 4-7 sentences of one topic, in template order, slots filled at random."""
    topic = fx.topics[rng.choice(sorted(fx.topics))]
    picked = sorted(rng.sample(range(len(topic)), rng.randint(4, min(7, len(topic)))))
    fill = lambda m: rng.choice(fx.slots[m.group(1)])  # noqa: E731
    text = " ".join(_SLOT.sub(fill, topic[i]) for i in picked)
    return text[0].upper() + text[1:]


@dataclass(frozen=True)
class Needle:
    kind: str  #: "passkey" | "fact"
    statement: str
    question: str
    answer: str


@dataclass
class RetentionSample:
    id: str
    kind: str  #: "needle" | "multi" | "summary"
    length: int  #: target prompt tokens (the bucket)
    prompt: str
    needles: list[Needle] = field(default_factory=list)
    depths: list[str] = field(default_factory=list)
    prompt_tokens: int = 0  #: measured, chat template applied

    @property
    def answers(self) -> list[str]:
        return [n.answer for n in self.needles]


def passkey_needle(rng: random.Random, passkey: dict[str, str]) -> Needle:
    """A 5-digit key drawn from ``rng``, in ``passkey``'s wording (``statement`` with ``{key}``, ``question``)."""
    key = str(rng.randint(10000, 99999))
    return Needle("passkey", passkey["statement"].format(key=key), passkey["question"], key)


def fact_needle(fact: dict[str, str]) -> Needle:
    return Needle("fact", fact["statement"], fact["question"], fact["answer"])


def _question(needles: Sequence[Needle]) -> str:
    if len(needles) == 1:
        return f"Question: {needles[0].question} Answer briefly."
    asked = "\n".join(f"{i + 1}. {n.question}" for i, n in enumerate(needles))
    return f"Questions:\n{asked}\nGive only the short answers, one per line."


def build_prompt(
    count: Callable[[str], int],
    rng: random.Random,
    fx: Fixture,
    target: int,
    head: str,
    tail: str,
    inserts: Sequence[tuple[float, str]] = (),
) -> tuple[str, int]:
    """``head``, filler paragraphs with ``inserts`` (depth fraction, text) placed among them, and ``tail``,
    grown paragraph by paragraph until the prompt (``count``: tokens with the chat template) reaches
    ``target`` (the last paragraph is dropped again when that lands nearer the target). Returns (prompt text,
    measured tokens)."""

    def render(paragraphs: list[str]) -> str:
        body = list(paragraphs)
        for depth, text in sorted(inserts, key=lambda x: -x[0]):  # deepest first: indices stay valid
            body.insert(round(depth * len(paragraphs)), text)
        return "\n\n".join([head, *body, tail])

    paragraphs: list[str] = []
    base = count(render(paragraphs))
    para_tokens: list[int] = []
    while base + sum(para_tokens) < target:  # paragraph counts add up to within a few tokens of the whole
        paragraphs.append(filler_paragraph(rng, fx))
        para_tokens.append(count(paragraphs[-1]) + 1)
    previous: tuple[str, int] | None = None
    while True:  # exact: measured on the rendered prompt, stop at the first count >= target
        text = render(paragraphs)
        n = count(text)
        if n >= target:
            return previous if previous and target - previous[1] < n - target else (text, n)
        previous = (text, n)
        paragraphs.append(filler_paragraph(rng, fx))


def split_streams(split: str, seed: int) -> tuple[random.Random, random.Random]:
    """(filler stream, passkey stream) of a split. ``all``/``tune``: one stream for both, as the suite the rules
    were tuned on drew them; ``heldout``: two streams of their own seeds."""
    if split in ("all", "tune"):
        rng = random.Random(f"retention-{seed}")
        return rng, rng
    return random.Random(f"retention-heldout-{seed}"), random.Random(f"retention-heldout-passkeys-{seed}")


def build_suite(
    count: Callable[[str], int],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[str] = tuple(DEPTHS),
    multi: bool = True,
    summaries: Sequence[int] | None = None,
    seed: int = 0,
    fx: Fixture | None = None,
    split: str = "all",
) -> list[RetentionSample]:
    """The benchmark's prompts, deterministic for ``seed`` and ``split``.

    Per length: one single-needle prompt per depth (passkey and fact alternate) and, with ``multi``, one prompt
    with a needle at every depth (3 depths: a passkey and two facts) asked together, so that with the default
    depths each length fills one batch of 4. ``summaries``: one summary prompt per listed length (None = three
    of ``TARGET_LENGTH``, or the middle length; each uses the next hand-written document). ``split``: whose
    facts, passkey wording, documents and seed streams (``SPLITS``; ``launch/bench_retention.py``'s docstring says why).
    """
    fx = fx or load_fixture()
    content = fx.content(split)
    rng, key_rng = split_streams(split, seed)
    facts = list(content.facts)
    rng.shuffle(facts)
    fact_iter = iter(facts * 8)
    passkey = lambda: passkey_needle(key_rng, content.passkey)  # noqa: E731
    out: list[RetentionSample] = []
    k = 0
    for length in lengths:
        for depth in depths:
            needle = passkey() if k % 2 == 0 else fact_needle(next(fact_iter))
            k += 1
            out.append(_needle_sample(count, rng, fx, length, depth, needle))
        if multi and len(depths) >= 2:
            n = len(depths)
            needles = [passkey() if i == 0 and n >= 3 else fact_needle(next(fact_iter)) for i in range(n)]
            out.append(_multi_sample(count, rng, fx, length, depths, needles))
    if summaries is None:
        mid = TARGET_LENGTH if TARGET_LENGTH in lengths else sorted(lengths)[len(lengths) // 2]
        summaries = [mid] * 3
    return out + [_summary_sample(count, rng, fx, length, i, content.documents) for i, length in enumerate(summaries)]


def _needle_sample(count, rng: random.Random, fx: Fixture, length: int, depth: str, needle: Needle) -> RetentionSample:
    """One needle at ``depth`` of a ``length``-token prompt, asked after the text."""
    placed = [(DEPTHS[depth], needle.statement)]
    text, n = build_prompt(count, rng, fx, length, NEEDLE_INSTRUCTION, _question([needle]), placed)
    return RetentionSample(f"{needle.kind}-{length}-{depth}", "needle", length, text, [needle], [depth], n)


def _multi_sample(
    count, rng, fx: Fixture, length: int, depths: Sequence[str], needles: list[Needle]
) -> RetentionSample:
    """One needle at every depth (which one where: shuffled with ``rng``), all asked together."""
    order = list(range(len(depths)))
    rng.shuffle(order)  # which needle sits at which depth
    placed = [(DEPTHS[depths[order[i]]], needles[i].statement) for i in range(len(needles))]
    text, n = build_prompt(count, rng, fx, length, NEEDLE_INSTRUCTION, _question(needles), placed)
    at = [depths[order[i]] for i in range(len(needles))]
    return RetentionSample(f"multi-{length}", "multi", length, text, needles, at, n)


def _summary_sample(count, rng, fx: Fixture, length: int, i: int, documents: list[dict[str, str]]) -> RetentionSample:
    """The ``i``-th summary prompt: the next hand-written document inside filler, to summarise."""
    doc = documents[i % len(documents)]
    placed = [(0.4, f"{doc['title']}\n\n{doc['text']}")]
    text, n = build_prompt(count, rng, fx, length, SUMMARY_INSTRUCTION, SUMMARY_QUESTION, placed)
    return RetentionSample(f"summary-{length}-{i}", "summary", length, text, [], [], n)


def shared_needles(a: Sequence[RetentionSample], b: Sequence[RetentionSample]) -> list[str]:
    """Needle statements or answers (passkeys) that both prompt sets hold: none between ``tune`` and ``heldout``."""
    seen = lambda suite: {x for s in suite for n in s.needles for x in (n.statement, n.answer)}  # noqa: E731
    return sorted(seen(a) & seen(b))


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Tokens of a user message with the chat template (what ``eval.generation.encode_prompts`` feeds the model)."""
    return lambda text: len(prompt_ids(tokenizer, text))


def batches(samples: Sequence[RetentionSample], batch_size: int) -> list[list[RetentionSample]]:
    """Batches of one kind (needle/multi together, summaries apart) and similar length: sorted by
    (summary?, length, id) and cut in order, so padding stays small and max_new_tokens is per batch."""
    ordered = sorted(samples, key=lambda s: (s.kind == "summary", s.length, s.prompt_tokens, s.id))
    out: list[list[RetentionSample]] = []
    for s in ordered:
        if out and len(out[-1]) < batch_size and (out[-1][0].kind == "summary") == (s.kind == "summary"):
            out[-1].append(s)
        else:
            out.append([s])
    return out
