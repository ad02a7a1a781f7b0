"""Issue 28, on the swapper (fake runtime, scripted backend): a GET or HEAD of
/load or /unload changes nothing (a web page's <img> or link used to load or
unload a model), a HEAD or OPTIONS never loads a model, and a target that cannot
be forwarded is refused before its model is admitted (it was refused only after
the model had been swapped in)."""
import json

import pytest

from tests.support.servers import Scripted
from tests.support.swapper_app import make_app, settled

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.fixture
def backend():
    srv = Scripted(*[OK] * 8)
    yield srv
    srv.close()


def started(runtime) -> list:
    return [c for c in runtime.calls if c[0] in ("create", "start")]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("path", ["/load/tiny-a", "/load", "/unload"])
def test_a_read_of_a_state_change_changes_nothing(backend, method, path):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    if path == "/unload":
        assert c.post("/load/tiny-a").status_code == 200
    before = list(runtime.calls)
    r = c.open(path, method=method)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    if method == "GET":
        err = r.get_json()["error"]
        assert err["code"] == "method_not_allowed" and "POST" in err["message"]
    assert runtime.calls == before
    assert settled(app)["model"] == ("tiny-a" if path == "/unload" else None)


def test_post_still_loads_and_unloads(backend):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    assert c.post("/load/tiny-a").get_json()["loaded"] == "tiny-a"
    assert c.post("/load", data=json.dumps({"model": "tiny-a"})).status_code == 200
    assert c.post("/unload").get_json()["unloaded"] is True


@pytest.mark.parametrize("path", ["/upstream/tiny-a/health", "/upstream/tiny-a/props",
                                  "/upstream/tiny-a/slots"])
def test_head_and_options_never_load_a_model(backend, path):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    h = c.head(path)
    assert h.status_code in (405, 409), h.status_code
    o = c.options(path)
    assert o.status_code in (204, 403, 405), o.status_code
    assert started(runtime) == [] and backend.heads == []
    assert settled(app)["model"] is None


@pytest.mark.parametrize("target", ["/upstream/tiny-a/props?q=%ZZ", "/upstream/tiny-a/a%",
                                    "/upstream/tiny-a/props?q={x}", "/v1/chat/completions?x=%ZZ",
                                    "/upstream/tiny-a/health?x=%G1"])
def test_a_bad_target_is_refused_before_its_model_is_admitted(backend, target):
    app, runtime = make_app({"tiny-a": backend.url})
    c = app.test_client()
    env = {"RAW_URI": target, "REQUEST_URI": target}
    if target.startswith("/v1/"):
        r = c.post(target, environ_overrides=env, json={
            "model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]})
    else:
        r = c.get(target, environ_overrides=env)
    assert r.status_code == 400, r.data
    assert r.get_json()["error"]["code"] == "invalid_path"
    assert started(runtime) == [] and backend.heads == []
    assert settled(app)["model"] is None
