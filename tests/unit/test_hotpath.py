"""common.hotpath: the forwarding routes served around Flask's per-request
machinery, with the same hooks, errors and guard as Flask's routes."""
from __future__ import annotations

import json

import flask
import pytest
from flask import Flask, Response, request

from common import guard
from common.errors import ApiError, install_error_handlers
from common.guard import harden
from common.hotpath import install



def make(limit: int = 100):
    app = Flask("hot")
    app.config["MAX_CONTENT_LENGTH"] = limit
    harden(app)
    install_error_handlers(app)
    seen = []

    def view(req):
        kind = guard.loads(req.get_data()).get("raise")
        if kind == "api":
            raise ApiError("nope", 409, code="conflict")
        if kind == "bug":
            raise RuntimeError("boom")
        return Response(req.get_data(), mimetype="application/json")

    def before(req):
        seen.append(("before", req.path))
        if req.headers.get("X-Deny"):
            return Response("denied", status=401)
        return None

    def after(resp, req):
        seen.append(("after", req.path, resp.status_code))
        resp.headers["X-After"] = "1"
        return resp

    app.add_url_rule("/hot", "hot", methods=["POST"], view_func=lambda: view(request))
    app.get("/cold")(lambda: "cold")
    install(app, {"/hot": view}.get, before=before, after=after)
    return app, seen


@pytest.fixture
def flask_dispatches():
    """Requests Flask dispatched (its request_started signal)."""
    got = []

    def record(sender, **_):
        got.append(request.path)
    flask.request_started.connect(record)
    yield got
    flask.request_started.disconnect(record)


def test_a_hot_route_is_served_around_flask_with_its_hooks(flask_dispatches):
    app, seen = make()
    c = app.test_client()
    r = c.post("/hot", data=b'{"a": 1}')
    assert r.status_code == 200 and r.json == {"a": 1} and r.headers["X-After"] == "1"
    assert seen == [("before", "/hot"), ("after", "/hot", 200)]
    assert flask_dispatches == []                       # Flask never saw it
    assert c.get("/cold").data == b"cold" and flask_dispatches == ["/cold"]
    assert c.post("/hot/", data=b"{}").status_code == 200     # Flask's route serves the rest
    assert flask_dispatches == ["/cold", "/hot/"]


def test_an_answer_from_before_skips_the_view_and_after_still_sees_it():
    app, seen = make()
    r = app.test_client().post("/hot", data=b'{"raise": "bug"}', headers={"X-Deny": "1"})
    assert r.status_code == 401 and r.headers["X-After"] == "1"
    assert seen == [("before", "/hot"), ("after", "/hot", 401)]


@pytest.mark.parametrize("body,status,code", [
    (b'{"raise": "api"}', 409, "conflict"),
    (b'{"raise": "bug"}', 500, None),
    (b"not json", 400, "invalid_json"),
    (b'{"pad": "' + b"x" * 200 + b'"}', 413, "body_too_large"),
])
def test_errors_answer_in_the_envelope_as_under_flask(body, status, code, caplog):
    app, seen = make()
    hot = app.test_client().post("/hot", data=body)
    cold = app.test_client().post("/hot/", data=body)       # the same view, through Flask
    for r in (hot, cold):
        err = json.loads(r.data)["error"]
        assert r.status_code == status and err["code"] == code and err["message"]
    assert hot.json == cold.json
    assert seen[1] == ("after", "/hot", status)
    if status == 500:
        assert "boom" not in hot.json["error"]["message"].split(":")[0]
        assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)


def test_the_guard_still_comes_first():
    app, seen = make()
    r = app.test_client().post("/x/../hot", data=b"{}")
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_path" and seen == []


def test_installing_needs_the_guard_first():
    with pytest.raises(TypeError):
        install(Flask("bare"), {}.get)


def test_the_services_serve_their_forwarding_routes_hot(flask_dispatches):
    from proxy.app import create_app
    from proxy.settings import Settings
    from tests.perf.coldhop import swapper_app

    proxy = create_app(Settings.from_env({}, API_KEY="k", BACKEND_URL="http://127.0.0.1:9"))
    c = proxy.test_client()
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/v1/messages", "/v1/responses"):
        assert c.post(path, data=b"{}").status_code == 401              # before: the key
        r = c.post(path, data=b"[]", headers={"Authorization": "Bearer k"})
        assert r.status_code == 400, (path, r.data)
        assert r.json.get("error", {}).get("message") or r.json["type"] == "error"
    assert flask_dispatches == []
    swapper = swapper_app()
    flask_dispatches.clear()
    r = swapper.test_client().post("/v1/nowhere", data=b"{}")
    assert r.status_code == 404 and r.json["error"]["code"] == "unknown_endpoint"
    assert flask_dispatches == []
