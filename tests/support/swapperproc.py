"""Run the swapper for real: `python -m swapper` (gunicorn + one gevent worker)
on a free loopback port, against the real Docker engine, with its own stack
name so it can touch nothing but what it creates."""
from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from pathlib import Path

import docker

from .process import REPO, ServiceProcess
from .servers import free_port

FIXTURE_BACKENDS = REPO / "tests" / "fixtures" / "backends"
# The test bed's variables as the unit tests give them to FIXTURE_BACKENDS (no test bed).
ENV = {"TESTBED_BASE_IMAGE": "base", "TESTBED_LLAMACPP_IMAGE": "llama",
       "TESTBED_MODELS_DIR": "/models", "TESTBED_MODEL_FILE": "m.gguf",
       "TESTBED_VLLM_IMAGE": "vllm", "TESTBED_VLLM_MODEL_NAME": "m"}
LABEL_STACK = "org.coding-stack.stack"
_KEYS: dict[str, str] = {}          # stack -> the backends' key of its swappers


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


class SwapperProcess(ServiceProcess):
    name = "swapper"

    def __init__(self, stack: str | None = None, backends_dir: Path = FIXTURE_BACKENDS,
                 publish_port: int | None = None, **env):
        super().__init__()
        self.stack = stack or new_stack_name()
        self.publish_port = publish_port or free_port()
        self.backend_url = f"http://127.0.0.1:{self.publish_port}"
        # The backends' own key (BACKEND_API_KEY): what a test reaching the published
        # port directly sends (backend_headers); a swapper run without it has a random one.
        self.backend_key = env.pop("BACKEND_API_KEY", None) or _KEYS.setdefault(
            self.stack, f"tb-{uuid.uuid4().hex}")       # a swapper back on its stack adopts
        self.backend_headers = {"Authorization": f"Bearer {self.backend_key}"}
        self.env.update({
            "SWAPPER_HOST": "127.0.0.1", "SWAPPER_PORT": str(self.port),
            "BACKENDS_DIR": str(backends_dir), "STACK_NAME": self.stack,
            "BACKEND_PUBLISH_PORT": str(self.publish_port), "BACKEND_BIND": "127.0.0.1",
            "CRASH_BACKOFF": "0.5", "WATCH_INTERVAL": "0.5",
            "BACKEND_API_KEY": self.backend_key,
            **load_testbed_env(),
        })
        self.env.update({k: str(v) for k, v in env.items()})

    def command(self) -> list[str]:
        return [sys.executable, "-m", "swapper"]

    def __exit__(self, *exc):
        self.stop()
        reap(docker.from_env(), self.stack)


class InvariantSampler:
    """Samples Docker in the background: how many of the stack's backend
    containers run at once (the one-resident invariant)."""

    def __init__(self, client, stack, interval=0.05):
        self.client, self.stack, self.interval = client, stack, interval
        self.peak = 0
        self.samples = 0
        self.seen_models: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            running = stack_containers(self.client, self.stack, running_only=True)
            self.samples += 1
            self.peak = max(self.peak, len(running))
            for c in running:
                m = c.labels.get("org.coding-stack.model")
                if not self.seen_models or self.seen_models[-1] != m:
                    self.seen_models.append(m)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
