"""Loads you can see (issue 13), on the real engine: a backend that takes its
time to become healthy (`slow-start`: /health 503 for SLOW_START seconds),
the real swapper, the real proxy, the openai and anthropic SDKs."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.support.proxyproc import ProxyProcess
from tests.support.servers import wait_until
from tests.support.swapper_client import running
from tests.support.swapperproc import SwapperProcess, stack_containers

INTERVAL = 0.5


@pytest.fixture(scope="module")
def stack(docker_client):
    with SwapperProcess(KEEPALIVE_INTERVAL=str(INTERVAL), SLOW_START="4") as sw, \
            ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH="0", INJECT_SYSTEM="0") as px:
        yield sw, px
    assert stack_containers(docker_client, sw.stack) == []


@pytest.fixture(autouse=True)
def _unloaded(stack):
    requests.post(stack[0].url + "/unload", timeout=120)
    yield


def timed_chunks(r):
    """(seconds since the request, chunk) as the bytes arrive."""
    t0 = time.monotonic()
    for chunk in r.iter_content(chunk_size=None):
        yield time.monotonic() - t0, chunk


@pytest.mark.parametrize("via", ["swapper", "proxy"])
def test_a_stream_waiting_for_a_load_gets_comments_until_its_first_token(stack, via):
    sw, px = stack
    url = (sw if via == "swapper" else px).url
    t0 = time.monotonic()
    r = requests.post(url + "/v1/chat/completions", stream=True, timeout=120, json={
        "model": "slow-start", "stream": True, "messages": [{"role": "user", "content": "Hi"}]})
    headers_after = time.monotonic() - t0
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    arrivals = list(timed_chunks(r))
    body = b"".join(c for _, c in arrivals)
    comments = [line for line in body.split(b"\n") if line.startswith(b": ")]
    before = body[:body.index(b"Slow")]              # the backend's first token
    assert before.count(b": ") >= 3, before          # ~4 s at 0.5 s
    if via == "proxy":          # and the progress Qwen Code & co. count (proxy/progress.py)
        assert before.index(b'"delta":{"role":"assistant","content":""}') < \
            before.index(b'"delta":{"content":""}')
        assert before.count(b'"delta":{"content":""}') >= 2, before
    assert any(b"loading model slow-start" in c for c in comments), comments
    assert body.rstrip().endswith(b"data: [DONE]")
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in body.split(b"\n")
                   if line.startswith(b"data: {"))
    assert text == "Slow but sure."
    # Headers came before the load was done, and no gap in the bytes was long:
    # the load takes seconds, the interval is half a second (generous bounds,
    # this is a liveness check, not a speed one).
    assert headers_after < arrivals[-1][0]
    gaps = [b - a for (a, _), (b, _) in zip(arrivals, arrivals[1:])]
    assert max(gaps) < INTERVAL * 4, gaps


def test_the_openai_sdk_reads_a_stream_that_waited(stack):
    _, px = stack
    client = openai.OpenAI(base_url=px.url + "/v1", api_key="x", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(
        model="slow-start", stream=True, messages=[{"role": "user", "content": "Hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Slow but sure."


@pytest.mark.parametrize("via", ["swapper", "proxy"])
def test_the_anthropic_sdk_reads_a_messages_stream_that_waited(stack, via):
    """Through the proxy the wait is a thinking block (what Claude Code's idle timer
    counts) before the answer's text, signed so the proxy takes it out of the next turn."""
    import anthropic
    from proxy.progress import MARKER
    sw, px = stack
    client = anthropic.Anthropic(base_url=(sw if via == "swapper" else px).url, api_key="x",
                                 max_retries=0, timeout=120)
    with client.messages.stream(model="slow-start", max_tokens=16,
                                messages=[{"role": "user", "content": "Hi"}],
                                extra_body={"thinking": {"type": "adaptive"}}) as s:
        final = s.get_final_message()
    assert final.content[-1].text == "Slow but sure."
    if via == "proxy":
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].signature == MARKER
        assert "loading model slow-start" in final.content[0].thinking
    else:
        assert len(final.content) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_load_that_fails_mid_wait_ends_the_stream_with_an_error_event(stack, path):
    sw, _ = stack
    r = requests.post(sw.url + path, stream=True, timeout=120, json={
        "model": "broken", "stream": True, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]})
    body = r.content
    assert r.status_code == 200 and body.startswith(b": ")
    last = [line for line in body.split(b"\n") if line.startswith(b"data: ")][-1]
    err = json.loads(last[6:])
    if path == "/v1/messages":
        assert b"event: error" in body and err["type"] == "error"
        assert "no-such-model" in err["error"]["message"]
    else:
        assert err["error"]["code"] == "load_failed"
        assert "no-such-model" in err["error"]["message"]
    wait_until(lambda: running(sw)["queued"] == 0 and running(sw)["in_flight"] == 0,
               "idle", 10, every=0.2)


def test_status_on_v1_models_and_the_router_api_through_the_proxy(stack):
    sw, px = stack

    def status(model, where="/v1/models"):
        data = requests.get(px.url + where, timeout=10).json()["data"]
        return next(m for m in data if m["id"] == model)["status"]["value"]

    assert status("tiny-b") == "unloaded" and status("tiny-b", "/models") == "unloaded"
    r = requests.post(px.url + "/models/load", json={"model": "b"}, timeout=180)
    assert r.status_code == 200 and r.json()["success"] is True
    assert status("tiny-b") == "loaded" and status("tiny-b", "/models") == "loaded"
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(requests.post, px.url + "/models/load",
                              json={"model": "slow-start"}, timeout=180)
        wait_until(lambda: status("slow-start") == "loading", "slow-start loading", 30, every=0.2)
        assert status("tiny-b") == "unloaded"
        assert loading.result().status_code == 200
    assert status("slow-start") == "loaded"
    r = requests.post(px.url + "/models/load", json={"model": "broken"}, timeout=120)
    assert r.status_code == 502
    failed = next(m for m in requests.get(px.url + "/models", timeout=10).json()["data"]
                  if m["id"] == "broken")["status"]
    assert failed["value"] == "failed" and "no-such-model" in failed["failure"]
    r = requests.post(px.url + "/models/unload", json={"model": "slow-start"}, timeout=60)
    assert r.status_code == 200
    assert status("slow-start") == "unloaded"
    assert requests.post(px.url + "/models/load", json={}, timeout=10).status_code == 400


def test_events_tell_the_transitions(stack):
    sw, px = stack
    seen = []
    r = requests.get(px.url + "/events", stream=True, timeout=60)
    assert r.status_code == 200

    def read():
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                ev = json.loads(line[6:])
                seen.append(ev)
                if ev["event"] == "unloaded" and ev.get("model") == "tiny-b":
                    return
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(read)
        assert requests.post(sw.url + "/load/b", timeout=180).status_code == 200
        assert requests.post(sw.url + "/load/broken", timeout=120).status_code == 502
        reader.result(timeout=60)
    r.close()
    kinds = [(e["event"], e.get("model")) for e in seen]
    assert kinds[0][0] == "state"
    for want in [("queued", "tiny-b"), ("load_started", "tiny-b"), ("ready", "tiny-b"),
                 ("unloading", "tiny-b"), ("unloaded", "tiny-b")]:
        assert want in kinds, (want, kinds)
    ready = next(e for e in seen if e["event"] == "ready")
    assert ready["seconds"] > 0 and ready["previous"] == "loading"
    assert kinds.index(("load_started", "tiny-b")) < kinds.index(("ready", "tiny-b"))


def test_preload_and_idle_model(docker_client):
    """PRELOAD loads at start; IDLE_MODEL comes back when another model's
    idle_ttl ends (tiny-ttl: 2 s)."""
    with SwapperProcess(PRELOAD="b", IDLE_MODEL="tiny-b") as sw:
        wait_until(lambda: running(sw)["model"] == "tiny-b" and running(sw)["state"] == "ready",
                   "PRELOAD loaded tiny-b", 120, every=0.2)
        assert requests.post(sw.url + "/load/tiny-ttl", timeout=180).status_code == 200
        wait_until(lambda: running(sw)["model"] == "tiny-b" and running(sw)["state"] == "ready",
                   "IDLE_MODEL tiny-b back after tiny-ttl's idle TTL", 120, every=0.2)
        time.sleep(3)                       # the resting model is never expired itself
        assert running(sw)["model"] == "tiny-b"
        (c,) = stack_containers(docker_client, sw.stack)
        assert c.labels["org.coding-stack.model"] == "tiny-b"


def test_an_unknown_preload_model_stops_the_swapper_with_a_clear_message():
    import subprocess
    import sys
    from tests.support.process import REPO
    from tests.support.swapperproc import FIXTURE_BACKENDS, load_testbed_env
    p = subprocess.run([sys.executable, "-m", "swapper"], cwd=REPO, capture_output=True,
                       text=True, timeout=60,
                       env={**__import__("os").environ, **load_testbed_env(),
                            "BACKENDS_DIR": str(FIXTURE_BACKENDS), "PRELOAD": "nope"})
    assert p.returncode == 2
    assert "PRELOAD='nope' is not a model of the registry" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {}),                                   # web_search injected
    ("/v1/messages", {"max_tokens": 16, "tools": [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]}),
])
def test_search_streams_pass_the_progress_on(stack, path, body):
    """With server-side search the proxy parses the stream itself: the waiting
    comments still reach the client (the model answers without searching)."""
    sw, _ = stack
    with ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH="1", INJECT_SYSTEM="0",
                      SEARXNG_URL="http://127.0.0.1:9") as px:
        r = requests.post(px.url + path, stream=True, timeout=120, json={
            "model": "slow-start", "stream": True,
            "messages": [{"role": "user", "content": "Hi"}], **body})
        data = r.content
    assert r.status_code == 200, data
    assert data.startswith(b": ") and b"loading model slow-start" in data, data[:300]
    assert b"Slow " in data and b"sure." in data


def test_a_load_done_before_gives_the_next_one_an_eta_and_requests_their_wait(stack):
    """Past loads make an ETA (the real engine, slow-start's ~4 s): the next load's
    `load_started` event and the waiting stream's comments carry it; the stream's
    last comment is its queue wait, which the proxy's activity list shows."""
    from tests.support.sseclient import told_waits
    sw, px = stack
    assert requests.post(sw.url + "/load/slow-start", timeout=120).status_code == 200
    assert running(sw)["last_load_seconds"] > 0
    requests.post(sw.url + "/unload", timeout=120)
    events, stream = [], requests.get(sw.url + "/events", stream=True, timeout=120)

    def follow():
        try:
            for line in stream.iter_lines():
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
        except (requests.RequestException, AttributeError, ValueError):
            pass                                  # closed at the end
    import threading
    threading.Thread(target=follow, daemon=True).start()
    wait_until(lambda: events, "the first event", 10, every=0.2)
    r = requests.post(px.url + "/v1/chat/completions", stream=True, timeout=120, json={
        "model": "slow-start", "stream": True, "messages": [{"role": "user", "content": "Hi"}]})
    body = r.content
    stream.close()
    assert r.status_code == 200
    loading = [c for c in body.split(b"\n") if c.startswith(b": loading model slow-start")]
    assert loading and all(c.endswith(b" s left") for c in loading), loading
    wait, _ = told_waits(body)
    assert wait is not None and wait > 0
    assert body.index(b": queue-wait ") < body.index(b"Slow")    # before the model's events
    started = [e for e in events if e["event"] == "load_started" and e["model"] == "slow-start"]
    assert started and started[-1]["expected_seconds"] > 0, events
    rec = [x for x in requests.get(px.url + "/ui/activity", timeout=10).json()["data"]
           if x.get("model") == "slow-start"][-1]
    assert rec["queue_wait"] == wait
