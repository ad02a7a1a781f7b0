"""common.http1 against hostile or broken upstreams and hostile request targets,
each byte scripted: framing conflicts, Unicode digits, unbounded heads and
trailers, floods of interim answers, targets and fields that must not reach a
request line, and descriptors beyond select()'s reach."""
from __future__ import annotations

import gzip
import resource
import socket
import time

import pytest
import requests

from common import disconnect
from common.failures import CAUSES, classify, failure, not_reached
from common.http1 import BadAnswer, BadTarget, BrokenBody, Client, Connection
from common.streaming import answer_headers, forward_headers
from tests.support.servers import Scripted

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture
def scripted():
    servers = []

    def make(*answers, **kw):
        servers.append(Scripted(*answers, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


# ------------------------------------------------------------ answer framing

@pytest.mark.parametrize("field", [
    "Content-Length: \u00b2".encode(),        # isdigit() is true, int() fails
    "Content-Length: \u00b2".encode("latin-1"),
    b"Content-Length: -1",
    b"Content-Length: 1_0",
    b"Content-Length: 2\r\nContent-Length: 3",
    b"Transfer-Encoding: xchunked",           # was read as chunked
    b"Transfer-Encoding: gzip, chunked",      # a coding we never asked for
])
def test_a_framing_h11_refuses_is_a_bad_answer_not_a_crash(scripted, field):
    srv = scripted(b"HTTP/1.1 200 OK\r\n" + field + b"\r\n\r\n2\r\nok\r\n0\r\n\r\n")
    with pytest.raises(BadAnswer) as e:
        Client().request("GET", srv.url + "/")
    assert classify(e.value) == "upstream_failed" and not not_reached(e.value)


def test_chunked_wins_over_a_length_and_the_relay_carries_no_stale_length(scripted):
    srv = scripted(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n"
                   b"Content-Type: text/plain\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    r = Client().request("GET", srv.url + "/")
    assert r.framing == "chunked" and r.length is None
    relayed = answer_headers(r)
    assert "Content-Length" not in relayed and relayed["Content-Type"] == "text/plain"
    assert r.content == b"hello"


@pytest.mark.parametrize("answer,framing,length", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", "length", "2"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok", "length", "2"),   # one value
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
     "chunked", None),
    ([b"HTTP/1.1 200 OK\r\n\r\nok", None], "close", None),
    (b"HTTP/1.1 204 No Content\r\nContent-Length: 2\r\n\r\n", "none", None),
])
def test_the_relayed_length_follows_the_framing(scripted, answer, framing, length):
    srv = scripted(answer)
    r = Client().request("GET", srv.url + "/")
    assert r.framing == framing
    assert answer_headers(r).get("Content-Length") == length
    r.content


def test_a_coded_body_is_relayed_without_its_length(scripted):
    data = gzip.compress(b"hello")
    srv = scripted(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                   % len(data) + data)
    r = Client().request("GET", srv.url + "/")
    assert r.framing == "length" and "Content-Length" not in answer_headers(r)
    assert r.content == b"hello"


def test_every_gzip_member_is_decoded_and_a_cut_one_is_an_error(scripted):
    two = gzip.compress(b"first ") + gzip.compress(b"second")
    cut = gzip.compress(b"x" * 1000)[:-4]
    srv = scripted(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                   % len(two) + two,
                   b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                   % len(cut) + cut)
    c = Client()
    assert c.request("GET", srv.url + "/").content == b"first second"
    with pytest.raises(requests.exceptions.ContentDecodingError) as e:
        c.request("GET", srv.url + "/").content
    assert classify(e.value) == "broke_off"


# ------------------------------------------------------------ bounds

# The scripted server is still sending when the client gives up on it.
_PEER_STILL_SENDING = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")


@_PEER_STILL_SENDING
def test_an_endless_trailer_section_is_refused_soon(scripted):
    """It was buffered without end (and rescanned on each read: 16 MB, 2.8 s of CPU)."""
    pad = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    srv = scripted([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"]
                   + [pad * 1000] * 16 + [5.0], pause=0)
    r = Client().request("GET", srv.url + "/", timeout=(5, 3))
    t0 = time.process_time()
    with pytest.raises(BrokenBody):
        r.content
    assert time.process_time() - t0 < 1.0


@_PEER_STILL_SENDING
def test_an_endless_head_is_refused_soon(scripted):
    srv = scripted([b"HTTP/1.1 200 OK\r\n"] + [b"X-Pad: a\r\n" * 10000] * 20 + [5.0], pause=0)
    with pytest.raises(BadAnswer, match="header block"):
        Client().request("GET", srv.url + "/", timeout=(5, 3))


def test_a_flood_of_interim_answers_is_refused(scripted):
    srv = scripted(b"HTTP/1.1 100 Continue\r\n\r\n" * 11 + OK)
    with pytest.raises(BadAnswer, match="interim"):
        Client().request("GET", srv.url + "/")
    few = scripted(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 10 + OK)
    assert Client().request("GET", few.url + "/").content == b"ok"


@pytest.mark.parametrize("answer", [
    [b"HTTP/1.1 100 Continue\r\n\r\n", None],
    [b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200", None],
])
def test_a_close_after_an_answer_began_is_not_sent_again(scripted, answer):
    """The request reached the upstream: only an answer with no byte at all
    may be taken for a stale connection and sent once more."""
    srv = scripted(answer)
    with pytest.raises(BadAnswer) as e:
        Client().request("POST", srv.url + "/v1/chat/completions", body=b"{}")
    assert not not_reached(e.value) and classify(e.value) != "closed_early"
    nothing = scripted(None)
    with pytest.raises(requests.exceptions.ConnectionError) as e:
        Client().request("POST", nothing.url + "/", body=b"{}")
    assert not_reached(e.value)


def test_an_upstream_reset_mid_body_is_a_broken_body():
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\npartial")
        time.sleep(0.1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()                                  # RST, not FIN

    import threading
    threading.Thread(target=serve, daemon=True).start()
    r = Client().request("GET", f"http://127.0.0.1:{srv.getsockname()[1]}/")
    with pytest.raises(BrokenBody):
        r.content
    srv.close()


# ------------------------------------------------------------ what is sent

@pytest.mark.parametrize("target", [
    "/upstream/m/\u20ac",                 # non-ASCII: was a UnicodeEncodeError
    "/v1/\xff",
    "/v1/responses/x\r\nX-Injected: 1/cancel",
    "/v1/a b", "/v1/a\tb", "/v1/a\x7f", "/v1/a\x00", "/v1/a\x01", "/v1/a\nb",
    "/v1/a#frag", "/v1/100%", "/v1/%zz", "/v1/a\"b", "/v1/{x}",
])
def test_a_target_rfc3986_does_not_allow_is_refused_before_anything_is_sent(scripted, target):
    srv = scripted(OK)
    with pytest.raises(BadTarget) as e:
        Client().request("GET", srv.url + target)
    assert isinstance(e.value, requests.exceptions.InvalidURL)
    assert classify(e.value) == "bad_target"
    err = failure(classify(e.value), "x")
    assert (err.status, CAUSES["bad_target"]) == (400, (400, "invalid_request_error",
                                                         "invalid_path"))
    time.sleep(0.05)
    assert srv.connections == 0


def test_a_target_is_written_exactly_as_given_still_encoded(scripted):
    target = "/v1/x%0D%0AX-Injected:%201/%E2%82%AC/a%2Fb?q=%23&r=a:b@c!$&'()*+,;=~._-"
    srv = scripted(OK)
    assert Client().request("GET", srv.url + target).content == b"ok"
    assert srv.heads[0].split(b"\r\n")[0] == b"GET " + target.encode() + b" HTTP/1.1"


@pytest.mark.parametrize("headers", [
    {"X-A": "1\r\nX-Evil: 1"}, {"X-A": "1\x00"}, {"X-A\nB": "1"}, {"X:A": "1"},
    {"X-A": "\u20ac"},                    # not a Latin-1 byte: was a UnicodeEncodeError
])
def test_a_field_that_cannot_be_sent_is_refused_as_the_clients_fault(headers):
    with pytest.raises(requests.exceptions.InvalidHeader) as e:
        Client().request("GET", "http://127.0.0.1:9/", headers=headers)
    assert classify(e.value) == "bad_header" and failure("bad_header", "x").status == 400


def test_a_latin1_field_value_goes_as_its_bytes(scripted):
    srv = scripted(OK)
    Client().request("GET", srv.url + "/", headers={"X-Name": "caf\xc3\xa9 "}).content
    assert b"X-Name: caf\xc3\xa9\r\n" in srv.heads[0] + b"\r\n"


# ------------------------------------------------------------ relayed fields

def test_repeated_set_cookie_stays_repeated_and_connection_named_fields_are_dropped(scripted):
    srv = scripted(b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2; Path=/\r\n"
                   b"Connection: keep-alive, X-Hop\r\nX-Hop: secret\r\nKeep-Alive: 5\r\n"
                   b"X-End: 1\r\nContent-Length: 2\r\n\r\nok")
    r = Client().request("GET", srv.url + "/")
    relayed = list(answer_headers(r).items())
    assert relayed == [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2; Path=/"), ("X-End", "1"),
                       ("Content-Length", "2")]
    assert list(forward_headers(r.headers).items()) == relayed[:3]
    # a request's fields the same way
    req = forward_headers({"Connection": "X-Secret", "X-Secret": "1", "X-Keep": "2"})
    assert list(req.items()) == [("X-Keep", "2")]


# ------------------------------------------------------------ poll, not select

@pytest.fixture
def many_fds():
    """Descriptors up to beyond 1024, so the next socket's is above select()'s reach."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1100 + 64
    if soft < want:     # a hard limit below it is raised too (root; else this fails)
        raised = hard if hard == resource.RLIM_INFINITY else max(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, raised))
    held = [socket.socket() for _ in range(1100)]
    yield
    for s in held:
        s.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _pair_above_1024():
    a, b = socket.socketpair()
    assert a.fileno() >= 1024 and b.fileno() >= 1024
    return a, b


def test_liveness_works_above_descriptor_1024(many_fds):
    a, b = _pair_above_1024()
    conn = Connection(a, ("x", 1))
    assert conn.alive()                      # select() raised: taken for dead
    b.close()
    assert not conn.alive()
    conn.close()


def test_a_client_above_descriptor_1024_is_not_taken_for_gone(many_fds):
    a, b = _pair_above_1024()
    environ = {"gunicorn.socket": a}
    assert not disconnect.client_gone(environ)      # select() raised: taken for gone
    b.sendall(b"more")                              # bytes to read: still there
    assert not disconnect.client_gone(environ)
    a.recv(4)
    b.close()
    assert disconnect.client_gone(environ)
    a.close()
