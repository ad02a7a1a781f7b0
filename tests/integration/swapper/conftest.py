import threading
import time

import docker
import pytest
import requests

from tests.support.swapperproc import SwapperProcess, stack_containers


@pytest.fixture(scope="session")
def docker_client():
    client = docker.from_env()
    client.ping()           # no engine: every test here fails, loudly
    return client


@pytest.fixture(scope="module")
def swapper(docker_client):
    """One swapper per test module, with its own stack name; every container it
    made is removed at the end."""
    with SwapperProcess() as sw:
        yield sw
    assert stack_containers(docker_client, sw.stack) == [], "a backend container leaked"


@pytest.fixture(autouse=True)
def _unload_between_tests(request, docker_client):
    yield
    if "swapper" in request.fixturenames:
        sw = request.getfixturevalue("swapper")
        if sw.proc and sw.proc.poll() is None:
            requests.post(sw.url + "/unload", timeout=120)


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


@pytest.fixture
def invariant(docker_client, swapper):
    with InvariantSampler(docker_client, swapper.stack) as s:
        yield s
    assert s.samples > 0
    assert s.peak <= 1, f"{s.peak} backend containers of the stack ran at once"
