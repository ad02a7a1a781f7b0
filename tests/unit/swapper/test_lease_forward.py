"""The swapper's request path on the fake runtime with real HTTP backends
(scripted servers on loopback sockets): every admitted request ends its lease
exactly once, whatever ends it (answer read, body never read, broken stream,
failure before the answer, fan-out member); a request that never reached its
backend is sent again, never failed."""
import json
import time

import pytest

from tests.support.chat import Reply, ScriptedChat
from tests.support.fake_runtime import FakeRuntime
from tests.support.servers import Relay
from tests.support.swapper_app import ask, make_app, settled


@pytest.fixture
def chat():
    with ScriptedChat() as c:
        yield c


def broken_stream(client, **extra) -> bytes:
    """A streamed answer that breaks off: what came (an error event last), and
    then the transfer breaks (common.streaming.BrokenRelay), so the client
    cannot take it for a whole answer."""
    from common.streaming import BrokenRelay
    body = {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, **extra}
    r = client.post("/v1/chat/completions", json=body, buffered=False)
    got = []
    with pytest.raises(BrokenRelay):
        for piece in r.response:
            got.append(piece)
    r.close()
    return b"".join(got)


def test_answer_read_to_the_end_frees_the_slot(chat):
    chat.script(Reply("one"), Reply("two"))
    app, _ = make_app({"tiny-b": chat.url})
    c = app.test_client()
    assert ask(c).json["choices"][0]["message"]["content"] == "one"
    r = ask(c, stream=True)
    assert b"two"[:2] in r.data and r.data.endswith(b"data: [DONE]\n\n")
    assert settled(app)["in_flight"] == 0


def test_head_never_holds_a_slot_nor_loads(chat):
    """Issue 9.1: HEAD held a slot for good (the body, never read, released it);
    issue 28: a HEAD loaded the model. /upstream refuses it before admission."""
    app, runtime = make_app({"tiny-a": chat.url})
    c = app.test_client()
    for _ in range(2):                           # the model's 2 slots
        r = c.head("/upstream/tiny-a/health", buffered=True)
        assert r.status_code == 405 and r.headers["Allow"] == "GET, OPTIONS"
    assert settled(app)["in_flight"] == 0
    assert not [call for call in runtime.calls if call[0] == "start"]
    chat.script(Reply("after"))
    assert ask(c, "tiny-a").json["choices"][0]["message"]["content"] == "after"


def test_a_stream_that_breaks_ends_with_an_error_event_and_frees_the_slot(chat):
    chat.script(Reply("a long answer", break_after=3), Reply("next"))
    app, _ = make_app({"tiny-b": chat.url})
    c = app.test_client()
    data = broken_stream(c)
    events = [json.loads(line[6:]) for line in data.split(b"\n\n")
              if line.startswith(b"data: {")]
    assert events[-1]["error"]["code"] == "backend_failed"
    assert settled(app)["in_flight"] == 0
    assert ask(c).status_code == 200


def test_a_backend_error_status_is_relayed_and_frees_the_slot(chat):
    chat.script(Reply(status=500, error="boom"), Reply("fine"))
    app, _ = make_app({"tiny-b": chat.url})
    c = app.test_client()
    r = ask(c)
    assert r.status_code == 500 and r.json["error"]["message"] == "boom"
    assert settled(app)["in_flight"] == 0
    assert ask(c).status_code == 200


def test_a_request_closed_before_any_answer_is_sent_again_on_a_fresh_connection(chat):
    """Issue 9.2: llama-server closes a kept-alive connection after a stream;
    the request that met it got 502. Never reached = sent again."""
    chat.script(Reply("answered"))
    drop = Relay(chat.url, drop_first=True)
    app, runtime = make_app({"tiny-b": drop.url})
    r = ask(app.test_client())
    assert r.status_code == 200, r.data
    assert r.json["choices"][0]["message"]["content"] == "answered"
    assert drop.dropped == 1
    assert [c for c in runtime.calls if c[0] == "start"] == [("start", "tiny-b")]
    assert settled(app)["in_flight"] == 0


def test_a_request_sent_again_tells_the_load_its_first_try_waited_for(chat):
    """The second try is admitted at once; the load seconds charged to the first
    (it waited for the load) are still the request's (X-Load-Seconds)."""
    chat.script(Reply("answered"))
    drop = Relay(chat.url, drop_first=True)

    class SlowStart(FakeRuntime):           # a load long enough to be told apart from 0
        def start(self, spec, on_progress=None, prepared=None):
            time.sleep(0.2)
            return super().start(spec, on_progress, prepared)

    app, runtime = make_app({"tiny-b": drop.url}, SlowStart({"tiny-b": drop.url}))
    charged = []
    app.extensions["swapper"].scheduler.listeners.subscribe(
        lambda e, f: charged.append(f["seconds"]) if e == "charged" else None)
    r = ask(app.test_client())
    assert r.status_code == 200 and drop.dropped == 1, r.data
    assert len(charged) == 1
    assert float(r.headers["X-Load-Seconds"]) == pytest.approx(charged[0], abs=0.002)


def test_first_request_after_a_crash_restarts_the_model_and_succeeds(chat):
    """Issue 9.3: the first request after `docker kill` went to the dead
    container and failed. Docker still calls it running for a while."""
    first = ScriptedChat().__enter__()
    first.script(Reply("first"))
    app, runtime = make_app({"tiny-b": first.url})
    c = app.test_client()
    assert ask(c).status_code == 200
    first.__exit__(None, None, None)                  # its port now refuses
    runtime.kill("tiny-b", reported_running=2)
    runtime.urls["tiny-b"] = chat.url                 # where the restarted one serves
    chat.script(Reply("after the crash"))
    r = ask(c)
    assert r.status_code == 200, r.data
    assert r.json["choices"][0]["message"]["content"] == "after the crash"
    assert [x for x in runtime.calls if x[0] == "start"] == [("start", "tiny-b")] * 2
    assert settled(app)["in_flight"] == 0


def test_a_request_that_reached_the_backend_is_not_sent_twice(chat):
    """A non-streamed request whose backend broke off mid-body is answered
    with an error, not silently run again."""
    chat.script(Reply("x" * 4000, break_after=2))
    app, _ = make_app({"tiny-b": chat.url})
    assert b"backend_failed" in broken_stream(app.test_client())
    assert len(chat.requests) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_fan_out_members_each_hold_a_slot_and_all_end(chat, stream):
    """n=3 on a 1-slot model: three member requests, one at a time, merged."""
    chat.script(Reply("red"), Reply("green"), Reply("blue"))
    app, _ = make_app({"tiny-b": chat.url})
    seen = []
    parts = app.extensions["swapper"]
    orig = parts.scheduler._admit

    def spy(t):
        orig(t)
        seen.append(sum(1 for x in parts.scheduler._active if x.model == "tiny-b"))
    parts.scheduler._admit = spy
    r = ask(app.test_client(), n=3, stream=stream)
    assert r.status_code == 200, r.data
    if stream:
        idx = {c["index"] for line in r.data.split(b"\n\n") if line.startswith(b"data: {")
               for c in json.loads(line[6:])["choices"]}
        assert idx == {0, 1, 2}
    else:
        assert sorted(c["index"] for c in r.json["choices"]) == [0, 1, 2]
    assert len(chat.requests) == 3 and all("n" not in b for b in chat.requests)
    assert max(seen) == 1                             # never over the model's slots
    assert settled(app)["in_flight"] == 0


def test_fan_out_member_failure_fails_the_request_and_frees_every_slot(chat):
    chat.script(Reply("ok"), Reply(status=500, error="member broke"), Reply("ok"))
    app, _ = make_app({"tiny-b": chat.url})
    r = ask(app.test_client(), n=3)
    assert r.status_code == 500
    snap = settled(app)
    assert snap["in_flight"] == 0 and snap["queued"] == 0


def test_engine_down_when_a_load_is_needed_is_a_clear_503(chat):
    app, runtime = make_app({"tiny-b": chat.url})
    runtime.engine_up = False
    r = ask(app.test_client())
    assert r.status_code == 503
    assert r.json["error"]["code"] == "docker_unavailable"
    hz = app.test_client().get("/healthz")
    assert hz.status_code == 503 and hz.json["status"] == "degraded"
    runtime.engine_up = True
    chat.script(Reply("back"))
    r = ask(app.test_client())
    assert r.status_code == 200, r.data


@pytest.mark.parametrize("n", [0, 9, "2", 1.5, True])
def test_n_out_of_range_is_refused_before_any_load(chat, n):
    """The swapper owns `n` (MAX_N, 8 by default): one checker, one code."""
    app, runtime = make_app({"tiny-b": chat.url})
    r = ask(app.test_client(), n=n)
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_n", r.json
    assert runtime.calls == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", [
    b"SSH-2.0-OpenSSH_9.2\r\n\r\n",                                 # not HTTP at all
    b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n{}",          # a length that is none
])
def test_a_backend_answering_garbage_is_a_502_envelope_sent_once_and_frees_the_slot(
        answer, stream):
    """Not HTTP is the backend's fault, not a stale connection: one try, a 502
    `upstream_error` in the envelope (a stream too: it fails before its first
    event), the slot back."""
    from tests.support.servers import Scripted
    srv = Scripted(answer)
    try:
        app, _ = make_app({"tiny-b": srv.url})
        r = ask(app.test_client(), stream=stream)
        assert r.status_code == 502, r.data
        err = json.loads(r.data)["error"]           # admitted at once: before any event
        assert err["code"] == "upstream_error" and "tiny-b" in err["message"]
        assert srv.connections == 1
        assert settled(app)["in_flight"] == 0
    finally:
        srv.close()


def test_an_agents_tier_name_goes_to_the_resident_model_without_a_swap(chat):
    """Claude Code's background calls name its haiku tier; Codex its gpt-5 names:
    the resident model answers them (no 404, no swap), counted by pattern."""
    chat.script(Reply("resident"), Reply("haiku"), Reply("codex"))
    app, runtime = make_app({"tiny-a": chat.url, "tiny-b": chat.url})
    c = app.test_client()
    assert ask(c, "tiny-a").status_code == 200
    for name in ("claude-haiku-4-5-20251001", "gpt-5.1-codex"):
        r = ask(c, name)
        assert r.status_code == 200, r.data
    assert [x for x in runtime.calls if x[0] == "start"] == [("start", "tiny-a")]
    assert [b["model"] for b in chat.requests] == ["tiny-a"] * 3   # the id, not the tier
    text = c.get("/metrics").data.decode()
    assert 'swapper_models_mapped_total{model="tiny-a",pattern="claude-*"} 1.0' in text
    assert c.post("/load/claude-haiku-4-5").status_code == 404     # operators' names: strict


def test_a_tier_name_stays_within_the_keys_scope(chat):
    """Issue 35: the proxy tells the swapper a key's scope; an agent's tier name
    is mapped within it (here: a swap to the model the key may use, not the
    resident one), a model outside it is a 403, an unknown name's 404 names only
    the models inside it, and the field never reaches the backend."""
    chat.script(Reply("resident"), Reply("in scope"))
    app, runtime = make_app({"tiny-a": chat.url, "tiny-b": chat.url})
    c = app.test_client()

    def scoped(model, scope, path="/v1/chat/completions"):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "input": "x"}
        return c.post(path, json=body, buffered=True,
                      headers={"X-Coding-Stack-Tenant": "bob",
                               "X-Coding-Stack-Models": scope})
    assert ask(c, "tiny-a").status_code == 200
    r = scoped("claude-haiku-4-5", '["b"]')             # by alias
    assert r.status_code == 200, r.data
    assert [b["model"] for b in chat.requests] == ["tiny-a", "tiny-b"]
    assert [x for x in runtime.calls if x[0] == "start"] == [("start", "tiny-a"),
                                                               ("start", "tiny-b")]
    r = scoped("claude-haiku-4-5", '["tiny-b"]', "/v1/embeddings")   # now resident: no swap
    assert r.status_code == 200
    assert "x-coding-stack-models" not in {k.lower() for k in chat.other[-1]["headers"]}
    for model, scope in (("tiny-a", '["tiny-b"]'), ("claude-opus-4-8", '["tiny-z*"]'),
                         ("claude-opus-4-8", "not json")):
        r = scoped(model, scope)
        assert r.status_code == 403 and r.json["error"]["code"] == "model_not_allowed", r.data
    r = scoped("nope", '["tiny-b"]')
    assert r.status_code == 404
    assert r.json["error"]["message"].endswith("known models: tiny-b (b)")
    assert [x for x in runtime.calls if x[0] == "start"][2:] == [], "no load for a refusal"
