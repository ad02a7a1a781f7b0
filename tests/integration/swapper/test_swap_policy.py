"""The hold swap policy on the real engine (issue 27): the real swapper, real
containers of stand-in models (tests/perf/synth.py, healthy LOAD seconds after
start), scripted agents with their own session ids. The numbers of a full run
are tests/perf/thrash.py's; here the behaviours, small and fast."""
import functools
import re
import time

import pytest
import requests

from tests.perf.thrash import BACKENDS, PERF_DIR, Agent, all_at_once, run_agent
from tests.support.swapperproc import SwapperProcess, stack_containers

LOAD = 1.0
HOLD = 20.0          # long: a hold that is not released would show as a 20 s wait


def loads(url) -> int:
    text = requests.get(url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(
        r'^swapper_loads_total\{[^}]*result="ok"[^}]*\} ([0-9.]+)$', text, re.M)))


def series(url, name) -> dict:
    text = requests.get(url + "/metrics", timeout=10).text
    return {labels: float(v) for labels, v in
            re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.]+)$", text, re.M)}


@pytest.fixture(scope="module")
def sw(docker_client):
    with SwapperProcess(backends_dir=BACKENDS, PERF_DIR=str(PERF_DIR), HOLD_SECONDS=str(HOLD),
                        QUANTUM_MIN_SECONDS="4", THRASH_LOAD_SECONDS=str(LOAD)) as sw:
        for m in ("x", "y"):        # each loaded once: its load time is known
            requests.post(f"{sw.url}/load/{m}", timeout=120).raise_for_status()
        yield sw
    assert stack_containers(docker_client, sw.stack) == []


@pytest.fixture(autouse=True)
def _unloaded(sw):
    requests.post(sw.url + "/unload", timeout=120).raise_for_status()
    yield


def agents_run(sw, agents) -> tuple[int, float, int]:
    """Run the agents at once; (loads, seconds, most backends at once)."""
    before = loads(sw.url)
    _, seconds, most = all_at_once(sw.stack, lambda t0: [
        functools.partial(run_agent, sw.url, a, t0) for a in agents], timeout=300)
    for a in agents:
        assert a.failures == [] and len(a.waits) == a.turns
    return loads(sw.url) - before, seconds, most


def test_two_agents_on_two_models_do_not_pay_a_load_a_turn(sw):
    before = series(sw.url, "swapper_holds_total")
    a, b = Agent("A", ["x"], 0.5, 5), Agent("B", ["y"], 0.5, 5)
    n, seconds, most = agents_run(sw, [a, b])
    assert most == 1
    # fifo pays a load on (almost) every turn: 10 here. The holds keep each model
    # for its agent's turns: x, y, and at most one more stint each.
    assert n <= 4, n
    # Nobody waits past the quantum (4 s min; 3 x ~1.5 s load) plus a load and a turn.
    assert max(a.waits + b.waits) < 4.5 + 6 + 1, (a.waits, b.waits)
    held = series(sw.url, "swapper_holds_total")
    assert held.get('outcome="used"', 0) - before.get('outcome="used"', 0) >= 3, held


def test_one_client_alternating_models_never_waits_for_its_own_hold(sw):
    before = series(sw.url, "swapper_holds_total")
    c = Agent("aider", ["x", "y"], 0.0, 4)
    n, seconds, most = agents_run(sw, [c])
    assert n == 4 and most == 1
    assert max(c.waits) < HOLD / 2, c.waits          # a load each, never the 20 s hold
    broken = series(sw.url, "swapper_holds_total")
    assert broken.get('outcome="other_model"', 0) - before.get('outcome="other_model"', 0) \
        >= 3, broken


def test_a_waiting_stream_and_running_say_why_it_waits(sw):
    requests.post(sw.url + "/v1/chat/completions", headers={"x-session-id": "A"}, timeout=60,
                  json={"model": "x", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
    r = requests.post(sw.url + "/v1/chat/completions", headers={"x-session-id": "B"},
                      stream=True, timeout=60, json={
                          "model": "y", "max_tokens": 1, "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]})
    first = next(r.iter_lines())
    running = requests.get(sw.url + "/running", timeout=10).json()
    r.close()
    assert first.startswith(b": waiting: x is held for 1 agent session(s)"), first
    assert running["policy"] == "hold" and running["hold"]["sessions"] == 1
    assert running["hold"]["waiting_model"] == "y"
    assert 0 < running["hold"]["quantum_ends_in"] <= 12
    # Meanwhile the waiting model's files (here: its script under its mount) were
    # read into the page cache.
    deadline = time.monotonic() + 5
    while "of model y into the page cache" not in sw.logs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "of model y into the page cache" in sw.logs()


def test_an_operator_load_is_not_held(sw):
    requests.post(sw.url + "/v1/chat/completions", headers={"x-session-id": "A"}, timeout=60,
                  json={"model": "x", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
    t0 = time.monotonic()
    r = requests.post(sw.url + "/load/y", timeout=60)
    assert r.status_code == 200 and r.json()["loaded"] == "y"
    assert time.monotonic() - t0 < HOLD / 2
    stops = series(sw.url, "swapper_stops_total")
    assert stops.get('cause="operator",model="x"', 0) + stops.get(
        'model="x",cause="operator"', 0) >= 1, stops
