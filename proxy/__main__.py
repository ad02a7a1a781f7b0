"""`python -m proxy`: serve the app with gunicorn and the gevent worker.

The app is imported inside the worker, after gevent has monkey-patched it, so the
master process never imports requests/ssl unpatched.
"""
from __future__ import annotations

from gunicorn.app.base import BaseApplication

from .settings import Settings


class ProxyServer(BaseApplication):
    def __init__(self, settings: Settings):
        self.settings = settings
        super().__init__()

    def load_config(self):
        s = self.settings
        for key, value in {
            "bind": f"{s.PROXY_HOST}:{s.PROXY_PORT}",
            "workers": s.PROXY_WORKERS,
            "worker_class": "gevent",
            "worker_connections": 1000,
            "timeout": 0,            # streams and cold starts last minutes
            "graceful_timeout": 30,
            "keepalive": 75,
            "loglevel": s.LOG_LEVEL.lower(),
            "accesslog": None,
            "proc_name": "coding-stack-proxy",
            "control_socket_disable": True,   # no ~/.gunicorn socket (non-root, no home)
        }.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app
        return create_app(self.settings)


def main() -> None:
    ProxyServer(Settings.from_env()).run()


if __name__ == "__main__":
    main()
