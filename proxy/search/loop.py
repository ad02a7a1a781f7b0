"""The model <-> SearXNG loop for chat completions, non-streaming and streaming: the
chat dialect's adapter over the shared engine (search/engine.py: Turn, decide,
Searcher), as proxy/dialects/ are for Anthropic Messages and OpenAI Responses.

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
from typing import Iterator

import requests
from flask import Response

from common import guard, sse
from common.errors import ApiError, error_body
from common.disconnect import ClientGone
from common.streaming import forward_headers, headers_now

from .. import normalize
from ..upstream import watched
from .engine import TOOL_DESCRIPTION, TOOL_NAME, TOOL_PARAMETERS, Search, Searcher, Step, \
    Turn, decide
from .searxng import SearxngClient

log = logging.getLogger("proxy.search")

WEB_SEARCH_TOOL = {"type": "function",
                   "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                                "parameters": TOOL_PARAMETERS}}
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
    # Fresh outer dicts; the parameters' schema is shared, as in the other dialects'
    # tool definitions (nothing changes a tool's schema; a deepcopy was 50 calls).
    body["tools"] = list(body.get("tools") or []) + [
        {"type": "function", "function": dict(WEB_SEARCH_TOOL["function"])}]


def _usage_add(total: dict | None, u) -> dict | None:
    if not isinstance(u, dict):
        return total
    total = dict(total or {})
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(u.get(k), int):
            total[k] = total.get(k, 0) + u[k]
    return total


class SearchSession:
    """One chat request with web_search injected: the backend body and the Searcher."""

    def __init__(self, body: dict, *, settings, upstream, searx: SearxngClient, metrics,
                 executor: cf.Executor, headers, environ: dict | None = None):
        self.body = body
        self.environ = environ      # the client's: its hang-up cuts the backend's work
        self.settings = settings
        self.upstream = upstream
        self.searcher = Searcher(settings=settings, searx=searx, metrics=metrics,
                                 executor=executor)
        # The client's end-to-end headers (common.http1 writes Accept-Encoding and framing).
        self.headers = {**forward_headers(headers), "Content-Type": "application/json"}
        self.usage: dict | None = None
        self.forced = isinstance(body.get("tool_choice"), dict)  # named web_search

    def round_body(self, stream: bool) -> dict:
        b = dict(self.body)
        b["stream"] = stream
        if self.searcher.rounds and self.forced:
            b["tool_choice"] = "auto"      # forcing web_search every round would never end
        if not self.searcher.budget_left:
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
        data = guard.dumps(self.round_body(stream))
        return self.upstream.request("POST", CHAT_PATH, headers=self.headers, data=data,
                                     stream=stream, environ=self.environ,
                                     read_body=not stream)

    def record(self, turn: Turn, reasoning_key: str | None,
               searches: list[Search]) -> None:
        """The round as the model sees it next time: its turn, one tool message per call."""
        assistant = {"role": "assistant", "content": turn.content or None,
                     "tool_calls": [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.args}}
                                    for c in turn.ours]}
        if turn.reasoning and reasoning_key:
            assistant[reasoning_key] = "".join(turn.reasoning)
        self.body["messages"] = list(self.body["messages"]) + [assistant] + [
            {"role": "tool", "tool_call_id": x.call.id, "content": x.text} for x in searches]

    def exhausted_error(self) -> dict:
        return error_body(self.searcher.exhausted_message(), 502,
                          code="search_budget_exhausted")

    def done(self) -> None:
        self.searcher.done()


def turn_of(msg: dict, finish=None) -> Turn:
    """A whole chat message as a Turn."""
    t = Turn()
    t.text(msg.get("content") if isinstance(msg.get("content"), str) else None)
    for i, c in enumerate(msg.get("tool_calls") or []):
        if not isinstance(c, dict):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        args = fn.get("arguments")
        t.call(i, c.get("id"), fn.get("name") or "")
        t.args(i, args if isinstance(args, str) else json.dumps(args or {}))
    t.finish = finish
    return t


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
            raw = r.content
            first_round = s.searcher.rounds == 0
            if first_round and b'"tool_calls"' not in raw and b'"reasoning' not in raw:
                # No call of ours or theirs, nothing to mirror: the answer as it came.
                return Response(raw, status=200, mimetype="application/json")
            try:
                obj = guard.answer_json(raw)
                choice = obj["choices"][0]
                msg = choice["message"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ApiError(f"upstream returned an unexpected chat response: "
                               f"{raw[:200]!r}", 502, code="bad_upstream_response")
            s.usage = _usage_add(s.usage, obj.get("usage"))
            turn = turn_of(msg, choice.get("finish_reason"))
            step = decide(turn, s.searcher.budget_left)
            if step is Step.SEARCH:
                rkey = next((k for k in normalize.REASONING_KEYS if msg.get(k)), None)
                turn.think(msg.get(rkey) if rkey else None)
                s.record(turn, rkey, s.searcher.run(turn.ours))
                continue
            if step is Step.EXHAUSTED:
                return Response(guard.dumps(s.exhausted_error()), status=502,
                                mimetype="application/json")
            # final: an answer, client tool calls (ours dropped)
            changed = False
            if turn.ours:
                changed = True
                theirs = [c for c in msg["tool_calls"] if _tool_name(c) != TOOL_NAME]
                if theirs:
                    msg["tool_calls"] = theirs
                else:
                    msg.pop("tool_calls", None)
                    if choice.get("finish_reason") == "tool_calls":
                        choice["finish_reason"] = "stop"
            if not turn.theirs and s.settings.SEARCH_SOURCES:
                block = s.searcher.sources.block(msg.get("content"))
                if block:
                    changed = True
                    msg["content"] = (msg.get("content") or "") + block
            changed |= bool(normalize.normalize_completion(obj))
            if s.usage and not first_round:         # the rounds' usage, summed
                changed = True
                obj["usage"] = {**(obj.get("usage") or {}), **s.usage}
            # An answer of one round that needs no change leaves as the backend sent it.
            return Response(guard.dumps(obj) if changed else raw, status=200,
                            mimetype="application/json")
    finally:
        s.done()


# ================================================================= streaming

class _Round:
    """One streamed chat round: feeds the Turn, and renumbers the client's tool calls
    (ours are held back, so theirs get consecutive indexes)."""

    def __init__(self, first_round: bool):
        self.turn = _ChatTurn()
        self.first_round = first_round
        self.rkey: str | None = None
        self.finish_obj: dict | None = None
        self._out: dict[int, int] = {}         # backend index -> client index
        self._pending: dict[int, list] = {}    # fragments that came before the name

    def tool_deltas(self, tcs: list[dict]) -> list[dict]:
        """The client's share of one delta's tool_calls."""
        out = []
        for tc in tcs:
            idx = tc.get("index", 0)
            fn = tc.get("function") or {}
            c = self.turn.call(idx, tc.get("id"), fn.get("name"))
            self.turn.args(idx, fn.get("arguments"))
            if not c.name:
                self._pending.setdefault(idx, []).append(tc)
                continue
            pending = self._pending.pop(idx, [])
            if c.name == TOOL_NAME:
                continue                       # ours: held back
            if idx not in self._out:
                self._out[idx] = len(self._out)
            out += [{**p, "index": self._out[idx]} for p in pending + [tc]]
        return out

    def feed(self, obj: dict, s: SearchSession) -> tuple[dict | None, bool]:
        """One backend chunk -> (the chunk for the client or None, whether it changed:
        an unchanged chunk goes out as the backend's own bytes)."""
        changed = not self.first_round
        if "usage" in obj:
            s.usage = _usage_add(s.usage, obj.pop("usage"))
            changed = True
        choices = obj.get("choices") or []
        if not choices:
            return None, changed
        ch = choices[0]
        delta = ch.get("delta") or {}
        if not self.first_round:
            delta.pop("role", None)
        self.turn.text(delta.get("content"))
        for k in normalize.REASONING_KEYS:
            if delta.get(k):
                self.rkey = self.rkey or k
                if k == self.rkey:
                    self.turn.think(delta[k])
        changed |= normalize.mirror_reasoning(delta)
        if delta.get("tool_calls"):
            changed = True
            out_tcs = self.tool_deltas(delta["tool_calls"])
            if out_tcs:
                delta["tool_calls"] = out_tcs
            else:
                delta.pop("tool_calls")
        if ch.get("finish_reason"):
            self.finish_obj = obj
            self.turn.finish = ch["finish_reason"]
            ch["delta"] = delta
            if not _meaningful(delta):
                return None, True
            obj = copy.deepcopy(obj)            # the delta now, the finish_reason later
            obj["choices"][0]["finish_reason"] = None
            return obj, True
        if not changed:
            return obj, False
        if not _meaningful(delta):
            return None, True
        ch["delta"] = delta
        return obj, True


class _Head:
    """id, created, model and system_fingerprint of the client's stream: the first
    round's, taken from its first chunk when first needed. That chunk goes out
    as the backend sent it, unparsed (it lies between the first token and the
    client; most streams never need their head)."""

    KEYS = ("id", "created", "model", "system_fingerprint")

    def __init__(self):
        self._raw: bytes | None = None          # the first plain chunk(s), unparsed
        self._fields: dict | None = None

    def see(self, raw: bytes) -> None:
        if self._raw is None and self._fields is None:
            self._raw = raw

    def learn(self, obj: dict) -> None:
        if self._fields is None and self._raw is None:
            self._fields = {k: obj[k] for k in self.KEYS if k in obj}

    @property
    def fields(self) -> dict:
        if self._fields is None:
            self._fields = {}
            for ev in sse.events(self._raw or b""):
                try:
                    obj = guard.answer_json(ev.data)
                except (ValueError, TypeError):
                    continue
                if isinstance(obj, dict):
                    self._fields = {k: obj[k] for k in self.KEYS if k in obj}
                    break
            self._raw = None
        return self._fields


def _relay_round(s: SearchSession, resp: requests.Response, rnd: _Round, head: _Head):
    """Relay one backend stream to the client, the events of each read in one write;
    returns False if it ended the stream."""
    for whole in sse.batches(watched(resp, s.environ)):
        if rnd.first_round and _plain(whole):
            head.see(whole)
            rnd.turn.texts.append(whole)       # parsed only if the text is needed
            yield whole
            continue
        out: list[bytes] = []
        more = _relay_events(s, whole, rnd, head, out)
        if out:
            yield b"".join(out)
        if more is not None:
            return more
    return True


def _relay_events(s: SearchSession, whole: bytes, rnd: _Round, head: _Head,
                  out: list) -> bool | None:
    """The client's bytes for the events of one read, into `out`; True at [DONE],
    False when an error ended the stream, None to read on."""
    for raw in sse.split(whole):
        if rnd.first_round and _plain(raw):
            head.see(raw)
            rnd.turn.texts.append(raw)
            out.append(raw)
            continue
        ev = sse.parse_event(raw)
        if ev is None:
            continue
        if ev.data is None:
            out.append(raw)              # a comment (the swapper's progress): pass it on
            continue
        if ev.is_done:
            return True
        try:
            obj = guard.answer_json(ev.data)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            out += (sse.emit(obj), sse.DONE)
            return False
        head.learn(obj)
        chunk, changed = rnd.feed(obj, s)
        if chunk is None:
            continue
        if not changed:
            out.append(raw)
        else:
            chunk.update(head.fields)
            out.append(sse.emit(chunk))
    return None


def _plain(whole: bytes) -> bool:
    """Whether whole events (one or more) are all chunks that the first round passes
    on as the backend sent them and learns only their text from: each a single
    `data:` line holding a JSON object with a choice; no tool calls, reasoning, usage
    or error (what the round may change or act on); a null (or no) finish_reason.
    Checked on the bytes, at C speed; a false "no" only costs the parse."""
    n = whole.count(b"\n\n")
    return (whole.startswith(b'data: {"') and whole.endswith(b"}\n\n")
            and whole.count(b"\n") == 2 * n
            and whole.count(b'}\n\ndata: {"') == n - 1
            and whole.count(b'"choices":[{') == n
            and whole.count(b'"finish_reason"') == whole.count(b'"finish_reason":null')
            and b'"tool_calls"' not in whole and b'"reasoning' not in whole
            and b'"usage"' not in whole and b'"error"' not in whole)


def _text_of(whole: bytes) -> str:
    """The content of plain chunks (see _plain), as _Round.feed would have taken it."""
    texts = []
    for ev in sse.events(whole):
        try:
            delta = json.loads(ev.data)["choices"][0].get("delta") or {}
        except (ValueError, TypeError, KeyError, IndexError):
            continue
        if delta.get("content"):
            texts.append(delta["content"])
    return "".join(texts)


class _ChatTurn(Turn):
    """A streamed chat turn whose `texts` may hold the bytes of plain chunks (see
    _plain), parsed the first time its content is read (most answers never are)."""

    @property
    def content(self) -> str:
        if any(type(t) is bytes for t in self.texts):
            self.texts = [t if type(t) is str else _text_of(t) for t in self.texts]
        return "".join(self.texts)


def _search_round(s: SearchSession, rnd: _Round):
    """Answer our calls, with keep-alives while SearXNG works."""
    yield sse.KEEPALIVE
    calls = rnd.turn.ours
    planned = s.searcher.start(calls)
    futs = s.searcher.futures(planned)
    while futs:
        _, pending = cf.wait(futs, timeout=s.settings.KEEPALIVE_INTERVAL)
        futs = list(pending)
        if futs:
            yield sse.KEEPALIVE
    s.record(rnd.turn, rnd.rkey, s.searcher.finish(calls, planned))


def _final(s: SearchSession, rnd: _Round, head: _Head):
    """The end of the client's stream, in one write: sources, the finish chunk, usage,
    [DONE]."""
    out = []
    fin = rnd.finish_obj or {"object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    head = head.fields
    fin.update(head)
    fin.pop("usage", None)
    fch = fin["choices"][0]
    fch["delta"] = {}
    if rnd.turn.theirs:
        fch["finish_reason"] = "tool_calls"
    else:
        if fch.get("finish_reason") == "tool_calls":
            fch["finish_reason"] = "stop"
        sources = s.searcher.sources
        block = sources.block(rnd.turn.content) \
            if s.settings.SEARCH_SOURCES and sources.items else ""
        if block:
            out.append(sse.emit({**head, "object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": {"content": block},
                                              "finish_reason": None}]}))
    out.append(sse.emit(fin))
    if s.usage:
        out.append(sse.emit({**head, "object": "chat.completion.chunk", "choices": [],
                             "usage": s.usage}))
    out.append(sse.DONE)
    yield b"".join(out)


def run_stream(s: SearchSession, first: requests.Response) -> Iterator[bytes]:
    resp = first
    head = _Head()               # id/created/model of the client's stream (first round)
    try:
        if headers_now(first):
            yield b""
        while True:
            rnd = _Round(first_round=s.searcher.rounds == 0)
            if not (yield from _relay_round(s, resp, rnd, head)):
                return
            resp.end()           # at its [DONE]: the connection serves the next call
            step = decide(rnd.turn, s.searcher.budget_left)
            if step is Step.SEARCH:
                yield from _search_round(s, rnd)
                resp = s.call_model(stream=True)
                if resp.status_code != 200:
                    yield sse.emit(_error_of(resp)) + sse.DONE
                    return
                continue
            if step is Step.TRUNCATED:
                yield sse.emit(error_body("the upstream stream ended without a finish", 502,
                                          code="upstream_stream_truncated")) + sse.DONE
            elif step is Step.EXHAUSTED:
                yield sse.emit(s.exhausted_error()) + sse.DONE
            else:
                yield from _final(s, rnd, head)
            return
    except ClientGone:
        return
    except ApiError as e:
        yield sse.emit(error_body(e.message, e.status, e.type, e.code)) + sse.DONE
    except requests.RequestException as e:
        yield sse.emit(error_body(f"upstream stream failed: {e}", 502,
                                  code="upstream_error")) + sse.DONE
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
