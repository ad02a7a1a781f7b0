"""Usage per key (issue 35), counted from the request's record (proxy/record.py)
when it ends: proxy/app.py `before` gives every model request (a POST under
/v1/) of a key from the store one reader, `Counting(...).reader(key)`, which

- turns the record into one row's counters (`spent_of`: one request, its prompt
  / cached / completion tokens, its queue wait, and the load seconds the swapper
  charged to it: its share of the load it waited for, the split of the swapper's
  per-tenant account, so a key's sum equals its tenant's charge),
- names its model (`model_of`: the model the request named, as the catalog's id
  when the catalog knows it, else the answer's, else ""),
- counts it in the metrics with the key's name as a bounded label
  (proxy/metrics.py `key_usage`), then adds it to the key's row of the day
  in the database (store.add_usage: one UPSERT; kept and retried while the
  database is down). A request holding a concurrency lease hands its row to the
  door's end instead (auth.LastWrite), which writes it in the release's
  transaction: still one write at a request's end.

The daily token limit reads its totals from the same rows. `totals` and `day`
serve the admin route (GET /admin/usage) and the CLI (`python -m proxy.keys
usage`)."""
from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Callable

from ..record import NOT_READ, Record, requested_model
from .auth import LastWrite
from .policy import DAY, SPENT_FIELDS, Key, Spent
from .store import Store

MODEL_CHARS = 128           # a model name as a row keeps it, at most
RESOLVED_MAX = 256
UNKNOWN_TTL = 30.0          # seconds an unknown model name is not asked of the catalog again


def spent_of(rec: Record) -> Spent:
    """One ended request's counters (a token count the answer did not give is 0)."""
    return Spent(requests=1, prompt_tokens=rec.prompt or 0, cached_tokens=rec.cached or 0,
                 completion_tokens=rec.completion or 0,
                 queue_wait_seconds=rec.queue_wait or 0.0,
                 load_seconds=rec.load_seconds or 0.0)


def model_of(rec: Record, resolve: Callable[[str], str | None] | None = None) -> str:
    """The row's model: the model the request named (its id when `resolve` knows
    it), else the one the answer names, else ""."""
    name = rec.model if rec.model is not NOT_READ else \
        (requested_model(rec.body) if rec.body else None)
    if name and resolve is not None:
        name = resolve(name) or name
    return (name or rec.answered or "")[:MODEL_CHARS]


class Counting:
    """The usage reader's parts: the store, the catalog's resolver, the metrics."""

    def __init__(self, store: Store, resolve: Callable[[str], str | None] | None = None,
                 metrics=None, clock=time.monotonic):
        self.store, self.metrics = store, metrics
        self._lookup = resolve
        self._clock = clock
        self._resolved: dict[str, tuple[str | None, float]] = {}   # name -> (id, until)
        self._lock = threading.Lock()

    def resolve(self, name: str) -> str | None:
        """The catalog's id for `name`: kept once known; an unknown name is asked
        again after UNKNOWN_TTL seconds (the catalog may fetch on a lookup)."""
        hit = self._resolved.get(name)
        now = self._clock()
        if hit is not None and (hit[0] is not None or hit[1] > now):
            return hit[0]
        if self._lookup is None:
            return None
        try:
            known = self._lookup(name)
        except Exception:  # noqa: BLE001 - a name must never fail the count
            known = None
        with self._lock:
            if name in self._resolved or len(self._resolved) < RESOLVED_MAX:
                self._resolved[name] = (known or None, now + UNKNOWN_TTL)
        return known or None

    def reader(self, key: Key, last: LastWrite | None = None) -> Callable[[Record], None]:
        """The reader of a request's record; `last`: the request holds a lease, and
        its row goes in the release's transaction while the door has not ended it."""
        return lambda rec: self.count(key, rec, last)

    def count(self, key: Key, rec: Record, last: LastWrite | None = None) -> None:
        model, spent = model_of(rec, self.resolve), spent_of(rec)
        if self.metrics is not None:
            self.metrics.key_usage(key.name, model, spent)
        if last is not None and last.open:
            last.usage = (model, spent)
        else:
            self.store.add_usage(key, model, spent)


def day(n: int) -> str:
    """A UTC day number (seconds // 86400) as YYYY-MM-DD."""
    return (dt.date(1970, 1, 1) + dt.timedelta(days=n)).isoformat()


def day_number(text: str) -> int:
    """YYYY-MM-DD (UTC) as a day number; ValueError for anything else."""
    return (dt.date.fromisoformat(text) - dt.date(1970, 1, 1)).days


def today(now: float) -> int:
    return int(now // DAY)


def totals(rows: list[dict]) -> dict:
    """The sums of rows' counters."""
    out = {c: 0 for c in SPENT_FIELDS}
    for r in rows:
        for c in SPENT_FIELDS:
            out[c] += r[c]
    for c in SPENT_FIELDS:
        if c.endswith("seconds"):
            out[c] = round(out[c], 3)
    return out


def shown(rows: list[dict]) -> list[dict]:
    """Rows as the admin route and the CLI's --json show them (the day as a date)."""
    return [{**r, "day": day(r["day"]),
             **{c: round(r[c], 3) for c in SPENT_FIELDS if c.endswith("seconds")}}
            for r in rows]
