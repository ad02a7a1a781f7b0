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

import copy
import json
import re
import time
import uuid
from typing import Iterator

from flask import Response

from common import sse
from common.dialects import RESPONSES
from common.errors import ApiError

from .. import agents, progress
from ..search import engine
from ..search.engine import Search, Turn, new_id
from .base import (TOOL_NAME, Adapter, Dialect, event, parse_json_object, put_system,
                   server_search)

SEARCH_TOOL_TYPES = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                     "web_search_2025_08_26")
FUNCTION_TOOL = {"type": "function", "name": TOOL_NAME, "description": engine.TOOL_DESCRIPTION,
                 "parameters": engine.TOOL_PARAMETERS}


def stream_error(message: str, status: int, code: str) -> list[sse.Event]:
    """An error ending a stream whose status is sent already: `response.failed`
    (Codex shows its error's message)."""
    return event("response.failed", {"type": "response.failed", "sequence_number": 0,
                                      "response": {"id": new_id("resp_"), "object": "response",
                                                   "created_at": int(time.time()),
                                                   "status": "failed", "output": [],
                                                   "error": {"code": code, "message": message}}})


def server_tool(body: dict) -> dict | None:
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


PATH = RESPONSES.path
FLOOR_KEYS = ("max_output_tokens",)


def parse(raw: bytes) -> dict:
    body = parse_json_object(raw, "a Responses request with 'input'")
    validate(body)
    return body


def system_prompt(body: dict, text) -> bool:
    return put_system(body, "instructions", text)


def search_tool(body: dict, settings) -> tuple[dict | None, bool]:
    return server_search(body, settings, server_tool(body))


def straight_stream(chunks, body, names=None):
    return renamed_stream(chunks, names) if names else chunks


def straight_whole(content: bytes, names=None) -> bytes:
    if not names or not any(n.encode() in content for n in names):
        return content
    try:
        obj = json.loads(content)
    except ValueError:
        return content
    return json.dumps(renamed(obj, names), ensure_ascii=False).encode() \
        if isinstance(obj, dict) else content


# ============================================================ namespace tools (Codex)
#
# Codex groups tools in `{"type": "namespace", "name": NS, "tools": [function, ...]}`
# (its multi-agent tools, MCP servers' tools); llama-server's /v1/responses skips
# every tool that is not a function (the model would never see them). They reach
# the backend as plain function tools named NS__NAME (Codex's own rule when it
# speaks chat completions: codex-rs chat_tools_from_responses_tool), and the model's
# calls of them come back in Codex's shape: `{"type": "function_call", "name":
# NAME, "namespace": NS, ...}` (codex-rs ResponseItem::FunctionCall). Codex's history
# items carry the same two fields: they reach the backend as NS__NAME again, so the
# prompt renders the call as the model made it (and stays a prefix turn to turn).

def _joined(ns: str, name: str) -> str:
    return ns + name if ns.endswith("__") else f"{ns}__{name}"


def flatten(body: dict) -> dict[str, tuple[str, str]]:
    """Namespace tools and namespaced history calls made plain, in place (each
    namespace's tools where it stood); {backend name: (namespace, name)} of the
    tools flattened ({} when nothing was)."""
    names: dict[str, tuple[str, str]] = {}
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") == "namespace"
                                       for t in tools):
        flat = []
        for t in tools:
            if not (isinstance(t, dict) and t.get("type") == "namespace"):
                flat.append(t)
                continue
            ns = t.get("name") if isinstance(t.get("name"), str) else ""
            for child in t.get("tools") or []:
                if not (isinstance(child, dict) and child.get("type", "function") == "function"
                        and isinstance(child.get("name"), str)):
                    continue
                full = _joined(ns, child["name"]) if ns else child["name"]
                names[full] = (ns, child["name"])
                flat.append({**child, "type": "function", "name": full})
        body["tools"] = flat
    items = body.get("input")
    for it in items if isinstance(items, list) else ():
        if isinstance(it, dict) and it.get("type") in ("function_call", "custom_tool_call") \
                and isinstance(it.get("namespace"), str) and isinstance(it.get("name"), str):
            ns = it.pop("namespace")
            if ns:
                full = _joined(ns, it["name"])
                names.setdefault(full, (ns, it["name"]))
                it["name"] = full
            else:
                names.setdefault(it["name"], ("", it["name"]))
    return names


def renamed_item(item, names: dict):
    """A function_call item of a flattened tool in Codex's shape (a copy)."""
    if isinstance(item, dict) and item.get("type") == "function_call" and \
            item.get("name") in names:
        ns, name = names[item["name"]]
        return {**item, "name": name, "namespace": ns} if ns else item
    return item


def renamed(obj: dict, names: dict) -> dict:
    """An event or a response with its function_call items in Codex's shape (copies
    where they change; the backend's own objects are left as they are)."""
    if not names:
        return obj
    out = obj
    if isinstance(obj.get("item"), dict):
        item = renamed_item(obj["item"], names)
        if item is not obj["item"]:
            out = {**out, "item": item}
    resp = obj.get("response") if isinstance(obj.get("response"), dict) else None
    target = resp if resp is not None else obj
    if isinstance(target.get("output"), list):
        output = [renamed_item(i, names) for i in target["output"]]
        if any(a is not b for a, b in zip(output, target["output"])):
            if resp is not None:
                out = {**out, "response": {**resp, "output": output}}
            else:
                out = {**out, "output": output}
    return out


def renamed_stream(chunks, names: dict) -> sse.Body:
    """A Responses stream (bytes, or an earlier stage's events) with the calls of
    flattened tools in Codex's shape: the events that name one remade, every other
    one as it came."""
    return sse.Body(_renamed(sse.events_of(chunks), names))


def _renamed(batches, names: dict):
    keys = [n.encode() for n in names]
    try:
        for evs in batches:
            if any(k in ev.raw for ev in evs for k in keys):
                evs = [_renamed_event(ev, names, keys) for ev in evs]
            yield evs
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _renamed_event(ev: sse.Event, names: dict, keys: list[bytes]) -> sse.Event:
    if ev.data is None or not any(k in ev.raw for k in keys):
        return ev
    obj = ev.json
    if not isinstance(obj, dict):
        return ev
    new = renamed(obj, names)
    return ev if new is obj else sse.Event.of(new, ev.name or new.get("type", ""))


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
        t.usage(usage.get("output_tokens"))
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


def _usage(inp: int, out: int, cached: int = 0, reasoning: int = 0) -> dict:
    """The client's usage: the prompt side (input_tokens, cached_tokens) is the last
    round's -- the conversation as the model last read it, what a direct request
    reports, and what Codex counts (summing every round's prompt doubled its count);
    output tokens are summed over the rounds (see chat._usage_add)."""
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": inp + out}


def _detail(u: dict, key: str, field: str) -> int:
    d = u.get(key)
    v = d.get(field) if isinstance(d, dict) else None
    return v if isinstance(v, int) else 0



def _item_key(obj: dict):
    """The key of the item an event is about: its output_index, or (llama-server
    sends none) its item's id; None: about no item."""
    bi = obj.get("output_index")
    if bi is None:
        item = obj.get("item") if isinstance(obj.get("item"), dict) else {}
        bi = item.get("id") or obj.get("item_id")
    return bi


class _Round:
    """What one streamed round has told so far."""

    def __init__(self, first: bool):
        self.first = first          # the first round (its head is the client's)
        self.where: dict = {}       # backend item key -> client index (None: held)
        self.items: dict = {}       # backend item key -> the finished item
        self.order: list = []       # backend item keys as they were added
        self.done: dict | None = None   # its response.completed's response
        self.over = self.failed = False


class ResponsesAdapter(Adapter):
    path = PATH
    call_prefix = "ws_"

    def __init__(self, body: dict, tool: dict, parts: dict, request):
        super().__init__(body, tool, parts, request)
        self.tools = [copy.deepcopy(FUNCTION_TOOL)
                      if isinstance(t, dict) and t.get("type") in SEARCH_TOOL_TYPES else t
                      for t in body.get("tools") or []]
        inp = body["input"]
        self.input = [{"type": "message", "role": "user", "content": inp}] \
            if isinstance(inp, str) else list(inp)
        tc = body.get("tool_choice")
        self.forced = isinstance(tc, dict) and tc.get("type") in SEARCH_TOOL_TYPES or \
            tc == "required"
        self.head: dict | None = None       # the first round's response, less its output
        self.output: list[dict] = []        # the client's output items, in order
        self.items: list[dict] = []         # the round's, as the backend sent them
        self.shown: list[dict] = []         # of which the client saw (not ours)
        self.last: dict = {}                # the round's response (whole) / its completion
        self.streaming = False
        self.seq = 0                        # the client stream's next sequence_number
        self.inp = self.out = 0             # the last round's input, every round's output
        self.cached = self.reasoning = 0    # the last round's cached, every round's reasoning
        self.names: dict = {}               # flattened namespace tools (flatten)

    def round_body(self, stream: bool) -> dict:
        b = dict(self.body)                 # the client's key order: a stable prompt
        inc = [x for x in self.body.get("include") or [] if "web_search" not in str(x)]
        if inc:
            b["include"] = inc
        else:
            b.pop("include", None)
        b["input"] = self.input
        b["stream"] = stream
        tools = self.tools
        if not self.searcher.budget_left:
            tools = [t for t in tools if t.get("name") != TOOL_NAME]
        if tools:
            b["tools"] = tools
        else:
            b.pop("tools", None)
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

    @property
    def keepalive(self) -> list[sse.Event]:
        """While SearXNG works and the next round prefills (the stream has begun):
        `response.in_progress`, which Codex's idle timer counts (a comment does not)."""
        if self.head is None:
            return super().keepalive
        return self.emit({"type": "response.in_progress",
                          "response": {**self.head, "output": []}})

    def emit(self, obj: dict) -> list[sse.Event]:
        """obj (numbered in place) as the client stream's next event (the calls of
        flattened namespace tools in Codex's shape)."""
        if self.names:
            obj = renamed(obj, self.names)
        obj["sequence_number"] = self.seq
        self.seq += 1
        return event(obj["type"], obj)

    def _head(self) -> dict:
        return self.head or {"id": new_id("resp_"), "object": "response",
                             "created_at": int(time.time()), "model": self.body.get("model")}

    def searching(self, calls) -> list[sse.Event]:
        """Each search's web_search_call item, in progress, while they run."""
        self.output += self.shown
        if not self.streaming:
            return []
        out, base = [], len(self.output)
        for k, c in enumerate(calls):
            out += self.emit({"type": "response.output_item.added", "output_index": base + k,
                              "item": web_search_call(Search(c, c.query, ""), "in_progress")})
            out += self.emit({"type": "response.web_search_call.in_progress",
                              "output_index": base + k, "item_id": c.client_id})
            out += self.emit({"type": "response.web_search_call.searching",
                              "output_index": base + k, "item_id": c.client_id})
        return out

    def searched(self, turn: Turn, searches: list[Search]) -> list[sse.Event]:
        """The round as the backend sees it next time: its items, our calls' outputs."""
        keep = [_input_item(i) for i in self.items if i.get("type") in ("message",
                                                                         "function_call")]
        self.input = self.input + keep + [
            {"type": "function_call_output", "call_id": s.call.id, "output": s.text}
            for s in searches]
        out, base = [], len(self.output)
        for k, x in enumerate(searches):
            item = web_search_call(x)
            self.output.append(item)
            if self.streaming:
                out += self.emit({"type": "response.web_search_call.completed",
                                  "output_index": base + k, "item_id": x.call.client_id})
                out += self.emit({"type": "response.output_item.done",
                                  "output_index": base + k, "item": item})
        return out

    # ------------------------------------------------------------ whole answers

    def turn_of(self, r) -> Turn:
        try:
            obj = r.json()
            items = obj["output"]
            if not isinstance(items, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise ApiError(f"upstream returned an unexpected Responses object: "
                           f"{r.content[:200]!r}", 502, code="bad_upstream_response")
        self.head = self.head or obj
        self.last, self.items = obj, items
        self.shown = [i for i in items if not _is_ours(i)]
        turn = turn_of(items, obj.get("status"), obj.get("usage"))
        self._round_usage(obj.get("usage"))
        return turn

    def _round_usage(self, u) -> None:
        u = u if isinstance(u, dict) else {}
        self.inp = u.get("input_tokens") or 0
        self.cached = _detail(u, "input_tokens_details", "cached_tokens")
        self.out += u.get("output_tokens") or 0
        self.reasoning += _detail(u, "output_tokens_details", "reasoning_tokens")

    def usage(self) -> dict:
        return _usage(self.inp, self.out, self.cached, self.reasoning)

    def answer(self, turn: Turn) -> Response:
        for it in self.shown:
            annotate(it, self.searcher)
        result = {**self.head, "status": self.last.get("status") or "completed",
                  "output": self.output + self.shown, "usage": self.usage(),
                  "tools": self.body.get("tools") or [],
                  "model": self.head.get("model") or self.body.get("model")}
        result.pop("output_text", None)
        result = renamed(result, self.names)
        return Response(json.dumps(result, ensure_ascii=False), status=200,
                        mimetype="application/json")

    # ------------------------------------------------------------ streams

    def relay(self, resp):
        """One backend stream's events, renumbered into the client's one response
        (our function calls held back), each through its handler in ON; the round's
        Turn, or None when it ended the stream."""
        self.streaming = True
        rnd = _Round(first=self.searcher.rounds == 0)
        yield from self.events(resp, rnd)
        if rnd.failed:
            return None
        done = rnd.done
        if done is None:
            yield self.fail("the upstream stream ended before response.completed", 502,
                            "upstream_stream_truncated")
            return None
        self.last = done
        self._round_usage(done.get("usage"))
        self.items = [rnd.items[k] for k in rnd.order if k in rnd.items] or \
            done.get("output") or []
        self.shown = [rnd.items[k] for k in rnd.order
                      if k in rnd.items and rnd.where.get(k) is not None]
        return turn_of(self.items, done.get("status"))

    def _opened(self, rnd: "_Round", obj: dict, kind: str) -> list[sse.Event]:
        """response.created, response.in_progress: the first round's, as our one
        response (later rounds: the same one response, nothing new)."""
        if not rnd.first:
            return []
        if self.head is None:
            self.head = {k: v for k, v in (obj.get("response") or {}).items()
                         if k not in ("output", "usage")}
        obj["response"] = {**self.head, "output": []}
        return self.emit(obj)

    def _completed(self, rnd: "_Round", obj: dict, kind: str) -> list[sse.Event]:
        """The round's end (response.completed or .incomplete): kept for end()."""
        rnd.done = obj.get("response") or {}
        rnd.over = True
        return []

    def _failed(self, rnd: "_Round", obj: dict, kind: str) -> list[sse.Event]:
        """The backend's failure ends the client's stream, its message kept."""
        rnd.over = rnd.failed = True
        err = obj.get("error") or (obj.get("response") or {}).get("error") or obj
        return self.fail(str(err.get("message") or err) if isinstance(err, dict) else
                         str(err), 502, "upstream_error")

    def _added(self, rnd: "_Round", obj: dict, kind: str) -> list[sse.Event]:
        """An item at the client's next output index; our function calls held back."""
        bi = _item_key(obj)
        if bi is None:
            return []
        rnd.order.append(bi)
        if _is_ours(obj.get("item") or {}):
            rnd.where[bi] = None
            return []
        rnd.where[bi] = len(self.output) + sum(1 for v in rnd.where.values() if v is not None)
        return self._moved(rnd, obj, kind, bi)

    def _item_done(self, rnd: "_Round", obj: dict, kind: str) -> list[sse.Event]:
        """An item whole: kept for the round, its citations annotated."""
        bi = _item_key(obj)
        if bi is None:
            return []
        ci = rnd.where.get(bi)
        rnd.items[bi] = item = obj.get("item") or {}
        out = []
        if ci is not None:
            for pi, ai, a in annotate(item, self.searcher):
                out += self.emit({"type": "response.output_text.annotation.added",
                                  "item_id": item.get("id"), "output_index": ci,
                                  "content_index": pi, "annotation_index": ai,
                                  "annotation": a})
        return out + self._moved(rnd, obj, kind, bi)

    def other(self, rnd: "_Round", obj: dict, kind: str) -> list[sse.Event]:
        """Any other event of an item (its content parts, text deltas...)."""
        bi = _item_key(obj)
        return [] if bi is None else self._moved(rnd, obj, kind, bi)

    def _moved(self, rnd: "_Round", obj: dict, kind: str, bi) -> list[sse.Event]:
        """An item's event at its client output index, numbered in the client's
        stream (nothing for our held-back calls)."""
        ci = rnd.where.get(bi)
        if ci is None:
            return []
        obj.pop("sequence_number", None)
        if kind.startswith(("response.content_part.", "response.output_text.")):
            obj.setdefault("content_index", 0)
        obj["output_index"] = ci
        return self.emit(obj)

    ON = {"response.created": _opened, "response.in_progress": _opened,
          "response.completed": _completed, "response.incomplete": _completed,
          "response.failed": _failed, "error": _failed,
          "response.output_item.added": _added, "response.output_item.done": _item_done}

    def end(self, turn: Turn) -> list[sse.Event]:
        self.output += self.shown
        status = self.last.get("status") or "completed"
        final = {**self._head(),
                 **{k: v for k, v in self.last.items()
                    if k in ("incomplete_details", "completed_at")},
                 "status": status, "output": self.output, "usage": self.usage()}
        return self.emit({"type": "response.incomplete" if status == "incomplete"
                          else "response.completed", "response": final})

    def fail(self, message: str, status: int, code: str) -> list[sse.Event]:
        r = {**self._head(), "status": "failed", "output": self.output,
             "error": {"code": code, "message": message}}
        return self.emit({"type": "response.failed", "response": r})


# ================================================================= progress

class Progress(progress.Progress):
    """A waiting stream's progress: `response.created`, then `response.in_progress`
    events (Codex's idle timer counts every event); the backend's own
    `response.created` is left out."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.response = {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response",
                         "created_at": int(time.time()), "status": "in_progress",
                         "model": body.get("model") or "", "output": []}
        self.opened = False

    def tick(self, text: str) -> list[sse.Event]:
        out = []
        if not self.opened:
            self.opened = True
            out.append(self.event({"type": "response.created", "response": self.response},
                                  "response.created"))
        out.append(self.event({"type": "response.in_progress", "response": self.response},
                              "response.in_progress"))
        return out

    def then(self, first: list[sse.Event], batches) -> Iterator[list[sse.Event]]:
        """The backend's events, its response.created left out (ours went first) and
        its lifecycle events (in_progress, completed, ...) under our response's id:
        the OpenAI SDK refuses a stream whose response changes identity."""
        yield self._ours(first)
        for evs in batches:
            ours = self._ours(evs)
            if ours or not evs:
                yield ours

    def _ours(self, evs: list[sse.Event]) -> list[sse.Event]:
        out = []
        for ev in evs:
            obj = ev.json if _LIFECYCLE.search(ev.raw) else None
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == "response.created":
                continue
            if not kind or not isinstance(obj.get("response"), dict):
                out.append(ev)
                continue
            obj["response"]["id"] = self.response["id"]
            out.append(sse.Event.of(obj, ev.name or kind))
        return out


_LIFECYCLE = re.compile(rb'"response\.(?:created|queued|in_progress|completed|failed|incomplete)"')


DIALECT = Dialect(RESPONSES, parse=parse, system_prompt=system_prompt, search_tool=search_tool,
                  floor_keys=FLOOR_KEYS, straight_stream=straight_stream,
                  straight_whole=straight_whole, stream_error=stream_error,
                  adapter=ResponsesAdapter, progress=Progress, flatten=flatten,
                  agent_fix=agents.fix_responses)
