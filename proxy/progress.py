"""Progress that a waiting stream's client counts, in its dialect.

A streamed request waits before its first event -- in the swapper's queue, behind a
hold, for a download, a load, a restore, or the backend's prefill (llama-server
sends nothing until the first token). What it sends meanwhile are SSE comments: the
swapper's (`: loading model qwen (12 s), ~40 s left`) and the proxy's own
(`: keep-alive`). Agents' idle timers do not count comments (measured: Qwen Code
drops the stream after its 240 s, Claude Code after 300 s, and sends it again), so
until the first event with data each comment is followed by the dialect's own
progress:

- chat completions: a role chunk, then a chunk with an empty content delta
  (`{"choices": [{"index": 0, "delta": {"content": ""}}]}`): Qwen Code, OpenCode,
  Continue and Aider accept them and their timers count them; the answer's text is
  unchanged.
- Anthropic Messages (a client that takes thinking blocks: `wanted`): `message_start`,
  then a `thinking` block (index 0) whose deltas
  say what the request waits for. Claude Code's idle timer counts every event but
  `ping` (its stream watchdog). When the backend's first event comes, the block ends
  with the signature MARKER, the backend's `message_start` is left out (its usage goes
  to the `message_delta`) and every content block index after it is one more. When
  the agent sends that turn back, `strip()` removes the block: the prompt (and the
  backend's prompt cache) is exactly what it would have been without the wait.
- Responses: `response.created`, then `response.in_progress` events (Codex's idle
  timer counts every event); the backend's own `response.created` is left out.

A stream that never waited passes untouched (one look at its first piece).
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Iterable, Iterator

from common import sse

# The signature of our progress thinking block (Messages): how strip() knows it.
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


class _Chat:
    def __init__(self, body: dict):
        self.head = {"id": "chatcmpl-" + uuid.uuid4().hex[:24],
                     "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": body.get("model") or ""}
        self.opened = False

    def tick(self, text: str) -> bytes:
        delta = {"content": ""}
        if not self.opened:
            self.opened = True
            delta = {"role": "assistant", "content": ""}
        return sse.emit({**self.head, "choices": [
            {"index": 0, "delta": delta, "finish_reason": None}]})

    def then(self, first: list[bytes], parser: sse.Parser, it) -> Iterator[bytes]:
        yield b"".join(first) + parser.pending()
        yield from it


class _Messages:
    def __init__(self, body: dict):
        self.model = body.get("model")
        self.opened = False
        self.last = None

    def tick(self, text: str) -> bytes:
        out = b""
        if not self.opened:
            self.opened = True
            out = sse.event("message_start", {"type": "message_start", "message": {
                "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": None,
                "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
            out += sse.event("content_block_start", {
                "type": "content_block_start", "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            text = text or "waiting for the model"
        words = text + "\n" if text and text != self.last else ""
        if text:
            self.last = text
        return out + sse.event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "thinking_delta", "thinking": words}})

    def then(self, first: list[bytes], parser: sse.Parser, it) -> Iterator[bytes]:
        """The backend's events after our block: its message_start left out (its usage
        kept for the message_delta), every block index one more; the events of each
        read in one write."""
        self.usage: dict = {}
        yield (sse.event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "signature_delta", "signature": MARKER}})
            + sse.event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + b"".join(map(self._moved, first)))
        for piece in it:
            whole = parser.take(piece)
            if whole:
                yield b"".join(map(self._moved, sse.split(whole)))
        rest = parser.rest()
        if rest:
            yield self._moved(rest)

    def _moved(self, raw: bytes) -> bytes:
        parsed = sse.json_event(raw)
        if parsed is None:
            return raw
        ev, obj = parsed
        kind = obj.get("type")
        if kind == "message_start":
            u = (obj.get("message") or {}).get("usage")
            if isinstance(u, dict):
                self.usage = {k: v for k, v in u.items() if k != "output_tokens"}
            return b""
        if kind in ("content_block_start", "content_block_delta", "content_block_stop") \
                and isinstance(obj.get("index"), int):
            obj["index"] += 1
        elif kind == "message_delta" and self.usage:
            u = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
            obj["usage"] = {**self.usage, **{k: v for k, v in u.items() if v is not None}}
        else:
            return raw
        return sse.event(ev.name or kind, obj)


class _Responses:
    def __init__(self, body: dict):
        self.response = {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response",
                         "created_at": int(time.time()), "status": "in_progress",
                         "model": body.get("model") or "", "output": []}
        self.opened = False

    def tick(self, text: str) -> bytes:
        out = b""
        if not self.opened:
            self.opened = True
            out = sse.event("response.created", {"type": "response.created",
                                                  "response": self.response})
        return out + sse.event("response.in_progress", {"type": "response.in_progress",
                                                         "response": self.response})

    def then(self, first: list[bytes], parser: sse.Parser, it) -> Iterator[bytes]:
        """The backend's events, its response.created left out (ours went first) and
        its lifecycle events (in_progress, completed, ...) under our response's id:
        the OpenAI SDK refuses a stream whose response changes identity."""
        yield b"".join(map(self._ours, first))
        for piece in it:
            whole = parser.take(piece)
            if whole:
                yield b"".join(map(self._ours, sse.split(whole))) \
                    if _LIFECYCLE.search(whole) else whole
        rest = parser.rest()
        if rest:
            yield self._ours(rest)

    def _ours(self, raw: bytes) -> bytes:
        if not _LIFECYCLE.search(raw):
            return raw
        parsed = sse.json_event(raw)
        if parsed is None:
            return raw
        ev, obj = parsed
        kind = obj.get("type")
        if kind == "response.created":
            return b""
        if not kind or not isinstance(obj.get("response"), dict):
            return raw
        obj["response"]["id"] = self.response["id"]
        return sse.event(ev.name or kind, obj)


_LIFECYCLE = re.compile(rb'"response\.(?:created|queued|in_progress|completed|failed|incomplete)"')


WAITING = {"chat": _Chat, "messages": _Messages, "responses": _Responses}


def wanted(dialect: str, body: dict, environ: dict) -> bool:
    """Whether this request's client gets progress events. Messages: only a client
    that takes thinking blocks -- one that asked for thinking (Claude Code sends
    `thinking: {"type": "adaptive"}`), or Claude Code itself (its session header, its
    user agent: its small calls ask for no thinking) -- since a thinking block first
    would surprise a program that reads `content[0].text`; other Messages clients
    get the comments only, as before. Chat and Responses: every client (their
    progress events carry no content)."""
    if dialect != "messages":
        return True
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"):
        return True
    return bool(environ.get("HTTP_X_CLAUDE_CODE_SESSION_ID")) or \
        str(environ.get("HTTP_USER_AGENT", "")).startswith("claude-cli/")


def kept_in_progress(dialect: str, body: dict, pieces: Iterable[bytes],
                     environ: dict | None = None) -> Iterator[bytes]:
    """The client's stream (`pieces`, as the dialect's relay makes it), its comments
    before the first event with data made the dialect's progress (see above). A
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
                    waiting = waiting or WAITING[dialect](body)
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


def strip(dialect: str, body: dict) -> bool:
    """Our progress block out of the conversation an agent sends back (Messages:
    an assistant turn's thinking block signed MARKER); True when the body changed."""
    if dialect != "messages":
        return False
    changed = False
    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else ():
        c = m.get("content") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(c, list) or not any(_ours(b) for b in c):
            continue
        m["content"] = [b for b in c if not _ours(b)]
        changed = True
    if changed:
        body["messages"] = [m for m in msgs if not (isinstance(m, dict) and
                                                    m.get("content") == [])]
    return changed


def _ours(block) -> bool:
    return isinstance(block, dict) and block.get("type") == "thinking" and \
        block.get("signature") == MARKER
