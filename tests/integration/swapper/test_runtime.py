"""DockerRuntime against the real engine: the pieces of an overlapped swap.
The next model's container is created while the old one runs (same published
port), started once the old one stopped, and the stopped one removed after."""
import dataclasses
import os

import pytest
import requests

from swapper.registry import Registry
from swapper.runtime import DockerRuntime
from swapper.settings import Settings
from tests.support.servers import free_port
from tests.support.swapperproc import (FIXTURE_BACKENDS, load_testbed_env, new_stack_name,
                                       reap, stack_containers)


@pytest.fixture
def rt(docker_client):
    stack = new_stack_name()
    env = {**os.environ, **load_testbed_env(), "STACK_NAME": stack,
           "BACKEND_PUBLISH_PORT": str(free_port()), "BACKEND_BIND": "127.0.0.1",
           "BACKENDS_DIR": str(FIXTURE_BACKENDS)}
    settings = Settings.from_env(env)
    runtime = DockerRuntime(settings, Registry.load(settings.BACKENDS_DIR, settings.env),
                            docker_client)
    yield runtime
    assert reap(docker_client, stack) == 0, "a container was left behind"


def status(docker_client, container_id):
    return docker_client.api.inspect_container(container_id)["State"]["Status"]


def healthy(backend):
    return requests.get(backend.url + "/health", timeout=5).status_code == 200


def test_prepare_next_to_a_running_backend_then_start_after_its_stop(rt, docker_client):
    models = rt.registry.models
    a = rt.start(models["tiny-a"])
    again = rt.prepare(models["tiny-a"])          # a restart of the same model: its own name
    b = rt.prepare(models["tiny-b"])              # the same published port, not bound yet
    assert len({a.name, again.name, b.name}) == 3
    assert status(docker_client, b.container_id) == "created" and healthy(a)
    assert rt.stop(a) == [a.container_id]
    assert status(docker_client, a.container_id) == "exited"
    assert rt.start(models["tiny-b"], prepared=b) == b and healthy(b)
    rt.remove(a.container_id)
    rt.remove(again.container_id)
    rt.remove(a.container_id)                     # already gone: fine
    assert [c.id for c in stack_containers(docker_client, rt.settings.STACK_NAME)] == [
        b.container_id]
    assert rt.remove_all(keep=[b.container_id]) == 0
    assert rt.remove_all() == 1


def test_start_removes_any_other_running_backend_first(rt, docker_client):
    """The runtime's own guard of the one-resident invariant."""
    models = rt.registry.models
    a = rt.start(models["tiny-a"])
    b = rt.start(models["tiny-b"], prepared=rt.prepare(models["tiny-b"]))
    assert healthy(b)
    assert [c.id for c in stack_containers(docker_client, rt.settings.STACK_NAME)] == [
        b.container_id]
    assert rt.state(a) == (False, "its container is gone")
    assert rt.remove_all() == 1


def test_nothing_is_prepared_for_an_image_that_must_be_pulled_first(rt, docker_client):
    """A pull can take minutes: it belongs to the load (which reports its
    progress), not to the stop of the model before."""
    spec = dataclasses.replace(rt.registry.models["tiny-a"], image="coding-stack-test/absent:0")
    assert rt.prepare(spec) is None
    assert stack_containers(docker_client, rt.settings.STACK_NAME) == []
