"""How a stream crosses the hops, on the real proxy in front of the real swapper
(both gunicorn + gevent, as in production), streaming from the synthetic
backend of tests/perf (in each of the three dialects, as llama-server serves
them). A relay between proxy and swapper counts the connections.

- A stream the proxy stops reading at its logical end ([DONE], message_stop,
  response.completed) leaves its connection to the swapper open for the next
  request. It used to close it there, so every streamed request (what agents
  send) cost the next one a new connection: ~0.7 ms on the test machine.
- A stream's headers cross each hop as soon as the backend sends them, not
  with its first token: each hop (and the client) sets its end of the stream
  up while the model works on that token, instead of after it. Held back, the
  proxy's set-up (~0.5 ms on the test machine) lay between the first token and
  the client.
"""
from __future__ import annotations

import socket
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
def swapper():
    with SwapperProcess(backends_dir=PERF_BACKENDS, PERF_DIR=str(PERF_DIR)) as sw:
        requests.post(sw.url + "/load/synth", timeout=120).raise_for_status()
        yield sw


@pytest.fixture
def swapper_url(swapper):
    return swapper.url


@pytest.fixture(scope="module")
def stack(swapper):
    relay = Relay(swapper.url)
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

    ask()
    before = relay.connections
    for _ in range(3):
        ask()
    assert relay.connections == before


def _head_and_first_event(url: str, body: dict) -> tuple[float, float]:
    """Seconds from sending a streamed request to its header block, and to its
    first event (a raw socket: a client library may read both at once)."""
    host, port = url[7:].split(":")
    data = requests.models.complexjson.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
                  + data)
        buf, head = b"", None
        while b"data:" not in buf.partition(b"\r\n\r\n")[2]:
            more = s.recv(65536)
            assert more, buf
            buf += more
            if head is None and b"\r\n\r\n" in buf:
                head = time.monotonic() - t0
        assert buf.startswith(b"HTTP/1.1 200"), buf[:300]
        return head, time.monotonic() - t0


@pytest.mark.parametrize("through", ["proxy", "swapper"])
def test_a_streams_headers_come_before_its_first_token(stack, swapper_url, through):
    url = stack[0] if through == "proxy" else swapper_url
    head, first = _head_and_first_event(url, {
        "model": "synth", "messages": USER, "max_tokens": 2, "stream": True,
        "perf_first_ms": 1500})                 # the backend's first token, 1.5 s late
    assert first >= 1.5 and head < 1.0, (head, first)
