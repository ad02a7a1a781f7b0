"""The real server (`python -m proxy`: gunicorn + gevent) running the search loop, used by
the official openai client, streaming and not."""
import threading

import openai
import pytest
import requests

from tests.support.chat import Reply, call, search
from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng
from tests.support.chat import ScriptedChat
from tests.support.sseclient import read_stream

USER = [{"role": "user", "content": "latest flask?"}]
EDIT = {"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def stack():
    with FakeSearxng() as searx, ScriptedChat() as chat, \
            ProxyProcess(BACKEND_URL=chat.url, SEARXNG_URL=searx.url,
                         KEEPALIVE_INTERVAL=0.2, MODELS_TTL=0) as proxy:
        yield proxy, chat, searx


@pytest.fixture
def client(stack):
    proxy, chat, searx = stack
    searx.requests.clear()
    searx.barrier = None
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0), chat, searx


def test_openai_client_full_with_search(client):
    c, chat, searx = client
    chat.script(Reply(tool_calls=[search("flask release")]), Reply(content="Flask 3.1 [1]"))
    r = c.chat.completions.create(model="scripted-model", messages=USER)
    msg = r.choices[0].message
    assert msg.content.startswith("Flask 3.1 [1]\n\nSources:\n[1] flask release result 0")
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == 20      # the last round's prompt, both rounds' output
    assert searx.queries == ["flask release"]


def test_openai_client_stream_with_search(client):
    c, chat, searx = client
    chat.script(Reply(reasoning="hmm", tool_calls=[search("flask release")]),
                Reply(content="Flask 3.1 [1]"))
    text, finish, ids = "", None, set()
    with c.chat.completions.create(model="scripted-model", messages=USER, stream=True) as s:
        for chunk in s:
            ids.add(chunk.id)
            if chunk.choices:
                d = chunk.choices[0].delta
                assert not d.tool_calls
                text += d.content or ""
                finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("Flask 3.1 [1]\n\nSources:\n[1]") and finish == "stop"
    assert len(ids) == 1


def test_openai_client_stream_client_tool_call(client):
    c, chat, searx = client
    chat.script(Reply(tool_calls=[search("x"), call("edit", {"path": "a.py"})]))
    calls = {}
    with c.chat.completions.create(model="scripted-model", messages=USER, tools=[EDIT],
                                   stream=True) as s:
        for chunk in s:
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                cur = calls.setdefault(tc.index, {"name": "", "args": ""})
                cur["name"] += tc.function.name or ""
                cur["args"] += tc.function.arguments or ""
    assert calls == {0: {"name": "edit", "args": '{"path": "a.py"}'}}
    assert searx.queries == []


def test_parallel_searches_under_gevent(client):
    c, chat, searx = client
    searx.barrier = threading.Barrier(3, timeout=10)
    chat.script(Reply(tool_calls=[search("a"), search("b"), search("c")]), Reply(content="ok"))
    r = c.chat.completions.create(model="scripted-model", messages=USER)
    assert r.choices[0].message.content.startswith("ok")
    tools = [m for m in chat.requests[1]["messages"] if m["role"] == "tool"]
    assert all("result 0" in t["content"] for t in tools) and len(tools) == 3


def test_stream_keepalive_and_single_done_under_gunicorn(stack, client):
    proxy, chat, searx = stack
    chat.script(Reply(content="let me check ", tool_calls=[search("k")]),
                Reply(content="done"))
    r = requests.post(proxy.url + "/v1/chat/completions", stream=True,
                      json={"messages": USER, "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers["X-Accel-Buffering"] == "no"
    s = read_stream(r)
    # while searching: a chunk with an empty content delta (agents' timers count it)
    assert s.done == 1 and [c for c in s.chunks
                            if c["choices"] and c["choices"][0]["delta"] == {"content": ""}]
    assert s.text().startswith("let me check done\n\nSources:")


def test_openai_client_errors(client):
    c, chat, searx = client
    chat.script(Reply(status=404, error="unknown model"))
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        c.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model="m", messages="hi")
