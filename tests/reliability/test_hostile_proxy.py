"""Hostile input against the real proxy (`python -m proxy`: gunicorn + gevent) in
front of a scripted OpenAI backend that records what reaches it.

Each test of a named defect fails on the code before its fix; the hypothesis
tests then sweep every public route with hostile methods, paths, Content-Types
and bodies: never a 5xx from our code, every error in the envelope."""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.search.searxng import SearxngClient
from tests.support import hostile
from tests.support.chat import Reply, ScriptedChat, search
from tests.support.proxyproc import ProxyProcess
from tests.support.rawhttp import send
from tests.support.searxng import FakeSearxng
from tests.support.servers import Scripted

LIMIT = 65536          # the proxy's MAX_BODY_BYTES here
BODY_TIMEOUT = 3.0     # its BODY_TIMEOUT


@pytest.fixture(scope="module")
def backend():
    with ScriptedChat() as chat:
        yield chat


@pytest.fixture(scope="module")
def searx():
    with FakeSearxng() as s:
        yield s


@pytest.fixture(scope="module")
def proxy(backend, searx):
    with ProxyProcess(BACKEND_URL=backend.url, SEARXNG_URL=searx.url, MAX_BODY_BYTES=LIMIT,
                      MODELS_TTL=60, SYSTEM_PROMPT="", LOG_LEVEL="warning",
                      BODY_TIMEOUT=BODY_TIMEOUT) as p:
        yield p


@pytest.fixture(autouse=True)
def _answers(backend):
    """The backend always has an answer ready, so any 5xx seen is ours."""
    backend.script(*[Reply(content="ok") for _ in range(500)])
    backend.other.clear()


def post(proxy, path, body: bytes, ctype="application/json", **kw):
    return send(proxy.url, "POST", path, {"Content-Type": ctype} if ctype else {}, body, **kw)


def chat_body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


# ------------------------------------------------------------------- item 7

@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "ok \\udfff"}], "stream": true}',
    b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
    b'"text": "\\ud83d"}]}]}',
], ids=["content", "stream", "text-part"])
def test_lone_surrogate_is_a_400(proxy, backend, body):
    ans = post(proxy, "/v1/chat/completions", body)
    assert ans.status == 400, ans.body
    assert "surrogate" in ans.envelope["message"]
    assert backend.requests == []


def test_a_valid_surrogate_pair_passes(proxy, backend):
    ans = post(proxy, "/v1/chat/completions",
               b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert ans.status == 200, ans.body
    assert backend.requests[-1]["messages"][-1]["content"] == "\U0001F600"


@pytest.mark.parametrize("depth", [1000, 30_000])
def test_deeply_nested_json_is_a_400(proxy, backend, depth):
    body = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": '
            + hostile.deep(depth) + "}").encode()
    ans = post(proxy, "/v1/chat/completions", body)
    assert ans.status == 400, ans.body
    assert "deeper" in ans.envelope["message"] or "deeply" in ans.envelope["message"]
    assert backend.requests == []


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("body", [hostile.deep(1000).encode(),
                                  b'{"model": "m", "input": "\\ud800", "messages": []}'],
                         ids=["deep", "surrogate"])
def test_dialect_routes_parse_as_strictly(proxy, backend, path, body):
    """The Anthropic and Responses routes use the same strict parser as chat
    (a deep body was a RecursionError 500 there)."""
    ans = post(proxy, path, body)
    assert ans.status == 400, ans.body
    err = ans.anthropic_error if path == "/v1/messages" else ans.envelope
    assert err is not None and ("deeper" in err["message"] or "surrogate" in err["message"])
    assert backend.requests == []


def test_nesting_that_tool_schemas_need_passes(proxy, backend):
    schema: dict = {"type": "string"}
    for _ in range(30):
        schema = {"type": "object", "properties": {"x": schema}}
    body = chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    ans = post(proxy, "/v1/chat/completions", json.dumps(body).encode())
    assert ans.status == 200, ans.body


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": []}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].type"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f",
                                                                   "arguments": {"a": 1}}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
      "tool_calls": "f()"}]}, "messages[1].tool_calls"),
    ({"tools": [{"function": {"name": "f", "parameters": {}}}]}, "tools[0].type"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": 3}, "stop"),
    ({"n": 0}, "n"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_input_a_backend_fails_on_is_refused_with_400(proxy, backend, fields, param):
    ans = post(proxy, "/v1/chat/completions", json.dumps(chat_body(**fields)).encode())
    assert ans.status == 400, ans.body
    assert ans.envelope["param"] == param, ans.envelope
    assert backend.requests == []


def test_well_formed_parts_tools_and_tool_calls_pass(proxy, backend):
    body = chat_body(messages=[
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:,x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        temperature=0, stop=["\n"])
    ans = post(proxy, "/v1/chat/completions", json.dumps(body).encode())
    assert ans.status == 200, ans.body
    assert backend.requests[-1]["messages"][1]["tool_calls"][0]["type"] == "function"


# ------------------------------------------------------------------- item 8

@pytest.mark.parametrize("method, target", [
    ("POST", "/upstream/m/../../unload"),
    ("GET", "/logs/m/../../running"),
    ("POST", "/upstream/m/%2e%2e/%2e%2e/unload"),
    ("POST", "/upstream/m/%2E%2E/%2e./unload"),
    ("POST", "/upstream/m%2f..%2f..%2funload"),
    ("GET", "/v1/../running"),
    ("GET", "/v1/%2e%2e/running"),
    ("GET", "/logs/m/..%5c..%5crunning"),
    ("GET", "/upstream/m/%252e%252e/running"),
    ("GET", "/logs/./m"),
    ("GET", "/upstream/m/a%00b"),
])
def test_dot_segments_never_reach_another_route(proxy, backend, method, target):
    ans = send(proxy.url, method, target)
    assert ans.status == 400, (ans.status, ans.body)
    assert ans.envelope["code"] == "invalid_path"
    assert backend.other == [], "the request reached the backend"


def test_an_absolute_form_target_is_checked_too(proxy, backend):
    # example.com is not a name of this proxy (issue 28: its authority stands for Host)
    ans = send(proxy.url, "POST", "http://example.com/upstream/m/..%2f..%2funload")
    assert ans.status == 421, ans.body
    ans = send(proxy.url, "POST", proxy.url + "/upstream/m/..%2f..%2funload")
    assert ans.status == 400, ans.body
    assert backend.other == []


def test_an_absolute_form_target_is_not_mangled(proxy, backend):
    """Issue 28: the slash collapse made `http://host//x` into `http:/host/x`."""
    ans = send(proxy.url, "GET", proxy.url + "//upstream//m//props")
    assert ans.status == 200, ans.body
    assert backend.other[-1]["path"] == "/upstream/m/props"


@pytest.mark.parametrize("target", ["/upstream/m/props", "/upstream/qwen3.8-27b/v1/models",
                                    "/logs/m?tail=5", "/upstream/m/a..b/c.d"])
def test_ordinary_paths_still_pass(proxy, backend, target):
    ans = send(proxy.url, "GET", target)
    assert ans.status == 200, ans.body
    assert backend.other[-1]["path"] == target.partition("?")[0]


# ------------------------------------------------------------------- item 9

def test_a_request_line_too_long_is_a_414_envelope(proxy):
    ans = send(proxy.url, "GET", "/v1/models?q=" + "x" * 10_000)
    assert ans.status == 414
    assert ans.envelope["code"] == "request_line_too_long"
    assert ans.headers["content-type"] == "application/json"


@pytest.mark.parametrize("method, target, headers", [
    ("G(T", "/v1/models", {}),                       # not a method
    ("GET", "/v1/models", {"Bad Name": "x"}),        # not a header name
    ("POST", "/v1/models", {"Transfer-Encoding": "gzip, chunked, x"}),
], ids=["method", "header-name", "transfer-coding"])
def test_requests_gunicorn_refuses_are_answered_in_the_envelope(proxy, method, target, headers):
    ans = send(proxy.url, method, target, headers)
    assert 400 <= ans.status < 500 or ans.status == 501, ans.status
    assert ans.envelope is not None, ans.body
    assert ans.headers["content-type"] == "application/json"


def test_a_declared_length_over_the_limit_is_a_413_before_the_body(proxy, backend):
    ans = send(proxy.url, "POST", "/v1/chat/completions",
               {"Content-Type": "application/json", "Content-Length": str(10**12)})
    assert ans.status == 413, ans.body
    assert ans.envelope["code"] == "body_too_large"
    assert backend.requests == []


@pytest.mark.parametrize("headers", [{"X-Big": "x" * 20_000},
                                     {f"X-H{i}": "1" for i in range(200)}],
                         ids=["one-huge", "too-many"])
def test_headers_too_large_are_a_431_envelope(proxy, headers):
    ans = send(proxy.url, "GET", "/v1/models", headers)
    assert ans.status == 431
    assert ans.envelope["code"] == "headers_too_large"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/load"])
def test_a_chunked_body_over_the_limit_is_a_413(proxy, backend, path):
    body = json.dumps(chat_body(pad="x" * (LIMIT + 1000))).encode()
    chunks = [body[i:i + 8192] for i in range(0, len(body), 8192)]
    ans = send(proxy.url, "POST", path, {"Content-Type": "application/json"}, chunks=chunks)
    assert ans.status == 413, (ans.status, ans.body[:300])
    assert ans.envelope["code"] == "body_too_large"
    assert backend.requests == [] and backend.other == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings"])
def test_a_chunked_body_under_the_limit_is_served_whole(proxy, backend, path):
    body = json.dumps(chat_body(pad="y" * (LIMIT // 2))).encode()
    chunks = [body[i:i + 8192] for i in range(0, len(body), 8192)]
    ans = send(proxy.url, "POST", path, {"Content-Type": "application/json"}, chunks=chunks)
    assert ans.status == 200, ans.body[:300]
    got = backend.requests[-1] if path.endswith("completions") else \
        json.loads(backend.other[-1]["body"])
    assert got["pad"] == "y" * (LIMIT // 2)


class TricklingSearxng:
    """Answers 200 with a valid SearXNG JSON body, one byte every `gap` seconds."""

    BODY = b'{"results": [], "answers": ["forty-two"]}'

    def __init__(self, gap: float = 0.2):
        self.gap = gap
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(self.BODY))
                for i in range(len(self.BODY)):
                    if self.stop.is_set():
                        return
                    conn.sendall(self.BODY[i:i + 1])
                    time.sleep(self.gap)
            except OSError:
                return              # the client hung up: what a deadline does

    def close(self):
        self.stop.set()
        self.sock.close()


def test_searxng_timeout_bounds_the_whole_search():
    """The server sends a byte well within every per-read timeout, but the
    whole answer takes ~8 s: with SEARXNG_TIMEOUT=1 the search is a timeout."""
    srv = TricklingSearxng(gap=0.2)
    try:
        out = SearxngClient(srv.url, timeout=1.0).search("q")
    finally:
        srv.close()
    assert not out.ok and out.kind == "timeout", out


def test_the_deadline_holds_in_the_served_proxy():
    """The same through `python -m proxy` (gevent): the model is told the search
    timed out instead of getting results after the trickle ends."""
    srv = TricklingSearxng(gap=0.2)
    try:
        with ScriptedChat([Reply(tool_calls=[search("q")]), Reply(content="done")]) as chat, \
                ProxyProcess(BACKEND_URL=chat.url, SEARXNG_URL=srv.url, SEARXNG_TIMEOUT=1,
                             SYSTEM_PROMPT="", LOG_LEVEL="warning") as p:
            ans = send(p.url, "POST", "/v1/chat/completions",
                       {"Content-Type": "application/json"},
                       json.dumps(chat_body()).encode(), timeout=60)
            assert ans.status == 200, ans.body
            tool_msgs = [m for m in chat.requests[-1]["messages"] if m["role"] == "tool"]
    finally:
        srv.close()
    assert tool_msgs and "within 1 s" in tool_msgs[0]["content"], tool_msgs
    assert "forty-two" not in tool_msgs[0]["content"]


def test_a_search_within_its_timeout_still_succeeds():
    srv = TricklingSearxng(gap=0.0)
    try:
        out = SearxngClient(srv.url, timeout=10.0).search("q")
    finally:
        srv.close()
    assert out.ok and out.answers == ["forty-two"], out


def _searxng_answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def test_a_connection_dropped_before_the_answer_is_tried_once_more():
    """SearXNG hangs up on the first connection without answering (a pooled
    keep-alive connection it closed, a restart): the search is the second
    connection's answer, not "unreachable"."""
    srv = Scripted(None, _searxng_answer(b'{"answers": ["forty-two"]}'))
    try:
        out = SearxngClient(srv.url, timeout=10.0).search("q")
    finally:
        srv.close()
    assert out.ok and out.answers == ["forty-two"], out
    assert srv.connections == 2


def test_a_searxng_that_keeps_hanging_up_is_unreachable_after_one_retry():
    srv = Scripted(None, None, None, _searxng_answer(b'{"answers": ["late"]}'))
    try:
        out = SearxngClient(srv.url, timeout=10.0).search("q")
    finally:
        srv.close()
    assert not out.ok and out.kind == "unreachable", out
    assert srv.connections == 2


# ------------------------------------------------------------------- properties

PROXY_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
                "/v1/models/m", "/v1/responses", "/v1/messages", "/v1/nope", "/load", "/load/m",
                "/unload", "/running", "/healthz", "/metrics", "/upstream/m/props",
                "/upstream/m", "/logs", "/logs/m", "/", "/nope"]


@settings(max_examples=120)
@given(method=st.sampled_from(hostile.METHODS), path=st.sampled_from(PROXY_ROUTES),
       ctype=st.sampled_from(hostile.CONTENT_TYPES),
       body=hostile.raw_bodies(hostile.chat_bodies(st.just("m"))))
def test_every_route_survives_any_request(proxy, method, path, ctype, body):
    ans = send(proxy.url, method, path, {"Content-Type": ctype} if ctype else {}, body)
    hostile.check(ans, f"{method} {path} ({ctype}) {body[:80]!r}", dialects=True)


@settings(max_examples=150)
@given(body=hostile.chat_bodies(st.one_of(st.just("m"), hostile.json_values)),
       stream=st.booleans())
def test_chat_survives_any_body(proxy, body, stream):
    if stream:
        body["stream"] = True
    ans = post(proxy, "/v1/chat/completions", hostile.dumps(body))
    hostile.check(ans, f"POST /v1/chat/completions {body!r}"[:400])
    assert ans.status in (200, 400), (ans.status, ans.body[:300])


SEGMENTS = ["..", ".", "%2e%2e", "%2E.", ".%2e", "%2f", "a%2Fb", "%5c", "%00", "%252e%252e",
            "x", "m", "unload", "running", "load", "v1", "upstream", "logs", "", "a..b", "~"]


@settings(max_examples=120)
@given(prefix=st.sampled_from(["/upstream/m", "/logs/m", "/v1", "/load", "/logs", ""]),
       segs=st.lists(st.sampled_from(SEGMENTS), max_size=5),
       method=st.sampled_from(["GET", "POST"]))
def test_no_path_trick_reaches_a_route_it_does_not_name(proxy, backend, prefix, segs, method):
    target = prefix + "/" + "/".join(segs)
    before = len(backend.other)
    ans = send(proxy.url, method, target, {"Content-Type": "application/json"}, b"{}")
    hostile.check(ans, f"{method} {target}", dialects=True)
    sent = re.sub("/+", "/", target)          # runs of slashes are collapsed, nothing else
    for rec in backend.other[before:]:
        # What reached the backend is the path as sent: nothing was resolved away.
        assert rec["path"] in (sent, sent.rstrip("/")), (target, rec["path"])


# ------------------------------------------------------------------- issue 28: the door

BROWSERS = st.sampled_from([
    {"Origin": "https://evil.example"}, {"Origin": "null"},
    {"Origin": "http://localhost:3000"}, {"Origin": "http://127.0.0.1:1"},
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"},
    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate"},
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors",
     "Origin": "https://evil.example"},
])
REBOUND = st.sampled_from(["evil.example", "evil.example:11433", "rebind.test:1",
                           "localhost.evil.example", "127.0.0.1.nip.io", "swapper:9000"])


def no_cors(ans, what):
    assert not any(k.startswith("access-control-") for k in ans.headers), (what, ans.headers)


@settings(max_examples=120)
@given(method=st.sampled_from(hostile.METHODS), path=st.sampled_from(PROXY_ROUTES),
       ctype=st.sampled_from(hostile.CONTENT_TYPES), browser=BROWSERS,
       body=st.one_of(st.none(), hostile.raw_bodies(hostile.chat_bodies(st.just("m")))))
def test_no_other_origin_reaches_any_route(proxy, backend, method, path, ctype, browser,
                                           body):
    before = len(backend.other), len(backend.requests)
    headers = {**browser, **({"Content-Type": ctype} if ctype else {})}
    ans = send(proxy.url, method, path, headers, body)
    what = f"{method} {path} {browser} ({ctype})"
    hostile.check(ans, what, dialects=True)
    assert ans.status == 403, (what, ans.status, ans.body[:200])
    no_cors(ans, what)
    assert (len(backend.other), len(backend.requests)) == before, f"{what} reached the backend"


@settings(max_examples=80)
@given(method=st.sampled_from(hostile.METHODS), path=st.sampled_from(PROXY_ROUTES + ["/ui"]),
       host=REBOUND, same=st.booleans())
def test_no_rebound_name_reaches_any_route(proxy, backend, method, path, host, same):
    """A DNS-rebinding page: its own name, its own origin (so same-origin to the browser)."""
    before = len(backend.other), len(backend.requests)
    headers = {"Host": host, **({"Origin": f"http://{host}"} if same else {})}
    ans = send(proxy.url, method, path, headers, b"{}" if method == "POST" else None)
    hostile.check(ans, f"{method} {path} Host {host}", dialects=True)
    assert ans.status == 421, (host, ans.status)
    no_cors(ans, host)
    assert (len(backend.other), len(backend.requests)) == before


@settings(max_examples=60)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages",
                             "/v1/responses", "/load", "/v1/embeddings"]),
       ctype=st.sampled_from([None, "text/plain", "text/plain; charset=utf-8",
                              "application/x-www-form-urlencoded",
                              "multipart/form-data; boundary=x"]),
       site=st.sampled_from([{"Origin": None}, {"Sec-Fetch-Site": "same-origin"},
                             {"Sec-Fetch-Site": "same-origin", "Origin": None}]))
def test_a_browsers_simple_body_is_never_taken_for_json(proxy, backend, path, ctype, site):
    """The same origin too (a rebinding page that got past Host would be one)."""
    origin = proxy.url
    headers = {k: (origin if v is None else v) for k, v in site.items()}
    if ctype:
        headers["Content-Type"] = ctype
    before = len(backend.other), len(backend.requests)
    ans = send(proxy.url, "POST", path, headers, hostile.dumps(chat_body()))
    hostile.check(ans, f"POST {path} {headers}", dialects=True)
    assert ans.status == 415, (path, headers, ans.status)
    assert (len(backend.other), len(backend.requests)) == before


@settings(max_examples=40)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models"]),
       ctype=st.sampled_from(["application/json", "application/x-www-form-urlencoded", None]),
       host=st.sampled_from(["localhost", "127.0.0.1", "[::1]", "api.localhost"]))
def test_curl_sdks_and_agents_pass_unchanged(proxy, backend, path, ctype, host):
    """No Origin, no Sec-Fetch-*: curl -d (a form type), SDKs, agents."""
    port = proxy.url.rsplit(":", 1)[1]
    headers = {"Host": f"{host}:{port}", **({"Content-Type": ctype} if ctype else {})}
    method = "GET" if path == "/v1/models" else "POST"
    ans = send(proxy.url, method, path, headers, hostile.dumps(chat_body(max_tokens=3))
               if method == "POST" else None)
    assert ans.status == 200, (path, ctype, host, ans.status, ans.body[:200])
    no_cors(ans, path)


def test_a_text_plain_chat_from_another_origin_reads_nothing(proxy, backend):
    """The issue's curl: `-H 'Origin: https://evil.example' -H 'Content-Type:
    text/plain'` answered with Access-Control-Allow-Origin and the answer."""
    ans = send(proxy.url, "POST", "/v1/chat/completions",
               {"Origin": "https://evil.example", "Content-Type": "text/plain"},
               hostile.dumps(chat_body(max_tokens=3)))
    assert ans.status == 403 and ans.envelope["code"] == "cross_origin_refused"
    assert "access-control-allow-origin" not in ans.headers
    assert b"ok" not in ans.body


# ------------------------------------------------------------------- issue 28: bodies

def trickler(url: str, length: int, path: str = "/v1/chat/completions") -> socket.socket:
    host, port = url.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
              f"application/json\r\nContent-Length: {length}\r\n\r\n{{".encode())
    return s


@pytest.mark.parametrize("length, status", [(1000, b"408"), (LIMIT + 1, b"413")])
def test_a_thousand_trickling_bodies_do_not_lock_new_clients_out(proxy, backend, length,
                                                                  status):
    """1,000 bodies at a byte every 20 s held all of gunicorn's 1,000 connections for as
    long as they trickled; now each is cut at BODY_TIMEOUT (408, closed). A body refused
    before it was read (413 on its declared length; 401 and 403 alike) closes its
    connection at once: gunicorn drained the rest with no deadline."""
    socks = []
    try:
        for _ in range(1000):
            socks.append(trickler(proxy.url, length))
        time.sleep(0.5)
        for s in socks[:50]:
            s.sendall(b" ")                          # still trickling
        t0 = time.monotonic()
        ans = send(proxy.url, "GET", "/v1/models", timeout=BODY_TIMEOUT + 20)
        waited = time.monotonic() - t0
        assert ans.status == 200
        assert waited < BODY_TIMEOUT + 10, waited
        # each trickler got its 408 and its connection was closed
        s = socks[0]
        s.settimeout(10)
        got = b""
        while True:
            piece = s.recv(65536)
            if not piece:
                break
            got += piece
        assert got.startswith(b"HTTP/1.1 " + status), got[:100]
    finally:
        for s in socks:
            s.close()


def test_long_model_names_are_cut_in_the_activity_list(proxy, backend):
    """Issue 28: the activity list kept each request's `model` whole (60 requests with
    10 MB names: the worker grew from 42 to 528 MB, /ui/activity was 500 MB of JSON).
    Here 200 names of 60 KB (the limit of this proxy's bodies): each record keeps 100
    characters, the list stays small."""
    name = "m" * 60_000
    for _ in range(200):
        ans = post(proxy, "/v1/chat/completions", hostile.dumps(chat_body(model=name)))
        assert ans.status == 200, ans.body[:200]
    listed = send(proxy.url, "GET", "/ui/activity")
    assert listed.status == 200
    models = [r.get("model") for r in listed.json()["data"]]
    assert len(models) == 200 and all(m is None or len(m) <= 100 for m in models), \
        max(len(m or "") for m in models)
    assert len(listed.body) < 200 * 1024, len(listed.body)


class Holding:
    """A backend that never answers: it records when the proxy hangs up on it."""

    def __init__(self):
        from tests.support.servers import RawServer

        holder = self

        class Srv(RawServer):
            def answer(self, conn, head, body):
                if not head.startswith(b"POST"):            # the proxy's /v1/models
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 11\r\n\r\n{\"data\":[]}")
                    return True
                holder.asked.append(time.monotonic())
                conn.settimeout(30)
                try:
                    holder.cut.append((time.monotonic(), conn.recv(1)))
                except OSError as e:
                    holder.cut.append((time.monotonic(), e))
                return False
        self.asked: list[float] = []
        self.cut: list = []
        self.srv = Srv()
        self.url = self.srv.url


@pytest.fixture(scope="module")
def holding():
    """A proxy in front of a backend that never answers (Holding)."""
    held = Holding()
    with ProxyProcess(BACKEND_URL=held.url, WEB_SEARCH=0, MODELS_TTL=0,
                      LOG_LEVEL="warning") as p:
        yield p, held
    held.srv.close()


@pytest.mark.parametrize("stray", [b"", b"\r\n"])
def test_a_client_that_hangs_up_after_a_stray_crlf_is_seen_leaving(holding, stray):
    """Issue 28: a client that sent its request, then an empty line (RFC 9112 lets
    clients send one between requests), then hung up was never seen leaving: the
    one byte peeked was the CR, so the generation ran to its end."""
    p, held = holding
    held.asked.clear()
    held.cut.clear()
    host, port = p.url.rsplit("/", 1)[1].split(":")
    body = json.dumps(chat_body()).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
              .encode() + body)
    deadline = time.monotonic() + 10
    while not held.asked and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held.asked, "the request never reached the backend"
    if stray:
        s.sendall(stray)            # after the request was read: in the socket's buffer
        time.sleep(0.2)
    s.close()
    while not held.cut and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert held.cut, "the proxy never hung up on the backend"
    assert held.cut[0][1] == b"", held.cut
    assert held.cut[0][0] - held.asked[0] < 5, held.cut


def test_expect_100_continue_is_answered_here_and_never_sent_on(proxy, backend):
    """Issue 28: `Expect: 100-continue` was forwarded: the next hop was asked for a
    handshake the proxy had already done (gunicorn answers it) on a body sent whole."""
    ans = send(proxy.url, "POST", "/v1/embeddings", {"Content-Type": "application/json",
                                                     "Expect": "100-continue"},
               hostile.dumps({"model": "m", "input": "x"}))
    assert ans.status == 200, ans.body[:200]
    got = {k.lower(): v for k, v in backend.other[-1]["headers"].items()}
    assert "expect" not in got and got["content-type"] == "application/json"
