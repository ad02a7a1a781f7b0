"""Pass-through, errors, auth, limits and normalisation over real sockets (scripted upstream)."""
import json

import pytest
import requests

from tests.support.chat import Reply
from tests.support.servers import free_port

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/embeddings?x=1&y=%20z"), ("POST", "/v1/completions"),
    ("GET", "/v1/models/foo"), ("POST", "/load/qwen-coder?wait=1"), ("POST", "/load"),
    ("POST", "/unload"), ("GET", "/running"), ("GET", "/logs"), ("GET", "/logs/qwen?tail=5"),
    ("GET", "/upstream/qwen/slots?fields=a"), ("DELETE", "/v1/files/abc"),
    ("POST", "/v1/messages/count_tokens"), ("GET", "/v1/responses/resp_1"),
])
def test_paths_forwarded_intact(proxy, chat, method, path):
    body = b'{"input": "a  b",   "raw": true}' if method != "GET" else b""
    r = requests.request(method, proxy + path, data=body or None,
                         headers={"X-Custom": "keep-me", "Content-Type": "application/json",
                                  "Connection": "keep-alive"})
    assert r.status_code == 200
    assert r.headers["X-Echo"] == "1"
    assert r.headers["X-Accel-Buffering"] == "no" and r.headers["Cache-Control"] == "no-cache"
    rec = chat.other[-1]
    p, _, q = path.partition("?")
    assert (rec["method"], rec["path"], rec["query"]) == (method, p, q)
    assert rec["body"].encode() == body, "body bytes unchanged"
    assert rec["headers"]["X-Custom"] == "keep-me"


def test_chat_body_untouched_when_nothing_to_change(make_proxy, chat):
    proxy = make_proxy(WEB_SEARCH=False, INJECT_SYSTEM=False)
    chat.script(Reply(content="x"))
    raw = b'{"model":"m",  "messages":[{"role":"user","content":"hi"}], "chat_template_kwargs": {"enable_thinking": false}}'
    r = requests.post(proxy + "/v1/chat/completions", data=raw,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    assert chat.requests[0]["chat_template_kwargs"] == {"enable_thinking": False}


def test_chat_template_kwargs_pass_through_with_search(proxy, chat):
    chat.script(Reply(content="x"))
    requests.post(proxy + "/v1/chat/completions", json={
        "messages": USER, "chat_template_kwargs": {"enable_thinking": True}})
    assert chat.requests[0]["chat_template_kwargs"] == {"enable_thinking": True}


def test_upstream_down_is_502_naming_it(searx):
    from proxy.settings import Settings
    from tests.support.proxyproc import inprocess
    dead = f"http://127.0.0.1:{free_port()}"
    with inprocess(Settings.from_env({}, BACKEND_URL=dead, SEARXNG_URL=searx.url)) as p:
        for path, kw in [("/v1/chat/completions", {"json": {"messages": USER}}),
                         ("/v1/chat/completions", {"json": {"messages": USER, "stream": True}}),
                         ("/v1/embeddings", {"json": {"input": "x"}}), ("/running", {})]:
            r = requests.post(p.url + path, **kw) if kw else requests.get(p.url + path)
            assert r.status_code == 502, path
            err = r.json()["error"]
            assert dead in err["message"] and "connection refused" in err["message"]
            assert err["type"] == "upstream_error"
        h = requests.get(p.url + "/healthz")
        assert h.status_code == 200 and h.json()["upstream"]["status"] == "unreachable"


def test_healthz_includes_upstream(proxy):
    r = requests.get(proxy + "/healthz")
    assert r.status_code == 200
    j = r.json()
    assert j["status"] == "ok" and j["upstream"]["status"] == "ok"
    assert j["upstream"]["body"] == {"status": "ok", "scripted": True}


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"model": "m"}', "'messages' is required"),
    (b'{"messages": "hi"}', "'messages' must be a list"),
    (b'{"messages": []}', "must not be empty"),
    (b'{"messages": ["hi"]}', "messages[0] must be an object"),
    (b'{"messages": [{"content": "hi"}]}', "messages[0].role must be a string"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "'stream' must be bool"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "'max_tokens' must be an integer"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": {}}', "'tools' must be list"),
])
def test_bad_input_400(proxy, chat, body, needle):
    r = requests.post(proxy + "/v1/chat/completions", data=body,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert chat.requests == []


def test_oversized_body_413(make_proxy, chat):
    proxy = make_proxy(MAX_BODY_BYTES=1000)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]})
    for path in ("/v1/chat/completions", "/v1/embeddings"):
        r = requests.post(proxy + path, data=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert "MAX_BODY_BYTES" in r.json()["error"]["message"]
    assert chat.requests == [] and chat.other == []


def test_api_key(make_proxy, chat):
    proxy = make_proxy(API_KEY="s3cret")
    for path in ("/v1/models", "/metrics", "/running", "/load/x"):
        r = requests.get(proxy + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert requests.get(proxy + path, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert requests.get(proxy + "/healthz").status_code == 200
    ok = requests.get(proxy + "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    chat.script(Reply(content="x"))
    r = requests.post(proxy + "/v1/chat/completions", json={"messages": USER},
                      headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200


def test_unknown_route_404_envelope(proxy):
    r = requests.get(proxy + "/nope")
    assert r.status_code == 404 and "error" in r.json()


# ------------------------------------------------------------------ normalisation

REGISTRY = [{"id": "qwen-coder", "object": "model", "owned_by": "coding-stack",
             "aliases": ["coder"], "kind": "llamacpp", "context_length": 32768, "slots": 2,
             "system_prompt": "You are a careful coding agent.", "max_tokens_floor": 4096}]
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("model", ["qwen-coder", "coder"])
def test_registry_system_prompt_and_floor(make_proxy, chat, model):
    chat.models = REGISTRY
    proxy = make_proxy(SYSTEM_PROMPT="fallback", TOOL_MAX_TOKENS_FLOOR=1000)
    chat.script(Reply(content="x"))
    requests.post(proxy + "/v1/chat/completions", json={
        "model": model, "messages": USER, "tools": TOOLS, "max_tokens": 100})
    got = chat.requests[0]
    assert got["messages"][0] == {"role": "system", "content": "You are a careful coding agent."}
    assert got["max_tokens"] == 4096


def test_fallback_prompt_floor_and_existing_system(make_proxy, chat):
    proxy = make_proxy(SYSTEM_PROMPT="fallback prompt", TOOL_MAX_TOKENS_FLOOR=1000)
    chat.script(Reply(content="x"), Reply(content="y"), Reply(content="z"))
    url = proxy + "/v1/chat/completions"
    requests.post(url, json={"model": "other", "messages": USER, "tools": TOOLS,
                             "max_completion_tokens": 10})
    requests.post(url, json={"messages": [{"role": "developer", "content": "mine"}] + USER,
                             "tools": TOOLS, "max_tokens": 5000})
    requests.post(url, json={"messages": USER, "max_tokens": 10, "tool_choice": "none"})
    a, b, c = chat.requests
    assert a["messages"][0]["content"] == "fallback prompt" and a["max_completion_tokens"] == 1000
    assert b["messages"][0]["content"] == "mine" and b["max_tokens"] == 5000
    assert "tools" not in c and c["max_tokens"] == 10, "no tools reach the backend: no floor"


SEED_REGISTRY = [{"id": "qwen-38-27b", "object": "model", "aliases": ["qwen36"],
                  "kind": "llamacpp", "max_tokens_floor": 512}]


@pytest.mark.parametrize("stream", [False, True])
def test_the_injected_web_search_never_raises_the_budget(make_proxy, chat, stream):
    """The client's budget is the client's: a title or probe call (a small max_tokens,
    no tools of its own: Continue's 16-token title) gets no web_search of ours and
    keeps its limit; a budget at the floor or above gets the tool and keeps its limit;
    the floor (the registry's, else TOOL_MAX_TOKENS_FLOOR) still raises a small limit
    when the client's own tools are there, web_search beside them. A small budget
    that names web_search in tool_choice asks for it."""
    chat.models = SEED_REGISTRY
    proxy = make_proxy(TOOL_MAX_TOKENS_FLOOR=1000)
    chat.script(*[Reply(content="x")] * 6)
    url = proxy + "/v1/chat/completions"
    for body in ({"model": "qwen36", "max_tokens": 16},
                 {"model": "other", "max_tokens": 16, "max_completion_tokens": 20000},
                 {"model": "other", "max_tokens": 1000},
                 {"model": "qwen36", "max_tokens": 16, "tools": TOOLS},
                 {"model": "other", "max_completion_tokens": 10, "tools": TOOLS},
                 {"model": "other", "max_tokens": 16, "tool_choice": {
                     "type": "function", "function": {"name": "web_search"}}}):
        r = requests.post(url, json={**body, "messages": USER, "stream": stream})
        assert r.status_code == 200 and r.content
    title, both, enough, seed, other, named = chat.requests
    assert "tools" not in title and title["max_tokens"] == 16, "no tool, the limit kept"
    assert "tools" not in both and (both["max_tokens"], both["max_completion_tokens"]) == \
        (16, 20000), "the smaller of its limits is the budget"
    assert [t["function"]["name"] for t in enough["tools"]] == ["web_search"]
    assert enough["max_tokens"] == 1000, "a budget at the floor: our tool, its limit"
    assert [t["function"]["name"] for t in seed["tools"]] == ["edit", "web_search"]
    assert seed["max_tokens"] == 512, "the client's own tools: the model's floor"
    assert other["max_completion_tokens"] == 1000, "TOOL_MAX_TOKENS_FLOOR without one"
    assert [t["function"]["name"] for t in named["tools"]] == ["web_search"]
    assert named["max_tokens"] == 16, "asked for by name: our tool, its budget"


CONTEXTS = [{"id": "vllm-model", "object": "model", "kind": "vllm", "context_length": 2048},
            {"id": "llama-model", "object": "model", "kind": "llamacpp",
             "context_length": 2048},
            {"id": "plain-vllm", "object": "model", "owned_by": "vllm", "max_model_len": 4096}]


def test_a_limit_above_a_vllm_context_is_clamped(make_proxy, chat):
    """vLLM refuses a max_tokens above its max_model_len with a 400 ("max_tokens=32000
    cannot be greater than max_model_len=2048", vLLM 0.32) and clamps a smaller one
    to what the prompt leaves; OpenCode and Qwen Code send 32000: the proxy
    lowers such a limit to the context the registry gives (or vLLM's own /v1/models
    max_model_len); llama-server, which stops at the context's end, gets it as sent."""
    chat.models = CONTEXTS
    proxy = make_proxy(WEB_SEARCH=False)
    chat.script(*[Reply(content="x")] * 4)
    url = proxy + "/v1/chat/completions"
    for model, limits in (("vllm-model", {"max_tokens": 32000, "max_completion_tokens": 32768}),
                          ("vllm-model", {"max_tokens": 2000}),
                          ("llama-model", {"max_tokens": 32000}),
                          ("plain-vllm", {"max_completion_tokens": 32768})):
        r = requests.post(url, json={"model": model, "messages": USER, **limits})
        assert r.status_code == 200
    clamped, under, llama, plain = chat.requests
    assert (clamped["max_tokens"], clamped["max_completion_tokens"]) == (2048, 2048)
    assert under["max_tokens"] == 2000
    assert llama["max_tokens"] == 32000
    assert plain["max_completion_tokens"] == 4096


def test_models_unreachable_does_not_fail_chat(make_proxy, chat):
    chat.models = "broken"   # /v1/models answers nonsense
    proxy = make_proxy(SYSTEM_PROMPT="sp")
    chat.script(Reply(content="x"))
    r = requests.post(proxy + "/v1/chat/completions", json={"model": "m", "messages": USER})
    assert r.status_code == 200
    assert chat.requests[0]["messages"][0]["content"] == "sp"


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_both_names_without_search(make_proxy, chat, key):
    proxy = make_proxy(WEB_SEARCH=False)
    chat.script(Reply(reasoning="think", reasoning_key=key, content="a"),
                Reply(reasoning="think", reasoning_key=key, content="a"))
    r = requests.post(proxy + "/v1/chat/completions", json={"messages": USER})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "think"
    from tests.support.sseclient import read_stream
    s = read_stream(requests.post(proxy + "/v1/chat/completions",
                                  json={"messages": USER, "stream": True}, stream=True))
    assert s.text("reasoning") == s.text("reasoning_content") == "think"
    assert s.text() == "a" and s.done == 1


def test_n_and_a_missing_model_are_left_to_the_upstream(make_proxy, chat):
    """One checker per rule: the swapper owns `n`'s range (its MAX_N, its
    fan-out) and which model answers a request naming none; the proxy passes
    both through as the client sent them."""
    proxy = make_proxy()
    chat.script(Reply("x"))
    r = requests.post(proxy + "/v1/chat/completions", json={"messages": USER, "n": 3,
                                                           "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert chat.requests[-1]["n"] == 3 and "model" not in chat.requests[-1]


def test_a_request_the_upstream_closed_on_is_sent_again(make_proxy, chat):
    """The proxy's own hop: a kept-alive connection the upstream had closed
    (llama-server after a stream, gunicorn's keep-alive) reaches no one; the
    request goes again on a fresh connection instead of failing with 502."""
    from tests.support.servers import Relay
    drop = Relay(chat.url, drop_first=True)
    proxy = make_proxy(BACKEND_URL=drop.url, WEB_SEARCH=False)
    chat.script(Reply(content="answered"))
    r = requests.post(proxy + "/v1/chat/completions", json={"messages": USER}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "answered"
    assert drop.dropped == 1 and len(chat.requests) == 1


def test_the_proxys_api_key_is_not_sent_upstream(make_proxy, chat):
    proxy = make_proxy(API_KEY="s3cret")
    r = requests.get(proxy + "/v1/anything", timeout=30,
                     headers={"Authorization": "Bearer s3cret", "X-Other": "kept"})
    assert r.status_code == 200, r.text
    sent = {k.lower(): v for k, v in chat.other[-1]["headers"].items()}
    assert "authorization" not in sent and sent["x-other"] == "kept"
