"""Run the proxy for real: `python -m proxy` (gunicorn + gevent) on a free loopback port,
or the app in-process on a werkzeug thread server."""
from __future__ import annotations

import signal
import sys

from .process import ServiceProcess
from .servers import ServerThread


class ProxyProcess(ServiceProcess):
    name = "proxy"
    stop_signal = signal.SIGINT          # gunicorn: quick shutdown

    def __init__(self, **env):
        super().__init__(env)
        self.env.update({"PROXY_HOST": "127.0.0.1", "PROXY_PORT": str(self.port)})

    def command(self) -> list[str]:
        return [sys.executable, "-m", "proxy"]


def inprocess(settings):
    """The app on a threaded werkzeug server (real sockets, no gunicorn)."""
    from proxy.app import create_app
    return ServerThread(create_app(settings))
