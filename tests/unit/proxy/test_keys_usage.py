"""Issue 35, usage per key: the rows a request's record (proxy/record.py) gives at
its end, on a real SQLite store with a hand clock (UTC days, the daily token limit
read from the same rows, a database that refuses writes: the rows kept in memory,
bounded, and written once it is back); then through the app in-process (Flask's
test client, a scripted model): GET /admin/usage, the CLI, the key-labelled
metrics (bounded) and /v1/models filtered by the key's scope."""
from __future__ import annotations

import io
import json
import sqlite3

import pytest

from common.dialects import anthropic_usage, cached_tokens, openai_usage
from proxy.app import create_app
from proxy.keys import cli, policy, store as store_mod
from proxy.keys.policy import Spent
from proxy.keys.sqlite import SqliteStore
from proxy.keys.store import Limited
from proxy.keys.usage import Counting, model_of, spent_of
from proxy.record import Record
from proxy.settings import Settings
from tests.support.chat import Reply, ScriptedChat
from tests.support.clock import Clock
from tests.support.metrics import Scrape

T0 = 1_800_000_000.0            # 2027-01-15 08:00 UTC
DAY0 = int(T0 // policy.DAY)
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
MODELS = [{"id": "smollm2", "object": "model", "aliases": ["smol", "cpu"]},
          {"id": "qwen-35b", "object": "model", "aliases": ["qwen-moe"]}]


class Flaky(SqliteStore):
    """A SQLite store whose database can be made unreachable."""
    down = False

    def _connect(self):
        if self.down:
            raise sqlite3.OperationalError("unable to open database file")
        return super()._connect()

    def cut(self):
        self.down = True
        self.close()                        # the pooled connections go with it


def record(model=None, usage=None, timings=None, queue_wait=None, answered=None,
           load_seconds=None) -> Record:
    """A chat request's record as the writer leaves it at the end."""
    rec = Record("/v1/chat/completions", "chat", "POST", t0=0.0, clock=lambda: T0)
    rec.model = model
    rec.usage = openai_usage
    body = {"model": answered or "/models/x.gguf", "choices": []}
    if usage:
        body["usage"] = usage
    if timings:
        body["timings"] = timings
    rec.read(body)
    rec.note_wait(queue_wait)
    rec.note_load(load_seconds)
    rec.end(1.0)
    return rec


@pytest.fixture
def clock():
    return Clock(T0)


@pytest.fixture
def store(tmp_path, clock):
    s = Flaky(str(tmp_path / "k.db"), clock=clock)
    yield s
    s.down = False
    s.close()


def test_a_record_gives_one_row_per_key_model_and_day(store, clock):
    key, _ = store.create("alice")
    other, _ = store.create("bob")
    count = Counting(store, resolve={"smol": "smollm2"}.get)
    usage = {"prompt_tokens": 100, "completion_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 60}}
    count.count(key, record("smol", usage, queue_wait=1.25, load_seconds=0.75))
    count.count(key, record("smollm2", usage, queue_wait=0.5, load_seconds=0.5))  # the same row
    # a stream without usage: llama.cpp's timings (prompt_n + cache_n, cache_n cached)
    count.count(key, record("qwen-35b", timings={"prompt_n": 5, "cache_n": 20,
                                                 "predicted_n": 3}))
    count.count(other, record(None, answered="/models/x.gguf"))     # no tokens, no model named
    clock.sleep(policy.DAY - T0 % policy.DAY)                        # midnight UTC
    count.count(key, record("smol", usage))
    rows = store.usage_rows()
    assert [(r["key"], r["model"], r["day"]) for r in rows] == [
        ("alice", "qwen-35b", DAY0), ("alice", "smollm2", DAY0),
        ("bob", "/models/x.gguf", DAY0), ("alice", "smollm2", DAY0 + 1)]
    assert rows[1] == {"key": "alice", "model": "smollm2", "day": DAY0, "requests": 2,
                       "prompt_tokens": 200, "cached_tokens": 120, "completion_tokens": 14,
                       "queue_wait_seconds": 1.75, "load_seconds": 1.25}
    assert rows[0]["prompt_tokens"] == 25 and rows[0]["cached_tokens"] == 20 \
        and rows[0]["completion_tokens"] == 3
    assert rows[2]["requests"] == 1 and rows[2]["prompt_tokens"] == 0
    assert [r["day"] for r in store.usage_rows(name="alice", since=DAY0 + 1)] == [DAY0 + 1]
    assert len(store.usage_rows(model="smollm2", until=DAY0)) == 1


def test_cached_tokens_in_each_dialects_usage():
    assert spent_of(record("m", {"input_tokens": 9, "output_tokens": 1,
                                 "input_tokens_details": {"cached_tokens": 4}})) \
        .cached_tokens == 4                                          # Responses
    rec = record("m", {"prompt_tokens": 9, "completion_tokens": 1},
                 timings={"prompt_n": 2, "cache_n": 7, "predicted_n": 1})
    assert (rec.prompt, rec.cached) == (9, 7)                        # llama.cpp: usage + timings
    u = {"input_tokens": 3, "cache_read_input_tokens": 40, "output_tokens": 2}
    assert cached_tokens(u) == 40 and anthropic_usage(u)[0] == 43   # part of the prompt
    assert model_of(record(None)) == "/models/x.gguf"


def test_the_daily_token_limit_reads_the_usage_rows(store, clock):
    key, _ = store.create("carol", tokens_per_day=100)
    store.add_usage(key, "smollm2", Spent(1, prompt_tokens=50, cached_tokens=50,
                                          completion_tokens=10))
    assert store.admit(key) is None and store.usage(key).tokens_today == 60
    store.add_usage(key, "qwen-35b", Spent(1, prompt_tokens=30, completion_tokens=15))
    with pytest.raises(Limited) as e:
        store.admit(key)
    assert e.value.refusal.limit == "tokens_per_day"
    clock.sleep(policy.DAY - T0 % policy.DAY)
    assert store.usage(key).tokens_today == 0 and store.admit(key) is None


def test_rows_refused_by_the_database_are_kept_and_written_once_back(store, monkeypatch):
    started = []
    monkeypatch.setattr(store, "_start_heartbeat", lambda: started.append(1))
    key, _ = store.create("dave")
    store.add_usage(key, "smollm2", Spent(1, prompt_tokens=10))
    store.cut()
    for _ in range(3):
        store.add_usage(key, "smollm2", Spent(1, prompt_tokens=10))   # never raises
    store.add_usage(key, "qwen-35b", Spent(1, completion_tokens=4))
    assert store.pending() == 2 and started                          # summed per row
    with pytest.raises(store_mod.StoreDown):
        store.beat()
    assert store.pending() == 2                                      # a failed beat keeps them
    store.down = False
    store.beat()                                                     # the heartbeat writes them
    assert store.pending() == 0
    assert {r["model"]: (r["requests"], r["prompt_tokens"], r["completion_tokens"])
            for r in store.usage_rows()} == {"smollm2": (4, 40, 0), "qwen-35b": (1, 0, 4)}
    # kept rows also go with the next write that succeeds
    store.cut()
    store.add_usage(key, "smollm2", Spent(1))
    store.down = False
    store.add_usage(key, "qwen-35b", Spent(1))
    assert store.pending() == 0 and sum(r["requests"] for r in store.usage_rows()) == 7
    # bounded: past MAX_PENDING rows a new row is dropped (and said), never memory
    monkeypatch.setattr(store_mod, "MAX_PENDING", 2)
    store.cut()
    for model in ("a", "b", "c"):
        store.add_usage(key, model, Spent(1))
    assert store.pending() == 2 and store.dropped == 1
    store.down = False
    store.close()                                                    # the exit's last try
    assert store.pending() == 0 and {r["model"] for r in store.usage_rows()} >= {"a", "b"}


# ------------------------------------------------------------ through the app

@pytest.fixture(scope="module")
def chat():
    with ScriptedChat(models=MODELS) as c:
        yield c


def make(chat, db):
    settings = Settings.from_env({}, BACKEND_URL=chat.url, WEB_SEARCH=False, MODELS_TTL=0,
                                 SYSTEM_PROMPT="", KEYS_DB=db)
    return create_app(settings).test_client()


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def test_usage_through_the_app_admin_route_cli_and_metrics(chat, tmp_path, monkeypatch):
    db = str(tmp_path / "keys.db")
    monkeypatch.setattr("proxy.metrics.KEY_LABELS", 2)
    s = SqliteStore(db)
    _, admin = s.create("ops", role="admin")
    tokens = [s.create(name, models=["smol*"])[1] for name in ("ann", "ben", "cid")]
    c = make(chat, db)
    for token in tokens + tokens[:1]:
        chat.script(Reply(content="hello"))                  # usage 10 + 5
        r = c.post("/v1/chat/completions", json=CHAT, headers=bearer(token))
        assert r.status_code == 200
        r.close()
    r = c.post("/v1/embeddings", json={"model": "cpu", "input": "x"}, headers=bearer(tokens[1]))
    r.close()
    assert c.get("/v1/models", headers=bearer(tokens[0])).status_code == 200   # not counted
    r = c.get("/admin/usage?key=ann", headers=bearer(admin))
    assert r.status_code == 200
    assert [(x["key"], x["model"], x["requests"], x["prompt_tokens"],
             x["completion_tokens"]) for x in r.json["rows"]] == [("ann", "smollm2", 2, 20, 10)]
    assert r.json["rows"][0]["day"].count("-") == 2 and r.json["pending_rows"] == 0
    everyone = c.get("/admin/usage", headers=bearer(admin)).json
    assert everyone["totals"]["requests"] == 5 and everyone["totals"]["prompt_tokens"] == 40
    assert c.get("/admin/usage?since=2999-01-01", headers=bearer(admin)).json["rows"] == []
    assert c.get("/admin/usage?since=yesterday", headers=bearer(admin)).status_code == 400
    assert c.get("/admin/usage", headers=bearer(tokens[0])).status_code == 403
    # the CLI
    out = io.StringIO()
    assert cli.main(["usage", "--key", "ben", "--json"], settings=Settings.from_env(
        {}, KEYS_DB=db), out=out) == 0
    shown = json.loads(out.getvalue())
    assert shown["totals"]["requests"] == 2 and \
        {x["model"] for x in shown["rows"]} == {"smollm2"}
    out = io.StringIO()
    assert cli.main(["usage", "--days", "1"], settings=Settings.from_env({}, KEYS_DB=db),
                    out=out) == 0
    assert out.getvalue().splitlines()[-1].split()[:2] == ["total", "5"]
    # the metrics: the first two keys by name, the third "other"
    m = Scrape(c.get("/metrics", headers=bearer(admin)).get_data(as_text=True))
    assert m.value("proxy_key_requests_total", key="ann", model="smollm2") == 2
    assert m.labels("proxy_key_requests_total", "key") == {"ann", "ben", "other"}
    assert m.value("proxy_key_prompt_tokens_total") == 40
    assert m.value("proxy_key_completion_tokens_total", key="ann") == 10
    # a use key sees its own key's series only; the rest of the scrape as an admin's
    mine = Scrape(c.get("/metrics", headers=bearer(tokens[1])).get_data(as_text=True))
    for family in ("proxy_key_requests_total", "proxy_key_prompt_tokens_total",
                   "proxy_key_completion_tokens_total"):
        assert mine.labels(family, "key") == {"ben"}, family
    assert mine.value("proxy_key_requests_total", key="ben") == 2
    assert mine.type("proxy_key_requests") == "counter"
    assert mine.labels("proxy_requests_total", "model") == m.labels("proxy_requests_total", "model")


def test_models_lists_only_what_the_key_may_use(chat, tmp_path):
    db = str(tmp_path / "keys.db")
    s = SqliteStore(db)
    _, narrow = s.create("narrow", models=["qwen-moe"])      # an alias matches its entry
    _, wide = s.create("wide")
    c = make(chat, db)
    r = c.get("/v1/models", headers=bearer(narrow))
    assert r.status_code == 200 and [m["id"] for m in r.json["data"]] == ["qwen-35b"]
    r = c.get("/v1/models", headers=bearer(wide))
    assert [m["id"] for m in r.json["data"]] == ["smollm2", "qwen-35b"]


def test_model_names_are_asked_of_the_catalog_once(store, clock):
    asked = []
    catalog = {"smol": "smollm2"}

    def lookup(name):
        asked.append(name)
        return catalog.get(name)
    count = Counting(store, resolve=lookup, clock=clock)
    key, _ = store.create("erin")
    for _ in range(3):
        count.count(key, record("smol"))
        count.count(key, record("new-model"))
    assert asked == ["smol", "new-model"]           # an unknown name: not asked again at once
    catalog["new-model"] = "new-model-id"
    clock.sleep(31)
    count.count(key, record("new-model"))
    count.count(key, record("new-model"))
    assert asked == ["smol", "new-model", "new-model"]
    assert {r["model"]: r["requests"] for r in store.usage_rows()} == {
        "smollm2": 3, "new-model": 3, "new-model-id": 2}


def test_a_leased_requests_end_is_one_write_with_its_usage(chat, tmp_path):
    db = str(tmp_path / "keys.db")
    _, token = SqliteStore(db).create("lea", max_concurrent=2)
    c = make(chat, db)
    store = c.application.extensions["proxy"]["keys"]
    writes = []
    real = store._run
    store._run = lambda fn, write=False, key_id=None: (
        writes.append(write), real(fn, write, key_id))[1]
    chat.script(Reply(content="hello"))
    r = c.post("/v1/chat/completions", json=CHAT, headers=bearer(token))
    assert r.status_code == 200 and writes[-1] is True       # the key's lookup, its admission
    writes.clear()
    r.close()                               # the answer's end: the release with the usage row
    assert writes == [True]
    key = store.get("lea")
    assert store.usage(key).in_flight == 0
    assert [(x["requests"], x["prompt_tokens"]) for x in store.usage_rows()] == [(1, 10)]


def test_a_leased_end_the_database_refused_is_retried_whole(store, monkeypatch):
    monkeypatch.setattr(store, "_start_heartbeat", lambda: None)
    key, _ = store.create("flo", max_concurrent=1)
    lease = store.admit(key)
    store.cut()
    store.finish(key, lease, ("smollm2", Spent(1, prompt_tokens=7)))    # never raises
    assert store.pending() == 1
    store.down = False
    assert store.usage(key).in_flight == 1          # until the heartbeat's beat
    store.beat()
    assert store.usage(key).in_flight == 0 and store.pending() == 0
    assert [(r["requests"], r["prompt_tokens"]) for r in store.usage_rows()] == [(1, 7)]
