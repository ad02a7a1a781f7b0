"""Codex as it is used (issue 21), through the proxy in front of a model that renders
every request through the official Qwen3.5 template the way llama-server does
(tests.support.agents.Rendering: its /v1/responses conversion keeps only function
tools, a template exception is its 500).

- `namespace` tools (Codex's `multi_agent_v1`, an MCP server's tools) reach the
  backend as plain function tools NS__NAME (llama-server would skip them: the model
  would never see them), and the model's calls of them come back as Codex's
  `{"type": "function_call", "name": NAME, "namespace": NS}`; Codex's history items
  of such calls reach the backend as NS__NAME again. Streamed and not, web search on
  and off.
- A late developer message renders (a user note in place), where the template
  would raise.
- `previous_response_id`: llama-server refuses it (400 invalid_request_error "llama.cpp
  does not support 'previous_response_id'."); the client gets that 400 in the
  Responses error shape, never a 500.
"""
from __future__ import annotations

import json

import pytest
import requests

from proxy.agents import NOTE
from tests.support.agents import Rendering
from tests.support.chat import Reply, call
from tests.support.dialects import LlamaError, ScriptedDialects
from tests.support.proxyproc import searching

FN = {"type": "function", "strict": False,
      "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                     "required": ["message"], "additionalProperties": False}}
NAMESPACES = {
    "multi_agent_v1": ({"type": "namespace", "name": "multi_agent_v1",
                        "description": "Sub-agents.",
                        "tools": [{**FN, "name": "spawn_agent", "description": "Spawn one."},
                                  {**FN, "name": "wait", "description": "Wait for them."}]},
                       ["multi_agent_v1__spawn_agent", "multi_agent_v1__wait"], "spawn_agent"),
    "mcp": ({"type": "namespace", "name": "mcp__docs__", "description": "Docs server.",
             "tools": [{**FN, "name": "search", "description": "Search the docs."}]},
            ["mcp__docs__search"], "search"),
}
EXEC = {**FN, "name": "exec_command", "description": "Run a command."}
DEV = {"type": "message", "role": "developer",
       "content": [{"type": "input_text", "text": "You are Codex."}]}


def user(text):
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def namespaced_model(body: dict, path: str) -> Reply:
    """Calls the first flattened tool it is offered, once; then answers."""
    items = body.get("input") or []
    if items and items[-1].get("type") == "function_call_output":
        return Reply(content="DONE: " + str(items[-1].get("output")))
    names = [t.get("name") for t in body.get("tools") or []]
    for full in ("multi_agent_v1__spawn_agent", "mcp__docs__search"):
        if full in names:
            return Reply(tool_calls=[call(full, {"message": "go"})])
    return Reply(content="ok")


@pytest.fixture(scope="module")
def model():
    with ScriptedDialects() as m:
        m.llama_style = True            # Responses events as llama-server sends them
        yield m


@pytest.fixture(scope="module", params=["search", "no-search"])
def proxy(request, model):
    with searching(model.url, request.param == "search") as p:
        yield p


@pytest.fixture
def rendering(model):
    r = Rendering(namespaced_model)
    model.responder = r
    model.requests.clear()
    yield r
    model.responder = None


def post(proxy, body: dict, stream: bool):
    url, search = proxy
    body = {"model": "m", **body, "stream": stream}
    if search:
        body["tools"] = list(body.get("tools") or []) + [{"type": "web_search"}]
    return requests.post(url + "/v1/responses", json=body, stream=stream, timeout=10)


def output_of(r, stream: bool) -> list[dict]:
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["output"]
    done, added = None, []
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data:"):
            obj = json.loads(line[5:])
            if obj.get("type") == "response.output_item.added":
                added.append(obj["item"])
            if obj.get("type") == "response.completed":
                done = obj["response"]["output"]
    # what Codex reads: each item as added (its name) and the completed output
    for a in added:
        if a.get("type") == "function_call":
            assert "namespace" in a and "__" not in a["name"], a
    return done


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("ns", list(NAMESPACES))
def test_namespace_tools_reach_the_model_and_calls_come_back_in_codex_shape(
        proxy, model, rendering, ns, stream):
    tool, flat, short = NAMESPACES[ns]
    full = flat[0]
    r = post(proxy, {"input": [DEV, user("spawn a helper")], "tools": [EXEC, tool]}, stream)
    out = output_of(r, stream)
    calls = [i for i in out if i.get("type") == "function_call"]
    assert len(calls) == 1
    assert (calls[0]["namespace"], calls[0]["name"]) == (tool["name"], short)
    sent = model.requests[-1]
    assert not [t for t in sent["tools"] if t.get("type") == "namespace"]
    names = [t["name"] for t in sent["tools"]]
    assert names[:1 + len(flat)] == ["exec_command"] + flat, "where the namespace stood"
    assert full in rendering.prompts[-1], "the model saw the tool"

    # Codex's next request: its history holds the call as it got it
    history = [DEV, user("spawn a helper"),
               {k: v for k, v in calls[0].items() if k in
                ("type", "name", "namespace", "arguments", "call_id")},
               {"type": "function_call_output", "call_id": calls[0]["call_id"],
                "output": "helper started"}]
    r = post(proxy, {"input": history, "tools": [EXEC, tool]}, stream)
    out = output_of(r, stream)
    assert any("DONE: helper started" in json.dumps(i) for i in out)
    fc = [i for i in model.requests[-1]["input"] if i.get("type") == "function_call"][0]
    assert fc["name"] == full and "namespace" not in fc
    assert rendering.refused == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_late_developer_message_renders(proxy, model, rendering, stream):
    late = {"type": "message", "role": "developer",
            "content": [{"type": "input_text", "text": "Approvals are now off."}]}
    r = post(proxy, {"input": [DEV, DEV, user("hi"), late, user("go on")]}, stream)
    assert r.status_code == 200, r.text
    b"".join(r.iter_content(None)) if stream else r.json()
    assert rendering.refused == []
    assert NOTE + "Approvals are now off." in rendering.prompts[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_previous_response_id_is_a_clear_400(proxy, model, stream):
    model.responder = None
    model.script(LlamaError(400, {"error": {
        "code": 400, "message": "llama.cpp does not support 'previous_response_id'.",
        "type": "invalid_request_error"}}))
    r = post(proxy, {"input": [user("and then?")], "previous_response_id": "resp_1"}, stream)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "previous_response_id" in err["message"]
