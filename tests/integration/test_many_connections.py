"""The real proxy (gunicorn + gevent) with over 1,100 descriptors open in its
worker: idle client connections, and requests each waiting on an upstream
connection of its own. Every waiting request's client is watched (a hang-up
cuts the upstream) and pooled upstream connections are checked before reuse;
with select() every check on a descriptor from 1024 up failed, so those
clients were taken for gone (499) and their upstreams cut. With poll they are
served."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.support.proxyproc import ProxyProcess
from tests.support.servers import ServerThread

IDLE = 880          # client connections that never send a request
WAITING = 110       # requests waiting on the upstream meanwhile (each: 2 descriptors)
SLOW = 1.5          # seconds the upstream takes: the client watch checks after 1


def slow_upstream(environ, start_response):
    if environ["PATH_INFO"] != "/healthz":
        time.sleep(SLOW)
    body = json.dumps({"path": environ["PATH_INFO"]}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]


def test_requests_are_served_with_over_1100_connections_open(nofile):
    with ServerThread(slow_upstream) as upstream, \
            ProxyProcess(BACKEND_URL=upstream.url, WEB_SEARCH=0, MODELS_TTL=0) as proxy:
        idle = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(IDLE)]
        try:
            # accepted in order: once this is answered, the idle ones hold their descriptors
            assert requests.get(proxy.url + "/healthz", timeout=10).status_code == 200

            def ask(i: int) -> int:
                return requests.get(f"{proxy.url}/v1/slow/{i}", timeout=30).status_code

            with ThreadPoolExecutor(WAITING) as pool:
                statuses = list(pool.map(ask, range(WAITING)))
            assert statuses == [200] * WAITING, {s: statuses.count(s) for s in set(statuses)}
            # and one more, on the pooled upstream connections (checked with poll too)
            assert requests.get(proxy.url + "/v1/slow/last", timeout=30).json() == \
                {"path": "/v1/slow/last"}
        finally:
            for s in idle:
                s.close()
        assert "Traceback" not in proxy.logs()
