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
import urllib3
from flask import Response
from requests.models import PreparedRequest
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

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


def answer_headers(upstream: requests.Response) -> dict:
    """An upstream answer's headers for relaying its body unchanged: the
    forwarded ones, and its Content-Length when the bytes we relay are the
    bytes it counted (no content coding: requests decodes those). A known
    length lets the WSGI server send a non-streamed answer in one write
    instead of chunked pieces (common.serve.HeadWithBody)."""
    headers = forward_headers(upstream.headers)
    length = upstream.headers.get("content-length")
    if length is not None and \
            upstream.headers.get("content-encoding", "identity").lower() == "identity":
        headers["Content-Length"] = length
    return headers


READ_SIZE = 65536


class _BrokenBody(requests.exceptions.ChunkedEncodingError):
    """The upstream's chunked body ended or broke before its last chunk."""


def _dechunk(read1: Callable[[int], bytes]) -> Iterator[bytes]:
    """The payload of a chunked body read with `read1` (BufferedReader.read1:
    whatever is buffered, else one recv), one piece per read."""
    buf = b""
    left = 0            # payload bytes due in the current chunk
    crlf = False        # the CRLF after a chunk's payload is due
    while True:
        data = read1(READ_SIZE)
        if not data:
            raise _BrokenBody("Connection broken: the upstream closed the connection "
                              "before the end of the body")
        buf = buf + data if buf else data
        out = []
        i, n = 0, len(buf)
        while i < n:
            if left:
                take = left if left < n - i else n - i
                out.append(buf if take == n else buf[i:i + take])
                left -= take
                i += take
                crlf = not left
                continue
            if crlf:
                if n - i < 2:
                    break
                i += 2
                crlf = False
                continue
            end = buf.find(b"\r\n", i)
            if end < 0:
                if n - i > 1024:
                    raise _BrokenBody("Connection broken: invalid chunk size line")
                break
            try:
                size = int(buf[i:end].split(b";", 1)[0], 16)
            except ValueError:
                raise _BrokenBody(f"Connection broken: invalid chunk size "
                                  f"{buf[i:end][:40]!r}") from None
            if size == 0:
                # The last chunk; then optional trailer fields and an empty line.
                if buf.startswith(b"\r\n", end + 2) or buf.find(b"\r\n\r\n", end) >= 0:
                    if out:
                        yield b"".join(out)
                    return
                break           # wait for the rest of the trailer section
            left = size
            i = end + 2
        buf = buf[i:] if i < n else b""
        if out:
            yield out[0] if len(out) == 1 else b"".join(out)


def iter_body(upstream: requests.Response) -> Iterator[bytes]:
    """The upstream body as it arrives, in as few pieces as the socket allows.

    A chunked body (llama.cpp, vLLM and our own services stream chunked) is
    read straight from the connection's buffered reader and de-chunked here;
    at its end the connection goes back to the pool. Any other body goes
    through requests' iter_content. Raises requests.RequestException when the
    upstream breaks off."""
    raw = getattr(upstream, "raw", None)           # None: a response-like object
    hr = getattr(raw, "_fp", None)                 # http.client.HTTPResponse
    fp = getattr(hr, "fp", None)
    # Only a chunked body nobody has started reading; not a HEAD/204/304 answer
    # (http.client gives those length 0, chunked or not) nor a compressed one.
    if (fp is None or not getattr(hr, "chunked", False) or hr.chunk_left is not None
            or hr.length is not None
            or upstream.headers.get("content-encoding", "identity").lower() != "identity"
            or not hasattr(fp, "read1")):
        yield from upstream.iter_content(chunk_size=None)
        return
    try:
        yield from _dechunk(fp.read1)
    except OSError as e:
        raise _BrokenBody(f"Connection broken: {e!r}") from e
    # The whole body was read: the connection can serve the next request.
    hr.close()
    raw.release_conn()


def pooled_request(session: requests.Session, method: str, url: str, *, headers=None,
                   data=None, timeout: tuple = (None, None)) -> requests.Response:
    """session.request(method, url, stream=True, allow_redirects=False, ...) for a
    plain-HTTP upstream, without requests' per-call machinery (settings merge,
    cookies, hooks, redirect handling): urlopen on the session's own pool, the
    answer wrapped into a requests.Response with its body unread,
    urllib3's errors raised as requests' (as HTTPAdapter.send does). About half
    of requests' client-side CPU per call. The session's default headers are not
    added: the caller's headers go as they are."""
    if not url.startswith("http://"):
        return session.request(method, url, headers=headers, data=data, stream=True,
                               timeout=timeout, allow_redirects=False)
    slash = url.find("/", 7)
    base, target = (url, "/") if slash < 0 else (url[:slash], url[slash:])
    cache = session.__dict__.setdefault("_pooled", {})
    hit = cache.get(base)
    if hit is None:
        adapter = session.get_adapter(url)
        hit = cache[base] = (adapter, adapter.poolmanager.connection_from_url(base))
    adapter, pool = hit
    t = cache.get(timeout)
    if t is None:
        t = cache[timeout] = urllib3.Timeout(connect=timeout[0], read=timeout[1])
    headers = dict(headers or ())
    if isinstance(data, str):
        data = data.encode()
    req = PreparedRequest()
    req.method, req.url, req.headers, req.body = method, url, headers, data
    try:
        raw = pool.urlopen(method, target, body=data, headers=headers, retries=False,
                           redirect=False, assert_same_host=False, timeout=t,
                           preload_content=False, decode_content=False)
    except urllib3.exceptions.NewConnectionError as e:     # a ConnectTimeoutError subclass
        raise requests.exceptions.ConnectionError(e, request=req) from None
    except urllib3.exceptions.ConnectTimeoutError as e:
        raise requests.exceptions.ConnectTimeout(e, request=req) from None
    except urllib3.exceptions.ReadTimeoutError as e:
        raise requests.exceptions.ReadTimeout(e, request=req) from None
    except (urllib3.exceptions.ProtocolError, OSError) as e:
        raise requests.exceptions.ConnectionError(e, request=req) from None
    except urllib3.exceptions.HTTPError as e:
        raise requests.exceptions.RequestException(e, request=req) from None
    # adapter.build_response(req, raw), minus its cookie extraction: nothing
    # here reads cookies, and an upstream's Set-Cookie is none of our business.
    resp = requests.Response()
    resp.status_code = raw.status
    resp.headers = CaseInsensitiveDict(raw.headers)
    resp.encoding = get_encoding_from_headers(resp.headers)
    resp.raw, resp.reason, resp.url = raw, raw.reason, url
    resp.request, resp.connection = req, adapter
    return resp


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
