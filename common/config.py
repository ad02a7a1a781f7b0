"""Settings read one way, for both services.

A service's settings are a frozen dataclass; each field is one environment
variable spelled as the field, typed by the field's
annotation (str, int, float, bool, `str | None`). `load(cls, env)` reads them
strictly: an empty or missing variable means the default; anything else must
parse as the field's type and pass its bounds, or ConfigError names the variable
and the value. The launchers print that one line and exit 2 (`exit_on_error`),
never a traceback.

Each setting is declared once, with its default, bounds and one line of help:
`.env.example` and docs/configuration.md are written from the declarations
(`python -m scripts.settings_doc`), which `declared(cls, group)` lists; a variable that
is no service's field (compose's own, what backends/ interpolates) is a `Var`.
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


def setting(default: Any, help: str = "", *, min: float | None = None,  # noqa: A002
            max: float | None = None, choices: tuple[str, ...] | None = None,  # noqa: A002
            url: bool = False, read: bool = True, repr: bool = True,  # noqa: A002
            group: str | None = None, shown: str | None = None):
    """A dataclass field read from the variable of its name; `read=False`: not an
    environment variable (only set by the service's own loader). `help`: its one
    line in the docs; `group`: the docs' table when not its service's (GROUPS);
    `shown`: the default in words when it is derived (.env.example leaves it empty)."""
    meta = {"min": min, "max": max, "choices": choices, "url": url, "read": read,
            "help": help, "group": group, "shown": shown}
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


# ------------------------------------------------------------------ declarations

GROUPS = {
    "compose": ("Compose", "read by `docker compose` itself"),
    "both": ("Proxy and swapper", "read by both services: one name, one meaning, one value "
             "from `.env`"),
    "swapper": ("Swapper", "the GPU's owner, port 9000, not published"),
    "models": ("Models", "what `backends/models/*.yaml` and `backends/kinds/*.yaml` "
               "interpolate, and what the downloads read; read by the swapper and "
               "`download-model.sh`"),
    "proxy": ("Proxy", "the public door"),
    "fixed": ("Fixed by compose", "set them only when running `python -m proxy` / "
              "`python -m swapper` outside Docker; compose or the image sets them and "
              "`.env` cannot move them"),
    "outside": ("Development", "outside compose: development, tests and "
                "`download-model.sh`; not in `.env.example`"),
}
"""The docs' tables, in their order, as (title, what they hold): each variable is
in one (its service's, or the one its declaration names)."""


@dataclasses.dataclass(frozen=True)
class Var:
    """A variable declared for the docs that is no service's settings field:
    compose's own, or one backends/ interpolates. `default`: as written in .env
    (None: empty); `shown`: the default in words instead."""
    name: str
    default: str | None
    help: str
    group: str
    shown: str | None = None
    accepts: str = ""


def accepts(typ, meta: Mapping) -> str:
    """What a setting's value may be, in words: its type and its bounds as `parse`
    checks them ("a number >= 0.001", "one of `hold`, `fifo`")."""
    typ = _base(typ)
    choices = meta.get("choices")
    if choices:
        return "one of " + ", ".join(f"`{c}`" for c in choices)
    if typ is bool:
        return "a boolean"
    if meta.get("url"):
        return "an http:// or https:// URL"
    if typ is str:
        return "text"
    word = "an integer" if typ is int else "a number"
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{word} from {lo:g} to {hi:g}"
    if lo is not None:
        return f"{word} >= {lo:g}"
    if hi is not None:
        return f"{word} <= {hi:g}"
    return word


def declared(cls: type, group: str) -> list[Var]:
    """The environment variables of settings class `cls` (fields read from the
    environment), as `Var`s; `group` unless a field names its own. The class's own
    fields first, then each base's (its MRO), each in declaration order."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    order = [name for c in cls.__mro__ for name in vars(c).get("__annotations__", {})]
    out, seen = [], set()
    for name in order:
        f = fields.get(name)
        if f is None or name in seen or not f.init or not f.metadata.get("read", True):
            continue
        seen.add(name)
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(Var(f.name, written(default, hints[f.name]), meta.get("help", ""),
                       meta.get("group") or group, meta.get("shown"),
                       accepts(hints[f.name], meta)))
    return out


def written(value: Any, typ=None) -> str | None:
    """A default as .env spells it: booleans 1/0, numbers without a needless .0,
    None and "" as None (empty)."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e15 else repr(value)
    return str(value)


def read_dotenv(path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (inline ' # comments' stripped, quotes
    removed), for the tools that read `.env` as compose does (download-model.sh,
    verify.sh); {} when there is none."""
    from pathlib import Path
    path = Path(path)
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        key = key.strip().removeprefix("export ").strip()
        value = value.strip()
        if value[:1] in ("'", '"') and value.count(value[0]) >= 2:
            value = value[1:value.index(value[0], 1)]
        else:
            for sep in (" #", "\t#"):
                if sep in value:
                    value = value.split(sep, 1)[0].rstrip()
        out[key] = value
    return out
