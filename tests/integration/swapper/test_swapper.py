"""The real swapper against the real Docker engine, the real llama-server image
and the real small model."""
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import docker
import requests

from tests.support.servers import post_and_abandon, wait_until
from tests.support.swapper_client import chat, data_until_broken, metric, running
from tests.support.swapperproc import InvariantSampler, SwapperProcess, stack_containers


# ------------------------------------------------------------------ surface

def test_models_lists_the_registry(swapper):
    r = requests.get(swapper.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    data = {m["id"]: m for m in r.json()["data"]}
    assert {"tiny-a", "tiny-b", "broken", "gpu-model"} <= set(data)
    assert data["tiny-a"]["kind"] == "llamacpp"
    assert data["tiny-a"]["aliases"] == ["a"]
    assert data["tiny-a"]["context_length"] == 1024


def test_unknown_model_is_404_naming_the_known_ones(swapper):
    r = chat(swapper.url, "no-such-model")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found"
    assert "no-such-model" in err["message"] and "tiny-a" in err["message"]
    assert requests.post(swapper.url + "/load/nope", timeout=10).status_code == 404


def test_bad_json_is_400(swapper):
    r = requests.post(swapper.url + "/v1/chat/completions", data=b"{not json",
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def test_healthz(swapper):
    r = requests.get(swapper.url + "/healthz", timeout=10)
    assert r.status_code == 200 and r.json()["docker"] is True


# ------------------------------------------------------------ load and chat

def test_load_then_chat_streamed_and_not(swapper, invariant):
    r = requests.post(swapper.url + "/load/a", timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == "tiny-a" and r.json()["running"] == ["tiny-a"]
    again = requests.post(swapper.url + "/load/tiny-a", timeout=60).json()
    assert again["loaded"] == "tiny-a"
    assert again["seconds"] < r.json()["seconds"]      # no second load: it joined the resident

    r = chat(swapper.url, "a")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1

    r = chat(swapper.url, "tiny-a", stream=True)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers.get("X-Accel-Buffering") == "no"
    events = [l for l in r.iter_lines() if l.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    deltas = [json.loads(e[6:]) for e in events[:-1]]
    assert any(d["choices"] and d["choices"][0]["delta"].get("content") for d in deltas)

    state = running(swapper)
    assert state["model"] == "tiny-a" and state["state"] == "ready"
    assert state["in_flight"] == 0 and state["queued"] == 0


def test_missing_model_uses_the_default(swapper):
    r = chat(swapper.url, None)
    assert r.status_code == 200, r.text
    assert running(swapper)["model"] == "tiny-a"      # the first model in the registry


def test_published_port_reaches_the_backend_directly(swapper):
    assert requests.post(swapper.url + "/load/a", timeout=180).status_code == 200
    r = requests.get(swapper.backend_url + "/health", timeout=10)
    assert r.status_code == 200


def test_swap_between_models_keeps_one_resident(swapper, invariant, docker_client):
    assert chat(swapper.url, "a").status_code == 200
    assert chat(swapper.url, "b").status_code == 200
    assert running(swapper)["model"] == "tiny-b"
    assert chat(swapper.url, "a").status_code == 200

    def models():                       # b's stopped container is removed after a's load
        return [c.labels["org.coding-stack.model"]
                for c in stack_containers(docker_client, swapper.stack)]
    wait_until(lambda: models() == ["tiny-a"], "only tiny-a's container left", 10, every=0.05)
    assert invariant.seen_models[-3:] == ["tiny-a", "tiny-b", "tiny-a"]


def test_unload_frees_everything(swapper, docker_client):
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200
    r = requests.post(swapper.url + "/unload", timeout=60)
    assert r.status_code == 200 and r.json()["unloaded"] is True
    assert stack_containers(docker_client, swapper.stack) == []
    assert running(swapper)["model"] is None
    # unloading when nothing runs is fine too
    assert requests.post(swapper.url + "/unload", timeout=10).json()["unloaded"] is True
    # a GET changes nothing (issue 28: a web page's <img> unloaded the model)
    r = requests.get(swapper.url + "/unload", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"


def test_idle_ttl_unloads(swapper, docker_client):
    assert requests.post(swapper.url + "/load/tiny-ttl", timeout=180).status_code == 200
    wait_until(lambda: running(swapper)["model"] is None, "TTL unload", 60, every=0.2)
    assert stack_containers(docker_client, swapper.stack) == []


def test_logs_of_the_backend(swapper):
    assert requests.post(swapper.url + "/load/a", timeout=180).status_code == 200
    r = requests.get(swapper.url + "/logs/a?tail=50", timeout=10)
    assert r.status_code == 200 and "llama" in r.text.lower()
    with requests.get(swapper.url + "/logs/a/stream?tail=5", stream=True, timeout=10) as s:
        first = next(s.iter_content(chunk_size=None))
        assert first


# ------------------------------------------------------------------ failures

def test_start_failure_carries_the_log_lines(swapper, docker_client):
    r = requests.post(swapper.url + "/load/broken", timeout=120)
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert "model 'broken'" in msg and "failed to start" in msg
    assert "no-such-model.gguf" in msg            # from llama-server's own log
    assert stack_containers(docker_client, swapper.stack) == []
    # the swapper is fine afterwards
    assert chat(swapper.url, "a").status_code == 200


def test_start_timeout_is_504_with_logs(swapper, docker_client):
    r = requests.post(swapper.url + "/load/never-ready", timeout=120)
    assert r.status_code == 504, r.text
    msg = r.json()["error"]["message"]
    assert "start timeout" in msg and "pretending to load weights" in msg
    assert stack_containers(docker_client, swapper.stack) == []


def test_gpu_model_on_a_gpu_less_host_says_so(swapper, docker_client):
    r = chat(swapper.url, "gpu-model")
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert "gpu-model" in msg and "GPU" in msg
    assert stack_containers(docker_client, swapper.stack) == []


def test_crash_is_noticed_and_the_next_request_restarts(swapper, docker_client):
    assert requests.post(swapper.url + "/load/a", timeout=180).status_code == 200
    (c,) = stack_containers(docker_client, swapper.stack)
    # An in-flight stream gets an error event when the container dies under it,
    # and then its transfer breaks: no client can take it for a whole answer.
    r = chat(swapper.url, "a", stream=True, max_tokens=2000, ignore_eos=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    next(l for l in lines if l.startswith(b"data: "))
    c.kill()
    tail = data_until_broken(lines)
    assert tail and b'"error"' in tail[-1]
    wait_until(lambda: running(swapper)["model"] is None, "crash noticed", 30, every=0.2)
    assert metric(swapper, "swapper_crashes_total", model="tiny-a") >= 1
    r = chat(swapper.url, "a")
    assert r.status_code == 200, r.text
    (c2,) = stack_containers(docker_client, swapper.stack)
    assert c2.id != c.id


def test_a_crash_is_noticed_from_dockers_events_not_by_polling(docker_client):
    with SwapperProcess(WATCH_INTERVAL="300") as sw:       # the watch never polls here
        assert requests.post(sw.url + "/load/a", timeout=180).status_code == 200
        (c,) = stack_containers(docker_client, sw.stack)
        c.kill()
        wait_until(lambda: running(sw)["model"] is None, "crash noticed", 20, every=0.05)
        assert metric(sw, "swapper_crashes_total", model="tiny-a") == 1
        assert stack_containers(docker_client, sw.stack) == []


def test_client_disconnect_stops_generation(swapper):
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200  # one slot
    with chat(swapper.url, "b", stream=True, max_tokens=4000, ignore_eos=True) as r:
        next(l for l in r.iter_lines() if l.startswith(b"data: "))
    # The slot is free again soon after the client left (the backend stopped):
    def idle():
        slots = requests.get(swapper.backend_url + "/slots", timeout=5,
                             headers=swapper.backend_headers).json()
        return all(not s.get("is_processing") for s in slots)
    wait_until(idle, "backend slot idle after client disconnect", 30, every=0.2)
    assert running(swapper)["in_flight"] == 0


def test_client_disconnect_stops_a_non_streaming_generation(swapper):
    """The answer of a non-streaming request comes whole at the end; a client
    that leaves before closes the backend request all the same."""
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200  # one slot
    max_tokens = 900                # fits tiny-b's 1024-token context: only a cut ends it early
    def backend_metric(name):
        text = requests.get(swapper.backend_url + "/metrics", timeout=5,
                            headers=swapper.backend_headers).text
        return float(next(l.split()[1] for l in text.splitlines() if l.startswith(name + " ")))
    before = backend_metric("llamacpp:tokens_predicted_total")
    post_and_abandon(swapper.url, "/v1/chat/completions", {
        "model": "b", "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Say hello."}]})
    # Poll slowly: llama-server checks a non-streaming request's connection only
    # after 1 s with no other result, and every /metrics answer restarts that wait.
    wait_until(lambda: backend_metric("llamacpp:requests_processing") == 0,
               "backend idle after the client left", 120, every=2.5)
    predicted = backend_metric("llamacpp:tokens_predicted_total") - before
    assert 0 < predicted < max_tokens, f"{predicted} tokens generated: not cut at the disconnect"
    wait_until(lambda: running(swapper)["in_flight"] == 0, "slot released", 10, every=0.2)


# ------------------------------------------------------------ queue policy

def test_queue_full_answers_503_with_retry_after(docker_client):
    with SwapperProcess(MAX_QUEUE="1") as sw:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(requests.post, sw.url + "/load/never-ready", timeout=60)
            wait_until(lambda: running(sw)["state"] == "loading", "loading", 10, every=0.2)
            r = chat(sw.url, "a")
            assert r.status_code == 503
            assert r.headers["Retry-After"].isdigit()
            assert r.json()["error"]["code"] == "queue_full"
            assert first.result().status_code == 504
        assert metric(sw, "swapper_rejected_total", reason="queue_full") == 1
        del r, first        # their kept-alive sockets would hold the swapper's stop 5 s


def test_client_leaving_the_queue_is_forgotten(swapper, docker_client):
    loads_before = metric(swapper, "swapper_loads_total", model="tiny-b")
    with ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(requests.post, swapper.url + "/load/never-ready", timeout=60)
        wait_until(lambda: running(swapper)["state"] == "loading", "loading", 10, every=0.2)
        post_and_abandon(swapper.url, "/v1/chat/completions", {      # gives up while queued
            "model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        wait_until(lambda: running(swapper)["queued"] <= 1,
                   "the abandoned request dropped", 10, every=0.2)
        assert blocker.result().status_code == 504
    time.sleep(1.5)      # give a wrongly kept ticket the chance to start tiny-b
    assert running(swapper)["model"] is None
    assert metric(swapper, "swapper_loads_total", model="tiny-b") == loads_before


def test_many_clients_mixed_models_all_answered_grouped(docker_client):
    """24 clients, two models, random order, all at once: every request is
    answered, Docker never shows two backends, requests are grouped by model
    (two loads in all, not one per alternation)."""
    rng = random.Random(11)
    models = [rng.choice(["a", "b"]) for _ in range(24)]
    with SwapperProcess() as sw, InvariantSampler(docker_client, sw.stack) as inv:
        with ThreadPoolExecutor(len(models)) as pool:
            # The statuses, not the responses: kept, their kept-alive sockets would
            # hold the swapper's stop 5 s.
            statuses = list(pool.map(lambda m: chat(sw.url, m, max_tokens=4).status_code,
                                     models))
        assert statuses == [200] * len(models)
        loads = metric(sw, "swapper_loads_total")
    assert inv.peak == 1
    assert loads == 2, f"{loads} loads for two models requested at once"
    assert len(inv.seen_models) == 2


def test_orphans_adopted_or_removed_after_restart(docker_client):
    sw = SwapperProcess()
    with sw:
        assert requests.post(sw.url + "/load/a", timeout=180).status_code == 200
        (kept,) = stack_containers(docker_client, sw.stack)
        sw.stop(kill=True)                       # no clean exit: containers stay
        # and a stray container of the same stack that is not healthy
        stray = docker_client.containers.run(
            sw.env["TESTBED_BASE_IMAGE"], ["sleep", "600"], detach=True,
            labels={"org.coding-stack.stack": sw.stack, "org.coding-stack.model": "ghost"})
        # a container of another stack: never touched
        other = docker_client.containers.run(
            sw.env["TESTBED_BASE_IMAGE"], ["sleep", "600"], detach=True,
            labels={"org.coding-stack.stack": sw.stack + "-other"})
        try:
            sw.start()
            state = running(sw)
            assert state["model"] == "tiny-a" and state["state"] == "ready"
            assert state["last_load_seconds"] is None        # adopted, not loaded
            ids = [c.id for c in stack_containers(docker_client, sw.stack)]
            assert ids == [kept.id]
            assert chat(sw.url, "a").status_code == 200
            other.reload()
            assert other.status == "running"
        finally:
            other.remove(force=True)
            try:
                stray.remove(force=True)
            except docker.errors.NotFound:
                pass


def test_clean_exit_removes_the_backend(docker_client):
    sw = SwapperProcess()
    with sw:
        assert requests.post(sw.url + "/load/b", timeout=180).status_code == 200
        sw.stop()
        assert stack_containers(docker_client, sw.stack) == []
