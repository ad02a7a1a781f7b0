"""An upstream answer that breaks off mid-body, relayed by the real proxy
(gunicorn + gevent, common.serve.HeadWithBody): the client's transfer breaks
too. A chunked relay used to be ended with a last chunk, so the client got a
truncated body that looked complete."""
from __future__ import annotations

import socket

import pytest

from tests.support.proxyproc import ProxyProcess
from tests.support.servers import RawServer

HEALTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}'
ANSWERS = {   # path -> what the upstream sends before it hangs up
    b"/v1/sse": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n",
    b"/v1/chunked": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n",
    b"/v1/length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 10\r\n\r\n{\"a\":",
    b"/v1/nothing": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 10\r\n\r\n",
}


class BreakingUpstream(RawServer):
    """Answers /healthz, and each path of ANSWERS with its bytes, then hangs up."""

    def answer(self, conn, head: bytes, body: bytes) -> bool:
        path = head.split(b" ")[1]
        if path not in ANSWERS:
            conn.sendall(HEALTH)
            return True
        conn.sendall(ANSWERS[path])
        return False

@pytest.fixture(scope="module")
def proxy():
    up = BreakingUpstream()
    with ProxyProcess(BACKEND_URL=up.url, WEB_SEARCH=0, MODELS_TTL=0) as p:
        yield p
    up.close()


def raw_get(port: int, path: str) -> bytes:
    """All the proxy sends for one request, until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        got = b""
        while data := s.recv(65536):
            got += data
        return got


@pytest.mark.parametrize("path,body", [
    ("/v1/sse", b"9\r\ndata: 1\n\n\r\n"),
    ("/v1/chunked", b'5\r\n{"a":\r\n'),
])
def test_a_chunked_relay_that_breaks_ends_without_its_last_chunk(proxy, path, body):
    got = raw_get(proxy.port, path)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert rest == body                      # what came, then the end of the connection
    assert not rest.endswith(b"0\r\n\r\n")


@pytest.mark.parametrize("path,body", [("/v1/length", b'{"a":'), ("/v1/nothing", b"")])
def test_a_length_relay_that_breaks_ends_short_of_its_length(proxy, path, body):
    got = raw_get(proxy.port, path)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-length: 10" in head.lower()
    assert rest == body


def test_breaks_leave_no_traceback_in_the_log(proxy):
    raw_get(proxy.port, "/v1/chunked")
    assert "Traceback" not in proxy.logs()
