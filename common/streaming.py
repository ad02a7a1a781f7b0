"""Relay an upstream `requests` response to a Flask client without buffering.

Used by the proxy (client -> swapper) and the swapper (-> backend). The body is
passed on as it arrives: each read takes whatever the socket holds (one token
when the client keeps up; many, in one write, when it does not), so no byte
waits for another and a fast stream costs one read and one write per batch
instead of one per HTTP chunk. When the client goes away, the WSGI server closes
our generator and we close the upstream connection, so the backend stops
generating. When the upstream breaks off, the client's transfer breaks too
(BrokenRelay): a cut body never reaches a client looking complete.
"""
from __future__ import annotations

import errno
from typing import Callable, Iterable, Iterator

import requests
from flask import Response
from werkzeug.datastructures import Headers
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
    body go to the server as they are, without a Flask Response's conversions.
    A Flask view returns one: Flask runs a WSGI app it is given. `headers`: a mapping or
    werkzeug Headers (answer_headers), or a list of (name, value)."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers, body: Iterable[bytes]):
        self.status = f"{status} {HTTP_STATUS_CODES.get(status, 'UNKNOWN')}"
        self.headers = headers if isinstance(headers, list) else list(headers.items())
        self.body = body

    def __call__(self, environ, start_response):
        start_response(self.status, self.headers)
        return self.body


class BrokenRelay(ConnectionResetError):
    """Raised by a relayed body whose upstream broke off, after what on_break
    said: the WSGI server then ends the client's connection there, without the
    last chunk (or short of the Content-Length), so the client sees a broken
    transfer, not a complete body. gunicorn takes a reset for a client gone:
    the connection is closed, with no traceback in the log."""

    def __init__(self, cause: Exception):
        super().__init__(errno.ECONNRESET, f"the upstream broke off mid-body: {cause}")


def headers_now(upstream) -> bool:
    """Whether a stream relayed from `upstream` should send its headers before
    its first piece: yes for an event stream none of whose body has come yet
    (the backend is still at its first token). An empty first piece does it
    (common.serve.HeadWithBody sends the headers at once on an empty write):
    the next hop, or the client, sets its end of the stream up while the
    backend works, instead of after the first token has come."""
    return (upstream.headers.get("content-type") or "").startswith("text/event-stream") \
        and not getattr(upstream, "body_arrived", True)


def sse_response(events: Iterator[bytes]) -> Response:
    """Our own event stream (made from an upstream's: its generator begins with
    an empty piece when headers_now() says so)."""
    return Response(events, status=200, mimetype="text/event-stream",
                    headers=dict(NO_BUFFERING), direct_passthrough=True)


def forward_headers(headers) -> Headers:
    """End-to-end header fields of a request or an answer: minus the hop-by-hop
    ones and every one its Connection field names (RFC 9110 7.6.1). An
    answer's (common.http1.AnswerHeaders) come from its fields as they came,
    a repeated one (Set-Cookie) still repeated; a request's from any mapping."""
    fields = getattr(headers, "fields", None)
    if fields is None:
        fields = list(headers.items()) if hasattr(headers, "items") else list(headers)
    drop = HOP_BY_HOP
    for name, value in fields:
        if name.lower() == "connection":
            drop = drop | {t.strip().lower() for t in value.split(",")}
    return Headers([(k, v) for k, v in fields if k.lower() not in drop])


def answer_headers(upstream) -> Headers:
    """An upstream answer's headers for relaying its body unchanged: the
    forwarded ones, and a Content-Length derived from its framing: only when
    its body was framed by a length and the bytes we relay are the bytes it
    counted (no content coding: common.http1 decodes those). Never one from a
    chunked answer that also carried a length, never a stale one. A known
    length lets the WSGI server send a non-streamed answer in one write
    instead of chunked pieces (common.serve.HeadWithBody)."""
    headers = forward_headers(upstream.headers)
    if upstream.framing == "length" and \
            upstream.headers.get("content-encoding", "identity").lower() == "identity":
        headers["Content-Length"] = str(upstream.length)
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
    breaks mid-body (an SSE error event, say); then BrokenRelay is raised, so
    the client's transfer breaks too instead of ending as if complete.
    """
    complete = False
    try:
        if headers_now(upstream):
            yield b""
        yield from iter_body(upstream)
        complete = True
    except requests.RequestException as e:
        tail = on_break(e) if on_break is not None else b""
        # With the tail, or empty (HeadWithBody sends a head still held at
        # once): the client gets the head and what came, then the break.
        yield tail or b""
        raise BrokenRelay(e) from None
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
