"""Hostile-input guards both services share: request paths and JSON bodies.

- Paths: a request target whose path has a `.` or `..` segment, an encoded
  slash or backslash, or a NUL (raw or percent-encoded) is refused with 400
  before routing. Forwarded, such a path could be normalised (an HTTP client or
  server that removes dot segments) into another route of the next service:
  `/upstream/m/../../unload` would become the swapper's `/unload`.
- Runs of slashes are collapsed (`//unload` is `/unload`), so what is
  forwarded is what was routed; in an absolute-form target
  (`GET http://host//x HTTP/1.1`) only its path's.
- A request target is forwarded only when it can be written on the next
  request line as it came (RFC 3986 origin-form, `%` before two hex digits):
  anything else is a 400 before routing, so the swapper refuses it before it
  admits (and perhaps swaps to) its model.
- A body without Content-Length (chunked) is read up to the size limit; one
  that goes beyond is refused with 413, never cut.
- A body must arrive within `body_timeout` seconds, plus one second per 64 KiB
  that came (a minimum rate): a slower one is a 408 and its connection is
  closed, so clients trickling bodies cannot hold the server's connections.
  (The request head's deadline is the server's: common.serve.HeadTimedWorker.)
- Routing never redirects: a redirect built by the router names the address the
  request came in on, which for the swapper is its internal one.
- JSON: a body is decoded as strict UTF-8, nested at most MAX_JSON_DEPTH deep,
  and may not hold a lone UTF-16 surrogate (`"\\ud800"`), which Python's json
  parses but cannot encode again, nor NaN or Infinity. Each failure is a 400 in
  the envelope.
"""
from __future__ import annotations

import io
import json
import re
import socket
import time
from urllib.parse import unquote, urlsplit

import orjson
from werkzeug.routing import PathConverter

from .errors import ApiError, error_response, too_large
from .http1 import TARGET

MAX_JSON_DEPTH = 100

_BAD_SEGMENTS = (".", "..")


def unsafe_path(raw_path: str) -> str | None:
    """Why a raw request path (no query) is refused, or None when it is fine."""
    if "\\" in raw_path or "\x00" in raw_path:
        return "backslashes and NUL bytes are not allowed in a path"
    if "%" not in raw_path and "/." not in raw_path and raw_path[:1] != ".":
        # Nothing to decode, and no segment starts with a dot: none is "." or "..".
        return None
    for seg in raw_path.split("/"):
        if not seg:
            continue
        dec = unquote(seg)
        if dec in _BAD_SEGMENTS:
            return "'.' and '..' path segments are not allowed"
        if dec != seg and ("/" in dec or "\\" in dec or "\x00" in dec or "%" in dec):
            return "encoded slashes, backslashes, NUL bytes and double encoding are not allowed"
    return None


def raw_path(environ: dict) -> str:
    """The request path as the client sent it (before percent-decoding)."""
    target = environ.get("RAW_URI") or environ.get("REQUEST_URI") or ""
    if target.startswith("/"):
        return target.partition("?")[0]
    if "://" in target:                 # absolute-form: GET http://host/path HTTP/1.1
        return urlsplit(target).path
    # Absent: the decoded path (a decoded `..` still shows as a segment).
    return environ.get("PATH_INFO", "")


# What may be written into the next request line (common.http1's grammar: RFC
# 3986 origin-form, percent escapes as they came, never decoded, no fragment).
_TARGET = TARGET


def raw_target(environ: dict) -> str:
    """The request target as the client sent it, still percent-encoded (path and
    query): what a route forwards, so that nothing decoded is ever written into
    the next request line. ApiError(400) when it could not be written there as
    it is (raw non-ASCII, a space, a control byte, a fragment)."""
    target = environ.get("RAW_URI") or environ.get("REQUEST_URI") or ""
    if "://" in target and not target.startswith("/"):      # absolute-form
        u = urlsplit(target)
        target = u.path + ("?" + u.query if u.query else "")
    if not target:
        target = environ.get("PATH_INFO", "") or "/"
    if not _TARGET.fullmatch(target):
        raise ApiError("invalid request target: only the characters RFC 3986 allows "
                       "(percent-encode the rest, '%' only before two hex digits), no '#'",
                       400, code="invalid_path")
    return target


def raw_tail(environ: dict, skip: int) -> tuple[str, str]:
    """The raw target's path less its first `skip` segments, and its query:
    `/upstream/m/a%20b?x`, skip 2: (`a%20b`, `x`). Segments match the routed
    (decoded) path one to one: the guard refuses encoded slashes."""
    path, _, query = raw_target(environ).partition("?")
    parts = path.split("/", skip + 1)
    return (parts[skip + 1] if len(parts) > skip + 1 else ""), query


class Rest(PathConverter):
    """The rest of a forwarded path, whatever it decodes to (werkzeug's `path`
    stops at a decoded line break): what is forwarded is the raw target."""
    regex = "[^/][\\s\\S]*?"


_SLASHES = re.compile(r"//+")


class RequestGuard:
    """WSGI middleware, before routing: refuse unsafe paths (400), collapse runs
    of slashes, hold a chunked body to `max_body` bytes (413 beyond) and every
    body to its deadline (`body_timeout`, 408 beyond)."""

    def __init__(self, app, max_body: int | None = None, body_timeout: float | None = None):
        self.app = app
        self.max_body = max_body
        self.body_timeout = body_timeout

    def __call__(self, environ, start_response):
        raw, path = raw_path(environ), environ.get("PATH_INFO", "")
        why = unsafe_path(raw) or (unsafe_path(path) if path != raw else None)
        if why is not None:
            resp = error_response(f"invalid request path: {why}", 400, code="invalid_path")
            return resp(environ, start_response)
        for key in ("PATH_INFO", "RAW_URI", "REQUEST_URI"):
            value = environ.get(key)
            if value and "//" in value:
                environ[key] = _collapsed(value)
        chunked = not environ.get("CONTENT_LENGTH") and \
            "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        body = None
        if self.body_timeout is not None and (chunked or environ.get("CONTENT_LENGTH",
                                                                       "0") not in ("", "0")):
            body = environ["wsgi.input"] = TimedBody(environ, self.body_timeout)
            start_response = _closing_unless_read(start_response, environ, body)
        if self.max_body is not None and chunked:
            try:
                body = _read_at_most(environ["wsgi.input"], self.max_body + 1)
            except ApiError as e:
                return e.response()(environ, start_response)
            if len(body) > self.max_body:
                close_connection(environ)
                return too_large(self.max_body)(environ, start_response)
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
        return self.app(environ, start_response)


def _collapsed(target: str) -> str:
    """Runs of slashes in a target's path made one; an absolute-form target's
    scheme and authority (`http://host`) kept as they are."""
    head = ""
    if not target.startswith("/") and "://" in target:
        scheme, _, rest = target.partition("://")
        authority, slash, rest = rest.partition("/")
        head, target = f"{scheme}://{authority}", slash + rest
    path, sep, query = target.partition("?")
    return head + _SLASHES.sub("/", path) + sep + query


def _closing_unless_read(start_response, environ: dict, body: "TimedBody"):
    """start_response, closing the connection after an answer given before its
    request's body was read to the end (a 413 on a declared length, a 401, any
    early error): gunicorn would wait for the rest, with no deadline."""
    def start(status, headers, exc_info=None):
        if not body.complete:
            close_connection(environ)
        return start_response(status, headers, exc_info)
    return start


def close_connection(environ: dict) -> None:
    """The client's connection closes after this answer, its body's rest unread:
    gunicorn would otherwise drain it, with no deadline, before the next request
    (a refused request's trickling body would hold the connection)."""
    body = environ.get(_ORIGINAL_INPUT) or environ.get("wsgi.input")
    if hasattr(body, "failed"):             # gunicorn's Body: it closes, not drains
        body.failed = True


_ORIGINAL_INPUT = "coding_stack.input"
BODY_RATE = 64 * 1024       # bytes per second of body that buy one more second


class TimedBody:
    """The request body, read against a deadline: `timeout` seconds from the
    request's start, plus one second per BODY_RATE bytes that came. Each read
    waits at most until the deadline (the client socket's timeout); past it,
    ApiError(408) and the connection closes (close_connection)."""

    def __init__(self, environ: dict, timeout: float):
        # Not the environ itself: environ -> body -> environ would be a cycle, and
        # a cycle waits for the cyclic GC with the request's body in it (a worker
        # grew by ~5 MB per 10 MB body until a full collection).
        self._stream = environ[_ORIGINAL_INPUT] = environ["wsgi.input"]
        self._sock = environ.get("gunicorn.socket")
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        length = environ.get("CONTENT_LENGTH") or ""
        self._left = int(length) if length.isdigit() else None     # None: chunked
        self.complete = False           # read to its end

    def _call(self, fn, *args):
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            self._expired()
        sock = self._sock
        prior = sock.gettimeout() if sock is not None else None
        try:
            if sock is not None:
                sock.settimeout(remaining)
            data = fn(*args)
        except (socket.timeout, TimeoutError):
            self._expired()
        finally:
            if sock is not None:
                try:
                    sock.settimeout(prior)
                except OSError:
                    pass
        self._deadline += len(data) / BODY_RATE
        if self._left is not None:
            self._left -= len(data)
        if not data or (self._left is not None and self._left <= 0):
            self.complete = True
        return data

    def _expired(self):
        if hasattr(self._stream, "failed"):     # as close_connection: gunicorn closes
            self._stream.failed = True
        raise ApiError(f"the request body did not arrive in time (BODY_TIMEOUT "
                       f"{self._timeout:g} s, then at least {BODY_RATE // 1024} KiB/s)", 408,
                       code="body_timeout", headers={"Connection": "close"})

    def read(self, size: int | None = -1) -> bytes:
        return self._call(self._stream.read, size)

    def readline(self, size: int | None = -1) -> bytes:
        return self._call(self._stream.readline, size)

    def readlines(self, hint=None) -> list[bytes]:  # noqa: ARG002
        return list(iter(self.readline, b""))

    def __iter__(self):
        return iter(self.readline, b"")


def _read_at_most(stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = stream.read(min(65536, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def harden(app, body_timeout: float | None = 30.0) -> None:
    """Install the request guard (holding chunked bodies to the app's
    MAX_CONTENT_LENGTH, every body to `body_timeout`), turn off the router's
    redirects and add the `rest` converter on a Flask app."""
    m = app.url_map
    m.strict_slashes = False        # '/x/' and '/x' both match, no redirect
    m.merge_slashes = False         # the guard collapsed them already
    m.redirect_defaults = False
    m.converters["rest"] = Rest     # <rest:x>: what a route forwards, raw (raw_target)
    app.wsgi_app = RequestGuard(app.wsgi_app, app.config.get("MAX_CONTENT_LENGTH"),
                                body_timeout)


# ------------------------------------------------------------------- JSON

def too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when a parsed JSON value nests arrays/objects deeper than limit
    (iterative: deep input cannot exhaust the stack here)."""
    level, depth = [value], 1
    while level:
        if depth > limit:
            return True
        deeper = []
        for v in level:
            for k in (v.values() if type(v) is dict else v):
                if type(k) is dict or type(k) is list:
                    deeper.append(k)
        level, depth = deeper, depth + 1
    return False


def loads(raw: bytes, what: str = "request body"):
    """Parse a JSON body strictly; ApiError(400, code invalid_json) says what is wrong.

    orjson (3-4x json's speed on an agent's 150 KB body) is strict where we
    want it: invalid UTF-8, a lone surrogate escape, NaN/Infinity and a depth
    beyond 1,024 are errors. Integers beyond 64 bits become floats."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(_why_not_json(raw, e, what), 400, code="invalid_json") from None
    # Only a body with that many brackets can be that deep: ordinary ones skip the walk.
    if isinstance(value, (dict, list)) and \
            raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and too_deep(value):
        raise ApiError(f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels", 400,
                       code="invalid_json")
    return value


def _why_not_json(raw: bytes, e: Exception, what: str) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        return f"{what} is not valid UTF-8: {u}"
    msg = str(e)
    if "surrogate" in msg:
        return (f"{what} holds a lone UTF-16 surrogate escape (like \"\\ud800\"), "
                "which is not a character")
    if "depth limit" in msg:
        return f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels"
    return f"{what} is not valid JSON: {msg}"


def dumps(value) -> bytes:
    """A body we changed, serialised again (compact UTF-8; orjson: ~10x json's
    speed, which for an agent's body is a millisecond per request)."""
    return orjson.dumps(value)


def answer_json(raw: bytes):
    """An upstream's JSON answer, parsed: orjson, or json for what only json
    takes (a lone surrogate escape). Raises ValueError."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
