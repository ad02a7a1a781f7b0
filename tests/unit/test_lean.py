"""common.lean: Flask's per-request work the services do not need is gone, and
what Flask does for them is unchanged."""
from __future__ import annotations

import flask.app
import pytest
from flask import Flask, session
from flask.sessions import NullSession

from common.lean import lean
from proxy.app import create_app as proxy_app
from proxy.settings import Settings


def counting(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)

    def wrapper(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@pytest.fixture
def proxy():
    return proxy_app(Settings.from_env({}, WEB_SEARCH=False, BACKEND_URL="http://127.0.0.1:9"))


def test_no_session_is_made_per_request(monkeypatch, proxy):
    made = counting(monkeypatch, NullSession, "__init__")
    c = proxy.test_client()
    for _ in range(3):
        assert c.get("/metrics").status_code == 200
    assert made == []


def test_a_session_is_still_read_only_and_never_saved():
    app = Flask("t")
    lean(app)

    @app.get("/read")
    def read():
        return {"user": session.get("user")}

    @app.get("/write")
    def write():
        session["user"] = "x"
        return "no"

    c = app.test_client()
    r = c.get("/read")
    assert r.json == {"user": None} and "Set-Cookie" not in r.headers
    assert "Vary" not in r.headers
    assert c.get("/write").status_code == 500     # no secret key: as with Flask's default


def test_hooks_and_views_are_asked_about_coroutines_once(monkeypatch, proxy):
    c = proxy.test_client()
    c.get("/metrics")
    asked = counting(monkeypatch, flask.app, "iscoroutinefunction")
    for _ in range(3):
        assert c.get("/metrics").status_code == 200
    assert asked == []


def test_a_coroutine_function_is_still_handed_to_async_to_sync(monkeypatch):
    app = Flask("t")
    lean(app)
    handed = []
    monkeypatch.setattr(app, "async_to_sync", lambda f: handed.append(f) or "wrapped")

    async def view():
        return "x"

    assert app.ensure_sync(view) == "wrapped" and app.ensure_sync(view) == "wrapped"
    assert handed == [view, view]

    def plain():
        return "x"

    assert app.ensure_sync(plain) is plain and app.ensure_sync(plain) is plain
