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
# The request's environ key that is true while a piece of progress is being sent.
SENDING = "proxy.progress.sending"
# Comments that carry no words for the user (the proxy's keep-alive, the swapper's
# queue-wait record for the activity list).
_SILENT = ("keep-alive", "queue-wait")


def _text(raw: bytes) -> str:
    """A comment event's words ("" for a keep-alive)."""
    words = " ".join(line[1:].decode("utf-8", "replace").strip()
                     for line in raw.split(b"\n") if line.startswith(b":")).strip()
    return "" if not words or words.startswith(_SILENT) else words


class Progress:
    """A waiting stream's progress in one dialect (each dialect's module declares
    its own: proxy/dialects/*.py): `tick(text)` is the progress for one comment
    (`text`: its words, "" for none), `then(first, parser, it)` the backend's events
    after it. The class also says which clients get it (`wanted`) and takes ours
    out of a conversation sent back (`strip`)."""

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

    def tick(self, text: str) -> bytes:
        raise NotImplementedError

    def then(self, first: list[bytes], parser: sse.Parser, it) -> Iterator[bytes]:
        """The backend's events as they came."""
        yield b"".join(first) + parser.pending()
        yield from it


def kept_in_progress(progress: type[Progress], body: dict, pieces: Iterable[bytes],
                     environ: dict | None = None) -> Iterator[bytes]:
    """The client's stream (`pieces`, as the dialect's relay makes it), its comments
    before the first event with data made the dialect's progress (`progress`:
    its Progress; see above). A
    stream whose first event comes with no comment before it passes untouched.
    `environ[SENDING]` is true while the piece just handed on is progress only
    (whole events): the metrics do not take it for the answer's first token."""
    it = iter(pieces)
    parser = sse.Parser()
    waiting = None
    environ = environ if environ is not None else {}
    try:
        for piece in it:
            if not piece:
                yield piece             # the headers, now
                continue
            events = sse.split(parser.take(piece))
            out = []
            for i, raw in enumerate(events):
                ev = sse.parse_event(raw)
                if ev is None:
                    continue
                if ev.data is None:     # the comment stays (curl's reader, the activity list)
                    waiting = waiting or progress(body)
                    out += (raw, waiting.tick(_text(raw)))
                    continue
                rest = events[i:]
                if waiting is None:     # no wait: the stream as it came
                    yield b"".join(rest) + parser.pending()
                    yield from it
                    return
                if out:
                    environ[SENDING] = True
                    yield b"".join(out)
                environ[SENDING] = False
                yield from waiting.then(rest, parser, it)
                return
            if out:
                environ[SENDING] = True
                yield b"".join(out)
                environ[SENDING] = False
        rest = parser.rest()
        if rest:
            yield rest
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
