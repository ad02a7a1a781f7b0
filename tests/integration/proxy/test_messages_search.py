"""Anthropic Messages (/v1/messages) with the web_search_20250305 server tool, run by
the proxy against a SearXNG-shaped server; a scripted backend that speaks Messages
itself; the real anthropic SDK as the client, streamed (its stream helpers) and not."""
import json

import anthropic
import pytest
import requests

from tests.support.chat import Reply, call, search
from tests.support.dialects import ScriptedDialects
from tests.support.metrics import scrape
from tests.support.searxng import make_results

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
USER = [{"role": "user", "content": "What changed in Flask 3.1?"}]
WEB = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
BASH = {"name": "Bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}


@pytest.fixture
def chat():
    with ScriptedDialects() as c:
        yield c


def client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)


def ask(base: str, stream: bool, **kw) -> anthropic.types.Message:
    kw = {"model": "scripted-model", "max_tokens": 2048, "messages": USER,
          "tools": [WEB], **kw}
    c = client(base)
    if not stream:
        return c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        return s.get_final_message()


def raw_events(base: str, body: dict) -> list[tuple[str, dict]]:
    """The proxy's SSE stream as (event name, data) pairs, keep-alives dropped."""
    body = {"model": "scripted-model", "max_tokens": 2048, "messages": USER,
            "tools": [WEB], **body, "stream": True}
    r = requests.post(base + "/v1/messages", json=body, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    out = []
    for block in r.text.split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln
                     and not ln.startswith(":"))
        if "event" in lines:
            data = json.loads(lines["data"])
            assert data["type"] == lines["event"]
            out.append((lines["event"], data))
    return out


def kinds(msg) -> list[str]:
    return [b.type for b in msg.content]


@STREAM
def test_one_search_round(proxy, chat, searx, stream):
    chat.script(Reply(content="Let me look.", tool_calls=[search("flask 3.1 changelog")]),
                Reply(content="Flask 3.1 adds partitioned cookies [1]."))
    msg = ask(proxy, stream)
    assert kinds(msg) == ["text", "server_tool_use", "web_search_tool_result", "text"]
    use, res, answer = msg.content[1], msg.content[2], msg.content[3]
    assert use.id.startswith("srvtoolu_") and use.name == "web_search"
    assert use.input == {"query": "flask 3.1 changelog"}
    assert res.tool_use_id == use.id
    assert [r.url for r in res.content] == [
        f"https://example.com/flask-3-1-changelog/{i}" for i in range(5)]
    assert res.content[0].type == "web_search_result"
    assert res.content[0].title == "flask 3.1 changelog result 0"
    assert res.content[1].page_age == "2024-05-02"
    assert answer.text == "Flask 3.1 adds partitioned cookies [1]."
    assert [c.url for c in answer.citations] == ["https://example.com/flask-3-1-changelog/0"]
    assert answer.citations[0].type == "web_search_result_location"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.server_tool_use.web_search_requests == 1
    assert msg.usage.input_tokens == 10 and msg.usage.output_tokens == 10   # last prompt, all output
    # the backend got a plain custom tool, then our tool_result
    first, second = chat.requests
    assert chat.paths == ["/v1/messages", "/v1/messages"]
    assert first["tools"] == [{"name": "web_search", "description": first["tools"][0][
        "description"], "input_schema": first["tools"][0]["input_schema"]}]
    assert first["tools"][0]["input_schema"]["required"] == ["query"]
    assert first["stream"] is stream
    assistant, user = second["messages"][-2:]
    assert assistant["role"] == "assistant"
    tool_use = [b for b in assistant["content"] if b["type"] == "tool_use"][0]
    assert tool_use["name"] == "web_search" and tool_use["input"] == {
        "query": "flask 3.1 changelog"}
    assert user["content"][0]["type"] == "tool_result"
    assert user["content"][0]["tool_use_id"] == tool_use["id"]
    assert "[1] flask 3.1 changelog result 0" in user["content"][0]["content"]
    assert searx.queries == ["flask 3.1 changelog"]


def test_stream_event_sequence(proxy, chat, searx):
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="answer [2]"))
    evs = raw_events(proxy, {})
    names = [n for n, _ in evs]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "ping" in names
    starts = [d for n, d in evs if n == "content_block_start"]
    assert [d["index"] for d in starts] == [0, 1, 2]
    assert [d["content_block"]["type"] for d in starts] == [
        "server_tool_use", "web_search_tool_result", "text"]
    # every block opened is closed, in order, with its deltas between
    opened = []
    for n, d in evs:
        if n == "content_block_start":
            opened.append(d["index"])
        elif n in ("content_block_delta", "content_block_stop"):
            assert d["index"] == opened[-1]
    assert [d["index"] for n, d in evs if n == "content_block_stop"] == [0, 1, 2]
    deltas = [d["delta"] for n, d in evs if n == "content_block_delta" and d["index"] == 2]
    assert "".join(x["text"] for x in deltas if x["type"] == "text_delta") == "answer [2]"
    cites = [x["citation"] for x in deltas if x["type"] == "citations_delta"]
    assert [c["url"] for c in cites] == ["https://example.com/a/1"]
    md = [d for n, d in evs if n == "message_delta"][0]
    assert md["delta"]["stop_reason"] == "end_turn"
    assert md["usage"]["server_tool_use"] == {"web_search_requests": 1}
    assert sum(1 for n in names if n == "message_start") == 1


@pytest.mark.parametrize("suffix", ["", "/v1"], ids=["root", "v1"])
def test_sdk_base_url_root_and_v1(proxy, chat, suffix):
    chat.script(Reply(content="plain answer"))
    msg = client(proxy + suffix).messages.create(model="scripted-model", max_tokens=64,
                                                 messages=USER)
    assert msg.content[0].text == "plain answer"
    assert chat.paths == ["/v1/messages"]
    assert "tools" not in chat.requests[0]


@STREAM
def test_mixed_turn_client_tool_returned_search_dropped(proxy, chat, searx, stream):
    chat.script(Reply(content="Running.", tool_calls=[search("x"),
                                                      call("Bash", {"command": "ls"})]))
    msg = ask(proxy, stream, tools=[WEB, BASH])
    assert kinds(msg) == ["text", "tool_use"]
    assert msg.content[1].name == "Bash" and msg.content[1].input == {"command": "ls"}
    assert msg.stop_reason == "tool_use"
    assert searx.queries == [] and len(chat.requests) == 1
    assert [t["name"] for t in chat.requests[0]["tools"]] == ["web_search", "Bash"]
    assert chat.requests[0]["tools"][1] == BASH, "client tools reach the backend untouched"


@STREAM
def test_client_tool_after_search_round(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("x")]),
                Reply(tool_calls=[call("Bash", {"command": "pip list"})]))
    msg = ask(proxy, stream, tools=[WEB, BASH])
    assert kinds(msg) == ["server_tool_use", "web_search_tool_result", "tool_use"]
    assert msg.stop_reason == "tool_use"
    assert msg.content[2].id.startswith("toolu_")


@STREAM
def test_max_uses(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("a"), search("b")]), Reply(content="done"))
    msg = ask(proxy, stream, tools=[{**WEB, "max_uses": 1}])
    assert kinds(msg) == ["server_tool_use", "web_search_tool_result"] * 2 + ["text"]
    assert searx.queries == ["a"]
    err = msg.content[3].content
    assert err.type == "web_search_tool_result_error" and err.error_code == "max_uses_exceeded"
    assert msg.usage.server_tool_use.web_search_requests == 1
    # the budget is spent: the next round offers no web_search
    assert "tools" not in chat.requests[1]
    results = chat.requests[1]["messages"][-1]["content"]
    assert "limit of 1 searches" in results[1]["content"]


@STREAM
def test_max_search_iter(make_proxy, chat, searx, stream):
    proxy = make_proxy(MAX_SEARCH_ITER=1)
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="final"))
    msg = ask(proxy, stream, tools=[WEB, BASH])
    assert kinds(msg)[-1] == "text" and msg.content[-1].text == "final"
    assert [t["name"] for t in chat.requests[1]["tools"]] == ["Bash"]
    assert "budget is exhausted" in chat.requests[1]["messages"][-1]["content"][0]["content"]


@STREAM
def test_budget_spent_and_no_answer_is_an_anthropic_error(make_proxy, chat, searx, stream):
    proxy = make_proxy(MAX_SEARCH_ITER=1)
    chat.script(Reply(tool_calls=[search("a")]), Reply(tool_calls=[search("b")]))
    if not stream:
        with pytest.raises(anthropic.APIStatusError) as e:
            ask(proxy, False)
        assert e.value.status_code == 502
        assert e.value.body["type"] == "error"
        assert "budget is exhausted" in e.value.body["error"]["message"]
        return
    evs = raw_events(proxy, {})
    assert evs[-1][0] == "error"
    assert evs[-1][1]["error"]["type"] == "api_error"
    assert "budget is exhausted" in evs[-1][1]["error"]["message"]


@STREAM
@pytest.mark.parametrize("mode,code", [("403", "unavailable"), ("429", "too_many_requests"),
                                       ("empty", "unavailable")])
def test_searxng_failures(proxy, chat, searx, stream, mode, code):
    searx.mode = mode
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="no luck"))
    msg = ask(proxy, stream)
    err = msg.content[1].content
    assert err.type == "web_search_tool_result_error" and err.error_code == code
    told = chat.requests[1]["messages"][-1]["content"][0]["content"]
    assert told.startswith('Web search for "a" failed: ')


@STREAM
def test_domain_filters(proxy, chat, searx, stream):
    searx.results["q"] = make_results("q", 2, "docs.python.org") + \
        make_results("q", 2, "spam.example")
    chat.script(Reply(tool_calls=[search("q")]), Reply(content="ok"))
    msg = ask(proxy, stream, tools=[{**WEB, "allowed_domains": ["python.org"]}])
    assert {r.url.split("/")[2] for r in msg.content[1].content} == {"docs.python.org"}
    chat.script(Reply(tool_calls=[search("q")]), Reply(content="ok"))
    msg = ask(proxy, stream, tools=[{**WEB, "blocked_domains": ["docs.python.org"]}])
    assert {r.url.split("/")[2] for r in msg.content[1].content} == {"spam.example"}


@STREAM
def test_thinking_blocks_pass_and_stay_in_history(proxy, chat, searx, stream):
    chat.script(Reply(reasoning="need docs", tool_calls=[search("a")]),
                Reply(reasoning="got it", content="answer"))
    msg = ask(proxy, stream)
    assert kinds(msg) == ["thinking", "server_tool_use", "web_search_tool_result",
                          "thinking", "text"]
    assert msg.content[0].thinking == "need docs"
    hist = chat.requests[1]["messages"][-2]["content"]
    assert hist[0]["type"] == "thinking" and hist[0]["thinking"] == "need docs"


def test_system_prompt_and_token_floor_in_messages_shape(make_proxy, chat):
    proxy = make_proxy(SYSTEM_PROMPT="Be brief.", TOOL_MAX_TOKENS_FLOOR=1000)
    chat.script(Reply(content="a"), Reply(content="b"), Reply(content="c"))
    c = client(proxy)
    c.messages.create(model="scripted-model", max_tokens=10, messages=USER, tools=[BASH])
    c.messages.create(model="scripted-model", max_tokens=10, messages=USER, system="Mine.")
    c.messages.create(model="scripted-model", max_tokens=4000, messages=USER, tools=[BASH])
    a, b, d = chat.requests
    assert a["system"] == "Be brief." and a["max_tokens"] == 1000
    assert b["system"] == "Mine." and b["max_tokens"] == 10, "no tools: no floor"
    assert d["max_tokens"] == 4000


def test_a_max_tokens_above_a_vllm_context_is_clamped(make_proxy, chat):
    """Claude Code asks for 32000 output tokens: vLLM (max_model_len 8192 here) would
    refuse it; the backend gets the context's size."""
    chat.models = [{"id": "v", "object": "model", "kind": "vllm", "context_length": 8192}]
    proxy = make_proxy(WEB_SEARCH=False)
    chat.script(Reply(content="a"))
    client(proxy).messages.create(model="v", max_tokens=32000, messages=USER, tools=[BASH])
    assert chat.requests[0]["max_tokens"] == 8192


def test_search_off_strips_the_server_tool(make_proxy, chat, searx):
    proxy = make_proxy(WEB_SEARCH=False)
    chat.script(Reply(content="from memory"))
    msg = ask(proxy, False, tools=[WEB, BASH])
    assert msg.content[0].text == "from memory"
    assert chat.requests[0]["tools"] == [BASH]


@pytest.mark.parametrize("body,needle", [
    ({"model": "m", "max_tokens": 5}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": 1, "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 1}]},
     "content"),
    ({"model": "m", "max_tokens": "5", "messages": USER}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": USER,
      "tools": [{**WEB, "max_uses": 0}]}, "max_uses"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": ["hi"]}]},
     "messages.0.content.0"),
    ({"model": "m", "max_tokens": 5, "messages": USER, "system": 3}, "system"),
    ({"model": "m", "max_tokens": 5, "messages": USER, "tools": ["Bash"]}, "tools.0"),
])
def test_bad_requests_in_anthropic_shape(proxy, chat, body, needle):
    r = requests.post(proxy + "/v1/messages", json=body, timeout=10)
    assert r.status_code == 400
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert needle in j["error"]["message"]
    assert chat.requests == []


def test_not_json_and_backend_errors_in_anthropic_shape(proxy, chat):
    r = requests.post(proxy + "/v1/messages", data=b"{nope", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "not valid JSON" in r.json()["error"]["message"]
    # a backend's own Anthropic error passes as it is
    chat.script(Reply(status=500, error="kaputt"))
    with pytest.raises(anthropic.InternalServerError) as e:
        ask(proxy, False)
    assert e.value.body == {"type": "error", "error": {"type": "api_error",
                                                       "message": "kaputt"}}
    # the swapper's OpenAI envelope (unknown model) becomes Anthropic's shape
    chat.error_shape = "openai"
    for stream in (False, True):
        chat.script(Reply(status=404, error="model 'nope' not found"))
        with pytest.raises(anthropic.NotFoundError) as e:
            ask(proxy, stream)
        assert e.value.body == {"type": "error", "error": {
            "type": "not_found_error", "message": "model 'nope' not found"}}
    chat.script(Reply(status=404, error="model 'nope' not found"))
    with pytest.raises(anthropic.NotFoundError):
        client(proxy).messages.create(model="nope", max_tokens=5, messages=USER)
    # an unknown model's 404 is the answer, not a sign the backend lacks /v1/messages
    assert len(chat.requests) == 1, "nothing was sent to chat completions"
    chat.script(Reply(status=503, error="loading"))
    r = requests.post(proxy + "/v1/messages", timeout=10, json={
        "model": "m", "max_tokens": 5, "messages": USER, "stream": True, "tools": [WEB]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


def test_auth_error_in_anthropic_shape(make_proxy, chat):
    proxy = make_proxy(API_KEY="sekret")
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(proxy).messages.create(model="m", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    chat.script(Reply(content="in"))
    ok = anthropic.Anthropic(base_url=proxy, api_key="sekret", max_retries=0)
    assert ok.messages.create(model="m", max_tokens=5, messages=USER).content[0].text == "in"


def test_count_tokens_passes_through_under_both_bases(proxy, chat):
    for base in (proxy, proxy + "/v1"):
        r = requests.post(base + "/v1/messages/count_tokens", json={"messages": USER},
                          timeout=10)
        assert r.status_code == 200 and r.json()["path"] == "/v1/messages/count_tokens"


def test_stream_backend_break_mid_round_is_an_error_event(proxy, chat, searx):
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="long answer", break_after=5))
    evs = raw_events(proxy, {})
    assert evs[-1][0] == "error"
    assert "upstream stream failed" in evs[-1][1]["error"]["message"]


def test_forced_search_is_forced_once(proxy, chat, searx):
    chat.script(Reply(tool_calls=[search("a")]), Reply(content="ok"))
    ask(proxy, False, tool_choice={"type": "tool", "name": "web_search"})
    assert chat.requests[0]["tool_choice"] == {"type": "tool", "name": "web_search"}
    assert chat.requests[1]["tool_choice"] == {"type": "auto"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_plain_request_bytes_unchanged(proxy, chat, path):
    """Nothing to do (no search tool, system prompt off, no floor): the backend gets
    the client's bytes as they came, and its answer comes back as it went."""
    chat.script(Reply(content="hi back"))
    raw = (b'{"model":"m",  "max_tokens": 9, "input": "x", "extra": {"keep": [1, 2]},'
           b' "messages":[{"role":"user","content":"hi"}]}')
    r = requests.post(proxy + path, data=raw, headers={"Content-Type": "application/json"},
                      timeout=10)
    assert r.status_code == 200
    assert chat.raw == [raw]
    assert "hi back" in r.text


def test_a_native_stream_without_message_start_gets_one(proxy, chat):
    """llama-server now and then leaves message_start out of a short stream; the
    anthropic SDK (Claude Code's) refuses a stream that does not begin with it."""
    chat.omit_message_start = True
    chat.script(Reply(content="hello there"), Reply(content="again"))
    with client(proxy).messages.stream(model="scripted-model", max_tokens=64,
                                       messages=USER) as s:
        msg = s.get_final_message()
    assert msg.content[0].text == "hello there" and msg.model == "scripted-model"
    chat.omit_message_start = False      # one that has it is passed as it came
    evs = raw_events(proxy, {"tools": []})
    assert [n for n, _ in evs].count("message_start") == 1 and evs[0][0] == "message_start"
    assert evs[0][1]["message"]["usage"]["input_tokens"] == 10


def test_a_search_stream_without_message_start_gets_one_first(proxy, chat, searx):
    """The same llama-server gap when the proxy runs the web_search rounds."""
    chat.omit_message_start = True
    chat.script(Reply(tool_calls=[search("flask 3.1")]), Reply(content="It changed."),
                Reply(content="Again."))
    msg = ask(proxy, True)
    assert kinds(msg)[-1] == "text" and msg.content[-1].text.startswith("It changed.")
    evs = raw_events(proxy, {})
    assert evs[0][0] == "message_start"


def test_stream_that_ends_early_is_an_error_not_an_answer(proxy, chat, searx):
    chat.truncate_after = 6             # text deltas went out, no message_delta
    chat.script(Reply(content="half an answer"))
    evs = raw_events(proxy, {})
    assert evs[-1][0] == "error" and "ended before message_delta" in \
        evs[-1][1]["error"]["message"]
    assert "message_stop" not in [n for n, _ in evs]


@STREAM
def test_metrics_count_dialect_searches(proxy, chat, searx, stream):
    chat.script(Reply(tool_calls=[search("a"), search("b")]), Reply(content="x"))
    ask(proxy, stream)
    chat.script(Reply(tool_calls=[search("c")]), Reply(content="y"))
    requests.post(proxy + "/v1/responses", timeout=30, json={
        "model": "m", "input": "q", "tools": [{"type": "web_search"}], "stream": stream})
    m = scrape(proxy)
    assert m.value("proxy_searches_total") == 3
    assert m.value("proxy_search_rounds_count") == 2 and m.value("proxy_search_rounds_sum") == 2
    assert m.value("proxy_requests_total", route="/v1/messages", method="POST", status="200") == 1
    assert m.value("proxy_requests_total", route="/v1/responses", method="POST",
                   status="200") == 1


@pytest.mark.parametrize("where", ["no-head", "head-only"])
def test_a_slow_second_round_keeps_claude_code_fed(make_proxy, chat, searx, where):
    """After the search the next round prefills (before its head, or after it): the
    stream has begun and Claude Code counts no ping, so for a client that takes
    thinking blocks the wait is a thinking block (signed progress.MARKER) after the
    search's blocks; the answer follows at the next index; sent back, the block is
    taken out before the model sees the conversation. A client that asked for no
    thinking gets pings."""
    from proxy.progress import MARKER
    proxy = make_proxy(KEEPALIVE_INTERVAL=0.2)
    for thinking in (True, False):
        chat.script(Reply(tool_calls=[search("a")]), Reply(content="done [1]"))
        if where == "no-head":
            chat.head_delays = [0.0, 1.2]
        else:
            chat.event_delays = [0.0, 1.2]
        extra = {"extra_body": {"thinking": {"type": "adaptive"}}} if thinking else {}
        msg = ask(proxy, True, **extra)
        if not thinking:
            assert kinds(msg) == ["server_tool_use", "web_search_tool_result", "text"]
            continue
        assert kinds(msg) == ["server_tool_use", "web_search_tool_result", "thinking", "text"]
        assert msg.content[2].signature == MARKER and msg.content[3].text.startswith("done")
        # the agent's next turn carries it back: the model never sees it
        chat.script(Reply(content="ok"))
        client(proxy).messages.create(model="scripted-model", max_tokens=64, messages=USER + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                              for b in msg.content]},
            {"role": "user", "content": "thanks"}])
        sent = chat.requests[-1]["messages"][1]["content"]
        assert [b["type"] for b in sent] == ["server_tool_use", "web_search_tool_result",
                                             "text"]
