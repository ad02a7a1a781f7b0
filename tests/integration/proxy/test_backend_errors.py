"""Errors an agent can act on (issue 21): llama-server answers a chat-template
exception with 500 `server_error` and a prompt longer than its context with 400
`exceed_context_size_error`; Claude Code and Codex retry a 500 for minutes. Through
the proxy both are a 400 in the dialect's own shape -- OpenAI's envelope for chat
completions and Responses, Anthropic's `{"type": "error", "error": {"type":
"invalid_request_error", ...}}` for Messages -- naming the template's words, or both
numbers of an overflow in the form Claude Code parses ("prompt is too long: N
tokens > C maximum"). In every dialect, streamed or not, web search on or off; a
streamed request's error, answered before its stream, is that 400, not a stream.

The backend is scripted to answer byte for byte what llama-server answers
(tests/support/dialects.LlamaError)."""
from __future__ import annotations

import re

import pytest
import requests

from tests.support.dialects import LlamaError, SEARCH_TOOL, ScriptedDialects
from tests.support.proxyproc import searching
from tests.support.sseclient import named_events

USER = [{"role": "user", "content": "hello"}]
BODIES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": USER}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER,
                                  "thinking": {"type": "adaptive"}}),
    "responses": ("/v1/responses", {"model": "m", "input": "hello"}),
}
PROGRESS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "response.created", "response.in_progress")
CLAUDE_RE = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)


@pytest.fixture(scope="module")
def model():
    with ScriptedDialects() as m:
        yield m


@pytest.fixture(scope="module", params=["search", "no-search"])
def proxy(request, model):
    with searching(model.url, request.param == "search") as p:
        yield p


def ask(proxy, dialect: str, stream: bool, error: LlamaError):
    url, search = proxy
    path, body = BODIES[dialect]
    body = {**body, "stream": stream}
    if search and dialect in SEARCH_TOOL:
        body["tools"] = [SEARCH_TOOL[dialect]]
    return requests.post(url + path, json=body, stream=stream, timeout=10)


def error_of(dialect: str, r) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), \
        "an error answered before the stream is no stream"
    body = r.json()
    if dialect == "messages":
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", list(BODIES))
def test_context_overflow_is_a_400_naming_both_numbers(proxy, model, dialect, stream):
    model.script(LlamaError.context(19234, 8192))
    err = error_of(dialect, ask(proxy, dialect, stream, None))
    m = CLAUDE_RE.search(err["message"])
    assert m and m.groups() == ("19234", "8192"), err["message"]
    if dialect != "messages":
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", list(BODIES))
def test_template_exception_is_a_400_with_its_message(proxy, model, dialect, stream):
    model.script(LlamaError.template())
    err = error_of(dialect, ask(proxy, dialect, stream, None))
    assert err["message"].endswith("System message must be at the beginning."), err
    if dialect != "messages":
        assert err["code"] == "chat_template_error"


@pytest.mark.parametrize("dialect", list(BODIES))
def test_other_backend_errors_keep_their_status(proxy, model, dialect):
    model.script(LlamaError(503, {"error": {"code": 503, "message": "Loading model",
                                            "type": "unavailable_error"}}))
    r = ask(proxy, dialect, False, None)
    assert r.status_code == 503 and "Loading model" in r.text


@pytest.mark.parametrize("dialect", list(BODIES))
def test_an_error_after_the_stream_began_is_the_dialects_error_event(proxy, model, dialect):
    """The backend's head took longer than a keep-alive interval: the stream had to
    start (status 200), so the error comes as the dialect's error event, with the
    same message an agent can act on."""
    model.script(LlamaError.context(19234, 8192))
    model.head_delay = 1.2
    try:
        r = ask(proxy, dialect, True, None)
        assert r.status_code == 200
        evs = named_events(r)
    finally:
        model.head_delay = 0.0
    # the wait's progress first (proxy/progress.py), then the error
    waited = [e for e in evs if e[0] in PROGRESS or "choices" in e[1]]
    assert waited and evs[:len(waited)] == waited, evs
    evs = evs[len(waited):]
    assert len(evs) == 1, evs
    name, obj = evs[0]
    if dialect == "messages":
        assert name == "error" and obj["error"]["type"] == "invalid_request_error"
        message = obj["error"]["message"]
    elif dialect == "responses":
        assert name == "response.failed"
        message = obj["response"]["error"]["message"]
    else:
        message = obj["error"]["message"]
    assert CLAUDE_RE.search(message), message
