"""OpenAI Responses (`POST /v1/responses`, Codex) with its `web_search` tool.

A request whose `tools` hold `{"type": "web_search"}` (or `web_search_preview`) gets
the search run here: the backend (which speaks Responses itself) is offered a function
tool `web_search` (argument `query`); each `function_call` of it is run against SearXNG
and answered with a `function_call_output`. The client sees `web_search_call` output
items (status, action with the query and sources) before the answer `message`, whose
text carries `url_citation` annotations where the model cites [n]; streamed, the events
Codex expects (`response.output_item.added/done`, `response.web_search_call.*`,
`response.completed`). Client function tools come back as `function_call` items.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import re
import time
from typing import Iterator

import requests
from flask import Response

from common.disconnect import ClientGone
from common.errors import ApiError
from common.streaming import headers_now

from ..search import engine
from ..search.engine import Search, Step, Turn, decide, new_id
from .base import TOOL_NAME, DialectSession, event

SEARCH_TOOL_TYPES = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                     "web_search_2025_08_26")
FUNCTION_TOOL = {"type": "function", "name": TOOL_NAME, "description": engine.TOOL_DESCRIPTION,
                 "parameters": engine.TOOL_PARAMETERS}


def search_tool(body: dict) -> dict | None:
    for t in body.get("tools") or []:
        if isinstance(t, dict) and t.get("type") in SEARCH_TOOL_TYPES:
            return t
    return None


def validate(body: dict) -> None:
    def bad(msg, param):
        raise ApiError(msg, 400, code="invalid_request", param=param)
    if "input" not in body or not isinstance(body["input"], (str, list)):
        bad("'input' is required: a string or a list of input items", "input")
    if "tools" in body and not isinstance(body["tools"], list):
        bad("'tools' must be a list", "tools")
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            bad(f"tools[{i}] must be a tool object with a 'type'", f"tools[{i}]")
    for i, it in enumerate(body["input"] if isinstance(body["input"], list) else []):
        if not isinstance(it, dict):
            bad(f"input[{i}] must be an input item object", f"input[{i}]")
    mt = body.get("max_output_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        bad("'max_output_tokens' must be a positive integer", "max_output_tokens")


def strip_search_tool(body: dict) -> None:
    t = search_tool(body)
    body["tools"] = [x for x in body.get("tools") or [] if x is not t]
    if not body["tools"]:
        body.pop("tools")
        body.pop("tool_choice", None)


class ResponsesSession(DialectSession):
    path = "/v1/responses"

    def __init__(self, body: dict, **kw):
        super().__init__(body, **kw)
        self.tools = [copy.deepcopy(FUNCTION_TOOL)
                      if isinstance(t, dict) and t.get("type") in SEARCH_TOOL_TYPES else t
                      for t in body.get("tools") or []]
        inp = body["input"]
        self.input = [{"type": "message", "role": "user", "content": inp}] \
            if isinstance(inp, str) else list(inp)
        tc = body.get("tool_choice")
        self.forced = isinstance(tc, dict) and tc.get("type") in SEARCH_TOOL_TYPES or \
            tc == "required"

    def round_body(self, stream: bool) -> dict:
        b = {k: v for k, v in self.body.items() if k not in ("tools", "input", "include")}
        inc = [x for x in self.body.get("include") or [] if "web_search" not in str(x)]
        if inc:
            b["include"] = inc
        b["input"] = self.input
        b["stream"] = stream
        tools = self.tools
        if not self.searcher.budget_left:
            tools = [t for t in tools if t.get("name") != TOOL_NAME]
        if tools:
            b["tools"] = tools
        else:
            b.pop("tool_choice", None)
            b.pop("parallel_tool_calls", None)
        tc = b.get("tool_choice")
        if isinstance(tc, dict) and tc.get("type") in SEARCH_TOOL_TYPES:
            b["tool_choice"] = {"type": "function", "name": TOOL_NAME}
        if "tools" in b and (self.searcher.rounds and self.forced or not self.searcher.budget_left
                             and isinstance(b.get("tool_choice"), dict)
                             and b["tool_choice"].get("name") == TOOL_NAME):
            b["tool_choice"] = "auto"
        return b

    def record(self, items: list[dict], searches: list[Search]) -> None:
        keep = [_input_item(i) for i in items if i.get("type") in ("message", "function_call")]
        self.input = self.input + keep + [
            {"type": "function_call_output", "call_id": s.call.id, "output": s.text}
            for s in searches]


def _input_item(item: dict) -> dict:
    """An output item of the backend as an input item for its next round."""
    if item.get("type") == "function_call":
        return {"type": "function_call", "call_id": item.get("call_id"),
                "name": item.get("name"), "arguments": item.get("arguments") or ""}
    return {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": p.get("text") or ""}
                        for p in item.get("content") or [] if isinstance(p, dict)]}


def turn_of(items: list[dict], status=None, usage=None) -> Turn:
    t = Turn()
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            continue
        if it.get("type") == "message":
            for p in it.get("content") or []:
                if isinstance(p, dict) and p.get("type") == "output_text":
                    t.text(p.get("text"))
        elif it.get("type") == "reasoning":
            for p in (it.get("content") or []) + (it.get("summary") or []):
                if isinstance(p, dict):
                    t.think(p.get("text"))
        elif it.get("type") == "function_call":
            t.call(i, it.get("call_id") or it.get("id"), it.get("name") or "")
            t.args(i, it.get("arguments") or "")
    t.finish = status
    if isinstance(usage, dict):
        t.usage(usage.get("input_tokens"), usage.get("output_tokens"))
    return t


def _is_ours(item: dict) -> bool:
    return item.get("type") == "function_call" and item.get("name") == TOOL_NAME


def web_search_call(s: Search, status: str | None = None) -> dict:
    action = {"type": "search", "query": s.query if s.query is not None else s.call.args}
    if status is None:
        action["sources"] = [{"type": "url", "url": src.url} for src in s.sources]
        status = "failed" if s.error in ("unavailable", "too_many_requests") else "completed"
    return {"type": "web_search_call", "id": s.call.client_id, "status": status,
            "action": action}


def annotate(item: dict, searcher) -> list[tuple[int, int, dict]]:
    """Add url_citation annotations to a message item's text where it cites [n];
    returns (content index, annotation index, annotation) for the new ones."""
    new = []
    if item.get("type") != "message" or not searcher.searches:
        return new
    by_n = {s.n: s for s in searcher.sources.items}
    for ci, part in enumerate(item.get("content") or []):
        if not isinstance(part, dict) or part.get("type") != "output_text":
            continue
        text = part.get("text") or ""
        anns = part.setdefault("annotations", [])
        for m in re.finditer(r"\[(\d{1,3})\]", text):
            src = by_n.get(int(m.group(1)))
            if src is None:
                continue
            a = {"type": "url_citation", "start_index": m.start(), "end_index": m.end(),
                 "url": src.url, "title": src.title}
            anns.append(a)
            new.append((ci, len(anns) - 1, a))
    return new


def _usage(inp: int, out: int) -> dict:
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": inp + out}


def _client_ids(calls) -> None:
    for c in calls:
        c.client_id = new_id("ws_")


# ================================================================= non-streaming

def run_nonstream(s: ResponsesSession) -> Response:
    output: list[dict] = []
    head = None
    inp = out = 0
    try:
        while True:
            r = s.call(stream=False)
            if r.status_code != 200:
                return Response(r.content, status=r.status_code, mimetype="application/json")
            try:
                obj = r.json()
                items = obj["output"]
                if not isinstance(items, list):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ApiError(f"upstream returned an unexpected Responses object: "
                               f"{r.content[:200]!r}", 502, code="bad_upstream_response")
            head = head or obj
            turn = turn_of(items, obj.get("status"), obj.get("usage"))
            inp += turn.usage_in
            out += turn.usage_out
            step = decide(turn, s.searcher.budget_left)
            if step is Step.SEARCH:
                _client_ids(turn.ours)
                searches = s.searcher.run(turn.ours)
                output += [i for i in items if not _is_ours(i)]
                output += [web_search_call(x) for x in searches]
                s.record(items, searches)
                continue
            if step is Step.EXHAUSTED:
                raise ApiError(s.searcher.exhausted_message(), 502,
                               code="search_budget_exhausted")
            for it in items:
                if _is_ours(it):
                    continue
                annotate(it, s.searcher)
                output.append(it)
            result = {**head, "status": obj.get("status") or "completed", "output": output,
                      "usage": _usage(inp, out), "tools": s.body.get("tools") or [],
                      "model": head.get("model") or s.body.get("model")}
            result.pop("output_text", None)
            return Response(json.dumps(result, ensure_ascii=False), status=200,
                            mimetype="application/json")
    finally:
        s.searcher.done()


# ================================================================= streaming

class _Out:
    """The client's stream: one sequence of numbered events."""

    def __init__(self):
        self.seq = 0

    def __call__(self, obj: dict) -> bytes:
        """obj (numbered in place) as the next event."""
        obj["sequence_number"] = self.seq
        self.seq += 1
        return event(obj["type"], obj)


def run_stream(s: ResponsesSession, first: requests.Response) -> Iterator[bytes]:
    emit = _Out()
    resp = first
    head: dict | None = None
    output: list[dict] = []           # the client's output items, in order
    inp = out = 0
    keepalive = s.settings.KEEPALIVE_INTERVAL

    def failed(message: str, code: str) -> Iterator[bytes]:
        r = {**(head or {"id": new_id("resp_"), "object": "response",
                         "created_at": int(time.time()), "model": s.body.get("model")}),
             "status": "failed", "output": output,
             "error": {"code": code, "message": message}}
        yield emit({"type": "response.failed", "response": r})

    try:
        if headers_now(first):
            yield b""
        while True:
            where: dict = {}              # backend item key -> client index (None: held)
            items: dict = {}              # backend item key -> the finished item
            order: list = []              # backend item keys as they were added
            done_resp = None
            for batch in s.batches(resp):
                sent = []                     # what this read makes: one write
                for name, obj in batch:
                    if name == ":":          # a comment: keeps the client's wait alive
                        sent.append(obj)
                        continue
                    t = obj.get("type") or name or ""
                    if t in ("response.created", "response.in_progress"):
                        if s.searcher.rounds == 0:          # later rounds: one response
                            if head is None:
                                head = {k: v for k, v in (obj.get("response") or {}).items()
                                        if k not in ("output", "usage")}
                            obj["response"] = {**head, "output": []}
                            sent.append(emit(obj))
                        continue
                    if t in ("response.completed", "response.incomplete"):
                        done_resp = obj.get("response") or {}
                        break
                    if t in ("response.failed", "error"):
                        err = obj.get("error") or (obj.get("response") or {}).get("error") \
                            or obj
                        sent += failed(str(err.get("message") or err)
                                       if isinstance(err, dict) else str(err), "upstream_error")
                        yield b"".join(sent)
                        return
                    # the item's key: its output_index, or (llama-server sends none) its id
                    bi = obj.get("output_index")
                    if bi is None:
                        item = obj.get("item") if isinstance(obj.get("item"), dict) else {}
                        bi = item.get("id") or obj.get("item_id")
                        if bi is None:
                            continue
                    if t == "response.output_item.added":
                        order.append(bi)
                        item = obj.get("item") or {}
                        if _is_ours(item):
                            where[bi] = None
                            continue
                        where[bi] = len(output) + sum(1 for v in where.values() if v is not None)
                    ci = where.get(bi)
                    if ci is None:
                        if t == "response.output_item.done":
                            items[bi] = obj.get("item") or {}
                        continue
                    if t == "response.output_item.done":
                        item = obj.get("item") or {}
                        items[bi] = item
                        for pi, ai, a in annotate(item, s.searcher):
                            sent.append(emit({"type": "response.output_text.annotation.added",
                                              "item_id": item.get("id"), "output_index": ci,
                                              "content_index": pi, "annotation_index": ai,
                                              "annotation": a}))
                    obj.pop("sequence_number", None)
                    if t.startswith(("response.content_part.", "response.output_text.")):
                        obj.setdefault("content_index", 0)
                    obj["output_index"] = ci
                    sent.append(emit(obj))
                if sent:
                    yield b"".join(sent)
                if done_resp is not None:
                    break
            resp.end()           # at response.completed: the connection serves the next call
            if done_resp is None:
                yield from failed("the upstream stream ended before response.completed",
                                  "upstream_stream_truncated")
                return
            ordered = [items[k] for k in order if k in items]
            if done_resp is not None:
                u = done_resp.get("usage") or {}
                inp += u.get("input_tokens") or 0
                out += u.get("output_tokens") or 0
                if not ordered and done_resp.get("output"):
                    ordered = done_resp["output"]
            turn = turn_of(ordered, (done_resp or {}).get("status"))
            step = decide(turn, s.searcher.budget_left)
            if step is Step.SEARCH:
                output += [items[k] for k in order if k in items and where.get(k) is not None]
                calls = turn.ours
                _client_ids(calls)
                planned = s.searcher.start(calls)
                base = len(output)
                for k, c in enumerate(calls):
                    pending = Search(c, c.query, "")
                    yield emit({"type": "response.output_item.added", "output_index": base + k,
                                "item": web_search_call(pending, "in_progress")})
                    yield emit({"type": "response.web_search_call.in_progress",
                                "output_index": base + k, "item_id": c.client_id})
                    yield emit({"type": "response.web_search_call.searching",
                                "output_index": base + k, "item_id": c.client_id})
                futs = s.searcher.futures(planned)
                while futs:
                    _, pend = cf.wait(futs, timeout=keepalive)
                    futs = list(pend)
                    if futs:
                        yield b": keep-alive\n\n"
                searches = s.searcher.finish(calls, planned)
                for k, x in enumerate(searches):
                    yield emit({"type": "response.web_search_call.completed",
                                "output_index": base + k, "item_id": x.call.client_id})
                    item = web_search_call(x)
                    output.append(item)
                    yield emit({"type": "response.output_item.done", "output_index": base + k,
                                "item": item})
                s.record(ordered, searches)
                resp = s.call(stream=True)
                if resp.status_code != 200:
                    try:
                        msg = resp.json()["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        msg = f"upstream answered HTTP {resp.status_code}"
                    yield from failed(msg, "upstream_error")
                    return
                continue
            if step is Step.TRUNCATED:
                yield from failed("the upstream stream ended without a finish",
                                  "upstream_stream_truncated")
                return
            if step is Step.EXHAUSTED:
                yield from failed(s.searcher.exhausted_message(), "search_budget_exhausted")
                return
            output += [items[k] for k in order if k in items and where.get(k) is not None]
            status = (done_resp or {}).get("status") or "completed"
            final = {**(head or {"id": new_id("resp_"), "object": "response",
                                 "created_at": int(time.time()), "model": s.body.get("model")}),
                     **{k: v for k, v in (done_resp or {}).items()
                        if k in ("incomplete_details", "completed_at")},
                     "status": status, "output": output, "usage": _usage(inp, out)}
            yield emit({"type": "response.incomplete" if status == "incomplete"
                        else "response.completed", "response": final})
            return
    except ClientGone:
        return
    except ApiError as e:
        yield from failed(e.message, e.code or "error")
    except requests.RequestException as e:
        yield from failed(f"upstream stream failed: {e}", "upstream_error")
    finally:
        resp.close()
        s.searcher.done()

