"""The retention benchmark's library (``launch/bench_retention.py`` runs it): what each eviction rule keeps under the
same bounded memory.

``suite`` builds the prompts (needles at depths in filler, summaries, the splits), ``run`` runs one row (FKV, or BM
with a rule at a kv_max) over them, ``score`` scores the outputs into the table, ``report`` writes the files and
``cli`` holds the command line and the run's steps. The names tests and scripts use are gathered here.
"""

from .cli import cli_suite, parse_args
from .report import CSV_COLUMNS, format_csv, format_markdown, plot, write_outputs
from .run import Row, available_rules, make_method, run_row
from .score import TARGETS, needle_hits, passkey_hit, score_rows
from .suite import (
    DEFAULT_LENGTHS,
    DEPTHS,
    FIXTURE_DIR,
    KINDS,
    SPLIT_ABOUT,
    SPLITS,
    TARGET_LENGTH,
    Content,
    Fixture,
    Needle,
    RetentionSample,
    batches,
    build_prompt,
    build_suite,
    load_fixture,
    shared_needles,
    token_counter,
)

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_LENGTHS",
    "DEPTHS",
    "FIXTURE_DIR",
    "KINDS",
    "SPLITS",
    "SPLIT_ABOUT",
    "TARGETS",
    "TARGET_LENGTH",
    "Content",
    "Fixture",
    "Needle",
    "RetentionSample",
    "Row",
    "available_rules",
    "batches",
    "build_prompt",
    "build_suite",
    "cli_suite",
    "format_csv",
    "format_markdown",
    "load_fixture",
    "make_method",
    "needle_hits",
    "parse_args",
    "passkey_hit",
    "plot",
    "run_row",
    "score_rows",
    "shared_needles",
    "token_counter",
    "write_outputs",
]
