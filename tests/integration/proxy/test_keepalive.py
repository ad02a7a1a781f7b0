"""A streamed request is never silent for long (issue 21): while the backend
prefills a long prompt -- llama-server sends a stream's head only with its first
token; a backend behind the swapper may send the head and then nothing -- the
client's stream carries a keep-alive comment every KEEPALIVE_INTERVAL, so an
agent does not give up and send the request again (Claude Code drops a stream
silent for 300 s). In all three dialects, web search on and off, through the real
server (`python -m proxy`: gunicorn + gevent).

Comments, not Anthropic `ping` events, before the first event: the anthropic
SDKs skip both, but a ping before message_start is an event out of order to
anything that accumulates a message; an SSE comment is ignored by every client."""
from __future__ import annotations

import time

import pytest
import requests

from tests.support.chat import Reply
from tests.support.dialects import SEARCH_TOOL, ScriptedDialects
from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng

DELAY = 3.0
INTERVAL = 0.5
USER = [{"role": "user", "content": "hello"}]
BODIES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": USER, "stream": True}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER,
                                  "stream": True}),
    "responses": ("/v1/responses", {"model": "m", "input": "hello", "stream": True}),
}


@pytest.fixture(scope="module")
def model():
    with ScriptedDialects() as m:
        yield m


@pytest.fixture(scope="module", params=["search", "no-search"])
def stack(request, model):
    search = request.param == "search"
    with FakeSearxng() as searx, ProxyProcess(
            BACKEND_URL=model.url, SEARXNG_URL=searx.url, MODELS_TTL=0,
            KEEPALIVE_INTERVAL=INTERVAL, WEB_SEARCH=int(search)) as proxy:
        yield proxy.url, search


def first_event(url: str, path: str, body: dict) -> tuple[float, int, bytes]:
    """(seconds until the head, comments before the first event, the stream)."""
    t0 = time.monotonic()
    r = requests.post(url + path, json=body, stream=True, timeout=30)
    head = time.monotonic() - t0
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    raw = b"".join(r.iter_content(chunk_size=None))
    before = raw[:raw.index(b"data:")] if b"data:" in raw else raw
    return head, before.count(b"\n: "), raw


@pytest.mark.parametrize("where", ["no-head", "head-only"])
@pytest.mark.parametrize("dialect", list(BODIES))
def test_keepalives_while_the_backend_prefills(stack, model, dialect, where):
    """no-head: the backend answers nothing for 3 s (llama-server prefilling);
    head-only: its stream's head at once, its first event after 3 s."""
    url, search = stack
    path, body = BODIES[dialect]
    if search and dialect in SEARCH_TOOL:
        body = {**body, "tools": [SEARCH_TOOL[dialect]]}
    model.script(Reply(content="hello there"))
    setattr(model, "head_delay" if where == "no-head" else "event_delay", DELAY)
    try:
        head, comments, raw = first_event(url, path, body)
    finally:
        model.head_delay = model.event_delay = 0.0
    assert comments >= 3, raw[:300]
    assert head < DELAY - 1, "the stream's head went out before the backend's first event"
    # the answer followed, whole (the scripted text comes in 4-character pieces)
    assert b'"hell"' in raw
    assert {"chat": b"[DONE]", "messages": b"message_stop",
            "responses": b"response.completed"}[dialect] in raw


def test_a_prompt_answered_at_once_has_no_keepalive(stack, model):
    url, _ = stack
    model.script(Reply(content="quick"))
    _, comments, raw = first_event(url, *BODIES["chat"])
    assert comments == 0 and raw.startswith(b"data:")
