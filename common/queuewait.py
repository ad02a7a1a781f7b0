"""How long a request waited in the swapper before its backend got it (the queue,
a load, a swap, a drain), told to the proxy for its activity list (/ui/activity).

- An answer relayed once admitted carries it as a header: `X-Queue-Wait: 0.012`.
- A streamed request that had to wait was answered at once with progress
  comments (its headers went before the wait ended): the wait comes as one more
  comment, `: queue-wait 3.214`, just before the backend's own events.
Seconds, three decimals. Clients ignore both.
"""
from __future__ import annotations

import re

HEADER = "X-Queue-Wait"
_COMMENT = b": queue-wait "
_VALUE = re.compile(rb": queue-wait (\d+(?:\.\d+)?)\n")


def header_value(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}"


def comment(seconds: float) -> bytes:
    return _COMMENT + header_value(seconds).encode() + b"\n\n"


def from_header(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 1e9 else None


def from_piece(piece: bytes) -> float | None:
    """The wait a piece of a stream carries in its comment (None: none)."""
    if _COMMENT not in piece:
        return None
    m = _VALUE.search(piece.replace(b"\r\n", b"\n"))
    return float(m.group(1)) if m else None
