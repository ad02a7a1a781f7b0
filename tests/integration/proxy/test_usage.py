"""Usage an agent can trust (issue 21): the prompt tokens the backend reused from its
cache reach the client in every dialect and path -- Messages
`cache_read_input_tokens` (llama-server: input_tokens are the uncached rest),
Responses `input_tokens_details.cached_tokens`, chat
`prompt_tokens_details.cached_tokens` -- streamed or not, web search off (the
backend's answer as it is) and on (the search rounds' answer).

Over search rounds: the prompt side is the LAST round's (the conversation as the
model last read it: what a direct request reports, what an agent sizes its context
from, and whose cache the next turn reuses), output tokens are summed over the
rounds. So a one-round answer reports exactly what the backend did, and a
two-round one never doubles the prompt (the issue: Codex counted 13,805 tokens
through the stack vs 6,847 direct, with cached_tokens 0 while 6,802 were reused)."""
from __future__ import annotations


import pytest
import requests

from tests.support.chat import Reply, search
from tests.support.dialects import SEARCH_TOOL, ScriptedDialects
from tests.support.proxyproc import searching
from tests.support.sseclient import named_events

USER = [{"role": "user", "content": "hello"}]
BODIES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": USER,
                                      "stream_options": {"include_usage": True}}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER}),
    "responses": ("/v1/responses", {"model": "m", "input": "hello"}),
}


@pytest.fixture(scope="module")
def model():
    with ScriptedDialects() as m:
        yield m


@pytest.fixture(scope="module", params=["search", "no-search"])
def proxy(request, model):
    with searching(model.url, request.param == "search", SEARCH_SOURCES=False) as p:
        yield p


def usage_of(dialect: str, r, stream: bool) -> dict:
    """The usage as the client's SDK makes it of the answer."""
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]
    evs = named_events(r)
    if dialect == "chat":
        return [o for _, o in evs if o.get("usage")][-1]["usage"]
    if dialect == "responses":
        return [o for n, o in evs if n == "response.completed"][-1]["response"]["usage"]
    # Anthropic: message_start's usage, updated by message_delta's (the SDKs do that)
    u = dict([o for n, o in evs if n == "message_start"][0]["message"]["usage"])
    u.update({k: v for k, v in [o for n, o in evs if n == "message_delta"][-1]["usage"].items()
              if v is not None})
    return u


def prompt_side(dialect: str, u: dict) -> tuple[int, int]:
    """(prompt tokens, of which cached) from a dialect's usage."""
    if dialect == "messages":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    if dialect == "responses":
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def ask(proxy, dialect, stream):
    url, search_on = proxy
    path, body = BODIES[dialect]
    body = {**body, "stream": stream}
    if search_on and dialect in SEARCH_TOOL:
        body["tools"] = [SEARCH_TOOL[dialect]]
    return requests.post(url + path, json=body, stream=stream, timeout=10)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", list(BODIES))
def test_one_round_reports_the_backends_cache(proxy, model, dialect, stream):
    model.script(Reply(content="hi"))
    model.prompt_cache = [(6847, 6802)]
    u = usage_of(dialect, ask(proxy, dialect, stream), stream)
    assert prompt_side(dialect, u) == (6847, 6802), u
    out = u["output_tokens" if dialect != "chat" else "completion_tokens"]
    assert out == 5
    if dialect != "messages":
        assert u["total_tokens"] == 6852


@pytest.mark.parametrize("proxy", ["search"], indirect=True)    # rounds: the search loop's
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", list(BODIES))
def test_search_rounds_report_the_last_prompt_and_every_output(proxy, model, dialect, stream):
    url, search_on = proxy
    assert search_on
    model.script(Reply(tool_calls=[search("flask 3.1")]), Reply(content="Flask 3.1 [1]"))
    model.prompt_cache = [(6847, 6802), (6931, 6847)]
    u = usage_of(dialect, ask(proxy, dialect, stream), stream)
    assert len(model.requests) == 2
    assert prompt_side(dialect, u) == (6931, 6847), u
    assert u["output_tokens" if dialect != "chat" else "completion_tokens"] == 10
    if dialect != "messages":
        assert u["total_tokens"] == 6941, "the prompt counted once, not per round"
