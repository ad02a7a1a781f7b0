"""Chat completions (`POST /v1/chat/completions`) with the web_search tool we inject.

The adapter's `body["messages"]` is the internal history: assistant turns with our
web_search calls (reasoning kept), one tool message per call id; nothing of it is
shown to the client but the final answer (whole) or every round's content and
reasoning deltas (streamed). In a turn that also calls client tools, their calls go
back to the client untouched and ours are dropped (not run, never shown).
"""
from __future__ import annotations

import copy
import json
import time
import uuid

from flask import Response

from common import guard, sse
from common.dialects import CHAT
from common.errors import ApiError, error_body

from .. import agents, normalize, progress
from ..search.engine import TOOL_DESCRIPTION, TOOL_PARAMETERS, Turn
from ..search.rounds import backend_error
from .base import TOOL_NAME, Adapter, Dialect

PATH = CHAT.path
FLOOR_KEYS = ("max_tokens", "max_completion_tokens")
WEB_SEARCH_FUNCTION = {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                       "parameters": TOOL_PARAMETERS}


def parse(raw: bytes) -> dict:
    return normalize.parse_chat_body(raw)


def system_prompt(body: dict, text) -> bool:
    """A system message first, unless the conversation begins with one."""
    if body["messages"][0].get("role") in ("system", "developer"):
        return False
    return normalize.inject_system_prompt(body, text())


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
    return (body.get("n") or 1) <= 1


def inject_tool(body: dict) -> None:
    """web_search last: the tools before it render as the client sent them, so the
    prompt's prefix stays the same turn to turn (fresh outer dicts; the schema is
    shared, nothing changes it)."""
    body["tools"] = list(body.get("tools") or []) + [
        {"type": "function", "function": dict(WEB_SEARCH_FUNCTION)}]


def search_tool(body: dict, settings) -> tuple[dict | None, bool]:
    """The search tool's settings when the proxy runs search for this request (ours,
    injected: no limits of its own), and whether the body changed."""
    if not should_inject(body, settings):
        return None, False
    inject_tool(body)
    return {}, True


def straight_stream(chunks, body, names=None):
    return normalize.normalize_sse(chunks)


def straight_whole(content: bytes, names=None) -> bytes:
    return normalize.normalize_completion_bytes(content)


def stream_error(message: str, status: int, code: str) -> list[sse.Event]:
    """An error ending a stream whose status is sent already: the OpenAI envelope."""
    return [sse.Event.of(error_body(message, status, code=code)), sse.done()]


def _usage_add(total: dict | None, u) -> dict | None:
    """The usage of the rounds so far with one more round's: the prompt side
    (prompt_tokens and its details, the cached tokens) is the last round's -- the
    conversation as the model last read it, what a direct request reports, whose
    cached part the agent's next turn reuses; completion tokens are summed over the
    rounds (all of them were generated); total_tokens is their sum. A one-round
    answer reports exactly what the backend did."""
    if not isinstance(u, dict):
        return total
    out = dict(u)
    done = (total or {}).get("completion_tokens", 0)
    if isinstance(u.get("completion_tokens"), int):
        out["completion_tokens"] = done + u["completion_tokens"]
    elif done:
        out["completion_tokens"] = done
    if isinstance(out.get("prompt_tokens"), int) and isinstance(out.get("completion_tokens"), int):
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def turn_of_message(msg: dict, finish=None) -> Turn:
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


class ChatAdapter(Adapter):
    path = PATH

    @property
    def keepalive(self) -> list[sse.Event]:
        """While SearXNG works and the next round prefills (the stream has begun): a
        chunk with an empty content delta, which agents' idle timers count (a comment
        does not: proxy/progress.py)."""
        return [sse.Event.of({**self.head.fields, "object": "chat.completion.chunk",
                              "choices": [{"index": 0, "delta": {"content": ""},
                                           "finish_reason": None}]})]

    def __init__(self, body: dict, tool: dict, parts: dict, request):
        super().__init__(body, tool, parts, request)
        self.usage: dict | None = None
        self.forced = isinstance(body.get("tool_choice"), dict)  # named web_search
        self.rkey: str | None = None        # the round's reasoning field
        self.head = _Head()                 # id/created/model of the client's stream
        self.whole: tuple | None = None     # the last whole answer: raw, obj, choice, msg

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

    def searched(self, turn: Turn, searches) -> list[sse.Event]:
        """The round as the model sees it next time: its turn, one tool message per call."""
        assistant = {"role": "assistant", "content": turn.content or None,
                     "tool_calls": [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.args}}
                                    for c in turn.ours]}
        if turn.reasoning and self.rkey:
            assistant[self.rkey] = "".join(turn.reasoning)
        self.body["messages"] = list(self.body["messages"]) + [assistant] + [
            {"role": "tool", "tool_call_id": x.call.id, "content": x.text} for x in searches]
        return []

    # ------------------------------------------------------------ whole answers

    def turn_of(self, r):
        raw = r.content
        if self.searcher.rounds == 0 and b'"tool_calls"' not in raw and \
                b'"reasoning' not in raw:
            # No call of ours or theirs, nothing to mirror: the answer as it came.
            return Response(raw, status=200, mimetype="application/json")
        try:
            obj = guard.answer_json(raw)
            choice = obj["choices"][0]
            msg = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ApiError(f"upstream returned an unexpected chat response: "
                           f"{raw[:200]!r}", 502, code="bad_upstream_response")
        self.usage = _usage_add(self.usage, obj.get("usage"))
        self.whole = raw, obj, choice, msg
        turn = turn_of_message(msg, choice.get("finish_reason"))
        self.rkey = next((k for k in normalize.REASONING_KEYS if msg.get(k)), None)
        turn.think(msg.get(self.rkey) if self.rkey else None)
        return turn

    def answer(self, turn: Turn) -> Response:
        """The client's tool calls (ours dropped) or the answer, with its sources."""
        raw, obj, choice, msg = self.whole
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
        if not turn.theirs and self.settings.SEARCH_SOURCES:
            block = self.searcher.sources.block(msg.get("content"))
            if block:
                changed = True
                msg["content"] = (msg.get("content") or "") + block
        changed |= bool(normalize.normalize_completion(obj))
        if self.usage and self.searcher.rounds:         # the rounds' usage, summed
            changed = True
            obj["usage"] = {**(obj.get("usage") or {}), **self.usage}
        # An answer of one round that needs no change leaves as the backend sent it.
        return Response(guard.dumps(obj) if changed else raw, status=200,
                        mimetype="application/json")

    # ------------------------------------------------------------ streams

    def relay(self, resp):
        """Relay one backend stream, the events of each read in one list (one write);
        the round's Turn, or None when an error event ended the stream."""
        rnd = _Round(first_round=self.searcher.rounds == 0)
        self.rkey = None
        for evs in sse.events_of(self.body_of(resp)):
            out: list[sse.Event] = []
            more = self._events(evs, rnd, out)
            if out:
                yield out
            if more is False:
                return None
            if more:
                break
        self.finish_obj = rnd.finish_obj
        self.rkey = rnd.rkey
        return rnd.turn

    def _events(self, evs: list[sse.Event], rnd: "_Round", out: list) -> bool | None:
        """The client's events for the events of one read, into `out`; True at
        [DONE], False when an error ended the stream, None to read on. A first
        round's plain chunk (see _plain) goes out as it came, unparsed; blank lines
        between events are dropped."""
        head = self.head
        for ev in evs:
            if rnd.first_round and _plain(ev):
                head.see(ev)
                rnd.turn.texts.append(ev)          # parsed only if the text is needed
                out.append(ev.bare())
                continue
            if ev.data is None:              # a comment (the swapper's progress): pass it on,
                if not ev.blank:             # in a later round (the stream has begun) with a
                    out.append(ev.bare())    # chunk timers count; blank lines go
                    if not rnd.first_round:
                        out += self.keepalive
                continue
            if ev.is_done:
                return True
            obj = ev.json
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                out += (sse.Event.of(obj), sse.done())
                return False
            head.learn(obj)
            chunk, changed = rnd.feed(obj, self)
            if chunk is None:
                continue
            if not changed:
                out.append(ev.bare())
            else:
                chunk.update(head.fields)
                out.append(sse.Event.of(chunk))
        return None

    def end(self, turn: Turn) -> list[sse.Event]:
        """The end of the client's stream, in one write: sources, the finish chunk,
        usage, [DONE]."""
        out = []
        fin = self.finish_obj or {"object": "chat.completion.chunk",
                                  "choices": [{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]}
        head = self.head.fields
        fin.update(head)
        fin.pop("usage", None)
        fch = fin["choices"][0]
        fch["delta"] = {}
        if turn.theirs:
            fch["finish_reason"] = "tool_calls"
        else:
            if fch.get("finish_reason") == "tool_calls":
                fch["finish_reason"] = "stop"
            sources = self.searcher.sources
            block = sources.block(turn.content) \
                if self.settings.SEARCH_SOURCES and sources.items else ""
            if block:
                out.append(sse.Event.of({**head, "object": "chat.completion.chunk",
                                         "choices": [{"index": 0, "delta": {"content": block},
                                                      "finish_reason": None}]}))
        out.append(sse.Event.of(fin))
        if self.usage:
            out.append(sse.Event.of({**head, "object": "chat.completion.chunk", "choices": [],
                                     "usage": self.usage}))
        out.append(sse.done())
        return out

    def fail(self, message: str, status: int, code: str) -> list[sse.Event]:
        return stream_error(message, status, code)

    def fail_answer(self, raw: bytes, status: int) -> list[sse.Event]:
        """The upstream's own envelope, as it is, when it sent one (or the one
        backend_error makes of it)."""
        status, raw = backend_error(status, raw)
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            obj = None
        if isinstance(obj, dict) and "error" in obj:
            return [sse.Event.of(obj), sse.done()]
        return super().fail_answer(raw, 502)


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

    def feed(self, obj: dict, ad: ChatAdapter) -> tuple[dict | None, bool]:
        """One backend chunk -> (the chunk for the client or None, whether it changed:
        an unchanged chunk goes out as the backend's own bytes)."""
        changed = not self.first_round
        if "usage" in obj:
            ad.usage = _usage_add(ad.usage, obj.pop("usage"))
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
        self._ev: sse.Event | None = None       # the first plain chunk, unparsed
        self._fields: dict | None = None

    def see(self, ev: sse.Event) -> None:
        if self._ev is None and self._fields is None:
            self._ev = ev

    def learn(self, obj: dict) -> None:
        if self._fields is None and self._ev is None:
            self._fields = {k: obj[k] for k in self.KEYS if k in obj}

    @property
    def fields(self) -> dict:
        if self._fields is None:
            obj = self._ev.json if self._ev is not None else None
            self._fields = {k: obj[k] for k in self.KEYS if k in obj} \
                if isinstance(obj, dict) else {}
            self._ev = None
        return self._fields


def _plain(ev: sse.Event) -> bool:
    """Whether an event is a chunk that the first round passes on as the backend
    sent it and learns only its text from: data holding a JSON object with one
    choice; no tool calls, reasoning, usage or error (what the round may change
    or act on); a null (or no) finish_reason. Checked on its data's text, at C
    speed, without parsing it; a false "no" only costs the parse."""
    d = ev.data
    return (d is not None and d[:2] == '{"' and d[-1:] == "}"
            and d.count('"choices":[{') == 1
            and d.count('"finish_reason"') == d.count('"finish_reason":null')
            and '"tool_calls"' not in d and '"reasoning' not in d
            and '"usage"' not in d and '"error"' not in d)


def _text_of(ev: sse.Event) -> str:
    """The content of a plain chunk (see _plain), as _Round.feed would have taken it."""
    obj = ev.json
    try:
        delta = obj["choices"][0].get("delta") or {}
    except (TypeError, KeyError, IndexError, AttributeError):
        return ""
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


class _ChatTurn(Turn):
    """A streamed chat turn whose `texts` may hold plain chunks (see _plain), their
    text read the first time its content is (most answers never are)."""

    @property
    def content(self) -> str:
        if any(type(t) is not str for t in self.texts):
            self.texts = [t if type(t) is str else _text_of(t) for t in self.texts]
        return "".join(self.texts)


def _meaningful(delta: dict) -> bool:
    return any(v not in (None, "", [], {}) for v in delta.values())


class Progress(progress.Progress):
    """A waiting stream's progress: a role chunk, then chunks with an empty content
    delta (`{"choices": [{"index": 0, "delta": {"content": ""}}]}`): Qwen Code,
    OpenCode, Continue and Aider accept them and their timers count them; the
    answer's text is unchanged."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.head = {"id": "chatcmpl-" + uuid.uuid4().hex[:24],
                     "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": body.get("model") or ""}
        self.opened = False

    def tick(self, text: str) -> list[sse.Event]:
        delta = {"content": ""}
        if not self.opened:
            self.opened = True
            delta = {"role": "assistant", "content": ""}
        return [self.event({**self.head, "choices": [
            {"index": 0, "delta": delta, "finish_reason": None}]})]


DIALECT = Dialect(CHAT, parse=parse, system_prompt=system_prompt, search_tool=search_tool,
                  floor_keys=FLOOR_KEYS, straight_stream=straight_stream,
                  straight_whole=straight_whole, stream_error=stream_error,
                  adapter=ChatAdapter, progress=Progress, agent_fix=agents.fix_chat)
