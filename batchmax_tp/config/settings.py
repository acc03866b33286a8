"""The configuration's building blocks: :class:`ConfigError`, the kinds of values (:class:`Kind`: a YAML value's
type and how its flag's text is read), each field's metadata (:class:`Setting`, :func:`setting`) and :class:`Part`,
the base of every part (``parts``, ``sweep``, ``memory``) that checks itself from that metadata."""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

#: Upper bounds of settings that have no natural one without the model: far above any real use, low enough that no
#: count overflows a tensor index or a timer. What the model bounds (its context) is checked once its configuration is
#: read, still before any weight loads (``job._prepare``).
MAX_TOKENS = 2**24  # token counts: kv_max, p, max_new_tokens, max_input_tokens, prefill_budget, kv_values
MAX_COUNT = 2**31 - 1  # sample counts, top_k
MAX_BATCH = 2**16  # batch_size
MAX_RANKS = 2**16  # tp_size, dp_size
MAX_SEED = 2**32 - 1  # numpy's and torch's common seed range
MAX_TIMEOUT_S = 7 * 24 * 3600  # setup_timeout: a week


class ConfigError(ValueError):
    """A one-line, user-facing configuration error naming the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        message = " ".join(str(message).split())  # always one line
        super().__init__(f"{key}: {message}" if key else message)


# ---------------------------------------------------------------------- kinds of values
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _int_or_null(text: str) -> int | None:
    if text.lower() in ("null", "none", "default", "all"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or null, got {text!r}") from None


def _null_or_text(text: str) -> str | None:
    return None if text.lower() in ("null", "none") else text


def _int_or_text(text: str) -> int | str | None:
    """``--memory-budget``: null, a plain integer (bytes) or a size with a unit (checked by MemoryConfig)."""
    if text.lower() in ("null", "none"):
        return None
    return int(text) if text.strip().isdigit() else text


def _int_list(text: str) -> list[int] | None:
    if text.lower() in ("null", "none", "default"):
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 896,1024, got {text!r}") from None


@dataclass(frozen=True)
class Kind:
    """A setting's type: what a YAML value must be (:meth:`check`) and how its flag's text is read (``parse``;
    None: the text itself). ``float`` settings take ints too and only finite values (no .nan, no .inf); a bool is
    never an int here."""

    what: str
    types: tuple[type, ...]
    nullable: bool = False
    parse: Callable[[str], Any] | None = None

    def describe(self) -> str:
        return f"{self.what} or null" if self.nullable else self.what

    def check(self, key: str, value: Any) -> None:
        if value is None:
            if not self.nullable:
                raise ConfigError(key, f"must be {self.describe()}, got null")
            return
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            raise ConfigError(key, f"must be {self.describe()}, got {type(value).__name__} {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
        if isinstance(value, str) and "\x00" in value:  # no path, name or size holds one (os calls refuse it)
            raise ConfigError(key, f"must not contain a NUL character, got {value!r}")


TEXT = Kind("a string", (str,))
OPTIONAL_TEXT = Kind("a string", (str,), nullable=True)
NULL_OR_TEXT = Kind("a string", (str,), nullable=True, parse=_null_or_text)
INT = Kind("an integer", (int,), parse=_int)
OPTIONAL_INT = Kind("an integer", (int,), nullable=True, parse=_int_or_null)
NUMBER = Kind("a number", (int, float), parse=_number)
FLAG = Kind("a boolean (true/false)", (bool,))
OPTIONAL_FLAG = Kind("a boolean (true/false)", (bool,), nullable=True)
BYTES = Kind("a byte size (e.g. 24GiB, 512MiB or 1000000)", (str, int), nullable=True, parse=_int_or_text)
INT_LIST = Kind("a list", (list,), nullable=True, parse=_int_list)
LIST = Kind("a list", (list,))
OPTIONAL_LIST = Kind("a list", (list,), nullable=True)


@dataclass(frozen=True)
class Setting:
    """A field's metadata: its YAML key (default the field's name), kind, help and limits. ``flag``: the CLI flag
    (default ``--key-with-dashes``; "" = YAML only); ``low``/``high``: the lowest/highest value, ``null`` what null
    means then;
    ``lists``: setting it lists the job's runs (it leaves the main job); ``off``: the help of ``--no-FLAG``."""

    kind: Kind
    help: str
    key: str | None = None
    flag: str | None = None
    metavar: str | None = None
    low: int | float | None = None
    high: int | float | None = None
    null: str | None = None
    choices: tuple[str, ...] | None = None
    lists: bool = False
    off: str | None = None


def setting(default: Any, kind: Kind, help: str, **meta: Any) -> Any:
    """A part's field with its :class:`Setting` (a list default is copied per instance)."""
    info = {"setting": Setting(kind, help, **meta)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=info)
    return field(default=default, metadata=info)


class Part:
    """A part of the configuration: a frozen dataclass whose fields carry a :class:`Setting`. Construction checks
    each value's kind and limits, then the part's own rules (:meth:`validate`); errors name the YAML key."""

    title: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.normalise()
        for f, s, key in self.settings():
            s.kind.check(key, getattr(self, f.name))
        for f, s, key in self.settings():
            self._check_limits(s, key, getattr(self, f.name))
        self.validate()

    @staticmethod
    def _check_limits(s: Setting, key: str, value: Any) -> None:
        if value is None:
            return
        if s.low is not None and value < s.low:
            raise ConfigError(key, f"must be >= {s.low}{f' or null ({s.null})' if s.null else ''}, got {value}")
        if s.high is not None and value > s.high:
            raise ConfigError(key, f"must be <= {s.high}{f' or null ({s.null})' if s.null else ''}, got {value}")
        if s.choices is not None and value not in s.choices:
            null = " or null" if s.kind.nullable else ""
            raise ConfigError(key, f"must be one of {', '.join(s.choices)}{null}, got {value!r}")

    def normalise(self) -> None:
        """Settle spellings before the checks (frozen: through ``_set``)."""

    def validate(self) -> None:
        """The part's own rules beyond each value's kind and limits."""

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @classmethod
    def settings(cls) -> list[tuple[Any, Setting, str]]:
        """(field, setting, YAML key) of each field, in order."""
        return [(f, f.metadata["setting"], f.metadata["setting"].key or f.name) for f in fields(cls)]

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> Part:
        return cls(**{f.name: flat[key] for f, _, key in cls.settings() if key in flat})

    def to_flat(self) -> dict[str, Any]:
        return {key: copy.deepcopy(getattr(self, f.name)) for f, _, key in self.settings()}
