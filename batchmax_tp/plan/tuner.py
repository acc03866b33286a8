"""Choosing (b, kv_max): the paper's procedure as a plan, and an auto-tuner that needs few trials.

Both work on any ``evaluate(method, batch) -> Trial`` callable (a real run, or a toy model in tests) and use the
planner to skip what cannot fit the memory budget.

The tuner rests on two observations the paper's tables bear out: at a fixed ``kv_max`` throughput grows with the
batch, so the largest batch that fits is the one to time; and the task metric depends on ``kv_max`` (how much
context survives) but not on the batch size. So it (1) measures FKV's metric once, (2) bisects the ``kv_max``
grid for the smallest value whose metric reaches ``target x FKV`` (metric is taken as non-decreasing in
``kv_max``; each probe runs at that kv_max's largest fitting batch, so its throughput is measured too), and (3)
times a few neighbours above it, since a slightly larger ``kv_max`` can fit the same batch and a smaller one
is below target. Trials are cached: no (method, batch) runs twice.

Every BM batch is sized with the eviction rule the run will use (``rule``): a rule with a look-ahead probe needs
more memory than the paper's at the same batch (``planner.predict``), so a batch sized for the paper's rule can
overflow the budget under another. With ``cheaper`` the rule's cheaper settings (``core.rules.rule_candidates``:
``question`` probing every 8th block, or with 16 probe tokens) are tuned as candidates of their own, beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ..core.method import Method, ed_settings, is_full_cache, make_method, min_kv_max, takes_rule
from ..core.rules import rule_candidates
from .planner import ModelShape, _largest, max_batch, paper_ed_bytes

logger = logging.getLogger(__name__)

PAPER_BATCHES = (
    1,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    12,
    15,
    16,
    20,
    24,
    30,
    32,
    40,
    48,
    60,
    64,
    80,
    96,
    120,
    160,
    192,
    240,
    320,
    480,
    960,
)  # divisors of 960, the paper's sample count


@dataclass
class Trial:
    method: str
    kv_max: int | None
    batch: int
    tokens_per_s: float | None  # None: out of memory
    metric: float | None
    rule: str | None = None  #: the eviction rule's spec, for a method that takes one (BM)

    @property
    def oom(self) -> bool:
        return self.tokens_per_s is None


@dataclass
class TuneResult:
    best: Trial | None
    fkv: Trial
    target_metric: float
    trials: list[Trial] = field(default_factory=list)
    why: str = ""  #: one line: why ``best`` won (or why nothing did)

    def as_dict(self) -> dict:
        return {
            "best": None if self.best is None else asdict(self.best),
            "fkv": asdict(self.fkv),
            "target_metric": self.target_metric,
            "trials": [asdict(t) for t in self.trials],
            "why": self.why,
        }


def kv_grid(prompt_len: int, step: int = 128, p: int = 64, rule: str = "paper") -> list[int]:
    """Multiples of ``step`` that BM with ``p`` and ``rule`` can run with (``core.method.min_kv_max``) and below the
    prompt length (beyond it BM never evicts in prefill)."""
    return [k for k in range(step, prompt_len + step, step) if k >= min_kv_max(p, rule)]


def divisor_batches(num_samples: int, limit: int) -> list[int]:
    """Batch sizes that divide ``num_samples`` (so every batch size sees the same samples), up to ``limit``."""
    return [b for b in range(1, min(limit, num_samples) + 1) if num_samples % b == 0]


def largest_batch(
    budget: int,
    shape: ModelShape,
    method: Method,
    prompt_len: int,
    new: int,
    *,
    dtype: str,
    tp: int = 1,
    batches: list[int] | None = None,
) -> int:
    """Largest fitting batch, restricted to ``batches`` when given (0 when nothing fits)."""
    b = max_batch(budget, shape, method, prompt_len, new, tp=tp, dtype=dtype)
    if batches is not None:
        b = max((x for x in batches if x <= b), default=0)
    return b


def planned_b0(
    budget: int, shape: ModelShape, prompt_len: int, new: int, *, dtype: str, tp: int = 1, p: int = 64
) -> int:
    """The planner's b0: the smallest batch at which the paper's ED (kv_max 2, its prompts cached through prefill:
    ``planner.paper_ed_bytes``) does not fit ``budget``."""
    return _largest(lambda b: paper_ed_bytes(shape, b, prompt_len, new, tp=tp, dtype=dtype, p=p) <= budget, 1 << 16) + 1


def find_b0(start: int, fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The smallest batch for which ``fits`` (a real trial) is False, searched from the planner's guess ``start``:
    up by doubling while trials fit, down by halving while they do not, then bisection. Assumes that a batch that
    fits means every smaller one fits. Trials: about 2 log2 of the distance from ``start``."""
    start = max(1, min(start, limit))
    if fits(start):
        lo, hi = start, min(2 * start, limit + 1)
        while hi <= limit and fits(hi):
            lo, hi = hi, min(2 * hi, limit + 1)
    else:
        lo, hi = start // 2, start
        while lo >= 1 and not fits(lo):
            lo, hi = lo // 2, lo
        if lo < 1:
            return 1
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return hi


def paper_plan(
    budget: int,
    shape: ModelShape,
    prompt_len: int,
    new: int,
    *,
    dtype: str,
    tp: int = 1,
    p: int = 64,
    num_samples: int = 960,
    kv_values: list[int] | None = None,
    b0: int | None = None,
    rule: str = "paper",
) -> list[tuple[Method, int]]:
    """The runs of the paper's procedure: ED (kv_max 2) at b0 (the smallest batch that does not fit: an OOM row),
    ED (2 and 65) and FKV at b0 - 1, then BM with ``rule`` at each kv_max's largest fitting divisor batch (sized
    with that rule). ``b0``: measured by real trials (:func:`find_b0`, on CUDA); None = the planner's
    (:func:`planned_b0`)."""
    ed2, ed65 = ed_settings(p)
    if b0 is None:
        b0 = planned_b0(budget, shape, prompt_len, new, dtype=dtype, tp=tp, p=p)
    runs = [(ed2, b0)]
    if b0 > 1:
        # FKV also keeps the generated tokens' pairs, so b0 - 1 may not fit it: then it runs at its own largest
        # batch (only its metric is compared, and that does not depend on b).
        fkv = Method("fkv", p=p, block=0, chunk=0)  # the paper's: a fixed slot per sample, its prompt in one pass
        b_fkv = min(b0 - 1, max_batch(budget, shape, fkv, prompt_len, new, tp=tp, dtype=dtype)) or b0 - 1
        runs += [(ed2, b0 - 1), (ed65, b0 - 1), (fkv, b_fkv)]
    batches = divisor_batches(num_samples, 1 << 16)
    for k in kv_values or kv_grid(prompt_len, 128, p, rule):
        bm = Method("bm", kv_max=k, p=p, rule=rule)
        b = largest_batch(budget, shape, bm, prompt_len, new, dtype=dtype, tp=tp, batches=batches)
        if b:
            runs.append((bm, b))
    return runs


def tune(
    evaluate: Callable[[Method, int], Trial],
    budget: int,
    shape: ModelShape,
    prompt_len: int,
    new: int,
    *,
    target: float = 0.95,
    dtype: str = "float32",
    tp: int = 1,
    p: int = 64,
    kv_values: list[int] | None = None,
    batches: list[int] | None = None,
    neighbours: int = 2,
    rule: str = "paper",
    methods: Sequence[str] = ("bm",),
    cheaper: bool = False,
) -> TuneResult:
    """Highest-throughput run whose metric is at least ``target`` x FKV's, under ``budget``, among ``methods``
    (specs, ``core.method.make_method``: ``bm`` with ``rule``, ``snap[:window=..]``, ``fkv`` itself; default BM
    alone). Each method that takes a kv_max is tuned as BM is (its batches sized with it; ``evaluate`` gets it);
    a method that takes a rule is tuned once with ``rule`` and, with ``cheaper``, once more with each of the rule's
    cheaper settings (``rule_candidates``). FKV runs once, as the reference, at its largest batch.
    ``TuneResult.why`` says in one line why the pick won."""
    run = _Trials(evaluate)
    fkv_b = largest_batch(budget, shape, Method("fkv", p=p), prompt_len, new, dtype=dtype, tp=tp, batches=batches)
    if fkv_b == 0:
        raise ValueError("the budget does not fit FKV at batch 1: the target metric cannot be measured")
    fkv = run(Method("fkv", p=p), fkv_b)
    goal = target * fkv.metric
    if not fkv.metric:
        logger.warning("FKV's metric is %s: every BM configuration meets the target; the fastest one wins", fkv.metric)

    rules = rule_candidates(rule) if cheaper else [rule]
    candidates = [(spec, r) for spec in methods for r in (rules if takes_rule(spec) else [None])]
    picks: list[Trial] = []  # each candidate's fastest run that meets the goal
    for spec, spec_rule in candidates:
        if is_full_cache(spec):
            picks.append(fkv)
            continue
        extra = {} if spec_rule is None else {"rule": spec_rule}
        make = lambda k, spec=spec, extra=extra: make_method(spec, kv_max=k, p=p, **extra)  # noqa: E731
        grid = [k for k in (kv_values or kv_grid(prompt_len, 128, p, spec_rule or rule)) if _runs_with(make, k)]
        fitting = _fitting(budget, shape, prompt_len, new, [make(k) for k in grid], dtype=dtype, tp=tp, batches=batches)
        if not fitting:
            continue

        def probe(i: int, fitting=fitting) -> Trial:
            return run(*fitting[i])

        lo = _first_meeting(probe, len(fitting), goal)
        tried = [probe(i) for i in range(lo, min(lo + 1 + neighbours, len(fitting)))]
        best = max((t for t in tried if _meets(t, goal)), key=lambda t: t.tokens_per_s, default=None)
        if best is not None:
            picks.append(best)
    best = max(picks, key=lambda t: t.tokens_per_s, default=None)
    return TuneResult(best, fkv, goal, run.trials, _why(best, picks, goal, target))


def _runs_with(make: Callable[[int], Method], kv_max: int) -> bool:
    try:
        make(kv_max)
    except ValueError:
        return False
    return True


def trial_name(trial: Trial) -> str:
    """A trial's method in one word: its name, its rule where it has one other than the paper's, and its kv_max
    where it evicts (``bm rule=question:every=8 kv_max=512``)."""
    rule = "" if trial.rule in (None, "paper") else f" rule={trial.rule}"
    kv = "" if trial.kv_max is None or is_full_cache(trial.method) else f" kv_max={trial.kv_max}"
    return f"{trial.method}{rule}{kv}"


def _why(best: Trial | None, picks: list[Trial], goal: float, target: float) -> str:
    """One line: the pick, its tokens/s and metric against the goal, and each other candidate's best that met it."""
    if best is None:
        return f"no configuration that fits the budget reaches {target} x FKV's metric ({goal:.3f})"
    others = ", ".join(f"{trial_name(t)} b={t.batch} {t.tokens_per_s:.1f}" for t in picks if t is not best)
    return (
        f"{trial_name(best)} b={best.batch}: {best.tokens_per_s:.1f} tokens/s at metric {best.metric:.3f} >= "
        f"{goal:.3f} ({target} x FKV's), the fastest of the methods that reach it"
        + (f" (the others' best: {others} tokens/s)" if others else "")
    )


class _Trials:
    """``evaluate`` with each (method, kv_max, batch) run once and logged; ``trials``: those run, in order."""

    def __init__(self, evaluate: Callable[[Method, int], Trial]):
        self.evaluate = evaluate
        self.done: dict[tuple, Trial] = {}

    def __call__(self, method: Method, batch: int) -> Trial:
        key = (method.name, method.kv_max, method.rule, batch)
        if key not in self.done:
            self.done[key] = self.evaluate(method, batch)
            logger.info("trial %s b=%d -> %s", method.label(), batch, self.done[key])
        return self.done[key]

    @property
    def trials(self) -> list[Trial]:
        return list(self.done.values())


def _fitting(
    budget: int,
    shape: ModelShape,
    prompt_len: int,
    new: int,
    methods: list[Method],
    *,
    dtype: str,
    tp: int,
    batches: list[int] | None,
) -> list[tuple[Method, int]]:
    """(method, largest fitting batch) of each of ``methods`` (one per kv_max, each sized with its own rule) that fits
    a batch, in order."""
    fitting = []
    for method in methods:
        b = largest_batch(budget, shape, method, prompt_len, new, dtype=dtype, tp=tp, batches=batches)
        if b:
            fitting.append((method, b))
    return fitting


def _meets(trial: Trial, goal: float) -> bool:
    """Whether a trial ran (no OOM) and its metric reaches ``goal``."""
    return not trial.oom and trial.metric is not None and trial.metric >= goal


def _first_meeting(probe: Callable[[int], Trial], n: int, goal: float) -> int:
    """The first index in [0, n] whose trial meets ``goal`` (n: none), by bisection: the metric is taken as
    non-decreasing in kv_max, so only about log2(n) indices are probed."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if _meets(probe(mid), goal):
            hi = mid
        else:
            lo = mid + 1
    return lo
