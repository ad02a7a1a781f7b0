"""Each request's queue wait, from the swapper to the proxy's activity list: the
real swapper in-process (its Docker runtime the fake one, a load held until the
test lets it go), a scripted model behind it, the real proxy app in front. A
stream that waited for the load hears `: queue-wait <s>` before the model's
events; an answer relayed once admitted carries X-Queue-Wait; the proxy puts
the seconds in the request's record (/ui/activity)."""
from __future__ import annotations

import threading

import pytest

from common import queuewait, sse
from proxy.record import Record, noting_waits
from proxy.app import create_app as proxy_app
from proxy.settings import Settings as ProxySettings
from swapper.app import create_app as swapper_app
from swapper.settings import Settings as SwapperSettings
from tests.support.chat import Reply, ScriptedChat
from tests.support.fake_runtime import FakeRuntime
from tests.support.servers import ServerThread, wait_until
from tests.support.sseclient import told_waits
from tests.support.swapperproc import ENV, FIXTURE_BACKENDS


class GatedRuntime(FakeRuntime):
    """Starts wait until the test opens the gate."""

    def __init__(self, urls):
        super().__init__(urls)
        self.gate = threading.Event()

    def start(self, spec, on_progress=None, prepared=None):
        self.gate.wait(30)
        return super().start(spec, on_progress, prepared)


@pytest.fixture
def stack():
    with ScriptedChat() as model:
        runtime = GatedRuntime({"tiny-a": model.url})
        sw = swapper_app(SwapperSettings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=ENV,
                                         WATCH_INTERVAL=0.05, KEEPALIVE_INTERVAL=0.05),
                         runtime=runtime)
        with ServerThread(sw) as swapper:
            px = proxy_app(ProxySettings.from_env({}, BACKEND_URL=swapper.url, WEB_SEARCH=False,
                                                  MODELS_TTL=0, KEEPALIVE_INTERVAL=0.05))
            yield px.test_client(), sw.extensions["swapper"], runtime, model


def records(client) -> list[dict]:
    return client.get("/ui/activity").json["data"]


def test_a_stream_that_waited_for_the_load_and_a_request_admitted_at_once(stack):
    client, sw, runtime, model = stack
    model.script(Reply(content="hello there"), Reply(content="again"))
    got, pieces, waiting = {}, [], threading.Event()

    def ask():
        r = client.post("/v1/chat/completions", buffered=False, json={
            "model": "tiny-a", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        got["status"] = r.status_code
        for piece in r.response:
            pieces.append(piece)
            if b": loading model tiny-a" in piece:
                waiting.set()             # the swapper's waiting stream has begun
        r.close()

    t = threading.Thread(target=ask)
    t.start()
    assert waiting.wait(30), pieces
    runtime.gate.set()                    # the load may end now
    t.join(30)
    assert got["status"] == 200
    body = b"".join(pieces)
    wait, load = told_waits(body)
    assert wait is not None and wait > 0
    # before the backend's events; the client's progress chunks (proxy/progress.py) first
    assert body.index(b'"delta":{"role":"assistant","content":""}') < \
        body.index(b": queue-wait ") < body.index(b'"model":"scripted-model"')
    (rec,) = records(client)
    assert rec["queue_wait"] == wait and rec["queue_wait"] <= rec["seconds"]
    assert rec["status"] == 200 and rec["stream"] is True
    # the load's seconds, all charged to it (it alone waited), in the same comment event
    assert load is not None and load <= wait
    assert body.index(b": queue-wait ") < body.index(b": load-seconds ") < \
        body.index(b'"model":"scripted-model"')

    # Loaded now: admitted at once, the wait in the relayed answer's header.
    r = client.post("/v1/chat/completions", json={
        "model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    header = queuewait.from_header(r.headers.get("X-Queue-Wait"))
    assert header is not None
    assert r.headers.get("X-Load-Seconds") == "0.000"     # it waited for no load
    r.close()                             # the record is made once the answer has gone
    assert [x["queue_wait"] for x in records(client)] == [wait, header]


def test_a_passed_through_request_has_its_wait_too(stack):
    client, sw, runtime, model = stack
    runtime.gate.set()
    r = client.post("/v1/completions", json={"model": "tiny-a", "prompt": "hi"})
    assert r.status_code == 200          # the scripted model echoes it
    assert "X-Queue-Wait" in r.headers
    r.close()
    (rec,) = records(client)
    assert rec["dialect"] == "completions"
    assert rec["queue_wait"] == queuewait.from_header(r.headers["X-Queue-Wait"])


def test_a_fanned_out_request_tells_its_members_load_seconds_summed(stack):
    """n=3 on a 2-slot llama.cpp model: three members, one answer; its
    X-Load-Seconds (what the key counts) is the load's whole charge, the only
    tenant's (the swapper's `charged` event)."""
    client, sw, runtime, model = stack
    model.script(*[Reply(content=f"take {i}") for i in range(3)])
    got, charged = {}, []
    sw.scheduler.listeners.subscribe(
        lambda e, f: charged.append(f["seconds"]) if e == "charged" else None)

    def ask():
        got["r"] = client.post("/v1/chat/completions", json={
            "model": "tiny-a", "n": 3, "messages": [{"role": "user", "content": "hi"}]})

    t = threading.Thread(target=ask)
    t.start()
    wait_until(lambda: sw.scheduler.snapshot()["state"] == "loading", "the load")
    runtime.gate.set()
    t.join(30)
    r = got["r"]
    assert r.status_code == 200 and len(r.json["choices"]) == 3
    told = queuewait.from_header(r.headers.get("X-Load-Seconds"))
    r.close()
    assert len(charged) == 1 and told == pytest.approx(charged[0], abs=0.002)


def test_wait_pieces_parsed_summed_and_only_before_the_first_event():
    assert told_waits(b": keep-alive\n\n") == (None, None)
    assert told_waits(queuewait.comment(1.25)) == (1.25, None)
    assert told_waits(b": loading x\r\n\r\n: queue-wait 0.5\r\n\r\n") == (0.5, None)
    assert queuewait.from_event(sse.Event.comment(b": loading x\n\n")) == (None, None)
    assert queuewait.from_header("0.012") == 0.012
    for bad in (None, "", "soon", "-1", "nan"):
        assert queuewait.from_header(bad) is None
    rec = Record("/v1/chat/completions", "chat")
    pieces = [b": loading\n\n", queuewait.comment(2.0) + b"data: {}\n\n",
              queuewait.comment(9.0)]          # after the first event: the model's bytes
    assert list(noting_waits(pieces, rec)) == pieces
    assert rec.queue_wait == 2.0
    rec.note_wait(0.5)                            # another search round's
    rec.note_wait(None)
    assert rec.queue_wait == 2.5
    assert list(noting_waits(pieces, None)) == pieces    # no record


def test_a_passed_through_stream_that_waited():
    """/v1/completions streamed (the proxy's pass-through route): the wait comes in
    the stream's comment, the bytes reach the client as they came."""
    from flask import Flask, Response
    stream = b": loading model m\n\n" + queuewait.comment(1.5) + \
        b'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n'
    up = Flask("waited")
    up.post("/v1/completions")(lambda: Response(stream, mimetype="text/event-stream"))
    with ServerThread(up) as server:
        client = proxy_app(ProxySettings.from_env({}, BACKEND_URL=server.url, WEB_SEARCH=False,
                                                  MODELS_TTL=0)).test_client()
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 200 and r.data == stream
        r.close()
        (rec,) = records(client)
    assert rec["dialect"] == "completions" and rec["queue_wait"] == 1.5


def test_load_seconds_read_into_the_record_from_the_comment_and_the_header():
    """The swapper's load seconds (its share of the load the request waited for):
    the comment's second line or the X-Load-Seconds header, summed over rounds;
    a swapper that tells none leaves None; a reader of the queue wait alone still
    reads the new comment."""
    both = queuewait.comment(2.0, 1.5)
    assert both == b": queue-wait 2.000\n: load-seconds 1.500\n\n"
    assert told_waits(both) == (2.0, 1.5)
    assert queuewait.from_event(sse.Event.comment(both)) == (2.0, 1.5)   # one event, two lines
    assert told_waits(queuewait.comment(2.0))[1] is None               # an older swapper
    rec = Record("/v1/chat/completions", "chat")
    pieces = [b": loading\n\n", both + b"data: {}\n\n", queuewait.comment(9.0, 9.0)]
    assert list(noting_waits(pieces, rec)) == pieces
    assert (rec.queue_wait, rec.load_seconds) == (2.0, 1.5)
    rec.note_header({"X-Queue-Wait": "0.250", "X-Load-Seconds": "0.750"})   # another round
    assert (rec.queue_wait, rec.load_seconds) == (2.25, 2.25)
    old = Record("/v1/chat/completions", "chat")
    old.note_header({"X-Queue-Wait": "0.250"})
    assert list(noting_waits([queuewait.comment(1.0) + b"data: {}\n\n"], old))
    assert (old.queue_wait, old.load_seconds) == (1.25, None)
    from proxy.keys.usage import spent_of
    assert spent_of(rec).load_seconds == 2.25 and spent_of(old).load_seconds == 0.0
