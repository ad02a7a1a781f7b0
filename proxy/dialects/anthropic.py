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
import concurrent.futures as cf
import copy
import json
from typing import Iterable, Iterator

import requests
from flask import Response

from common import sse
from common.errors import ApiError
from common.disconnect import ClientGone
from common.streaming import headers_now

from ..search import engine
from ..search.engine import Search, Step, Turn, cited, decide, new_id
from . import translate
from ..upstream import watched
from .base import TOOL_NAME, DialectSession, event

SERVER_TOOL_TYPES = ("web_search_20250305", "web_search_20260209")
CUSTOM_TOOL = {"name": TOOL_NAME, "description": engine.TOOL_DESCRIPTION,
               "input_schema": engine.TOOL_PARAMETERS}

# HTTP status -> Anthropic error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error",
               503: "overloaded_error"}


def error_obj(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def to_anthropic_error(raw: bytes, status: int) -> bytes | None:
    """An error body (OpenAI envelope, or anything) in Anthropic's shape; None when it
    already is."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict) and obj.get("type") == "error" and isinstance(obj.get("error"), dict):
        return None
    msg = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            msg = err.get("message")
        elif isinstance(err, str):
            msg = err
        msg = msg or obj.get("message") or obj.get("detail")
    if not isinstance(msg, str) or not msg:
        msg = (raw[:300].decode("utf-8", "replace").strip()
               or f"HTTP {status} with an empty body")
    return json.dumps(error_obj(msg, status)).encode()


def search_tool(body: dict) -> dict | None:
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
    t = search_tool(body)
    if t is not None:
        mu = t.get("max_uses")
        if mu is not None and (not isinstance(mu, int) or isinstance(mu, bool) or mu < 1):
            bad("tools.web_search.max_uses: must be a positive integer")
        if t.get("allowed_domains") and t.get("blocked_domains"):
            bad("tools.web_search: use allowed_domains or blocked_domains, not both")


def strip_search_tool(body: dict) -> None:
    """Search is off: the backend cannot run Anthropic's server tool, so it is removed."""
    body["tools"] = [t for t in body.get("tools") or [] if t is not search_tool(body)]
    if not body["tools"]:
        body.pop("tools")
        body.pop("tool_choice", None)


# ================================================================= the session

class MessagesSession(DialectSession):
    path = "/v1/messages"

    def __init__(self, body: dict, **kw):
        super().__init__(body, **kw)
        tools = []
        for t in body.get("tools") or []:
            if isinstance(t, dict) and t.get("type") in SERVER_TOOL_TYPES:
                tools.append(copy.deepcopy(CUSTOM_TOOL))
            else:
                tools.append(t)
        self.tools = tools
        self.messages = list(body["messages"])
        tc = body.get("tool_choice")
        self.forced = isinstance(tc, dict) and tc.get("type") in ("tool", "any")

    def batches(self, resp):
        """The backend's events, beginning with message_start (with_message_start)."""
        return sse.json_batches(with_message_start(watched(resp, self.environ),
                                                   self.body.get("model")))

    def round_body(self, stream: bool) -> dict:
        b = {k: v for k, v in self.body.items() if k not in ("tools", "messages")}
        b["messages"] = self.messages
        b["stream"] = stream
        tools = self.tools
        if not self.searcher.budget_left:
            tools = [t for t in tools if t.get("name") != TOOL_NAME]
        if not tools:
            b.pop("tool_choice", None)
            return b
        b["tools"] = tools
        tc = b.get("tool_choice")
        if isinstance(tc, dict) and (
                self.searcher.rounds and self.forced     # forcing every round never ends
                or tc.get("name") and tc["name"] not in [t.get("name") for t in tools]):
            b["tool_choice"] = {"type": "auto"}
        return b

    def record(self, blocks: list[dict], searches: list[Search]) -> None:
        """The round as the backend sees it next time: its turn, then our tool results."""
        self.messages = self.messages + [
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": s.call.id,
                                          "content": s.text} for s in searches]}]


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
        t.usage(usage.get("input_tokens"), usage.get("output_tokens"))
    return t


# ================================================================= client blocks

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


def _client_ids(calls) -> None:
    for c in calls:
        c.client_id = "srvtoolu_" + new_id("")[:24]


def _block(index: int, block: dict) -> Iterator[bytes]:
    """A whole server-side block as its start/delta/stop events (a server_tool_use's
    input goes as one input_json_delta, as Anthropic's API sends it)."""
    if block["type"] == "server_tool_use":
        yield event("content_block_start", {"type": "content_block_start", "index": index,
                                            "content_block": {**block, "input": {}}})
        yield event("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
    else:
        yield event("content_block_start", {"type": "content_block_start", "index": index,
                                            "content_block": block})
    yield event("content_block_stop", {"type": "content_block_stop", "index": index})


def _usage(s: MessagesSession, inp: int, out: int) -> dict:
    return {"input_tokens": inp, "output_tokens": out,
            "server_tool_use": {"web_search_requests": s.searcher.searches}}


def _stop_reason(turn: Turn) -> str:
    if turn.theirs:
        return "tool_use"
    if turn.finish in (None, "tool_use"):
        return "end_turn"
    return turn.finish


# ================================================================= non-streaming

def with_message_start(chunks: Iterable[bytes], model) -> Iterator[bytes]:
    """A Messages stream from the backend, made to begin with message_start
    (relayed as it is, or read by the web_search rounds).

    llama-server now and then leaves it out of a short stream (its first tokens
    reach the stream writer together with the final result; seen 2 in 11 runs
    of tests/integration/test_metrics.py), and the Anthropic SDK, Claude Code's,
    builds its message from message_start: without it first, the answer fails
    or comes out empty. A stream that begins with an error stays as it is.
    Comments (the swapper's `: loading model` lines) pass at once; once the
    first event with data has been seen, the rest passes untouched."""
    parser = sse.Parser()
    chunks = iter(chunks)
    for chunk in chunks:
        if not chunk:
            yield chunk          # the headers, now (common.streaming.headers_now)
            continue
        events = sse.split(parser.take(chunk))
        for i, raw in enumerate(events):
            ev = sse.parse_event(raw)
            if ev is None or ev.data is None:
                continue                          # a comment or a blank line
            head = b"".join(events[:i])
            try:                                  # one parse per stream: its first event
                kind = ev.name or json.loads(ev.data).get("type")
            except (ValueError, AttributeError):
                kind = None
            if kind not in ("message_start", "error"):
                head += translate.message_start(new_id("msg_"), model)
            yield head + b"".join(events[i:]) + parser.pending()
            yield from chunks
            return
        if events:
            yield b"".join(events)
    tail = parser.pending()
    if tail:
        yield tail


def run_nonstream(s: MessagesSession) -> Response:
    content: list[dict] = []
    head = None
    inp = out = 0
    try:
        while True:
            r = s.call(stream=False)
            if r.status_code != 200:
                return Response(to_anthropic_error(r.content, r.status_code) or r.content,
                                status=r.status_code, mimetype="application/json")
            try:
                msg = r.json()
                blocks = msg["content"]
                if not isinstance(blocks, list):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ApiError(f"upstream returned an unexpected Messages response: "
                               f"{r.content[:200]!r}", 502, code="bad_upstream_response")
            head = head or msg
            turn = turn_of(blocks, msg.get("stop_reason"), msg.get("usage"))
            inp += turn.usage_in
            out += turn.usage_out
            step = decide(turn, s.searcher.budget_left)
            if step is Step.SEARCH:
                _client_ids(turn.ours)
                searches = s.searcher.run(turn.ours)
                content += [b for b in blocks if b.get("type") not in ("tool_use",)]
                for x in searches:
                    content += [server_tool_use(x), search_result_block(x)]
                s.record(blocks, searches)
                continue
            if step is Step.EXHAUSTED:
                raise ApiError(s.searcher.exhausted_message(), 502,
                               code="search_budget_exhausted")
            for b in blocks:
                if b.get("type") == "tool_use" and b.get("name") == TOOL_NAME:
                    continue                    # ours, in a client's turn: dropped
                if b.get("type") == "text" and s.searcher.searches:
                    cites = citations_for(b.get("text") or "", s.searcher)
                    if cites:
                        b = {**b, "citations": cites}
                content.append(b)
            result = {"id": head.get("id") or new_id("msg_"), "type": "message",
                      "role": "assistant", "model": head.get("model") or s.body.get("model"),
                      "content": content, "stop_reason": _stop_reason(turn),
                      "stop_sequence": msg.get("stop_sequence"),
                      "usage": _usage(s, inp, out)}
            return Response(json.dumps(result, ensure_ascii=False), status=200,
                            mimetype="application/json")
    finally:
        s.searcher.done()


# ================================================================= streaming

def _error_event(message: str, status: int) -> bytes:
    return event("error", error_obj(message, status))


def _grow(block: dict, key: str, piece: str | None) -> None:
    """A streamed block's field grows by pieces, joined once (see _joined)."""
    block.setdefault("_" + key, []).append(piece or "")


def _joined(block: dict, key: str) -> str:
    return (block.get(key) or "") + "".join(block.get("_" + key, ()))


def run_stream(s: MessagesSession, first: requests.Response) -> Iterator[bytes]:
    resp = first
    started = False
    nxt = 0                     # the client's next content block index
    inp = out = 0
    keepalive = s.settings.KEEPALIVE_INTERVAL
    try:
        if headers_now(first):
            yield b""
        while True:
            blocks: dict[int, dict] = {}      # backend index -> block as it builds up
            where: dict[int, int | None] = {}  # backend index -> client index (None: held)
            stop = {}
            round_in = 0
            ended = False
            for batch in s.batches(resp):
                sent = []                     # what this read makes: one write
                for name, obj in batch:
                    if name == ":":          # a comment: keeps the client's wait alive
                        sent.append(obj)
                        continue
                    t = obj.get("type") or name
                    if t == "error":
                        err = obj.get("error") or {}
                        sent.append(event("error", obj if obj.get("type") == "error" else
                                          error_obj(str(err.get("message") or err), 502)))
                        yield b"".join(sent)
                        return
                    if t == "message_start":
                        m = obj.get("message") or {}
                        u = m.get("usage") or {}
                        round_in = u.get("input_tokens") or 0
                        if not started:
                            started = True
                            m = {**m, "content": [],
                                 "usage": {**u, "server_tool_use": {"web_search_requests": 0}}}
                            sent.append(event("message_start", {"type": "message_start",
                                                                "message": m}))
                        continue
                    if t == "content_block_start":
                        bi = obj.get("index", 0)
                        b = copy.deepcopy(obj.get("content_block") or {})
                        if b.get("type") == "tool_use":
                            b["_args"] = [json.dumps(b["input"])] if b.get("input") else []
                        blocks[bi] = b
                        if b.get("type") == "tool_use" and b.get("name") == TOOL_NAME:
                            where[bi] = None
                            continue
                        where[bi] = nxt
                        nxt += 1
                        obj["index"] = where[bi]
                        sent.append(event(t, obj))
                        continue
                    if t == "content_block_delta":
                        bi = obj.get("index", 0)
                        b = blocks.get(bi)
                        if b is None:
                            b = blocks[bi] = {"type": "text", "text": ""}
                        d = obj.get("delta") or {}
                        kind = d.get("type")
                        if kind == "text_delta":
                            _grow(b, "text", d.get("text"))
                        elif kind == "thinking_delta":
                            _grow(b, "thinking", d.get("thinking"))
                        elif kind == "input_json_delta":
                            b.setdefault("_args", []).append(d.get("partial_json") or "")
                        ci = where.get(bi)
                        if ci is None:
                            continue
                        obj["index"] = ci
                        sent.append(event(t, obj))
                        continue
                    if t == "content_block_stop":
                        bi = obj.get("index", 0)
                        ci = where.get(bi)
                        if ci is None:
                            continue
                        b = blocks.get(bi) or {}
                        if b.get("type") == "text" and s.searcher.searches:
                            for c in citations_for(_joined(b, "text"), s.searcher):
                                sent.append(event("content_block_delta", {
                                    "type": "content_block_delta", "index": ci,
                                    "delta": {"type": "citations_delta", "citation": c}}))
                        obj["index"] = ci
                        sent.append(event(t, obj))
                        continue
                    if t == "message_delta":
                        stop = obj.get("delta") or {}
                        u = obj.get("usage") or {}
                        out += u.get("output_tokens") or 0
                        # input tokens come in message_start, or (translated) only here
                        round_in = max(round_in, u.get("input_tokens") or 0)
                        continue
                    if t == "message_stop":
                        ended = True
                        break
                    if t == "ping":
                        sent.append(event("ping", {"type": "ping"}))
                if sent:
                    yield b"".join(sent)
                if ended:
                    break
            resp.end()           # at message_stop: the connection serves the next call
            if not stop:
                yield _error_event("the upstream stream ended before message_delta", 502)
                return
            inp += round_in
            ordered = [blocks[i] for i in sorted(blocks)]
            for b in ordered:
                for key in ("text", "thinking"):
                    if "_" + key in b:
                        b[key] = _joined(b, key)
                        del b["_" + key]
                if b.get("type") == "tool_use":
                    try:
                        b["input"] = json.loads("".join(b.pop("_args")) or "{}")
                    except ValueError:
                        b["input"] = {}
            turn = turn_of(ordered, stop.get("stop_reason"))
            step = decide(turn, s.searcher.budget_left)
            if step is Step.SEARCH:
                # use, result, use, result... as Anthropic's API sends them; the
                # searches run in parallel while the first use is on screen
                calls = turn.ours
                _client_ids(calls)
                planned = s.searcher.start(calls)
                yield from _block(nxt, server_tool_use(Search(calls[0], calls[0].query, "")))
                futs = s.searcher.futures(planned)
                yield event("ping", {"type": "ping"})
                while futs:
                    _, pending = cf.wait(futs, timeout=keepalive)
                    futs = list(pending)
                    if futs:
                        yield event("ping", {"type": "ping"})
                searches = s.searcher.finish(calls, planned)
                for k, x in enumerate(searches):
                    if k:
                        yield from _block(nxt + 2 * k, server_tool_use(x))
                    yield from _block(nxt + 2 * k + 1, search_result_block(x))
                nxt += 2 * len(searches)
                for b in ordered:
                    b.pop("_args", None)
                s.record(ordered, searches)
                resp = s.call(stream=True)
                if resp.status_code != 200:
                    body = to_anthropic_error(resp.content, resp.status_code) or resp.content
                    yield b"event: error\ndata: " + body + b"\n\n"
                    return
                continue
            if step is Step.TRUNCATED:
                yield _error_event("the upstream stream ended without a finish", 502)
                return
            if step is Step.EXHAUSTED:
                yield _error_event(s.searcher.exhausted_message(), 502)
                return
            yield event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(turn),
                          "stop_sequence": stop.get("stop_sequence")},
                "usage": _usage(s, inp, out)})
            yield event("message_stop", {"type": "message_stop"})
            return
    except ClientGone:
        return
    except ApiError as e:
        yield _error_event(e.message, e.status)
    except requests.RequestException as e:
        yield _error_event(f"upstream stream failed: {e}", 502)
    finally:
        resp.close()
        s.searcher.done()
