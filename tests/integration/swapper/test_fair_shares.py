"""Tenants within a model on the real engine (issue 35): the real swapper, a real
container of a stand-in model with one slot (tests/perf/fairshare_backends), the
proxy's tenant fields sent as the proxy sends them on the internal hop. One
tenant's batch is queued; another tenant's request is served before the batch
drains. Then two tenants wait for a load of the other model: the load seconds
their answers tell add up to the tenants' charges in /running. The numbers of a
full run are tests/perf/fairshare.py's."""
import threading
import time

import pytest
import requests

from common import queuewait
from tests.perf.fairshare import BACKENDS, PERF_DIR
from tests.support.servers import wait_until
from tests.support.sseclient import told_waits
from tests.support.swapperproc import SwapperProcess, stack_containers

BATCH = 10
ANSWER_MS = 300


@pytest.fixture(scope="module")
def sw(docker_client):
    with SwapperProcess(backends_dir=BACKENDS, PERF_DIR=str(PERF_DIR), FAIR_LOAD_X="1",
                        FAIR_LOAD_Y="1") as sw:
        requests.post(f"{sw.url}/load/fx", timeout=120).raise_for_status()
        yield sw
    assert stack_containers(docker_client, sw.stack) == []


def ask(url, tenant, done, session):
    r = requests.post(url + "/v1/chat/completions", timeout=120, headers={
        "X-Coding-Stack-Tenant": tenant, "X-Coding-Stack-Weight": "1",
        "x-session-id": session}, json={
        "model": "fx", "max_tokens": 1, "perf_first_ms": ANSWER_MS,
        "messages": [{"role": "user", "content": "go"}]})
    done.append((tenant, r.status_code))


def test_another_tenants_request_goes_before_a_batch_drains(sw):
    done: list = []
    batch = [threading.Thread(target=ask, args=(sw.url, "ci", done, f"ci-{i}"))
             for i in range(BATCH)]
    for t in batch:
        t.start()
    try:
        # The batch is in line (one slot: one answered at a time).
        wait_until(lambda: requests.get(sw.url + "/running", timeout=10).json()
                   ["tenants"].get("ci", {}).get("queued", 0) >= BATCH - 2,
                   "the batch in line", deadline=30)
        ask(sw.url, "alice", done, "alice")
        ci_before_alice = done.index(("alice", 200))    # the batch's answers before it
        # Without fair order alice would wait for the whole batch (FIFO).
        assert ci_before_alice <= 3, done
    finally:
        for t in batch:
            t.join(120)
    assert sorted(done) == sorted([("alice", 200)] + [("ci", 200)] * BATCH)
    tenants = requests.get(sw.url + "/running", timeout=10).json()["tenants"]
    assert tenants["ci"]["queued"] == tenants["alice"]["queued"] == 0
    metrics = requests.get(sw.url + "/metrics", timeout=10).text
    assert 'swapper_tenant_queued{tenant="alice"} 0.0' in metrics


def told_load(url, tenant, weight, stream, told):
    """One request for fy; the load seconds its answer told (the header of an
    answer relayed once admitted, else the waiting stream's comment line)."""
    r = requests.post(url + "/v1/chat/completions", timeout=120, stream=stream, headers={
        "X-Coding-Stack-Tenant": tenant, "X-Coding-Stack-Weight": weight}, json={
        "model": "fy", "max_tokens": 1, "stream": stream,
        "messages": [{"role": "user", "content": "go"}]})
    body = r.content
    load = queuewait.from_header(r.headers.get(queuewait.LOAD_HEADER))
    told.append((tenant, r.status_code, load if load is not None
                 else told_waits(body)[1]))


def test_the_load_seconds_answers_tell_add_up_to_the_tenants_charges(sw):
    told: list = []
    asks = [threading.Thread(target=told_load, args=(sw.url, tenant, weight, stream, told))
            for tenant, weight, stream in (("bob", "1", False), ("carol", "3", True),
                                           ("carol", "3", False))]
    for t in asks:
        t.start()
    for t in asks:
        t.join(120)
    assert sorted((t, s) for t, s, _ in told) == [("bob", 200), ("carol", 200),
                                                   ("carol", 200)], told
    assert all(load is not None for _, _, load in told), told
    assert sum(load for _, _, load in told) > 0, told      # fy's load: someone waited for it
    tenants = requests.get(sw.url + "/running", timeout=10).json()["tenants"]
    for name in ("bob", "carol"):
        mine = [load for t, _, load in told if t == name]
        # /running rounds to 0.1 s, each answer to 1 ms
        assert sum(mine) == pytest.approx(tenants.get(name, {}).get(
            "charged_load_seconds_total", 0.0), abs=0.05 + 0.001 * len(mine)), (told, tenants)
