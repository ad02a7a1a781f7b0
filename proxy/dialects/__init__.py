"""The client dialects: chat completions, Anthropic Messages (`/v1/messages`) and
OpenAI Responses (`/v1/responses`), each a module of the same shape:

    parse(raw) -> body                    validated, or ApiError(400)
    system_prompt(body, text) -> bool     the operator's system prompt (text(): lazily)
    search_tool(body, settings) -> (tool settings | None, body changed)
    FLOOR_KEYS                            the limits the tool token floor raises
    straight_stream / straight_whole      the backend's answer when we run no search
    *Adapter                              the search rounds' adapter (base.Adapter)

`handle(dialect, request)` serves one request: the agent fixes (proxy/agents.py),
our own changes after them, then the search rounds (proxy/search/rounds.py) or the
body straight to the backend, which speaks the dialect itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from flask import Response

from common import guard
from common.streaming import forward_headers, relay

from .. import normalize
from ..metrics import MODEL
from ..search import rounds
from ..upstream import streamed
from . import anthropic, chat, responses

try:
    from .. import agents
except ModuleNotFoundError as e:        # not written yet: no agent fixes
    if e.name != "proxy.agents":
        raise
    agents = None

MESSAGES_PATHS = ("/v1/messages", "/v1/v1/messages")


@dataclass(frozen=True)
class Dialect:
    name: str                   # agents.fix's name for it
    module: ModuleType
    adapter: type


CHAT = Dialect("chat", chat, chat.ChatAdapter)
MESSAGES = Dialect("messages", anthropic, anthropic.MessagesAdapter)
RESPONSES = Dialect("responses", responses, responses.ResponsesAdapter)


def handle(d: Dialect, parts: dict, request) -> Response:
    settings, catalog, m = parts["settings"], parts["catalog"], d.module
    raw = request.get_data()
    body = m.parse(raw)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    request.environ[MODEL] = model                   # for the metrics: no second parse
    info = _Lazy(lambda: catalog.lookup(model))
    changed = bool(agents and agents.fix(d.name, body, info()))
    # Our own changes come after the agent's, the same every turn (a stable prefix).
    if settings.INJECT_SYSTEM:
        changed |= m.system_prompt(
            body, lambda: info().get("system_prompt") or settings.SYSTEM_PROMPT)
    tool, stripped = m.search_tool(body, settings)   # before the floor: a tool too
    changed |= stripped
    if body.get("tools") and any(isinstance(body.get(k), int) for k in m.FLOOR_KEYS):
        floor = info().get("max_tokens_floor") or settings.TOOL_MAX_TOKENS_FLOOR
        changed |= normalize.apply_token_floor(body, floor, keys=m.FLOOR_KEYS)
    stream = bool(body.get("stream"))
    if tool is not None:
        return rounds.serve(d.adapter(body, tool, parts, request), stream)

    # nothing to change: the client's bytes, as they came
    r = parts["upstream"].request(
        "POST", m.PATH, headers=forward_headers(request.headers),
        data=guard.dumps(body) if changed else raw, stream=True, environ=request.environ,
        read_body=not stream)
    if stream and r.status_code == 200:
        return relay(r, body=m.straight_stream(streamed(r, request.environ), body))
    content = m.straight_whole(r.content)
    r.close()
    return Response(content, status=r.status_code, headers=forward_headers(r.headers))


class _Lazy:
    """The model's registry entry, looked up once, when first needed."""

    def __init__(self, fetch):
        self.fetch, self.value = fetch, None

    def __call__(self) -> dict:
        if self.value is None:
            self.value = self.fetch()
        return self.value


def anthropic_errors(resp: Response, path: str) -> Response:
    """Errors on /v1/messages in Anthropic's shape, whoever raised them."""
    if resp.status_code < 400 or resp.is_streamed or not path.startswith(MESSAGES_PATHS):
        return resp
    body = anthropic.to_anthropic_error(resp.get_data(), resp.status_code)
    if body is not None:
        resp.set_data(body)
        resp.mimetype = "application/json"
    return resp
