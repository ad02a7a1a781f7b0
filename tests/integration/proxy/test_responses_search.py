"""OpenAI Responses (/v1/responses) with the `web_search` tool run by the proxy against a
SearXNG-shaped server; a scripted backend that speaks Responses itself; the real openai
SDK as the client (responses.create, streamed and not, and its stream helper)."""
import json

import openai
import pytest
import requests

from tests.support.chat import Reply, call, search
from tests.support.dialects import ScriptedDialects

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
WEB = {"type": "web_search"}
SHELL = {"type": "function", "name": "shell", "description": "run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


@pytest.fixture
def chat():
    with ScriptedDialects() as c:
        yield c


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)


def ask(base: str, stream: bool, **kw):
    """(final Response, stream events or None)"""
    kw = {"model": "scripted-model", "input": "What changed in Flask 3.1?", "tools": [WEB],
          **kw}
    c = client(base)
    if not stream:
        return c.responses.create(**kw), None
    events = list(c.responses.create(stream=True, **kw))
    done = [e for e in events if e.type in ("response.completed", "response.failed")]
    assert len(done) == 1 and events[-1] is done[0]
    return done[0].response, events


def types(resp) -> list[str]:
    return [i.type for i in resp.output]


@STREAM
@pytest.mark.parametrize("tool", ["web_search", "web_search_preview"])
def test_one_search_round(proxy, chat, searx, stream, tool):
    chat.script(Reply(tool_calls=[search("flask 3.1 changelog")]),
                Reply(content="Flask 3.1 adds partitioned cookies [1]."))
    resp, events = ask(proxy, stream, tools=[{"type": tool}])
    assert types(resp) == ["web_search_call", "message"]
    ws, msg = resp.output
    assert ws.id.startswith("ws_") and ws.status == "completed"
    assert ws.action.type == "search" and ws.action.query == "flask 3.1 changelog"
    assert ws.action.sources[0].url == "https://example.com/flask-3-1-changelog/0"
    text = msg.content[0]
    assert text.text == "Flask 3.1 adds partitioned cookies [1]."
    ann = text.annotations[0]
    assert ann.type == "url_citation" and ann.url == "https://example.com/flask-3-1-changelog/0"
    assert text.text[ann.start_index:ann.end_index] == "[1]"
    assert resp.output_text == "Flask 3.1 adds partitioned cookies [1]."
    assert resp.status == "completed"
    assert resp.usage.input_tokens == 10 and resp.usage.output_tokens == 10   # last prompt, all output
    first, second = chat.requests
    assert chat.paths == ["/v1/responses"] * 2
    assert first["tools"][0]["type"] == "function" and first["tools"][0]["name"] == "web_search"
    assert first["input"] == [{"type": "message", "role": "user",
                               "content": "What changed in Flask 3.1?"}]
    fc, out = second["input"][-2:]
    assert fc["type"] == "function_call" and fc["name"] == "web_search"
    assert out["type"] == "function_call_output" and out["call_id"] == fc["call_id"]
    assert "[1] flask 3.1 changelog result 0" in out["output"]
    if stream:
        names = [e.type for e in events]
        assert names[:2] == ["response.created", "response.in_progress"]
        assert names.count("response.created") == 1
        i = names.index("response.web_search_call.in_progress")
        assert names[i - 1] == "response.output_item.added"
        assert names[i:i + 3] == ["response.web_search_call.in_progress",
                                  "response.web_search_call.searching",
                                  "response.web_search_call.completed"]
        assert names[i + 3] == "response.output_item.done"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert {e.output_index for e in events[i - 1:i + 4]} == {0}
        msg_events = [e for e in events if getattr(e, "output_index", None) == 1]
        assert msg_events[0].type == "response.output_item.added"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
            == "Flask 3.1 adds partitioned cookies [1]."
        assert any(e.type == "response.output_text.annotation.added" for e in events)
        assert not any(e.type.startswith("response.function_call") for e in events)


def test_stream_from_backend_without_output_index(proxy, chat, searx):
    """llama-server's Responses events name items by id only: the client still gets
    every event, numbered and indexed."""
    chat.llama_style = True
    chat.script(Reply(content="Checking.", tool_calls=[search("a")]), Reply(content="done [1]"))
    resp, events = ask(proxy, True)
    assert types(resp) == ["message", "web_search_call", "message"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == "Checking.done [1]"
    assert [e.output_index for e in deltas] == [0] * 3 + [2] * 2
    assert all(e.content_index == 0 for e in deltas)
    assert resp.output[2].content[0].annotations[0].url == "https://example.com/a/0"


def test_stream_helper(proxy, chat, searx):
    chat.script(Reply(content="Checking.", tool_calls=[search("a")]), Reply(content="done [1]"))
    with client(proxy).responses.stream(model="scripted-model", input="q",
                                        tools=[WEB]) as s:
        final = s.get_final_response()
    assert types(final) == ["message", "web_search_call", "message"]
    assert final.output_text == "Checking.done [1]"


@STREAM
def test_mixed_turn_function_call_returned_search_dropped(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("x"), call("shell", {"cmd": "ls"})]))
    resp, _ = ask(proxy, stream, tools=[WEB, SHELL])
    assert types(resp) == ["function_call"]
    assert resp.output[0].name == "shell" and json.loads(resp.output[0].arguments) == {
        "cmd": "ls"}
    assert searx.queries == [] and len(chat.requests) == 1
    assert chat.requests[0]["tools"][1] == SHELL


@STREAM
def test_search_then_client_function_call(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("x")]), Reply(tool_calls=[call("shell", {"cmd": "a"})]))
    resp, _ = ask(proxy, stream, tools=[WEB, SHELL])
    assert types(resp) == ["web_search_call", "function_call"]
    assert resp.output[1].call_id.startswith("call_")


@STREAM
def test_max_search_iter_and_searxng_failure(make_proxy, chat, searx, stream):
    proxy = make_proxy(MAX_SEARCH_ITER=1)
    searx.mode = "403"
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="unavailable, sorry"))
    resp, _ = ask(proxy, stream, tools=[WEB, SHELL])
    assert types(resp) == ["web_search_call", "message"]
    assert resp.output[0].status == "failed"
    assert [t["name"] for t in chat.requests[1]["tools"]] == ["shell"]
    told = chat.requests[1]["input"][-1]["output"]
    assert "refused JSON output" in told and "budget is exhausted" in told


@STREAM
def test_budget_spent_without_answer_fails(make_proxy, chat, searx, stream):
    proxy = make_proxy(MAX_SEARCH_ITER=1)
    chat.script(Reply(tool_calls=[search("a")]), Reply(tool_calls=[search("b")]))
    if not stream:
        with pytest.raises(openai.APIStatusError) as e:
            ask(proxy, False)
        assert e.value.status_code == 502
        assert e.value.body["code"] == "search_budget_exhausted"
        return
    resp, _ = ask(proxy, True)
    assert resp.status == "failed" and resp.error.code == "search_budget_exhausted"


def test_instructions_and_output_token_floor(make_proxy, chat):
    proxy = make_proxy(SYSTEM_PROMPT="Be brief.", TOOL_MAX_TOKENS_FLOOR=1000)
    chat.script(Reply(content="a"), Reply(content="b"))
    c = client(proxy)
    c.responses.create(model="m", input="hi", tools=[SHELL], max_output_tokens=20)
    c.responses.create(model="m", input="hi", instructions="Mine.", max_output_tokens=20)
    a, b = chat.requests
    assert a["instructions"] == "Be brief." and a["max_output_tokens"] == 1000
    assert b["instructions"] == "Mine." and b["max_output_tokens"] == 20


def test_an_output_limit_above_a_vllm_context_is_clamped(make_proxy, chat):
    chat.models = [{"id": "v", "object": "model", "kind": "vllm", "context_length": 8192}]
    proxy = make_proxy(WEB_SEARCH=False)
    chat.script(Reply(content="a"))
    client(proxy).responses.create(model="v", input="hi", max_output_tokens=32768)
    assert chat.requests[0]["max_output_tokens"] == 8192


def test_plain_request_passes_through(proxy, chat):
    chat.script(Reply(content="hello"))
    resp = client(proxy).responses.create(model="scripted-model", input="hi")
    assert resp.output_text == "hello"
    assert chat.requests[0]["input"] == "hi" and "tools" not in chat.requests[0]


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 5}, "input"),
    ({"model": "m", "input": ["hi"]}, "input[0]"),
    ({"model": "m", "input": "hi", "tools": [{"name": "x"}]}, "tools[0]"),
    ({"model": "m", "input": "hi", "max_output_tokens": "9"}, "max_output_tokens"),
])
def test_bad_request_openai_envelope(proxy, chat, body, param):
    r = requests.post(proxy + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert chat.requests == []


def test_forced_search_is_forced_once(proxy, chat, searx):
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="ok"))
    ask(proxy, False, tool_choice={"type": "web_search_preview"},
        tools=[{"type": "web_search_preview"}])
    assert chat.requests[0]["tool_choice"] == {"type": "function", "name": "web_search"}
    assert chat.requests[1]["tool_choice"] == "auto"


def test_stream_that_ends_early_fails(proxy, chat, searx):
    chat.truncate_after = 11            # the whole message item, no response.completed
    chat.script(Reply(content="half an answer"))
    resp, events = ask(proxy, True)
    assert resp.status == "failed" and resp.error.code == "upstream_stream_truncated"
    assert "response.completed" not in [e.type for e in events]


@pytest.mark.parametrize("where", ["no-head", "head-only"])
def test_a_slow_second_round_keeps_codex_fed(make_proxy, chat, searx, where):
    """After the search the next round prefills (our results are new tokens), before
    its head or after it: the stream has begun, so it carries response.in_progress
    events (Codex's idle timer counts them, not comments), numbered with the rest,
    under the one response id."""
    proxy = make_proxy(KEEPALIVE_INTERVAL=0.2)
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="done [1]"))
    if where == "no-head":
        chat.head_delays = [0.0, 1.2]
    else:
        chat.event_delays = [0.0, 1.2]  # the second round's first event
    resp, events = ask(proxy, True)
    assert resp.output_text == "done [1]"
    names = [e.type for e in events]
    after = names[names.index("response.web_search_call.completed"):]
    assert after.count("response.in_progress") >= 3, names
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {e.response.id for e in events if e.type.startswith("response.in")} == {resp.id}
