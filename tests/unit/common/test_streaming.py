"""common.streaming against a real socket server speaking chunked HTTP/1.1:
what arrives together leaves together, framing split anywhere, trailers, the
connection reused after a complete body, and a body that breaks off."""
from __future__ import annotations

import errno

import pytest
import requests

from common.http1 import Client
from common.streaming import BrokenRelay, iter_upstream
from tests.support.servers import Scripted

EVENT = b'data: {"choices":[{"delta":{"content":" tok"}}]}\n\n'
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class session:
    """requests' verbs on a common.http1 client."""

    def __init__(self):
        self.client = Client(4)

    def get(self, url):
        return self.client.request("GET", url)

    def head(self, url):
        return self.client.request("HEAD", url)


def test_a_burst_of_chunks_is_relayed_in_few_pieces_and_the_connection_reused():
    body = EVENT * 500
    burst = HEAD + b"".join(framed(EVENT) for _ in range(500)) + b"0\r\n\r\n"
    srv = Scripted([burst], [HEAD + framed(b"second") + b"0\r\n\r\n"], pause=0)
    s = session()
    try:
        r = s.get(srv.url + "/a")
        pieces = list(iter_upstream(r))
        assert b"".join(pieces) == body
        # One piece per read of what had arrived, not one per HTTP chunk (500).
        assert len(pieces) <= 50, len(pieces)
        r.close()
        r2 = s.get(srv.url + "/b")
        assert b"".join(iter_upstream(r2)) == b"second"
        assert srv.connections == 1              # the pooled connection served both
    finally:
        srv.close()


def test_framing_split_anywhere_and_trailers():
    wire = framed(b"hello ") + framed(b"wor") + framed(b"ld") + b"0\r\nX-Trailer: 1\r\n\r\n"
    # every byte its own send: size lines, CRLFs and the trailer section all split
    srv = Scripted([HEAD] + [wire[i:i + 1] for i in range(len(wire))],
                   [HEAD + framed(b"again") + b"0\r\n\r\n"], pause=0)
    s = session()
    try:
        r = s.get(srv.url + "/a")
        assert b"".join(iter_upstream(r)) == b"hello world"
        r.close()
        r2 = s.get(srv.url + "/b")     # trailers fully consumed
        assert b"".join(iter_upstream(r2)) == b"again"
        assert srv.connections == 1
    finally:
        srv.close()


def test_a_body_that_breaks_off_calls_on_break_and_on_close_then_breaks_the_relay():
    """The tail (an SSE error event) goes out, then BrokenRelay: the server ends
    the client's transfer broken, not with a last chunk as if complete."""
    srv = Scripted([HEAD + framed(b"partial"), None], pause=0)
    s = session()
    seen = {}
    try:
        r = s.get(srv.url + "/a")

        def on_break(e):
            seen["break"] = e
            return b"[error]"

        out = []
        with pytest.raises(BrokenRelay) as e:
            for piece in iter_upstream(r, on_close=lambda ok: seen.setdefault("complete", ok),
                                       on_break=on_break):
                out.append(piece)
        assert b"".join(out) == b"partial[error]"
        assert e.value.errno == errno.ECONNRESET     # gunicorn: closed, no traceback logged
        assert isinstance(seen["break"], requests.RequestException)
        assert seen["complete"] is False
    finally:
        srv.close()


def test_a_break_before_any_byte_still_sends_the_head_then_breaks():
    """Without a tail, an empty piece: HeadWithBody sends the head it holds."""
    srv = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", None], pause=0)
    s = session()
    try:
        r = s.get(srv.url + "/a")
        it = iter_upstream(r)
        assert next(it) == b""
        with pytest.raises(BrokenRelay):
            next(it)
    finally:
        srv.close()


def test_a_body_with_a_length_is_read_to_its_end():
    data = b"x" * 1000
    srv = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + data], pause=0)
    s = session()
    try:
        r = s.get(srv.url + "/a")
        assert b"".join(iter_upstream(r)) == data
    finally:
        srv.close()


def test_an_answer_is_a_requests_response_and_errors_are_requests_errors():
    from tests.support.servers import free_port
    srv = Scripted([HEAD.replace(b"200 OK", b"201 Created") + framed(b"ok") + b"0\r\n\r\n"], pause=0)
    c = Client(1)
    try:
        r = c.request("POST", srv.url + "/v1/x?a=1", headers={"X-Test": "1"}, body=b"{}",
                      timeout=(5, 5))
        assert isinstance(r, requests.Response)
        assert r.status_code == 201 and r.headers["content-type"] == "text/event-stream"
        assert r.url == srv.url + "/v1/x?a=1" and r.reason == "Created"
        head = srv.heads[0].decode()
        assert head.startswith("POST /v1/x?a=1 HTTP/1.1\r\n") and "X-Test: 1" in head
        assert "Content-Length: 2" in head
        assert b"".join(iter_upstream(r)) == b"ok"
    finally:
        srv.close()
    dead = f"http://127.0.0.1:{free_port()}/v1/x"
    try:
        c.request("GET", dead, timeout=(5, 5))
        raise AssertionError("no error")
    except requests.exceptions.ConnectionError as e:
        assert "Connection refused" in str(e)
        assert not isinstance(e, requests.exceptions.ConnectTimeout)


def test_a_head_answer_with_chunked_headers_has_no_body_to_wait_for():
    srv = Scripted([HEAD], [HEAD + framed(b"after") + b"0\r\n\r\n"], pause=0)
    s = session()
    try:
        r = s.head(srv.url + "/a")
        assert b"".join(iter_upstream(r)) == b""
        r2 = s.get(srv.url + "/b")
        assert b"".join(iter_upstream(r2)) == b"after"
    finally:
        srv.close()
