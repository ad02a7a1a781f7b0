"""Noticing a client that went away while we wait on an upstream.

Under gunicorn's gevent worker the client socket is in the WSGI environ. A
streaming response notices a disconnect on its next write; a request that waits
(queued in the swapper, or for a non-streaming answer that arrives whole after
minutes of generation) polls the socket instead, and gives up: the upstream
connection is closed, so the backend stops generating.
"""
from __future__ import annotations

import socket
from typing import Callable, TypeVar

import requests
from greenlet import getcurrent

from .errors import ApiError
from .failures import failure, not_reached, reason
from .http1 import readable, waiting

T = TypeVar("T")

POLL = 1.0   # seconds between checks of the client socket
STRAY = 64   # bytes peeked at: a hang-up behind stray CRLFs is still seen


class ClientGone(Exception):
    """The client closed its connection while we waited."""


def client_gone(environ: dict) -> bool:
    """True when the client closed its connection (gunicorn exposes the socket)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        # Not recv(MSG_DONTWAIT): gevent's socket waits on EAGAIN. A zero-timeout
        # poll says whether a read would return at once; EOF reads as b"".
        # The OS's own poll (common.http1.readable): select() fails from
        # descriptor 1024 up, gevent's yields to the loop, and this also runs
        # in the loop itself (call_watching_client's timer).
        if not readable(sock):
            return False
        peeked = sock.recv(STRAY, socket.MSG_PEEK)
        if peeked.strip(b"\r\n"):
            return False                    # the client's next request: it is there
        if peeked:
            # Only the empty lines RFC 9112 2.2 lets a client send between requests
            # (a stray CRLF after a body): read them, then see what follows them.
            sock.recv(len(peeked))
            return readable(sock) and sock.recv(1, socket.MSG_PEEK) == b""
        return True                         # EOF
    except (ValueError, OSError):
        return True


def call_watching_client(fn: Callable[[], T], environ: dict | None, poll: float = POLL) -> T:
    """Run fn() (blocking upstream I/O) and return its result; if the client
    goes away first, shut its upstream connection down (so llama.cpp and vLLM
    stop generating) and raise ClientGone where fn() waits. Outside a gevent
    server (no client socket in the environ) this simply calls fn(). fn's
    upstream calls must go through common.http1 (which registers the
    connection it waits on).

    The check is a timer of the event loop every `poll` seconds, not a greenlet
    of its own: an answer that comes within a second (most non-streamed ones)
    costs a timer started and stopped, not a spawn and two switches."""
    if not environ or environ.get("gunicorn.socket") is None:
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
        conn = waiting.get(id(me))
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


def sent_once_more(send: Callable[[bool], T], environ: dict | None,
                   failed: Callable[[BaseException, bool], "ApiError | None"]) -> T:
    """`send(fresh)`'s answer, the client watched while it waits
    (call_watching_client): the one loop of both hops. A request that did not
    reach the upstream (common.failures.not_reached: refused, or closed before
    any byte of an answer: a stale kept-alive connection, a backend that just
    died) may be sent once more, on a fresh connection. `failed(exc, retry)` is
    told of each failure, a ClientGone or a requests error, with retry=True
    when one more try is allowed; it returns the ApiError to raise, or None to
    send once more (then only)."""
    for fresh in (False, True):
        try:
            return call_watching_client(lambda: send(fresh), environ)
        except (ClientGone, requests.RequestException) as e:
            retry = not fresh and not isinstance(e, ClientGone) and not_reached(e)
            err = failed(e, retry)
            if err is None and retry:
                continue
            raise (err or failure("upstream_failed", reason(e))) from None
    raise AssertionError("unreachable")
