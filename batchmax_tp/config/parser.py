"""The command line: :func:`build_parser` makes every setting's flag from the parts' metadata; :func:`parse_args`
layers defaults -> ``--config`` YAML -> flags into a validated :class:`~.run.RunConfig`."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..core.method import METHODS
from ..core.rules import get_rule, rule_names
from .run import LISTING_KEYS, PARTS, SETTINGS, RunConfig, _normalise_mapping, load_yaml
from .settings import LIST, ConfigError, Setting

_ARGUMENT_RE = re.compile(r"^argument (\S+?)(?:/\S+)*: (.*)$", re.S)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting: the key is the setting the flag sets
    (``argument --batch-size: ...`` -> ``batch_size: --batch-size: ...``)."""

    def error(self, message: str):  # type: ignore[override]
        match = _ARGUMENT_RE.match(message)
        if match is None:
            raise ConfigError("", message)
        flag, problem = match.groups()
        action = self._option_string_actions.get(flag)
        raise ConfigError(action.dest if action is not None else flag, f"{flag}: {problem}")

    def unknown(self, extra: Sequence[str]) -> ConfigError:
        """The error for the arguments no flag takes: the first unknown flag with the closest known one, or a
        stray value."""
        flags = [arg for arg in extra if arg.startswith("-") and arg != "-"]
        if not flags:
            return ConfigError(extra[0], "unexpected argument: every value follows its flag (--help lists them)")
        name = flags[0].split("=", 1)[0]
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        if name in known:  # after "--", which ends the flags
            return ConfigError(name, "a flag after '--' (which ends the flags): drop the '--'")
        dashed = "--" + name.lstrip("-").replace("_", "-")
        close = [dashed] if dashed in known else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"{self.prog} --help lists them"
        return ConfigError(name, f"unknown flag; {hint}")


class _ListRules(argparse.Action):
    """``--list-rules``: print each rule's name and its parameters with their defaults (one rule per line, the
    name first) and exit 0, like ``--help``."""

    def __call__(self, parser, namespace, values, option_string=None):
        lines = [f"{name:<9} {get_rule(name).parameters()}" for name in rule_names()]
        parser._print_message("\n".join(lines) + "\n", sys.stdout)
        parser.exit(0)


class _ListMethods(argparse.Action):
    """``--list-methods``: print each method's name and its own parameters with their defaults (set as
    ``--method NAME:key=value,...``; one method per line, the name first) and exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        lines = []
        for name, cls in METHODS.items():
            own = " ".join(f"{k}={v}" for k, v in cls.own_parameters().items())
            rule = " (--rule NAME: its eviction rule)" if cls.takes_rule else ""
            lines.append(f"{name:<5} {own or '-'}{rule}")
        parser._print_message("\n".join(lines) + "\n", sys.stdout)
        parser.exit(0)


def _flag(key: str, s: Setting) -> str:
    return s.flag if s.flag is not None else "--" + key.replace("_", "-")


def _add_setting(group: argparse._ArgumentGroup, key: str, s: Setting) -> None:
    """One setting's flag (``--x`` and ``--no-x`` for a boolean), from its metadata."""
    flag = _flag(key, s)
    text = s.help + (" [lists the runs: leaves the main job]" if s.lists else "")
    if s.kind.types == (bool,):
        pair = group.add_mutually_exclusive_group()
        pair.add_argument(flag, dest=key, action="store_true", help=text)
        pair.add_argument("--no-" + flag[2:], dest=key, action="store_false", help=s.off)
    elif s.kind is LIST:  # --method: repeated or comma-separated
        group.add_argument(flag, dest=key, action="append", metavar=s.metavar, help=text)
    else:
        group.add_argument(flag, dest=key, type=s.kind.parse, metavar=s.metavar, help=text)


def _main_job_help() -> str:
    flags = ", ".join(_flag(key, SETTINGS[key]) for key in LISTING_KEYS if SETTINGS[key].flag != "")
    keys = ", ".join(["method", *LISTING_KEYS])
    return (
        "The main job (FKV, ED, BM, BM with the best rule and snap, each at its largest batch within FKV's memory at "
        f"batch 4) runs unless the configuration lists its runs: {flags} (YAML: {keys}) leave it, as does "
        "--no-same-memory; --same-memory forces it. Every other flag keeps it."
    )


def build_parser(prog: str = "run.py") -> argparse.ArgumentParser:
    """The flags of every setting (from the parts' metadata), ``--config`` and ``--list-rules``. Only flags
    actually given are in the parsed namespace: they override the YAML and the defaults."""
    parser = _Parser(
        prog=prog,
        description="Batched generation with Batch-Max (bm), extreme decoding-only (ed) or full-cache (fkv) "
        "KV caches. Settings layer: built-in defaults -> --config YAML -> these flags.",
        epilog=_main_job_help(),
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file with any of the keys below (underscores)")
    parser.add_argument("--list-rules", nargs=0, action=_ListRules, help="print the eviction rule names and exit")
    parser.add_argument(
        "--list-methods", nargs=0, action=_ListMethods, help="print the methods and their own parameters, and exit"
    )
    for _, part in PARTS:
        group = parser.add_argument_group(part.title)
        for _, s, key in part.settings():
            if s.flag != "":
                _add_setting(group, key, s)
    # Passed by the deepspeed / torch.distributed launchers; accepted and ignored (LOCAL_RANK env is used).
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None, prog: str = "run.py") -> RunConfig:
    """defaults -> ``--config`` YAML -> CLI flags, validated. Raises :class:`ConfigError` (one line)."""
    parser = build_parser(prog)
    namespace, extra = parser.parse_known_args(argv)
    if extra:
        raise parser.unknown(extra)
    args = vars(namespace)
    args.pop("local_rank", None)
    config_path = args.pop("config", None)
    merged: dict[str, Any] = {}
    if config_path is not None:
        merged.update(_normalise_mapping(load_yaml(config_path), str(config_path)))
    if "methods" in args:
        methods = [m.strip() for item in args["methods"] for m in item.split(",") if m.strip()]
        if not methods:
            raise ConfigError("method", "--method needs a method name (bm, ed or fkv)")
        args["methods"] = methods
    merged.update(args)
    return RunConfig(**merged)
