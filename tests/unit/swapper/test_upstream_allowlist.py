"""Issue 28: /upstream/<model>/... forwards the backend's read-only paths only.
Slot actions (save, restore, erase: a file of the caller's choosing in the
KV-cache folder, a prefix oracle on another session's prompt), POST /props and
any other path are refused (403, in the envelope) before anything is admitted
or loaded; OPTIONS is answered by the swapper, HEAD refused: neither loads.
On the fake runtime with a scripted backend that records what reaches it."""
import json

import pytest

from swapper.intake import UPSTREAM_ROUTES
from tests.support.servers import Scripted
from tests.support.swapper_app import make_app, settled

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.fixture
def backend():
    srv = Scripted(*[OK] * 16)
    yield srv
    srv.close()


def starts(runtime):
    return [c for c in runtime.calls if c[0] == "start"]


@pytest.mark.parametrize("method, target", [
    ("POST", "/upstream/tiny-a/slots/0?action=save"),
    ("POST", "/upstream/tiny-a/slots/0?action=restore"),
    ("POST", "/upstream/tiny-a/slots/0?action=erase"),
    ("POST", "/upstream/tiny-a/slots/0"),
    ("GET", "/upstream/tiny-a/slots/0?action=save"),
    ("POST", "/upstream/tiny-a/slots"),
    ("POST", "/upstream/tiny-a/props"),
    ("GET", "/upstream/tiny-a/"),
    ("GET", "/upstream/tiny-a"),
    ("POST", "/upstream/tiny-a/completion"),
    ("POST", "/upstream/tiny-a/v1/chat/completions"),
    ("GET", "/upstream/tiny-a/slots%2F0"),           # encoded: refused by the guard (400)
    ("GET", "/upstream/tiny-a/health/"),
    ("GET", "/upstream/tiny-a/%68ealth"),            # an encoded 'h': not the path listed
    ("DELETE", "/upstream/tiny-a/slots"),
    ("HEAD", "/upstream/tiny-a/health"),
    ("PUT", "/upstream/tiny-a/props"),
])
def test_admin_paths_are_refused_before_anything_loads(backend, method, target):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    body = json.dumps({"filename": "../x.bin"}) if method == "POST" else None
    r = c.open(target, method=method, data=body, content_type="application/json",
               buffered=True)
    assert r.status_code in (400, 403, 405), (r.status_code, r.data)
    if method != "HEAD":
        err = json.loads(r.data)["error"]
        assert err["message"] and err["code"] in ("upstream_forbidden", "method_not_allowed",
                                                  "invalid_path")
    if r.status_code == 403:
        assert "slot actions" in json.loads(r.data)["error"]["message"]
    assert backend.heads == []                       # nothing reached the backend
    assert starts(runtime) == []                     # nothing was loaded
    assert settled(app)["in_flight"] == 0


@pytest.mark.parametrize("path", sorted(UPSTREAM_ROUTES))
def test_read_only_paths_are_forwarded(backend, path):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    (method,) = UPSTREAM_ROUTES[path]
    r = c.open(f"/upstream/tiny-a/{path}?n=1", method=method,
               data="{}" if method == "POST" else None, content_type="application/json",
               buffered=True)
    assert r.status_code == 200, r.data
    assert backend.heads[-1].split(b"\r\n")[0] == f"{method} /{path}?n=1 HTTP/1.1".encode()
    assert settled(app)["in_flight"] == 0


def test_options_is_answered_without_a_load(backend):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    r = c.options("/upstream/tiny-a/tokenize")
    assert r.status_code == 204 and r.headers["Allow"] == "OPTIONS, POST"
    r = c.options("/upstream/tiny-a/slots/0")
    assert r.status_code == 403
    assert backend.heads == [] and starts(runtime) == []


def test_the_backend_gets_its_key_not_the_clients(backend):
    """The swapper adds the backend's own key to what it forwards; the client's
    credentials (the proxy's API_KEY) never reach the backend."""
    from tests.support.fake_runtime import FakeRuntime
    app, _ = make_app({}, FakeRuntime({"tiny-a": backend.url}, key="backend-secret"))
    c = app.test_client()
    r = c.get("/upstream/tiny-a/props", headers={"Authorization": "Bearer proxy-key",
                                                 "X-Api-Key": "proxy-key"}, buffered=True)
    assert r.status_code == 200
    head = backend.heads[-1].decode().lower()
    assert "authorization: bearer backend-secret" in head
    assert "proxy-key" not in head
