"""The proxy's recent requests, for the console (/ui) and scripts (/ui/activity).

A bounded in-memory ring (RING_SIZE entries, the oldest dropped first) of what
each model request was: when, which dialect and model, its status, queue wait,
time to first token, tokens in and out, tokens/s and search rounds. Each is the
request's record (proxy/record.py: made when it arrived, filled while it was
served and as its answer went), handed here by the metrics at its end (`record`).
One ring per worker process: with PROXY_WORKERS > 1 each worker shows its own
requests.
"""
from __future__ import annotations

import collections
import itertools
import threading

from common.dialects import WIRES

RING_SIZE = 200
NAME_CHARS = 100        # a model name kept in an activity record, at most

# The routes whose requests are listed (the console's own polling is not): the
# dialects' (common/dialects.py) and the other model routes, by route label.
DIALECTS = {**{w.path: w.name for w in WIRES},
            "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


def short(name):
    """A model name as a record keeps it: the client's string, cut to NAME_CHARS
    (a request may name a 10 MB model; the ring keeps 200 records)."""
    return name[:NAME_CHARS] if isinstance(name, str) else None


class Activity:
    def __init__(self, size: int = RING_SIZE):
        self._ring: collections.deque = collections.deque(maxlen=size)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    @staticmethod
    def dialect(route: str) -> str | None:
        """The dialect a route's requests are listed under (None: not listed)."""
        return DIALECTS.get(route)

    def record(self, rec, label: str | None = None) -> None:
        """A request's answer has ended: its record (proxy/record.Record; `label`:
        the model's metric label, when its tokens were counted) joins the ring, when
        its route is listed."""
        if rec.dialect is None:
            return
        entry = {"time": rec.time, "dialect": rec.dialect, "method": rec.method,
                 "status": rec.status, "model": short(rec.requested()),
                 "stream": rec.stream, "seconds": round(rec.seconds, 3)}
        if rec.who is not None:
            entry["key"] = rec.who.name          # the request's key (proxy/keys/auth.py)
        if rec.rounds is not None:
            entry["search_rounds"] = rec.rounds
        if rec.queue_wait is not None:
            entry["queue_wait"] = rec.queue_wait
        if rec.usage is not None:
            first_token, rate = rec.first_token, rec.rate
            entry.update(model=short(label or rec.requested() or rec.answered),
                         ttft=None if first_token is None else round(first_token, 3),
                         prompt_tokens=rec.prompt, completion_tokens=rec.completion,
                         tokens_per_second=None if rate is None else round(rate, 1))
        self.add(entry)

    def add(self, entry: dict) -> None:
        with self._lock:
            entry["seq"] = next(self._seq)
            self._ring.append(entry)

    def since(self, seq: int = 0, limit: int = RING_SIZE,
              key: str | None = None) -> tuple[list[dict], int]:
        """The records after `seq`, oldest first (at most `limit`, the newest), and
        the newest record's number (0: none; below `seq`: the proxy restarted).
        `key`: only that key's records (a `use` key sees its own requests only)."""
        with self._lock:
            out = [dict(r) for r in self._ring
                   if r["seq"] > seq and (key is None or r.get("key") == key)]
            newest = self._ring[-1]["seq"] if self._ring else 0
        return (out[-limit:] if limit > 0 else []), newest
