"""How long a request waited in the swapper before its backend got it (the queue,
a load, a swap, a drain), told to the proxy for its activity list (/ui/activity),
and the load seconds charged to it (its share of the load it waited for,
swapper/tenants.py `split`), for its key's usage (proxy/keys/usage.py).

- An answer relayed once admitted carries them as headers:
  `X-Queue-Wait: 0.012` and `X-Load-Seconds: 0.000`.
- A streamed request that had to wait was answered at once with progress
  comments (its headers went before the wait ended): they come as one more
  comment event just before the backend's own events, one line each:
  `: queue-wait 3.214` then `: load-seconds 2.500`.
Seconds, three decimals. Clients ignore both. A reader that knows only the
queue wait (an older proxy) still reads it: the load seconds are a line (and a
header) of their own; an older swapper tells no load seconds (None here).
"""
from __future__ import annotations

import re

from . import sse

HEADER = "X-Queue-Wait"
LOAD_HEADER = "X-Load-Seconds"
_WAIT, _LOAD = "queue-wait", "load-seconds"     # the comment lines' names
_VALUE = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def header_value(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}"


def comment(seconds: float, load_seconds: float | None = None) -> bytes:
    """The comment event a waiting stream gets before the backend's events (the
    load seconds' line only when given)."""
    out = f": {_WAIT} {header_value(seconds)}\n"
    if load_seconds is not None:
        out += f": {_LOAD} {header_value(load_seconds)}\n"
    return (out + "\n").encode()


def from_header(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 1e9 else None


def from_event(ev: sse.Event) -> tuple[float | None, float | None]:
    """The wait and the load seconds an event's comment lines tell (the first of
    each; None: not told)."""
    wait = load = None
    for line in ev.comments:
        name, _, value = line.partition(" ")
        if not _VALUE.fullmatch(value):
            continue
        if name == _WAIT and wait is None:
            wait = float(value)
        elif name == _LOAD and load is None:
            load = float(value)
    return wait, load
