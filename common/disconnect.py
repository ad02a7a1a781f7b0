"""Noticing a client that went away while we wait on an upstream.

Under gunicorn's gevent worker the client socket is in the WSGI environ. A
streaming response notices a disconnect on its next write; a request that waits
(queued in the swapper, or for a non-streaming answer that arrives whole after
minutes of generation) polls the socket instead, and gives up: the upstream
connection is closed, so the backend stops generating.
"""
from __future__ import annotations

import select
import socket
from typing import Callable, TypeVar

import requests
from requests.adapters import HTTPAdapter
import urllib3
from greenlet import getcurrent

try:
    from gevent.monkey import get_original
    _select = get_original("select", "select")
except ImportError:                   # no gevent: the standard library's
    _select = select.select

T = TypeVar("T")

POLL = 1.0   # seconds between checks of the client socket


class ClientGone(Exception):
    """The client closed its connection while we waited."""


def client_gone(environ: dict) -> bool:
    """True when the client closed its connection (gunicorn exposes the socket)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        # Not recv(MSG_DONTWAIT): gevent's socket waits on EAGAIN. A zero-timeout
        # select says whether a read would return at once; EOF reads as b"".
        # The OS's own select: gevent's yields to the loop, and this also runs
        # in the loop itself (call_watching_client's timer).
        readable, _, _ = _select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (ValueError, OSError):
        return True


# id(greenlet) -> the upstream connection it is waiting on for an answer
_waiting: dict[int, urllib3.connection.HTTPConnection] = {}


class _WatchedConnection(urllib3.connection.HTTPConnection):
    """Remembers which greenlet waits on it, so a hang-up can cut it; tells
    truly whether a pooled connection is still open; and remembers whether it
    carried a streamed answer, after which the swapper does not use it again."""

    spent = False
    _held: bytes | None = None     # the header block, while a body is due

    def request(self, method, url, body=None, headers=None, **kwargs):
        """urllib3 sends a request's header block and its body in two send()s;
        a bytes body goes in the same one here. On loopback each send runs the
        receiver's TCP path and wakes it: one wake-up less per request."""
        if isinstance(body, bytes) and body:
            self._held = b""
        try:
            result = super().request(method, url, body=body, headers=headers, **kwargs)
        finally:
            held, self._held = self._held, None
        if held:                        # no body went out after all: the head alone
            super().send(held)
        return result

    def send(self, data):
        held = self._held
        if held is None:
            return super().send(data)
        if not held:                    # the header block: wait for the body
            self._held = data
            return None
        self._held = None
        return super().send(held + data)

    @property
    def is_connected(self) -> bool:
        """urllib3 asks this before reusing a pooled connection. Its own check
        is a zero-timeout poll through gevent's poll object, which with many
        greenlets runnable reported connections the server had closed while
        idle (gunicorn's keep-alive, llama-server after a stream) as open: 49-63
        of 256 streams failed with RemoteDisconnected after an idle pause
        (tests/integration/test_stale_keepalive.py). The OS's own zero-timeout
        select answers truly and at once (gevent's also yields to the loop).
        Readable while idle means EOF (or stray bytes): not reusable either way."""
        if self.sock is None:
            return False
        try:
            readable, _, _ = _select([self.sock], [], [], 0)
        except (ValueError, OSError):
            return False
        return not readable

    def getresponse(self, *args, **kwargs):
        key = id(getcurrent())
        _waiting[key] = self
        try:
            resp = super().getresponse(*args, **kwargs)
        finally:
            _waiting.pop(key, None)
        # llama-server closes the connection right after a streamed answer
        # although it advertises keep-alive: reused at once, it fails with
        # RemoteDisconnected. Such a connection goes back to no one.
        self.spent = resp.headers.get("content-type", "").startswith("text/event-stream")
        return resp


class _WatchedPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedConnection


class _StreamSpendingPool(_WatchedPool):
    """Never reuses a connection that carried a streamed answer."""

    def _put_conn(self, conn) -> None:
        if conn is not None and conn.spent:
            conn.close()
            conn = None               # the pool opens a new one when needed
        super()._put_conn(conn)


def new_session(pool_size: int, fresh_after_stream: bool = False) -> requests.Session:
    """A pooled session to an upstream: no retries (callers decide), no proxies
    from the environment, connections cuttable by call_watching_client (and,
    with `fresh_after_stream`, not reused after a streamed answer)."""
    s = requests.Session()
    s.trust_env = False            # never route backend traffic through env proxies
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return watch_connections(s, fresh_after_stream)


def watch_connections(session: requests.Session,
                      fresh_after_stream: bool = False) -> requests.Session:
    """Make the session's plain-HTTP connections cuttable by call_watching_client.
    With `fresh_after_stream`, a connection that carried a streamed (SSE)
    answer is closed instead of reused (for llama-server, see above)."""
    pool = _StreamSpendingPool if fresh_after_stream else _WatchedPool
    for adapter in session.adapters.values():
        pm = adapter.poolmanager
        pm.pool_classes_by_scheme = {**pm.pool_classes_by_scheme, "http": pool}
    return session


def call_watching_client(fn: Callable[[], T], environ: dict, poll: float = POLL) -> T:
    """Run fn() (blocking upstream I/O) and return its result; if the client
    goes away first, shut its upstream connection down (so llama.cpp and vLLM
    stop generating) and raise ClientGone where fn() waits. Outside a gevent
    server (no client socket in the environ) this simply calls fn(). Its
    session must be watch_connections()'d.

    The check is a timer of the event loop every `poll` seconds, not a greenlet
    of its own: an answer that comes within a second (most non-streamed ones)
    costs a timer started and stopped, not a spawn and two switches."""
    if environ.get("gunicorn.socket") is None:
        return fn()
    import gevent
    me = getcurrent()
    timer = gevent.get_hub().loop.timer(poll, poll)

    def check():                # runs in the event loop: must not block
        if not client_gone(environ):
            return
        timer.stop()
        # Hang up on the upstream first: shutdown() sends the FIN at once,
        # whatever else still holds the socket (a half-read response does),
        # so the backend sees the client leave and stops generating.
        conn = _waiting.get(id(me))
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        me.throw(ClientGone())

    timer.start(check)
    try:
        return fn()
    finally:
        timer.close()
