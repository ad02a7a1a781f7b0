"""The forwarding routes every model request crosses, served straight from WSGI.

A model request crosses two of them (the proxy's dialect route, then the
swapper's /v1/*), and arrives with cold CPU caches (docs/performance.md).
Flask's per-request machinery -- request and app contexts, the URL map,
signals, the session, response conversion -- costs ~200 us of such a request
(tests/perf/coldhop.py: bare Flask against raw WSGI under the same server).

A hot route skips it: its view gets a werkzeug Request and returns any WSGI
app (a Flask Response, a common.streaming.Relayed). The service's own hooks
run around it as Flask's before/after_request would (an answer from `before`
skips the view; `after` sees every answer), and what either raises is
answered by the one error mapping, common.errors.error_for. Every other
request -- another path, another method than POST -- goes to Flask, whose
routes serve the same views; the request guard (common.guard) comes before
both.
"""
from __future__ import annotations

import logging
from typing import Callable

from werkzeug.wrappers import Request

from .errors import error_for

View = Callable[[Request], Callable]                  # a request -> a WSGI app


class HotPath:
    """WSGI middleware: POST requests whose path `pick` maps to a view are served
    by it; the rest by `app` (Flask's wsgi_app)."""

    def __init__(self, app, pick: Callable[[str], View | None], *, log: logging.Logger,
                 body_limit: int | None = None,
                 before: Callable[[Request], Callable | None] | None = None,
                 after: Callable[[Callable, Request], Callable] | None = None):
        self.app = app
        self.pick = pick
        self.log = log
        self.body_limit = body_limit
        self.before = before
        self.after = after
        # A body beyond the limit raises 413 as it is read, as under Flask's
        # MAX_CONTENT_LENGTH.
        self.request_class = type("HotRequest", (Request,), {"max_content_length": body_limit})

    def __call__(self, environ, start_response):
        view = self.pick(environ.get("PATH_INFO", "")) \
            if environ["REQUEST_METHOD"] == "POST" else None
        if view is None:
            return self.app(environ, start_response)
        req = self.request_class(environ)
        try:
            resp = self.before(req) if self.before is not None else None
            if resp is None:
                resp = view(req)
        except Exception as e:  # noqa: BLE001 - every error answers in the envelope
            resp = error_for(e, self.log, self.body_limit)
        if self.after is not None:
            try:
                resp = self.after(resp, req)
            except Exception as e:  # noqa: BLE001
                resp = error_for(e, self.log, self.body_limit)
        return resp(environ, start_response)


def install(app, pick: Callable[[str], View | None], **hooks) -> HotPath:
    """Serve `pick`'s routes hot in a Flask app (`hooks`: before, after), with
    its logger and body limit (MAX_CONTENT_LENGTH), beneath its request guard:
    common.guard.harden must be installed first, as every request still
    crosses the guard before anything else."""
    from .guard import RequestGuard
    guard = app.wsgi_app
    if not isinstance(guard, RequestGuard):
        raise TypeError("harden(app) first: the request guard comes before the hot routes")
    guard.app = hot = HotPath(guard.app, pick, log=app.logger,
                              body_limit=app.config.get("MAX_CONTENT_LENGTH"), **hooks)
    return hot
