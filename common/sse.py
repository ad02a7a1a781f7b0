"""Server-sent events framing: parse an upstream byte stream into events, emit events.

No model logic here. OpenAI-style streams use `data:` lines only; comments
(lines starting with `:`) are keep-alives.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


@dataclass
class Event:
    raw: bytes          # the event's bytes including the terminating blank line
    data: str | None    # joined `data:` payload, None for comment-only events
    name: str | None = None     # the `event:` field

    @property
    def is_done(self) -> bool:
        return self.data is not None and self.data.strip() == "[DONE]"


def emit(obj) -> bytes:
    """One `data:` event carrying obj as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def event(name: str, obj: dict) -> bytes:
    """One named event (`event:` + `data:`), as Anthropic and Responses streams use."""
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")


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


def json_batches(chunks: Iterable[bytes]) -> Iterator[list[tuple[str | None, object]]]:
    """A stream's JSON-object events as (`event:` name or None, object), one list per
    read, up to `[DONE]`; a comment comes as (":", its raw bytes). Data that is not a
    JSON object is skipped."""
    for whole in batches(chunks):
        out: list[tuple[str | None, object]] = []
        for ev in events(whole):
            if ev.data is None:
                out.append((":", ev.raw))
                continue
            if ev.is_done:
                if out:
                    yield out
                return
            try:
                obj = json.loads(ev.data)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append((ev.name, obj))
        if out:
            yield out


def json_events(chunks: Iterable[bytes]) -> Iterator[tuple[str | None, object]]:
    """json_batches(chunks), one event at a time."""
    for batch in json_batches(chunks):
        yield from batch


def error_event(path: str, message: str, status: int, code: str | None = None,
                type_: str | None = None) -> bytes:
    """The event that ends a stream with an error, in the stream's dialect (the
    one whose route's last part `path` ends with: common/dialects.py): Anthropic
    Messages (`event: error`), OpenAI Responses (`event: error`), or else
    chat/completions' (`data: {"error": ...}`)."""
    from .dialects import WIRES
    from .errors import error_body
    p = path.strip("/")
    for w in WIRES:
        if w.error_event is not None and p.endswith(w.path.rsplit("/", 1)[1]):
            return w.error_event(message, status, code)
    return emit(error_body(message, status, type_, code))
