"""Issue 20: what the swapper writes on the backend's request line is the target
as the client sent it (still percent-encoded), or nothing: a decoded CR/LF, a
space, a `?` or a non-ASCII character never reaches a request line, and no
target jams a model's slot. On the fake runtime with a scripted backend that
records the request heads it gets."""
import json

import pytest

from tests.support.servers import Scripted
from tests.support.swapper_app import make_app, settled

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.fixture
def backend():
    srv = Scripted(*[OK] * 4)
    yield srv
    srv.close()


@pytest.mark.parametrize("target, line", [
    # the issue's: a decoded target broke the request line or jammed the slot (paths
    # through /v1/responses/<id>; /upstream forwards its read-only paths only, with
    # their queries as sent)
    ("/v1/responses/%E2%82%AC", b"GET /v1/responses/%E2%82%AC HTTP/1.1"),
    ("/v1/responses/%FF", b"GET /v1/responses/%FF HTTP/1.1"),
    ("/v1/responses/a%20b%09c%7F", b"GET /v1/responses/a%20b%09c%7F HTTP/1.1"),
    ("/upstream/tiny-a/props?q=%FF&r=%0A&s=%0D%0AX-Injected:%201",
     b"GET /props?q=%FF&r=%0A&s=%0D%0AX-Injected:%201 HTTP/1.1"),
    ("/upstream/a/slots?x%0Ay", b"GET /slots?x%0Ay HTTP/1.1"),          # by alias; LF too
    ("/v1/responses/r%0D%0AX-Injected:%201", b"GET /v1/responses/r%0D%0AX-Injected:%201 "
                                             b"HTTP/1.1"),
])
def test_the_backend_gets_the_target_as_sent(backend, target, line):
    app, _ = make_app({"tiny-a": backend.url})
    c = app.test_client()
    if target.startswith("/v1/"):
        assert c.post("/load/tiny-a").status_code == 200
    r = c.get(target, buffered=True)
    assert r.status_code == 200, r.data
    assert backend.heads[-1].split(b"\r\n")[0] == line
    assert b"X-Injected" not in backend.heads[-1].split(b"\r\n", 1)[1]
    assert settled(app)["in_flight"] == 0


def test_a_post_that_would_inject_a_header_goes_on_encoded(backend):
    app, _ = make_app({"tiny-a": backend.url})
    c = app.test_client()
    assert c.post("/load/tiny-a").status_code == 200
    r = c.post("/v1/responses/x%0D%0AX-Injected:%201/cancel", json={}, buffered=True)
    assert r.status_code == 200, r.data
    head = backend.heads[-1].split(b"\r\n")
    assert head[0] == b"POST /v1/responses/x%0D%0AX-Injected:%201/cancel HTTP/1.1"
    assert not any(h.lower().startswith(b"x-injected") for h in head[1:])


@pytest.mark.parametrize("target", ["/upstream/tiny-a/\u20ac", "/upstream/tiny-a/a b",
                                    "/upstream/tiny-a/a\x7fb"])
def test_a_raw_target_no_request_line_may_carry_is_a_400_and_frees_the_slot(backend, target):
    """A target with raw bytes that no request line may carry (a WSGI server
    passes some on): refused, never decoded or re-encoded; the model serves on."""
    app, _ = make_app({"tiny-a": backend.url})
    c = app.test_client()
    env = {"RAW_URI": target, "REQUEST_URI": target}
    r = c.get(target, environ_overrides=env, buffered=True)
    assert r.status_code == 400, r.data
    assert json.loads(r.data)["error"]["code"] == "invalid_path"
    assert backend.heads == []
    assert settled(app)["in_flight"] == 0
    assert c.get("/upstream/tiny-a/health", buffered=True).status_code == 200
