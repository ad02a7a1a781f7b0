"""The console's server side, in-process: the page and its assets load without the
key and carry no data, the activity JSON needs it, the ring is bounded, and a
model request's record carries what its answer said (TTFT, tokens, rate)."""
from __future__ import annotations

import json
import time

from flask import Flask, Response, request

from proxy.activity import Activity
from proxy.app import create_app
from proxy.metrics import Metrics
from proxy.record import Record
from proxy.settings import Settings

USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}

UP = "http://upstream.test"


def app(**kw):
    return create_app(Settings.from_env({}, BACKEND_URL=UP, WEB_SEARCH=False, MODELS_TTL=0,
                                        **kw)).test_client()


def test_page_and_assets_public_data_behind_the_key():
    c = app(API_KEY="sekret")
    page = c.get("/ui")
    assert page.status_code == 200 and b"console.js" in page.data
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    for asset in ("/ui/static/console.js", "/ui/static/console.css"):
        assert c.get(asset).status_code == 200
    assert c.get("/ui/static/other.js").status_code == 401          # only the two assets
    assert c.get("/ui/activity").status_code == 401
    assert c.get("/ui/activity?key=sekret").status_code == 401       # never in a URL
    ok = c.get("/ui/activity", headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json == {"object": "list", "data": [], "newest": 0}


def test_ring_is_bounded_and_incremental():
    ring = Activity(size=5)
    for i in range(12):
        ring.add({"dialect": Activity.dialect("/v1/chat/completions"), "n": i})
    entries, newest = ring.since(0)
    assert [e["n"] for e in entries] == [7, 8, 9, 10, 11] and newest == 12
    assert [e["seq"] for e in ring.since(10)[0]] == [11, 12]
    assert ring.since(12) == ([], 12)
    rec = Record("/running", Activity.dialect("/running"), "GET")
    rec.end()
    ring.record(rec)                                # not a model request: not listed
    assert rec.dialect is None and ring.since(0)[1] == 12


def observed(body: bytes, stream: bool, rounds: int | None = None) -> list[dict]:
    """One answer through the metrics hook, as the app's hooks run it; the ring after."""
    ring = Activity()
    metrics = Metrics(activity=ring)
    flask_app = Flask(__name__)
    with flask_app.test_request_context("/v1/chat/completions", method="POST",
                                        json={"model": "tiny-a", "messages": []}):
        request.get_data()
        rec = Record("/v1/chat/completions", Activity.dialect("/v1/chat/completions"),
                     request.method, time.perf_counter())
        rec.model = "tiny-a"
        if rounds is not None:
            metrics.rounds(rounds)                  # the search loop, in the request
            rec.rounds = rounds
        mimetype = "text/event-stream" if stream else "application/json"
        resp = Response(iter([body]) if stream else body, mimetype=mimetype)
        resp = metrics.observe(resp, rec)
        if resp.is_streamed:
            for _ in resp.response:
                pass
            resp.response.close()
        else:
            resp.close()
    return ring.since(0)[0]


def test_a_streamed_answer_is_recorded_with_ttft_tokens_and_rounds():
    def ev(o):
        return b"data: " + json.dumps(o).encode() + b"\n\n"
    delta = {"choices": [{"index": 0, "delta": {"content": "a"}}], "model": "x.gguf"}
    body = ev(delta) + ev(delta) + ev({"choices": [], "usage": USAGE,
                                       "timings": {"predicted_per_second": 42.0}}) \
        + b"data: [DONE]\n\n"
    [rec] = observed(body, stream=True, rounds=2)
    assert rec["dialect"] == "chat" and rec["status"] == 200 and rec["stream"] is True
    assert rec["model"] == "tiny-a" and rec["search_rounds"] == 2
    assert rec["prompt_tokens"] == 11 and rec["completion_tokens"] == 3
    assert rec["tokens_per_second"] == 42.0 and rec["ttft"] >= 0 and rec["seconds"] >= 0


def test_a_whole_answer_is_recorded_once_sent():
    body = json.dumps({"model": "x.gguf", "usage": USAGE,
                       "choices": [{"message": {"content": "hi"}}]}).encode()
    [rec] = observed(body, stream=False)
    assert rec["prompt_tokens"] == 11 and rec["completion_tokens"] == 3
    assert rec["stream"] is False and rec["ttft"] is None and "search_rounds" not in rec
