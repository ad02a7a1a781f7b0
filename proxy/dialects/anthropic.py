"""Anthropic Messages (`POST /v1/messages`, Claude Code) with its server search tool.

A request whose `tools` hold `{"type": "web_search_20250305", "name": "web_search", ...}`
gets the search run here: the backend (which speaks Messages itself) is offered a plain
custom tool `web_search` (input `query`); each of its `tool_use` calls is run against
SearXNG and answered with a `tool_result`. The client sees what Anthropic's API returns:
`server_tool_use` (id `srvtoolu_…`) and `web_search_tool_result` blocks, the answer text
with `web_search_result_location` citations where the model cites [n], and
`usage.server_tool_use.web_search_requests`. Client tools come back untouched.
Errors are in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""
from __future__ import annotations

import base64
import copy
import json
import uuid
from typing import Iterable, Iterator

from flask import Response

from common import sse
from common.dialects import MESSAGES
from common.errors import ApiError, anthropic_error

from ..search import engine
from ..search.engine import Search, Turn, cited, new_id

from .. import agents, progress
from .base import (TOOL_NAME, Adapter, Dialect, event, parse_json_object, put_system,
                   server_search)

SERVER_TOOL_TYPES = ("web_search_20250305", "web_search_20260209")
CUSTOM_TOOL = {"name": TOOL_NAME, "description": engine.TOOL_DESCRIPTION,
               "input_schema": engine.TOOL_PARAMETERS}


def stream_error(message: str, status: int, code: str = "") -> list[sse.Event]:
    """An error ending a stream whose status is sent already: Anthropic's error
    event (its type from the status: a 400 is invalid_request_error)."""
    return event("error", anthropic_error(message, status))


def server_tool(body: dict) -> dict | None:
    for t in body.get("tools") or []:
        if isinstance(t, dict) and t.get("type") in SERVER_TOOL_TYPES:
            return t
    return None


def validate(body: dict) -> None:
    def bad(msg):
        raise ApiError(msg, 400, code="invalid_request")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        bad("messages: a non-empty list of {role, content} is required")
    for i, m in enumerate(msgs):
        # roles are the backend's business (Claude Code sends "system" ones too)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            bad(f"messages.{i}.role: must be a string")
        if not isinstance(m.get("content"), (str, list)):
            bad(f"messages.{i}.content: must be a string or a list of content blocks")
        for j, b in enumerate(m["content"] if isinstance(m["content"], list) else []):
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                bad(f"messages.{i}.content.{j}: must be a content block with a 'type'")
    if body.get("system") is not None and not isinstance(body["system"], (str, list)):
        bad("system: must be a string or a list of text blocks")
    if "tools" in body and not isinstance(body["tools"], list):
        bad("tools: must be a list")
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            bad(f"tools.{i}: must be a tool with a 'name'")
    mt = body.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        bad("max_tokens: must be a positive integer")
    t = server_tool(body)
    if t is not None:
        mu = t.get("max_uses")
        if mu is not None and (not isinstance(mu, int) or isinstance(mu, bool) or mu < 1):
            bad("tools.web_search.max_uses: must be a positive integer")
        if t.get("allowed_domains") and t.get("blocked_domains"):
            bad("tools.web_search: use allowed_domains or blocked_domains, not both")


PATH = MESSAGES.path
FLOOR_KEYS = ("max_tokens",)


def parse(raw: bytes) -> dict:
    body = parse_json_object(raw, "an Anthropic Messages request with 'messages'")
    validate(body)
    return body


def system_prompt(body: dict, text) -> bool:
    return put_system(body, "system", text)


def search_tool(body: dict, settings) -> tuple[dict | None, bool]:
    return server_search(body, settings, server_tool(body))


def straight_stream(chunks, body, names=None):
    return with_message_start(chunks, body.get("model"))


def straight_whole(content: bytes, names=None) -> bytes:
    return content


# ================================================================= blocks

def turn_of(blocks: list[dict], stop_reason=None, usage=None) -> Turn:
    t = Turn()
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            continue
        if b.get("type") == "text":
            t.text(b.get("text"))
        elif b.get("type") == "thinking":
            t.think(b.get("thinking"))
        elif b.get("type") == "tool_use":
            t.call(i, b.get("id"), b.get("name") or "")
            t.args(i, json.dumps(b.get("input") or {}))
    t.finish = stop_reason
    if isinstance(usage, dict):
        t.usage(usage.get("output_tokens"))
    return t


def _opaque(*parts) -> str:
    return base64.b64encode(json.dumps(parts).encode()).decode()


def server_tool_use(s: Search) -> dict:
    return {"type": "server_tool_use", "id": s.call.client_id, "name": TOOL_NAME,
            "input": {"query": s.query if s.query is not None else s.call.args}}


def search_result_block(s: Search) -> dict:
    if s.error:
        content = {"type": "web_search_tool_result_error", "error_code": s.error}
    else:
        content = [{"type": "web_search_result", "url": src.url, "title": src.title,
                    "encrypted_content": _opaque(src.n, src.snippet),
                    "page_age": src.date or None} for src in s.sources]
    return {"type": "web_search_tool_result", "tool_use_id": s.call.client_id, "content": content}


def citations_for(text: str, searcher) -> list[dict]:
    return [{"type": "web_search_result_location", "url": src.url, "title": src.title,
             "encrypted_index": _opaque(src.n), "cited_text": src.snippet[:150]}
            for src in cited(text, searcher.sources.items)]


def _block(index: int, block: dict) -> list[sse.Event]:
    """A whole server-side block as its start/delta/stop events (a server_tool_use's
    input goes as one input_json_delta, as Anthropic's API sends it)."""
    if block["type"] == "server_tool_use":
        out = event("content_block_start", {"type": "content_block_start", "index": index,
                                            "content_block": {**block, "input": {}}})
        out += event("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
    else:
        out = event("content_block_start", {"type": "content_block_start", "index": index,
                                            "content_block": block})
    return out + event("content_block_stop", {"type": "content_block_stop", "index": index})


def _stop_reason(turn: Turn) -> str:
    if turn.theirs:
        return "tool_use"
    if turn.finish in (None, "tool_use"):
        return "end_turn"
    return turn.finish


def message_start(msg_id: str, model) -> dict:
    """An Anthropic stream's message_start: an empty assistant message, no usage yet."""
    return {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0}}}


def with_message_start(chunks: Iterable, model) -> sse.Body:
    """A Messages stream from the backend (bytes, or an earlier stage's events),
    made to begin with message_start (relayed as it is, or read by the web_search
    rounds).

    llama-server now and then leaves it out of a short stream (its first tokens
    reach the stream writer together with the final result; seen 2 in 11 runs
    of tests/integration/test_metrics.py), and the Anthropic SDK, Claude Code's,
    builds its message from message_start: without it first, the answer fails
    or comes out empty. A stream that begins with an error stays as it is.
    Comments (the swapper's `: loading model` lines) pass at once; once the
    first event with data has been seen, the rest passes untouched."""
    return sse.Body(_with_message_start(sse.events_of(chunks), model))


def _with_message_start(batches, model) -> Iterator[list[sse.Event]]:
    try:
        for evs in batches:
            for i, ev in enumerate(evs):
                if ev.data is None:
                    continue                      # a comment
                kind = ev.name                    # one parse per stream at most: its first event
                if not kind:
                    obj = ev.json
                    kind = obj.get("type") if isinstance(obj, dict) else None
                if kind not in ("message_start", "error"):
                    evs = evs[:i] + [sse.Event.of(message_start(new_id("msg_"), model),
                                                  "message_start")] + evs[i:]
                yield evs
                yield from batches
                return
            yield evs
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _grow(block: dict, key: str, piece: str | None) -> None:
    """A streamed block's field grows by pieces, joined once (see _joined)."""
    block.setdefault("_" + key, []).append(piece or "")


def _joined(block: dict, key: str) -> str:
    return (block.get(key) or "") + "".join(block.get("_" + key, ()))


# a delta's type -> (the block's growing field, the delta's field)
_GROWS = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
          "input_json_delta": ("args", "partial_json")}


class _Round:
    """What one streamed round has told so far."""

    def __init__(self):
        self.blocks: dict[int, dict] = {}       # backend index -> block as it builds up
        self.where: dict[int, int | None] = {}  # backend index -> client index (None: held)
        self.usage: dict = {}                   # its usage, message_start's and message_delta's
        self.over = self.failed = False         # it ended (message_stop, an error event)

    def finished(self) -> list[dict]:
        """The round's blocks, whole, in the backend's order."""
        blocks = [self.blocks[i] for i in sorted(self.blocks)]
        for b in blocks:
            for key in ("text", "thinking"):
                if "_" + key in b:
                    b[key] = _joined(b, key)
                    del b["_" + key]
            args = b.pop("_args", [])
            if b.get("type") == "tool_use":
                try:
                    b["input"] = json.loads("".join(args) or "{}")
                except ValueError:
                    b["input"] = {}
        return blocks


# ================================================================= the adapter

def ping() -> list[sse.Event]:
    return event("ping", {"type": "ping"})


class MessagesAdapter(Adapter):
    path = PATH
    call_prefix = "srvtoolu_"

    @property
    def keepalive(self) -> list[sse.Event]:
        """`ping`, but in a later round's wait (its prefill reads our search results,
        after the stream has begun) for a client that takes thinking blocks: a thinking
        block (at the client's next index) whose deltas Claude Code's idle timer counts
        (not pings); closed, signed progress.MARKER, when the round's events come, and
        taken out of the history the client sends back (Progress.strip)."""
        if not (self.streaming and self.started and self.searcher.rounds) or \
                self.in_search or not Progress.wanted(self.body, self.environ):
            return ping()
        delta = event("content_block_delta", {
            "type": "content_block_delta", "index": self.nxt,
            "delta": {"type": "thinking_delta",
                      "thinking": "" if self.paused else "reading the search results\n"}})
        if self.paused:
            return delta
        self.paused = True
        return event("content_block_start", {
            "type": "content_block_start", "index": self.nxt,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""}}) + delta

    def _resume(self) -> list[sse.Event]:
        """Our progress block of a later round's wait closed, its index taken."""
        if not self.paused:
            return []
        self.paused = False
        i, self.nxt = self.nxt, self.nxt + 1
        return event("content_block_delta", {
            "type": "content_block_delta", "index": i,
            "delta": {"type": "signature_delta", "signature": progress.MARKER}}) + \
            event("content_block_stop", {"type": "content_block_stop", "index": i})

    def __init__(self, body: dict, tool: dict, parts: dict, request):
        super().__init__(body, tool, parts, request)
        self.tools = [copy.deepcopy(CUSTOM_TOOL)
                      if isinstance(t, dict) and t.get("type") in SERVER_TOOL_TYPES else t
                      for t in body.get("tools") or []]
        self.messages = list(body["messages"])
        tc = body.get("tool_choice")
        self.forced = isinstance(tc, dict) and tc.get("type") in ("tool", "any")
        self.blocks: list[dict] = []        # the round's, as the backend sent them
        self.content: list[dict] = []       # whole: the client's blocks of earlier rounds
        self.head: dict | None = None       # whole: the first round's message
        self.last: dict = {}                # whole: the round's message
        self.streaming = False
        self.started = False                # stream: message_start sent
        self.nxt = 0                        # stream: the client's next block index
        self.stop: dict = {}                # stream: the round's message_delta
        self.inp = self.out = 0             # the last round's input, every round's output
        self.cache: dict = {}               # the last round's cache_*_input_tokens
        self.in_search = False              # stream: our searches run (their blocks open)
        self.paused = False                 # stream: our progress block open at nxt

    def round_body(self, stream: bool) -> dict:
        b = dict(self.body)                 # the client's key order: a stable prompt
        b["messages"] = self.messages
        b["stream"] = stream
        tools = self.tools
        if not self.searcher.budget_left:
            tools = [t for t in tools if t.get("name") != TOOL_NAME]
        if not tools:
            b.pop("tools", None)
            b.pop("tool_choice", None)
            return b
        b["tools"] = tools
        tc = b.get("tool_choice")
        if isinstance(tc, dict) and (
                self.searcher.rounds and self.forced     # forcing every round never ends
                or tc.get("name") and tc["name"] not in [t.get("name") for t in tools]):
            b["tool_choice"] = {"type": "auto"}
        return b

    def body_of(self, resp):
        """The backend's events, beginning with message_start."""
        return with_message_start(super().body_of(resp), self.body.get("model"))

    def searching(self, calls) -> list[sse.Event]:
        """The first search's server_tool_use block while they all run (use, result,
        use, result... as Anthropic's API sends them), then a ping."""
        if not self.streaming:
            return []
        self.in_search = True
        return _block(self.nxt, server_tool_use(Search(calls[0], calls[0].query, ""))) + \
            self.keepalive

    def searched(self, turn: Turn, searches: list[Search]) -> list[sse.Event]:
        """The round as the backend sees it next time: its turn, then our tool results."""
        self.in_search = False
        self.messages = self.messages + [
            {"role": "assistant", "content": self.blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": s.call.id,
                                          "content": s.text} for s in searches]}]
        if not self.streaming:
            self.content += [b for b in self.blocks if b.get("type") != "tool_use"]
            for x in searches:
                self.content += [server_tool_use(x), search_result_block(x)]
            return []
        out = []
        for k, x in enumerate(searches):
            if k:
                out += _block(self.nxt + 2 * k, server_tool_use(x))
            out += _block(self.nxt + 2 * k + 1, search_result_block(x))
        self.nxt += 2 * len(searches)
        return out

    def _round_usage(self, u) -> None:
        """One round's usage: its prompt side (input_tokens, the cache_* counts) is
        what the client gets (the conversation as the model last read it, what a
        direct request reports; Claude Code sizes its context from it), its
        output_tokens add to the rounds' (see chat._usage_add)."""
        if not isinstance(u, dict):
            return
        if isinstance(u.get("input_tokens"), int):
            self.inp = u["input_tokens"]
        cache = {k: v for k, v in u.items() if k.startswith("cache_") and isinstance(v, int)}
        if cache:
            self.cache = cache

    def _usage(self) -> dict:
        return {"input_tokens": self.inp, **self.cache, "output_tokens": self.out,
                "server_tool_use": {"web_search_requests": self.searcher.searches}}

    def _cited(self, b: dict, text: str) -> list[dict]:
        return citations_for(text, self.searcher) \
            if b.get("type") == "text" and self.searcher.searches else []

    # ------------------------------------------------------------ whole answers

    def turn_of(self, r) -> Turn:
        try:
            msg = r.json()
            blocks = msg["content"]
            if not isinstance(blocks, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise ApiError(f"upstream returned an unexpected Messages response: "
                           f"{r.content[:200]!r}", 502, code="bad_upstream_response")
        self.head = self.head or msg
        self.last, self.blocks = msg, blocks
        turn = turn_of(blocks, msg.get("stop_reason"), msg.get("usage"))
        self.cache = {}
        self._round_usage(msg.get("usage"))
        self.out += turn.usage_out
        return turn

    def answer(self, turn: Turn) -> Response:
        content = self.content
        for b in self.blocks:
            if b.get("type") == "tool_use" and b.get("name") == TOOL_NAME:
                continue                    # ours, in a client's turn: dropped
            cites = self._cited(b, b.get("text") or "")
            content.append({**b, "citations": cites} if cites else b)
        head = self.head
        result = {"id": head.get("id") or new_id("msg_"), "type": "message",
                  "role": "assistant", "model": head.get("model") or self.body.get("model"),
                  "content": content, "stop_reason": _stop_reason(turn),
                  "stop_sequence": self.last.get("stop_sequence"), "usage": self._usage()}
        return Response(json.dumps(result, ensure_ascii=False), status=200,
                        mimetype="application/json")

    # ------------------------------------------------------------ streams

    def relay(self, resp):
        """One backend stream's events, renumbered for the client (our tool_use
        blocks held back), each through its handler in ON; the round's Turn, or None
        when it ended the stream."""
        self.streaming = True
        self.stop = {}
        rnd = _Round()
        yield from self.events(resp, rnd)
        if rnd.failed:
            return None
        if not self.stop:
            yield self.fail("the upstream stream ended before message_delta", 502, "")
            return None
        self.cache = {}
        self._round_usage(rnd.usage)
        self.blocks = rnd.finished()
        return turn_of(self.blocks, self.stop.get("stop_reason"))

    def resumed(self) -> list[sse.Event]:
        """The round's first event ends our progress block (a later round's wait)."""
        return self._resume()

    def _message_start(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        """The first round's, with our usage field; a later round's only its usage."""
        m = obj.get("message") or {}
        u = m.get("usage") or {}
        rnd.usage.update(u)
        if self.started:
            return []
        self.started = True
        m = {**m, "content": [], "usage": {**u, "server_tool_use": {"web_search_requests": 0}}}
        return event("message_start", {"type": "message_start", "message": m})

    def _block_start(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        """A block at the client's next index; our tool_use blocks held back."""
        bi = obj.get("index", 0)
        b = copy.deepcopy(obj.get("content_block") or {})
        if b.get("type") == "tool_use":
            b["_args"] = [json.dumps(b["input"])] if b.get("input") else []
        rnd.blocks[bi] = b
        if b.get("type") == "tool_use" and b.get("name") == TOOL_NAME:
            rnd.where[bi] = None
            return []
        rnd.where[bi] = obj["index"] = self.nxt
        self.nxt += 1
        return event("content_block_start", obj)

    def _block_delta(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        bi = obj.get("index", 0)
        b = rnd.blocks.get(bi)
        if b is None:
            b = rnd.blocks[bi] = {"type": "text", "text": ""}
        d = obj.get("delta") or {}
        grows = _GROWS.get(d.get("type")) if isinstance(d.get("type"), str) else None
        if grows is not None:
            _grow(b, grows[0], d.get(grows[1]))
        if rnd.where.get(bi) is None:
            return []
        obj["index"] = rnd.where[bi]
        return event("content_block_delta", obj)

    def _block_stop(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        """A block's end, after the citations of its text."""
        ci = rnd.where.get(obj.get("index", 0))
        if ci is None:
            return []
        b = rnd.blocks.get(obj.get("index", 0)) or {}
        out = []
        for c in self._cited(b, _joined(b, "text")):
            out += event("content_block_delta", {
                "type": "content_block_delta", "index": ci,
                "delta": {"type": "citations_delta", "citation": c}})
        obj["index"] = ci
        return out + event("content_block_stop", obj)

    def _message_delta(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        """The round's stop and usage, kept for the client's one message_delta."""
        self.stop = obj.get("delta") or {}
        u = obj.get("usage") or {}
        self.out += u.get("output_tokens") or 0
        # input tokens come in message_start, or only here
        rnd.usage.update({k: v for k, v in u.items() if k != "output_tokens" and v is not None})
        return []

    def _message_stop(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        rnd.over = True
        return []

    def _error(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        """The backend's error event ends the client's stream."""
        rnd.over = rnd.failed = True
        err = obj.get("error") or {}
        return event("error", obj if obj.get("type") == "error" else
                     anthropic_error(str(err.get("message") or err), 502))

    def _ping(self, rnd: "_Round", obj: dict, kind) -> list[sse.Event]:
        return ping()

    ON = {"message_start": _message_start, "content_block_start": _block_start,
          "content_block_delta": _block_delta, "content_block_stop": _block_stop,
          "message_delta": _message_delta, "message_stop": _message_stop,
          "error": _error, "ping": _ping}

    def end(self, turn: Turn) -> list[sse.Event]:
        return self._resume() + event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(turn),
                      "stop_sequence": self.stop.get("stop_sequence")},
            "usage": self._usage()}) + event("message_stop", {"type": "message_stop"})

    def fail(self, message: str, status: int, code: str) -> list[sse.Event]:
        return self._resume() + event("error", anthropic_error(message, status))


# ================================================================= progress

class Progress(progress.Progress):
    """A waiting stream's progress, for a client that takes thinking blocks
    (`wanted`): `message_start`, then a `thinking` block (index 0) whose deltas say
    what the request waits for. Claude Code's idle timer counts every event but
    `ping` (its stream watchdog). When the backend's first event comes, the block
    ends with the signature progress.MARKER, the backend's `message_start` is left
    out (its usage goes to the `message_delta`) and every content block index after
    it is one more. When the agent sends that turn back, `strip()` removes the
    block: the prompt (and the backend's prompt cache) is exactly what it would
    have been without the wait."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.model = body.get("model")
        self.opened = False
        self.last = None

    @staticmethod
    def wanted(body: dict, environ: dict) -> bool:
        """Only a client that takes thinking blocks -- one that asked for thinking
        (Claude Code sends `thinking: {"type": "adaptive"}`), or Claude Code itself
        (its session header, its user agent: its small calls ask for no thinking) --
        since a thinking block first would surprise a program that reads
        `content[0].text`; other Messages clients get the comments only."""
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"):
            return True
        return bool(environ.get("HTTP_X_CLAUDE_CODE_SESSION_ID")) or \
            str(environ.get("HTTP_USER_AGENT", "")).startswith("claude-cli/")

    @staticmethod
    def strip(body: dict) -> bool:
        """Our progress block out of the conversation an agent sends back (an
        assistant turn's thinking block signed MARKER); True when the body changed."""
        changed = False
        msgs = body.get("messages")
        for m in msgs if isinstance(msgs, list) else ():
            c = m.get("content") if isinstance(m, dict) and m.get("role") == "assistant" \
                else None
            if not isinstance(c, list) or not any(_ours(b) for b in c):
                continue
            m["content"] = [b for b in c if not _ours(b)]
            changed = True
        if changed:
            body["messages"] = [m for m in msgs if not (isinstance(m, dict) and
                                                        m.get("content") == [])]
        return changed

    def tick(self, text: str) -> list[sse.Event]:
        out = []
        if not self.opened:
            self.opened = True
            out.append(self.event({"type": "message_start", "message": {
                "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": None,
                "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}},
                "message_start"))
            out.append(self.event({
                "type": "content_block_start", "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
                "content_block_start"))
            text = text or "waiting for the model"
        words = text + "\n" if text and text != self.last else ""
        if text:
            self.last = text
        out.append(self.event({
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "thinking_delta", "thinking": words}}, "content_block_delta"))
        return out

    def then(self, first: list[sse.Event], batches) -> Iterator[list[sse.Event]]:
        """The backend's events after our block: its message_start left out (its usage
        kept for the message_delta), every block index one more; the events of each
        read in one write."""
        self.usage: dict = {}
        yield [self.event({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "signature_delta", "signature": progress.MARKER}},
                          "content_block_delta"),
               self.event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
               *self._moved(first)]
        for evs in batches:
            moved = self._moved(evs)
            if moved:
                yield moved

    def _moved(self, evs: list[sse.Event]) -> list[sse.Event]:
        out = []
        for ev in evs:
            obj = ev.json
            if not isinstance(obj, dict):
                out.append(ev)
                continue
            kind = obj.get("type")
            if kind == "message_start":
                u = (obj.get("message") or {}).get("usage")
                if isinstance(u, dict):
                    self.usage = {k: v for k, v in u.items() if k != "output_tokens"}
                continue
            if kind in ("content_block_start", "content_block_delta", "content_block_stop") \
                    and isinstance(obj.get("index"), int):
                obj["index"] += 1
            elif kind == "message_delta" and self.usage:
                u = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
                obj["usage"] = {**self.usage, **{k: v for k, v in u.items() if v is not None}}
            else:
                out.append(ev)
                continue
            out.append(sse.Event.of(obj, ev.name or kind))
        return out


def _ours(block) -> bool:
    return isinstance(block, dict) and block.get("type") == "thinking" and \
        block.get("signature") == progress.MARKER


DIALECT = Dialect(MESSAGES, parse=parse, system_prompt=system_prompt, search_tool=search_tool,
                  floor_keys=FLOOR_KEYS, straight_stream=straight_stream,
                  straight_whole=straight_whole, stream_error=stream_error,
                  adapter=MessagesAdapter, progress=Progress, agent_fix=agents.fix_messages)
