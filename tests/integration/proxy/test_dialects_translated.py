"""Anthropic Messages and OpenAI Responses for a backend that speaks chat completions
only (404 on the dialect paths, as llama-server answers an unknown path): the proxy
finds out once per model, then translates; search, client tools and streams behave
as with a backend that speaks the dialect. Real SDKs as clients."""
import json

import anthropic
import openai
import pytest
import requests

from tests.support.chat import Reply, call, search
from tests.support.dialects import ChatOnly

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
USER = [{"role": "user", "content": "What changed in Flask 3.1?"}]
WEB_A = {"type": "web_search_20250305", "name": "web_search"}
BASH = {"name": "Bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
SHELL = {"type": "function", "name": "shell", "description": "run",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


@pytest.fixture
def chat():
    with ChatOnly() as c:
        yield c


def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)


def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)


def message(base, stream, **kw):
    kw = {"model": "scripted-model", "max_tokens": 2048, "messages": USER, **kw}
    if not stream:
        return claude(base).messages.create(**kw)
    with claude(base).messages.stream(**kw) as s:
        return s.get_final_message()


def response(base, stream, **kw):
    kw = {"model": "scripted-model", "input": "What changed in Flask 3.1?", **kw}
    if not stream:
        return oai(base).responses.create(**kw)
    events = list(oai(base).responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


@STREAM
def test_messages_search_round(proxy, chat, searx, stream):
    chat.script(Reply(reasoning="hmm", content="Looking.", tool_calls=[search("flask 3.1")]),
                Reply(content="Partitioned cookies [1]."))
    msg = message(proxy, stream, tools=[WEB_A, BASH], system="Be exact.")
    assert [b.type for b in msg.content] == ["thinking", "text", "server_tool_use",
                                             "web_search_tool_result", "text"]
    assert msg.content[4].citations[0].url == "https://example.com/flask-3-1/0"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.server_tool_use.web_search_requests == 1
    assert msg.usage.input_tokens == 20 and msg.usage.output_tokens == 10
    first, second = chat.requests
    assert first["messages"][0] == {"role": "system", "content": "Be exact."}
    assert [t["function"]["name"] for t in first["tools"]] == ["web_search", "Bash"]
    assert first["tools"][1]["function"]["parameters"] == BASH["input_schema"]
    assert first["stream"] is stream
    assistant, tool = second["messages"][-2:]
    assert assistant["role"] == "assistant" and assistant["content"] == "Looking."
    assert assistant["reasoning_content"] == "hmm"
    assert assistant["tool_calls"][0]["function"]["name"] == "web_search"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {
        "query": "flask 3.1"}
    assert tool["role"] == "tool" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert "[1] flask 3.1 result 0" in tool["content"]
    assert chat.missing == ["/v1/messages"], "found out once, then remembered"


@STREAM
def test_messages_client_tool_and_its_result(proxy, chat, stream):
    chat.script(Reply(tool_calls=[call("Bash", {"command": "ls"})]), Reply(content="2 files"))
    msg = message(proxy, stream, tools=[BASH])
    assert [b.type for b in msg.content] == ["tool_use"] and msg.stop_reason == "tool_use"
    use = msg.content[0]
    assert use.name == "Bash" and use.input == {"command": "ls"}
    history = USER + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": use.id,
                           "content": [{"type": "text", "text": "a b"}]},
                          {"type": "text", "text": "count them"}]}]
    msg = message(proxy, stream, tools=[BASH], messages=history)
    assert msg.content[0].text == "2 files"
    sent = chat.requests[1]["messages"]
    assert sent[-3]["tool_calls"][0]["id"] == use.id
    assert sent[-2] == {"role": "tool", "tool_call_id": use.id, "content": "a b"}
    assert sent[-1] == {"role": "user", "content": "count them"}


@STREAM
def test_responses_search_round(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("flask 3.1")]), Reply(content="Cookies [1]."))
    resp = response(proxy, stream, tools=[{"type": "web_search"}, SHELL],
                    instructions="Be exact.", max_output_tokens=3000)
    assert [i.type for i in resp.output] == ["web_search_call", "message"]
    assert resp.output[0].action.query == "flask 3.1"
    assert resp.output[1].content[0].annotations[0].url == "https://example.com/flask-3-1/0"
    assert resp.output_text == "Cookies [1]."
    first, second = chat.requests
    assert first["messages"][0] == {"role": "system", "content": "Be exact."}
    assert first["messages"][1] == {"role": "user", "content": "What changed in Flask 3.1?"}
    assert first["max_tokens"] == 3000
    assert [t["function"]["name"] for t in first["tools"]] == ["web_search", "shell"]
    fc, out = second["messages"][-2:]
    assert fc["tool_calls"][0]["function"]["name"] == "web_search"
    assert out["role"] == "tool" and out["tool_call_id"] == fc["tool_calls"][0]["id"]
    assert chat.missing == ["/v1/responses"]


@STREAM
def test_responses_function_call_round_trip(proxy, chat, stream):
    chat.script(Reply(content="Let me run it.", tool_calls=[call("shell", {"cmd": "ls"})]),
                Reply(content="done"))
    resp = response(proxy, stream, tools=[SHELL])
    assert [i.type for i in resp.output] == ["message", "function_call"]
    fc = resp.output[1]
    assert fc.name == "shell" and json.loads(fc.arguments) == {"cmd": "ls"}
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "run ls"}]},
             {"type": "function_call", "call_id": fc.call_id, "name": "shell",
              "arguments": fc.arguments},
             {"type": "function_call_output", "call_id": fc.call_id, "output": "a b"}]
    resp = response(proxy, stream, tools=[SHELL], input=items)
    assert resp.output_text == "done"
    sent = chat.requests[1]["messages"]
    assert sent == [{"role": "user", "content": "run ls"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": fc.call_id, "type": "function",
                         "function": {"name": "shell", "arguments": fc.arguments}}]},
                    {"role": "tool", "tool_call_id": fc.call_id, "content": "a b"}]


def test_length_finish_and_plain_requests(proxy, chat):
    chat.script(Reply(content="cut", finish_reason="length"), Reply(content="cut",
                                                                    finish_reason="length"))
    assert message(proxy, False).stop_reason == "max_tokens"
    assert response(proxy, True).status == "incomplete"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_chat_errors_in_the_dialects_shape(proxy, chat, path):
    chat.script(Reply(status=503, error="loading"))
    body = {"model": "m", "max_tokens": 5, "messages": USER, "input": "x", "stream": True}
    r = requests.post(proxy + path, json=body, timeout=10)
    assert r.status_code == 503
    if path == "/v1/messages":
        assert r.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                       "message": "loading"}}
    else:
        assert r.json()["error"]["message"] == "loading"


@STREAM
def test_responses_reasoning_item(proxy, chat, stream):
    chat.script(Reply(reasoning="think first", content="then answer"))
    resp = response(proxy, stream)
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "think first"
    assert resp.output_text == "then answer"
