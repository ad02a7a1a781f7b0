"""The swapper's /events stream never ends by itself (the console keeps it open):
when its worker is told to stop (common.serve.STOPPING, set on SIGTERM) it ends at
its next beat, so `docker compose down` is not held for gunicorn's graceful
timeout (30 s) by an open console."""
from __future__ import annotations

from common.serve import STOPPING
from swapper.events import EventHub


def test_the_event_stream_ends_at_its_next_beat_once_the_worker_stops():
    hub = EventHub()
    stream = hub.stream({"model": None}, keepalive=0.05)
    try:
        assert b'"event":"state"' in next(stream)
        assert next(stream).startswith(b":")              # a beat: it runs on
        STOPPING.set()
        assert list(stream) == []                          # ended, nothing more
        assert not hub._subscribers                       # its queue is gone with it
    finally:
        STOPPING.clear()
        stream.close()
