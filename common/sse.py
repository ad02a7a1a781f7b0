"""Server-sent events framing: parse an upstream byte stream into events, emit events.

No model logic here. OpenAI-style streams use `data:` lines only; comments
(lines starting with `:`) are keep-alives.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Iterable, Iterator

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


_UNREAD = object()


class Event:
    """One event as it came (or as a stage made it): its bytes, up to and with its
    blank line, are what the writer sends when no stage changed it; its JSON is
    parsed once, when a stage (or the request record) first asks (`json`)."""

    __slots__ = ("raw", "data", "name", "_obj", "progress")

    def __init__(self, raw: bytes, data: str | None, name: str | None = None,
                 obj=_UNREAD, progress: bool = False):
        self.raw = raw          # the event's bytes including the terminating blank line
        self.data = data        # joined `data:` payload, None for comment-only events
        #                         (a stage's event has its data too: Event.of)
        self.name = name        # the `event:` field
        self._obj = obj
        self.progress = progress    # a wait's progress (not the answer: no first token)

    @classmethod
    def of(cls, obj: dict, name: str | None = None, progress: bool = False) -> "Event":
        """An event a stage makes of `obj` (framed here, never parsed again). It is
        a data event like one read: its `data` is the JSON it carries (the stages
        after it and the request's record tell comments by `data is None`)."""
        data = _dumps(obj, ascii=not name)
        return cls(_framed(name, data), data, name, obj, progress)

    @classmethod
    def comment(cls, raw: bytes) -> "Event":
        """A comment event of these bytes (keep-alives, the swapper's progress)."""
        return cls(raw, None)

    @property
    def is_done(self) -> bool:
        return self.data is not None and self.data.strip() == "[DONE]"

    @property
    def is_comment(self) -> bool:
        """A comment (or blank) event: no data."""
        return self.data is None

    @property
    def blank(self) -> bool:
        """Blank lines only (what a read held between events): neither data nor a
        comment."""
        return not self.raw.strip(b"\n")

    def bare(self) -> "Event":
        """The event without the blank lines the reader glued to it (batch: they
        go with a neighbour, which one depends on how the reads were cut): what a
        stage that drops blank lines passes on, the same however the stream was
        cut. Itself when it has none."""
        raw = self.raw
        if raw[:1] != b"\n" and raw[-3:-2] != b"\n":
            return self
        body = raw.lstrip(b"\n")
        # blank lines come in pairs; an odd newline before it is its own (Parser)
        head = b"\n" if (len(raw) - len(body)) % 2 else b""
        return Event(head + body.rstrip(b"\n") + b"\n\n", self.data, self.name, self._obj,
                     self.progress)

    @property
    def comments(self) -> list[str]:
        """The texts of its comment lines (`: loading model m (3 s)` ->
        `loading model m (3 s)`), stripped."""
        return [line[1:].decode("utf-8", "replace").strip()
                for line in self.raw.split(b"\n") if line.startswith(b":")]

    @property
    def words(self) -> str:
        """The words of its comment lines, joined by spaces; "" when it has none."""
        return " ".join(self.comments).strip()

    @property
    def json(self):
        """The event's data as JSON (a dict for the events stages read), parsed once;
        None for a comment, `[DONE]` or data that is not JSON."""
        if self._obj is _UNREAD:
            self._obj = None
            if self.data is not None and not self.is_done:
                from .guard import answer_json
                try:
                    self._obj = answer_json(self.data)
                except ValueError:
                    pass
        return self._obj

    def __repr__(self) -> str:
        return f"Event({self.raw!r})"


def keepalive() -> list[Event]:
    """The keep-alive comment, as the stages pass events: a list (one write) of
    its one event (a new one each time)."""
    return [Event(KEEPALIVE, None)]


def done() -> Event:
    """The `[DONE]` event that ends an OpenAI stream."""
    return Event(DONE, "[DONE]")


def emit(obj) -> bytes:
    """One `data:` event carrying obj as compact JSON."""
    return _framed(None, _dumps(obj, ascii=True))


def event(name: str, obj: dict) -> bytes:
    """One named event (`event:` + `data:`), as Anthropic and Responses streams use."""
    return _framed(name, _dumps(obj, ascii=False))


def _dumps(obj, ascii: bool) -> str:
    """obj as compact JSON on one line (a `data:` payload)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii)


def _framed(name: str | None, data: str) -> bytes:
    """One event of this one-line data (named when `name`)."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + data.encode() + b"\n\n"


def comment(text: str = "keep-alive") -> bytes:
    """A comment line (clients ignore it; it keeps a waiting stream alive)."""
    return b": " + " ".join(text.split()).encode("utf-8", "replace") + b"\n\n"


class Parser:
    """Incremental SSE parser: feed() bytes, get complete events back (or take()
    the bytes of the events a read completed, to look at them whole).

    Handles \\n, \\r\\n and \\r line endings (events come out with \\n) and events
    split across reads.
    """

    def __init__(self) -> None:
        self._buf = b""

    def take(self, chunk: bytes) -> bytes:
        """The bytes of every event that `chunk` completes, up to the last blank line
        (b"" if none); an incomplete event stays here for the next read."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            # a \r at the end may be the first half of a \r\n: decide next time
            cr = buf.endswith(b"\r")
            buf = buf[:-1] if cr else buf
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if cr:
                buf += b"\r"
        i = buf.rfind(b"\n\n")
        if i < 0:
            self._buf = buf
            return b""
        end = i + 2
        if i and buf[i - 1] == 10:
            # blank lines pair off from the left: in a run of newlines, an odd one
            # out (the run's last) begins the next event
            run = i - 1
            while run and buf[run - 1] == 10:
                run -= 1
            end = run + (end - run) // 2 * 2
        if end == len(buf):
            self._buf = b""
            return buf
        self._buf = buf[end:]
        return buf[:end]

    def pending(self) -> bytes:
        """The bytes of an incomplete event held for the next read, handed back
        as they are (for a caller that passes the rest of the stream through)."""
        pending, self._buf = self._buf, b""
        return pending

    def feed(self, chunk: bytes) -> list[Event]:
        return events(self.take(chunk))

    def rest(self) -> bytes:
        """What is left when the stream ends: an unterminated last event, terminated
        (b"" if nothing is left)."""
        rest, self._buf = self._buf, b""
        if rest.endswith(b"\r"):
            rest = rest[:-1] + b"\n"
        return rest.rstrip(b"\n") + b"\n\n" if rest.strip() else b""

    def flush(self) -> list[Event]:
        """Whatever is left when the stream ends (an unterminated last event)."""
        return events(self.rest())


def split(whole: bytes) -> list[bytes]:
    """Whole events' bytes (as Parser.take gives them) cut into events, blank ones too."""
    parts = whole.split(b"\n\n")
    parts.pop()
    return [p + b"\n\n" for p in parts]


def events(whole: bytes) -> list[Event]:
    """Whole events' bytes (as Parser.take gives them) parsed; blank ones left out."""
    if not whole:
        return []
    return [ev for ev in map(parse_event, split(whole)) if ev is not None]


def parse_event(raw: bytes) -> Event | None:
    """One event's bytes (up to its blank line) as an Event; None for a blank one."""
    if raw[:6] == b"data: " and raw.find(b"\n") == len(raw) - 2:
        # one `data: ` line, most events of a model's stream: no lines to split
        return Event(raw=raw, data=raw[6:-2].decode("utf-8", "replace"))
    if not raw.strip(b"\n"):
        return None
    data_lines = []
    name = None
    for line in raw.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data_lines.append(value)
        elif field == b"event":
            name = value.strip().decode("utf-8", "replace")
    data = b"\n".join(data_lines).decode("utf-8", "replace") if data_lines else None
    return Event(raw=raw, data=data, name=name)


def json_event(raw: bytes) -> tuple[Event, dict] | None:
    """One event's bytes as (the Event, its JSON object); None when it is blank, a
    comment, `[DONE]`, or its data is not a JSON object."""
    ev = parse_event(raw)
    if ev is None or ev.data is None or ev.is_done:
        return None
    try:
        obj = json.loads(ev.data)
    except ValueError:
        return None
    return (ev, obj) if isinstance(obj, dict) else None


def iter_events(chunks: Iterable[bytes]) -> Iterator[Event]:
    for whole in batches(chunks):
        yield from events(whole)


def batches(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """A stream's whole events, one piece per read that completed any: the bytes of
    every event that read completed (CR-normalised), then an unterminated last event."""
    parser = Parser()
    for chunk in chunks:
        whole = parser.take(chunk)
        if whole:
            yield whole
    rest = parser.rest()
    if rest:
        yield rest


# ------------------------------------------------------------ the reader and the writer

def read(chunks: Iterable[bytes]) -> Iterator[list[Event]]:
    """THE reader: a byte stream as lists of events, one list per read that completed
    any (an empty list for an empty piece: the head, now), then an unterminated last
    event. Blank events' bytes go with a neighbour (the writer sends them as they
    came)."""
    parser = Parser()
    try:
        for chunk in chunks:
            if not chunk:
                yield []
                continue
            whole = parser.take(chunk)
            if whole:
                yield batch(whole)
        rest = parser.rest()
        if rest:
            yield batch(rest)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def batch(whole: bytes) -> list[Event]:
    """Whole events' bytes (as Parser.take gives them) as events, blank ones glued
    to the event before (or after) them."""
    out: list[Event] = []
    blank = b""
    for raw in split(whole):
        ev = parse_event(raw)
        if ev is None:
            if out:
                out[-1].raw += raw
            else:
                blank += raw
            continue
        if blank:
            ev.raw, blank = blank + ev.raw, b""
        out.append(ev)
    if blank:
        out.append(Event(blank, None))
    return out


def events_of(body: Iterable) -> Iterator[list[Event]]:
    """A stage's input as lists of events: an earlier stage's Body as it is (its
    events, not read again), anything else (bytes) through the reader."""
    if isinstance(body, Body):
        return body.take()
    return read(body)


def write(batches: Iterable[list[Event]]) -> Iterator[bytes]:
    """THE writer: each list of events in one write; an event no stage changed goes
    out as it came, byte for byte."""
    for evs in batches:
        yield evs[0].raw if len(evs) == 1 else b"".join(ev.raw for ev in evs)


class Body:
    """A streamed answer's events as the WSGI server takes them: bytes, one write per
    list of events (the writer). A later stage takes the events themselves (take),
    never the bytes; the request's record sees each list once it has gone (`sent`,
    called with the list and the time it was handed on) and the end (`ended`)."""

    __slots__ = ("batches", "sent", "ended", "_it", "_taken")

    def __init__(self, batches: Iterable[list[Event]]):
        self.batches = batches
        self.sent: Callable[[list[Event], float], None] | None = None
        self.ended: Callable[[], None] | None = None
        self._it = None
        self._taken = False

    def take(self) -> Iterator[list[Event]]:
        self._taken = True
        return iter(self.batches)

    def __iter__(self) -> Iterator[bytes]:
        if self._it is None:
            self._it = self._write()
        return self._it

    def __next__(self) -> bytes:
        """The next write (a Body is the iterator of its writes, as a generator of
        bytes is)."""
        return next(iter(self))

    def _write(self) -> Iterator[bytes]:
        sent = self.sent
        try:
            for evs in self.batches:
                now = time.perf_counter()
                yield evs[0].raw if len(evs) == 1 else b"".join(ev.raw for ev in evs)
                if sent is not None and evs:
                    sent(evs, now)
        finally:
            self._close_batches()
            if self.ended is not None:
                ended, self.ended = self.ended, None
                ended()

    def _close_batches(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        if self._it is not None:
            self._it.close()
        else:
            self._close_batches()
            if self.ended is not None:
                ended, self.ended = self.ended, None
                ended()
