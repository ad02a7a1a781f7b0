"""Serve a Flask app factory with gunicorn's gevent worker, from Python.

Both services run this way in their containers and outside Docker
(`python -m proxy`, `python -m swapper`), so tests exercise the real server.
The app is built inside the worker (`factory()`), after gevent has patched the
standard library, so the master never imports requests/ssl unpatched.
"""
from __future__ import annotations

from typing import Callable

from gunicorn.app.base import BaseApplication


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
