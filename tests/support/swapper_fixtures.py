"""The swapper fixtures shared by tests/integration/swapper and tests/reliability (each
conftest imports them): a real swapper per module on the real engine, the
one-resident invariant sampled around a test, and an unload between tests."""
import docker
import pytest
import requests

from .swapperproc import InvariantSampler, SwapperProcess, stack_containers


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


@pytest.fixture
def invariant(docker_client, swapper):
    with InvariantSampler(docker_client, swapper.stack) as s:
        yield s
    assert s.samples > 0
    assert s.peak <= 1, f"{s.peak} backend containers of the stack ran at once"
