"""The web_search loop over real sockets: scripted model + SearXNG-shaped server."""
import threading

import pytest
import requests

from tests.support.chat import Reply, call, search
from tests.support.metrics import scrape
from tests.support.searxng import make_results
from tests.support.servers import wait_until

from tests.support.ask import ask, check_stream_shape

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
USER = [{"role": "user", "content": "What changed in Flask 3.1?"}]
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "parameters": {"type": "object",
                                        "properties": {"path": {"type": "string"}}}}}


def tool_msgs(body):
    return [m for m in body["messages"] if m["role"] == "tool"]


@STREAM
def test_one_round(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("flask 3.1 changelog")]),
                Reply(content="Flask 3.1 adds partitioned cookies [1]."))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 200
    assert out["content"].startswith("Flask 3.1 adds partitioned cookies [1].")
    assert "\n\nSources:\n[1] flask 3.1 changelog result 0 — " \
           "https://example.com/flask-3-1-changelog/0" in out["content"]
    assert "[2]" not in out["content"].split("Sources:")[1], "only cited sources listed"
    assert out["tool_calls"] == [] and out["finish"] == "stop"
    # the model saw our tool, then its call answered with numbered results
    first, second = chat.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["web_search"]
    assert "keywords" in first["tools"][0]["function"]["description"]
    assistant = second["messages"][-2]
    tool = second["messages"][-1]
    assert assistant["role"] == "assistant"
    assert assistant["tool_calls"][0]["function"]["name"] == "web_search"
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert "[1] flask 3.1 changelog result 0" in tool["content"]
    assert "URL: https://example.com/flask-3-1-changelog/0" in tool["content"]
    assert "Date: 2024-05-02" in tool["content"]
    assert searx.queries == ["flask 3.1 changelog"]
    ua = searx.requests[0]["headers"]["User-Agent"]
    assert ua.startswith("Mozilla/5.0") and searx.requests[0]["format"] == "json"
    if stream:
        check_stream_shape(out)
        # while searching: a chunk with an empty content delta, which agents' idle
        # timers count (a comment does not: Qwen Code's)
        assert [c for c in out["stream"].chunks
                if c["choices"] and c["choices"][0]["delta"] == {"content": ""}]


@STREAM
def test_several_rounds_numbering_and_dedupe(proxy, chat, searx, stream):
    searx.results["b"] = make_results("b", 3) + [make_results("a", 1)[0]]
    chat.script(Reply(tool_calls=[search("a")]), Reply(tool_calls=[search("b")]),
                Reply(tool_calls=[search("c")]), Reply(content="done [6] [9]"))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 200 and out["content"].startswith("done [6] [9]")
    assert len(chat.requests) == 4
    last = tool_msgs(chat.requests[3])
    assert len(last) == 3
    assert "[1] a result 0" in last[0]["content"]
    assert "[6] b result 0" in last[1]["content"]
    assert "https://example.com/a/0" not in last[1]["content"], "duplicate URL removed"
    assert "1 result(s) already listed" in last[1]["content"]
    assert "[9] c result 0" in last[2]["content"]
    sources = out["content"].split("Sources:\n")[1]
    assert sources.splitlines() == ["[6] b result 0 — https://example.com/b/0",
                                    "[9] c result 0 — https://example.com/c/0"]
    assert searx.queries == ["a", "b", "c"]
    if stream:
        check_stream_shape(out)


@STREAM
def test_parallel_calls_all_answered(proxy, chat, searx, stream):
    # the two searches must be in flight together, or the barrier breaks
    searx.barrier = threading.Barrier(2, timeout=10)
    chat.script(Reply(tool_calls=[search("alpha"), search("beta")]), Reply(content="ok"))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 200 and out["content"].startswith("ok")
    second = chat.requests[1]
    ids = [c["id"] for c in second["messages"][-3]["tool_calls"]]
    tools = tool_msgs(second)
    assert [t["tool_call_id"] for t in tools] == ids
    assert "alpha result 0" in tools[0]["content"] and "beta result 0" in tools[1]["content"]
    assert "barrier" not in tools[0]["content"] + tools[1]["content"]
    assert sorted(searx.queries) == ["alpha", "beta"]


@STREAM
def test_repeated_query_gets_corrective_result(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("rust 2024 edition")]),
                Reply(tool_calls=[search("Rust  2024 edition ")]),
                Reply(content="answer"))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 200
    assert searx.queries == ["rust 2024 edition"], "no second search"
    corrective = tool_msgs(chat.requests[2])[-1]["content"]
    assert "already searched" in corrective and "Do not repeat" in corrective


@STREAM
def test_budget_exhausted_final_call_without_tools(make_proxy, chat, searx, stream):
    proxy = make_proxy(MAX_SEARCH_ITER=2)
    chat.script(Reply(tool_calls=[search("a")]), Reply(tool_calls=[search("b")]),
                Reply(content="best effort answer"))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 200 and out["content"].startswith("best effort answer")
    assert len(chat.requests) == 3
    assert "web_search" in str(chat.requests[1]["tools"])
    assert "tools" not in chat.requests[2] and "tool_choice" not in chat.requests[2]
    assert "search budget is exhausted" in tool_msgs(chat.requests[2])[-1]["content"]


@STREAM
def test_budget_exhausted_and_no_answer_is_an_error(make_proxy, chat, searx, stream):
    proxy = make_proxy(MAX_SEARCH_ITER=1)
    searx.mode = "empty"
    chat.script(Reply(tool_calls=[search("a")]), Reply(tool_calls=[search("b")]))
    out = ask(proxy, {"messages": USER}, stream)
    err = out["json"]["error"] if not stream else out["errors"][0]["error"]
    assert "1 searches ran, 1 came back empty" in err["message"]
    if not stream:
        assert out["status"] == 502
    else:
        assert out["stream"].done == 1


@STREAM
@pytest.mark.parametrize("order", ["client_first", "search_first"])
def test_mixed_turn_client_calls_returned_ours_dropped(proxy, chat, searx, stream, order):
    calls = [call("read_file", {"path": "a.py"}), search("q")]
    if order == "search_first":
        calls.reverse()
    chat.script(Reply(content="Let me look.", tool_calls=calls))
    out = ask(proxy, {"messages": USER, "tools": [READ_FILE]}, stream)
    assert out["status"] == 200
    assert out["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in out["tool_calls"]] == \
        [("read_file", '{"path": "a.py"}')]
    assert out["tool_calls"][0]["id"]
    assert searx.queries == [] and len(chat.requests) == 1
    assert "Sources" not in out["content"]
    if stream:
        check_stream_shape(out)
        idx = {tc["index"] for c in out["stream"].chunks
               for tc in (c["choices"][0]["delta"].get("tool_calls") or [])}
        assert idx == {0}


@STREAM
def test_client_defined_web_search_left_alone(proxy, chat, searx, stream):
    own = {"type": "function", "function": {"name": "web_search", "description": "mine",
                                            "parameters": {"type": "object"}}}
    chat.script(Reply(tool_calls=[search("x")]))
    out = ask(proxy, {"messages": USER, "tools": [own]}, stream)
    assert out["finish"] == "tool_calls"
    assert [c["name"] for c in out["tool_calls"]] == ["web_search"]
    assert chat.requests[0]["tools"] == [own]
    assert searx.queries == []


@pytest.mark.parametrize("tool_choice", ["none", {"type": "function",
                                                   "function": {"name": "read_file"}}])
def test_tool_choice_disables_injection(proxy, chat, tool_choice):
    chat.script(Reply(content="hi"))
    out = ask(proxy, {"messages": USER, "tools": [READ_FILE], "tool_choice": tool_choice},
              False)
    assert out["content"] == "hi"
    assert [t["function"]["name"] for t in chat.requests[0]["tools"]] == ["read_file"]


def test_web_search_off(make_proxy, chat):
    proxy = make_proxy(WEB_SEARCH=False)
    chat.script(Reply(content="hi"))
    assert ask(proxy, {"messages": USER}, False)["content"] == "hi"
    assert "tools" not in chat.requests[0]


FAILURES = {
    "403": ("json_disabled", "refused JSON output (HTTP 403)"),
    "429": ("rate_limited", "rate-limited"),
    "empty": ("engines_failed", "google (timeout), duckduckgo (CAPTCHA)"),
    "down": ("unreachable", "down or unreachable"),
    "html": ("bad_response", "not JSON"),
}


@STREAM
@pytest.mark.parametrize("mode", list(FAILURES))
def test_searxng_failures_told_to_model(make_proxy, chat, searx, stream, mode):
    if mode == "down":
        from tests.support.servers import free_port
        proxy = make_proxy(SEARXNG_URL=f"http://127.0.0.1:{free_port()}")
    else:
        proxy = make_proxy()
        searx.mode = mode
    chat.script(Reply(tool_calls=[search("q")]), Reply(content="I could not search."))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 200 and out["content"] == "I could not search."
    kind, words = FAILURES[mode]
    tool = tool_msgs(chat.requests[1])[0]["content"]
    assert words in tool and "failed" in tool
    assert scrape(proxy).value("proxy_search_failures_total", kind=kind) == 1


def test_searxng_limiter_blocks_python_requests_agent(searx):
    """The fake behaves like SearXNG's limiter, so the browser headers above matter."""
    r = requests.get(searx.url + "/search", params={"q": "x", "format": "json"})
    assert r.status_code == 429


@STREAM
def test_reasoning_kept_in_internal_history_and_served_both_ways(proxy, chat, stream):
    chat.script(Reply(reasoning="need fresh facts", tool_calls=[search("q")]),
                Reply(reasoning="now answer", reasoning_key="reasoning", content="A"))
    out = ask(proxy, {"messages": USER}, stream)
    assistant = chat.requests[1]["messages"][-2]
    assert assistant["reasoning_content"] == "need fresh facts"
    if stream:
        s = out["stream"]
        assert s.text("reasoning_content") == "need fresh factsnow answer"
        assert s.text("reasoning") == "need fresh factsnow answer"
    else:
        assert out["message"]["reasoning"] == out["message"]["reasoning_content"] == "now answer"


def test_stream_mid_round_failure_becomes_error_event(proxy, chat):
    chat.script(Reply(tool_calls=[search("q")]), Reply(content="abcdefgh", break_after=2))
    out = ask(proxy, {"messages": USER}, True)
    assert out["status"] == 200
    assert len(out["errors"]) == 1 and out["errors"][0]["error"]["message"]
    assert out["stream"].done == 1 and not out["stream"].after_done


def test_stream_upstream_error_in_later_round_passes_its_envelope(proxy, chat):
    chat.script(Reply(tool_calls=[search("q")]), Reply(status=503, error="model is loading"))
    out = ask(proxy, {"messages": USER}, True)
    assert out["errors"] == [{"error": {"message": "model is loading", "type": "server_error",
                                        "code": "scripted"}}]


@STREAM
def test_upstream_error_on_first_call_untouched(proxy, chat, stream):
    chat.script(Reply(status=404, error="unknown model 'x'; known: a, b"))
    out = ask(proxy, {"messages": USER}, stream)
    assert out["status"] == 404
    assert out["json"] == {"error": {"message": "unknown model 'x'; known: a, b",
                                     "type": "server_error", "code": "scripted"}}


def test_stream_usage_over_rounds(proxy, chat):
    """The last round's prompt (the conversation as the model last read it), every
    round's completion tokens."""
    chat.script(Reply(tool_calls=[search("q")]), Reply(content="x"))
    out = ask(proxy, {"messages": USER, "stream_options": {"include_usage": True}}, True)
    usage = [e for e in out["stream"].events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}


def test_metrics_count_searches_and_rounds(proxy, chat):
    chat.script(Reply(tool_calls=[search("a"), search("b")]), Reply(content="x"))
    ask(proxy, {"messages": USER}, False)
    m = scrape(proxy)
    assert m.value("proxy_searches_total") == 2
    assert m.value("proxy_search_rounds_count") == 1 and m.value("proxy_search_rounds_sum") == 1
    assert m.value("proxy_requests_total", route="/v1/chat/completions", method="POST",
                   status="200") == 1
    # a whole answer's time is counted at its close, after the client has it
    wait_until(lambda: scrape(proxy).value("proxy_time_to_first_byte_seconds_count",
                                           route="/v1/chat/completions") == 1,
               "the answer's time counted")


def test_an_answer_without_searches_leaves_as_the_backend_sent_it(proxy, chat, searx):
    """One round, no search, nothing to mirror: the backend's bytes, not a
    re-serialisation (the scripted backend escapes non-ASCII, as Flask does)."""
    chat.script(Reply(content="café"))
    r = requests.post(proxy + "/v1/chat/completions", timeout=60,
                      json={"model": "scripted-model", "messages": USER})
    assert r.status_code == 200
    assert b'"content":"caf\\u00e9"' in r.content
    assert r.json()["choices"][0]["message"]["content"] == "café"
    # After a search round the answer is rebuilt (sources, the rounds' usage).
    chat.script(Reply(tool_calls=[search("q")]), Reply(content="café [1]"))
    r = requests.post(proxy + "/v1/chat/completions", timeout=60,
                      json={"model": "scripted-model", "messages": USER})
    body = r.json()
    assert body["choices"][0]["message"]["content"].startswith("café [1]\n\nSources:")
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}


def test_a_slow_second_round_keeps_chat_agents_fed(make_proxy, searx):
    """The next round's prefill after a search, its head sent at once (llama-server
    sends it when the prefill starts): the stream has begun, so its wait carries
    chunks with an empty content delta (Qwen Code's timer ignores comments)."""
    from tests.support.dialects import ScriptedDialects
    from tests.support.sseclient import read_stream
    with ScriptedDialects() as model:
        proxy = make_proxy(BACKEND_URL=model.url, KEEPALIVE_INTERVAL=0.2)
        model.script(Reply(tool_calls=[search("a")]), Reply(content="done [1]"))
        model.event_delays = [0.0, 1.2]         # the second round's first event
        s = read_stream(requests.post(proxy + "/v1/chat/completions", stream=True, json={
            "messages": USER, "stream": True}))
    empty = [c for c in s.chunks if c["choices"] and c["choices"][0]["delta"] == {"content": ""}]
    assert len(empty) >= 4, s.chunks
    assert s.text().startswith("done [1]") and s.done == 1
    assert len({c.get("id") for c in s.chunks if c.get("id")}) == 1
