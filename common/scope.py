"""A key's model scope, the one matching rule both services apply (issue 35).

A key's `models` are ids, aliases or shell-style globs (`qwen-*`), matched
case-sensitively; `*` is every model. A model is in scope when its id or one of
its aliases matches an entry.

The proxy checks the names its catalog knows (proxy/keys/auth.check_model) and
tells the swapper the scope of a key that is not `*` on the internal hop:

    X-Coding-Stack-Models: ["qwen-*", "smollm2"]        (a JSON list of strings)

so that the swapper, which alone maps an agent's own tier names (`claude-*`,
`gpt-5*`) to registry models (`@resident`: the resident one), maps them within
the scope (swapper/registry.py `resolve(allowed=...)`) and refuses a model
outside it. A field that fails the strict checks allows nothing (it only ever
comes from the proxy, which strips clients' copies: a bad one is a bug, and a
bug must not open the scope).
"""
from __future__ import annotations

import fnmatch
import json
from typing import Iterable

MODELS_HEADER = "X-Coding-Stack-Models"
MAX_ENTRIES = 256
MAX_FIELD = 16384


def matches(models: Iterable[str], names: Iterable[str]) -> bool:
    """True when one of `names` (a model's id and aliases) matches an entry."""
    models = tuple(models)
    if "*" in models:
        return True
    return any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in models)


def header_value(models: Iterable[str]) -> str | None:
    """The field's value for a key's models; None for an all-models key."""
    models = list(models)
    return None if "*" in models else json.dumps(models, separators=(",", ":"))


def parse(value: str | None) -> tuple[str, ...] | None:
    """The scope a field names: None without the field (every model), else its
    entries; () (nothing allowed) when it fails the checks."""
    if value is None:
        return None
    if len(value) > MAX_FIELD:
        return ()
    try:
        models = json.loads(value)
    except (ValueError, RecursionError):        # RecursionError: deep nesting
        return ()
    if not isinstance(models, list) or not 0 < len(models) <= MAX_ENTRIES or \
            not all(isinstance(m, str) and m for m in models):
        return ()
    return tuple(models)
