"""What one hop's server side costs with cold CPU caches, in process: for A/B
runs of a change to the hop, at a resolution (~10 us) the end-to-end
workloads cannot give on a noisy 2-core machine.

Each service's real app runs behind gunicorn's own request parser, WSGI environ
and response writer (common.serve.HeadWithBody) on an in-memory socket; its
upstream is a stub answering a canned chat completion at once (the HTTP client,
common.http1, is not measured). Before each request 32 MB are written, which
evicts the CPU caches as the backend's work and the idle gaps between real
requests do: on the test machine a hop's CPU per request triples after 50 ms
idle (docs/performance.md). Bare Flask and a raw WSGI app under the same server
show what the frameworks take.

    python -m tests.perf.coldhop [--n 800] [--apps proxy,swapper,flask,wsgi] [--hot]

Prints the median microseconds per request of each phase: gunicorn's parse,
its environ, the app (Flask and the route, up to the response object), and the
write of the answer (the response's own iteration, headers, send).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from requests.structures import CaseInsensitiveDict

import common.serve  # noqa: F401  (gunicorn answers through HeadWithBody, as in the services)
from gunicorn import http
from gunicorn.config import Config
from gunicorn.http import wsgi

BODY = json.dumps({"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 8}).encode()
ANSWER = json.dumps({
    "id": "x", "object": "chat.completion", "model": "tiny-b",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    "timings": {"predicted_per_second": 100.0, "prompt_n": 5, "predicted_n": 2}}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:11433\r\n"
           b"User-Agent: OpenAI/Python 1.99.0\r\nAccept-Encoding: gzip, deflate\r\n"
           b"Accept: application/json\r\nConnection: keep-alive\r\n"
           b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
ADDR = ("127.0.0.1", 40000)


class Canned:
    """An upstream answer (the part of requests.Response the services read)."""

    status_code = 200
    reason = "OK"

    framing = "length"              # common.http1.Answer: how its body was framed

    def __init__(self, body: bytes):
        self.content = body
        self.length = len(body)
        self.headers = CaseInsensitiveDict({
            "Content-Type": "application/json; charset=utf-8",
            "Content-Length": str(len(body)), "Server": "llama.cpp"})

    def iter_content(self, chunk_size=None, decode_unicode=False):
        return iter((self.content,))

    def json(self):
        return json.loads(self.content)

    def close(self) -> None:
        pass


class StubClient:
    """common.http1.Client's request(), answered at once."""

    def request(self, method, url, **_):
        return Canned(b'{"object":"list","data":[]}' if method == "GET" else ANSWER)


class Sock:
    def __init__(self, data: bytes):
        self.data, self.out = data, []

    def recv(self, n: int) -> bytes:
        d, self.data = self.data[:n], self.data[n:]
        return d

    def sendall(self, d: bytes) -> None:
        self.out.append(d)

    def setblocking(self, flag) -> None:
        pass

    def fileno(self) -> int:
        return -1


def proxy_app():
    from proxy.app import create_app
    from proxy.settings import Settings
    app = create_app(Settings.from_env({}, API_KEY="k", LOG_LEVEL="WARNING",
                                       BACKEND_URL="http://127.0.0.1:1"))
    app.extensions["proxy"]["upstream"].client = StubClient()
    return app


def swapper_app():
    from swapper.app import create_app
    from swapper.settings import Settings
    from tests.support.fake_runtime import FakeRuntime
    from tests.support.swapperproc import ENV, FIXTURE_BACKENDS
    app = create_app(Settings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=ENV, WATCH_INTERVAL=5),
                     runtime=FakeRuntime({"tiny-b": "http://127.0.0.1:1"}))
    app.extensions["swapper"].forwarder.client = StubClient()
    assert app.test_client().post("/load/tiny-b").status_code == 200
    return app


def flask_app():
    from flask import Flask, Response, request
    app = Flask("bare")

    @app.post("/v1/chat/completions")
    def chat():
        request.get_data()
        return Response(ANSWER, mimetype="application/json")
    return app


def wsgi_app():
    def app(environ, start_response):
        environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(ANSWER)))])
        return [ANSWER]
    return app


APPS = {"proxy": proxy_app, "swapper": swapper_app, "flask": flask_app, "wsgi": wsgi_app}


def measure(app, cfg: Config, n: int, cold: bool) -> dict[str, float]:
    junk = bytearray(32 * 1024 * 1024)
    line = b"\x01" * (len(junk) // 64)
    phases: dict[str, list[float]] = {k: [] for k in ("parse", "environ", "app", "write")}
    clock = time.perf_counter
    for i in range(n + 50):
        if cold:
            junk[::64] = line                 # every cache line of 32 MB written
        sock = Sock(REQUEST)
        t0 = clock()
        req = next(http.get_parser(cfg, sock, ADDR))
        t1 = clock()
        resp, environ = wsgi.create(req, sock, ADDR, ("127.0.0.1", 11433), cfg)
        t2 = clock()
        it = app(environ, resp.start_response)
        t3 = clock()
        try:
            for item in it:
                resp.write(item)
            resp.close()
        finally:
            if hasattr(it, "close"):
                it.close()
        t4 = clock()
        if not sock.out or not sock.out[0].startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"not a 200: {b''.join(sock.out)[:300]!r}")
        if i >= 50:                           # the first ones build caches of their own
            for k, a, b in (("parse", t0, t1), ("environ", t1, t2), ("app", t2, t3),
                            ("write", t3, t4)):
                phases[k].append((b - a) * 1e6)
    return {k: statistics.median(v) for k, v in phases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=800, help="requests per app")
    ap.add_argument("--apps", default="proxy,swapper,flask,wsgi")
    ap.add_argument("--hot", action="store_true", help="do not evict the caches")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    cfg = Config()
    for k, v in {"worker_class": "gevent", "keepalive": 75, "timeout": 0,
                 "accesslog": None, "control_socket_disable": True}.items():
        cfg.set(k, v)
    print(f"| app | parse | environ | app | write | total (µs per request, median, "
          f"{'hot' if a.hot else 'cold'}) |\n|---|---|---|---|---|---|")
    for name in a.apps.split(","):
        m = measure(APPS[name](), cfg, a.n, cold=not a.hot)
        print(f"| {name} | " + " | ".join(f"{m[k]:.0f}" for k in m) + f" | {sum(m.values()):.0f} |")


if __name__ == "__main__":
    main()
