"""Run a WSGI app on a free loopback port in a background thread (real sockets)."""
from __future__ import annotations

import fcntl
import itertools
import os
import socket
import tempfile
import threading
import time

import requests
from werkzeug.serving import make_server


PORTS_PER_WORKER = 2000
BLOCKS = 8
BLOCK_LOCKS = os.path.join(tempfile.gettempdir(), "coding-stack-test-ports")


def _port_block() -> range:
    """This test process's own block of ports: outside the kernel's ephemeral
    range (no outgoing connection's local port lands in it), and held by no other
    test process on this machine: each of the BLOCKS blocks is claimed with an
    flock (BLOCK_LOCKS/N.lock) held until this process ends (children do not
    inherit it: Popen closes their descriptors). A pytest-xdist worker (gw0, gw1,
    ...) tries the block of its number first. Before, the block was the worker's
    number alone: a second test command on the same machine (one process, so
    "gw0") was handed the same ports as the first one's gw0, and the fleet's router
    port answered as the other run's scripted chat."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    base = 10000 if low - 10000 >= BLOCKS * PORTS_PER_WORKER else high + 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    first = int(worker[2:]) % BLOCKS if worker[2:].isdigit() else 0
    os.makedirs(BLOCK_LOCKS, exist_ok=True)
    for index in [(first + i) % BLOCKS for i in range(BLOCKS)]:
        f = open(os.path.join(BLOCK_LOCKS, f"{index}.lock"), "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _held.append(f)                 # open (and locked) for the life of this process
        start = base + index * PORTS_PER_WORKER
        return range(start, min(start + PORTS_PER_WORKER, 65536))
    raise RuntimeError(f"all {BLOCKS} test port blocks are held by other test processes "
                       f"(locks in {BLOCK_LOCKS})")


_held: list = []
_block: range | None = None             # this process's block, claimed on first use
_ports = None                           # ... and its ports, cycled
_ports_lock = threading.RLock()


def port_block() -> range:
    """This process's block of ports, claimed at the first call (not at import:
    xdist's controller imports this module and serves nothing)."""
    global _block, _ports
    with _ports_lock:
        if _block is None:
            _block = _port_block()
            _ports = itertools.cycle(_block)
        return _block


def free_port() -> int:
    """A loopback port nobody listens on, from this process's block, taken in turn
    (a port handed out is not handed out again until the block wraps). With the
    kernel's port 0 instead, a port one test process was given and closed could be
    given to another process before the first bound it again (seen: a backend's
    published port taken by another xdist worker's proxy)."""
    with _ports_lock:
        port_block()
        for _ in range(PORTS_PER_WORKER):
            port = next(_ports)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue            # in use (or lingering): the next one
                return port
    raise RuntimeError("no free port left in this test process's block")


class ServerThread:
    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.server = make_server("127.0.0.1", self.port, app, threaded=True)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def wait_http(url: str, deadline_s: float = 30.0, ok=(200,), proc=None) -> requests.Response:
    """Poll url until it answers with a status in ok (a wait, not an assertion on time)."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {url}")
        try:
            r = requests.get(url, timeout=2)
            if r.status_code in ok:
                return r
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = str(e)
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {deadline_s} s: {last}")


def wait_until(predicate, what: str, deadline: float = 5.0, every: float = 0.01):
    """Poll predicate() every `every` seconds until it gives a true value, and return
    that value; fail naming `what` after `deadline` seconds (a wait for something done
    in the background, not an assertion on time). The tests' one wait helper."""
    end = time.monotonic() + deadline
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what}: not within {deadline} s")
        time.sleep(every)


class ScriptedServer:
    """Base of the scripted test servers: a subclass sets `self.app`; `with`
    serves it on a free loopback port and sets `self.url`."""
    app = None

    def __enter__(self):
        self._server = ServerThread(self.app).__enter__()
        self.url = self._server.url
        return self

    def __exit__(self, *exc):
        self._server.__exit__(*exc)


def post_and_abandon(url: str, path: str, body: dict, after: float = 1.5) -> None:
    """POST a JSON body, then hang up before the answer comes, like a client
    that gives up. (A requests timeout would not do: the exception's traceback
    keeps the response, and so the socket, open.)"""
    import http.client
    import json
    from urllib.parse import urlsplit
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(after)
    conn.close()


def accepted(sock: socket.socket):
    """The connections accepted on a listening socket, until it is closed."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        yield conn


class Relay:
    """A TCP relay to a server that counts the connections made through it.
    With `drop_first`, the first is closed without an answer instead (what a
    stale kept-alive connection looks like)."""

    def __init__(self, target_url: str, drop_first: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.target = int(target_url.rsplit(":", 1)[1])
        self.drop_first = drop_first
        self.dropped = 0
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        for conn in accepted(self.sock):
            self.connections += 1
            if self.drop_first and self.dropped == 0:
                self.dropped += 1
                conn.recv(65536)
                conn.close()
                continue
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn):
        up = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
        pipe(conn, up)

    def close(self):
        self.sock.close()


def pipe(a: socket.socket, b: socket.socket, on_end=None) -> None:
    """Copy bytes from a to b until either side ends; then shut both down
    (and call `on_end(a, b)`)."""
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        close_socket(a)
        close_socket(b)
        if on_end is not None:
            on_end(a, b)


def close_socket(s: socket.socket) -> None:
    """Shut a socket down (the peer sees the end at once) and close it."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


class RawServer:
    """A loopback server that speaks raw HTTP/1.1 bytes: each connection's
    requests (head, Content-Length body) go to `answer(conn, head, body)`, which
    writes what it likes and returns whether to read the next request on that
    connection. Counts connections; `more()` is asked before each read."""

    def __init__(self):
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        for conn in accepted(self.sock):
            self.connections += 1
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn):
        try:
            self._requests(conn)
        except OSError:
            pass                        # the client hung up: nothing to answer

    def _requests(self, conn):
        with conn:
            buf = b""
            while self.more():
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                if not self.answer(conn, head, body):
                    return

    def more(self) -> bool:
        return True

    def answer(self, conn, head: bytes, body: bytes) -> bool:
        raise NotImplementedError

    def close(self):
        self.sock.close()


class Scripted(RawServer):
    """Answers the requests on each connection with the next scripted answers
    (bytes sent as they are; a list: pieces, each sent on its own, `pause`
    apart; None: hang up; a float: pause that long). Records request heads and
    bodies, and counts connections."""

    def __init__(self, *answers, pause: float = 0.01):
        self.answers = list(answers)
        self.pause = pause
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        super().__init__()

    def more(self) -> bool:
        return bool(self.answers)

    def answer(self, conn, head: bytes, body: bytes) -> bool:
        self.heads.append(head)
        self.bodies.append(body)
        answer = self.answers.pop(0)
        if answer is None:
            return False
        for piece in answer if isinstance(answer, list) else [answer]:
            if piece is None:
                return False
            if isinstance(piece, float):
                time.sleep(piece)
                continue
            conn.sendall(piece)
            time.sleep(self.pause)
        return True

