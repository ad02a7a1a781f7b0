"""Slow request heads against the real proxy (`python -m proxy`: gunicorn + gevent).

gunicorn's gevent worker holds each wait for a request head (idle time and the
head's bytes together) to its keep-alive, 75 s here: 1,000 connections sending
a request line and then a header byte every 5 s, or nothing at all, held all of
its 1,000 connections for 75 s, and a new client waited 74 s. A new
connection's head now has HEADER_TIMEOUT (common.serve.HeadTimedWorker); a
served connection still waits the keep-alive for its next request, and what
comes after a head (a slow body, a slow answer) is not cut by it."""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import pytest

from tests.support.proxyproc import ProxyProcess
from tests.support.rawhttp import send
from tests.support.servers import ServerThread

HEADER_TIMEOUT = 2.0       # the proxy's HEADER_TIMEOUT here
BODY_TIMEOUT = 20.0        # its BODY_TIMEOUT: well beyond HEADER_TIMEOUT
SLOW = 1000                # slow-header connections: all of gunicorn's worker_connections


def upstream(environ, start_response):
    if environ["PATH_INFO"].startswith("/v1/slow"):
        time.sleep(HEADER_TIMEOUT + 1)           # an answer slower than a head may be
    n = len(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
    body = json.dumps({"path": environ["PATH_INFO"], "received": n}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]


@pytest.fixture(scope="module")
def proxy():
    with ServerThread(upstream) as up, \
            ProxyProcess(BACKEND_URL=up.url, WEB_SEARCH=0, MODELS_TTL=0, LOG_LEVEL="warning",
                         HEADER_TIMEOUT=HEADER_TIMEOUT, BODY_TIMEOUT=BODY_TIMEOUT) as p:
        yield p


def connect(proxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=30)


def answer(s: socket.socket) -> tuple[bytes, bytes]:
    """One answer with a Content-Length, read off a kept-alive connection: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = s.recv(65536)
        assert piece, data
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([line.split(b":", 1)[1] for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:")][0])
    while len(body) < length:
        piece = s.recv(65536)
        assert piece, body
        body += piece
    return head, body


def test_slow_and_silent_connections_do_not_lock_new_clients_out(proxy, nofile):  # noqa: F811
    """1,000 connections each sending its request head a byte every half second and a
    silent one fill the worker's connections: a new client is served within about
    HEADER_TIMEOUT (it waited 74 s, the keep-alive, before), and every slow or silent
    connection is closed, unanswered, once its HEADER_TIMEOUT has passed."""
    silent = connect(proxy)
    slow = []
    closed: dict[socket.socket, float] = {}
    stop = threading.Event()
    try:
        opened = time.monotonic()
        for _ in range(SLOW):
            s = connect(proxy)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(s)

        def drip():                     # a header byte every half second, never the end
            while not stop.wait(0.5):
                for s in slow:
                    if s not in closed:
                        try:
                            s.send(b"a")
                        except OSError:
                            pass
        threading.Thread(target=drip, daemon=True).start()

        t0 = time.monotonic()
        ans = send(proxy.url, "GET", "/healthz", timeout=HEADER_TIMEOUT + 60)
        waited = time.monotonic() - t0
        assert ans.status == 200, ans.body
        assert waited < HEADER_TIMEOUT + 10, waited

        sel = selectors.DefaultSelector()
        for s in slow + [silent]:
            sel.register(s, selectors.EVENT_READ)
        got = {}
        # the last ones were accepted as the first were closed: two deadlines, and room
        deadline = opened + 2 * HEADER_TIMEOUT + 20
        while len(closed) < SLOW + 1 and time.monotonic() < deadline:
            for key, _ in sel.select(0.5):
                try:
                    got[key.fileobj] = key.fileobj.recv(4096)
                except OSError:
                    got[key.fileobj] = b""
                closed[key.fileobj] = time.monotonic() - opened
                sel.unregister(key.fileobj)
        assert len(closed) == SLOW + 1, f"{SLOW + 1 - len(closed)} still open"
        assert set(got.values()) == {b""}          # closed without an answer
        assert min(closed.values()) >= HEADER_TIMEOUT - 0.5, min(closed.values())
    finally:
        stop.set()
        for s in slow + [silent]:
            s.close()
    # and the worker serves on
    assert send(proxy.url, "GET", "/healthz", timeout=10).status == 200


def test_a_served_connection_waits_the_keep_alive_for_its_next_request(proxy):
    """A kept-alive connection idle past HEADER_TIMEOUT is reused, not cut: clients
    keep idle connections in their pools (the keep-alive is 75 s)."""
    with connect(proxy) as s:
        for _ in range(2):
            s.sendall(b"GET /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head, body = answer(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"connection: keep-alive" in head.lower(), head
            time.sleep(HEADER_TIMEOUT + 1)


def test_served_connections_gone_quiet_give_way_to_new_clients(proxy, nofile):  # noqa: F811
    """1,000 connections each served once and then idle (clients' pools, or a page
    that opens many) fill the worker's connections: a new client is served at once,
    not after their 75 s keep-alive (it waited 72 s before), because each new
    connection past 90 % of worker_connections closes the longest-idle served
    ones; those that were not needed stay open and are reused."""
    idle = []
    try:
        for _ in range(SLOW):
            s = connect(proxy)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head, _ = answer(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            idle.append(s)
        t0 = time.monotonic()
        ans = send(proxy.url, "GET", "/healthz", timeout=60)
        waited = time.monotonic() - t0
        assert ans.status == 200, ans.body
        assert waited < HEADER_TIMEOUT + 10, waited
        sel = selectors.DefaultSelector()
        for s in idle:
            sel.register(s, selectors.EVENT_READ)
        closed = {key.fileobj for key, _ in sel.select(1.0)}
        assert all(s.recv(4096) == b"" for s in closed)     # closed, unanswered
        assert len(closed) >= SLOW // 10, len(closed)       # room was made for the rest
        assert idle[0] in closed, "the longest idle went first"
        kept = idle[-1]                                      # the newest: still served
        assert kept not in closed
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert answer(kept)[0].startswith(b"HTTP/1.1 200")
    finally:
        for s in idle:
            s.close()


def test_slow_answers_and_slow_bodies_outlast_the_header_timeout(proxy):
    """HEADER_TIMEOUT holds the head only: an answer that takes longer, and a body that
    arrives over longer (within BODY_TIMEOUT), are served."""
    ans = send(proxy.url, "GET", "/v1/slow/1", timeout=30)
    assert ans.status == 200 and ans.json()["path"] == "/v1/slow/1"

    body = b'{"x": "' + b"y" * 114 + b'"}'           # 125 bytes
    with connect(proxy) as s:
        s.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/"
                  b"json\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 25):            # 5 pieces, over 4 s
            time.sleep((HEADER_TIMEOUT + 2) / 5)
            s.sendall(body[i:i + 25])
        head, got = answer(s)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(got) == {"path": "/v1/echo", "received": len(body)}


def test_answers_that_end_their_connection_say_close():
    """A 408 (a body past BODY_TIMEOUT) and a 413 (a declared length over the limit)
    end their connection, and now say `Connection: close` (they said keep-alive)."""
    with ServerThread(upstream) as up, \
            ProxyProcess(BACKEND_URL=up.url, WEB_SEARCH=0, LOG_LEVEL="warning",
                         BODY_TIMEOUT=1) as p:
        for length, status in [(1000, b"408"), (10 ** 9, b"413")]:
            with connect(p) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
                          % length)
                got = b""
                while piece := s.recv(65536):
                    got += piece
            head = got.partition(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 " + status), head
            assert b"\r\nconnection: close\r\n" in head + b"\r\n", head


def test_a_stop_does_not_wait_for_idle_kept_alive_connections():
    """SIGTERM (docker compose down): an agent's idle kept-alive connection has
    nothing in flight, yet held the proxy's graceful stop for gunicorn's 30 s
    graceful_timeout (compose kills it at 10 s). It is closed at once and the proxy
    exits; a request in flight at the signal still gets its whole answer."""
    import signal
    with ServerThread(upstream) as up:
        p = ProxyProcess(BACKEND_URL=up.url, WEB_SEARCH=0, LOG_LEVEL="warning")
        p.start()
        try:
            idle, busy = connect(p), connect(p)
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert answer(idle)[0].startswith(b"HTTP/1.1 200")
            busy.sendall(b"GET /v1/slow/1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            time.sleep(0.5)                              # in flight at the signal
            p.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            head, body = answer(busy)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert json.loads(body)["path"] == "/v1/slow/1"
            busy.settimeout(25)
            assert busy.recv(4096) == b"", "kept alive by a stopping proxy"
            idle.settimeout(25)
            assert idle.recv(4096) == b"", "the idle connection was answered, not closed"
            p.proc.wait(25)
            # gunicorn's graceful_timeout (30 s) was what it waited before
            assert time.monotonic() - t0 < 20, time.monotonic() - t0
        finally:
            p.stop(kill=True)
