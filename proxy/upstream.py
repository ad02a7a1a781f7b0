"""The one pooled HTTP client to BACKEND_URL: forwarding, and small JSON helpers.

Connect timeout short, read timeout unbounded (cold starts and long generations).
Connection failures become a 502 in the OpenAI envelope naming the URL.
Requests go through common.http1: a requests.Response for callers, at a
quarter of requests' per-call CPU.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

import requests

from common import sse
from common.disconnect import ClientGone, call_watching_client, sent_once_more
from common.errors import ApiError
from common.failures import classify, failure, reason
from common.http1 import Client
from common.streaming import headers_now, iter_body

from .record import Record, noting_waits
from .keys.auth import HOP_HEADERS, tenant_headers

log = logging.getLogger("proxy.upstream")

BROWSER_FIELDS = frozenset({"origin", "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest",
                            "sec-fetch-user", "access-control-request-method",
                            "access-control-request-headers"})
TENANT_FIELDS = frozenset(h.lower() for h in HOP_HEADERS)   # never a client's copy


class Upstream:
    def __init__(self, base_url: str, connect_timeout: float = 10.0, pool_size: int = 1000,
                 api_key: str = "", strip_auth: bool = False):
        self.base_url = base_url.rstrip("/")
        self.connect_timeout = connect_timeout
        # The proxy's own API key is for its door: never sent on upstream. Nor are
        # a browser's fields: the door (common.origins) has judged them, and a
        # backend seeing an Origin would answer with CORS fields of its own.
        # The request's key (a store's) is the door's too. The tenant fields are ours
        # alone: a client's are dropped, the request's key's sent (keys.auth).
        self._strip = BROWSER_FIELDS | TENANT_FIELDS | (
            frozenset({"authorization", "x-api-key"}) if api_key or strip_auth
            else frozenset())
        self.client = Client(pool_size)

    def request(self, method: str, path: str, *, query: str = "", headers=None, data=None,
                stream: bool = True, read_timeout: float | None = None,
                environ: dict | None = None, read_body: bool = False) -> requests.Response:
        """Send one request upstream. Raises ApiError with the failure's cause
        (common.failures) when the upstream cannot be reached.

        A request that did not reach the upstream (refused, or the connection
        closed before any answer: a kept-alive connection the server had just
        closed) is sent once more on a fresh connection. With the client's WSGI
        `environ`, the wait for the answer's headers (and, with read_body, its
        whole body) gives up when the client disconnects: the upstream
        connection is closed, so the model stops generating.
        """
        url = self.base_url + path
        if query:
            url += "?" + query
        if headers:
            headers = {k: v for k, v in headers.items() if k.lower() not in self._strip}
        tenant = tenant_headers(environ)
        if tenant:
            headers = {**(headers or {}), **tenant}
        timeout = (self.connect_timeout, read_timeout)

        def send(fresh: bool) -> requests.Response:
            r = self.client.request(method, url, headers=headers, body=data, timeout=timeout,
                                    fresh=fresh)
            if read_body or not stream:
                r.content
            return r

        def failed(e: BaseException, retry: bool) -> ApiError | None:
            if isinstance(e, ClientGone):
                return failure("client_gone", "client disconnected before the answer")
            if retry:
                log.info("%s %s did not reach %s (%s): sending it again",
                         method, path, self.base_url, reason(e))
                return None
            cause = classify(e)
            return failure(cause, f"upstream {self.base_url} "
                                  f"{_WHAT.get(cause, 'failed')}: {reason(e)} ({url})")

        return sent_once_more(send, environ, failed)


def watched(resp: requests.Response, environ: dict | None,
            record: Record | None = None) -> sse.Body:
    """The body of a streamed answer, read into events (common.sse's reader: the
    one place its bytes are framed); the reads that wait for its first byte
    watch the client (call_watching_client). A backend that sent its head is
    still prefilling then, and a gone client writes nothing that could fail:
    only the watch cuts the upstream. After the first byte every piece is
    written to the client, and a write to a gone client ends the stream. The
    swapper's queue-wait comment is noted in the request's record (noting_waits)."""
    return noting_waits(_watched(resp, environ), record)


def _watched(resp: requests.Response, environ: dict | None) -> Iterator[bytes]:
    it = iter_body(resp)
    if environ is not None:
        while True:
            piece = call_watching_client(lambda: next(it, None), environ)
            if piece is None:
                return
            yield piece
            if piece:
                break
    yield from it


def streamed(resp: requests.Response, environ: dict | None,
             record: Record | None = None) -> sse.Body:
    """A streamed answer's events to relay (common.streaming.relay(resp, body=...)):
    its head at once (an empty list of events when headers_now), its first byte
    awaited watching the client, the upstream closed at the end, whatever ends it."""
    return sse.Body(_streamed(resp, environ, record))


def _streamed(resp: requests.Response, environ: dict | None,
              record: Record | None) -> Iterator[list[sse.Event]]:
    try:
        if headers_now(resp):
            yield []
        yield from sse.events_of(watched(resp, environ, record))
    except ClientGone:
        pass
    finally:
        resp.close()


class Background:
    """fn() running beside the request (a greenlet under gunicorn's gevent worker,
    whose threading is gevent's; a thread under a threaded server), so a stream
    can write keep-alives while it waits. fn's own waits watch the client
    (call_watching_client), so a hang-up still cuts the backend's work."""

    __slots__ = ("_done", "_value", "_error")

    def __init__(self, fn: Callable):
        self._done = threading.Event()
        self._value = self._error = None
        threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self._error = e
        finally:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """True once fn() has returned or raised."""
        return self._done.wait(timeout)

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


def waited(task: "Background | Callable", interval: float,
           keepalive: Callable[[], list]):
    """A generator that yields what `keepalive()` makes (the stream's keep-alive
    events, made only when sent) every `interval` s while the task (or fn(),
    started now) runs and returns its result (`r = yield from waited(...)`), or
    raises what it raised."""
    if not isinstance(task, Background):
        task = Background(task)
    while not task.wait(interval):
        yield keepalive()
    return task.result()


def kept_alive(pieces, interval: float,
               abort: Callable[[], None] | None = None) -> sse.Body:
    """`pieces` (a stream's body: bytes, or an earlier stage's events), with a
    keep-alive comment every `interval` s of silence until an event with data has
    come: a backend prefilling a long prompt sends nothing for minutes, and a
    client waiting that long (Claude Code: 300 s) gives up and sends the request
    again. After that first event, the events pass as they come. `abort` closes
    the upstream when the client goes away during a wait (the read itself runs
    beside us and cannot be closed from here)."""
    return sse.Body(_kept_alive(sse.events_of(pieces), interval, abort))


def _kept_alive(batches, interval: float,
                abort: Callable[[], None] | None) -> Iterator[list[sse.Event]]:
    it = iter(batches)
    try:
        while True:
            evs = yield from waited(lambda: next(it, None), interval, sse.keepalive)
            if evs is None:
                return
            yield evs
            if any(ev.data is not None for ev in evs):
                break
    except GeneratorExit:
        if abort is not None:
            abort()
        raise
    yield from it


_WHAT = {"unreachable": "unreachable", "closed_early": "closed the connection",
         "timeout": "timed out"}


class ModelCatalog:
    """A short-lived cache of the upstream's GET /v1/models.

    The swapper adds system_prompt / max_tokens_floor / aliases per model; a plain
    llama-server or vLLM does not (then lookups find nothing, which is fine). A failed
    fetch is cached too, so an unreachable upstream never slows chat requests down.
    """

    def __init__(self, upstream: Upstream, ttl: float = 30.0):
        self.upstream = upstream
        self.ttl = ttl
        self._lock = threading.Lock()
        self._by_name: dict[str, dict] = {}
        self._expires = 0.0

    def lookup(self, model: str | None) -> dict:
        if not model:
            return {}
        now = time.monotonic()
        if now >= self._expires:
            with self._lock:
                if now >= self._expires:
                    self._by_name = self._fetch()
                    self._expires = time.monotonic() + self.ttl
        return self._by_name.get(model, {})

    def _fetch(self) -> dict[str, dict]:
        try:
            r = self.upstream.client.request(
                "GET", self.upstream.base_url + "/v1/models",
                timeout=(min(self.upstream.connect_timeout, 2.0), 5.0))
            try:
                if r.status_code != 200:
                    return {}
                entries = r.json().get("data") or []
            finally:
                r.close()
        except Exception as e:  # noqa: BLE001 - never fail a chat request over this
            log.debug("could not fetch /v1/models: %s", e)
            return {}
        out: dict[str, dict] = {}
        for m in entries:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str):
                continue
            out[m["id"]] = m
            for alias in m.get("aliases") or []:
                if isinstance(alias, str):
                    out.setdefault(alias, m)
        return out
