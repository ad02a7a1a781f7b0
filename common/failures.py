"""Why a request failed, and what its client is told: the one table from causes
to HTTP status and OpenAI error code, used by both services.

Code that notices a failure names its cause (`failure("timeout", message)`);
nothing else picks a status or a code. `classify()` names the cause of an
exception raised by an HTTP call upstream.

    cause                status  code                  when
    client_gone          499     client_closed         the client hung up first
    unreachable          502     upstream_unreachable  connect refused / no route / DNS
    bad_target           400     invalid_path          the path cannot be sent as it is (RFC 3986)
    bad_header           400     invalid_header        a header field cannot be sent (CR, LF, NUL...)
    closed_early         502     upstream_closed       the connection closed before any answer byte
    timeout              504     upstream_timeout      connect or read timed out
    upstream_failed      502     upstream_error        any other transport error
    broke_off            502     backend_failed        the answer broke off mid-body
    docker_unreachable   503     docker_unavailable    the Docker engine does not answer
    load_failed          502     load_failed           the model could not be started
    load_timeout         504     load_timeout          not healthy within its start timeout
    queue_full           503     queue_full            too many requests waiting
    not_downloaded       409     model_not_downloaded  its files are absent and AUTO_DOWNLOAD=0
    download_failed      502     download_failed       fetching its files failed (401, network)
    disk_full            507     insufficient_storage  no room for its files
"""
from __future__ import annotations

import errno
import json
import http.client

import requests

from .errors import ApiError
from .http1 import BadTarget

# cause -> (HTTP status, OpenAI error type, OpenAI error code)
CAUSES: dict[str, tuple[int, str, str]] = {
    "client_gone": (499, "invalid_request_error", "client_closed"),
    "unreachable": (502, "upstream_error", "upstream_unreachable"),
    "bad_target": (400, "invalid_request_error", "invalid_path"),
    "bad_header": (400, "invalid_request_error", "invalid_header"),
    "closed_early": (502, "upstream_error", "upstream_closed"),
    "timeout": (504, "timeout_error", "upstream_timeout"),
    "upstream_failed": (502, "upstream_error", "upstream_error"),
    "broke_off": (502, "upstream_error", "backend_failed"),
    "docker_unreachable": (503, "service_unavailable", "docker_unavailable"),
    "load_failed": (502, "upstream_error", "load_failed"),
    "load_timeout": (504, "timeout_error", "load_timeout"),
    "queue_full": (503, "service_unavailable", "queue_full"),
    "not_downloaded": (409, "invalid_request_error", "model_not_downloaded"),
    "download_failed": (502, "upstream_error", "download_failed"),
    "disk_full": (507, "server_error", "insufficient_storage"),
}


def failure(cause: str, message: str, headers: dict | None = None) -> ApiError:
    """The ApiError a request handler raises for `cause`."""
    status, type_, code = CAUSES[cause]
    return ApiError(message, status, type_=type_, code=code, headers=headers)


def status_of(cause: str) -> int:
    return CAUSES[cause][0]


def classify(exc: BaseException) -> str:
    """The cause of an exception from an upstream HTTP call (common.http1, or
    requests/urllib3)."""
    if isinstance(exc, (requests.exceptions.ConnectTimeout, requests.exceptions.ReadTimeout)):
        return "timeout"
    if isinstance(exc, BadTarget):
        return "bad_target"
    if isinstance(exc, requests.exceptions.InvalidHeader):
        return "bad_header"
    if isinstance(exc, requests.exceptions.ConnectionError):
        inner = _root(exc)
        if isinstance(inner, (http.client.RemoteDisconnected, ConnectionResetError,
                              BrokenPipeError, ConnectionAbortedError)):
            return "closed_early"
        if isinstance(inner, OSError) and inner.errno in (errno.ECONNRESET, errno.EPIPE):
            return "closed_early"
        text = str(exc)
        if "RemoteDisconnected" in text or "Connection aborted" in text \
                or "Connection reset" in text:
            return "closed_early"
        return "unreachable"
    if isinstance(exc, (requests.exceptions.ChunkedEncodingError,
                        requests.exceptions.ContentDecodingError)):
        return "broke_off"
    return "upstream_failed"


def not_reached(exc: BaseException) -> bool:
    """True when the request cannot have been processed upstream: the
    connection was refused, or closed before any byte of an answer (a stale
    keep-alive connection, a backend that just died). Such a request may be
    sent again. common.http1 raises ConnectionError only then: a connection
    that ends after an answer began (an interim 1xx, part of a head) is a
    BadAnswer, and the request is not sent twice."""
    return classify(exc) in ("unreachable", "closed_early") \
        and not isinstance(exc, requests.exceptions.ConnectTimeout)


def message_of(raw: bytes, status: int) -> str:
    """The message of an upstream's error answer, whatever its shape (OpenAI's
    envelope, Anthropic's, FastAPI's `detail`), else the start of its body."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    msg = None
    if isinstance(obj, dict):
        err = obj.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        msg = msg or obj.get("message") or obj.get("detail")
    if isinstance(msg, str) and msg:
        return msg
    text = raw[:300].decode("utf-8", "replace").strip()
    return f"upstream answered HTTP {status}: {text}" if text else \
        f"upstream answered HTTP {status} with an empty body"


def reason(exc: BaseException) -> str:
    """A short human reason for an upstream exception."""
    text = str(exc)
    for needle in ("Connection refused", "Name or service not known", "No route to host",
                   "Temporary failure in name resolution", "Connection reset",
                   "RemoteDisconnected", "Remote end closed connection without response"):
        if needle in text:
            return needle.lower()
    return text[:300]


def _root(exc: BaseException) -> BaseException:
    """The innermost cause (requests wraps urllib3, which wraps the OSError)."""
    seen = set()
    cur: BaseException = exc
    while id(cur) not in seen:
        seen.add(id(cur))
        nxt = cur.__cause__ or cur.__context__
        if nxt is None and cur.args and isinstance(cur.args[0], BaseException):
            nxt = cur.args[0]
        if nxt is None:
            # urllib3's ProtocolError('Connection aborted.', RemoteDisconnected(...))
            nxt = next((a for a in cur.args if isinstance(a, BaseException)), None)
        if nxt is None:
            break
        cur = nxt
    return cur
