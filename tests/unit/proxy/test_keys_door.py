"""Issue 35, keys at the proxy's door, in-process on a real SQLite store (Flask's
test client; the upstream a scripted model): 401 / 403 / 429 in each dialect's
error shape, API_KEY as before, a store without keys as no store, admin routes,
failed-auth bursts, the tenant fields on the internal hop, the admin API and the
CLI (its token printed once, the file 0600, never the token in the database)."""
from __future__ import annotations

import io
import json
import os
import sqlite3
import stat

import pytest

from proxy.app import create_app
from proxy.keys import auth, cli
from proxy.keys.sqlite import SqliteStore
from proxy.settings import Settings
from tests.support.chat import Reply, ScriptedChat

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "qwen-moe", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "qwen-moe", "input": "hi"}
MODELS = [{"id": "smollm2", "object": "model", "aliases": ["smol", "cpu"]},
          {"id": "qwen-35b", "object": "model", "aliases": ["qwen-moe"]}]


@pytest.fixture(scope="module")
def chat():
    with ScriptedChat(models=MODELS) as c:
        yield c


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "keys" / "keys.db")


def make(chat, db, **kw):
    settings = Settings.from_env({}, BACKEND_URL=chat.url, WEB_SEARCH=False, MODELS_TTL=0,
                                 SYSTEM_PROMPT="", KEYS_DB=db, **kw)
    return create_app(settings).test_client()


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def post(c, path, body, token=None, **headers):
    r = c.post(path, json=body, headers={**(bearer(token) if token else {}), **headers})
    r.close()               # the answer's end: a lease is released, tokens counted
    return r


def test_a_store_without_keys_changes_nothing(chat, db):
    c = make(chat, db)
    chat.script(Reply(content="hello"))
    assert post(c, "/v1/chat/completions", CHAT).status_code == 200
    assert c.get("/v1/models").status_code == 200
    assert oct(stat.S_IMODE(os.stat(db).st_mode)) == "0o600"      # made on first use


def test_api_key_works_as_before_and_as_an_admin(chat, db):
    c = make(chat, db, API_KEY="sekrit")
    r = post(c, "/v1/chat/completions", CHAT)
    assert r.status_code == 401 and r.json["error"]["code"] == "invalid_api_key"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    chat.script(Reply(content="hello"))
    assert post(c, "/v1/chat/completions", CHAT, "sekrit").status_code == 200
    # with keys in the store, API_KEY is still every route's key, the admin's too
    r = post(c, "/admin/keys", {"name": "alice", "models": ["smollm2"]}, "sekrit")
    assert r.status_code == 201 and r.json["token"].startswith("cs-")
    chat.script(Reply(content="hello"))
    assert post(c, "/v1/chat/completions", CHAT, "sekrit").status_code == 200
    assert c.get("/admin/keys", headers=bearer("sekrit")).json["keys"][0]["name"] == "alice"
    assert post(c, "/v1/chat/completions", CHAT, "wrong").status_code == 401


def test_keys_refuse_in_each_dialects_shape(chat, db):
    store = SqliteStore(db)
    _, token = store.create("bob", models=["smol"])        # an alias of smollm2
    c = make(chat, db)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES),
                       ("/v1/responses", RESPONSES)):
        r = post(c, path, body)
        assert r.status_code == 401
        if path == "/v1/messages":
            assert r.json["type"] == "error" and \
                r.json["error"]["type"] == "authentication_error"
        else:
            assert r.json["error"]["code"] == "invalid_api_key"
    chat.script(Reply(content="hello"))
    assert post(c, "/v1/chat/completions", CHAT, token).status_code == 200   # by its id
    r = post(c, "/v1/messages", MESSAGES, token)
    assert r.status_code == 403 and r.json == {"type": "error", "error": {
        "type": "permission_error",
        "message": "key 'bob' may not use model 'qwen-moe': it may use smol"}}
    r = post(c, "/v1/responses", RESPONSES, token)
    assert r.status_code == 403 and r.json["error"]["code"] == "model_not_allowed"
    # An agent's tier name (a name the catalog does not know) goes on to the
    # swapper, which alone maps it: within the scope the proxy tells it.
    n = len(chat.other)
    r = post(c, "/v1/embeddings", {"model": "claude-opus-4-8", "input": "x"}, token)
    sent = {k.lower(): v for k, v in chat.other[n]["headers"].items()}
    assert r.status_code == 200 and sent["x-coding-stack-models"] == '["smol"]'
    r = post(c, "/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "model"}, token)
    assert r.status_code == 403                     # naming none: only an all-models key
    r = post(c, "/v1/embeddings", {"model": "qwen-35b", "input": "x"}, token)
    assert r.status_code == 403                     # pass-through routes too
    assert post(c, "/v1/embeddings", {"model": "cpu", "input": "x"}, token).status_code == 200


def test_admin_routes_need_an_admin_key(chat, db):
    store = SqliteStore(db)
    _, use = store.create("user")
    _, admin = store.create("ops", role="admin")
    c = make(chat, db)
    for path in ("/unload", "/load/smollm2", "/admin/keys", "/upstream/smollm2/health",
                 "/logs/smollm2"):
        r = post(c, path, {}, use)
        assert r.status_code == 403 and r.json["error"]["code"] == "admin_only", path
    assert c.get("/admin/keys", headers=bearer(use)).status_code == 403
    assert c.get("/running", headers=bearer(use)).status_code == 200   # status: any key
    assert post(c, "/unload", {}, admin).status_code == 200
    listed = c.get("/admin/keys", headers=bearer(admin)).json["keys"]
    assert [k["name"] for k in listed] == ["ops", "user"]
    assert all("token" not in k and "hash" not in k for k in listed)


def test_limits_answer_429_with_retry_after(chat, db):
    store = SqliteStore(db)
    _, token = store.create("carol", rpm=2, tokens_per_day=100)
    c = make(chat, db)
    chat.script(Reply(content="a"), Reply(content="b"))
    assert post(c, "/v1/chat/completions", CHAT, token).status_code == 200
    assert post(c, "/v1/chat/completions", CHAT, token).status_code == 200
    r = post(c, "/v1/messages", MESSAGES, token)
    assert r.status_code == 429 and r.json["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["Retry-After"]) <= 60         # the next minute
    assert c.get("/v1/models", headers=bearer(token)).status_code == 200   # not a model request
    key = store.get("carol")
    assert store.usage(key).tokens_today == 30      # 15 per scripted answer, counted at its end
    store.update("carol", rpm=None, tokens_per_day=30)
    auth_cache_expired(c)
    r = post(c, "/v1/chat/completions", CHAT, token)
    assert r.status_code == 429 and r.json["error"]["code"] == "tokens_per_day_exceeded"


def test_a_lease_is_released_when_the_answer_fails(chat, db):
    store = SqliteStore(db)
    _, token = store.create("dave", max_concurrent=1)
    c = make(chat, db)
    chat.script(Reply(status=500), Reply(content="ok"))
    assert post(c, "/v1/chat/completions", CHAT, token).status_code == 500
    assert post(c, "/v1/chat/completions", CHAT, token).status_code == 200
    assert store.usage(store.get("dave")).in_flight == 0


def test_failed_checks_from_one_address_are_slowed(chat, db):
    store = SqliteStore(db)
    _, token = store.create("erin")
    _, working = store.create("frida")
    c = make(chat, db, AUTH_FAILURES_PER_MINUTE=3)
    chat.script(Reply(content="before"), Reply(content="during"))
    assert post(c, "/v1/chat/completions", CHAT, working).status_code == 200
    for _ in range(3):
        assert post(c, "/v1/chat/completions", CHAT, "cs-guess").status_code == 401
    r = post(c, "/v1/chat/completions", CHAT, token)     # a right key new here: a minute
    assert r.status_code == 429 and r.json["error"]["code"] == "too_many_auth_failures"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert post(c, "/v1/chat/completions", CHAT, "cs-guess").status_code == 429
    # behind one NAT address: an agent whose key passed before goes on working
    assert post(c, "/v1/chat/completions", CHAT, working).status_code == 200
    store.revoke("frida")
    auth_cache_expired(c)
    assert post(c, "/v1/chat/completions", CHAT, working).status_code == 401   # still checked
    c2 = make(chat, db, AUTH_FAILURES_PER_MINUTE=3)
    chat.script(Reply(content="ok"))
    r = c2.post("/v1/chat/completions", json=CHAT, headers=bearer(token),
                environ_base={"REMOTE_ADDR": "10.1.2.3"})
    assert r.status_code == 200                     # another address is not slowed


def test_the_tenant_goes_upstream_and_a_clients_does_not(chat, db):
    store = SqliteStore(db)
    _, token = store.create("frank", weight=2.5)
    c = make(chat, db)
    body = {"model": "smollm2", "input": "x"}
    n = len(chat.other)
    r = post(c, "/v1/embeddings", body, token,
             **{"X-Coding-Stack-Tenant": "someone-else", "X-Coding-Stack-Weight": "100",
                "X-Coding-Stack-Models": '["*"]'})
    assert r.status_code == 200
    sent = {k.lower(): v for k, v in chat.other[n]["headers"].items()}
    assert sent["x-coding-stack-tenant"] == "frank" and sent["x-coding-stack-weight"] == "2.5"
    assert "x-coding-stack-models" not in sent      # all models: no scope to tell
    assert "authorization" not in sent              # the key stays at the door
    # without keys (an open box) no tenant is sent, and a client's never passes
    c = create_app(Settings.from_env({}, BACKEND_URL=chat.url, WEB_SEARCH=False,
                                     MODELS_TTL=0)).test_client()
    r = post(c, "/v1/embeddings", body, None, **{"X-Coding-Stack-Tenant": "someone-else"})
    sent = {k.lower() for k in chat.other[-1]["headers"]}
    assert r.status_code == 200 and "x-coding-stack-tenant" not in sent


def test_the_request_record_names_the_key(chat, db):
    store = SqliteStore(db)
    _, token = store.create("gina")
    c = make(chat, db)
    chat.script(Reply(content="hello"))
    assert post(c, "/v1/chat/completions", CHAT, token).status_code == 200
    rec = c.application.extensions["proxy"]["activity"].since(0)[0][-1]
    assert rec["key"] == "gina"


def test_the_origin_guard_refuses_a_page_with_a_key(chat, db):
    store = SqliteStore(db)
    _, token = store.create("hank")
    c = make(chat, db)
    r = post(c, "/v1/chat/completions", CHAT, token, Origin="https://evil.example")
    assert r.status_code == 403 and "origin" in r.json["error"]["message"].lower()


def test_admin_api_makes_changes_and_revokes(chat, db):
    store = SqliteStore(db)
    _, admin = store.create("root", role="admin")
    c = make(chat, db)
    r = post(c, "/admin/keys", {"name": "ivy", "models": ["qwen-*"], "rpm": 5}, admin)
    assert r.status_code == 201
    token = r.json["token"]
    taken = post(c, "/admin/keys", {"name": "ivy"}, admin)
    assert taken.status_code == 409 and taken.json["error"]["code"] == "key_name_taken"
    assert post(c, "/admin/keys", {"name": "x", "rpm": 0}, admin).status_code == 400
    assert post(c, "/admin/keys", {"name": "x", "colour": 1}, admin).status_code == 400
    r = post(c, "/admin/keys/ivy", {"rpm": None, "weight": 3}, admin)
    assert r.status_code == 200 and r.json["key"]["rpm"] is None and r.json["key"]["weight"] == 3
    r = c.get("/admin/keys/ivy", headers=bearer(admin))
    assert r.json["usage"] == {"in_flight": 0, "requests_this_minute": 0, "tokens_today": 0}
    assert c.get("/admin/keys/revoke", headers=bearer(admin)).status_code == 404
    assert post(c, "/admin/keys/ivy/revoke", {}, admin).json["key"]["revoked"] is not None
    assert post(c, "/admin/keys/ivy/revoke", {}, admin).status_code == 404
    auth_cache_expired(c)           # the cache holds an answer for a second at most
    assert post(c, "/v1/embeddings", {"model": "qwen-35b"}, token).status_code == 401
    # the token is nowhere in the database, only its digest
    raw = open(db, "rb").read() + b"".join(
        open(db + s, "rb").read() for s in ("-wal",) if os.path.exists(db + s))
    assert token.encode() not in raw


def auth_cache_expired(c) -> None:
    """Forget the door's cached answers (as a second passing does)."""
    door = c.application.wsgi_app.app
    assert isinstance(door, auth.KeyAuth)
    door.cache._keys.clear()
    door.cache._any = None


def test_cli_creates_lists_updates_and_revokes(db):
    settings = Settings.from_env({}, KEYS_DB=db)

    def run(*argv):
        out = io.StringIO()
        assert cli.main(list(argv), settings=settings, out=out) == 0
        return out.getvalue()

    made = run("create", "jo", "--models", "smollm2,qwen-*", "--rpm", "10",
               "--max-concurrent", "2", "--weight", "1.5")
    token = made.split("token (shown once, keep it): ")[1].strip()
    assert token.startswith("cs-") and len(token) >= 43
    assert token not in run("list") and "jo\tuse\tsmollm2,qwen-*\tweight=1.5" in run("list")
    run("update", "jo", "--rpm", "none", "--role", "admin")
    listed = json.loads(run("list", "--json"))
    assert listed[0]["rpm"] is None and listed[0]["max_concurrent"] == 2 \
        and listed[0]["role"] == "admin" and listed[0]["models"] == ["smollm2", "qwen-*"]
    run("revoke", "jo")
    assert run("list") == "" and "REVOKED" in run("list", "--revoked")
    assert SqliteStore(db).by_token(token) is None
    with pytest.raises(SystemExit):
        cli.main(["create", "bad name"], settings=settings)
    assert cli.main(["revoke", "nobody"], settings=settings) == 1
    assert oct(stat.S_IMODE(os.stat(db).st_mode)) == "0o600"
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_an_answer_that_fails_to_close_still_ends_its_request():
    ended = []

    class Broken:
        def __iter__(self):
            return iter([b"x"])

        def close(self):
            raise OSError("boom")

    it = auth.Ending(Broken(), lambda: ended.append(1))
    assert list(it) == [b"x"]
    with pytest.raises(OSError):
        it.close()
    assert ended == [1]


def test_a_use_key_lists_only_its_own_requests(chat, db):
    """The console's recent requests: a `use` key sees its own, an admin all."""
    store = SqliteStore(db)
    _, ann = store.create("ann")
    _, ben = store.create("ben")
    _, ops = store.create("ops", role="admin")
    c = make(chat, db)
    for token in (ann, ben, ann):
        chat.script(Reply(content="hi"))
        assert post(c, "/v1/chat/completions", CHAT, token).status_code == 200

    def listed(token):
        r = c.get("/ui/activity", headers=bearer(token))
        assert r.status_code == 200
        return [e.get("key") for e in r.json["data"]], r.json["newest"]
    assert listed(ann) == (["ann", "ann"], 3)
    assert listed(ben) == (["ben"], 3)
    assert listed(ops) == (["ann", "ben", "ann"], 3)
    r = c.get("/ui/activity?limit=1", headers=bearer(ben))
    assert [e["key"] for e in r.json["data"]] == ["ben"]
