"""Task data: the paper's tasks (CNN/DailyMail, NarrativeQA, GSM8K), JSONL samples and their prompts.

Two kinds of samples run through the same engine:

- **JSONL samples** (``task: jsonl``), one object per line: ``{"id": ..., "prompt": ..., "reference": ...}``.
  ``id`` (int or str, stored as str) and ``prompt`` (non-empty str) are required; ``reference`` (str, or
  int/float stored as str) is optional; other keys (e.g. the fixture's ``answer_location``) are ignored. Blank
  lines are skipped. The prompt is sent as one user message and never cut.
- **Paper tasks** (``cnn_dailymail``, ``narrativeqa``, ``gsm8k``; :data:`TASKS`) read through ``datasets`` from
  a hub id (the dataset the paper used) or a local folder with ``train.jsonl`` and ``test.jsonl`` in the
  dataset's own schema (the bundled fixtures under ``fixtures/<task>/``). Each prompt is a chat: the k shots
  (drawn once, with a fixed seed, from the train split, the same for every sample) as user/assistant turns,
  then the test sample as the last user message. A user message is ``instruction``, ``document`` and
  ``question`` joined by blank lines; when the rendered prompt is longer than ``max_input_tokens`` only
  documents are cut (their end is dropped): the test sample's document first, then the shots' documents from
  the last shot back. The instruction, the question and the shots' answers are never cut; a prompt that
  still does not fit raises ``ValueError``. How many tokens were cut is kept in ``Sample.tokens_cut``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.tasks import PAPER_TASKS, TASK_NAMES, Task  # noqa: F401 (TASK_NAMES: the names a run can give, re-exported)
from .metrics import normalise_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: The bundled data (package data of ``batchmax_tp``).
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

#: A chat message, ``{"role": "user" | "assistant" | "system", "content": str}``.
Message = dict[str, str]
#: What a sample sends to the model: one user message, or a whole chat (shots + the question).
Prompt = str | Sequence[Message]


@dataclass(frozen=True)
class Sample:
    """One prompt to generate for. ``reference`` is one reference, several (NarrativeQA's two answers) or None;
    ``tokens_cut`` counts the document tokens dropped to fit ``max_input_tokens``."""

    id: str
    prompt: Prompt
    reference: str | tuple[str, ...] | None = None
    tokens_cut: int = 0


def default_fixture_path() -> Path:
    """The bundled fixture: 6 long documents (1-2k tokens) each ending with a short-answer question."""
    return FIXTURES / "long_qa.jsonl"


def load_jsonl(path: str | os.PathLike[str]) -> list[Sample]:
    """Read samples from a JSONL file.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError("FILE:LINE: ...")`` for a malformed line,
    a missing/invalid field or a duplicate id; ``ValueError`` also for a file without samples.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file not found: {path}")
    samples: list[Sample] = []
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            sample = _parse_line(line, where)
            if sample.id in first_line:
                raise ValueError(f"{where}: duplicate id {sample.id!r} (first on line {first_line[sample.id]})")
            first_line[sample.id] = lineno
            samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no samples (empty file)")
    return samples


def _parse_line(line: str, where: str) -> Sample:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")

    if "id" not in record:
        raise ValueError(f"{where}: missing 'id'")
    raw_id = record["id"]
    if isinstance(raw_id, bool) or not isinstance(raw_id, (int, str)) or str(raw_id) == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {raw_id!r}")

    prompt = record.get("prompt")
    if "prompt" not in record:
        raise ValueError(f"{where}: missing 'prompt'")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")

    reference = record.get("reference")
    if reference is not None:
        if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
            raise ValueError(f"{where}: 'reference' must be a string, got {type(reference).__name__}")
        reference = str(reference)
        if not normalise_text(reference):
            raise ValueError(f"{where}: 'reference' has no letters or digits")
    return Sample(id=str(raw_id), prompt=prompt, reference=reference)


def as_messages(prompt: Prompt) -> list[Message]:
    """A prompt as chat messages: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, *, chat_template: bool = True) -> list[int]:
    """Token ids of one prompt: its chat messages rendered by the tokenizer's chat template with
    ``add_generation_prompt=True`` (the template supplies the special tokens, so none are added on top), or,
    without ``chat_template``, the raw text of a string prompt with the tokenizer's default special tokens."""
    if chat_template:
        text = tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise ValueError("a chat (list of messages) needs chat_template=True")
    return list(tokenizer(prompt)["input_ids"])


# ---------------------------------------------------------------------- the paper's tasks
#: The paper's input limit: 4096 (Llama-2's context) - 512 generated tokens.
MAX_INPUT_TOKENS = 3584

_CALCULATOR = re.compile(r"<<[^<>]*>>")


@dataclass(frozen=True)
class Turn:
    """One example of a task: the user message's parts and the answers.

    ``answer`` is what a shot shows as the assistant's reply; ``references`` are what an output is scored
    against. Only ``document`` may be cut to fit the input limit.
    """

    instruction: str
    document: str
    question: str
    answer: str
    references: tuple[str, ...]

    def user_text(self, document: str | None = None) -> str:
        """The user message, with ``document`` in place of the turn's own document when given."""
        doc = self.document if document is None else document
        return "\n\n".join(part for part in (self.instruction, doc, self.question) if part)


def _cnn_dailymail_turn(record: dict[str, Any]) -> Turn:
    highlights = record["highlights"].strip()
    return Turn(
        instruction="Summarize the following news article in a few sentences.",
        document=record["article"].strip(),
        question="",
        answer=" ".join(highlights.split("\n")),
        references=(highlights,),
    )


def _narrativeqa_turn(record: dict[str, Any]) -> Turn:
    answers = tuple(a["text"].strip() for a in record["answers"] if a["text"].strip())
    if not answers:
        raise ValueError("a NarrativeQA record without answers")
    return Turn(
        instruction="Read the story summary below and answer the question with a short answer.",
        document=record["document"]["summary"]["text"].strip(),
        question=f"Question: {record['question']['text'].strip()}",
        answer=answers[0],
        references=answers,
    )


def _gsm8k_turn(record: dict[str, Any]) -> Turn:
    answer = record["answer"].strip()
    return Turn(
        instruction="Solve the math problem step by step. End with the final answer after '####'.",
        document="",
        question=record["question"].strip(),
        answer=_CALCULATOR.sub("", answer),  # shots without the calculator annotations <<48/2=24>>
        references=(answer,),
    )


@dataclass(frozen=True)
class TaskDef(Task):
    """A paper task (``config.tasks.Task``: where its data lives, how many shots, which metric) and how a record
    becomes a :class:`Turn`."""

    to_turn: Callable[[dict[str, Any]], Turn] = field(repr=False, kw_only=True)


_TURNS = {"cnn_dailymail": _cnn_dailymail_turn, "narrativeqa": _narrativeqa_turn, "gsm8k": _gsm8k_turn}
#: The paper's tasks (``config.tasks.PAPER_TASKS``, each with how its records become turns).
TASKS: dict[str, TaskDef] = {name: TaskDef(**vars(t), to_turn=_TURNS[name]) for name, t in PAPER_TASKS.items()}


def fixture_dir(task: str) -> Path:
    """The bundled offline fixture of a paper task: ``fixtures/<task>/{train,test}.jsonl``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    return FIXTURES / task


def load_split(task: TaskDef, source: str | os.PathLike[str], split: str) -> list[dict[str, Any]]:
    """The records of one split, through ``datasets``.

    ``source`` is a local folder or a hub id. A folder holding ``<split>.jsonl`` is read with the ``json``
    builder; any other folder with ``load_dataset(folder)`` (parquet/csv/arrow files named by split); a hub id
    with ``load_dataset(source, task.hub_config)`` (offline, it must already be in the local HF cache).
    """
    import datasets  # only paper tasks need it (and its seconds of import); not installed on every GPU image

    datasets.disable_progress_bars()
    path = Path(source).expanduser()
    if path.is_dir():
        jsonl = path / f"{split}.jsonl"
        if jsonl.is_file():
            dataset = datasets.load_dataset("json", data_files={split: str(jsonl)}, split=split)
        else:
            dataset = datasets.load_dataset(str(path), split=split)
    else:
        dataset = datasets.load_dataset(str(source), task.hub_config, split=split)
    return [dict(record) for record in dataset]


def select_indices(total: int, num_samples: int | None, seed: int) -> list[int]:
    """``num_samples`` of ``range(total)`` drawn with ``seed``, in increasing order (all when None or more).

    The draw depends only on ``(total, num_samples, seed)``: every method and batch size sees the same samples.
    """
    if num_samples is None or num_samples >= total:
        return list(range(total))
    return sorted(random.Random(f"batchmax-samples-{seed}").sample(range(total), num_samples))


def select_shots(total: int, k: int, seed: int) -> list[int]:
    """The ``k`` shot indices drawn with ``seed`` from a pool of ``total`` (in draw order)."""
    if k > total:
        raise ValueError(f"{k} shots needed but the shot split has only {total} examples")
    return random.Random(f"batchmax-shots-{seed}").sample(range(total), k)


@dataclass
class TaskData:
    """A paper task's selected test examples and its shots, before tokenization."""

    task: TaskDef
    source: str
    shots: list[Turn]
    examples: list[tuple[str, Turn]]  #: (id = row index in the test split, turn)
    total: int  #: rows in the test split


def load_task(
    name: str,
    data: str | os.PathLike[str] | None = None,
    *,
    num_shots: int | None = None,
    num_samples: int | None = None,
    seed: int = 0,
) -> TaskData:
    """Read a paper task's shots and its ``num_samples`` seeded test examples (no tokenizer needed).

    ``data``: a hub id or a local folder; None = the bundled fixture. ``num_shots`` None = the paper's count.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    task = TASKS[name]
    source = str(fixture_dir(name) if data is None else data)
    k = task.shots if num_shots is None else num_shots
    shots: list[Turn] = []
    if k > 0:
        pool = load_split(task, source, task.shot_split)
        shots = [task.to_turn(pool[i]) for i in select_shots(len(pool), k, seed)]
    test = load_split(task, source, task.test_split)
    if not test:
        raise ValueError(f"{source}: the {task.test_split} split is empty")
    examples = [(str(i), task.to_turn(test[i])) for i in select_indices(len(test), num_samples, seed)]
    logger.info("%s: %d of %d %s samples, %d shots from %s", name, len(examples), len(test), task.test_split, k, source)
    return TaskData(task=task, source=source, shots=shots, examples=examples, total=len(test))


def chat_messages(shots: Sequence[Turn], turn: Turn, documents: Sequence[str] | None = None) -> list[Message]:
    """The chat of one sample: each shot as a user/assistant pair, then ``turn`` as the last user message.
    ``documents`` (one per shot, then the turn's) replace the turns' own documents."""
    turns = [*shots, turn]
    docs = [t.document for t in turns] if documents is None else list(documents)
    messages: list[Message] = []
    for index, (t, doc) in enumerate(zip(turns, docs, strict=True)):
        messages.append({"role": "user", "content": t.user_text(doc)})
        if index < len(shots):
            messages.append({"role": "assistant", "content": t.answer})
    return messages


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    shots: Sequence[Turn],
    turn: Turn,
    max_input_tokens: int | None = MAX_INPUT_TOKENS,
) -> tuple[list[Message], int]:
    """The chat messages of one sample cut to at most ``max_input_tokens`` tokens, and the tokens cut.

    Only documents are cut, from their end: first the sample's own, then the shots' from the last one back.
    Raises ``ValueError`` when the prompt does not fit even without documents.
    """
    turns = [*shots, turn]
    docs = [t.document for t in turns]
    length = len(prompt_ids(tokenizer, chat_messages(shots, turn, docs)))
    if max_input_tokens is None or length <= max_input_tokens:
        return chat_messages(shots, turn, docs), 0
    cut = 0
    for index in [len(turns) - 1, *reversed(range(len(shots)))]:
        if not docs[index]:
            continue
        doc_ids = tokenizer(docs[index], add_special_tokens=False)["input_ids"]
        keep = len(doc_ids)
        while length > max_input_tokens and keep > 0:
            keep = max(0, keep - (length - max_input_tokens))
            docs[index] = tokenizer.decode(doc_ids[:keep], skip_special_tokens=True).rstrip()
            length = len(prompt_ids(tokenizer, chat_messages(shots, turn, docs)))
        cut += len(doc_ids) - keep
        if length <= max_input_tokens:
            return chat_messages(shots, turn, docs), cut
    raise ValueError(
        f"the prompt has {length} tokens without any document, more than max_input_tokens={max_input_tokens} "
        "(only documents are cut; use fewer shots or a larger max_input_tokens)"
    )


def build_samples(
    tokenizer: PreTrainedTokenizerBase, data: TaskData, max_input_tokens: int | None = MAX_INPUT_TOKENS
) -> list[Sample]:
    """One :class:`Sample` (chat prompt, references, tokens cut) per selected example of ``data``."""
    samples = []
    for sample_id, turn in data.examples:
        try:
            messages, cut = build_prompt(tokenizer, data.shots, turn, max_input_tokens)
        except ValueError as err:
            raise ValueError(f"{data.task.name} sample {sample_id}: {err}") from None
        samples.append(Sample(id=sample_id, prompt=messages, reference=turn.references, tokens_cut=cut))
    num_cut = sum(1 for s in samples if s.tokens_cut)
    if num_cut:
        logger.info(
            "%s: %d of %d prompts cut to max_input_tokens=%s (%d document tokens in all)",
            data.task.name,
            num_cut,
            len(samples),
            max_input_tokens,
            sum(s.tokens_cut for s in samples),
        )
    return samples
