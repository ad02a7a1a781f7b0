"""The client dialects as the wire knows them: one declaration each (WIRES), read by
whatever routes, counts or admits a dialect's requests.

A dialect is the shape of a model request and its answer: chat completions (most
agents), Anthropic Messages (`/v1/messages`, Claude Code) and OpenAI Responses
(`/v1/responses`, Codex). Both services read these declarations: the proxy its
routes, its error shapes, the usage its metrics count and its activity list's names
(proxy/dialects adds each dialect's behaviour: parsing, search rounds, progress);
the swapper's intake the paths a backend answers in the dialect and where a
request's conversation is (its image check). The swapper ships without the
proxy's code, so what both read lives here; a new dialect is a Wire here and its
module in proxy/dialects/.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from .errors import anthropic_error, error_body
from .failures import message_of
from .sse import emit

POST = frozenset({"POST"})


@dataclass(frozen=True)
class Wire:
    """One dialect's wire facts."""
    name: str                       # the activity list's and the route's name for it
    paths: tuple[str, ...]          # the proxy's routes: the first is the backend's,
    #                                 the others aliases of it (an SDK's base URL quirk)
    usage: Callable[[dict], tuple[int | None, int | None]]   # (prompt, completion) tokens
    # path under /v1/ (a regex) -> methods a backend answers there (swapper/intake.py)
    backend: dict[str, frozenset[str]] = field(default_factory=dict)
    # route (a `backend` key) -> the body's key holding the conversation (its images)
    conversation: dict[str, str] = field(default_factory=dict)
    # the body's keys rendered before the conversation (system text, tools), and the
    # one bounding the answer's tokens: what the swapper's conversation key reads
    # and its replay caps (swapper/conversations.py)
    head: tuple[str, ...] = ()
    answer_cap: str = "max_tokens"
    # an error body in the dialect's shape (None: it is already); None: the OpenAI envelope
    error: Callable[[bytes, int], bytes | None] | None = None
    # (message, status, code) -> the event ending a stream with an error, as the
    # swapper sends it (error_event); None: the OpenAI envelope's
    error_event: Callable[[str, int, str | None], bytes] | None = None

    @property
    def path(self) -> str:
        """The backend's path for the dialect."""
        return self.paths[0]


def count(v) -> int | None:
    """A token count, or None for anything that is not one."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def openai_usage(usage: dict) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of an OpenAI usage object (also /v1/completions')."""
    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


def cached_tokens(usage: dict) -> int | None:
    """Of a usage object's prompt tokens, those the backend's prompt cache served
    (None: it does not say): OpenAI's and vLLM's `prompt_tokens_details.cached_tokens`,
    the Responses API's `input_tokens_details.cached_tokens`, Anthropic's
    `cache_read_input_tokens`. llama.cpp's `timings.cache_n` says it too
    (proxy/record.py reads it when the usage does not)."""
    for details in ("prompt_tokens_details", "input_tokens_details"):
        d = usage.get(details)
        if isinstance(d, dict) and count(d.get("cached_tokens")) is not None:
            return count(d.get("cached_tokens"))
    return count(usage.get("cache_read_input_tokens"))


def anthropic_usage(usage: dict) -> tuple[int | None, int | None]:
    """Anthropic counts cached prompt tokens apart from input_tokens: they are prompt too."""
    prompt = count(usage.get("input_tokens"))
    if prompt is not None:
        prompt += (count(usage.get("cache_read_input_tokens")) or 0) + \
            (count(usage.get("cache_creation_input_tokens")) or 0)
    return prompt, count(usage.get("output_tokens"))


def responses_usage(usage: dict) -> tuple[int | None, int | None]:
    return count(usage.get("input_tokens")), count(usage.get("output_tokens"))


def to_anthropic_error(raw: bytes, status: int) -> bytes | None:
    """An error body (OpenAI envelope, or anything) in Anthropic's shape; None when it
    already is."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict) and obj.get("type") == "error" and isinstance(obj.get("error"), dict):
        return None
    return json.dumps(anthropic_error(message_of(raw, status), status)).encode()


def anthropic_error_event(message: str, status: int, code: str | None) -> bytes:
    return b"event: error\n" + emit(anthropic_error(message, status))


def responses_error_event(message: str, status: int, code: str | None) -> bytes:
    return b"event: error\n" + emit({"type": "error", "code": code, "message": message,
                                     "param": None})


CHAT = Wire("chat", ("/v1/chat/completions",), openai_usage,
            backend={r"chat/completions": POST},
            conversation={"chat/completions": "messages"}, head=("tools",))
# /v1/v1/messages: the anthropic SDK appends /v1/messages to its base URL, so
# base_url=<proxy>/v1 (the form the OpenAI SDK wants) must work too.
MESSAGES = Wire("messages", ("/v1/messages", "/v1/v1/messages"), anthropic_usage,
                backend={r"messages": POST, r"messages/count_tokens": POST},
                conversation={"messages": "messages", "messages/count_tokens": "messages"},
                head=("system", "tools"),
                error=to_anthropic_error, error_event=anthropic_error_event)
RESPONSES = Wire("responses", ("/v1/responses",), responses_usage,
                 backend={r"responses": POST,
                          r"responses/[^/]+": frozenset({"GET", "DELETE"}),
                          r"responses/[^/]+/cancel": POST,
                          r"responses/input_tokens": POST},
                 conversation={"responses": "input"}, head=("instructions", "tools"),
                 answer_cap="max_output_tokens", error_event=responses_error_event)

WIRES: tuple[Wire, ...] = (CHAT, MESSAGES, RESPONSES)


def wire_of(path: str) -> Wire | None:
    """The dialect whose route (or a path under it) `path` is, if any."""
    for w in WIRES:
        if path.startswith(w.paths):
            return w
    return None


def error_event(path: str, message: str, status: int, code: str | None = None,
                type_: str | None = None) -> bytes:
    """The event that ends a stream with an error, in the stream's dialect (the
    one whose route's last part `path` ends with): Anthropic
    Messages (`event: error`), OpenAI Responses (`event: error`), or else
    chat/completions' (`data: {"error": ...}`)."""
    p = path.strip("/")
    for w in WIRES:
        if w.error_event is not None and p.endswith(w.path.rsplit("/", 1)[1]):
            return w.error_event(message, status, code)
    return emit(error_body(message, status, type_, code))
