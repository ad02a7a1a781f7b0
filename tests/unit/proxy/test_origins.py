"""Issue 28, the door (common.origins and the proxy's key check), in-process:
no web page on another origin, and no DNS-rebinding name, reaches a route; the
backend's CORS fields never reach a client; curl, SDKs and agents (no Origin)
pass as before. The upstream is a scripted server that answers as llama-server
does (Access-Control-Allow-Origin copied from the request, credentials allowed)
and records what it got: a refused request never reaches it."""
from __future__ import annotations

import io
import json

import pytest

from common import guard
from common.origins import OriginGuard, host_name
from proxy.app import create_app
from proxy.settings import Settings
from tests.support.servers import Scripted

CHAT = json.dumps({"model": "m", "max_tokens": 3,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
EVIL = "https://evil.example"
# As llama-server answers a request with an Origin: its Origin copied back, credentials on.
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
          b"Access-Control-Allow-Origin: https://evil.example\r\n"
          b"Access-Control-Allow-Credentials: true\r\n"
          b"Access-Control-Expose-Headers: *\r\nContent-Length: 2\r\n\r\n{}")


@pytest.fixture
def upstream():
    srv = Scripted(*[ANSWER] * 20)
    yield srv
    srv.close()


def client(upstream, **kw):
    return create_app(Settings.from_env({}, BACKEND_URL=upstream.url, WEB_SEARCH=False,
                                        MODELS_TTL=0, **kw)).test_client()


def envelope(r, status, code):
    assert r.status_code == status, r.data
    err = r.get_json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    return err["message"]


# --------------------------------------------------------------------- Origin

ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("GET", "/v1/models"), ("POST", "/load/m"), ("POST", "/unload"),
          ("GET", "/load/m"), ("GET", "/unload"), ("POST", "/models/load"),
          ("GET", "/upstream/m/slots"), ("POST", "/upstream/m/slots/0?action=save"),
          ("OPTIONS", "/upstream/m/props"), ("HEAD", "/upstream/m/health"),
          ("GET", "/running"), ("GET", "/events"), ("GET", "/logs"), ("GET", "/healthz"),
          ("GET", "/metrics"), ("GET", "/ui/activity"), ("POST", "/v1/messages"),
          ("GET", "/")]


@pytest.mark.parametrize("method, path", ROUTES)
@pytest.mark.parametrize("headers", [
    {"Origin": EVIL},
    {"Origin": "null"},
    {"Origin": "http://localhost:3000"},                   # another port: another origin
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},    # an <img>, a GET link
    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"},     # localhost:3000's page
], ids=["foreign", "null", "other-port", "cross-site", "same-site"])
def test_another_origin_reaches_no_route(upstream, method, path, headers):
    c = client(upstream)
    r = c.open(path, method=method, data=CHAT if method == "POST" else None,
               headers={**headers, "Content-Type": "application/json"})
    if method == "HEAD":
        assert r.status_code == 403 and r.data == b""
    elif path == "/v1/messages":                   # Claude Code reads Anthropic's shape
        assert r.status_code == 403
        body = r.get_json()
        assert body["type"] == "error" and body["error"]["type"] == "permission_error"
        assert "another origin" in body["error"]["message"]
    else:
        assert "another origin" in envelope(r, 403, "cross_origin_refused")
    assert not any(k.lower().startswith("access-control-") for k in r.headers.keys())
    assert upstream.heads == []                   # nothing went on: no load, no answer read


def test_with_a_key_too_the_origin_is_refused_first(upstream):
    c = client(upstream, API_KEY="k")
    r = c.post("/v1/chat/completions", data=CHAT, headers={
        "Origin": EVIL, "Authorization": "Bearer k", "Content-Type": "application/json"})
    envelope(r, 403, "cross_origin_refused")
    assert upstream.heads == []


@pytest.mark.parametrize("path", ["/ui", "/ui/", "/ui/static/console.js",
                                  "/ui/static/console.css"])
def test_the_consoles_page_and_assets_are_anyones(upstream, path):
    """They hold no data (and the page may not be framed: frame-ancestors 'none')."""
    r = client(upstream).get(path, headers={"Origin": EVIL, "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 200
    # ... but only them, and only to read
    assert client(upstream).post(path, headers={"Origin": EVIL}).status_code == 403


def test_no_origin_is_curl_and_passes_unchanged(upstream):
    """curl's -d (a form type), an SDK, an agent: no Origin, no Sec-Fetch-*."""
    c = client(upstream)
    r = c.post("/v1/completions", data=CHAT,
               headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    assert len(upstream.heads) == 1


def test_the_same_origin_passes_and_the_backends_cors_fields_never_reach_anyone(upstream):
    c = client(upstream)
    for headers in ({}, {"Origin": "http://localhost"}, {"Sec-Fetch-Site": "same-origin"},
                    {"Sec-Fetch-Site": "none"}):
        r = c.post("/v1/completions", data=CHAT,
                   headers={**headers, "Content-Type": "application/json"})
        assert r.status_code == 200, (headers, r.data)
        assert [k for k in r.headers.keys() if k.lower().startswith("access-control")] == []
    # and the browser's fields were not sent on (a backend would answer them with CORS)
    for head in upstream.heads:
        assert b"\r\norigin:" not in head.lower() and b"sec-fetch" not in head.lower()


def test_same_origin_is_by_host_and_port(upstream):
    c = client(upstream)
    ok = {"Host": "127.0.0.1:11433", "Origin": "http://127.0.0.1:11433"}
    assert c.get("/v1/models", headers=ok).status_code == 200
    tls = {"Host": "localhost", "Origin": "https://localhost"}     # a TLS front end
    assert c.get("/v1/models", headers=tls).status_code == 200
    for origin in ("http://127.0.0.1:11434", "http://localhost:11433", "http://127.0.0.1",
                   "http://127.0.0.1:11433/x", "file://", "chrome-extension://abc"):
        r = c.get("/v1/models", headers={"Host": "127.0.0.1:11433", "Origin": origin})
        assert r.status_code == 403, origin


# ------------------------------------------------------------------ CORS_ORIGINS

def test_an_allowlisted_origin_gets_the_proxys_own_cors(upstream):
    app = "https://app.example"
    c = client(upstream, CORS_ORIGINS=f"{app}, https://other.example")
    r = c.post("/v1/completions", data=CHAT,
               headers={"Origin": app, "Content-Type": "application/json"})
    assert r.status_code == 200
    assert r.headers.getlist("Access-Control-Allow-Origin") == [app]
    assert "Access-Control-Allow-Credentials" not in r.headers
    assert "Access-Control-Expose-Headers" not in r.headers        # the backend's, dropped
    assert "Origin" in r.headers.get("Vary", "")
    # its preflight is answered by the proxy: never routed, never forwarded
    pre = c.options("/upstream/m/props", headers={
        "Origin": app, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert pre.status_code == 204
    assert pre.headers["Access-Control-Allow-Origin"] == app
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"]
    assert len(upstream.heads) == 1
    assert c.post("/v1/completions", data=CHAT, headers={
        "Origin": EVIL, "Content-Type": "application/json"}).status_code == 403


# --------------------------------------------------------------------- Host

@pytest.mark.parametrize("host", ["localhost", "localhost:11433", "127.0.0.1:11433",
                                  "[::1]:11433", "10.1.2.3", "console.localhost:8080",
                                  "LOCALHOST.:11433"])
def test_loopback_names_and_addresses_are_answered(upstream, host):
    assert client(upstream).get("/v1/models", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example:11433", "rebind.attacker.test",
                                  "127.0.0.1.nip.io:11433", "localhost.evil.example",
                                  "swapper:9000", "a@localhost", "localhost:x"])
def test_any_other_name_is_a_421(upstream, host):
    """A DNS-rebinding page: its own name, resolved to 127.0.0.1, under its own origin."""
    c = client(upstream)
    for method, path in (("GET", "/v1/models"), ("POST", "/load/m"), ("GET", "/ui"),
                         ("GET", "/healthz"), ("POST", "/v1/chat/completions")):
        r = c.open(path, method=method, headers={"Host": host, "Origin": f"http://{host}"},
                   data=CHAT if method == "POST" else None)
        envelope(r, 421, "misdirected_request")
    assert upstream.heads == []


def test_allowed_hosts_adds_names(upstream):
    c = client(upstream, ALLOWED_HOSTS="gpu1, stack.example.")
    for host in ("gpu1:11433", "GPU1", "stack.example"):
        assert c.get("/v1/models", headers={"Host": host}).status_code == 200
    assert c.get("/v1/models", headers={"Host": "gpu2"}).status_code == 421
    anyhost = client(upstream, ALLOWED_HOSTS="*")
    assert anyhost.get("/v1/models", headers={"Host": "whatever.test"}).status_code == 200


def test_an_absolute_form_targets_authority_is_its_host():
    guard_ = OriginGuard(lambda e, s: [b"routed"])
    seen = []
    env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/v1/models", "HTTP_HOST": "localhost",
           "RAW_URI": "http://evil.example/v1/models"}
    body = b"".join(guard_(env, lambda status, headers, exc=None: seen.append(status)))
    assert seen == ["421 MISDIRECTED REQUEST"] and b"evil.example" in body
    env["RAW_URI"] = "http://127.0.0.1:11433//v1//models"
    assert b"".join(guard_(env, lambda *a: None)) == b"routed"
    for bad in ("http://[::1/v1/models", "http://a@localhost/v1", "http:///v1"):
        env["RAW_URI"], seen[:] = bad, []
        b"".join(guard_(env, lambda status, headers, exc=None: seen.append(status)))
        assert seen == ["421 MISDIRECTED REQUEST"], bad


def test_host_name_parses_with_the_standard_library():
    assert host_name("[::1]:80") == "::1"
    assert host_name("Example.COM.:1") == "example.com"
    assert host_name("a/b") is None and host_name("h:99999") is None and host_name("") is None


# ------------------------------------------------------- a browser's simple bodies

@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=UTF-8",
                                   "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
def test_a_browsers_body_is_json_only_when_it_says_so(upstream, ctype):
    """Even from the same origin (the console sends JSON as application/json)."""
    headers = {"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"}
    if ctype:
        headers["Content-Type"] = ctype
    r = client(upstream).post("/v1/chat/completions", data=CHAT, headers=headers)
    envelope(r, 415, "unsupported_media_type")
    assert upstream.heads == []


def test_nodes_fetch_is_not_a_browser(upstream):
    """Node's fetch (undici: the JS SDKs, Claude Code) sends `sec-fetch-mode: cors`
    on every request, and no Origin: it is a client like curl."""
    r = client(upstream).post("/v1/completions", data=CHAT, headers={
        "sec-fetch-mode": "cors", "user-agent": "node", "accept-language": "*",
        "Content-Type": "text/plain"})
    assert r.status_code == 200 and len(upstream.heads) == 1


def test_a_browsers_empty_post_passes(upstream):
    """The console's Load and Unload buttons: POST, no body."""
    c = client(upstream)
    r = c.post("/unload", headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200 and len(upstream.heads) == 1


# ------------------------------------------------------------- the API key first

class Untouchable(io.RawIOBase):
    failed = False          # as gunicorn's Body: True, and gunicorn closes instead of draining

    def read(self, *a):
        raise AssertionError("the body was read before the key was checked")
    readline = readinto = read


@pytest.mark.parametrize("extra", [{"CONTENT_LENGTH": "1000000"},
                                   {"HTTP_TRANSFER_ENCODING": "chunked"}])
def test_the_key_is_checked_before_the_body_is_read(upstream, extra):
    app = create_app(Settings.from_env({}, BACKEND_URL=upstream.url, API_KEY="k",
                                       WEB_SEARCH=False))
    body = Untouchable()
    env = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions",
           "SERVER_NAME": "localhost", "SERVER_PORT": "11433", "HTTP_HOST": "localhost",
           "wsgi.url_scheme": "http", "wsgi.input": body, "wsgi.errors": io.StringIO(),
           "CONTENT_TYPE": "application/json", **extra}
    status = []
    out = b"".join(app.wsgi_app(env, lambda s, h, e=None: status.append((s, dict(h)))))
    assert status[0][0].startswith("401") and b"invalid_api_key" in out
    assert body.failed is True               # the unread body ends the connection
    assert upstream.heads == []


def test_a_wrong_key_on_messages_is_still_anthropics_401(upstream):
    r = client(upstream, API_KEY="k").post("/v1/messages", data=CHAT, headers={
        "x-api-key": "wrong", "Content-Type": "application/json"})
    assert r.status_code == 401
    assert r.get_json()["error"]["type"] == "authentication_error"
    assert r.get_json()["type"] == "error"


def test_refusals_are_counted_with_bounded_labels(upstream):
    c = client(upstream, API_KEY="k")
    c.get("/v1/models", headers={"Host": "evil.example"})
    c.get("/v1/models", headers={"Origin": EVIL, "Authorization": "Bearer k"})
    c.get("/v1/models")
    for verb in ("FOO", "BREW", "X" * 100):
        c.open("/v1/models", method=verb, headers={"Authorization": "Bearer k"})
    text = c.get("/metrics", headers={"Authorization": "Bearer k"}).data.decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("proxy_requests_total{")]
    assert any('status="421"' in ln for ln in lines)
    assert any('status="403"' in ln for ln in lines)
    assert any('status="401"' in ln for ln in lines)
    methods = {ln.split('method="')[1].split('"')[0] for ln in lines}
    assert methods <= {"GET", "POST", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE", "other"}
    assert "other" in methods


# ------------------------------------------------------------- guard pieces

def test_slash_collapse_keeps_an_absolute_targets_authority():
    assert guard._collapsed("http://h:1//v1//models?a=//b") == "http://h:1/v1/models?a=//b"
    assert guard._collapsed("//unload") == "/unload"
    env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/v1//models",
           "RAW_URI": "http://127.0.0.1:8/v1//models?x=1"}
    got = {}
    guard.RequestGuard(lambda e, s: got.update(e) or [b""])(env, lambda *a: None)
    assert got["RAW_URI"] == "http://127.0.0.1:8/v1/models?x=1"
    assert guard.raw_target(got) == "/v1/models?x=1"
