"""Run the proxy for real: `python -m proxy` (gunicorn + gevent) on a free loopback port,
or the app in-process on a werkzeug thread server."""
from __future__ import annotations

import signal
from contextlib import contextmanager
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


@contextmanager
def searching(model_url: str, search: bool, **settings):
    """The proxy in process in front of a scripted model, with a FakeSearxng and
    web search on or off: (its URL, search)."""
    from proxy.settings import Settings
    from tests.support.searxng import FakeSearxng
    with FakeSearxng() as searx, inprocess(Settings.from_env({}, **dict(
            BACKEND_URL=model_url, SEARXNG_URL=searx.url, KEEPALIVE_INTERVAL=0.5,
            SYSTEM_PROMPT="", MODELS_TTL=0.0, WEB_SEARCH=search, **settings))) as srv:
        yield srv.url, search
