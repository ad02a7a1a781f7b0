"""Serve a Flask app factory with gunicorn's gevent worker, from Python.

Both services run this way in their containers and outside Docker
(`python -m proxy`, `python -m swapper`), so tests exercise the real server.
"""
from __future__ import annotations

import logging
from typing import Callable

from gunicorn.app.base import BaseApplication


class _App(BaseApplication):
    def __init__(self, factory: Callable, options: dict):
        self._factory = factory
        self._options = options
        super().__init__()

    def load_config(self):
        for key, value in self._options.items():
            if value is not None and key in self.cfg.settings:
                self.cfg.set(key, value)

    def load(self):
        # Called in the worker, after gevent has patched the standard library.
        return self._factory()


def serve(factory: Callable, host: str, port: int, workers: int = 1,
          on_exit: Callable | None = None, **options) -> None:
    """Run until SIGTERM/SIGINT. `factory()` builds the WSGI app in the worker."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = {
        "bind": f"{host}:{port}",
        "workers": workers,
        "worker_class": "gevent",
        "worker_connections": 1000,
        # Streams (cold starts, long generations) last minutes; gevent workers
        # keep heartbeating meanwhile, so this only bounds a wedged worker.
        "timeout": 300,
        "graceful_timeout": 30,
        "keepalive": 75,
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "info",
        "on_exit": (lambda server: on_exit()) if on_exit else None,
        # One control socket per user by default: several servers would fight over it.
        "control_socket_disable": True,
    }
    opts.update(options)
    _App(factory, opts).run()
