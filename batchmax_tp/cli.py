"""The command line: ``launch/run.py``, ``launch/sweep.py`` and ``launch/tune.py`` are this one entry point.

A configuration error is one ``error: <key>: <problem>`` line on stderr and exit status 2, before torch or a
model loads: the configuration layer imports nothing heavy, and the job (``batchmax_tp.job``: torch,
transformers, the model) is imported only once the configuration is valid -- the one deferred import of the
package (tests/test_imports.py allows it here and nowhere else). The flags' own errors name the key too
(``batch_size: --batch-size: expected an integer, got 'four'``) and an unknown flag gets the closest known one; what
needs the model's configuration (its context length), the file system (the ``--out`` folder) or the hub is checked
at the job's set-up, still before any weight loads, and ends the same way (tests/test_validation.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .config import ConfigError, parse_args

__all__ = ["main", "procedure_argv"]


def procedure_argv(argv: Sequence[str], procedure: str) -> list[str]:
    """run.py's arguments for a procedure entry point: ``--kv-max LIST`` becomes ``--kv-values LIST``, then
    ``--procedure <procedure>``."""
    out = []
    for arg in argv:
        if arg == "--kv-max":
            out.append("--kv-values")
        elif arg.startswith("--kv-max="):
            out.append("--kv-values=" + arg.split("=", 1)[1])
        else:
            out.append(arg)
    return [*out, "--procedure", procedure]


def main(argv: Sequence[str] | None = None, *, procedure: str | None = None) -> int:
    """Parse and validate (defaults -> ``--config`` YAML -> flags), then run the job. ``argv`` None: the process's
    arguments; ``procedure``: ``paper`` or ``tune`` (``--kv-max`` lists the kv_max values to try). Which job runs
    is the configuration's (``RunConfig.main_job``), never the number of arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if procedure is not None:
        args = procedure_argv(args, procedure)
    try:
        cfg = parse_args(args, prog={None: "run.py", "paper": "sweep.py", "tune": "tune.py"}[procedure])
    except ConfigError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as done:  # --help, --list-rules, --list-methods
        return int(done.code or 0)
    from .job import run  # deferred: torch and transformers load only for a valid configuration

    return run(cfg)
