"""Relay an upstream `requests` response to a Flask client without buffering.

Used by the proxy (client -> swapper) and the swapper (-> backend). The body is
passed through chunk by chunk as it arrives; when the client goes away, the
WSGI server closes our generator and we close the upstream connection, so the
backend stops generating.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import requests
from flask import Response

# Hop-by-hop headers (RFC 9110 7.6.1) and those the WSGI server recomputes.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "content-length", "content-encoding", "host",
})

NO_BUFFERING = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}


def forward_headers(headers) -> dict:
    """Request or response headers minus the hop-by-hop ones."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def iter_upstream(upstream: requests.Response,
                  on_close: Callable[[bool], None] | None = None,
                  on_break: Callable[[Exception], bytes] | None = None) -> Iterator[bytes]:
    """Yield the upstream body as it arrives; always close upstream at the end.

    `on_close(complete)` runs once at the end: complete is False when the
    upstream broke mid-body or the client went away before the end.
    `on_break(exc)` may return final bytes for the client when the upstream
    breaks mid-body (an SSE error event, say).
    """
    complete = False
    try:
        # chunk_size=None yields each chunk as soon as the socket has it.
        for chunk in upstream.iter_content(chunk_size=None):
            if chunk:
                yield chunk
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
    headers = forward_headers(upstream.headers)
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
