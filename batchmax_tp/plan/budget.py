"""Runs under a memory budget per rank: what a run is, and the plans that pick its batch size -- from shapes alone.

- :class:`RunSpec`: one run (a ``Method`` at a batch size) and its folder name;
- :func:`predict_spec`: the planner's peak per rank of a run, with the batch size and the longest prompt of its
  samples (every batch is padded to its longest prompt, so no batch of the run needs more);
- :func:`paper_specs`: the runs of the paper's procedure (section 4.1; ``tuner.paper_plan``): ED (kv_max 2) at
  b0, the smallest batch that does not fit (an OOM row), ED 2 and 65 and FKV at b0 - 1, BM (sized with the rule it
  runs) at each kv_max's largest fitting batch that divides the number of samples; b0 from the planner, or from
  real trials when a ``fits`` callback is given (``batchmax_tp.eval.procedures.ed_trials`` on CUDA);
- :func:`same_memory_plan`: the plain run's comparison (FKV, ED, BM, BM with the best rule, snap), each method at its
  largest batch within one budget (default: what FKV needs at batch 4), bounded only by the number of prompts.

Nothing here imports torch or transformers: planning is arithmetic on ``planner.ModelShape``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..core.method import Method, is_full_cache, min_kv_max, wide_parameters
from .planner import (
    MemoryEstimate,
    ModelShape,
    _largest,
    max_prompt_len,
    max_slots,
    predict,
    predict_pool,
)
from .tuner import find_b0, kv_grid, paper_plan, planned_b0

logger = logging.getLogger(__name__)

__all__ = [
    "RunSpec",
    "SameMemoryRun",
    "STORY_BEST_RULE",
    "STORY_FKV_BATCH",
    "STORY_MAX_PROMPTS",
    "fkv_budget",
    "fmt_bytes",
    "over_budget_message",
    "largest_kv_max",
    "prompts_held",
    "paper_specs",
    "planned_dtype",
    "predict_spec",
    "rule_slug",
    "run_dir_name",
    "same_memory_plan",
    "story_methods",
]


def run_dir_name(method: str, batch_size: int, kv_max: int | None, rule: str = "paper") -> str:
    """Folder of one run: ``fkv-b4``, ``ed-b4-kv2``, ``bm-b32-kv1024``; a rule other than the paper's is named
    after the method: ``bm-snapkv-b32-kv1024``, ``bm-snapkv-window64-b32-kv1024``."""
    if is_full_cache(method.partition("-")[0]):  # the full cache's kv_max holds nothing back
        kv_max = None
    if rule != "paper":
        method = f"{method}-{rule_slug(rule)}"
    return f"{method}-b{batch_size}" if kv_max is None else f"{method}-b{batch_size}-kv{kv_max}"


def rule_slug(rule: str) -> str:
    """A rule spelled for a folder name: ``snapkv:window=64,pool=avg`` -> ``snapkv-window64-poolavg``."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", rule.replace("=", "")).strip("-")


@dataclass(frozen=True)
class RunSpec:
    """One run: ``method`` (which holds kv_max, p and the rule) at ``batch_size`` samples per batch (0: not even
    one sample fits the budget; the run is an OOM row)."""

    method: Method
    batch_size: int
    policy: str | None = None  #: the scheduler this run uses when not the job's (the main job's paper setting)

    @property
    def kv_max(self) -> int | None:
        return self.method.held_kv_max

    @property
    def rule(self) -> str:
        return self.method.rule

    @property
    def name(self) -> str:
        """The run's folder: ``fkv-b4``, ``bm-b32-kv1024``, ``bm-snapkv-b32-kv1024`` (a rule other than the paper's)."""
        name = run_dir_name(self.method.slug(), self.batch_size, self.kv_max, self.rule)
        return name if self.policy is None else f"{self.policy}-{name}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


def planned_dtype(dtype: str) -> str:
    """The dtype a run is planned for: ``launch/run.py`` resolves ``auto`` before planning (the checkpoint's dtype on
    CUDA); a config used directly with ``auto`` plans float32, what ``auto`` means on a CPU."""
    return "float32" if dtype == "auto" else dtype


def predict_spec(
    shape: ModelShape, method: Method, batch_size: int, prompt_len: int, max_new_tokens: int, dtype: str, tp: int = 1
) -> MemoryEstimate:
    """The planner's ``MemoryEstimate`` per rank of a run of ``batch_size`` prompts padded to ``prompt_len``."""
    return predict(shape, method, batch_size, prompt_len, max_new_tokens, tp=tp, dtype=planned_dtype(dtype))


#: The longest prompt the planner looks for (``prompts_held``): past it a method "holds any length".
HELD_LIMIT = 1 << 20


def prompts_held(
    shape: ModelShape, method: Method, budget: int, max_new_tokens: int, *, slots: int = 1, dtype: str, tp: int = 1
) -> str:
    """What ``budget`` holds of ``method``'s prompts at ``slots`` slots, in words (``planner.max_prompt_len``):
    "fkv holds prompts of at most 9,812 tokens in it (1 slot)"; BM: "... of any length ..."."""
    n = max_prompt_len(
        budget, shape, method, max_new_tokens, slots=slots, tp=tp, dtype=planned_dtype(dtype), limit=HELD_LIMIT
    )
    at = f"{slots} slot{'s' if slots != 1 else ''}"
    if n == 0:
        return f"{method.name} holds no prompt in it ({at})"
    if n >= HELD_LIMIT:
        return f"{method.name} holds prompts of any length in it ({at}: its prefill is bounded by kv_max)"
    return f"{method.name} holds prompts of at most {n:,} tokens in it ({at})"


def largest_kv_max(
    shape: ModelShape, budget: int, prompt_len: int, max_new_tokens: int, *, p: int, rule: str, dtype: str, tp: int = 1
) -> int:
    """The largest kv_max (a multiple of ``p``, at most the prompt's length) with which BM under ``rule`` fits one
    slot of a ``prompt_len``-token prompt in ``budget``; 0 when not even the smallest it runs with fits."""
    least = -(-min_kv_max(p, rule) // p)
    fits = lambda k: predict_pool(  # noqa: E731
        shape, Method("bm", kv_max=(least + k - 1) * p, p=p, rule=rule), 1, prompt_len, max_new_tokens, tp=tp,
        dtype=planned_dtype(dtype),
    ).total <= budget  # fmt: skip
    steps = _largest(fits, max(-(-prompt_len // p) - least + 1, 1))
    return 0 if steps == 0 else (least + steps - 1) * p


def over_budget_message(estimate: MemoryEstimate, budget: int, held: str | None = None) -> str:
    """One line: the predicted peak against the budget, and (``held``, :func:`prompts_held`) the longest prompt the
    method fits in it."""
    parts = (
        f"K/V {fmt_bytes(estimate.kv)}, score block {fmt_bytes(estimate.workspace)}, "
        f"weights {fmt_bytes(estimate.weights)}, activations {fmt_bytes(estimate.activations)}"
    )
    return (
        f"predicted peak {fmt_bytes(estimate.total)} per rank ({estimate.total} bytes: {parts}) exceeds "
        f"memory_budget {fmt_bytes(budget)} ({budget} bytes){'' if held is None else f': {held}'}; not run"
    )


# ---------------------------------------------------------------------- the paper's procedure
def paper_specs(
    shape: ModelShape,
    prompt_len: int,
    *,
    budget: int,
    max_new_tokens: int,
    dtype: str,
    p: int,
    rule: str,
    kv_values: Sequence[int] | None,
    num_samples: int,
    tp: int = 1,
    fits: Callable[[int], bool] | None = None,
) -> tuple[list[RunSpec], dict]:
    """The runs of the paper's procedure (``tuner.paper_plan``) and the plan as a dict (``OUT/plan.json``): b0, the
    prompt length, each run's predicted peak and whether it fits. ``rule``: BM's eviction rule, which also sizes BM's
    batches (a rule with a probe fits fewer samples than the paper's in the same memory).

    ``fits``: real trials (on CUDA): b0 is then searched for real from the planner's guess (``b0_source:
    measured``); without it the planner's b0 stands (``b0_source: planner``, as on a CPU)."""
    grid = list(kv_values) if kv_values else kv_grid(prompt_len, 128, p, rule)
    dtype = planned_dtype(dtype)
    guess = planned_b0(budget, shape, prompt_len, max_new_tokens, dtype=dtype, tp=tp, p=p)
    measured = find_b0(guess, fits) if fits is not None else None
    plan = paper_plan(
        budget,
        shape,
        prompt_len,
        max_new_tokens,
        dtype=dtype,
        tp=tp,
        p=p,
        num_samples=num_samples,
        kv_values=grid,
        b0=measured,
        rule=rule,
    )
    specs = [RunSpec(m, b) for m, b in plan]
    runs = [_plan_row(spec, shape, prompt_len, max_new_tokens, budget, tp=tp, dtype=dtype) for spec in specs]
    info = _paper_info(specs, runs, grid, guess, measured, budget, prompt_len, max_new_tokens, num_samples, tp)
    _log_paper_plan(specs, info)
    return specs, info


def _paper_info(
    specs: list[RunSpec],
    runs: list[dict],
    grid: list[int],
    guess: int,
    measured: int | None,
    budget: int,
    prompt_len: int,
    max_new_tokens: int,
    num_samples: int,
    tp: int,
) -> dict:
    """The paper procedure's plan as ``plan.json`` holds it: the budget and shapes, b0 and where it came from (the
    planner's ``guess`` or the ``measured`` trials), the kv_max grid and which of it has no fitting batch, the runs."""
    b0 = specs[0].batch_size
    planned = {s.kv_max for s in specs if s.method.takes_rule}  # BM's runs: the kv_max grid, sized with its rule
    return {
        "procedure": "paper",
        "memory_budget_bytes": budget,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "num_samples": num_samples,
        "tp_size": tp,
        "b0": b0,
        "b0_source": "planner" if measured is None else "measured",
        "b0_planned": guess,
        "b0_note": _b0_note(b0, guess, measured),
        "adjusted": _fkv_adjusted(specs),
        "kv_values": grid,
        "kv_values_without_a_fitting_batch": [k for k in grid if k not in planned],
        "runs": runs,
    }


def _b0_note(b0: int, guess: int, measured: int | None) -> str:
    """Where the plan's b0 came from, in words (``plan.json``'s ``b0_note``)."""
    if measured is None:
        return f"b0 = {b0} from the planner's prediction (no real out-of-memory search on this device)"
    return f"b0 = {b0} found by real ED trials on the device (the planner predicted {guess}; trials in b0-trials/)"


def _fkv_adjusted(specs: list[RunSpec]) -> str | None:
    """The note (also logged) when FKV runs below b0 - 1 because b0 - 1 is predicted over the budget; else None."""
    b0, adjusted = specs[0].batch_size, None
    for spec in specs:
        if is_full_cache(spec.method) and spec.batch_size < b0 - 1:
            adjusted = (
                f"FKV at b0 - 1 = {b0 - 1} is predicted over the budget; it runs at b = {spec.batch_size}, "
                f"the largest batch that fits (only its metric is used)"
            )
            logger.warning("paper procedure: %s", adjusted)
    return adjusted


def _plan_row(
    spec: RunSpec, shape: ModelShape, prompt_len: int, max_new_tokens: int, budget: int, *, tp: int, dtype: str
) -> dict:
    """One run of ``plan.json``: its folder, method, batch, predicted peak per rank and whether that fits."""
    est = predict(shape, spec.method, spec.batch_size, prompt_len, max_new_tokens, tp=tp, dtype=dtype)
    return {
        "run": spec.name,
        "method": spec.method.name,
        "rule": spec.method.rule,
        "batch_size": spec.batch_size,
        "kv_max": spec.kv_max,
        "predicted_peak_bytes": est.total,
        "fits": est.total <= budget,
    }


def _log_paper_plan(specs: list[RunSpec], info: dict) -> None:
    """Log the plan's runs, and warn of kv_max values with no fitting batch and of batches past the samples."""
    num_samples = info["num_samples"]
    logger.info(
        "paper procedure: budget %s, longest prompt %d tokens, b0 = %d (ED kv_max 2 does not fit); runs: %s",
        fmt_bytes(info["memory_budget_bytes"]),
        info["prompt_len"],
        info["b0"],
        ", ".join(s.name for s in specs),
    )
    if info["kv_values_without_a_fitting_batch"]:
        logger.warning(
            "paper procedure: no batch dividing %d fits BM with kv_max %s",
            num_samples,
            info["kv_values_without_a_fitting_batch"],
        )
    big = [s.name for s in specs[1:] if s.batch_size > num_samples]
    if big:
        logger.warning(
            "paper procedure: %s ask for more than the %d samples; their batches hold %d", big, num_samples, num_samples
        )


# ---------------------------------------------------------------------- the plain run: same memory, larger batch
#: The rule the plain run shows beside the paper's: the best of ``launch/bench_retention.py`` (README: Retention).
#: Budgets shared by heads (``question:share=0``) were worse on the tuning half at kv_max 512 (docs/retention.md).
STORY_BEST_RULE = "question"
#: Most prompts the plain run fills its samples up to (CPU time): the largest fitting batch among its methods sets
#: the prompt count, up to this; a larger fit is reported (``largest_fitting``) and logged.
STORY_MAX_PROMPTS = 64
#: FKV's batch whose predicted peak sets the default memory budget of the plain run.
STORY_FKV_BATCH = 4


def fkv_budget(
    shape: ModelShape,
    prompt_len: int,
    max_new_tokens: int,
    *,
    batch: int = STORY_FKV_BATCH,
    tp: int = 1,
    dtype: str = "float32",
) -> int:
    """The comparison's memory budget when none is given (the main job, ``run_prompts``, the benchmarks, the
    RULER-style suite): the planner's peak per rank of FKV in ``batch`` slots for requests of ``prompt_len`` +
    ``max_new_tokens`` tokens, so FKV fits exactly that many and every other method is sized into the same bytes."""
    return predict_pool(shape, Method("fkv"), batch, prompt_len, max_new_tokens, tp=tp, dtype=dtype).total


#: The main job's lineup, in order: FKV, ED, the paper's BM, BM with the best rule (``None``: the job's) and snap
#: (SnapKV's compression once after an unchunked prefill: the peer users run instead).
STORY_LINEUP: tuple[tuple[str, str | None], ...] = (
    ("fkv", "paper"),
    ("ed", "paper"),
    ("bm", "paper"),
    ("bm", None),
    ("snap", "paper"),
)


def story_methods(kv_max: Callable[[str], int | None], p: int, rule: str = "paper", bm_chunk: int = 0) -> list[Method]:
    """The main job's lineup (:data:`STORY_LINEUP`), each method with ``kv_max(name)`` and ``p``; the best rule is
    ``rule``, or :data:`STORY_BEST_RULE` when ``rule`` is the paper's; ``bm_chunk``: BM's wide passes (``chunk``)."""
    best = rule if rule != "paper" else STORY_BEST_RULE
    return [
        Method(name, kv_max=kv_max(name), p=p, rule=own or best, **wide_parameters(name, bm_chunk))
        for name, own in STORY_LINEUP
    ]


def paper_setting_specs(
    shape: ModelShape,
    prompt_len: int,
    max_new_tokens: int,
    budget_bytes: int,
    bm: RunSpec,
    *,
    p: int,
    tp: int = 1,
    dtype: str = "float32",
) -> list[RunSpec]:
    """The paper's setting in the same budget, as static padded batches: ED (kv_max 2) and FKV in fixed slots at
    b0 - 1 (b0: the smallest batch at which the paper's ED, its prompts held through prefill, does not fit; FKV at its
    own largest batch when b0 - 1 does not fit it) and the paper's BM at its continuous run's batch (``bm``). None
    when b0 is 1 (the paper's ED does not fit even one sample)."""
    dtype = planned_dtype(dtype)
    b0 = planned_b0(budget_bytes, shape, prompt_len, max_new_tokens, dtype=dtype, tp=tp, p=p)
    if b0 <= 1:
        return []
    fkv = Method("fkv", p=p, block=0, chunk=0)  # the paper's: a fixed slot per sample, its prompt in one pass
    b_fkv = min(b0 - 1, max_slots(budget_bytes, shape, fkv, prompt_len, max_new_tokens, tp=tp, dtype=dtype))
    runs = [(Method("ed", kv_max=2, p=p), b0 - 1), (fkv, b_fkv), (bm.method, bm.batch_size)]
    return [RunSpec(m, b, policy="static") for m, b in runs if b > 0]


@dataclass(frozen=True)
class SameMemoryRun:
    """One method of the same-memory run: the batch it runs at and the planner's numbers behind it."""

    spec: RunSpec  #: the method at min(largest fitting batch, prompts); batch 0 when not even one sample fits
    largest_fitting: int  #: the planner's largest batch within the budget
    predicted_peak_bytes: int  #: the planner's peak per rank at ``spec.batch_size`` (at 1 when that is 0)


def _leanest(
    shape: ModelShape, method: Method, fit: int, budget: int, prompt_len: int, new: int, tp: int, dtype: str
) -> tuple[Method, int]:
    """(method, its slots in ``budget``): snap prefilling in chunks as it is, or in one pass (``chunk=0``) where that
    fits more slots: for prompts within about a chunk its chunks hold every layer's full pairs of the prompt it
    prefills, its one pass one layer's at a time and the prompt's activations (docs/performance.md, "Chunked
    prefill"). Ties keep the chunks. (FKV keeps its chunks: the budget is its own, and its chunks batch several
    requests' prompts in a pass.)"""
    if not method.transient_blocks or not method.chunk:
        return method, fit
    one = replace(method, chunk=0)
    fit_one = max_slots(budget, shape, one, prompt_len, new, tp=tp, dtype=dtype)
    if fit_one <= fit:
        return method, fit
    logger.info("same-memory run: %s fits %d slots in one pass, %d in chunks: one pass", method.label(), fit_one, fit)
    return one, fit_one


def same_memory_plan(
    shape: ModelShape,
    methods: Sequence[Method],
    prompt_len: int,
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    budget_bytes: int | None = None,
    fkv_batch: int = STORY_FKV_BATCH,
    max_prompts: int = STORY_MAX_PROMPTS,
    tp: int = 1,
    dtype: str = "float32",
) -> tuple[int, list[SameMemoryRun]]:
    """(budget, runs): every method at its largest batch whose predicted peak per rank fits one memory budget.

    ``budget_bytes`` None = the planner's peak of FKV at ``fkv_batch`` for prompts of ``prompt_len`` tokens (so
    FKV runs at exactly that batch). The prompts every method answers: the ``num_samples`` samples, repeated up to
    the largest fitting batch among the methods whose slots hold their prompts (FKV, BM: so the one that fits most
    runs one full batch; ED's slots never do) but not past
    ``max_prompts``; each method's batch is min(its largest fitting batch, the prompts), so the largest batch of
    the plan is the number of prompts to fill the samples up to. A method that does not fit even one sample gets
    batch 0 (reported as OOM, not run). A batch is a slot count either way (``planner.max_slots``: the pool for
    requests of up to ``prompt_len`` tokens; a padded batch of b prompts runs in b slots), so both schedulers answer
    the same prompts in the same sizes.
    """
    dtype = planned_dtype(dtype)
    if budget_bytes is None:
        budget_bytes = fkv_budget(shape, prompt_len, max_new_tokens, batch=fkv_batch, tp=tp, dtype=dtype)
    # One pool either way: a padded batch of b prompts runs in b slots (planner.predict is predict_pool).
    fits = [max_slots(budget_bytes, shape, m, prompt_len, max_new_tokens, tp=tp, dtype=dtype) for m in methods]
    args = (budget_bytes, prompt_len, max_new_tokens, tp, dtype)
    leanest = [_leanest(shape, m, f, *args) for m, f in zip(methods, fits)]
    methods, fits = [m for m, _ in leanest], [f for _, f in leanest]
    # The prompts fill the largest batch of a method whose slots hold their prompts: ED's never do, and fit hundreds,
    # which would make every method answer up to ``max_prompts`` prompts.
    holding = [f for m, f in zip(methods, fits) if not m.keeps_newest]
    largest = max(holding or fits, default=0)
    prompts = max(num_samples, min(largest, max_prompts))
    if largest > prompts:
        logger.info(
            "same-memory run: the largest fitting batch is %d; the run answers %d prompts (at most %d, "
            "max_prompts), so no batch is larger",
            largest,
            prompts,
            max_prompts,
        )
    runs = []
    for method, fit in zip(methods, fits):
        batch = min(fit, prompts)
        peak = predict_pool(shape, method, max(batch, 1), prompt_len, max_new_tokens, tp=tp, dtype=dtype).total
        runs.append(SameMemoryRun(RunSpec(method, batch), fit, peak))
    return budget_bytes, runs
