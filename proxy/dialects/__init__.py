"""Client dialects other than chat completions, over the one search engine:
Anthropic Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`).

`handle(dialect, ext, request)` serves one request: the request fixes in the dialect's
shape, then either the search loop (when the client's own search tool is present and
search is on) or the body straight to the backend, which speaks the dialect itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import Response

from common import guard
from common.streaming import forward_headers, relay, sse_response

from ..metrics import MODEL
from ..search.engine import Searcher
from ..upstream import streamed
from . import anthropic, responses, translate
from .base import parse_json_object, prepare

MESSAGES_PATHS = ("/v1/messages", "/v1/v1/messages")


@dataclass(frozen=True)
class _Dialect:
    module: Any                 # validate, search_tool, strip_search_tool, run_*, stream_*
    session: type               # its DialectSession
    path: str                   # the backend path
    system_key: str             # where the system prompt goes
    floor_keys: tuple           # which limits the tool token floor raises
    what: str                   # for "body is empty" errors


MESSAGES = _Dialect(anthropic, anthropic.MessagesSession, "/v1/messages", "system",
                    ("max_tokens",), "an Anthropic Messages request with 'messages'")
RESPONSES = _Dialect(responses, responses.ResponsesSession, "/v1/responses", "instructions",
                     ("max_output_tokens",), "a Responses request with 'input'")


def handle(d: _Dialect, ext: dict, request) -> Response:
    settings = ext["settings"]
    raw = request.get_data()
    body = parse_json_object(raw, d.what)
    d.module.validate(body)
    request.environ[MODEL] = body.get("model")       # for the metrics: no second parse
    changed = prepare(body, settings=settings, catalog=ext["catalog"],
                      system_key=d.system_key, floor_keys=d.floor_keys)
    stream = bool(body.get("stream"))
    tool = d.module.search_tool(body)
    chat_only = ext.setdefault("chat_only", set())   # (path, model) whose backend lacks it
    if tool is not None and settings.WEB_SEARCH and settings.MAX_SEARCH_ITER > 0:
        filters = tool.get("filters") if isinstance(tool.get("filters"), dict) else {}
        searcher = Searcher(settings=settings, searx=ext["searx"], metrics=ext["metrics"],
                            executor=ext["executor"], max_uses=tool.get("max_uses"),
                            allowed=tool.get("allowed_domains") or filters.get("allowed_domains"),
                            blocked=tool.get("blocked_domains") or filters.get("blocked_domains"))
        s = d.session(body, settings=settings, upstream=ext["upstream"], searcher=searcher,
                      headers=request.headers, chat_only=chat_only, environ=request.environ)
        if not stream:
            return d.module.run_nonstream(s)
        first = s.call(stream=True)
        if first.status_code != 200:
            searcher.done()
            content = first.content
            first.close()
            return Response(content, status=first.status_code,
                            headers=forward_headers(first.headers))
        return sse_response(d.module.run_stream(s, first))
    if tool is not None:
        d.module.strip_search_tool(body)
    # nothing to change: the client's bytes, as they came
    data = guard.dumps(body) if changed or tool else raw
    r = translate.send(ext["upstream"], d.path, body, data,
                       headers=forward_headers(request.headers), stream=stream,
                       chat_only=chat_only, environ=request.environ)
    if stream and r.status_code == 200:
        chunks = streamed(r, request.environ)
        if d is MESSAGES:
            chunks = anthropic.with_message_start(chunks, body.get("model"))
        return relay(r, body=chunks)
    content = r.content
    r.close()
    return Response(content, status=r.status_code, headers=forward_headers(r.headers))


def anthropic_errors(resp: Response, path: str) -> Response:
    """Errors on /v1/messages in Anthropic's shape, whoever raised them."""
    if resp.status_code < 400 or resp.is_streamed or not path.startswith(MESSAGES_PATHS):
        return resp
    body = anthropic.to_anthropic_error(resp.get_data(), resp.status_code)
    if body is not None:
        resp.set_data(body)
        resp.mimetype = "application/json"
    return resp
