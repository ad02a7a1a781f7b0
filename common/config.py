"""Settings read one way, for both services.

A service's settings are a frozen dataclass; each field is one environment
variable spelled as the field, typed by the field's
annotation (str, int, float, bool, `str | None`). `load(cls, env)` reads them
strictly: an empty or missing variable means the default; anything else must
parse as the field's type and pass its bounds, or ConfigError names the variable
and the value. The launchers print that one line and exit 2 (`exit_on_error`),
never a traceback.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting has a value its service cannot run with; the message names it."""


def setting(default: Any, *, min: float | None = None,  # noqa: A002
            max: float | None = None, choices: tuple[str, ...] | None = None,  # noqa: A002
            url: bool = False, read: bool = True, repr: bool = True):  # noqa: A002
    """A dataclass field read from the variable of its name; `read=False`: not an
    environment variable (only set by the service's own loader)."""
    meta = {"min": min, "max": max, "choices": choices, "url": url, "read": read}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata=meta, repr=repr)
    return dataclasses.field(default=default, metadata=meta, repr=repr)


def load(cls: type[T], environ: Mapping[str, str] | None = None, /, **overrides) -> T:
    """Build `cls` from `environ` (default: os.environ). `overrides` (by field
    name) are taken as given: for tests and callers that already hold typed values."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in overrides:
            values[f.name] = overrides.pop(f.name)
            continue
        if not f.metadata.get("read", True):
            continue
        name = f.name
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            values[f.name] = parse(name, raw, hints[f.name], f.metadata)
    if overrides:
        raise TypeError(f"{cls.__name__} has no setting(s) {', '.join(sorted(overrides))}")
    return cls(**values)


def parse(name: str, raw: str, typ, meta: Mapping = {}) -> Any:  # noqa: B006
    """`raw` (non-empty) as `typ`, checked against the field's bounds."""
    value = raw.strip()
    typ = _base(typ)
    if typ is bool:
        v = value.lower()
        if v in TRUE:
            return True
        if v in FALSE:
            return False
        raise ConfigError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), "
                          f"got {raw!r}")
    if typ is int:
        try:
            out: Any = int(value)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    elif typ is float:
        try:
            out = float(value)
        except ValueError:
            out = None
        if out is None or out != out or out in (float("inf"), float("-inf")):
            raise ConfigError(f"{name} must be a number, got {raw!r}")
    elif typ is str:
        out = value
    else:  # pragma: no cover - a programming error, not a configuration one
        raise TypeError(f"setting {name}: unsupported type {typ!r}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and out < lo:
        raise ConfigError(f"{name} must be at least {lo:g}, got {raw!r}")
    if hi is not None and out > hi:
        raise ConfigError(f"{name} must be at most {hi:g}, got {raw!r}")
    choices = meta.get("choices")
    if choices:
        if out.upper() not in {c.upper() for c in choices}:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    if meta.get("url") and not out.lower().startswith(("http://", "https://")):
        raise ConfigError(f"{name} must be an http:// or https:// URL, got {raw!r}")
    return out


def _base(typ):
    """`X | None` -> X."""
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return typ


def exit_on_error(read: Callable[[], T], service: str) -> T:
    """`read()`, or one line on stderr and exit status 2 when the configuration is bad."""
    try:
        return read()
    except ConfigError as e:
        print(f"{service}: invalid configuration: {e}", file=sys.stderr)
        raise SystemExit(2) from None


PORT = dict(min=1, max=65535)
