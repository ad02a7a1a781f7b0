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

    @property
    def is_done(self) -> bool:
        return self.data is not None and self.data.strip() == "[DONE]"


def emit(obj) -> bytes:
    """One `data:` event carrying obj as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def comment(text: str = "keep-alive") -> bytes:
    """A comment line (clients ignore it; it keeps a waiting stream alive)."""
    return b": " + " ".join(text.split()).encode("utf-8", "replace") + b"\n\n"


class Parser:
    """Incremental SSE parser: feed() bytes, get complete events back.

    Handles \\n, \\r\\n and \\r line endings and events split across reads.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        if b"\r" in self._buf:
            self._buf = self._buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            raw = self._buf[:end + 2]
            self._buf = self._buf[end + 2:]
            ev = _parse_event(raw)
            if ev is not None:
                events.append(ev)
        return events

    def flush(self) -> list[Event]:
        """Whatever is left when the stream ends (an unterminated last event)."""
        rest, self._buf = self._buf, b""
        if rest.strip():
            ev = _parse_event(rest.rstrip(b"\n") + b"\n\n")
            return [ev] if ev is not None else []
        return []


def _parse_event(raw: bytes) -> Event | None:
    data_lines = []
    for line in raw.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data_lines.append(value)
    if not raw.strip(b"\n"):
        return None
    data = b"\n".join(data_lines).decode("utf-8", "replace") if data_lines else None
    return Event(raw=raw, data=data)


def iter_events(chunks: Iterable[bytes]) -> Iterator[Event]:
    parser = Parser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.flush()


def json_events(chunks: Iterable[bytes]) -> Iterator[tuple[str | None, object]]:
    """A stream's JSON-object events as (`event:` name or None, object), up to
    `[DONE]`; a comment comes as (":", its raw bytes). Data that is not a JSON
    object is skipped."""
    for ev in iter_events(chunks):
        if ev.data is None:
            yield ":", ev.raw
            continue
        if ev.is_done:
            return
        try:
            obj = json.loads(ev.data)
        except ValueError:
            continue
        if isinstance(obj, dict):
            name = None
            for line in ev.raw.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip().decode()
            yield name, obj


# Anthropic's error types by HTTP status (its SSE and JSON error shape).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def error_event(path: str, message: str, status: int, code: str | None = None,
                type_: str | None = None) -> bytes:
    """The event that ends a stream with an error, in the stream's dialect:
    Anthropic Messages (`event: error`), OpenAI Responses (`event: error`), or
    chat/completions (`data: {"error": ...}`)."""
    p = path.strip("/")
    if p.endswith("messages"):
        obj = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                          "message": message}}
        return b"event: error\n" + emit(obj)
    if p.endswith("responses"):
        return b"event: error\n" + emit({"type": "error", "code": code, "message": message,
                                         "param": None})
    from .errors import error_body
    return emit(error_body(message, status, type_, code))
