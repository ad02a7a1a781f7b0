"""A real server process on a free loopback port, its output in a log file:
started, waited for until its health URL answers (the log in the error when it
does not), stopped at the end. The base of the proxy, swapper and llama-server
helpers."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from .servers import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]


class ServiceProcess:
    """`running` holds the ones started and not yet stopped: a failed test's report
    carries the end of each one's log (tests/conftest.py)."""
    running: list["ServiceProcess"] = []
    name = "service"
    health_path = "/healthz"
    ready_timeout = 30.0
    stop_signal = signal.SIGTERM
    ready_statuses = (200,)           # what the health URL answers once it serves

    def __init__(self, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{self.name}-", suffix=".log",
                                               delete=False)
        # Its own process group: kill(kill=True) takes the workers down with it.
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        ServiceProcess.running.append(self)
        try:
            wait_http(self.url + self.health_path, self.ready_timeout, ok=self.ready_statuses,
                      proc=self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n" + self.logs()[-4000:])
        return self

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self, kill: bool = False, timeout: float = 30):
        if self in ServiceProcess.running:
            ServiceProcess.running.remove(self)
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            # Like a crashed container: master and workers die at once, no clean-up.
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            # The test's own responses that are garbage (requests' are in reference
            # cycles: freed at the next cyclic collection) still hold their kept-alive
            # sockets to this server, and a graceful stop waits for idle connections
            # (the swapper: up to its keep-alive, 5 s). Collected now, they close first;
            # what a test still holds stays open.
            gc.collect()
            self.proc.send_signal(self.stop_signal)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
