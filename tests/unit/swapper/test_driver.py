"""The driver on the fake runtime: every action is reported whatever happens,
stops are retried until sure, crashes are noticed (also while Docker still
calls a killed container running), backoff, idle TTL, adoption."""
from types import SimpleNamespace

import pytest

from swapper.driver import Driver
from swapper.metrics import SwapperMetrics
from swapper.registry import ModelSpec
from swapper.runtime import BackendError
from swapper.scheduler import IDLE, LOADING, READY, STOPPING, LoadFailed, Scheduler
from swapper.settings import Settings
from tests.support.fake_runtime import FakeRuntime


def spec(model_id: str, slots: int = 1, idle_ttl: float = 0.0) -> ModelSpec:
    return ModelSpec(id=model_id, kind="llamacpp", image="img", port=8080, health_path="/health",
                     start_timeout=10, slots=slots, source="test", idle_ttl=idle_ttl)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    slept: list


@pytest.fixture
def world():
    clock = Clock()
    clock.slept = []
    models = {m.id: m for m in (spec("a"), spec("b", slots=2), spec("ttl", idle_ttl=30))}
    sched = Scheduler(lambda m: models[m].slots, backoff_base=1.0, backoff_max=8.0, clock=clock)
    runtime = FakeRuntime()
    driver = Driver(sched, runtime, SimpleNamespace(models=models), Settings(),
                    SwapperMetrics(), sleep=clock.sleep, clock=clock)
    return SimpleNamespace(sched=sched, runtime=runtime, driver=driver, clock=clock)


def turn(w, n: int = 1):
    for _ in range(n):
        w.driver.step(timeout=0)


def test_load_admits_with_the_backend(world):
    t = world.sched.submit("a")
    turn(world)
    assert t.state == "admitted"
    assert t.backend == world.sched.backend and t.backend.model == "a"
    assert world.runtime.calls == [("start", "a")]


def test_engine_down_during_a_load_fails_it_clearly_and_recovers(world):
    """Issue 9.4: a Docker outage during a load must not jam the scheduler."""
    turn(world)                                   # adopted (nothing there)
    world.runtime.engine_up = False
    t = world.sched.submit("a")
    turn(world)
    assert t.state == "failed"
    assert isinstance(t.error, LoadFailed) and t.error.kind == "docker_unreachable"
    assert world.sched.phase == IDLE
    world.runtime.engine_up = True
    t2 = world.sched.submit("a")
    turn(world)
    assert world.clock.slept == [1.0]             # one failure: backoff before the retry
    assert t2.state == "admitted"


@pytest.mark.parametrize("error", [RuntimeError("a bug"), KeyError("x")])
def test_an_unexpected_error_while_loading_is_still_reported(world, error):
    world.runtime.start_errors["a"] = error
    t = world.sched.submit("a")
    turn(world)
    assert t.state == "failed" and "could not start it" in str(t.error)
    assert world.sched.phase == IDLE


def test_a_failed_start_carries_its_cause(world):
    world.runtime.start_errors["a"] = BackendError("a", "not healthy", "last line",
                                                   kind="load_timeout")
    t = world.sched.submit("a")
    turn(world)
    assert t.error.kind == "load_timeout" and "last line" in str(t.error)


def test_stop_is_retried_until_the_engine_confirms(world):
    a = world.sched.submit("a")
    turn(world)
    world.sched.release(a)
    b = world.sched.submit("b")                   # a swap: stop a, then load b
    world.runtime.stop_failures = 2
    turn(world)
    assert world.clock.slept == [1.0, 2.0]
    assert [c for c in world.runtime.calls if c[0] == "stop"] == [("stop", "a")] * 3
    assert world.sched.phase == IDLE or world.sched.phase == LOADING
    turn(world)
    assert b.state == "admitted" and world.runtime.peak == 1


def test_crash_is_noticed_by_the_watch_and_the_next_request_restarts(world):
    a = world.sched.submit("a")
    turn(world)
    world.sched.release(a)
    world.runtime.kill("a")
    turn(world)                                   # watch: crash -> stop
    assert world.sched.phase == STOPPING
    turn(world)                                   # the dead container is removed
    assert world.sched.phase == IDLE and world.runtime.containers == {}
    again = world.sched.submit("a")
    turn(world)
    assert world.clock.slept == [1.0]             # backoff after a crash
    assert again.state == "admitted"


def test_check_with_confirm_sees_through_docker_calling_a_killed_container_running(world):
    a = world.sched.submit("a")
    turn(world)
    world.runtime.kill("a", reported_running=3)
    assert world.driver.alive(a.backend, confirm=0.5) is False
    assert world.sched.phase == STOPPING
    assert world.clock.slept == [0.05] * 3


def test_check_without_confirm_trusts_docker(world):
    a = world.sched.submit("a")
    turn(world)
    world.runtime.kill("a", reported_running=1)
    assert world.driver.alive(a.backend) is True
    assert world.sched.phase == READY


def test_an_engine_that_cannot_say_is_not_a_crash(world):
    a = world.sched.submit("a")
    turn(world)
    world.runtime.engine_up = False
    assert world.driver.alive(a.backend, confirm=0.5) is True
    assert world.sched.phase == READY


def test_a_crash_report_about_an_earlier_backend_changes_nothing(world):
    a = world.sched.submit("a")
    turn(world)
    old = a.backend
    world.sched.release(a)
    world.runtime.kill("a")
    turn(world, 2)                                # crash, stop
    b = world.sched.submit("a")
    turn(world)
    assert b.backend != old
    assert world.sched.crashed(old, "late report") is False
    assert world.sched.phase == READY


def test_idle_ttl_unloads(world):
    t = world.sched.submit("ttl")
    turn(world)
    world.sched.release(t)
    turn(world)
    assert world.sched.phase == READY
    world.clock.now += 31
    turn(world, 2)                                # expire, stop
    assert world.sched.phase == IDLE and world.runtime.containers == {}


def test_adoption_keeps_one_running_backend_and_removes_the_rest(world):
    world.runtime.leave("a")
    world.runtime.leave("b")
    world.runtime.leave("a", running=False)
    turn(world)
    assert world.sched.phase == READY and world.sched.model == "a"
    assert len(world.runtime.containers) == 1
    t = world.sched.submit("a")
    assert t.state == "admitted"


def test_adoption_waits_for_an_engine_that_is_down_at_start(world):
    """Issue 9.5: no engine at start is not fatal; adoption happens once it is up."""
    world.runtime.leave("a")
    world.runtime.engine_up = False
    turn(world)
    assert not world.driver.adopted and world.sched.phase == IDLE
    world.runtime.engine_up = True
    turn(world)
    assert world.driver.adopted and world.sched.phase == READY


@pytest.mark.parametrize("seed", range(5))
def test_never_two_running_and_nothing_stuck_over_a_random_walk(world, seed):
    """Requests, releases, crashes and engine outages in random order: never
    two containers, and once the engine is back every request is served."""
    import random
    rnd = random.Random(seed)

    def sleep(seconds):                 # an outage lasts until the driver waits
        world.clock.now += seconds
        world.runtime.engine_up = True
    world.driver._sleep = sleep
    tickets = []
    for _ in range(400):
        r = rnd.random()
        if r < 0.4 and len(tickets) < 32:
            tickets.append(world.sched.submit(rnd.choice("ab")))
        elif r < 0.7 and tickets:
            t = tickets.pop(rnd.randrange(len(tickets)))
            world.sched.cancel(t) if t.state == "waiting" else world.sched.release(t)
        elif r < 0.75:
            world.runtime.kill(world.sched.model or "a", reported_running=rnd.randrange(3))
        elif r < 0.8:
            world.runtime.engine_up = False
        turn(world)
        tickets = [t for t in tickets if t.state in ("waiting", "admitted")]
    world.runtime.engine_up = True
    for _ in range(200):                # drain: serve and release everything
        for t in tickets:
            if t.state == "admitted":
                world.sched.release(t)
        tickets = [t for t in tickets if t.state == "waiting"]
        if not tickets:
            break
        turn(world)
    assert tickets == [], [t.state for t in tickets]
    assert world.runtime.peak == 1
