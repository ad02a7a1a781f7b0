"""Faults against the real swapper on the real Docker engine with the real CPU
llama-server and SmolLM2 (issue 9 items 1-5): nothing lost, nothing jammed.

Every request here carries a client timeout, so a jam fails the test instead of
hanging it. Clients are raw http.client connections or plain `requests`, which
never retry: what they see is what curl, litellm or an agent's own HTTP sees."""
import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
import requests

from tests.support.docker_outage import DockerRelay
from tests.support.servers import post_and_abandon, wait_until
from tests.support.swapper_client import chat, data_until_broken, metric, running
from tests.support.swapperproc import SwapperProcess, stack_containers


def raw(url: str, method: str, path: str, body: dict | None = None, timeout: float = 120):
    """One request on a new connection with no retry: (status, body bytes)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def stream_ok(status: int, data: bytes) -> bool:
    return status == 200 and data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data


# ------------------------------------------------------------------ 9.1 HEAD

def test_head_never_holds_a_slot(swapper):
    """Two HEADs on a 2-slot model held both slots for good; /unload waited forever.
    (Issue 28: /upstream refuses HEAD before admission, so none is ever held.)"""
    assert requests.post(swapper.url + "/load/a", timeout=180).status_code == 200
    for _ in range(4):                                   # twice the slots
        r = requests.head(swapper.url + "/upstream/tiny-a/health", timeout=30)
        assert r.status_code == 405
    assert running(swapper)["in_flight"] == 0
    assert chat(swapper.url, "a", timeout=60).status_code == 200
    assert requests.post(swapper.url + "/unload", timeout=60).status_code == 200


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS"])
def test_head_and_options_on_every_route_leave_nothing_held(swapper, method):
    assert requests.post(swapper.url + "/load/a", timeout=180).status_code == 200
    for path in ("/healthz", "/running", "/metrics", "/v1/models", "/v1/models/tiny-a",
                 "/logs/tiny-a", "/upstream/tiny-a/health", "/upstream/tiny-a/v1/models",
                 "/v1/chat/completions", "/v1/completions", "/load/tiny-a", "/unload",
                 "/events", "/models", "/models/load", "/models/unload"):
        r = requests.request(method, swapper.url + path, timeout=30)
        assert r.status_code < 500, (method, path, r.status_code, r.text)
        if method == "OPTIONS" and r.status_code >= 400:
            assert r.json()["error"]["message"], (path, r.text)
    state = running(swapper)
    assert state["in_flight"] == 0 and state["queued"] == 0
    assert state["model"] == "tiny-a", "a HEAD or OPTIONS unloaded or swapped the model"


# ------------------------------------------------------ 9.2 stale keep-alive

def test_concurrent_streams_at_a_one_slot_model_all_complete(swapper):
    """12 concurrent streams at a 1-slot model lost 2-6 to a reused connection
    llama-server had closed (502 RemoteDisconnected)."""
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200
    body = {"model": "b", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    for _ in range(3):
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda _: raw(swapper.url, "POST", "/v1/chat/completions",
                                              body), range(12)))
        bad = [(s, d[-300:]) for s, d in got if not stream_ok(s, d)]
        assert bad == [], bad


def test_streams_and_plain_requests_alternating_none_lost(swapper):
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200
    failures = []
    for i in range(40):
        stream = i % 2 == 0
        status, data = raw(swapper.url, "POST", "/v1/chat/completions", {
            "model": "b", "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": "Hi"}]})
        ok = stream_ok(status, data) if stream else status == 200
        if not ok:
            failures.append((i, status, data[-200:]))
    assert failures == []


# ------------------------------------------------------------------ 9.3 crash

def test_first_request_after_an_idle_backend_is_killed_succeeds(swapper, docker_client):
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200
    (c,) = stack_containers(docker_client, swapper.stack)
    c.kill()
    status, data = raw(swapper.url, "POST", "/v1/chat/completions", {
        "model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, data
    (c2,) = stack_containers(docker_client, swapper.stack)
    assert c2.id != c.id
    assert metric(swapper, "swapper_crashes_total", model="tiny-b") >= 1


def test_first_request_after_a_kill_mid_stream_succeeds(swapper, docker_client):
    assert requests.post(swapper.url + "/load/b", timeout=180).status_code == 200
    (c,) = stack_containers(docker_client, swapper.stack)
    r = chat(swapper.url, "b", stream=True, max_tokens=2000, ignore_eos=True, timeout=60)
    lines = r.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    c.kill()
    tail = data_until_broken(lines)
    assert tail and b'"error"' in tail[-1]          # the in-flight stream is told
    status, data = raw(swapper.url, "POST", "/v1/chat/completions", {
        "model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, data
    wait_until(lambda: running(swapper)["in_flight"] == 0, "slots free", 10, every=0.2)


def test_a_crash_looping_backend_gets_clear_errors_and_leaves_nothing(swapper, docker_client):
    errors = []
    for _ in range(3):
        r = chat(swapper.url, "broken", timeout=120)
        errors.append((r.status_code, r.json()["error"]["code"]))
        assert "no-such-model" in r.json()["error"]["message"]   # the log lines say why
    assert errors == [(502, "load_failed")] * 3
    assert stack_containers(docker_client, swapper.stack) == []
    assert running(swapper)["state"] == "idle"
    assert chat(swapper.url, "b", timeout=180).status_code == 200


# ------------------------------------------------------- 9.4 / 9.5 Docker gone

def test_docker_outage_during_a_load_fails_it_clearly_and_recovers(docker_client):
    """The load's requests hung forever, also after Docker was back, and
    /running stayed 'loading'."""
    with DockerRelay() as relay:
        relay.up()
        with SwapperProcess(DOCKER_HOST=relay.url) as sw:
            with ThreadPoolExecutor(2) as pool:
                waiting = [pool.submit(chat, sw.url, "never-ready", timeout=60)
                           for _ in range(2)]
                wait_until(lambda: stack_containers(docker_client, sw.stack),
                           "the backend container created", 30, every=0.2)
                relay.down()
                results = [f.result() for f in waiting]
            for r in results:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "docker_unavailable"
            state = running(sw)
            assert state["state"] == "idle" and state["queued"] == 0
            hz = requests.get(sw.url + "/healthz", timeout=10)
            assert hz.status_code == 503 and hz.json()["status"] == "degraded"
            relay.up()
            r = chat(sw.url, "b", timeout=180)
            assert r.status_code == 200, r.text
            models = [c.labels["org.coding-stack.model"]
                      for c in stack_containers(docker_client, sw.stack)]
            assert models == ["tiny-b"], "the container left by the cut load was not removed"
            del r, results, waiting, hz     # their kept-alive sockets would hold the stop 5 s


def test_docker_unreachable_at_start_serves_degraded_and_recovers(docker_client):
    with DockerRelay() as relay:                  # not up yet: no engine
        sw = SwapperProcess(DOCKER_HOST=relay.url)
        sw.ready_statuses = (200, 503)
        with sw:
            hz = requests.get(sw.url + "/healthz", timeout=10)
            assert hz.status_code == 503
            assert hz.json()["status"] == "degraded" and hz.json()["docker"] is False
            r = chat(sw.url, "b", timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "docker_unavailable"
            relay.up()
            wait_until(lambda: requests.get(sw.url + "/healthz", timeout=10).status_code == 200,
                       "healthy once Docker answers", 30, every=0.2)
            r = chat(sw.url, "b", timeout=180)
            assert r.status_code == 200, r.text
            del r, hz       # their kept-alive sockets would hold the swapper's stop 5 s


# ------------------------------------------------------------ clients leaving

def test_client_gone_while_its_model_loads_leaves_nothing_held(swapper):
    post_and_abandon(swapper.url, "/v1/chat/completions", {
        "model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        after=0.3)
    wait_until(lambda: running(swapper)["state"] == "ready",
               "the load finished anyway", 120, every=0.2)
    wait_until(lambda: running(swapper)["in_flight"] == 0 and running(swapper)["queued"] == 0,
               "nothing held by the client that left", 10, every=0.2)
    assert chat(swapper.url, "b", timeout=60).status_code == 200


def test_many_hangups_at_every_stage_leave_nothing_held(swapper):
    assert requests.post(swapper.url + "/load/a", timeout=180).status_code == 200
    body = {"model": "a", "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count."}]}
    threads = [threading.Thread(target=post_and_abandon,
                                args=(swapper.url, "/v1/chat/completions",
                                      {**body, "stream": i % 2 == 0}),
                                kwargs={"after": 0.05 * i}) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: running(swapper)["in_flight"] == 0 and running(swapper)["queued"] == 0,
               "every abandoned request ended", 60, every=0.2)
    assert chat(swapper.url, "a", timeout=60).status_code == 200


# ------------------------------------------------------------ 9.10 privileges

def test_least_privilege_backends_run_as_nobody(swapper, docker_client):
    """llama.cpp backends run as nobody (the kind's `user`), and still serve."""
    assert chat(swapper.url, "b", timeout=180).status_code == 200
    (c,) = stack_containers(docker_client, swapper.stack)
    assert c.attrs["Config"]["User"] == "65534:65534"
    top = c.top(ps_args="-o pid,uid,comm")
    uid = top["Titles"].index("UID")
    assert top["Processes"] and all(row[uid] == "65534" for row in top["Processes"]), top


def test_least_privilege_swapper_drops_root_keeping_the_socket_group(tmp_path):
    """In its image the swapper starts as root and drops to SWAPPER_USER with
    the Docker socket's group (here: in a forked child, so the test runner
    keeps its own rights)."""
    import os
    from swapper.privileges import drop_privileges
    assert os.geteuid() == 0, "this check needs root (CI and the test bed run as root)"
    sock = tmp_path / "docker.sock"
    sock.touch()
    os.chown(sock, 0, 4242)
    fresh, theirs = tmp_path / "fresh", tmp_path / "theirs"   # the download folders
    fresh.mkdir()                                       # as Docker makes a bind mount's
    theirs.mkdir()
    (theirs / "model.gguf").touch()
    os.chown(theirs, 1234, 4343)                        # a host user's, group-writable
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                        # the child: drop, report, exit
        try:
            drop_privileges("nobody", f"unix://{sock}", writes=(str(fresh), str(theirs)),
                            groups_too=(5151,))         # the backends' (KV folders)
            os.write(w, json.dumps([os.getuid(), os.geteuid(), os.getgid(),
                                    sorted(os.getgroups())]).encode())
        finally:
            os._exit(0)
    os.close(w)
    got = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    assert got[0] == got[1] == 65534
    assert 4242 in got[3] and 0 not in got[3]
    assert fresh.stat().st_uid == 65534                # Docker's empty folder: now ours
    assert 4343 in got[3] and theirs.stat().st_uid == 1234   # theirs: by its group
    assert 5151 in got[3]                               # the backends' group, kept
