"""A streamed request is never silent for long (issue 21), and what it carries while
it waits counts for the client's idle timer (issue 29): while the backend prefills a
long prompt -- llama-server sends a stream's head only with its first token; a
backend behind the swapper may send the head and then nothing -- the client's stream
carries, every KEEPALIVE_INTERVAL, a comment and the dialect's progress
(proxy/progress.py): chat, a role chunk then empty content deltas; Messages,
message_start then a thinking block; Responses, response.created then
response.in_progress. The backend's answer then follows in the same stream, read
whole by the dialect's own SDK. In all three dialects, web search on and off, through
the real server (`python -m proxy`: gunicorn + gevent)."""
from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest
import requests

from common import sse
from proxy import progress

from tests.support.chat import Reply
from tests.support.dialects import SEARCH_TOOL, ScriptedDialects
from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng

DELAY = 3.0
INTERVAL = 0.5
USER = [{"role": "user", "content": "hello"}]
BODIES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": USER, "stream": True}),
    # as Claude Code asks (a client that takes thinking blocks: proxy/progress.wanted)
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER,
                                  "stream": True, "thinking": {"type": "adaptive"}}),
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
    """(seconds until the head, comments before the backend's first event, the stream)."""
    t0 = time.monotonic()
    r = requests.post(url + path, json=body, stream=True, timeout=30)
    head = time.monotonic() - t0
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    raw = b"".join(r.iter_content(chunk_size=None))
    first = raw.find(b"hell")
    before = raw[:first] if first >= 0 else raw
    return head, before.count(b"\n: ") + before.startswith(b": "), raw


def events(raw: bytes) -> list[dict]:
    return [json.loads(ev.data) for ev in sse.events(raw.replace(b"\r\n", b"\n"))
            if ev.data is not None and not ev.is_done]


def progress_of(dialect: str, raw: bytes) -> int:
    """The progress events before the answer's first text, checked for their shape;
    how many there are."""
    evs = events(raw[:raw.find(b"hell")])
    if dialect == "chat":
        assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        ticks = [e for e in evs if e.get("choices") and
                 e["choices"][0]["delta"] in ({"content": ""},
                                              {"role": "assistant", "content": ""})]
    elif dialect == "messages":
        assert [e["type"] for e in evs[:2]] == ["message_start", "content_block_start"]
        assert evs[1]["content_block"]["type"] == "thinking" and evs[1]["index"] == 0
        ticks = [e for e in evs if e["type"] == "content_block_delta"
                 and e["delta"]["type"] == "thinking_delta"]
    else:
        assert evs[0]["type"] == "response.created"
        ticks = [e for e in evs if e["type"] == "response.in_progress"]
    return len(ticks)


def read_whole(url: str, dialect: str, search: bool):
    """The stream read by the dialect's SDK, as an agent reads it."""
    if dialect == "chat":
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="m", messages=USER, stream=True) if ch.choices)
    if dialect == "messages":
        c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        kw = {"tools": [SEARCH_TOOL["messages"]]} if search else {}
        with c.messages.stream(model="m", max_tokens=64, messages=USER,
                               extra_body={"thinking": {"type": "adaptive"}}, **kw) as s:
            msg = s.get_final_message()
        return msg
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with c.responses.stream(model="m", input="hello") as s:
        return s.get_final_response().output_text


@pytest.mark.parametrize("where", ["no-head", "head-only"])
@pytest.mark.parametrize("dialect", list(BODIES))
def test_progress_while_the_backend_prefills(stack, model, dialect, where):
    """no-head: the backend answers nothing for 3 s (llama-server prefilling);
    head-only: its stream's head at once, its first event after 3 s."""
    url, search = stack
    path, body = BODIES[dialect]
    if search and dialect in SEARCH_TOOL:
        body = {**body, "tools": [SEARCH_TOOL[dialect]]}
    model.script(*[Reply(content="hello there")] * 2)
    setattr(model, "head_delay" if where == "no-head" else "event_delay", DELAY)
    try:
        head, comments, raw = first_event(url, path, body)
        whole = read_whole(url, dialect, search) if where == "head-only" else None
    finally:
        model.head_delay = model.event_delay = 0.0
    assert comments >= 3, raw[:300]
    assert progress_of(dialect, raw) >= 3, raw[:600]
    assert head < DELAY - 1, "the stream's head went out before the backend's first event"
    # the answer followed, whole (the scripted text comes in 4-character pieces)
    assert b'"hell"' in raw
    assert {"chat": b"[DONE]", "messages": b"message_stop",
            "responses": b"response.completed"}[dialect] in raw
    evs = events(raw)
    if dialect == "messages":
        assert [e["type"] for e in evs].count("message_start") == 1
        assert {e["index"] for e in evs if e["type"] == "content_block_start"} == {0, 1}
    elif dialect == "responses":
        assert [e["type"] for e in evs].count("response.created") == 1
    if whole is None:
        return
    if dialect == "messages":
        assert [b.type for b in whole.content] == ["thinking", "text"]
        assert whole.content[0].signature == progress.MARKER
        assert whole.content[1].text == "hello there"
        assert whole.usage.input_tokens == 10, "the backend's usage, from its message_start"
    else:
        assert whole == "hello there"


def test_a_prompt_answered_at_once_has_no_keepalive(stack, model):
    url, _ = stack
    model.script(Reply(content="quick"))
    _, comments, raw = first_event(url, *BODIES["chat"])
    assert comments == 0 and raw.startswith(b"data:")


@pytest.mark.parametrize("dialect", list(BODIES))
def test_the_time_to_first_token_is_the_models_not_the_progress(stack, model, dialect):
    """The progress events are not the answer's first token: the request's record
    (/ui/activity, the TTFT histogram's source) says when the model's came."""
    url, _ = stack
    path, body = BODIES[dialect]
    model.script(Reply(content="hello there"))
    model.head_delays = [1.5]
    _, comments, _ = first_event(url, path, body)
    assert comments >= 2
    rec = requests.get(url + "/ui/activity", timeout=10).json()["data"][-1]
    assert rec["ttft"] >= 1.5, rec


def test_a_messages_client_that_takes_no_thinking_gets_comments_only(stack, model):
    """A Messages client that did not ask for thinking (and is not Claude Code) gets no
    thinking block it would not expect first: the wait is comments, as before."""
    url, search = stack
    path, body = BODIES["messages"]
    body = {k: v for k, v in body.items() if k != "thinking"}
    model.script(Reply(content="hello there"))
    model.head_delays = [1.5]
    _, comments, raw = first_event(url, path, body)
    assert comments >= 2
    kinds = [e["type"] for e in events(raw)]
    assert kinds.count("message_start") == 1 and b"thinking" not in raw
    starts = [e for e in events(raw) if e["type"] == "content_block_start"]
    assert starts[0]["index"] == 0 and starts[0]["content_block"]["type"] == "text"
