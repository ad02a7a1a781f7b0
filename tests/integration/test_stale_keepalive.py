"""Pooled connections that the server closed while they idled are not reused.

The real proxy (WEB_SEARCH=0) in front of the real swapper, which closes idle
keep-alive connections after 5 s (gunicorn's keep-alive), streaming from the
synthetic backend of tests/perf. A burst of 64 streams leaves the proxy's pool
with 64 connections; after they have idled past the swapper's keep-alive, a
burst of 256 streams reuses them. urllib3's own check (a zero-timeout poll,
gevent's poll object under the gevent worker) let 49-63 of the 256 go out on
dead connections: 502 RemoteDisconnected from the proxy. common.http1 checks
with the OS's own select before it reuses a connection.
"""
from __future__ import annotations

import asyncio
import time

import requests

from tests.perf import client
from tests.perf.bench import PERF_BACKENDS, PERF_DIR, chat
from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import SwapperProcess


def burst(url: str, n: int) -> list:
    body = chat("synth", 10, True, perf_interval_ms=20)

    async def run():
        return await asyncio.gather(*(client.astream(url, body, 12) for _ in range(n)))
    return [r["error"] for r in asyncio.run(run()) if r["error"]]


def test_idle_connections_closed_by_the_swapper_are_not_reused():
    with SwapperProcess(backends_dir=PERF_BACKENDS, PERF_DIR=str(PERF_DIR),
                        MAX_QUEUE=4096) as sw, \
            ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH=0) as proxy:
        requests.post(sw.url + "/load/synth", timeout=120).raise_for_status()
        assert burst(proxy.url, 64) == []
        time.sleep(7)                   # past the swapper's 5 s keep-alive
        assert burst(proxy.url, 256) == []
