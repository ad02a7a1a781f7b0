"""The hops' HTTP/1.1 client: proxy -> swapper, swapper -> backend.

Both hops speak plain HTTP/1.1 to servers of ours on a private network (the
swapper, llama-server, vLLM), so they need none of requests' machinery:
no TLS, proxies, redirects, cookies, auth or retries (callers decide). h11
(python-hyper's sans-IO HTTP/1.1) writes each request and parses each answer,
strictly and within bounds (MAX_HEAD); this module is the pool around it, and
keeps only our policies.

    client = Client(pool_size=128)
    answer = client.request("POST", "http://host:8080/v1/x", headers={...},
                            body=b"...", timeout=(10.0, None))
    answer.status_code, answer.headers["content-type"], answer.fields
    for piece in answer.iter_content(): ...      # the body as it arrives
    answer.close()

An `Answer` is a `requests.Response` (its content, json(), text, ok work as
ever); its body is read straight from the socket, one piece per receive, and
says how it was framed (`framing`), so what is relayed is derived from that. A
connection goes back to its pool only after a complete body and only when both
sides keep it alive; a pooled connection that the server closed meanwhile is
noticed before reuse (an OS-level zero-timeout poll).

A request target is written as given, still percent-encoded, or refused: one
with a byte RFC 3986 does not allow there raises BadTarget before anything is
sent, so nothing decoded ever reaches a request line.

Errors are requests' own, so callers and common.failures keep one tree:

    requests.exceptions.ConnectTimeout        the connection was not made in time
    requests.exceptions.ReadTimeout           no answer within the read timeout
    requests.exceptions.ConnectionError       refused, unresolvable, or closed/reset
                                              before any byte of an answer; its
                                              argument is the OSError or
                                              http.client.RemoteDisconnected
    BadTarget (an InvalidURL)                 the request target is not RFC 3986
    requests.exceptions.InvalidHeader         a header field h11 refuses (CR, LF, NUL...)
    BadAnswer (a RequestException)            what came back is not valid HTTP/1.1, or
                                              the connection ended after the answer began
    BrokenBody (a ChunkedEncodingError)       the body broke off or its framing is bad

While a greenlet waits for an answer's head, its connection is registered in
`waiting`, so common.disconnect can cut it when the client hangs up.
"""
from __future__ import annotations

import http.client
import re
import select
import socket
import threading
import zlib
from datetime import timedelta
from typing import Iterator

import h11
import requests
from greenlet import getcurrent
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

try:
    from gevent.monkey import get_original
    _os_poll = get_original("select", "poll")
except ImportError:                   # no gevent: the standard library's
    _os_poll = select.poll

READ_SIZE = 65536
MAX_HEAD = 65536            # bytes h11 holds for one head, chunk size line or trailer section
MAX_INTERIM = 10            # informational (1xx) answers before the final one, at most
END_WAIT = 2.0              # Answer.end(): seconds each read of a body's rest may wait
SPARE_CONNECT = 2.0         # seconds a spare connection (fresh_after_stream) may take
MAX_UPSTREAMS = 16          # upstreams whose idle connections a client keeps
MAX_DECODED = 64 * 1024 * 1024  # bytes a gzip/deflate answer may decode to, at most

# Header fields the client writes itself: framing and the connection are its business.
# `Expect` is a client's handshake with the server it talks to (gunicorn answered
# its 100-continue already); the body is sent whole, so it is never passed on.
_OWN = frozenset({"host", "content-length", "transfer-encoding", "connection",
                  "accept-encoding", "keep-alive", "te", "upgrade", "trailer", "expect"})

# RFC 3986 origin-form (RFC 9112 3.2.1): "/" then pchar, "/" and "?", a "%" only
# before two hex digits. Not "#", a space, a control or a non-ASCII byte.
TARGET = _TARGET = re.compile(r"/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]+|%[0-9A-Fa-f]{2})*")


class BadTarget(requests.exceptions.InvalidURL):
    """A request target with a byte RFC 3986 does not allow in one (refused
    before anything is sent: nothing decoded is written into a request line)."""


class BadAnswer(requests.exceptions.RequestException):
    """The upstream's answer is not valid HTTP/1.1 (garbage, a head too large,
    a framing h11 refuses), or its connection ended after the answer began."""


class BrokenBody(requests.exceptions.ChunkedEncodingError):
    """The answer's body ended or broke before its end, or its chunking is invalid."""


# id(greenlet) -> the connection it waits on for an answer's head
waiting: dict[int, "Connection"] = {}


def readable(sock) -> bool:
    """Whether a read on `sock` would return at once: bytes, EOF or an error.
    The OS's own poll, with a zero timeout: select() fails for descriptors
    from 1024 up; gevent's poll, with many greenlets runnable, reported closed
    connections as open (tests/integration/test_stale_keepalive.py), and
    gevent's functions yield to the loop, while this also runs in the loop
    itself (common.disconnect's timer)."""
    p = _os_poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(0))


class Connection:
    __slots__ = ("sock", "key", "h11")

    def __init__(self, sock: socket.socket, key: tuple[str, int]):
        self.sock = sock
        self.key = key
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    def alive(self) -> bool:
        """Still open and idle: not readable (readable while idle is EOF, or
        stray bytes: not reusable either way)."""
        try:
            return not readable(self.sock)
        except (ValueError, OSError):
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


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
        head = _request(method, target, hostport, headers, body, fresh)
        conn = None if fresh else self._take(key)
        if conn is None:
            conn = _connect(key, timeout[0])
        me = id(getcurrent())
        try:
            h = conn.h11
            data = h.send_with_data_passthrough(head)
            if body:
                data += h.send_with_data_passthrough(h11.Data(data=body))
            data += h.send_with_data_passthrough(h11.EndOfMessage())
            conn.sock.settimeout(timeout[1])
            conn.sock.sendall(b"".join(data))
            waiting[me] = conn
            answer = _answer_head(conn)
        except BaseException as e:
            conn.close()
            if isinstance(e, requests.RequestException):
                raise
            if isinstance(e, socket.timeout):
                raise requests.exceptions.ReadTimeout(e) from None
            if isinstance(e, OSError):       # RemoteDisconnected too
                raise requests.exceptions.ConnectionError(e) from None
            raise
        finally:
            waiting.pop(me, None)
        return Answer(self, conn, url, method, answer, fresh)

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


def _request(method: str, target: str, hostport: str, headers, body, fresh: bool) -> h11.Request:
    """The request's head as h11 writes it, refused whole before anything is sent."""
    if _TARGET.fullmatch(target) is None:
        raise BadTarget(f"the request target {target[:200]!r} has a character that "
                        "RFC 3986 does not allow in a request target (it must be "
                        "percent-encoded)")
    try:
        fields = [(b"Host", hostport.encode("ascii"))]
        if headers:
            for k, v in headers.items():
                if k.lower() not in _OWN:
                    # Latin-1: a WSGI server hands on a field's bytes that way.
                    fields.append((k.encode("latin-1"), str(v).strip(" \t").encode("latin-1")))
        if body:
            fields.append((b"Content-Length", b"%d" % len(body)))
        elif method in ("POST", "PUT", "PATCH"):
            fields.append((b"Content-Length", b"0"))
        fields.append((b"Accept-Encoding", b"identity"))
        if fresh:
            fields.append((b"Connection", b"close"))
        return h11.Request(method=method.encode("ascii"), target=target.encode("ascii"),
                           headers=fields)
    except (h11.LocalProtocolError, UnicodeEncodeError) as e:
        raise requests.exceptions.InvalidHeader(f"a header field cannot be sent: {e}") from None


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


def _answer_head(conn: Connection) -> h11.Response:
    """The head of the final answer, after at most MAX_INTERIM interim ones.
    Only a connection that ends before any byte of an answer raises
    RemoteDisconnected (the request may be sent again); after one, the answer
    had begun: BadAnswer."""
    h = conn.h11
    began = False
    interim = 0
    while True:
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as e:
            if e.error_status_hint == 431:
                raise BadAnswer(f"the upstream's header block is over {MAX_HEAD} bytes") from None
            raise BadAnswer(f"the upstream's answer is not valid HTTP/1.1: {e}") from None
        if event is h11.NEED_DATA:
            try:
                data = conn.sock.recv(READ_SIZE)
            except socket.timeout:
                raise
            except OSError as e:
                if not began:
                    raise
                raise BadAnswer(f"the connection broke after the answer began: {e!r}") from None
            if not data:
                if not began:
                    raise http.client.RemoteDisconnected(
                        "Remote end closed connection without response")
                raise BadAnswer("the upstream closed the connection "
                                + ("after an interim answer" if interim else "mid-head"))
            began = True
            h.receive_data(data)
        elif type(event) is h11.InformationalResponse:
            interim += 1
            if interim > MAX_INTERIM:
                raise BadAnswer(f"the upstream sent over {MAX_INTERIM} interim (1xx) answers")
        else:
            return event                # h11.Response: the client's role sees nothing else


class AnswerHeaders(CaseInsensitiveDict):
    """An answer's header fields: requests' case-insensitive view (a repeated
    field's values joined by ", ", as requests does), and `fields`, the
    (name, value) pairs in the order they came, each repeated field repeated:
    what is relayed (Set-Cookie must not be joined)."""

    def __init__(self, fields: list[tuple[str, str]]):
        super().__init__()
        self.fields = fields
        store = self._store             # at once: update() goes field by field
        for name, value in fields:
            low = name.lower()
            had = store.get(low)
            store[low] = (name, value) if had is None else (had[0], f"{had[1]}, {value}")


def _framing(method: str, head: h11.Response) -> tuple[str, int | None]:
    """How the answer's body is framed ("none", "chunked", "length" or
    "close"), and its length when framed by one. h11 has checked the fields:
    Transfer-Encoding is only ever "chunked" (and then wins over a length),
    a Content-Length is ASCII digits."""
    if method == "HEAD" or head.status_code in (204, 304):
        return "none", None
    length = None
    for name, value in head.headers:            # h11's: lower-case names
        if name == b"transfer-encoding":
            return "chunked", None
        if name == b"content-length":
            length = int(value)
    return ("close", None) if length is None else ("length", length)


class Answer(requests.Response):
    """An upstream's answer, its body unread until iterated (see the module).
    `fields`: its header fields as they came; `framing`, `length`: how its
    body is delimited (_framing)."""

    def __init__(self, client: Client, conn: Connection, url: str, method: str,
                 head: h11.Response, fresh: bool):
        # requests.Response.__init__ builds a cookie jar and more we never use.
        self._content = False
        self._content_consumed = False
        self._next = None
        self.status_code = head.status_code
        self.fields = [(n.decode("latin-1"), v.decode("latin-1"))
                       for n, v in head.headers.raw_items()]
        self.headers = headers = AnswerHeaders(self.fields)
        self.raw = None
        self.url = url
        self.encoding = get_encoding_from_headers(headers)
        self.history = []
        self.reason = head.reason.decode("latin-1")
        self.cookies = None
        self.elapsed = timedelta(0)
        self.request = None
        self.connection = None
        self._client = client
        self._conn: Connection | None = conn
        self._body: Iterator[bytes] | None = None     # the body's reader, once iterated
        self.framing, self.length = _framing(method, head)
        self._spend = client.fresh_after_stream and \
            (headers.get("content-type") or "").startswith("text/event-stream")
        coding = (headers.get("content-encoding") or "identity").lower()
        if coding not in ("identity", "gzip", "x-gzip", "deflate"):
            self.close()
            raise BadAnswer(f"unsupported Content-Encoding {coding!r}")
        self._coding = coding
        if self.framing == "none":                 # nothing to read: done with it
            conn.h11.next_event()                  # its EndOfMessage
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
        return conn is None or self._content_consumed or bool(conn.h11.trailing_data[0])

    @property
    def content(self) -> bytes:
        if self._content is False:
            self._content = b"".join(self.iter_content())
        return self._content

    def _pieces(self, conn: "Connection | None" = None) -> Iterator[bytes]:
        """The body's payload from `conn` (default: the answer's), one piece
        per receive; pools or closes the connection at the body's end."""
        conn = conn or self._conn
        if conn is None:
            return
        h, sock = conn.h11, conn.sock
        try:
            # their_state DONE already: a reader before this one took the end,
            # with the last payload of the same receive (end()'s rest reader).
            while h.their_state is not h11.DONE:
                event = h.next_event()
                if type(event) is h11.Data:             # all that one receive held, at once
                    got = [event.data]
                    while type(event := h.next_event()) is h11.Data:
                        got.append(event.data)
                    yield b"".join(got)
                if event is h11.NEED_DATA:
                    h.receive_data(sock.recv(READ_SIZE))   # b"": the end, for h11 to judge
                elif type(event) is h11.EndOfMessage:
                    break
                else:
                    raise BrokenBody(f"Connection broken: {event!r} before the body's end")
        except h11.RemoteProtocolError as e:
            self.close()
            raise BrokenBody(f"Connection broken: {e}") from None
        except requests.RequestException:
            self.close()
            raise
        except socket.timeout as e:
            self.close()
            raise requests.exceptions.ReadTimeout(e) from None
        except OSError as e:
            self.close()
            raise BrokenBody(f"Connection broken: {e!r}") from None
        except GeneratorExit:
            # A reader given up (a relay's generator that ended at the stream's
            # logical end and was collected): not the answer closed. Its owner
            # says what becomes of the connection, end() or close().
            raise
        except BaseException:
            self.close()
            raise
        self._done(conn)

    def _done(self, conn: Connection) -> None:
        """The whole body was read: the connection serves the next request if
        both sides keep it alive (h11: both DONE), the server did not end it
        (a body delimited by the close) and no byte beyond the body came; one
        spent by a stream (fresh_after_stream) is replaced instead."""
        self._conn = None
        h = conn.h11
        beyond, ended = h.trailing_data
        if h.our_state is h11.DONE and h.their_state is h11.DONE and not beyond and not ended:
            if not self._spend:
                h.start_next_cycle()
                self._client.release(conn)
                return
            self._client.spare(conn.key)    # spent by a stream: the next one waits ready
        conn.close()

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
        conn, self._conn = self._conn, None
        if conn is None:
            return                          # read to its end (and pooled), or closed
        if self._body is None or self._coding != "identity":
            conn.close()
            return
        # A reader of its own: the caller's may be closed meanwhile (a generator
        # around it that ends), and closing it must not take the rest's reader.
        _background(_finish, conn, self._pieces(conn))


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


def _decoded(pieces: Iterator[bytes], coding: str,
             max_decoded: int = MAX_DECODED) -> Iterator[bytes]:
    """A gzip or deflate body decoded as it arrives (we ask for identity, but a
    server may code it anyway). Gzip: every member, one after the other (RFC
    1952); a body that ends inside its coded data is an error, not an end."""
    gz = "gzip" in coding
    wbits = 16 + zlib.MAX_WBITS if gz else zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    fed = False
    total = 0
    try:
        for piece in pieces:
            fed = fed or bool(piece)
            while True:
                # At most READ_SIZE out per call (a 64 KB piece of a bomb is
                # 64 MB decoded), MAX_DECODED in all.
                out = d.decompress(piece, READ_SIZE)
                total += len(out)
                if total > max_decoded:
                    raise zlib.error(f"it decodes to more than {max_decoded} bytes")
                if out:
                    yield out
                if d.unconsumed_tail:
                    piece = d.unconsumed_tail
                    continue
                if not (d.eof and d.unused_data):
                    break
                if not gz:
                    raise zlib.error("bytes after the end of the deflate stream")
                piece, d = d.unused_data, zlib.decompressobj(wbits)    # the next member
        out = d.flush()
        if total + len(out) > max_decoded:
            raise zlib.error(f"it decodes to more than {max_decoded} bytes")
        if fed and not d.eof:
            raise zlib.error("the body ends inside its coded data")
    except zlib.error as e:
        raise requests.exceptions.ContentDecodingError(f"cannot decode the {coding} "
                                                       f"body: {e}") from None
    if out:
        yield out
