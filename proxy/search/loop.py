"""The model <-> SearXNG loop, non-streaming and streaming.

One `SearchSession` per client chat request that got the web_search tool injected.
Its `messages` list is the internal history: assistant turns with our web_search
calls (reasoning kept), one tool message per call id, and nothing of it is shown to
the client except the final answer (non-streaming) or the content/reasoning deltas
of every round (streaming).

Mixed turns (the model calls client tools and web_search in the same turn): the
client's calls go back to the client untouched, our web_search calls are DROPPED
(not executed, never shown); the model may search again on the next turn.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import logging
import re
import uuid
from typing import Iterator

import requests
from flask import Response

from common import sse
from common.errors import ApiError, error_body
from common.streaming import NO_BUFFERING, forward_headers

from .. import normalize
from .results import Sources, bad_arguments_note, repeated_query_note
from .searxng import SearxngClient

log = logging.getLogger("proxy.search")

TOOL_NAME = "web_search"
WEB_SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Search the web. Use it when the answer depends on information you may not "
            "know or that may have changed: current versions, release notes, API docs, "
            "error messages, news, facts you are unsure of. Do not use it for things you "
            "already know well. Write a few precise keywords (e.g. 'flask 3.1 changelog "
            "stream_with_context'), not a sentence or a question. Results come numbered; "
            "cite them as [n]."),
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string",
                                     "description": "search keywords"}},
            "required": ["query"],
        },
    },
}
CHAT_PATH = "/v1/chat/completions"


def _tool_name(t) -> str | None:
    if isinstance(t, dict):
        fn = t.get("function")
        if isinstance(fn, dict):
            return fn.get("name")
    return None


def should_inject(body: dict, settings) -> bool:
    """Add our tool unless the client defines one of that name, tool_choice is "none" or
    names another function, the operator turned it off, or n > 1."""
    if not settings.WEB_SEARCH or settings.MAX_SEARCH_ITER <= 0:
        return False
    if any(_tool_name(t) == TOOL_NAME for t in body.get("tools") or []):
        return False
    tc = body.get("tool_choice")
    if tc == "none":
        return False
    if isinstance(tc, dict):
        name = _tool_name(tc) or tc.get("name")
        if name and name != TOOL_NAME:
            return False
    if (body.get("n") or 1) > 1:
        return False
    return True


def inject_tool(body: dict) -> None:
    body["tools"] = list(body.get("tools") or []) + [copy.deepcopy(WEB_SEARCH_TOOL)]


def _query_key(q: str) -> str:
    return re.sub(r"\s+", " ", q).strip().lower()


def _usage_add(total: dict | None, u) -> dict | None:
    if not isinstance(u, dict):
        return total
    total = dict(total or {})
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(u.get(k), int):
            total[k] = total.get(k, 0) + u[k]
    return total


class SearchSession:
    def __init__(self, body: dict, *, settings, upstream, searx: SearxngClient, metrics,
                 executor: cf.Executor, headers):
        self.body = body
        self.settings = settings
        self.upstream = upstream
        self.searx = searx
        self.metrics = metrics
        self.executor = executor
        self.headers = {k: v for k, v in forward_headers(headers).items()
                        if k.lower() not in ("accept-encoding",)}
        self.headers["Content-Type"] = "application/json"
        self.max_iter = settings.MAX_SEARCH_ITER
        self.sources = Sources(settings.SEARCH_SNIPPET_CHARS)
        self.seen: set[str] = set()
        self.rounds = 0          # search rounds done
        self.searches = 0        # SearXNG requests made
        self.empty = 0           # of which came back with nothing usable
        self.usage: dict | None = None
        self.forced = isinstance(body.get("tool_choice"), dict)  # named web_search

    # ------------------------------------------------------------- model calls

    @property
    def budget_spent(self) -> bool:
        return self.rounds >= self.max_iter

    def round_body(self, stream: bool) -> dict:
        b = dict(self.body)
        b["stream"] = stream
        if self.rounds and self.forced:
            b["tool_choice"] = "auto"      # forcing web_search every round would never end
        if self.budget_spent:
            tools = [t for t in b.get("tools") or [] if _tool_name(t) != TOOL_NAME]
            if tools:
                b["tools"] = tools
                if isinstance(b.get("tool_choice"), dict):
                    b["tool_choice"] = "auto"
            else:
                b.pop("tools", None)
                b.pop("tool_choice", None)
                b.pop("parallel_tool_calls", None)
        return b

    def call_model(self, stream: bool) -> requests.Response:
        data = json.dumps(self.round_body(stream), ensure_ascii=False).encode()
        return self.upstream.request("POST", CHAT_PATH, headers=self.headers, data=data,
                                     stream=stream)

    # ------------------------------------------------------------- searching

    def start_searches(self, calls: list[dict]) -> list:
        """One entry per call: a str (immediate tool result) or a Future of an outcome."""
        planned, this_turn = [], set()
        for c in calls:
            raw = c["function"].get("arguments") or ""
            try:
                args = json.loads(raw) if isinstance(raw, str) else raw
                query = args.get("query") if isinstance(args, dict) else None
            except ValueError:
                query = None
            if not isinstance(query, str) or not query.strip():
                planned.append(bad_arguments_note(str(raw)))
                continue
            key = _query_key(query)
            if key in self.seen or key in this_turn:
                planned.append(repeated_query_note(query))
                continue
            this_turn.add(key)
            planned.append(self.executor.submit(self.searx.search, query))
        self.seen |= this_turn
        return planned

    def finish_searches(self, calls: list[dict], planned: list) -> list[dict]:
        """Tool messages, one per call id, in call order (numbering stays stable)."""
        msgs = []
        for c, p in zip(calls, planned):
            if isinstance(p, str):
                text = p
            else:
                out = p.result()
                self.searches += 1
                self.metrics.search(out.kind)
                if out.empty:
                    self.empty += 1
                if not out.ok:
                    log.warning("web search %r failed (%s): %s", out.query, out.kind, out.hint)
                text = self.sources.format(out)
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": text})
        self.rounds += 1
        if self.budget_spent and msgs:
            msgs[-1]["content"] += (
                f"\n\nNote: the web search budget is exhausted ({self.rounds} rounds, "
                f"{self.searches} searches, {self.empty} empty). web_search is no longer "
                "available: answer now with what you have.")
        return msgs

    def record_turn(self, assistant: dict, tool_msgs: list[dict]) -> None:
        self.body["messages"] = list(self.body["messages"]) + [assistant] + tool_msgs

    def exhausted_error(self) -> dict:
        return error_body(
            f"the web search budget is exhausted ({self.searches} searches ran, {self.empty} "
            "came back empty) and the model gave no final answer", 502,
            code="search_budget_exhausted")

    def done(self) -> None:
        self.metrics.rounds(self.rounds)


def _ensure_ids(calls: list[dict]) -> None:
    for c in calls:
        if not c.get("id"):
            c["id"] = "call_" + uuid.uuid4().hex[:24]
        c.setdefault("type", "function")
        c.setdefault("function", {})


def _split(calls) -> tuple[list[dict], list[dict]]:
    ours, theirs = [], []
    for c in calls or []:
        (ours if _tool_name(c) == TOOL_NAME else theirs).append(c)
    return ours, theirs


def _passthrough(r: requests.Response) -> Response:
    headers = forward_headers(r.headers)
    return Response(r.content, status=r.status_code, headers=headers)


# ================================================================= non-streaming

def run_nonstream(s: SearchSession) -> Response:
    try:
        while True:
            r = s.call_model(stream=False)
            if r.status_code != 200:
                return _passthrough(r)      # the upstream's envelope, untouched
            try:
                obj = r.json()
                choice = obj["choices"][0]
                msg = choice["message"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ApiError(f"upstream returned an unexpected chat response: "
                               f"{r.content[:200]!r}", 502, code="bad_upstream_response")
            s.usage = _usage_add(s.usage, obj.get("usage"))
            ours, theirs = _split(msg.get("tool_calls"))
            if ours and not theirs and not s.budget_spent:
                _ensure_ids(ours)
                assistant = {k: v for k, v in msg.items() if v is not None}
                assistant["role"] = "assistant"
                assistant.setdefault("content", None)
                planned = s.start_searches(ours)
                s.record_turn(assistant, s.finish_searches(ours, planned))
                continue
            # final: an answer, client tool calls (ours dropped), or the last call
            if ours:
                if theirs:
                    msg["tool_calls"] = theirs
                else:
                    msg.pop("tool_calls", None)
                    if choice.get("finish_reason") == "tool_calls":
                        choice["finish_reason"] = "stop"
                    if not msg.get("content"):
                        return Response(json.dumps(s.exhausted_error()), status=502,
                                        mimetype="application/json")
            if not theirs and s.settings.SEARCH_SOURCES:
                block = s.sources.block(msg.get("content"))
                if block:
                    msg["content"] = (msg.get("content") or "") + block
            normalize.normalize_completion(obj)
            if s.usage:
                obj["usage"] = {**(obj.get("usage") or {}), **s.usage}
            return Response(json.dumps(obj, ensure_ascii=False), status=200,
                            mimetype="application/json")
    finally:
        s.done()


# ================================================================= streaming

class _Call:
    __slots__ = ("id", "name", "args", "pending", "out_index")

    def __init__(self):
        self.id = None
        self.name = ""
        self.args = ""
        self.pending: list[dict] = []
        self.out_index: int | None = None


def stream_response(s: SearchSession, first: requests.Response) -> Response:
    return Response(run_stream(s, first), status=200, mimetype="text/event-stream",
                    headers=dict(NO_BUFFERING), direct_passthrough=True)


def run_stream(s: SearchSession, first: requests.Response) -> Iterator[bytes]:
    resp = first
    head: dict = {}              # id/created/model of the client's stream (first round)
    try:
        while True:
            calls: dict[int, _Call] = {}
            content, reasoning, rkey = [], [], None
            finish_obj = None
            n_client = 0
            for ev in sse.iter_events(resp.iter_content(chunk_size=None)):
                if ev.data is None:
                    continue
                if ev.is_done:
                    break
                try:
                    obj = json.loads(ev.data)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    yield sse.emit(obj)
                    yield sse.DONE
                    return
                if not head:
                    head = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint")
                            if k in obj}
                changed = s.rounds > 0
                if "usage" in obj:
                    s.usage = _usage_add(s.usage, obj.pop("usage"))
                    changed = True
                choices = obj.get("choices") or []
                if not choices:
                    continue
                ch = choices[0]
                delta = ch.get("delta") or {}
                if s.rounds > 0:
                    delta.pop("role", None)
                if delta.get("content"):
                    content.append(delta["content"])
                for k in normalize.REASONING_KEYS:
                    if delta.get(k):
                        rkey = rkey or k
                        if k == rkey:
                            reasoning.append(delta[k])
                changed |= normalize.mirror_reasoning(delta)
                if delta.get("tool_calls"):
                    changed = True
                    out_tcs = []
                    for tc in delta["tool_calls"]:
                        idx = tc.get("index", 0)
                        c = calls.setdefault(idx, _Call())
                        fn = tc.get("function") or {}
                        if tc.get("id"):
                            c.id = tc["id"]
                        if fn.get("name"):
                            c.name += fn["name"]
                        if fn.get("arguments"):
                            c.args += fn["arguments"]
                        if not c.name:
                            c.pending.append(tc)
                            continue
                        if c.name == TOOL_NAME:
                            c.pending.clear()
                            continue          # ours: held back
                        if c.out_index is None:
                            c.out_index = n_client
                            n_client += 1
                        for p in c.pending + [tc]:
                            out_tcs.append({**p, "index": c.out_index})
                        c.pending.clear()
                    if out_tcs:
                        delta["tool_calls"] = out_tcs
                    else:
                        delta.pop("tool_calls")
                if ch.get("finish_reason"):
                    finish_obj = obj
                    ch["delta"] = delta
                    if not _meaningful(delta):
                        continue
                    # emit the delta now, the finish_reason later
                    obj = copy.deepcopy(obj)
                    obj["choices"][0]["finish_reason"] = None
                    changed = True
                if not changed:
                    yield ev.raw
                    continue
                if not _meaningful(delta):
                    continue
                obj.update(head)
                ch["delta"] = delta
                yield sse.emit(obj)

            ours = [c for c in calls.values() if c.name == TOOL_NAME]
            theirs = [c for c in calls.values() if c.name and c.name != TOOL_NAME]
            if ours and not theirs and not s.budget_spent:
                # a search round: answer every call, then the next round in this stream
                yield sse.KEEPALIVE
                tcalls = [{"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.args}} for c in ours]
                _ensure_ids(tcalls)
                planned = s.start_searches(tcalls)
                futs = [p for p in planned if not isinstance(p, str)]
                while futs:
                    done, pending = cf.wait(futs, timeout=s.settings.KEEPALIVE_INTERVAL)
                    futs = list(pending)
                    if futs:
                        yield sse.KEEPALIVE
                assistant = {"role": "assistant", "content": "".join(content) or None,
                             "tool_calls": tcalls}
                if reasoning:
                    assistant[rkey] = "".join(reasoning)
                s.record_turn(assistant, s.finish_searches(tcalls, planned))
                resp.close()
                resp = s.call_model(stream=True)
                if resp.status_code != 200:
                    yield sse.emit(_error_of(resp))
                    yield sse.DONE
                    return
                continue

            # the last round: answer, client tool calls, or budget spent
            if finish_obj is None and not content and not theirs:
                yield sse.emit(error_body("the upstream stream ended without a finish", 502,
                                          code="upstream_stream_truncated"))
                yield sse.DONE
                return
            if ours and not theirs and not content:
                yield sse.emit(s.exhausted_error())
                yield sse.DONE
                return
            fin = finish_obj or {"object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            fin.update(head)
            fin.pop("usage", None)
            fch = fin["choices"][0]
            fch["delta"] = {}
            if theirs:
                fch["finish_reason"] = "tool_calls"
            else:
                if fch.get("finish_reason") == "tool_calls":
                    fch["finish_reason"] = "stop"
                block = s.sources.block("".join(content)) if s.settings.SEARCH_SOURCES else ""
                if block:
                    yield sse.emit({**head, "object": "chat.completion.chunk",
                                    "choices": [{"index": 0, "delta": {"content": block},
                                                 "finish_reason": None}]})
            yield sse.emit(fin)
            if s.usage:
                yield sse.emit({**head, "object": "chat.completion.chunk", "choices": [],
                                "usage": s.usage})
            yield sse.DONE
            return
    except ApiError as e:
        yield sse.emit(error_body(e.message, e.status, e.type, e.code))
        yield sse.DONE
    except requests.RequestException as e:
        yield sse.emit(error_body(f"upstream stream failed: {e}", 502, code="upstream_error"))
        yield sse.DONE
    finally:
        resp.close()
        s.done()


def _meaningful(delta: dict) -> bool:
    return any(v not in (None, "", [], {}) for v in delta.values())


def _error_of(r: requests.Response) -> dict:
    try:
        obj = r.json()
        if isinstance(obj, dict) and "error" in obj:
            return obj
    except ValueError:
        pass
    finally:
        r.close()
    return error_body(f"upstream answered HTTP {r.status_code}: {r.text[:200]}", 502,
                      code="upstream_error")
