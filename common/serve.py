"""Serve a Flask app factory with gunicorn's gevent worker, from Python.

Both services run this way in their containers and outside Docker
(`python -m proxy`, `python -m swapper`), so tests exercise the real server.
The app is built inside the worker (`factory()`), after gevent has patched the
standard library, so the master never imports requests/ssl unpatched.
"""
from __future__ import annotations

import json
from typing import Callable

from gunicorn import util as gunicorn_util
from gunicorn.app.base import BaseApplication

from .errors import error_body

_CODES = {400: "bad_request", 403: "forbidden", 414: "request_line_too_long",
          417: "expectation_failed", 431: "headers_too_large", 500: "internal_error",
          501: "not_implemented"}


def write_envelope_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's answer to a request it refuses before the app runs (request line
    or headers too large or malformed, bad chunking...), in the OpenAI envelope
    instead of gunicorn's HTML page."""
    body = json.dumps(error_body(mesg or reason, status_int,
                                 code=_CODES.get(status_int))).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    gunicorn_util.write_nonblock(sock, head.encode("latin-1") + body)


# gunicorn's workers call util.write_error for these; every worker process of
# ours serves through this module, so the envelope replaces the HTML page.
gunicorn_util.write_error = write_envelope_error


class _Server(BaseApplication):
    def __init__(self, factory: Callable, options: dict):
        self._factory = factory
        self._options = options
        super().__init__()

    def load_config(self):
        for key, value in self._options.items():
            if value is not None:
                self.cfg.set(key, value)

    def load(self):
        return self._factory()


def serve(factory: Callable, host: str, port: int, *, workers: int = 1,
          name: str = "coding-stack", loglevel: str = "info", keepalive: int = 75,
          on_exit: Callable[[], None] | None = None,
          child_exit: Callable[[int], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT. On SIGTERM the worker finishes in-flight
    requests, but also waits for idle keep-alive connections to time out:
    `keepalive` bounds how long an idle client delays a shutdown. `child_exit(pid)`
    runs in the master when a worker exits."""
    _Server(factory, {
        "bind": f"{host}:{port}",
        "workers": workers,
        "worker_class": "gevent",
        "worker_connections": 1000,
        "timeout": 0,              # streams, cold starts and swaps last minutes
        "graceful_timeout": 30,
        "keepalive": keepalive,
        "loglevel": loglevel.lower(),
        "accesslog": None,
        "errorlog": "-",
        "proc_name": name,
        # gunicorn 27 opens a control socket under ~ by default: several servers
        # (or a user with no home) would fight over it.
        "control_socket_disable": True,
        "on_exit": (lambda server: on_exit()) if on_exit else None,
        "child_exit": (lambda server, worker: child_exit(worker.pid)) if child_exit else None,
    }).run()
