"""What each swap cost the GPU, phase by phase, and the serving share.

The driver tells the ledger what it did (`stopped`: the stop and the save of the
prompt caches; `loaded`: the container's start, its wait until healthy, the
restore); the prompt-cache keeper what the first requests after a restore still
prefilled (`reprefilled`); the scheduler how many requests are in flight
(`in_flight`). One swap is a stop and the load that follows it (a load alone,
after an unload or at start, is a swap from nothing). `/running`, `/events`
(`swap`), the metrics and the console read it.

The serving share over the last hour is the fraction of the GPU's busy time it
spent answering, rather than loading or re-prefilling what a swap threw away:
answering = time with requests in flight, less the re-prefills;
share = answering / (answering + swap phases + re-prefills).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

HOUR = 3600.0
KEEP = 20                     # swaps kept for /running and the console


class Ledger:
    def __init__(self, emit: Callable[..., None] | None = None, metrics=None,
                 clock=time.monotonic, wall=time.time):
        self._emit = emit or (lambda event, **fields: None)
        self._metrics = metrics
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._open: dict | None = None        # a stop done, its load to come
        self.recent: collections.deque[dict] = collections.deque(maxlen=KEEP)
        # (monotonic end, seconds, kind): kind busy, swap or reprefill, last hour
        self._spans: collections.deque[tuple[float, float, str]] = collections.deque()
        self._active = 0
        self._busy_since: float | None = None

    # ------------------------------------------------------------ the driver
    def stopped(self, model: str, cause: str | None, stop: float, save: float,
                saved=None) -> None:
        """`model`'s backend stopped: `stop` seconds in all, `save` of them
        saving its prompt caches (`saved`: kvcache.Outcome)."""
        record = {"from": model, "to": None, "cause": cause, "at": round(self._wall(), 3),
                  "phases": {"stop": round(stop - save, 3), "save": round(save, 3)},
                  "saved": _kept(saved), "restored": None,
                  "reprefill": {"requests": 0, "tokens": 0, "seconds": 0.0}}
        with self._lock:
            self._open = record
            self._span(stop, "swap")
        self._observe("stop", stop - save)
        self._observe("save", save)

    def loaded(self, model: str, start: float, healthy: float, restore: float,
               restored=None) -> dict:
        """`model` is ready: `start` seconds to create and start its container,
        `healthy` waiting for its health, `restore` restoring its prompt caches."""
        with self._lock:
            record, self._open = self._open, None
            if record is None:
                record = {"from": None, "to": None, "cause": None,
                          "at": round(self._wall(), 3), "phases": {}, "saved": None,
                          "reprefill": {"requests": 0, "tokens": 0, "seconds": 0.0}}
            record["to"] = model
            record["phases"].update(start=round(start, 3), healthy=round(healthy, 3),
                                    restore=round(restore, 3))
            record["restored"] = _kept(restored)
            record["seconds"] = round(sum(record["phases"].values()), 3)
            self.recent.append(record)
            self._span(start + healthy + restore, "swap")
        for phase, seconds in (("start", start), ("healthy", healthy), ("restore", restore)):
            self._observe(phase, seconds)
        self._emit("swap", **record)
        return record

    # -------------------------------------------------- the first answers
    def reprefilled(self, model: str, tokens: int, seconds: float | None) -> None:
        """A conversation's first answer after `model`'s load prefilled `tokens`
        (`seconds`): what its swap still cost it."""
        with self._lock:
            record = next((r for r in reversed(self.recent) if r["to"] == model), None)
            if record is not None:
                r = record["reprefill"]
                r["requests"] += 1
                r["tokens"] += tokens
                r["seconds"] = round(r["seconds"] + (seconds or 0.0), 3)
            if seconds:
                self._span(seconds, "reprefill")
        if seconds is not None:
            self._observe("reprefill", seconds)

    # -------------------------------------------------------- busy time
    def in_flight(self, n: int) -> None:
        """Requests in flight now (the scheduler's admitted ones)."""
        with self._lock:
            now = self._clock()
            if n > 0 and self._active == 0:
                self._busy_since = now
            elif n == 0 and self._active > 0 and self._busy_since is not None:
                self._spans.append((now, now - self._busy_since, "busy"))
                self._busy_since = None
            self._active = n

    def last_hour(self) -> dict:
        """Seconds busy, lost to swaps and to re-prefills in the last hour, and
        the serving share (None: the GPU did nothing)."""
        with self._lock:
            now = self._clock()
            self._trim(now)
            totals = {"busy": 0.0, "swap": 0.0, "reprefill": 0.0}
            for end, seconds, kind in self._spans:
                totals[kind] += min(seconds, end - (now - HOUR))
            if self._busy_since is not None:
                totals["busy"] += now - max(self._busy_since, now - HOUR)
        answering = max(totals["busy"] - totals["reprefill"], 0.0)
        spent = answering + totals["swap"] + totals["reprefill"]
        return {"busy_seconds": round(totals["busy"], 1),
                "swap_seconds": round(totals["swap"], 1),
                "reprefill_seconds": round(totals["reprefill"], 1),
                "serving_share": round(answering / spent, 4) if spent > 0 else None}

    def status(self) -> dict:
        with self._lock:
            last = dict(self.recent[-1]) if self.recent else None
        return {"last_swap": last, "last_hour": self.last_hour()}

    def _span(self, seconds: float, kind: str) -> None:
        now = self._clock()
        self._spans.append((now, max(seconds, 0.0), kind))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._spans and self._spans[0][0] < now - HOUR:
            self._spans.popleft()

    def _observe(self, phase: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.swap_phase(phase, max(seconds, 0.0))


def _kept(outcome) -> dict | None:
    """What a save or restore kept (kvcache.Outcome), for a swap's record."""
    if outcome is None:
        return None
    return {"prompts": len(outcome.names), "tokens": outcome.tokens, "bytes": outcome.bytes,
            "seconds": round(outcome.seconds, 3)}
