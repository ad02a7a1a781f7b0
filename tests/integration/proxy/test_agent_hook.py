"""The agent-session hook (proxy/agents.py `fix`) and the prefix our own changes keep.

fix(dialect, body, info) runs once per request in each dialect, on the body as the
client sent it, before the proxy's own changes (system prompt, web_search, token
floor). Those changes keep an agent's prompt prefix the same turn to turn: the
same system prompt, web_search after the client's tools, the client's key order,
so the backend's prompt cache serves the next turn."""
from __future__ import annotations

import copy
import json

import pytest
import requests

from proxy import dialects
from tests.support.chat import Reply
from tests.support.dialects import ScriptedDialects

EDIT = {"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}
BASH = {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}
SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}


@pytest.fixture
def chat():
    with ScriptedDialects() as c:
        yield c


def turns(dialect: str) -> tuple[str, dict, dict]:
    """(path, first turn, second turn: the first, answered, and a new user message)."""
    if dialect == "chat":
        one = {"model": "scripted-model", "max_tokens": 64, "tools": [EDIT],
               "messages": [{"role": "user", "content": "hi"}]}
        two = copy.deepcopy(one)
        two["messages"] += [{"role": "assistant", "content": "ok"},
                            {"role": "user", "content": "more"}]
        return "/v1/chat/completions", one, two
    if dialect == "messages":
        one = {"model": "scripted-model", "max_tokens": 64, "stream": False,
               "tools": [BASH, {"type": "web_search_20250305", "name": "web_search"}],
               "messages": [{"role": "user", "content": "hi"}]}
        two = copy.deepcopy(one)
        two["messages"] += [{"role": "assistant", "content": "ok"},
                            {"role": "user", "content": "more"}]
        return "/v1/messages", one, two
    one = {"model": "scripted-model", "max_output_tokens": 64, "input": [
        {"type": "message", "role": "user", "content": "hi"}],
        "tools": [SHELL, {"type": "web_search"}]}
    two = copy.deepcopy(one)
    two["input"] += [{"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": "ok"}]},
                     {"type": "message", "role": "user", "content": "more"}]
    return "/v1/responses", one, two


DIALECTS = ["chat", "messages", "responses"]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_fix_runs_once_on_the_clients_body_before_our_changes(make_proxy, chat, dialect,
                                                              monkeypatch):
    seen = []

    class Agents:
        @staticmethod
        def fix(d, body, info):
            seen.append((d.name, json.dumps(body), info))
            body["seen_by_fix"] = True          # its change reaches the backend
            return True

    monkeypatch.setattr(dialects, "agents", Agents)
    chat.models = [{"id": "scripted-model", "object": "model", "late_system": "keep"}]
    proxy = make_proxy(SYSTEM_PROMPT="be brief", TOOL_MAX_TOKENS_FLOOR=1000)
    path, one, _ = turns(dialect)
    chat.script(Reply(content="ok"))
    r = requests.post(proxy + path, json=one, timeout=30)
    assert r.status_code == 200, r.text
    assert [(name, json.loads(b), info.get("late_system")) for name, b, info in seen] == \
        [(dialect, one, "keep")], "once, on the client's body, with the model's entry"
    sent = chat.requests[-1]
    assert sent["seen_by_fix"] is True
    assert "be brief" in json.dumps(sent) and 1000 in (sent.get("max_tokens"),
                                                      sent.get("max_output_tokens"))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_our_changes_keep_the_prefix_turn_to_turn(make_proxy, chat, dialect):
    proxy = make_proxy(SYSTEM_PROMPT="be brief")
    path, one, two = turns(dialect)
    sent = []
    for body in (one, two):
        chat.script(Reply(content="ok"))
        r = requests.post(proxy + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        sent.append(chat.raw[-1] if dialect != "chat" else json.dumps(chat.requests[-1]))
    a, b = (json.loads(x) for x in sent)
    assert list(a) == list(b), "the same keys in the same order"
    history = "messages" if dialect != "responses" else "input"
    assert {k: v for k, v in a.items() if k != history} == \
        {k: v for k, v in b.items() if k != history}, "system, tools and the rest unchanged"
    assert b[history][:len(a[history])] == a[history], "the first turn is the second's prefix"
    names = [t.get("name") or t["function"]["name"] for t in a["tools"]]
    assert names[-1] == "web_search" and names[:-1] == [
        t.get("name") or t["function"]["name"] for t in one["tools"]
        if t.get("type") not in ("web_search_20250305", "web_search")]
    assert list(a)[:len(one)] == list(one), "the client's keys first, in its order"
