"""Progress that a waiting stream's client counts, in its dialect.

A streamed request waits before its first event -- in the swapper's queue, behind a
hold, for a download, a load, a restore, or the backend's prefill (llama-server
sends nothing until the first token). What it sends meanwhile are SSE comments: the
swapper's (`: loading model qwen (12 s), ~40 s left`) and the proxy's own
(`: keep-alive`). Agents' idle timers do not count comments (measured: Qwen Code
drops the stream after its 240 s, Claude Code after 300 s, and sends it again), so
until the first event with data each comment is followed by the dialect's own
progress: its Progress, declared with the dialect (proxy/dialects/*.py), whose
events the agents' timers count and which the answer's text does not change
(Messages: a thinking block signed MARKER, taken out again when the agent sends
the turn back, so the prompt and its cache are exactly what they would have been
without the wait).

A stream that never waited passes untouched (one look at its first piece).
"""
from __future__ import annotations

from typing import Iterable, Iterator

from common import sse

# The signature of our progress thinking block (Messages): how its strip() knows it.
MARKER = "coding-stack-wait"
# Comments that carry no words for the user (the proxy's keep-alive, the swapper's
# queue-wait and load-seconds record for the activity list and the keys' usage).
_SILENT = ("keep-alive", "queue-wait", "load-seconds")


def _text(ev: sse.Event) -> str:
    """A comment event's words for the user ("" for a keep-alive)."""
    words = ev.words
    return "" if not words or words.startswith(_SILENT) else words


class Progress:
    """A waiting stream's progress in one dialect (each dialect's module declares
    its own: proxy/dialects/*.py): `tick(text)` is the progress for one comment
    (`text`: its words, "" for none: events made with `event`), `then(first,
    batches)` the backend's events after it (`first`: the rest of the read that
    brought the first event with data; `batches`: the reads after it). The class
    also says which clients get it (`wanted`) and takes ours out of a conversation
    sent back (`strip`)."""

    def __init__(self, body: dict):
        self.body = body

    @staticmethod
    def wanted(body: dict, environ: dict) -> bool:
        """Whether this request's client gets progress events: every client, when
        they carry no content."""
        return True

    @staticmethod
    def strip(body: dict) -> bool:
        """Our progress out of the conversation an agent sends back; True when the
        body changed (none of it stays in a conversation: nothing to do)."""
        return False

    @staticmethod
    def event(obj: dict, name: str | None = None) -> sse.Event:
        """One event of progress (not the answer: the record's first token skips it)."""
        return sse.Event.of(obj, name, progress=True)

    def tick(self, text: str) -> list[sse.Event]:
        raise NotImplementedError

    def then(self, first: list[sse.Event], batches) -> Iterator[list[sse.Event]]:
        """The backend's events as they came."""
        yield first
        yield from batches


def kept_in_progress(progress: type[Progress], body: dict, pieces: Iterable,
                     environ: dict | None = None) -> sse.Body:
    """The client's stream (`pieces`: bytes, or an earlier stage's events), its
    comments before the first event with data made the dialect's progress
    (`progress`: its Progress; see above), flagged as progress (the record does
    not take it for the answer's first token). A stream whose first event comes
    with no comment before it passes untouched."""
    return sse.Body(_kept(progress, body, sse.events_of(pieces)))


def _kept(progress: type[Progress], body: dict, batches) -> Iterator[list[sse.Event]]:
    waiting = None
    try:
        for evs in batches:
            if not evs:
                yield evs               # the headers, now
                continue
            out: list[sse.Event] = []
            for i, ev in enumerate(evs):
                if ev.data is None:     # the comment stays (curl's reader, the activity list)
                    out.append(ev)
                    if not ev.blank:
                        waiting = waiting or progress(body)
                        out += waiting.tick(_text(ev))
                    continue
                rest = evs[i:]
                if waiting is None:     # no wait: the stream as it came
                    yield out + rest
                    yield from batches
                    return
                if out:
                    yield out
                yield from waiting.then(rest, batches)
                return
            if out:
                yield out
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
