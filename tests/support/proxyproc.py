"""Run the proxy for real: `python -m proxy` (gunicorn + gevent) on a free loopback port,
or the app in-process on a werkzeug thread server."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .servers import ServerThread, free_port, wait_http

REPO = Path(__file__).resolve().parents[2]


class ProxyProcess:
    def __init__(self, **env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: str(v) for k, v in env.items()}

    def __enter__(self):
        env = dict(os.environ)
        env.update({"PROXY_HOST": "127.0.0.1", "PROXY_PORT": str(self.port),
                    "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="proxy-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy"], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_http(self.url + "/healthz", 30, proc=self.proc)
        except Exception:
            self.__exit__()
            raise RuntimeError("proxy did not start:\n" + self.logs())
        return self

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)     # gunicorn: quick shutdown
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def inprocess(settings):
    """The app on a threaded werkzeug server (real sockets, no gunicorn)."""
    from proxy.app import create_app
    return ServerThread(create_app(settings))
