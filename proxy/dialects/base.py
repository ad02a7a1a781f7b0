"""What the dialects share: the declared Dialect each module of this package makes
of itself, and what their search adapters share: the round's backend call in the
client's own dialect (watching the client), the request's Searcher, and the
defaults of the protocol that proxy/search/rounds.py drives:

    round_body(stream) -> dict          the next round's request
    turn_of(resp) -> Turn | Response    a whole answer (a Response: needs nothing of ours)
    relay(resp) -> yields lists of events, returns Turn | None (None: it ended the stream)
    searching(calls) -> events          stream: our searches are starting
    searched(turn, searches) -> events  the round recorded for the next (stream: its events)
    answer(turn) -> Response            the final whole answer
    end(turn) -> events                 the final events of a stream
    fail(message, status, code) -> events  an error event ending a stream

A stream is events from end to end (common/sse.py frames them: its reader where
the backend's bytes come in, its writer where the client's go out): what a relay
passes on is the backend's own Event (its bytes go out as they came), what an
adapter makes is an Event made of an object (`event`), in lists that are one
write each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import requests

from common import guard, sse
from common.errors import ApiError
from common.failures import message_of
from common.dialects import Wire
from common.streaming import forward_headers

from ..search.engine import Searcher, TOOL_NAME
from ..search.rounds import backend_error
from ..upstream import kept_alive, watched

__all__ = ["Adapter", "Dialect", "event", "TOOL_NAME", "parse_json_object", "put_system",
           "server_search"]


def event(name: str, obj: dict) -> list[sse.Event]:
    """One named event an adapter makes (`event:` + `data:`, as Anthropic and
    Responses streams use), in a list: an adapter's events add up with `+`."""
    return [sse.Event.of(obj, name)]


def no_flattening(body: dict) -> dict:
    return {}


def no_agent_fix(body: dict, late_system: str) -> bool:
    return False


@dataclass(frozen=True)
class Dialect:
    """One client dialect, declared whole: what the wire knows of it (its routes,
    error shape and usage reader, read by the swapper too: common/dialects.Wire)
    and what the proxy does with it. Each module of this package declares its
    DIALECT and the package finds them; the routes, the error shapes, the metrics
    and the activity list read these objects, never a dialect by name, so a new
    dialect is its module here and its Wire."""
    wire: Wire
    parse: Callable[[bytes], dict]          # the body, validated, or ApiError(400)
    system_prompt: Callable                 # (body, text) -> bool: the operator's, text() lazily
    search_tool: Callable                   # (body, settings) -> (tool settings | None, changed)
    floor_keys: tuple[str, ...]             # the limits the tool token floor raises
    straight_stream: Callable               # (chunks, body, names): the backend's stream
    straight_whole: Callable                # (content, names): its whole answer (no search)
    stream_error: Callable                  # (message, status, code): the error events ending it
    adapter: type                           # the search rounds' (Adapter): its relay a table
    progress: type                          # a waiting stream's events (progress.Progress)
    # tools the backend cannot see as they came, made plain in place:
    # {backend name: (namespace, name)} of those it changed
    flatten: Callable[[dict], dict] = no_flattening
    # what coding agents send made acceptable to the model's template, in place
    # (proxy/agents.py, whose fix() runs it): (body, late_system mode) -> changed
    agent_fix: Callable[[dict, str], bool] = no_agent_fix

    @property
    def name(self) -> str:
        """The activity list's and the route's name for it."""
        return self.wire.name

    @property
    def paths(self) -> tuple[str, ...]:
        return self.wire.paths


def put_system(body: dict, key: str, text) -> bool:
    """The operator's system prompt (`text()`, asked only when needed) in the
    dialect's own field (`system`, `instructions`), unless the client sent one."""
    if body.get(key):
        return False
    text = text()
    if text:
        body[key] = text
    return bool(text)


def server_search(body: dict, settings, tool: dict | None) -> tuple[dict | None, bool]:
    """The client's server search `tool` when the proxy runs search, and whether
    the body changed: with search off the backend cannot run it, so it goes."""
    if tool is None:
        return None, False
    if settings.WEB_SEARCH and settings.MAX_SEARCH_ITER > 0:
        return tool, False
    body["tools"] = [x for x in body["tools"] if x is not tool]
    if not body["tools"]:
        body.pop("tools")
        body.pop("tool_choice", None)
    return None, True


def parse_json_object(raw: bytes, what: str) -> dict:
    """The request body as a JSON object, or ApiError(400) saying why not."""
    if not raw or not raw.strip():
        raise ApiError(f"request body is empty; expected a JSON object ({what})", 400,
                       code="invalid_json")
    body = guard.loads(raw)        # strict: UTF-8, depth, lone surrogates
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}", 400,
                       code="invalid_request")
    return body


class Adapter:
    """One client request with search, in one dialect."""
    path = ""                   # the backend path
    call_prefix = ""            # of the ids the client sees for our calls ("": none)
    record = None               # the request's record (proxy/record.py)

    def __init__(self, body: dict, tool: dict, parts: dict, request):
        self.body = body
        self.settings = parts["settings"]
        self.upstream = parts["upstream"]
        self.environ = request.environ     # the client's: its hang-up cuts the backend's work
        # The client's end-to-end headers (common.http1 writes Accept-Encoding and framing).
        self.headers = {**forward_headers(request.headers), "Content-Type": "application/json"}
        filters = tool.get("filters") if isinstance(tool.get("filters"), dict) else {}
        self.searcher = Searcher(
            settings=self.settings, searx=parts["searx"], metrics=parts["metrics"],
            executor=parts["executor"], max_uses=tool.get("max_uses"),
            allowed=tool.get("allowed_domains") or filters.get("allowed_domains"),
            blocked=tool.get("blocked_domains") or filters.get("blocked_domains"))

    def call(self, stream: bool) -> requests.Response:
        r = self.upstream.request("POST", self.path, headers=self.headers,
                                  data=guard.dumps(self.round_body(stream)), stream=stream,
                                  environ=self.environ, read_body=not stream)
        if self.record is not None:
            self.record.note_header(r.headers)
        return r

    def body_of(self, resp: requests.Response):
        """A streamed answer's body, its first event awaited watching the client,
        with keep-alive comments while the backend prefills."""
        return kept_alive(watched(resp, self.environ, self.record),
                          self.settings.KEEPALIVE_INTERVAL, resp.close)

    @property
    def keepalive(self) -> list[sse.Event]:
        """What keeps the client's wait alive: a comment (a dialect whose clients'
        timers count only data has its own)."""
        return sse.keepalive()

    def fail_answer(self, raw: bytes, status: int) -> list[sse.Event]:
        """A round's call answered an error: it ends the stream (one an agent can
        act on as backend_error makes it)."""
        status, raw = backend_error(status, raw)
        return self.fail(message_of(raw, status), status,
                         "upstream_error" if status != 400 else "invalid_request_error")

    def searching(self, calls) -> list[sse.Event]:
        return self.keepalive

    # ------------------------------------------------------------ a streamed round

    # The relay of a streamed round as a table: event type -> handler(self, rnd, obj,
    # type) -> the client's events for it; a type not in it goes to `other`.
    ON: dict = {}

    def other(self, rnd, obj: dict, kind) -> list[sse.Event]:
        """An event of a type the dialect has no handler for: dropped."""
        return []

    def resumed(self) -> list[sse.Event]:
        """What goes before the round's next event, after our own progress (none)."""
        return []

    def events(self, resp, rnd):
        """The backend stream's events, each through its handler in ON (by its type);
        the client's events of each read in one list (one write), until a handler
        ends the round (rnd.over) or [DONE] comes. A comment keeps the client's wait
        alive: in a later round (the stream has begun) with the dialect's
        keep-alive, which its timer counts. Blank lines and data that is not a JSON
        object are dropped."""
        for evs in sse.events_of(self.body_of(resp)):
            sent: list[sse.Event] = []          # what this read makes: one write
            for ev in evs:
                if ev.data is None:
                    if not ev.blank:
                        sent.append(ev.bare())
                        if self.searcher.rounds:
                            sent += self.keepalive
                    continue
                if ev.is_done:
                    if sent:
                        yield sent
                    return
                obj = ev.json
                if not isinstance(obj, dict):
                    continue
                kind = obj.get("type") or ev.name or ""
                handler = self.ON.get(kind, type(self).other) if isinstance(kind, str) \
                    else type(self).other
                sent += self.resumed() + handler(self, rnd, obj, kind)
                if rnd.over:
                    break
            if sent:
                yield sent
            if rnd.over:
                return
