"""The client dialects: chat completions, Anthropic Messages (`/v1/messages`) and
OpenAI Responses (`/v1/responses`), each a module of this package that declares
its DIALECT (base.Dialect: its wire facts, common/dialects.Wire, with its parser,
its changes, its straight relays, its search adapter and its progress events).
ALL is every declared one, found here, in the order of common/dialects.WIRES; the
routes, the error shapes, the metrics and the activity list read them.

`handle(dialect, request)` serves one request: the agent fixes (proxy/agents.py;
Codex's namespace tools made plain: the dialect's flatten), our own changes after
them, then the search rounds (proxy/search/rounds.py) or the body straight to the
backend, which speaks the dialect itself.

Either way, a backend's error an agent can act on (a chat-template exception, a
prompt over the context: agents.backend_error) is a 400 in the dialect's shape, and
a stream whose backend has not sent its head within KEEPALIVE_INTERVAL starts at
once and carries SSE comments until the first event (an error after that is the
dialect's error event, its message the same). Every streamed answer passes
progress.kept_in_progress: the comments before its first event come with the
dialect's progress events, which agents' idle timers count; the dialect's
Progress.strip takes ours out of a conversation an agent sends back.
"""
from __future__ import annotations

import importlib
import json
import pkgutil

from flask import Response

from common import guard
from common.dialects import WIRES, wire_of
from common.failures import message_of
from common.streaming import forward_headers, relay, sse_response

from .. import agents
from .. import normalize, progress
from ..search import rounds
from ..keys.auth import check_model
from ..search.engine import TOOL_NAME

from ..search.rounds import as_is, backend_error
from ..upstream import Background, kept_alive, streamed
from .base import Dialect


def _declared() -> tuple[Dialect, ...]:
    """Every DIALECT the modules of this package declare, in WIRES' order (a Wire
    without its module is an error here, at import)."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        d = getattr(importlib.import_module(f"{__name__}.{info.name}"), "DIALECT", None)
        if isinstance(d, Dialect):
            found[d.name] = d
    return tuple(found[w.name] for w in WIRES)


ALL = _declared()
BY_NAME = {d.name: d for d in ALL}


def handle(d: Dialect, parts: dict, request, record) -> Response:
    """Serve one request of dialect `d`; `record`: its record (proxy/record.py)."""
    settings, catalog = parts["settings"], parts["catalog"]
    raw = request.get_data()
    body = d.parse(raw)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    record.model = model                    # for the metrics: no second parse
    check_model(request.environ, model, catalog)     # the key's scope (403)
    info = _Lazy(lambda: catalog.lookup(model))
    changed = d.progress.strip(body)        # our wait's progress: never the model's
    changed |= agents.fix(d, body, info())
    # tools the backend cannot see as they came (Codex's namespaces): plain ones
    names = d.flatten(body)
    changed |= bool(names)
    # Our own changes come after the agent's, the same every turn (a stable prefix).
    if settings.INJECT_SYSTEM:
        changed |= d.system_prompt(
            body, lambda: info().get("system_prompt") or settings.SYSTEM_PROMPT)
    own = bool(body.get("tools"))       # the client's tools, before ours
    tool, stripped = d.search_tool(body, settings) if own or \
        not _small(body, d, settings, info) else (None, False)
    changed |= stripped
    changed |= _budget(d, body, own and bool(body.get("tools")), settings, info)
    stream = bool(body.get("stream"))
    if tool is not None:
        ad = d.adapter(body, tool, parts, request)
        ad.names = names
        ad.record = ad.searcher.record = record
        return _in_progress(d, body, rounds.serve(ad, stream), settings, request.environ)

    # nothing to change: the client's bytes, as they came
    headers, environ = forward_headers(request.headers), request.environ
    data = guard.dumps(body) if changed else raw

    def call():         # may run beside the request: no `request` in here
        r = parts["upstream"].request("POST", d.wire.path, headers=headers, data=data,
                                      stream=True, environ=environ, read_body=not stream)
        record.note_header(r.headers)
        return r
    if not stream:
        r = call()
        if r.status_code >= 400:
            return as_is(r)
        content = d.straight_whole(r.content, names)
        r.close()
        return Response(content, status=r.status_code, headers=forward_headers(r.headers))
    interval = settings.KEEPALIVE_INTERVAL

    def relayed(r):     # the backend's stream, kept alive while it prefills
        return d.straight_stream(kept_alive(streamed(r, environ, record), interval, r.close),
                                 body, names)
    task = Background(call)
    if not task.wait(interval):
        # No head from the backend yet (llama-server sends it with the first
        # token, after the prefill): the stream starts now, kept alive (the
        # round loop's late start: its comments, its errors as the dialect's event).
        return _in_progress(d, body, sse_response(rounds.late(
            task, interval, lambda m, s, c: d.stream_error(m, s, c or "upstream_error"),
            lambda raw, status: stream_failure(d, raw, status), relayed)), settings, environ)
    r = task.result()
    if r.status_code != 200:
        return as_is(r)
    return _in_progress(d, body, relay(r, body=relayed(r)), settings, environ)


def _in_progress(d: Dialect, body: dict, resp: Response, settings, environ) -> Response:
    """A stream that waits carries the dialect's progress, which the client's idle
    timer counts, until its first event (proxy/progress.py): the one place every
    streamed answer passes, whatever made it."""
    if settings.WAIT_PROGRESS and resp.status_code == 200 and resp.is_streamed and \
            resp.mimetype == "text/event-stream" and d.progress.wanted(body, environ):
        resp.response = progress.kept_in_progress(d.progress, body, resp.response, environ)
    return resp


def _budget(d: Dialect, body: dict, own_tools: bool, settings, info) -> bool:
    """The client's own budget, as it asked (before our tool is added: the stack's
    own tool never raises it): the floor when the client's own tools are present
    (a tool call cut mid-argument is a 500 it cannot act on), and a limit above the
    model's context clamped to it where the backend would refuse it (vLLM refuses
    `max_tokens` > max_model_len and clamps a smaller one to what the prompt leaves
    itself). True when the body changed."""
    keys = d.floor_keys
    if not any(isinstance(body.get(k), int) for k in keys):
        return False
    changed = False
    if own_tools:
        floor = info().get("max_tokens_floor") or settings.TOOL_MAX_TOKENS_FLOOR
        changed = normalize.apply_token_floor(body, floor, keys=keys)
    return normalize.clamp_to_context(body, refused_above(info()), keys) or changed


def refused_above(entry: dict) -> int | None:
    """The largest output limit the model's backend accepts, when it refuses larger
    ones (vLLM: `max_tokens` above its max_model_len is a 400): the registry's
    `context_length` of a vLLM model (the swapper's /v1/models), or vLLM's own
    `max_model_len` (a vLLM server as the upstream); None for llama-server, which
    stops at the context's end instead."""
    ctx = entry.get("max_model_len") if entry.get("kind") != "vllm" else \
        entry.get("context_length")
    return ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None


def _small(body: dict, d: Dialect, settings, info) -> bool:
    """A request without tools of its own whose budget is below the floor (a title,
    a probe): it gets no tool of ours, which could only cut its answer or cost the
    time of a search it did not ask for. One that names web_search in `tool_choice`
    asks for it: it gets it (with its budget as it is)."""
    limits = [body[k] for k in d.floor_keys if isinstance(body.get(k), int)]
    if not limits or _names_search(body.get("tool_choice")):
        return False
    floor = info().get("max_tokens_floor") or settings.TOOL_MAX_TOKENS_FLOOR
    return bool(floor) and min(limits) < floor


def _names_search(tc) -> bool:
    if not isinstance(tc, dict):
        return False
    fn = tc.get("function")
    return (fn.get("name") if isinstance(fn, dict) else tc.get("name")) == TOOL_NAME


def stream_failure(d: Dialect, raw: bytes, status: int) -> list:
    """A backend's error answer to a stream that has begun, as the dialect's error
    events (one an agent can act on as backend_error makes it)."""
    status, raw = backend_error(status, raw)
    return d.stream_error(message_of(raw, status), status, error_code(raw))


def error_code(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        return str(err.get("code") or err.get("type") or "upstream_error")
    except (ValueError, AttributeError, TypeError):
        return "upstream_error"


class _Lazy:
    """The model's registry entry, looked up once, when first needed."""

    def __init__(self, fetch):
        self.fetch, self.value = fetch, None

    def __call__(self) -> dict:
        if self.value is None:
            self.value = self.fetch()
        return self.value


def shaped(resp: Response, path: str) -> Response:
    """An error on a dialect's route in the dialect's shape (Anthropic's on
    /v1/messages), whoever raised it."""
    if resp.status_code < 400 or resp.is_streamed:
        return resp
    w = wire_of(path)
    body = w.error(resp.get_data(), resp.status_code) if w and w.error else None
    if body is not None:
        resp.set_data(body)
        resp.mimetype = "application/json"
    return resp
