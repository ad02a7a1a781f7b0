"""A stream the proxy stops reading at its logical end ([DONE], message_stop,
response.completed) leaves its connection to the swapper open for the next
request. It used to close it there, so every streamed request (what agents send)
cost the next one a new connection: ~0.7 ms on the test machine
(docs/performance.md).

The real proxy in front of the real swapper (both gunicorn + gevent: keep-alive
on streamed answers, as in production), streaming from the synthetic backend of
tests/perf, which speaks chat completions only (so the other dialects are
translated). A relay between proxy and swapper counts the connections.
"""
from __future__ import annotations

import time

import pytest
import requests

from tests.perf.bench import PERF_BACKENDS, PERF_DIR
from tests.support.proxyproc import ProxyProcess
from tests.support.servers import Relay
from tests.support.swapperproc import SwapperProcess

USER = [{"role": "user", "content": "hi"}]
CASES = {
    # path, body, the stream's last event
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 4}, b"data: [DONE]"),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 4}, b"message_stop"),
    "messages-search": ("/v1/messages", {"messages": USER, "max_tokens": 4, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, b"message_stop"),
    # (the synthetic backend stops at max_tokens: "length", so incomplete)
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 4},
                  b"response.incomplete"),
    "responses-search": ("/v1/responses", {"input": "hi", "max_output_tokens": 4,
                                           "tools": [{"type": "web_search"}]},
                         b"response.incomplete"),
}


@pytest.fixture(scope="module")
def stack():
    with SwapperProcess(backends_dir=PERF_BACKENDS, PERF_DIR=str(PERF_DIR)) as sw:
        requests.post(sw.url + "/load/synth", timeout=120).raise_for_status()
        relay = Relay(sw.url)
        try:
            with ProxyProcess(BACKEND_URL=relay.url) as proxy:     # web_search on
                yield proxy.url, relay
        finally:
            relay.close()


@pytest.mark.parametrize("case", list(CASES))
def test_streams_ended_at_their_end_keep_the_connection_to_the_swapper(stack, case):
    url, relay = stack
    path, body, last = CASES[case]

    def ask():
        r = requests.post(url + path, json={"model": "synth", **body, "stream": True},
                          timeout=60)
        assert r.status_code == 200 and last in r.content, r.content[-300:]
        # The rest of the swapper's answer (its last chunk) is read in the
        # background once the client has its answer: give it a moment.
        time.sleep(0.3)

    ask()               # the first: a dialect the backend lacks is found out (a 404)
    before = relay.connections
    for _ in range(3):
        ask()
    assert relay.connections == before
