"""Serve a Flask app factory with gunicorn's gevent worker, from Python.

Both services run this way in their containers and outside Docker
(`python -m proxy`, `python -m swapper`), so tests exercise the real server.
The app is built inside the worker (`factory()`), after gevent has patched the
standard library, so the master never imports requests/ssl unpatched.

The request's deadlines: its head is held to `header_timeout` on a new
connection (HeadTimedWorker, here), its body to BODY_TIMEOUT (common.guard).
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from typing import Callable

import gevent
from gevent.local import local
from gunicorn import util as gunicorn_util
from gunicorn.app.base import BaseApplication
from gunicorn.http import wsgi as gunicorn_wsgi
from gunicorn.workers.ggevent import GeventWorker

from .errors import error_body

_CODES = {400: "bad_request", 403: "forbidden", 414: "request_line_too_long",
          417: "expectation_failed", 431: "headers_too_large", 500: "internal_error",
          501: "not_implemented"}


def write_envelope_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's answer to a request it refuses before the app runs (request line
    or headers too large or malformed, bad chunking...), in the OpenAI envelope
    instead of gunicorn's HTML page."""
    body = json.dumps(error_body(mesg or reason, status_int,
                                 code=_CODES.get(status_int))).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    gunicorn_util.write_nonblock(sock, head.encode("latin-1") + body)


# gunicorn's workers call util.write_error for these; every worker process of
# ours serves through this module, so the envelope replaces the HTML page.
gunicorn_util.write_error = write_envelope_error


class _Collect:
    """Stands in for the socket while gunicorn writes a header block we hold."""

    def __init__(self):
        self.data = b""

    def sendall(self, data: bytes) -> None:
        self.data += data


class HeadWithBody(gunicorn_wsgi.Response):
    """gunicorn's response, except that the header block leaves in one send()
    with the first body bytes: a known-length body (Content-Length) whole, a
    streamed (chunked) one with its first chunk, instead of two sends. On
    loopback every send() runs the receiver's TCP path and wakes it: an answer
    passed through proxy and swapper cost one wake-up more per hop.

    gunicorn sends a stream's headers at its first write anyway, so nothing
    waits longer: an app that wants its headers out before it has a body
    writes b"", which still sends them at once. A relayed event stream does
    while the backend works on its first token (common.streaming.headers_now):
    the next hop sets up its end meanwhile, not after the token. So does a
    relay whose upstream broke off before its first byte, before it ends the
    connection (common.streaming.BrokenRelay)."""

    _head = b""

    def send_headers(self):
        if self.headers_sent or not (self.chunked or self.response_length):
            return super().send_headers()
        sock, self.sock = self.sock, _Collect()
        try:
            super().send_headers()
        finally:
            self._head, self.sock = self.sock.data, sock

    def write(self, arg):
        super().write(arg)
        if self._head and not arg:               # an empty write: the headers, now
            self._flush_head()

    def _emit_body(self, data: bytes) -> None:
        head, self._head = self._head, b""
        if not head:
            return super()._emit_body(data)
        if self.chunked:
            data = b"%X\r\n%s\r\n" % (len(data), data)
        self.sock.sendall(head + data)

    def _flush_head(self) -> None:
        head, self._head = self._head, b""
        if head:
            self.sock.sendall(head)

    def should_close(self):
        # A request answered before its body was read to the end (a 408, a 413 on
        # its declared length, a 401...: common.guard.close_connection) ends its
        # connection; its answer says so (gunicorn said keep-alive, then closed).
        body = getattr(self.req, "body", None)
        return getattr(body, "failed", False) is True or super().should_close()

    def close(self):
        if not self.headers_sent:
            self.send_headers()
        self._flush_head()           # no body was written (HEAD, an app that wrote none)
        super().close()
        if self.response_length is not None and self.sent < self.response_length \
                and not self._omits_body:
            # A body that ended short of its Content-Length: the client can
            # only tell if the connection ends here.
            self.force_close()


# gunicorn.http.wsgi.create() builds its responses from this name.
gunicorn_wsgi.Response = HeadWithBody


# Set in a worker when it is told to stop (SIGTERM): a stream that never ends by
# itself (the swapper's /events) ends at its next beat, so the stop is not held.
STOPPING = threading.Event()


class HeadTimedWorker(GeventWorker):
    """gunicorn's gevent worker, with a new connection's first request head held
    to `header_timeout` seconds from its accept: not there in time, the
    connection is closed, without an answer. gunicorn holds every wait for a
    request head (idle time and the head's bytes together) to `keepalive`; a
    connection that never sent a whole request kept one of `worker_connections`
    that long (75 s: 1,000 sending a header byte every 5 s, or nothing at all,
    locked new clients out for 74 s). A connection that has been served still
    waits `keepalive` for its next request: clients reuse idle ones -- until the
    worker's connections run short (RECLAIM_AT of them open): then each new
    connection closes the longest-idle served ones first, as nginx does (1,000
    connections that made one request each and went quiet locked new clients
    out for 72 s). None: gunicorn's `keepalive` for the first head too."""

    header_timeout: float | None = None
    RECLAIM_AT = 0.9                   # of worker_connections open: idle ones go

    def init_process(self):
        self._connection = local()     # gevent serves each connection in a greenlet of its own
        self._open = 0                 # connections being served or waited on
        self._idle: dict = {}          # greenlet -> its wait's timer, the longest idle first
        super().init_process()

    def handle(self, listener, client, addr):
        self._open += 1
        try:
            super().handle(listener, client, addr)
        finally:
            self._open -= 1

    def timeout_ctx(self):             # around each wait for a request head
        if STOPPING.is_set():          # the answer in flight at the stop was the last
            return gevent.Timeout(0, False)
        connection = self._connection
        if getattr(connection, "kept_alive", False):
            return self._idle_wait()
        connection.kept_alive = True   # any later wait: for a served connection's next request
        self._reclaim()
        if self.header_timeout is None:
            return super().timeout_ctx()
        return gevent.Timeout(self.header_timeout, False)   # False: ends the wait, silently

    def handle_exit(self, sig, frame):
        """SIGTERM: gunicorn stops accepting and lets what is in flight finish (up to
        graceful_timeout); a connection idle between two requests has nothing in
        flight, yet held the stop for as long as its keep-alive (a connected agent
        held the proxy's for its 30 s, past compose's 10 s). Those close now, and
        endless streams (the swapper's /events) end at their next beat (STOPPING)."""
        super().handle_exit(sig, frame)
        gevent.spawn(self._stopping)     # out of the signal handler

    def _stopping(self) -> None:
        STOPPING.set()
        self._reclaim(everyone=True)

    @contextmanager
    def _idle_wait(self):
        """A served connection's wait for its next head: `keepalive`, or less when
        _reclaim ends it (its own timer thrown into it: the wait ends as if it
        had run out, and gunicorn closes the connection)."""
        timer = gevent.Timeout(self.cfg.keepalive, False)
        me = gevent.getcurrent()
        self._idle[me] = timer
        try:
            with timer:
                yield
        finally:
            self._idle.pop(me, None)

    def _reclaim(self, everyone: bool = False) -> None:
        over = len(self._idle) if everyone else \
            self._open - int(self.worker_connections * self.RECLAIM_AT)
        for glet, timer in list(self._idle.items())[:max(over, 0)]:
            self._idle.pop(glet, None)
            glet.kill(timer, block=False)


class _Server(BaseApplication):
    def __init__(self, factory: Callable, options: dict):
        self._factory = factory
        self._options = options
        super().__init__()

    def load_config(self):
        for key, value in self._options.items():
            if value is not None:
                self.cfg.set(key, value)

    def load(self):                # in the worker, after gevent has patched
        return self._factory()


def serve(factory: Callable, host: str, port: int, *, workers: int = 1,
          name: str = "coding-stack", loglevel: str = "info", keepalive: int = 75,
          header_timeout: float | None = None,
          on_exit: Callable[[], None] | None = None,
          child_exit: Callable[[int], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT. On SIGTERM the worker finishes in-flight
    requests, but also waits for idle keep-alive connections to time out:
    `keepalive` bounds how long an idle client delays a shutdown. A new
    connection's first request head must arrive within `header_timeout` seconds
    (HeadTimedWorker; None: `keepalive`). `child_exit(pid)` runs in the master
    when a worker exits."""
    _Server(factory, {
        "bind": f"{host}:{port}",
        "workers": workers,
        "worker_class": type("HeadTimedWorker", (HeadTimedWorker,),
                             {"header_timeout": header_timeout}),
        "worker_connections": 1000,
        "timeout": 0,              # streams, cold starts and swaps last minutes
        "graceful_timeout": 30,
        "keepalive": keepalive,
        "loglevel": loglevel.lower(),
        "accesslog": None,
        "errorlog": "-",
        "proc_name": name,
        # gunicorn 27 opens a control socket under ~ by default: several servers
        # (or a user with no home) would fight over it.
        "control_socket_disable": True,
        "on_exit": (lambda server: on_exit()) if on_exit else None,
        "child_exit": (lambda server, worker: child_exit(worker.pid)) if child_exit else None,
    }).run()
