"""Forward an admitted request to the resident backend and stream the answer
back without buffering. The slot is released when the body ends (or the client
goes away, which closes the upstream connection so the backend stops)."""
from __future__ import annotations

import json

import requests
from requests.adapters import HTTPAdapter

from common.disconnect import ClientGone, call_watching_client, watch_connections
from common.errors import ApiError, error_body
from common.streaming import forward_headers, iter_upstream, relay

from .driver import Driver
from .metrics import SwapperMetrics
from .scheduler import Scheduler, Ticket
from .settings import Settings


class Forwarder:
    def __init__(self, scheduler: Scheduler, driver: Driver, settings: Settings,
                 metrics: SwapperMetrics):
        self.scheduler = scheduler
        self.driver = driver
        self.settings = settings
        self.metrics = metrics
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=128, max_retries=0)
        self.session.mount("http://", adapter)
        watch_connections(self.session)

    @staticmethod
    def url(ticket: Ticket, path: str, query: str) -> str:
        """Where a request for `path` goes on the ticket's backend."""
        return f"{ticket.backend.url}/{path.lstrip('/')}" + (f"?{query}" if query else "")

    def open(self, ticket: Ticket, method: str, path: str, query: str, headers,
             body: bytes | None, environ: dict) -> requests.Response:
        """Send the request upstream and wait for its headers (for a non-streaming
        answer: until generation ends). A client that leaves meanwhile closes the
        upstream connection, so the backend stops. On failure the slot is
        released and an ApiError raised."""
        backend = ticket.backend
        url = self.url(ticket, path, query)
        try:
            return call_watching_client(lambda: self.session.request(
                method, url, data=body, headers=forward_headers(headers), stream=True,
                timeout=(self.settings.connect_timeout, None), allow_redirects=False), environ)
        except ClientGone:
            self.scheduler.release(ticket, ok=False)
            self.metrics.request_done(ticket.model, 499)
            raise ApiError("client disconnected before the answer", 499,
                           code="client_closed") from None
        except requests.RequestException as e:
            self.scheduler.release(ticket, ok=False)
            self.metrics.request_done(ticket.model, 502)
            running = self.driver.check(backend)
            msg = f"backend of model '{ticket.model}' did not answer at {url}: {e}"
            if not running:
                msg += (" (its container died; the next request starts it again)\n"
                        + self.driver.runtime.logs(ticket.model))
            raise ApiError(msg, 502, type_="upstream_error", code="backend_unreachable") from None

    def stream(self, ticket: Ticket, upstream: requests.Response):
        """A Flask response relaying `upstream`; releases the slot at the end."""
        backend = ticket.backend
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

        def on_close(complete: bool) -> None:
            self.scheduler.release(ticket, ok=complete and upstream.status_code < 500)
            self.metrics.request_done(ticket.model, upstream.status_code)
            if not complete:
                self.driver.check(backend)

        def on_break(exc: Exception) -> bytes:
            running = self.driver.check(backend)
            cause = "the backend container died" if not running else f"the backend broke off: {exc}"
            err = error_body(f"model '{ticket.model}': {cause} mid-response", 502,
                             type_="upstream_error", code="backend_failed")
            return f"data: {json.dumps(err)}\n\n".encode() if is_sse else b""

        return relay(upstream, body=iter_upstream(upstream, on_close, on_break))

    def forward(self, ticket: Ticket, method: str, path: str, query: str, headers,
                body: bytes | None, environ: dict):
        return self.stream(ticket, self.open(ticket, method, path, query, headers, body, environ))
