"""The pass-through writes the request target into the next request line as the
client sent it, still percent-encoded, or refuses it with 400; never decoded
(issue 20: `%E2%82%AC` raised in the request line's encoding and leaked a slot,
`%0D%0A` wrote a CR/LF into it, `%3F`/`%23` became a query/fragment).

The real server (`python -m proxy`: gunicorn + gevent) in front of an upstream
that records each request line exactly as it arrived."""
from __future__ import annotations


import pytest

from tests.support.proxyproc import ProxyProcess
from tests.support.rawhttp import send
from tests.support.servers import RawServer

OK = b'{"ok": true}'


class Recorder(RawServer):
    """Answers every request 200 and records its request line, as bytes."""

    def __init__(self):
        self.lines: list[bytes] = []
        super().__init__()

    def answer(self, conn, head: bytes, body: bytes) -> bool:
        self.lines.append(head.split(b"\r\n")[0])
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(OK), OK))
        return True

@pytest.fixture(scope="module")
def stack():
    up = Recorder()
    with ProxyProcess(BACKEND_URL=up.url, MODELS_TTL=0, LOG_LEVEL="warning") as proxy:
        yield proxy, up


ESCAPES = ["%E2%82%AC", "%FF", "%0D%0A", "%0D", "%0A", "%09", "%7F", "%20", "%3F", "%23",
           "%25", "a%2Bb"]


@pytest.mark.parametrize("target", [f"/upstream/smollm2/{e}" for e in ESCAPES] + [
    "/upstream/smollm2/x?q=%E2%82%AC&n=%0D%0A&h=%23",
    "/v1/files/%E2%82%AC%20x?purpose=a%20b",
    "/logs/smollm2?tail=%0A",
    "/v1/v1/messages/count_tokens?beta=%20",
])
def test_a_target_goes_on_as_received_or_is_refused(stack, target):
    proxy, up = stack
    n = len(up.lines)
    ans = send(proxy.url, "GET", target)
    expect = target.replace("/v1/v1/", "/v1/", 1)
    if target.endswith("/%25"):             # the guard's: no double encoding
        assert ans.status == 400 and ans.envelope is not None and len(up.lines) == n
        return
    assert ans.status == 200 and ans.body == OK, (ans.status, ans.body)
    assert up.lines[n:] == [b"GET " + expect.encode() + b" HTTP/1.1"]


@pytest.mark.parametrize("target", ["/upstream/m/\xe2\x82\xac", "/upstream/m/a#b",
                                    "/upstream/m/a\x7fb"])
def test_raw_bytes_no_request_line_may_carry_are_refused(stack, target):
    proxy, up = stack
    n = len(up.lines)
    ans = send(proxy.url, "GET", target)
    assert ans.status == 400 and len(up.lines) == n
