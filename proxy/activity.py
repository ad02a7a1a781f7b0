"""The proxy's recent requests, for the console (/ui) and scripts (/ui/activity).

A bounded in-memory ring (RING_SIZE entries, the oldest dropped first) of what
each model request was: when, which dialect and model, its status, queue wait,
time to first token, tokens in and out, tokens/s and search rounds. The app's before-request
hook opens a record (`begin`); the metrics hook, which follows the answer's body
to its end anyway, fills it and hands it back (`record`); the search loop's
round count arrives through `rounds` (the request's context). The queue wait
(seconds in the swapper's queue, a load or a swap before the backend got the
request; summed over search rounds) is the swapper's word (common.queuewait): its
X-Queue-Wait header, read where the proxy sends upstream (`note_wait`), or its
`: queue-wait` comment in a stream that had to wait (`noting_waits`). One ring per
worker process: with PROXY_WORKERS > 1 each worker shows its own requests.
"""
from __future__ import annotations

import collections
import contextvars
import itertools
import threading
import time
from typing import Iterable, Iterator

from common import queuewait
from common.dialects import WIRES

from .keys.auth import KEY              # the request's key (proxy/keys/auth.py)

RING_SIZE = 200

# The routes whose requests are listed (the console's own polling is not): the
# dialects' (common/dialects.py) and the other model routes, by route label.
DIALECTS = {**{w.path: w.name for w in WIRES},
            "/v1/completions": "completions", "/v1/embeddings": "embeddings"}

RECORD = "coding_stack.activity"          # the request's open record (metrics.ACTIVITY)
_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "coding_stack_activity", default=None)


class Activity:
    def __init__(self, size: int = RING_SIZE, clock=time.time):
        self._ring: collections.deque = collections.deque(maxlen=size)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._clock = clock

    def begin(self, environ: dict, route: str) -> None:
        """A request for a listed route arrived: open its record."""
        dialect = DIALECTS.get(route)
        if dialect is None:
            _current.set(None)
            return
        rec = {"time": round(self._clock(), 3), "dialect": dialect,
               "method": environ.get("REQUEST_METHOD")}
        key = environ.get(KEY)
        if key is not None:
            rec["key"] = key.name           # the request's key (proxy/keys/auth.py)
        environ[RECORD] = rec
        _current.set(rec)

    def rounds(self, n: int) -> None:
        """The current request's search loop ended after `n` rounds."""
        rec = _current.get()
        if rec is not None:
            rec["search_rounds"] = n

    def record(self, rec: dict) -> None:
        """A request's answer has ended: its record joins the ring."""
        with self._lock:
            rec["seq"] = next(self._seq)
            self._ring.append(rec)

    def since(self, seq: int = 0, limit: int = RING_SIZE) -> tuple[list[dict], int]:
        """The records after `seq`, oldest first (at most `limit`, the newest), and
        the newest record's number (0: none; below `seq`: the proxy restarted)."""
        with self._lock:
            out = [dict(r) for r in self._ring if r["seq"] > seq]
            newest = self._ring[-1]["seq"] if self._ring else 0
        return (out[-limit:] if limit > 0 else []), newest


def note_wait(environ: dict | None, seconds: float | None) -> None:
    """The swapper said the request waited `seconds` (None: it said nothing)."""
    rec = environ.get(RECORD) if environ is not None and seconds is not None else None
    if rec is not None:
        rec["queue_wait"] = round(rec.get("queue_wait", 0.0) + seconds, 3)


def noting_waits(pieces: Iterable[bytes], environ: dict | None) -> Iterator[bytes]:
    """A streamed answer from the swapper as it comes; a queue-wait comment before
    its first event's data is noted in the request's record (then the rest passes
    untouched)."""
    it = iter(pieces)
    if environ is None or environ.get(RECORD) is None:
        yield from it
        return
    for piece in it:
        yield piece
        if piece:
            note_wait(environ, queuewait.from_piece(piece))
            if b"data:" in piece:
                break
    yield from it
