"""common.http1 against scripted socket servers: framing, reuse and its limits,
and each failure raised as the requests error common.failures classifies."""
from __future__ import annotations

import gzip
import socket
import time

import pytest
import requests

from common.failures import classify, not_reached
from common.http1 import BadAnswer, BrokenBody, Client, waiting
from tests.support.servers import Scripted, free_port, wait_until

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture
def scripted():
    servers = []

    def make(*answers):
        servers.append(Scripted(*answers))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_the_request_head_is_ours_and_the_body_framed(scripted):
    srv = scripted(OK)
    r = Client().request("POST", srv.url + "/v1/x", body="é", headers={
        "Content-Type": "application/json", "Host": "evil", "Content-Length": "99",
        "Transfer-Encoding": "chunked", "Accept-Encoding": "gzip", "Connection": "upgrade"})
    assert r.content == b"ok"
    head = srv.heads[0].decode("latin-1").split("\r\n")
    assert head[0] == "POST /v1/x HTTP/1.1"
    assert head[1] == f"Host: {srv.url[7:]}"
    fields = {line.split(": ")[0].lower(): line.split(": ")[1] for line in head[1:]}
    assert fields == {"host": srv.url[7:], "content-type": "application/json",
                      "content-length": "2", "accept-encoding": "identity"}
    assert srv.bodies == ["é".encode()]


def test_a_post_without_a_body_says_its_length_is_zero(scripted):
    srv = scripted(OK)
    Client().request("POST", srv.url + "/load").close()
    assert b"Content-Length: 0" in srv.heads[0]


def test_header_injection_is_refused():
    for headers in ({"X-A": "1\r\nX-Evil: 1"}, {"X-A\nB": "1"}, {"X:A": "1"}):
        with pytest.raises(requests.exceptions.InvalidHeader):
            Client().request("GET", "http://127.0.0.1:9/", headers=headers)


def test_a_complete_answer_frees_its_connection_for_the_next(scripted):
    srv = scripted(OK, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
                   OK)
    c = Client()
    assert [c.request("GET", srv.url + "/").content for _ in range(3)] == [b"ok", b"hi", b"ok"]
    assert srv.connections == 1


def test_an_answer_left_unread_closes_its_connection(scripted):
    srv = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", OK)
    c = Client()
    r = c.request("GET", srv.url + "/")
    r.close()                                       # half read: not reusable
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 2


def test_connection_close_http10_and_unframed_answers_are_not_reused(scripted):
    srv = scripted(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
                   b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
    srv2 = scripted([b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"the end", None])
    c = Client()
    for _ in range(2):
        c.request("GET", srv.url + "/").content
        assert not c._idle.get(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    assert srv.connections == 2
    r = c.request("GET", srv2.url + "/")
    assert r.framing == "close" and r.content == b"until the end"
    assert not any(c._idle.values())


def test_a_switch_of_protocols_we_never_asked_for_is_a_bad_answer(scripted):
    """We never send Upgrade: a 101 would leave HTTP for a protocol no one chose."""
    srv = scripted(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")
    with pytest.raises(BadAnswer):
        Client().request("GET", srv.url + "/")


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE = b"e\r\ndata: [DONE]\n\n\r\n"


def _read_to_done(r) -> bytes:
    got = b""
    for piece in r.iter_content():
        got += piece
        if got.endswith(b"data: [DONE]\n\n"):
            return got
    raise AssertionError(f"no [DONE] in {got!r}")


@pytest.mark.parametrize("last", [
    b"0\r\n\r\n",                                # the last chunk, sent a moment after [DONE]
    [0.2, b"0\r\n", 0.1, b"X-Trailer: 1\r\n\r\n"],   # later, in pieces, with a trailer
])
def test_a_stream_ended_at_its_done_keeps_its_connection(scripted, last):
    pieces = [SSE_HEAD + b"a\r\ndata: {}\n\n\r\n" + DONE] + (last if isinstance(last, list)
                                                                 else [last])
    srv = scripted(pieces, OK)
    c = Client()
    r = c.request("POST", srv.url + "/v1/chat/completions", body=b"{}")
    assert _read_to_done(r).endswith(b"[DONE]\n\n")
    r.end()                   # the last chunk has not come yet: it is read in the background
    r.close()                 # does nothing after end()
    wait_until(lambda: any(c._idle.values()), "the connection back in the pool")
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 1


def test_a_stream_whose_end_came_with_its_done_is_pooled_at_once(scripted):
    """The last chunk in the same receive as [DONE]: the caller's reader has
    taken the end already, and end()'s reader must not wait for more (it did,
    END_WAIT long, then closed the connection: a new one for the next turn)."""
    srv = scripted([SSE_HEAD + b"a\r\ndata: {}\n\n\r\n" + DONE + b"0\r\n\r\n"], OK)
    c = Client()
    r = c.request("POST", srv.url + "/v1/chat/completions", body=b"{}")
    assert _read_to_done(r).endswith(b"[DONE]\n\n")
    r.end()
    wait_until(lambda: any(c._idle.values()), "the connection back in the pool", 1.0)
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 1


def test_a_stream_ended_then_its_readers_closed_still_pools_its_connection(scripted):
    """The relays read a body through generators of their own, which close when
    they end: that must not take the rest's reader with them. It did: the
    connection was neither pooled nor closed (a socket leaked per stream)."""
    srv = scripted([SSE_HEAD + b"a\r\ndata: {}\n\n\r\n" + DONE, 0.1, b"0\r\n\r\n"], OK)
    c = Client()
    r = c.request("POST", srv.url + "/v1/chat/completions", body=b"{}")

    def relay():
        yield from r.iter_content()
    outer = relay()
    got = b""
    for piece in outer:
        got += piece
        if got.endswith(b"data: [DONE]\n\n"):
            break
    r.end()
    outer.close()             # GeneratorExit through the body's own reader
    wait_until(lambda: any(c._idle.values()), "the connection back in the pool")
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 1


@pytest.mark.parametrize("rest", [
    b"a\r\ndata: {}\n\n\r\n0\r\n\r\n",             # payload after the end: not dropped silently
    None,                                        # the server hangs up instead of ending
    [0.5, b"0\r\n\r\n"],                           # too late (END_WAIT is 0.2 here)
])
def test_a_stream_whose_rest_is_not_its_end_is_not_reused(scripted, monkeypatch, rest):
    monkeypatch.setattr("common.http1.END_WAIT", 0.2)
    srv = scripted([SSE_HEAD + DONE] + (rest if isinstance(rest, list) else [rest]), OK)
    c = Client()
    r = c.request("POST", srv.url + "/", body=b"{}")
    _read_to_done(r)
    r.end()
    time.sleep(0.8)
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 2


def test_end_before_reading_or_after_the_end_is_a_close_or_nothing(scripted):
    srv = scripted(SSE_HEAD + b"a\r\ndata: {}\n\n\r\n", OK, OK)
    c = Client()
    r = c.request("GET", srv.url + "/")
    r.end()                               # nothing read: nothing known about the rest
    assert c.request("GET", srv.url + "/").content == b"ok"
    done = c.request("GET", srv.url + "/")
    assert done.content == b"ok"
    done.end()                            # read to its end and pooled: nothing to do
    assert srv.connections == 2 and len(c._idle[next(iter(c._idle))]) == 1


def test_a_fresh_request_asks_to_close_and_is_not_pooled(scripted):
    srv = scripted(OK)
    c = Client()
    assert c.request("GET", srv.url + "/", fresh=True).content == b"ok"
    assert b"Connection: close" in srv.heads[0]
    assert not any(c._idle.values())


def test_a_pooled_connection_the_server_closed_is_not_used(scripted):
    srv = scripted([OK, None], OK)                 # the server hangs up after one answer
    c = Client()
    assert c.request("GET", srv.url + "/").content == b"ok"
    time.sleep(0.1)
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 2


def test_a_streamed_answer_spends_its_connection_when_asked_and_a_spare_waits(scripted):
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 6\r\n\r\ndata:1"
    srv = scripted(sse, sse, OK)
    plain, spending = Client(), Client(fresh_after_stream=True)
    assert plain.request("GET", srv.url + "/").content == b"data:1"
    assert any(plain._idle.values()) and srv.connections == 1
    spent = spending.request("GET", srv.url + "/")
    assert spent.content == b"data:1"
    # not reused: a new connection opens in the background for the next request
    wait_until(lambda: any(spending._idle.values()), "a spare connection")
    wait_until(lambda: srv.connections == 3, "the server to count the spare")
    idle = next(iter(spending._idle.values()))
    assert len(idle) == 1
    assert spending.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 3


def test_no_spare_when_one_is_idle_or_the_upstream_is_gone(scripted):
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 6\r\n\r\ndata:1"
    srv = scripted(OK, sse)
    c = Client(fresh_after_stream=True)
    assert c.request("GET", srv.url + "/").content == b"ok"        # pooled
    assert c.request("GET", srv.url + "/", fresh=True).content == b"data:1"
    time.sleep(0.3)
    assert srv.connections == 2                                    # no spare: one was idle
    key = ("127.0.0.1", free_port())     # nothing listens there (a closed Scripted
    c._open_spare(key)                   # may still accept): nothing pooled, nothing raised
    assert not c._idle.get(key)


def test_idle_connections_are_kept_for_the_upstreams_used_last(scripted, monkeypatch):
    monkeypatch.setattr("common.http1.MAX_UPSTREAMS", 2)
    servers = [scripted(OK, OK) for _ in range(3)]
    c = Client()
    for srv in servers:
        assert c.request("GET", srv.url + "/").content == b"ok"
    first = ("127.0.0.1", int(servers[0].url.rsplit(":", 1)[1]))
    assert len(c._idle) == 2 and first not in c._idle
    assert c.request("GET", servers[1].url + "/").content == b"ok"     # used: kept, last
    assert list(c._idle)[-1][1] == int(servers[1].url.rsplit(":", 1)[1])


def test_interim_answers_are_skipped_and_head_answers_have_no_body(scripted):
    srv = scripted(b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
                   b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"HTTP/1.1 204 No\r\n\r\n", OK)
    c = Client()
    assert c.request("POST", srv.url + "/", body=b"x").content == b"ok"
    assert c.request("HEAD", srv.url + "/").content == b""
    assert c.request("DELETE", srv.url + "/").status_code == 204
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 1


def test_repeated_fields_are_joined_in_the_view_kept_in_the_fields_and_unfolded(scripted):
    srv = scripted(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\nX-F: one\r\n two\r\n"
                   b"Content-Length: 0\r\n\r\n")
    r = Client().request("GET", srv.url + "/")
    assert r.headers["X-A"] == "1, 2" and r.headers["x-f"] == "one two"
    assert list(r.headers) == ["X-A", "X-F", "Content-Length"]
    assert r.fields == [("X-A", "1"), ("x-a", "2"), ("X-F", "one two"), ("Content-Length", "0")]
    assert r.headers.fields is r.fields


def test_a_coded_body_is_decoded(scripted):
    data = gzip.compress(b'{"ok": ') + gzip.compress(b'true}')     # two members (RFC 1952)
    srv = scripted(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                   % len(data) + data,
                   b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx")
    c = Client()
    assert c.request("GET", srv.url + "/").json() == {"ok": True}
    with pytest.raises(BadAnswer, match="br"):
        c.request("GET", srv.url + "/")


@pytest.mark.parametrize("answer,cause", [
    (None, "closed_early"),                                         # hung up, no answer
    (b"SSH-2.0-OpenSSH\r\n\r\n", "upstream_failed"),                # not HTTP
    ([b"HTTP/1.1 200 OK\r\nContent-Le", None], "upstream_failed"),  # cut mid-head
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "upstream_failed"),
    ([b"HTTP/1.1 100 Continue\r\n\r\n", None], "upstream_failed"),  # closed after a 1xx
])
def test_a_failed_answer_is_a_requests_error_of_its_cause(scripted, answer, cause):
    srv = scripted(answer)
    with pytest.raises(requests.RequestException) as e:
        Client().request("GET", srv.url + "/")
    assert classify(e.value) == cause
    assert not_reached(e.value) == (cause == "closed_early")
    assert not waiting


@pytest.mark.parametrize("answer", [
    [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", None],
    [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n12345\r\n", None],
    [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
    [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n12345\r\n0\r\n\r\n"],
])
def test_a_body_that_breaks_off_is_broken(scripted, answer):
    srv = scripted(answer)
    r = Client().request("GET", srv.url + "/")
    with pytest.raises(BrokenBody) as e:
        r.content
    assert classify(e.value) == "broke_off"


def test_timeouts(scripted, monkeypatch):
    srv = scripted([b"HTTP/1.1 200 OK\r\n", 1.0])     # a head that does not end in time
    with pytest.raises(requests.exceptions.ReadTimeout) as e:
        Client().request("GET", srv.url + "/", timeout=(5, 0.2))
    assert classify(e.value) == "timeout"

    def slow_connect(sock, address):
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket.socket, "connect", slow_connect)
    with pytest.raises(requests.exceptions.ConnectTimeout) as e:
        Client().request("GET", srv.url + "/", timeout=(0.2, None))
    assert classify(e.value) == "timeout" and not not_reached(e.value)


def test_only_plain_http_urls():
    with pytest.raises(requests.exceptions.InvalidURL):
        Client().request("GET", "https://example.com/")


def test_a_name_is_looked_up_once_and_again_when_its_address_fails(scripted, monkeypatch):
    from common import http1
    srv, other = scripted(OK), scripted(OK)
    looked_up = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        looked_up.append(host)
        return real("127.0.0.1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(http1, "_resolved", {"backend-x": (socket.AF_INET, ("127.0.0.2",))})
    port = srv.url.rsplit(":", 1)[1]
    c = Client()
    # The cached address refuses: the name is looked up again, once.
    assert c.request("GET", f"http://backend-x:{port}/", fresh=True).content == b"ok"
    assert looked_up == ["backend-x"]
    assert c.request("GET", f"http://backend-x:{other.url.rsplit(':', 1)[1]}/",
                     fresh=True).content == b"ok"
    assert looked_up == ["backend-x"]               # the same name: no second look-up
    with pytest.raises(requests.exceptions.ConnectionError):
        c.request("GET", "http://127.0.0.1:9/")     # a literal refused: no look-up at all
    assert looked_up == ["backend-x"]


def test_a_header_block_without_end_is_refused_not_buffered_forever(scripted):
    srv = scripted([b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70000, 1.0])
    with pytest.raises(BadAnswer, match="header block"):
        Client().request("GET", srv.url + "/")


def test_chunked_framing_wins_over_a_length(scripted):
    """RFC 9112 6.3: with Transfer-Encoding, Content-Length is ignored (a
    mismatch is how requests are smuggled)."""
    srv = scripted(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n"
                   b"5\r\nhello\r\n0\r\n\r\n", OK)
    c = Client()
    assert c.request("GET", srv.url + "/").content == b"hello"
    assert c.request("GET", srv.url + "/").content == b"ok"
    assert srv.connections == 1


def test_the_names_looked_up_are_bounded(monkeypatch):
    """Every backend container has a name of its own: a swapper that swaps for
    months must not keep one entry per container it ever started."""
    from common import http1
    monkeypatch.setattr(http1, "_resolved", {})
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))])
    for i in range(http1.MAX_RESOLVED * 3):
        http1._address(f"stack-backend-m-{i:06x}", 8080)
    assert len(http1._resolved) == http1.MAX_RESOLVED
    assert f"stack-backend-m-{http1.MAX_RESOLVED * 3 - 1:06x}" in http1._resolved
