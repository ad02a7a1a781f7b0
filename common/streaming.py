"""Relay an upstream `requests` response to a Flask client without buffering.

Used by the proxy (client -> swapper) and the swapper (-> backend). The body is
passed on as it arrives: each read takes whatever the socket holds (one token
when the client keeps up; many, in one write, when it does not), so no byte
waits for another and a fast stream costs one read and one write per batch
instead of one per HTTP chunk. When the client goes away, the WSGI server closes
our generator and we close the upstream connection, so the backend stops
generating.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import requests
from flask import Response
from werkzeug.http import HTTP_STATUS_CODES

# Hop-by-hop headers (RFC 9110 7.6.1) and those the WSGI server recomputes.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "content-length", "content-encoding", "host",
})

NO_BUFFERING = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}


class Relayed:
    """An answer relayed as it comes, as a WSGI app: its status, header list and
    body go to the server as they are, without a Flask Response's conversions
    (what the hot routes, common.hotpath, save). A Flask view may return one
    too: Flask runs a WSGI app it is given."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict, body: Iterable[bytes]):
        self.status = f"{status} {HTTP_STATUS_CODES.get(status, 'UNKNOWN')}"
        self.headers = list(headers.items())
        self.body = body

    def __call__(self, environ, start_response):
        start_response(self.status, self.headers)
        return self.body


def headers_now(upstream) -> bool:
    """Whether a stream relayed from `upstream` should send its headers before
    its first piece: yes for an event stream none of whose body has come yet
    (the backend is still at its first token). An empty first piece does it
    (common.serve.HeadWithBody sends the headers at once on an empty write):
    the next hop, or the client, sets its end of the stream up while the
    backend works, instead of after the first token has come."""
    return not getattr(upstream, "body_arrived", True) and \
        (upstream.headers.get("content-type") or "").startswith("text/event-stream")


def sse_response(events: Iterator[bytes]) -> Response:
    """Our own event stream (made from an upstream's: its generator begins with
    an empty piece when headers_now() says so)."""
    return Response(events, status=200, mimetype="text/event-stream",
                    headers=dict(NO_BUFFERING), direct_passthrough=True)


def forward_headers(headers) -> dict:
    """Request or response headers minus the hop-by-hop ones."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def answer_headers(upstream: requests.Response) -> dict:
    """An upstream answer's headers for relaying its body unchanged: the
    forwarded ones, and its Content-Length when the bytes we relay are the
    bytes it counted (no content coding: common.http1 decodes those). A known
    length lets the WSGI server send a non-streamed answer in one write
    instead of chunked pieces (common.serve.HeadWithBody)."""
    headers = forward_headers(upstream.headers)
    length = upstream.headers.get("content-length")
    if length is not None and \
            upstream.headers.get("content-encoding", "identity").lower() == "identity":
        headers["Content-Length"] = length
    return headers


def iter_body(upstream: requests.Response) -> Iterator[bytes]:
    """The upstream body as it arrives, in as few pieces as the socket allows
    (common.http1 reads one piece per receive, de-chunked). Raises
    requests.RequestException when the upstream breaks off."""
    return upstream.iter_content(chunk_size=None)


def iter_upstream(upstream: requests.Response,
                  on_close: Callable[[bool], None] | None = None,
                  on_break: Callable[[Exception], bytes] | None = None) -> Iterator[bytes]:
    """Yield the upstream body as it arrives; always close upstream at the end.
    An event stream none of whose body has come yet begins with an empty piece
    (headers_now).

    `on_close(complete)` runs once at the end: complete is False when the
    upstream broke mid-body or the client went away before the end.
    `on_break(exc)` may return final bytes for the client when the upstream
    breaks mid-body (an SSE error event, say).
    """
    complete = False
    try:
        if headers_now(upstream):
            yield b""
        yield from iter_body(upstream)
        complete = True
    except requests.RequestException as e:
        # The upstream broke mid-body: the client sees a truncated body,
        # ended by what on_break says (if anything).
        if on_break is not None:
            tail = on_break(e)
            if tail:
                yield tail
    finally:
        upstream.close()
        if on_close is not None:
            on_close(complete)


def relay(upstream: requests.Response, body: Iterable[bytes] | None = None,
          on_close: Callable[[bool], None] | None = None) -> Response:
    """A streaming Flask response mirroring the upstream status and headers."""
    headers = forward_headers(upstream.headers) if body is not None else \
        answer_headers(upstream)
    headers.update(NO_BUFFERING)
    resp = Response(
        body if body is not None else iter_upstream(upstream, on_close=on_close),
        status=upstream.status_code,
        headers=headers,
        direct_passthrough=True,
    )
    # A body never read (HEAD, a client gone before the first byte) is never
    # iterated, so its own clean-up never runs: the response's close() does it.
    resp.call_on_close(upstream.close)
    return resp
