"""A client that hangs up stops the backend's work, with web_search on (the default)
and off, in all three dialects, streamed and not (issue 20).

The real server (`python -m proxy`: gunicorn + gevent, whose environ carries the
client's socket) in front of a backend that never answers a model request -- a
model still prefilling or generating a whole answer -- and records when the proxy
closes that connection. The client hangs up after 0.5 s; the proxy must close the
backend's connection within a few seconds (it checks its client once a second), so
a backend stops generating instead of holding its slot until max_tokens."""
from __future__ import annotations

import time

import pytest

from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng
from tests.support.servers import RawServer, post_and_abandon, wait_until

MODEL_PATHS = (b"/v1/chat/completions", b"/v1/messages", b"/v1/responses")
LISTING = b'{"object": "list", "data": []}'


class Holding(RawServer):
    """Answers /v1/models and /healthz; holds every model request open, unanswered
    (after an event-stream head when `head` is set and the request streams), and
    records when the proxy closes its connection."""

    def __init__(self):
        self.head = False
        self.held: list[dict] = []          # {"path", "opened", "closed"}
        super().__init__()

    def answer(self, conn, head: bytes, body: bytes) -> bool:
        path = head.split(b" ")[1]
        if path not in MODEL_PATHS:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(LISTING), LISTING))
            return True
        rec = {"path": path.decode(), "opened": time.monotonic(), "closed": None}
        self.held.append(rec)
        if self.head and b'"stream": true' in body:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            while conn.recv(65536):          # the proxy sends nothing more
                pass
        except OSError:
            pass
        rec["closed"] = time.monotonic()
        return False

@pytest.fixture(scope="module")
def backend():
    return Holding()


@pytest.fixture(scope="module", params=["search", "no-search"])
def stack(request, backend):
    with FakeSearxng() as searx, ProxyProcess(
            BACKEND_URL=backend.url, SEARXNG_URL=searx.url, MODELS_TTL=0,
            KEEPALIVE_INTERVAL=0.5, WEB_SEARCH=int(request.param == "search")) as proxy:
        yield proxy, backend


USER = [{"role": "user", "content": "What changed in Flask 3.1?"}]
BODIES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": USER}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER,
                                  "tools": [{"type": "web_search_20250305",
                                             "name": "web_search"}]}),
    "responses": ("/v1/responses", {"model": "m", "input": "What changed in Flask 3.1?",
                                    "tools": [{"type": "web_search"}]}),
}


@pytest.mark.parametrize("dialect", list(BODIES))
@pytest.mark.parametrize("mode", ["full", "stream", "stream-head"])
def test_hang_up_closes_the_backend_connection(stack, dialect, mode):
    """With search on (the search loops) and off (straight to the backend). full:
    the whole answer is awaited; stream: the backend has sent nothing yet;
    stream-head: it sent its event-stream head and is still prefilling (no byte of
    body yet) -- each must close the backend's connection once the client is gone."""
    proxy, backend = stack
    backend.head = mode == "stream-head"
    path, body = BODIES[dialect]
    body = {**body, "stream": mode != "full"}
    n = len(backend.held)
    post_and_abandon(proxy.url, path, body, after=0.5)
    gone = time.monotonic()
    wait_until(lambda: len(backend.held) > n, "the model request reached the backend", 2)
    rec = backend.held[n]
    assert rec["path"] == path
    wait_until(lambda: rec["closed"] is not None,
               f"{dialect} {mode}: the backend's connection closed after the client left", 3)
    assert rec["closed"] - gone < 3
