"""The stack's one stream of events, told to whoever listens (/events' EventHub,
the metrics, the prefetcher): the scheduler's state events, told under its lock,
and what the driver's parts do (the KV cache's `saving`, `restoring`, the swap
ledger's). A listener's bug is its own: telling never raises.
"""
from __future__ import annotations

from typing import Callable


class Listeners:
    def __init__(self) -> None:
        self._listeners: list[Callable[[str, dict], None]] = []

    def subscribe(self, listener: Callable[[str, dict], None]) -> None:
        """Call `listener(event, fields)` on every event (metrics, logs)."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields) -> None:
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:  # a metrics bug must never wedge scheduling
                pass
