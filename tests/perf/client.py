"""Lean HTTP/1.1 clients for the benchmark: the client's own cost per chunk is
the same on every path and small, so the differences are the paths'.

`Stream` decodes chunked transfer encoding incrementally and counts SSE events
(blank-line terminated) without parsing JSON; `Session` keeps one keep-alive
connection per path for non-streaming requests.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
from urllib.parse import urlsplit

# Sent on every path (LiteLLM wants its master key; the others ignore it).
AUTH = "sk-perf-bench-0123456789abcdef"
CONTENT = re.compile(rb'"content":\s*"[^"]')      # a delta with (non-empty) text


class Dechunker:
    """Incremental chunked-transfer decoder (or identity, for a close-delimited body)."""

    def __init__(self, chunked: bool):
        self.chunked = chunked
        self.buf = b""
        self.left = 0            # payload bytes still due in the current chunk
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if not self.chunked:
            return data
        buf = self.buf + data if self.buf else data
        out = []
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self.left:
                take = min(self.left, n - i)
                out.append(buf[i:i + take])
                self.left -= take
                i += take
                continue
            # chunk boundary: "\r\n" ending the previous chunk, then "<hex>\r\n"
            if buf.startswith(b"\r\n", i):
                i += 2
                continue
            end = buf.find(b"\r\n", i)
            if end < 0:
                break
            size = int(buf[i:end].split(b";")[0] or b"0", 16)
            i = end + 2
            if size == 0:
                self.done = True
                break
            self.left = size
        self.buf = buf[i:]
        return b"".join(out)


class EventCounter:
    """Counts SSE events in a byte stream; remembers arrival times on request."""

    def __init__(self, keep_times: bool = False):
        self.events = 0
        self.tail = b""
        self.keep_times = keep_times
        self.content_times: list[float] = []
        self.first = None        # time of the first complete data event
        self.last = None

    def feed(self, data: bytes, now: float) -> None:
        if not data:
            return
        joined = self.tail + data
        cut = joined.rfind(b"\n\n")
        if cut < 0:
            self.tail = joined if self.keep_times else joined[-1:]
            return
        complete, self.tail = joined[:cut + 2], joined[cut + 2:]
        if not self.keep_times and len(self.tail) > 1:
            self.tail = self.tail[-1:]
        if self.first is None and b"data:" in complete:   # not a waiting stream's comment
            self.first = now
        self.last = now
        self.events += complete.count(b"\n\n")
        if self.keep_times:
            for ev in complete.split(b"\n\n"):
                if CONTENT.search(ev):
                    self.content_times.append(now)


def _split(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname, u.port or 80


def request_bytes(host: str, port: int, path: str, body: dict, close: bool = True) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nAuthorization: Bearer {AUTH}\r\n"
            f"Content-Length: {len(data)}\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode() + data


def _head(buf: bytes) -> tuple[int, bool, bytes] | None:
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].split(b"\r\n")
    status = int(lines[0].split()[1])
    chunked = any(l.lower().startswith(b"transfer-encoding:") and b"chunked" in l.lower()
                  for l in lines[1:])
    return status, chunked, buf[end + 4:]


def stream(url: str, body: dict, keep_times: bool = False, timeout: float = 600) -> dict:
    """One streamed request on a fresh connection. Returns t0-relative times:
    first_event, first_content, last_event, events, content_times, status."""
    host, port = _split(url)
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    counter = EventCounter(keep_times)
    try:
        t0 = time.perf_counter()
        sock.sendall(request_bytes(host, port, "/v1/chat/completions", body))
        buf = b""
        head = None
        dech = None
        while True:
            data = sock.recv(262144)
            now = time.perf_counter()
            if not data:
                break
            if dech is None:
                buf += data
                head = _head(buf)
                if head is None:
                    continue
                status, chunked, rest = head
                dech = Dechunker(chunked)
                data = rest
            counter.feed(dech.feed(data), now)
            if dech.done:
                break
    finally:
        sock.close()
    if head is None:
        raise ConnectionError(f"{url}: no response")
    ct = counter.content_times
    return {"status": head[0], "events": counter.events,
            "first_event": counter.first - t0 if counter.first else None,
            "last_event": counter.last - t0 if counter.last else None,
            "first_content": ct[0] - t0 if ct else None,
            "content_times": [t - t0 for t in ct]}


class Session:
    """One keep-alive connection for non-streaming requests; reconnects once on a
    connection the server had closed (llama-server closes after a stream)."""

    def __init__(self, url: str):
        self.host, self.port = _split(url)
        self.conn = None

    def post(self, path: str, body: dict) -> tuple[int, bytes, float]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {AUTH}"}
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
                self.conn.connect()
                self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                t0 = time.perf_counter()
                self.conn.request("POST", path, data, headers)
                r = self.conn.getresponse()
                out = r.read()
                dt = time.perf_counter() - t0
                if r.will_close:
                    self.close()
                return r.status, out, dt
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


async def astream(url: str, body: dict, expect_events: int, timeout: float = 120) -> dict:
    """One streamed request with asyncio (for many at once): ttft, events, error."""
    host, port = _split(url)
    t0 = time.perf_counter()
    counter = EventCounter()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(request_bytes(host, port, "/v1/chat/completions", body))
        buf = b""
        head = None
        dech = None
        errbody = bytearray()                   # the body of a non-200 answer

        async def run():
            nonlocal buf, head, dech
            while True:
                data = await reader.read(262144)
                if not data:
                    return
                now = time.perf_counter()
                if dech is None:
                    buf += data
                    head = _head(buf)
                    if head is None:
                        continue
                    dech = Dechunker(head[1])
                    data = head[2]
                payload = dech.feed(data)
                if head[0] != 200:
                    errbody.extend(payload)
                counter.feed(payload, now)
                if dech.done:
                    return
        await asyncio.wait_for(run(), timeout)
        if head is None:
            return {"error": "no response", "ttft": None, "events": 0}
        err = None
        if head[0] != 200:
            err = f"HTTP {head[0]}"
            try:
                err += ": " + json.loads(bytes(errbody))["error"]["message"][:160]
            except (ValueError, KeyError, TypeError):
                pass
        elif counter.events < expect_events:
            err = f"{counter.events} of {expect_events} events"
        return {"error": err, "events": counter.events,
                "ttft": counter.first - t0 if counter.first else None}
    except (OSError, asyncio.TimeoutError) as e:
        return {"error": f"{type(e).__name__}: {e}", "events": counter.events,
                "ttft": counter.first - t0 if counter.first else None}
    finally:
        if writer is not None:
            writer.close()
