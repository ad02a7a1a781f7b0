"""What the Anthropic Messages and OpenAI Responses adapters share: one backend call
per round in the client's own dialect, the search engine of the request, the request
fixes (system prompt, tool token floor) in each dialect's shape, named SSE events."""
from __future__ import annotations

from typing import Iterator

import requests

from common import guard, sse
from common.sse import event
from common.streaming import forward_headers

from .. import normalize
from ..search.engine import Searcher, TOOL_NAME
from ..upstream import watched
from . import translate

__all__ = ["DialectSession", "event", "prepare", "TOOL_NAME", "parse_json_object"]


def parse_json_object(raw: bytes, what: str) -> dict:
    """The request body as a JSON object, or ApiError(400) saying why not."""
    from common.errors import ApiError
    if not raw or not raw.strip():
        raise ApiError(f"request body is empty; expected a JSON object ({what})", 400,
                       code="invalid_json")
    from common import guard
    body = guard.loads(raw)        # strict: UTF-8, depth, lone surrogates
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}", 400,
                       code="invalid_request")
    return body


def prepare(body: dict, *, settings, catalog, system_key: str, floor_keys: tuple) -> bool:
    """System prompt and tool token floor, in the dialect's own fields
    (Anthropic: top-level `system`, `max_tokens`; Responses: `instructions`,
    `max_output_tokens`). True when the body changed."""
    changed = False
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if settings.INJECT_SYSTEM and not body.get(system_key):
        text = catalog.lookup(model).get("system_prompt") or settings.SYSTEM_PROMPT
        if text:
            body[system_key] = text
            changed = True
    if body.get("tools"):
        floor = catalog.lookup(model).get("max_tokens_floor") or settings.TOOL_MAX_TOKENS_FLOOR
        changed |= normalize.apply_token_floor(body, floor, keys=floor_keys)
    return changed


class DialectSession:
    """One client request with search: the backend path, headers, and the Searcher."""
    path = ""

    def __init__(self, body: dict, *, settings, upstream, searcher: Searcher, headers,
                 chat_only: set, environ: dict | None = None):
        self.body = body
        self.environ = environ      # the client's: its hang-up cuts the backend's work
        self.chat_only = chat_only
        self.settings = settings
        self.upstream = upstream
        self.searcher = searcher
        # The client's end-to-end headers (common.http1 writes Accept-Encoding and framing).
        self.headers = {**forward_headers(headers), "Content-Type": "application/json"}

    def round_body(self, stream: bool) -> dict:        # the dialect says
        raise NotImplementedError

    def call(self, stream: bool) -> requests.Response:
        body = self.round_body(stream)
        data = guard.dumps(body)
        return translate.send(self.upstream, self.path, body, data, headers=self.headers,
                              stream=stream, chat_only=self.chat_only, environ=self.environ)

    def batches(self, resp: requests.Response) -> Iterator[list[tuple[str | None, dict]]]:
        """The backend's SSE events as (event name, JSON object), one list per read
        (the client gets what they make in one write); ends at [DONE]. A comment
        (the swapper's progress while a model loads) comes as (":", its raw bytes),
        for the dialect to pass on to its client."""
        return sse.json_batches(watched(resp, self.environ))
