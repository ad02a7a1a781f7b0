"""The hops' own HTTP/1.1 client: proxy -> swapper, swapper -> backend.

Both hops speak plain HTTP/1.1 to servers of ours on a private network (the
swapper, llama-server, vLLM), so they need none of requests' machinery:
no TLS, proxies, redirects, cookies, auth or retries (callers decide). Through
requests + urllib3 + http.client (whose header parser is the email package's)
a call cost ~240 us of CPU; this costs ~60 (docs/performance.md).

    client = Client(pool_size=128)
    answer = client.request("POST", "http://host:8080/v1/x", headers={...},
                            body=b"...", timeout=(10.0, None))
    answer.status_code, answer.headers["content-type"]
    for piece in answer.iter_content(): ...      # the body as it arrives
    answer.close()

An `Answer` is a `requests.Response` (its content, json(), text, ok work as
ever); its body is read straight from the socket, one piece per receive, and
de-chunked here. A connection goes back to its pool only after a complete body
and only when both sides keep it alive; a pooled connection that the server
closed meanwhile is noticed before reuse (an OS-level zero-timeout select).

Errors are requests' own, so callers and common.failures keep one tree:

    requests.exceptions.ConnectTimeout        the connection was not made in time
    requests.exceptions.ReadTimeout           no answer within the read timeout
    requests.exceptions.ConnectionError       refused, unresolvable, or closed/reset
                                              before an answer; its argument is the
                                              OSError or http.client.RemoteDisconnected
    BadAnswer (a RequestException)            what came back is not HTTP/1.x
    requests.exceptions.ChunkedEncodingError  the body broke off or its framing is bad

While a greenlet waits for an answer's head, its connection is registered in
`waiting`, so common.disconnect can cut it when the client hangs up.
"""
from __future__ import annotations

import http.client
import socket
import threading
import zlib
from datetime import timedelta
from typing import Iterator

import requests
from greenlet import getcurrent
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

try:
    from gevent.monkey import get_original
    os_select = get_original("select", "select")
except ImportError:                   # no gevent: the standard library's
    from select import select as os_select

READ_SIZE = 65536
MAX_HEAD = 65536            # an answer's status line and header fields, at most
END_WAIT = 2.0              # Answer.end(): seconds each read of a body's rest may wait
SPARE_CONNECT = 2.0         # seconds a spare connection (fresh_after_stream) may take
MAX_UPSTREAMS = 16          # upstreams whose idle connections a client keeps

# Header fields the client writes itself: framing and the connection are its business.
_OWN = frozenset({"host", "content-length", "transfer-encoding", "connection",
                  "accept-encoding", "keep-alive", "te", "upgrade", "trailer"})


class BadAnswer(requests.exceptions.RequestException):
    """The upstream's answer is not HTTP/1.x (garbage, or a header block too large)."""


class BrokenBody(requests.exceptions.ChunkedEncodingError):
    """The answer's body ended or broke before its end, or its chunking is invalid."""


# id(greenlet) -> the connection it waits on for an answer's head
waiting: dict[int, "Connection"] = {}


class Connection:
    __slots__ = ("sock", "buf", "key")

    def __init__(self, sock: socket.socket, key: tuple[str, int]):
        self.sock = sock
        self.buf = b""          # bytes received beyond what was consumed
        self.key = key

    def alive(self) -> bool:
        """Still open and idle: not readable (readable while idle is EOF, or
        stray bytes: not reusable either way). The OS's own select: gevent's
        poll, with many greenlets runnable, reported closed connections as open
        (tests/integration/test_stale_keepalive.py), and gevent's select yields."""
        try:
            readable, _, _ = os_select([self.sock], [], [], 0)
        except (ValueError, OSError):
            return False
        return not readable

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def recv(self) -> bytes:
        return self.sock.recv(READ_SIZE)


class Client:
    """Pooled connections to any number of plain-HTTP upstreams.

    `pool_size`: idle connections kept per upstream (more may be open at once;
    the surplus is closed when released), for the MAX_UPSTREAMS upstreams
    used last (the swapper's backends come and go: each container is an
    upstream of its own). With `fresh_after_stream`, a connection that carried
    a streamed (SSE) answer is closed instead of reused: llama-server closes it
    right after such an answer although it advertises keep-alive, so reused at
    once it fails. A new one is then opened in the background when none is
    idle, so the next request (an agent's next turn) does not wait for its
    connection."""

    def __init__(self, pool_size: int = 10, fresh_after_stream: bool = False):
        self.pool_size = pool_size
        self.fresh_after_stream = fresh_after_stream
        self._idle: dict[tuple[str, int], list[Connection]] = {}

    def request(self, method: str, url: str, *, headers=None, body=None,
                timeout: tuple = (None, None), fresh: bool = False) -> "Answer":
        """Send a request and wait for its answer's head; the body is read as
        the caller iterates it. `fresh`: on a new connection, closed after
        this answer (the pooled one may be stale)."""
        key, hostport, target = _split(url)
        if isinstance(body, str):
            body = body.encode()
        head = _head(method, target, hostport, headers, body, fresh)
        data = head + body if body else head
        conn = None if fresh else self._take(key)
        if conn is None:
            conn = _connect(key, timeout[0])
        me = id(getcurrent())
        try:
            conn.sock.settimeout(timeout[1])
            conn.sock.sendall(data)
            waiting[me] = conn
            status, reason, version, fields = _read_head(conn, method)
        except BaseException as e:
            conn.close()
            if isinstance(e, requests.RequestException):
                raise
            if isinstance(e, socket.timeout):
                raise requests.exceptions.ReadTimeout(e) from None
            if isinstance(e, (OSError, http.client.RemoteDisconnected)):
                raise requests.exceptions.ConnectionError(e) from None
            raise
        finally:
            waiting.pop(me, None)
        return Answer(self, conn, url, method, status, reason, version, fields, fresh)

    def _take(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.alive():
                return conn
            conn.close()
        return None

    def release(self, conn: Connection) -> None:
        idle = self._idle.pop(conn.key, None)          # back in at the end: used last
        if idle is None:
            idle = []
            while len(self._idle) >= MAX_UPSTREAMS:    # the upstream used longest ago
                for old in self._idle.pop(next(iter(self._idle))):
                    old.close()
        self._idle[conn.key] = idle
        if len(idle) < self.pool_size:
            idle.append(conn)
        else:
            conn.close()

    def spare(self, key: tuple[str, int]) -> None:
        """Open a connection to `key` in the background for the next request,
        unless one is idle already."""
        if not self._idle.get(key):
            _background(self._open_spare, key)

    def _open_spare(self, key: tuple[str, int]) -> None:
        try:
            conn = _connect(key, SPARE_CONNECT)
        except requests.RequestException:
            return                       # the next request will find out for itself
        if self._idle.get(key):
            conn.close()                 # one came back meanwhile
        else:
            self.release(conn)

    def close(self) -> None:
        """Close the idle connections (answers being read keep theirs)."""
        for idle in self._idle.values():
            while idle:
                idle.pop().close()


def _split(url: str) -> tuple[tuple[str, int], str, str]:
    """("host", port), "host:port", "/target" of an http:// URL."""
    if not url.startswith("http://"):
        raise requests.exceptions.InvalidURL(f"only http:// upstreams are supported: {url}")
    slash = url.find("/", 7)
    hostport, target = (url[7:], "/") if slash < 0 else (url[7:slash], url[slash:])
    host, colon, port = hostport.rpartition(":")
    if not colon or not port.isdigit():
        host, port = hostport, "80"
    if host.startswith("["):
        host = host[1:-1]
    return (host, int(port)), hostport, target


def _head(method: str, target: str, hostport: str, headers, body, fresh: bool) -> bytes:
    parts = [f"{method} {target} HTTP/1.1\r\nHost: {hostport}\r\n"]
    if headers:
        for k, v in headers.items():
            if k.lower() in _OWN:
                continue
            v = str(v)
            if "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
                raise requests.exceptions.InvalidHeader(f"invalid header field {k!r}")
            parts.append(f"{k}: {v}\r\n")
    if body:
        parts.append(f"Content-Length: {len(body)}\r\n")
    elif method in ("POST", "PUT", "PATCH"):
        parts.append("Content-Length: 0\r\n")
    parts.append("Accept-Encoding: identity\r\n")
    if fresh:
        parts.append("Connection: close\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")


# host -> (family, address): resolved once. Through gevent, getaddrinfo runs on
# a thread pool (~100 us a call, an IP literal included), and inside Docker it
# asks the engine's DNS. A backend's container name names that container for
# its whole life; an address that refuses a connection is resolved again. Every
# container has a name of its own, so the oldest names are forgotten beyond
# MAX_RESOLVED.
_resolved: dict[str, tuple[int, tuple]] = {}
MAX_RESOLVED = 64


def _address(host: str, port: int) -> tuple[int, tuple]:
    hit = _resolved.get(host)
    if hit is None:
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                socket.inet_pton(family, host)
            except OSError:
                continue
            return family, (host, port)             # an IP literal: nothing to look up
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        while len(_resolved) >= MAX_RESOLVED:
            _resolved.pop(next(iter(_resolved)), None)        # the oldest
        hit = _resolved[host] = (family, addr[:1] + addr[2:])   # without its port
    family, addr = hit
    return family, (addr[0], port) + addr[1:]


def _connect(key: tuple[str, int], timeout: float | None) -> Connection:
    host, port = key
    for attempt in (1, 2):
        try:
            family, addr = _address(host, port)
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(addr)
            except BaseException:
                sock.close()
                raise
            break
        except socket.timeout as e:
            raise requests.exceptions.ConnectTimeout(
                f"connecting to {host}:{port} timed out after {timeout} s") from e
        except OSError as e:
            if attempt == 1 and _resolved.pop(host, None) is not None:
                continue                    # an address from before: look it up again
            raise requests.exceptions.ConnectionError(e) from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Connection(sock, key)


def _read_head(conn: Connection, method: str):
    """(status, reason, version, [(name, value)]) of the next final answer;
    what follows the head stays in conn.buf."""
    buf = conn.buf
    while True:
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            if len(buf) > MAX_HEAD:
                raise BadAnswer(f"the upstream's header block is over {MAX_HEAD} bytes")
            data = conn.recv()
            if not data:
                if not buf:
                    raise http.client.RemoteDisconnected(
                        "Remote end closed connection without response")
                raise BadAnswer(f"the upstream closed the connection mid-header: {buf[:80]!r}")
            buf = buf + data if buf else data
            end = buf.find(b"\r\n\r\n", max(0, len(buf) - len(data) - 3))
        lines = buf[:end].decode("latin-1").split("\r\n")
        buf = buf[end + 4:]
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise BadAnswer(f"the upstream's answer is not HTTP/1.x: {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200 and status != 101:
            continue                                # an interim answer: the next one
        conn.buf = buf
        fields = []
        for line in lines[1:]:
            if line[:1] in (" ", "\t") and fields:  # obsolete line folding
                fields[-1] = (fields[-1][0], fields[-1][1] + " " + line.strip())
                continue
            name, colon, value = line.partition(":")
            if colon:
                fields.append((name.strip(), value.strip()))
        return status, reason, version, fields


def _headers(fields: list[tuple[str, str]]) -> CaseInsensitiveDict:
    """requests' CaseInsensitiveDict, filled at once (its update() goes field by
    field through MutableMapping); repeated fields are joined with ", "."""
    h = CaseInsensitiveDict()
    store = h._store
    for name, value in fields:
        low = name.lower()
        had = store.get(low)
        store[low] = (name, value) if had is None else (had[0], f"{had[1]}, {value}")
    return h


class Answer(requests.Response):
    """An upstream's answer, its body unread until iterated (see the module)."""

    def __init__(self, client: Client, conn: Connection, url: str, method: str, status: int,
                 reason: str, version: str, fields, fresh: bool):
        # requests.Response.__init__ builds a cookie jar and more we never use.
        self._content = False
        self._content_consumed = False
        self._next = None
        self.status_code = status
        self.headers = headers = _headers(fields)
        self.raw = None
        self.url = url
        self.encoding = get_encoding_from_headers(headers)
        self.history = []
        self.reason = reason
        self.cookies = None
        self.elapsed = timedelta(0)
        self.request = None
        self.connection = None
        self._client = client
        self._conn: Connection | None = conn
        self._body: Iterator[bytes] | None = None     # the body's reader, once iterated
        te = headers.get("transfer-encoding")
        length = headers.get("content-length")
        conn_hdr = (headers.get("connection") or "").lower()
        self._reusable = not fresh and "close" not in conn_hdr and status != 101 and \
            (version != "HTTP/1.0" or "keep-alive" in conn_hdr)     # 101: no longer HTTP
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            self._framing, self._left = "none", 0
        elif te is not None and te.lower().rstrip().endswith("chunked"):
            self._framing, self._left = "chunked", 0
        elif length is not None and length.isdigit():
            self._framing, self._left = "length", int(length)
        elif length is not None:
            conn.close()
            self._conn = None
            raise BadAnswer(f"invalid Content-Length {length[:40]!r}")
        else:
            self._framing, self._left = "close", 0
            self._reusable = False
        self._spend = client.fresh_after_stream and self._reusable and \
            (headers.get("content-type") or "").startswith("text/event-stream")
        if self._spend:
            self._reusable = False
        coding = (headers.get("content-encoding") or "identity").lower()
        if coding not in ("identity", "gzip", "x-gzip", "deflate"):
            self.close()
            raise BadAnswer(f"unsupported Content-Encoding {coding!r}")
        self._coding = coding
        if self._framing == "none":                # nothing to read: done with it
            self._done(conn)

    # ---------------------------------------------------------- the body
    def iter_content(self, chunk_size=None, decode_unicode=False) -> Iterator[bytes]:
        """The body as it arrives: one piece per receive, whatever the framing
        (`chunk_size` is ignored)."""
        if self._content_consumed:
            if isinstance(self._content, bytes):
                return iter((self._content,) if self._content else ())
            raise requests.exceptions.StreamConsumedError()
        self._content_consumed = True
        pieces = self._body = self._pieces()
        if self._coding != "identity":
            pieces = _decoded(pieces, self._coding)
        return pieces

    @property
    def body_arrived(self) -> bool:
        """Whether any of the body has come (or there is none to wait for)."""
        conn = self._conn
        return conn is None or self._content_consumed or bool(conn.buf)

    @property
    def content(self) -> bytes:
        if self._content is False:
            self._content = b"".join(self.iter_content())
        return self._content

    def _pieces(self) -> Iterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        framing = self._framing
        try:
            if framing == "chunked":
                yield from _dechunk(conn)
            elif framing == "length":
                left = self._left
                buf, conn.buf = conn.buf, b""
                while True:
                    if buf:
                        if len(buf) > left:          # more than the body: not ours
                            buf = buf[:left]
                            self._reusable = False
                        left -= len(buf)
                        yield buf
                    if not left:
                        break
                    buf = conn.recv()
                    if not buf:
                        raise BrokenBody(f"Connection broken: the body ended {left} bytes "
                                         "short of its Content-Length")
            elif framing == "close":
                buf, conn.buf = conn.buf, b""
                while True:
                    if buf:
                        yield buf
                    buf = conn.recv()
                    if not buf:
                        break
        except requests.RequestException:
            self.close()
            raise
        except socket.timeout as e:
            self.close()
            raise requests.exceptions.ReadTimeout(e) from None
        except OSError as e:
            self.close()
            raise BrokenBody(f"Connection broken: {e!r}") from None
        except BaseException:
            self.close()
            raise
        self._done(conn)

    def _done(self, conn: Connection) -> None:
        """The whole body was read: the connection serves the next request,
        unless either side ends it or bytes beyond the body came."""
        self._conn = None
        if self._reusable and not conn.buf:
            self._client.release(conn)
        else:
            conn.close()
            if self._spend:                 # spent by a stream: the next one waits ready
                self._client.spare(conn.key)

    def close(self) -> None:
        """Done with the answer: a connection whose body was not read to the end
        is closed (the upstream sees the hang-up and stops generating)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def end(self) -> None:
        """Done with a body at its logical end, which the server is about to end
        too: an SSE stream after its `[DONE]`. Closing there would cost the next
        request a new connection; instead what is left (normally just the last
        chunk of the framing) is read in the background, each read waiting at
        most END_WAIT seconds, and if the body then ends with no more payload
        the connection goes back to the pool. More payload, or a server that
        does not end the body, closes it. Like close(), the answer is done with
        at once: close() after end() does nothing."""
        conn, body, self._conn = self._conn, self._body, None
        if conn is None:
            return                          # read to its end (and pooled), or closed
        if body is None or self._coding != "identity":
            conn.close()
            return
        _background(_finish, conn, body)


def _finish(conn: Connection, body: Iterator[bytes]) -> None:
    """Read an ended answer's rest (see Answer.end): its reader pools the
    connection when the body ends; anything else closes it."""
    pooled = False
    try:
        conn.sock.settimeout(END_WAIT)
        for piece in body:
            if piece:                       # payload after the end: not ours to drop
                break
        else:
            pooled = True
    except Exception:  # noqa: BLE001 - a broken rest: the connection is not reused
        pass
    if not pooled:
        conn.close()


def _background(fn, *args) -> None:
    """fn(*args) on its own: a greenlet under gevent (the services), else a thread."""
    from gevent import monkey
    if monkey.is_module_patched("socket"):
        import gevent
        gevent.spawn(fn, *args)
    else:
        threading.Thread(target=fn, args=args, daemon=True).start()


def _dechunk(conn: Connection) -> Iterator[bytes]:
    """The payload of a chunked body, one piece per receive; leaves what
    follows the body's end in conn.buf."""
    buf, conn.buf = conn.buf, b""
    left = 0            # payload bytes due in the current chunk
    crlf = False        # the CRLF after a chunk's payload is due
    while True:
        if not buf:
            buf = conn.recv()
            if not buf:
                raise BrokenBody("Connection broken: the upstream closed the connection "
                                 "before the end of the body")
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
                if buf[i:i + 2] != b"\r\n":
                    raise BrokenBody("Connection broken: a chunk is longer than its size")
                i += 2
                crlf = False
                continue
            end = buf.find(b"\r\n", i)
            if end < 0:
                if n - i > 1024:
                    raise BrokenBody("Connection broken: invalid chunk size line")
                break
            try:
                size = int(buf[i:end].split(b";", 1)[0], 16)
            except ValueError:
                raise BrokenBody(f"Connection broken: invalid chunk size "
                                 f"{buf[i:end][:40]!r}") from None
            if size == 0:
                # The last chunk; then optional trailer fields and an empty line.
                if buf.startswith(b"\r\n", end + 2):
                    conn.buf = buf[end + 4:]
                elif (tail := buf.find(b"\r\n\r\n", end)) >= 0:
                    conn.buf = buf[tail + 4:]
                else:
                    break           # wait for the rest of the trailer section
                if out:
                    yield b"".join(out)
                return
            if size < 0:
                raise BrokenBody("Connection broken: negative chunk size")
            left = size
            i = end + 2
        rest = buf[i:] if i < n else b""
        if out:
            yield out[0] if len(out) == 1 else b"".join(out)
        more = conn.recv()
        if not more:
            raise BrokenBody("Connection broken: the upstream closed the connection "
                             "before the end of the body")
        buf = rest + more if rest else more


def _decoded(pieces: Iterator[bytes], coding: str) -> Iterator[bytes]:
    """A gzip or deflate body decoded as it arrives (we ask for identity, but a
    server may code it anyway)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if "gzip" in coding else zlib.MAX_WBITS)
    try:
        for piece in pieces:
            out = d.decompress(piece)
            if out:
                yield out
        out = d.flush()
    except zlib.error as e:
        raise requests.exceptions.ContentDecodingError(f"cannot decode the {coding} "
                                                       f"body: {e}") from None
    if out:
        yield out
