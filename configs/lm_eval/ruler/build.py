"""Build the offline RULER-style long-context suite (Hsieh et al. 2024, adapted) as lm-eval tasks.

    python configs/lm_eval/ruler/build.py                  # deterministic: rewrites the same bytes
    python configs/lm_eval/ruler/build.py --per-half 2 --out /tmp/ruler   # a smaller suite elsewhere
    python configs/lm_eval/ruler/build.py --lengths 8k,16k,32k --out /tmp/ruler-long   # the long documents

Seven tasks, each at 2k and 4k tokens, each in a tuning half and a held-out half (this folder holds them). The long
lengths, 8k, 16k and 32k (``LONG``: a model with a 32k context, Qwen2.5-Coder-0.5B), carry the tasks of
``LONG_TASKS``: the three needle tasks that ask one key (single, multi-key, multi-value) and ``vt``, which needs five
facts chained; ``PER_HALF`` documents of each (at 8k and 16k 8 in the tuning half and 16 held out, so that a
held-out length's 64 documents give a share's 95% interval about +-0.08; 2 and 2 at 32k). They are built on demand
into another folder (``launch/bench_ruler.py`` builds them into the model cache; ~13 MB of text, not kept in the
repository):

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." (a 7-digit value, a key
  of two words) hidden in filler; the question asks for the value;
- ``niah_multikey``: four needles of four keys; one key is asked, three are distractors;
- ``niah_multivalue``: four needles of one key; all four values are asked;
- ``niah_multiquery``: four needles of four keys; all four are asked at once;
- ``vt`` (variable tracking): a chain "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." four times, in order,
  spread through filler; the answer is the five variables that hold the value;
- ``cwe`` (common words extraction): a numbered list of words where 10 words appear much more often (6 times
  against once at 2k, 30 against 3 at 4k, as RULER); the answer is those 10 words;
- ``fwe`` (frequent words extraction): coded text of 6-letter pseudo-words with Zipf frequencies (alpha 2, the
  most frequent "word" being the noise "..."); the answer is the three most frequent coded words.

Every text is the project's own: the filler is ``filler_paragraph``'s seeded sentences (``batchmax_tp/fixtures/
retention``), the keys and listed words come from the fixture's words (lowercase, 4-12 letters, none inside
another, so a word never matches inside a longer one). Nothing is downloaded.

Lengths: each prompt (``input``: instruction, text, question and answer prefix, plain text, fed as is) is
counted with the embedded model's tokenizer and fills ``target - max_gen_toks`` tokens to within 2 %, so prompt
and answer fit a ``target``-token context, as RULER sizes its inputs. Generation is greedy with ``max_gen_toks``
32 or 64 (``TASKS``); the needle tasks stop at a blank line, the list answers (vt, cwe, fwe) run to
``max_gen_toks`` or EOS, as RULER runs every task (a model often starts a list with a blank line).

Halves: the fixture's words are shuffled once (seed) and cut in two; the tuning half draws keys and words from
the first part, the held-out half from the second; values start with 1-4 (tune) or 5-9 (held-out), variable
names with A-M or N-Z, coded words with a-m or n-z. So no key, value, variable, listed word or coded word is in
both halves. Every document has its own random stream ``ruler-SEED-HALF-TASK-LENGTH-INDEX``: a smaller
``--per-half`` builds the first documents of a larger one.

Writes into ``--out`` (default: this folder): ``data/<task>_<length>_<half>.jsonl`` (fields ``input``,
``outputs``: the expected strings, ``needles``: what was hidden, ``tokens``, ``max_gen_toks``, ...), one task
yaml per (task, length, half) named ``batchmax_ruler_<task>_<length>_<half>``, and the groups
``batchmax_ruler_<half>`` (both short lengths; a build of other lengths: ``batchmax_ruler_<half>_8k_16k_32k``) and
``batchmax_ruler_<half>_<length>``, which average their tasks' ``string_match_all``. Another ``--out`` also gets the
shared template and ``ruler_utils.py``: a complete task folder for ``--include_path``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import string
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from batchmax_tp.bench.retention import Fixture, load_fixture  # noqa: E402
from batchmax_tp.bench.retention.suite import filler_paragraph  # noqa: E402

LENGTHS = {"2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384, "32k": 32768}
SHORT = ("2k", "4k")  #: the lengths this folder holds (the default build)
LONG = ("8k", "16k", "32k")  #: built on demand elsewhere (``--lengths``)
HALVES = ("tune", "heldout")
#: task -> max_gen_toks: just enough room for the answer.
TASKS = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "vt": 64,
    "cwe": 64,
    "fwe": 32,
}
#: Tasks whose generation stops at a blank line. The list answers (vt, cwe, fwe) often start on a new line ("they
#: are:\n\n1. ..."), which that stop would cut to nothing: they run to max_gen_toks (or EOS), as RULER runs all.
STOP_AT_BLANK_LINE = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
#: (keys, values per key, keys asked) of the needle tasks.
NIAH = {
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}
#: The tasks at the long lengths: the needles that ask one key, and variable tracking (five facts chained). The
#: list answers of cwe and fwe and the four-key query are left to 2k and 4k.
LONG_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
SLACK = 0.02  # a prompt fills its budget to within this share
DEFAULT_PER_HALF, DEFAULT_SEED = 4, 0
#: Documents per (task, half) at each long length (``--per-half`` sets the short lengths' and caps these). Issue 68:
#: 16 per task held out at 8k and 16k (64 a length), 8 per task to tune on; the first 4 are those built before.
PER_HALF = {"8k": {"tune": 8, "heldout": 16}, "16k": {"tune": 8, "heldout": 16}, "32k": {"tune": 2, "heldout": 2}}
VALUE_FIRST = {"tune": "1234", "heldout": "56789"}  # first digit of a value
UPPER_FIRST = {"tune": string.ascii_uppercase[:13], "heldout": string.ascii_uppercase[13:]}  # variable names
LOWER_FIRST = {"tune": string.ascii_lowercase[:13], "heldout": string.ascii_lowercase[13:]}  # coded words
TEMPLATE, UTILS = "_ruler_template_yaml", "ruler_utils.py"
ZETA2 = math.pi**2 / 6  # sum of k^-2: the Zipf normaliser of fwe


# -- words, values, names ----------------------------------------------------------------------------------------
def vocabulary(fx: Fixture) -> list[str]:
    """The fixture's lowercase words of 4-12 letters (slots, templates, facts, documents), none inside another;
    sorted."""
    texts: list[str] = []

    def walk(x) -> None:
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk([fx.slots, fx.topics, fx.facts, fx.passkey, fx.documents])
    if fx.heldout is not None:
        walk([fx.heldout.facts, fx.heldout.passkey, fx.heldout.documents])
    text = re.sub(r"\{\w+\}", " ", " ".join(texts))  # template slots are no words
    words = set(re.findall(r"(?<![\w'-])[a-z]{4,12}(?![\w'-])", text))
    return sorted(w for w in words if not any(w != o and w in o for o in words))


def split_vocabulary(words: list[str], seed: int) -> dict[str, list[str]]:
    """The words shuffled with ``seed`` and cut in two: half -> its words (disjoint)."""
    words = list(words)
    random.Random(f"ruler-vocab-{seed}").shuffle(words)
    mid = len(words) // 2
    return {"tune": words[:mid], "heldout": words[mid:]}


def distinct(draw: Callable[[], str], n: int) -> list[str]:
    """``n`` different results of ``draw``, in the order drawn."""
    out: list[str] = []
    while len(out) < n:
        x = draw()
        if x not in out:
            out.append(x)
    return out


def number(rng: random.Random, half: str, digits: int) -> str:
    """A ``digits``-digit number whose first digit is the half's."""
    return rng.choice(VALUE_FIRST[half]) + "".join(rng.choice(string.digits) for _ in range(digits - 1))


def phrase(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# -- prompts ---------------------------------------------------------------------------------------------------------
def prompt(head: str, body: str, question: str, answer_prefix: str) -> str:
    """The text the model reads: instruction, body, question and the start of the answer."""
    return f"{head}\n\n{body}\n\nQuestion: {question}\nAnswer: {answer_prefix}"


def fit(render: Callable[[int], str], count: Callable[[str], int], budget: int, hi: int) -> tuple[str, int, int]:
    """The longest ``render(n)`` (n in [0, hi]) within ``budget`` tokens, by bisection (tokens grow with n).
    Returns (text, tokens, n); ``ValueError`` when it ends more than ``SLACK`` below the budget."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(render(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    text = render(lo)
    tokens = count(text)
    if not (1 - SLACK) * budget <= tokens <= budget:
        raise ValueError(f"prompt of {tokens} tokens for a budget of {budget}: the generator cannot fill it")
    return text, tokens, lo


class Haystack:
    """Filler sentences (``filler_paragraph``'s, in their paragraphs), enough for ``budget`` tokens;
    ``text(n, inserts)``: the first ``n`` sentences with each insert (depth in [0, 1], sentence) placed before
    sentence ``round(depth * n)``, in its paragraph, inserts at one place in their given order."""

    def __init__(self, rng: random.Random, fx: Fixture, count: Callable[[str], int], budget: int, spare: int = 64):
        self.sentences: list[tuple[int, str]] = []  # (paragraph, sentence)
        tokens, p = 0, 0
        while tokens < budget + spare:
            for s in re.split(r"(?<=[.!?]) ", filler_paragraph(rng, fx)):
                self.sentences.append((p, s))
                tokens += count(s) + 1
            p += 1

    def text(self, n: int, inserts: list[tuple[float, str]]) -> str:
        at: dict[int, list[str]] = {}
        for depth, sentence in inserts:
            at.setdefault(round(depth * n), []).append(sentence)
        paragraphs: dict[int, list[str]] = {}  # paragraph -> its sentences, in order
        for i in range(n + 1):
            sentences = paragraphs.setdefault(self.sentences[min(i, n - 1)][0] if n else 0, [])
            sentences.extend(at.get(i, []))
            if i < n:
                sentences.append(self.sentences[i][1])
        return "\n\n".join(" ".join(p) for p in paragraphs.values())


def niah(task: str, rng: random.Random, half: str, words: list[str], hay: Haystack):
    """Needles "One of the special magic numbers for KEY is: VALUE." at random depths; some keys asked."""
    n_keys, n_values, n_asked = NIAH[task]
    keys = distinct(lambda: "-".join(rng.sample(words, 2)), n_keys)
    values = distinct(lambda: number(rng, half, 7), n_keys * n_values)
    needles = [(k, values[i * n_values + j]) for i, k in enumerate(keys) for j in range(n_values)]
    rng.shuffle(needles)
    placed = [(rng.random(), f"One of the special magic numbers for {k} is: {v}.") for k, v in needles]
    asked = rng.sample(keys, n_asked)
    if n_asked * n_values == 1:
        head = (
            "A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards."
        )
        question = f"What is the special magic number for {asked[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {asked[0]} mentioned in the provided text is"
    else:
        head = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards."
        )
        question = f"What are all the special magic numbers for {phrase(asked)} mentioned in the provided text?"
        prefix = f"The special magic numbers for {phrase(asked)} mentioned in the provided text are"
    outputs = [v for a in asked for k, v in needles if k == a]
    render = lambda n: prompt(head, hay.text(n, placed), question, prefix)  # noqa: E731
    return render, len(hay.sentences), outputs, keys + values


def vt(rng: random.Random, half: str, hay: Haystack):
    """One chain of 4 hops (5 variables), its statements in order at random depths."""
    names = distinct(lambda: rng.choice(UPPER_FIRST[half]) + "".join(rng.choices(string.ascii_uppercase, k=4)), 5)
    value = number(rng, half, 5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    placed = list(zip(sorted(rng.random() for _ in chain), chain))
    head = "Memorize and track the chain of variable assignments hidden in the following text."
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"According to the chain of variable assignments in the text above, {len(names)} variables are "
        f"assigned the value {value}, they are:"
    )
    render = lambda n: prompt(head, hay.text(n, placed), question, prefix)  # noqa: E731
    return render, len(hay.sentences), names, names + [value]


def cwe(rng: random.Random, words: list[str], target: int, stream: str):
    """A numbered list: 10 common words (6 times each at 2k, 30 at 4k) among uncommon ones (once, 3 times)."""
    common_n, uncommon_n = (6, 1) if target < 4096 else (30, 3)
    drawn = rng.sample(words, len(words))
    common, uncommon = drawn[:10], drawn[10:]
    head = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    question = "What are the 10 most common words in the above list?"
    prefix = "The top 10 words that appear most often in the list are:"

    def render(n: int) -> str:
        listed = common * common_n + uncommon[:n] * uncommon_n
        random.Random(f"{stream}-shuffle-{n}").shuffle(listed)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
        return prompt(head, body, question, prefix)

    return render, len(uncommon), common, list(common)


def fwe(rng: random.Random, half: str, target: int, budget: int, stream: str):
    """Coded text: ``target // 50`` pseudo-words, the k-th ``floor(n k^-2 / zeta(2))`` times, the first being
    the noise '...'; the three after it are asked."""
    size = target // 50
    letters = string.ascii_lowercase
    coded = distinct(lambda: rng.choice(LOWER_FIRST[half]) + "".join(rng.choices(letters, k=5)), size - 1)
    vocab = ["...", *coded]
    head = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequent coded words."
    )
    question = (
        "Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequent words in the above coded text?"
    )
    prefix = "According to the coded text above, the three most frequent words are:"

    def counts(n: int) -> list[int]:
        return [int(n * k**-2 / ZETA2) for k in range(1, size + 1)]

    def render(n: int) -> str:
        text = [w for w, c in zip(vocab, counts(n)) for _ in range(c)]
        random.Random(f"{stream}-shuffle").shuffle(text)
        return prompt(head, " ".join(text), question, prefix)

    return render, 2 * budget, coded[:3], coded, counts


def document(task: str, length: str, half: str, i: int, seed: int, fx: Fixture, words: list[str], count) -> dict:
    """Document ``i`` of (task, length, half), from its own random stream."""
    target, max_gen = LENGTHS[length], TASKS[task]
    budget = target - max_gen
    stream = f"ruler-{seed}-{half}-{task}-{length}-{i}"
    rng = random.Random(stream)
    # Sentences counted alone add up to more tokens than joined: 64 spare covers 2k and 4k, a tenth the long lengths.
    spare = 64 if length in SHORT else budget // 10
    if task in NIAH:
        render, hi, outputs, needles = niah(task, rng, half, words, Haystack(rng, fx, count, budget, spare))
    elif task == "vt":
        render, hi, outputs, needles = vt(rng, half, Haystack(rng, fx, count, budget, spare))
    elif task == "cwe":
        render, hi, outputs, needles = cwe(rng, words, target, stream)
    else:
        render, hi, outputs, needles, counts = fwe(rng, half, target, budget, stream)
    text, tokens, n = fit(render, count, budget, hi)
    if task == "fwe" and not (c := counts(n))[1] > c[2] > c[3] > c[4]:  # the asked words rank strictly first
        raise ValueError(f"fwe document {stream}: word counts {c[:5]} do not rank three words first")
    return {
        "id": i,
        "task": task,
        "length": target,
        "half": half,
        "tokens": tokens,
        "max_gen_toks": max_gen,
        "input": text,
        "outputs": outputs,
        "needles": needles,
    }


# -- files -----------------------------------------------------------------------------------------------------------
def tasks_at(length: str) -> tuple[str, ...]:
    """The tasks built at ``length``: all of ``TASKS`` at 2k and 4k, ``LONG_TASKS`` beyond."""
    return tuple(TASKS) if length in SHORT else LONG_TASKS


def documents_at(length: str, half: str, per_half: int | None = None) -> int:
    """Documents per task of ``half`` at ``length``: ``per_half`` (default ``DEFAULT_PER_HALF``) at 2k and 4k,
    ``PER_HALF`` beyond (at most ``per_half`` when given and smaller, so a smaller suite stays the first documents of
    a larger one)."""
    if length in SHORT:
        return DEFAULT_PER_HALF if per_half is None else per_half
    return PER_HALF[length][half] if per_half is None else min(PER_HALF[length][half], per_half)


def task_name(task: str, length: str, half: str) -> str:
    return f"batchmax_ruler_{task}_{length}_{half}"


def task_yaml(task: str, length: str, half: str, data: str) -> str:
    return (
        "# Written by build.py: do not edit.\n"
        f"include: {TEMPLATE}\n"
        f"task: {task_name(task, length, half)}\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {data}\n"
        "generation_kwargs:\n"
        + ('  until:\n    - "\\n\\n"\n' if task in STOP_AT_BLANK_LINE else "  until: []\n")
        + f"  max_gen_toks: {TASKS[task]}\n"
        "  do_sample: false\n"
    )


def group_yaml(name: str, members: list[str]) -> str:
    return (
        "# Written by build.py: do not edit.\n"
        f"group: {name}\n"
        "task:\n" + "".join(f"  - {m}\n" for m in members) + "aggregate_metric_list:\n"
        "  - metric: string_match_all\n"
        "    aggregation: mean\n"
        "    weight_by_size: false\n"
        "metadata:\n"
        "  version: 1.0\n"
    )


def build(
    out: Path,
    count: Callable[[str], int],
    *,
    seed: int = DEFAULT_SEED,
    per_half: int | None = None,
    lengths: tuple[str, ...] = SHORT,
    progress: Callable[[str], None] = lambda text: None,
):
    """Write the suite at ``lengths`` into ``out`` (see the module doc); ``count``: tokens of a text; ``progress``
    hears each file as it is written. Returns the data files."""
    fx = load_fixture()
    words = split_vocabulary(vocabulary(fx), seed)
    out = out.resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    if out != HERE:
        for name in (TEMPLATE, UTILS):
            shutil.copyfile(HERE / name, out / name)
    files = []
    for half in HALVES:
        for length in lengths:
            n = documents_at(length, half, per_half)
            for task in tasks_at(length):
                docs = [document(task, length, half, i, seed, fx, words[half], count) for i in range(n)]
                path = out / "data" / f"{task}_{length}_{half}.jsonl"
                path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
                data = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
                (out / f"{task_name(task, length, half)}.yaml").write_text(
                    task_yaml(task, length, half, data), encoding="utf-8"
                )
                files.append(path)
                progress(f"{path.name}: {n} documents of up to {max(d['tokens'] for d in docs):,} tokens")
            members = [task_name(t, length, half) for t in tasks_at(length)]
            (out / f"batchmax_ruler_{half}_{length}.yaml").write_text(
                group_yaml(f"batchmax_ruler_{half}_{length}", members), encoding="utf-8"
            )
        members = [f"batchmax_ruler_{half}_{length}" for length in lengths]
        # this folder's group of both halves' lengths; another build's names its lengths (two folders load together)
        group = f"batchmax_ruler_{half}" if tuple(lengths) == SHORT else f"batchmax_ruler_{half}_{'_'.join(lengths)}"
        (out / f"{group}.yaml").write_text(group_yaml(group, members), encoding="utf-8")
    return files


def embedded_counter() -> Callable[[str], int]:
    """Tokens of a text under the embedded model's tokenizer, as the model reads it (no chat template)."""
    from transformers import AutoTokenizer

    from batchmax_tp.models import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    return lambda text: len(tok.encode(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    ap.add_argument(
        "--per-half",
        type=int,
        default=None,
        help=f"documents per (task, length, half) (default {DEFAULT_PER_HALF} at 2k and 4k, PER_HALF beyond)",
    )
    ap.add_argument("--out", type=Path, default=HERE, help="task folder to write (default: this folder)")
    ap.add_argument(
        "--lengths", default=",".join(SHORT), help=f"comma list of {', '.join(LENGTHS)} (default {','.join(SHORT)})"
    )
    args = ap.parse_args(argv)
    if args.per_half is not None and args.per_half < 1:
        ap.error("--per-half must be >= 1")
    lengths = tuple(n.strip() for n in args.lengths.split(",") if n.strip())
    bad = [n for n in lengths if n not in LENGTHS] or ([] if lengths else ["(none)"])
    if bad:
        ap.error(f"unknown length {bad[0]!r}: choose from {', '.join(LENGTHS)}")
    if args.out.resolve() == HERE and set(lengths) != set(SHORT):
        ap.error(f"this folder holds {', '.join(SHORT)}: write other lengths with --out DIR")
    files = build(args.out, embedded_counter(), seed=args.seed, per_half=args.per_half, lengths=lengths, progress=print)
    size = sum(f.stat().st_size for f in files)
    print(f"{args.out}: {len(files)} data files, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
