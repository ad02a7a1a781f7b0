"""Run the swapper for real: `python -m swapper` (gunicorn + one gevent worker)
on a free loopback port, against the real Docker engine, with its own stack
name so it can touch nothing but what it creates."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import docker

from .servers import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]
FIXTURE_BACKENDS = REPO / "tests" / "fixtures" / "backends"
LABEL_STACK = "org.coding-stack.stack"


def load_testbed_env() -> dict:
    """The test bed's variables; raises (tests fail, not skip) when it is not laid."""
    need = ("TESTBED_LLAMACPP_IMAGE", "TESTBED_MODELS_DIR", "TESTBED_MODEL_FILE",
            "TESTBED_BASE_IMAGE")
    missing = [k for k in need if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: source tests/testbed/testbed.env "
                           "(made by tests/testbed/setup.sh)")
    return {k: os.environ[k] for k in need}


def new_stack_name() -> str:
    return f"cstest-{uuid.uuid4().hex[:8]}"


def stack_containers(client: docker.DockerClient, stack: str, running_only: bool = False):
    return client.containers.list(all=not running_only, filters={"label": f"{LABEL_STACK}={stack}"})


def reap(client: docker.DockerClient, stack: str) -> int:
    """Remove every container of a test stack (teardown; testcontainers' reaper idea)."""
    found = stack_containers(client, stack)
    for c in found:
        try:
            c.remove(force=True)
        except docker.errors.NotFound:
            pass
    return len(found)


class SwapperProcess:
    def __init__(self, stack: str | None = None, backends_dir: Path = FIXTURE_BACKENDS,
                 publish_port: int | None = None, **env):
        self.stack = stack or new_stack_name()
        self.port = free_port()
        self.publish_port = publish_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend_url = f"http://127.0.0.1:{self.publish_port}"
        self.env = {
            "SWAPPER_HOST": "127.0.0.1", "SWAPPER_PORT": str(self.port),
            "BACKENDS_DIR": str(backends_dir), "STACK_NAME": self.stack,
            "BACKEND_PUBLISH_PORT": str(self.publish_port), "BACKEND_BIND": "127.0.0.1",
            "CRASH_BACKOFF": "0.5", "WATCH_INTERVAL": "0.5", "PYTHONUNBUFFERED": "1",
            **load_testbed_env(),
        }
        self.env.update({k: str(v) for k, v in env.items()})
        self.proc = None

    def __enter__(self):
        self.start()
        return self

    def start(self):
        env = dict(os.environ)
        env.update(self.env)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="swapper-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "swapper"], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_http(self.url + "/healthz", 30, proc=self.proc)
        except Exception:
            self.stop()
            raise RuntimeError("swapper did not start:\n" + self.logs())
        return self

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self, kill: bool = False):
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc):
        self.stop()
        reap(docker.from_env(), self.stack)
