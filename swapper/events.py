"""The scheduler's notifications as a server-sent event stream (`GET /events`).

The scheduler calls `publish()` (its listener) under its lock, so publishing
never blocks: each subscriber has a bounded queue, and a subscriber too slow
to keep up loses its oldest events (and is told so), never the scheduler's time.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

from common.serve import STOPPING
from common.sse import comment, emit

QUEUE_SIZE = 256


class EventHub:
    def __init__(self, clock=time.time):
        self._clock = clock
        self._subscribers: set[queue.Queue] = set()
        self._lock = threading.Lock()

    def publish(self, event: str, fields: dict) -> None:
        """A scheduler listener: stamp the event and hand it to every subscriber
        (with none, as on every request's admission mostly: nothing to build)."""
        if not self._subscribers:
            return
        with self._lock:
            subscribers = list(self._subscribers)
        item = {"event": event, "time": round(self._clock(), 3), **fields}
        for q in subscribers:
            try:
                q.put_nowait(item)
            except queue.Full:
                try:
                    q.get_nowait()
                    q.put_nowait({"event": "events_dropped", "time": item["time"]})
                except (queue.Empty, queue.Full):
                    pass

    def stream(self, first: dict, keepalive: float) -> Iterator[bytes]:
        """SSE for one subscriber: `first` (the state now), then every event as
        it happens, a comment every `keepalive` seconds when nothing does."""
        q: queue.Queue = queue.Queue(QUEUE_SIZE)
        with self._lock:
            self._subscribers.add(q)
        try:
            yield emit({"event": "state", "time": round(self._clock(), 3), **first})
            while not STOPPING.is_set():     # the worker's stop ends it (common.serve)
                try:
                    yield emit(q.get(timeout=keepalive))
                except queue.Empty:
                    yield comment("keep-alive")
        finally:
            with self._lock:
                self._subscribers.discard(q)
