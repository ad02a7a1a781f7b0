"""Issue 35, keys on a real database through the real proxy (gunicorn + gevent,
two workers) in front of a scripted model: the store's contract on SQLite and on
PostgreSQL (a throwaway cluster, tests/support/postgres.py) with a hand clock, a
box with no keys unchanged, revocation seen by every worker within a second, two
proxies sharing one PostgreSQL (keys, and one concurrency count), a lease
released when the client hangs up mid-stream, API_KEY unchanged, and the
database down: 503, then back by itself."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import threading

import psycopg
import pytest
import requests

from proxy.keys import policy, store as store_mod
from proxy.keys.postgres import PostgresStore
from proxy.keys.sqlite import SqliteStore
from proxy.keys.policy import Spent
from proxy.keys.store import Limited, StoreDown
from tests.support.chat import Reply, ScriptedChat
from tests.support.clock import Clock
from tests.support.postgres import Postgres
from tests.support.process import REPO
from tests.support.proxyproc import ProxyProcess
from tests.support.servers import wait_until

MODELS = [{"id": "smollm2", "object": "model", "aliases": ["smol"]},
          {"id": "qwen-35b", "object": "model", "aliases": ["qwen-moe"]}]
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": True}
EMBED = {"model": "smollm2", "input": "x"}
ADMIN = "admin-secret"
T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def pg():
    with Postgres() as pg:
        with psycopg.connect(pg.url, autocommit=True) as c:
            c.execute("CREATE DATABASE contract")
        yield pg


@pytest.fixture(scope="module")
def stack(pg, tmp_path_factory):
    """A model, two proxies on one PostgreSQL (API_KEY set) and one on SQLite
    (no API_KEY), each with two workers."""
    db = str(tmp_path_factory.mktemp("keys") / "keys.db")
    # The tests' own refused requests must not trip the failed-auth throttle
    # (tests/unit/proxy/test_keys_door.py tests it).
    common = dict(WEB_SEARCH=0, MODELS_TTL=0, SYSTEM_PROMPT="", PROXY_WORKERS=2,
                  KEEPALIVE_INTERVAL=0.2, AUTH_FAILURES_PER_MINUTE=100000)
    with ScriptedChat(models=MODELS) as chat, contextlib.ExitStack() as stop:
        procs = [ProxyProcess(BACKEND_URL=chat.url, KEYS_DATABASE_URL=pg.url, API_KEY=ADMIN,
                              **common) for _ in range(2)]
        procs.append(ProxyProcess(BACKEND_URL=chat.url, KEYS_DB=db, **common))
        def each(fn):                                 # side by side: CI time
            with cf.ThreadPoolExecutor(len(procs)) as ex:
                list(ex.map(fn, procs))
        stop.callback(each, lambda p: p.stop())
        each(lambda p: p.start())
        a, b, s = procs
        yield dict(chat=chat, a=a, b=b, s=s, db=db)


def post(proxy, path, body, token=None, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # A new connection each time: gunicorn hands it to either worker.
    return requests.post(proxy.url + path, json=body, headers={**headers, "Connection": "close"},
                         timeout=30, **kw)


def answered(status: int, ask, what: str) -> requests.Response:
    """The first answer of ask() with that status (a Response is false when >= 400)."""
    return wait_until(lambda: (lambda r: [r] if r.status_code == status else None)(ask()),
                      what)[0]


# ------------------------------------------------------------ the store's contract

@pytest.fixture(params=["sqlite", "postgres"])
def two(request, pg, tmp_path):
    """Two stores on one database (two processes), on one hand clock."""
    clock = Clock(T0)
    if request.param == "sqlite":
        make = lambda: SqliteStore(str(tmp_path / "k.db"), clock=clock)  # noqa: E731
    else:
        url = pg.url.rsplit("/", 1)[0] + "/contract"
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("DROP TABLE IF EXISTS keys, minute_counts, key_usage, owners, leases")
        make = lambda: PostgresStore(url, clock=clock)  # noqa: E731
    one, other = make(), make()
    yield one, other, clock
    one.close()
    other.close()


def test_a_keys_life(two):
    s, other, clock = two
    assert not s.has_keys()
    key, token = s.create("alice", models=["qwen-*"], weight=2.0)
    assert other.has_keys() and other.by_token(token) == key
    assert other.by_token(token + "x") is None and other.by_token("") is None
    with pytest.raises(ValueError):
        other.create("alice")                         # one active key per name
    with pytest.raises(ValueError):
        s.update("alice", weight=0)
    assert other.update("alice", rpm=3, models="smollm2,qwen-*").models == ("smollm2", "qwen-*")
    clock.sleep(5)
    revoked = s.revoke("alice")
    assert revoked.revoked == T0 + 5 and other.by_token(token) is None
    assert other.has_keys()                           # the last revoked: the door stays shut
    again, token2 = other.create("alice")             # the name is free again
    assert again.id != key.id and s.by_token(token2) == again
    assert [k.name for k in s.keys(revoked=True)] == ["alice", "alice"]
    with pytest.raises(store_mod.UnknownKey):
        s.revoke("bob")


def test_limits_are_one_count_for_every_process(two):
    s, other, clock = two
    key, _ = s.create("bob", max_concurrent=2, rpm=3)
    first, second = s.admit(key), other.admit(key)
    with pytest.raises(Limited) as e:
        s.admit(key)
    assert e.value.refusal.limit == "max_concurrent"
    other.release(first)                              # any process may end any lease
    third = s.admit(key)
    s.release(second)
    with pytest.raises(Limited) as e:                 # 3 admitted this minute
        other.admit(key)
    assert e.value.refusal.limit == "rpm"
    s.release(third)
    clock.sleep(60 - T0 % 60)                          # the next minute
    s.release(other.admit(key))
    assert s.usage(key).this_minute == 1 and s.usage(key).in_flight == 0


def test_tokens_are_counted_per_utc_day(two):
    s, other, clock = two
    key, _ = s.create("carol", tokens_per_day=100)
    s.add_usage(key, "smollm2", Spent(1, prompt_tokens=50, completion_tokens=10))
    assert s.admit(key) is None                       # no concurrency limit: no lease
    other.add_usage(key, "qwen-35b", Spent(1, prompt_tokens=40, cached_tokens=30,
                                           completion_tokens=5))
    with pytest.raises(Limited) as e:
        other.admit(key)
    assert e.value.refusal.limit == "tokens_per_day"
    clock.sleep(policy.DAY - clock() % policy.DAY)     # midnight UTC
    assert other.usage(key).tokens_today == 0 and other.admit(key) is None


def test_a_crashed_processs_leases_stop_counting(two):
    s, other, clock = two
    key, _ = s.create("dave", max_concurrent=1)
    s.admit(key)                                      # s "crashes" holding it
    with pytest.raises(Limited):
        other.admit(key)
    clock.sleep(store_mod.STALE + 1)                  # s has not marked itself alive
    lease = other.admit(key)
    clock.sleep(store_mod.STALE)
    other.beat()                                      # other's beat forgets s's rows
    assert other.usage(key).in_flight == 1
    other.release(lease)
    assert s.usage(key).in_flight == 0


def test_a_release_the_outage_refused_is_retried(pg):
    """A request ends while PostgreSQL is down: its slot is freed once it is back
    (the heartbeat retries the release), never held for good."""
    clock = Clock(T0)
    s = PostgresStore(pg.url.rsplit("/", 1)[0] + "/contract", clock=clock)
    idle = PostgresStore(s.url, clock=clock)            # its pooled connection goes stale
    try:
        key, _ = s.create("erin", max_concurrent=1)
        assert idle.usage(key).in_flight == 0
        lease = s.admit(key)
        pg.stop()
        try:
            s.release(lease)                           # logged, kept for the heartbeat
            with pytest.raises(StoreDown):
                s.admit(key)
        finally:
            pg.start()
        assert idle.usage(key).in_flight == 1         # a stale connection: replaced, no error
        s.beat()
        assert s.usage(key).in_flight == 0 and s.admit(key) is not None
    finally:
        s.close()
        idle.close()


# ------------------------------------------------------------ the real proxies

def test_a_box_without_keys_then_keys_then_a_revocation_on_every_worker(stack):
    s, chat = stack["s"], stack["chat"]
    assert post(s, "/v1/embeddings", EMBED).status_code == 200          # no keys: open
    env = {**os.environ, "KEYS_DB": stack["db"]}
    out = subprocess.run([sys.executable, "-m", "proxy.keys", "create", "team", "--models",
                          "smol"], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout
    token = out.split("token (shown once, keep it): ")[1].strip()
    # Each worker's "no keys" answer lasts a second at most.
    wait_until(lambda: all(post(s, "/v1/embeddings", EMBED).status_code == 401
                           for _ in range(8)), "a key made: no key refused by both workers",
               deadline=3.0)
    assert all(post(s, "/v1/embeddings", EMBED, token).status_code == 200 for _ in range(6))
    r = post(s, "/v1/messages", {"model": "qwen-moe", "max_tokens": 5,
                                 "messages": [{"role": "user", "content": "hi"}]}, token)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    SqliteStore(stack["db"]).revoke("team")
    # Every worker refuses it once its cache (at most a second) has gone.
    wait_until(lambda: all(post(s, "/v1/embeddings", EMBED, token).status_code == 401
                           for _ in range(8)), "the revoked key refused by both workers",
               deadline=3.0)
    assert all(post(s, "/v1/embeddings", EMBED, token).status_code == 401 for _ in range(8))
    assert not chat.requests


def test_a_concurrency_limit_holds_across_two_workers(stack):
    """Eight streams at once, a key that may have three: three are served, five
    refused, whichever worker each reached; then the slots are free again."""
    s, chat = stack["s"], stack["chat"]
    token = SqliteStore(stack["db"]).create("many", max_concurrent=3)[1]
    held = threading.Event()
    chat.script(*[Reply(content="held", hold=held) for _ in range(3)])
    with cf.ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda _: post(s, "/v1/chat/completions", CHAT, token,
                                             stream=True), range(8)))
        try:
            statuses = sorted(r.status_code for r in answers)
            assert statuses == [200] * 3 + [429] * 5, statuses
        finally:
            held.set()
            for r in answers:
                r.close()
    chat.script(Reply(content="again"))
    answered(200, lambda: post(s, "/v1/embeddings", EMBED, token), "the slots free again")


def test_two_proxies_share_keys_and_one_concurrency_count(stack):
    a, b, chat = stack["a"], stack["b"], stack["chat"]
    r = post(a, "/admin/keys", {"name": "pair", "max_concurrent": 1, "weight": 3})
    assert r.status_code == 401                        # keys exist: API_KEY or a key
    r = post(a, "/admin/keys", {"name": "pair", "max_concurrent": 1, "weight": 3}, ADMIN)
    assert r.status_code == 201
    token = r.json()["token"]
    assert post(b, "/admin/keys", {"name": "x"}, token).status_code == 403   # role use
    held = threading.Event()
    chat.script(Reply(content="a long answer", hold=held))
    stream = post(a, "/v1/chat/completions", CHAT, token, stream=True)
    try:
        assert stream.status_code == 200
        next(stream.iter_content(None))               # it is being served
        r = post(b, "/v1/embeddings", EMBED, token)   # the other proxy: the one count
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "max_concurrent_exceeded"
    finally:
        stream.close()                                # the client hangs up mid-stream
        held.set()
    # Its lease ends with it (the proxy's next write finds the client gone).
    answered(200, lambda: post(b, "/v1/embeddings", EMBED, token),
             "the lease released after the hang-up")
    sent = {k.lower(): v for k, v in chat.other[-1]["headers"].items()}
    assert sent["x-coding-stack-tenant"] == "pair" and sent["x-coding-stack-weight"] == "3.0"
    assert post(b, "/admin/keys/pair/revoke", {}, ADMIN).status_code == 200
    wait_until(lambda: all(post(a, "/v1/embeddings", EMBED, token).status_code == 401
                           for _ in range(6)), "revoked on b: refused on a", deadline=3.0)


def test_the_database_down_is_a_503_then_back_by_itself(stack, pg):
    a = stack["a"]
    r = post(a, "/admin/keys", {"name": "outage"}, ADMIN)
    token = r.json()["token"]
    assert post(a, "/v1/embeddings", EMBED, token).status_code == 200
    pg.stop()
    try:
        r = answered(503, lambda: post(a, "/v1/embeddings", EMBED, token),
                     "a 503 once the database is gone")
        assert r.json()["error"]["code"] == "key_store_unavailable"
        assert r.headers["Retry-After"] == "1"
        assert post(a, "/v1/embeddings", EMBED, ADMIN).status_code == 200   # API_KEY: as before
    finally:
        pg.start()
    wait_until(lambda: post(a, "/v1/embeddings", EMBED, token).status_code == 200,
               "served again once the database is back", deadline=10.0)
    with pytest.raises(StoreDown):
        SqliteStore("/proc/no/such/folder/k.db").has_keys()


# ------------------------------------------------------------ usage per key

def usage_of(proxy, name: str) -> dict:
    r = requests.get(proxy.url + f"/admin/usage?key={name}", timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN}", "Connection": "close"})
    assert r.status_code == 200, r.text
    return r.json()


def counted(proxy, name: str, requests_: int, what: str) -> dict:
    """The key's totals once its requests are all written (each is written just
    after its answer has gone): then exactly these, never more."""
    totals = wait_until(lambda: (lambda t: t if t["requests"] >= requests_ else None)(
        usage_of(proxy, name)["totals"]), what, deadline=20.0)
    assert totals["requests"] == requests_, totals
    return totals


def test_usage_is_exact_across_two_workers_and_two_proxies(stack):
    a, b, chat = stack["a"], stack["b"], stack["chat"]
    token = post(a, "/admin/keys", {"name": "counted"}, ADMIN).json()["token"]
    n = 12
    chat.script(*[Reply(content="fine") for _ in range(n)])
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
    with cf.ThreadPoolExecutor(4) as ex:            # new connections: either worker
        statuses = list(ex.map(lambda i: post((a, b)[i % 2], "/v1/chat/completions", body,
                                              token).status_code, range(n)))
    assert statuses == [200] * n
    assert post(b, "/v1/embeddings", EMBED, token).status_code == 200
    totals = counted(b, "counted", n + 1, "every request's usage written")
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (10 * n, 5 * n)
    rows = usage_of(a, "counted")["rows"]           # one row: the alias resolved to its id
    assert [(r["model"], r["requests"]) for r in rows] == [("smollm2", n + 1)]
    assert rows[0]["load_seconds"] == 0.0           # the swapper does not tell it per answer


def test_usage_is_exact_after_a_database_restart_during_traffic(stack, pg):
    """Requests while PostgreSQL is down are refused 503 at the door, or (a key
    still in a worker's one-second cache, or a stream that began before) served
    and counted once when it is back: their rows wait in the worker's memory."""
    a, b, chat = stack["a"], stack["b"], stack["chat"]
    token = post(a, "/admin/keys", {"name": "outlived"}, ADMIN).json()["token"]
    served = 0
    for p in (a, b):
        served += post(p, "/v1/embeddings", EMBED, token).status_code == 200
    held = threading.Event()
    chat.script(Reply(content="a long answer", hold=held))
    stream = post(a, "/v1/chat/completions", {**CHAT, "stream_options": {
        "include_usage": True}}, token, stream=True)
    assert stream.status_code == 200
    pieces = stream.iter_content(None)
    next(pieces)                                    # being served
    pg.stop()
    try:
        held.set()
        b"".join(pieces)                            # it ends while the database is down
        served += 1
        refused = 0
        for i in range(8):
            status = post((a, b)[i % 2], "/v1/embeddings", EMBED, token).status_code
            assert status in (200, 503)
            served += status == 200
            refused += status == 503
    finally:
        stream.close()
        pg.start()
    for p in (a, b):
        served += post(p, "/v1/embeddings", EMBED, token).status_code == 200
    totals = counted(a, "outlived", served, "the rows kept while it was down written")
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (10, 5)
    assert usage_of(a, "outlived")["pending_rows"] == 0


def test_a_stream_in_flight_when_its_proxy_restarts_is_counted(stack):
    """SIGTERM: gunicorn stops taking connections and lets the stream in flight
    finish; its record's end writes its row, once, before the worker exits."""
    a, b, chat = stack["a"], stack["b"], stack["chat"]
    token = post(a, "/admin/keys", {"name": "restarted"}, ADMIN).json()["token"]
    held = threading.Event()
    chat.script(Reply(content="a long answer", hold=held))
    stream = post(b, "/v1/chat/completions", {**CHAT, "stream_options": {
        "include_usage": True}}, token, stream=True)
    pieces = stream.iter_content(None)
    next(pieces)
    # SIGTERM, gunicorn's graceful stop (the test helper's stop is SIGINT: quick)
    stopping = threading.Thread(target=lambda: (b.proc.send_signal(signal.SIGTERM),
                                                b.proc.wait(30)))
    stopping.start()
    try:
        def refused():
            try:
                requests.get(b.url + "/healthz", timeout=2)
            except requests.ConnectionError:
                return True
            return False
        wait_until(refused, "b stopping: new connections refused")
        held.set()
        assert b'"usage"' in b"".join(pieces)       # it finished, its usage sent
    finally:
        held.set()
        stream.close()
        stopping.join()
        b.stop()                                    # (exited: only its bookkeeping)
        b.start()
    totals = counted(b, "restarted", 1, "the stream's usage written before it exited")
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (10, 5)
