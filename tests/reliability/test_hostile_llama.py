"""Hostile chat bodies through the real proxy to the real llama-server (the test
bed's CPU build with SmolLM2): what the proxy lets through, the backend must be
able to take. Any 5xx, ours or the backend's, means the proxy forwarded input
it should have refused with a 400."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import hostile
from tests.support.llama import LlamaServer
from tests.support.proxyproc import ProxyProcess
from tests.support.rawhttp import send


@pytest.fixture(scope="module")
def proxy():
    with LlamaServer(ctx=1024, parallel=2) as llama, \
            ProxyProcess(BACKEND_URL=llama.url, WEB_SEARCH=0, SYSTEM_PROMPT="",
                         LOG_LEVEL="warning") as p:
        yield p


def ask(proxy, body: dict):
    return send(proxy.url, "POST", "/v1/chat/completions", {"Content-Type": "application/json"},
                hostile.dumps(body), timeout=120)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
], ids=["text-part-without-text", "tool-call-without-type"])
def test_what_llama_server_fails_on_is_a_400_at_the_proxy(proxy, messages):
    ans = ask(proxy, {"messages": messages, "max_tokens": 1})
    assert ans.status == 400, ans.body
    assert ans.envelope is not None


def test_a_tool_without_type_is_a_400_at_the_proxy(proxy):
    ans = ask(proxy, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "tools": [{"function": {"name": "f", "parameters": {}}}]})
    assert ans.status == 400, ans.body


# Near-valid requests: the shapes clients send, with one field or part off.
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "bot"])
# No image parts: a text-only model refuses them by its registry entry, at the
# swapper (test_hostile_swapper.py); this proxy fronts a bare llama-server.
CONTENT = st.one_of(st.text(max_size=12), st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    hostile.parts.filter(lambda p: p.get("type") != "image_url")), max_size=3))
CALLS = st.lists(st.fixed_dictionaries(
    {"id": st.text(max_size=4), "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.text(max_size=6),
                                        "arguments": st.sampled_from(["{}", "", "{", "[1]"])})}),
    max_size=2)
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": CONTENT}, optional={
    "tool_calls": CALLS, "tool_call_id": st.text(max_size=4), "name": st.text(max_size=4)})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=6)}, optional={
        "parameters": st.one_of(st.just({"type": "object", "properties": {}}),
                                st.dictionaries(st.text(max_size=4), hostile.json_values,
                                                max_size=3)),
        "description": st.text(max_size=8)})})
NEAR_VALID = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={"tools": st.lists(TOOL, max_size=2),
              "tool_choice": st.sampled_from(["auto", "none", "required",
                                              {"type": "function", "function": {"name": "f"}}]),
              "temperature": st.floats(-1, 3), "top_p": st.floats(-1, 2),
              "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)),
              "seed": st.integers(-2**40, 2**40), "n": st.integers(1, 2),
              # (json_object is left out: its grammar makes SmolLM2 take ~30 s a request)
              "response_format": st.sampled_from([{"type": "text"}, {"type": "nope"}]),
              "stream_options": st.just({"include_usage": True})})


# Non-streaming only: llama-server closes the connection after a streamed answer
# although it advertises keep-alive, and the proxy's next request on that pooled
# connection fails with a 502 (issue 9 item 2, the lead's); this sweep is about
# input, not connection reuse.
@settings(max_examples=50)
@given(body=st.one_of(NEAR_VALID, hostile.chat_bodies(st.just("smollm2")).filter(
    lambda b: "image_url" not in json.dumps(b))))
def test_nothing_the_proxy_forwards_makes_llama_server_fail(proxy, body):
    body["max_tokens"] = 1                # generation is not what is tested
    body["stream"] = False
    ans = ask(proxy, body)
    hostile.check(ans, "POST /v1/chat/completions " + json.dumps(body)[:400])
