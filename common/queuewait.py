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

HEADER = "X-Queue-Wait"
LOAD_HEADER = "X-Load-Seconds"
_COMMENT = b": queue-wait "
_LOAD_COMMENT = b": load-seconds "
_VALUE = re.compile(rb": queue-wait (\d+(?:\.\d+)?)\n")
_LOAD_VALUE = re.compile(rb": load-seconds (\d+(?:\.\d+)?)\n")


def header_value(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}"


def comment(seconds: float, load_seconds: float | None = None) -> bytes:
    """The comment event a waiting stream gets before the backend's events (the
    load seconds' line only when given)."""
    out = _COMMENT + header_value(seconds).encode() + b"\n"
    if load_seconds is not None:
        out += _LOAD_COMMENT + header_value(load_seconds).encode() + b"\n"
    return out + b"\n"


def from_header(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 1e9 else None


def from_piece(piece: bytes) -> float | None:
    """The wait a piece of a stream carries in its comment (None: none)."""
    return _found(piece, _COMMENT, _VALUE)


def load_from_piece(piece: bytes) -> float | None:
    """The load seconds a piece of a stream carries in its comment (None: none)."""
    return _found(piece, _LOAD_COMMENT, _LOAD_VALUE)


def _found(piece: bytes, marker: bytes, value: re.Pattern) -> float | None:
    if marker not in piece:
        return None
    m = value.search(piece.replace(b"\r\n", b"\n"))
    return float(m.group(1)) if m else None
