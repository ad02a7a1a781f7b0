"""The driver on the fake runtime: every action is reported whatever happens,
stops are retried until sure, crashes are noticed (also while Docker still
calls a killed container running), backoff, idle TTL, adoption; a swap
creates the next container while the old one stops, starts it only once the
stop returned, removes the old one afterwards, and leaks nothing when any of
those steps fails."""
import threading
import time
from types import SimpleNamespace

import pytest

from swapper.driver import Driver
from swapper.metrics import SwapperMetrics
from swapper.registry import ModelSpec
from swapper.runtime import BackendError
from swapper.scheduler import IDLE, LOADING, READY, STOPPING, LoadFailed, Scheduler
from swapper.settings import Settings
from tests.support.fake_runtime import FakeRuntime
from tests.support.servers import wait_until
from tests.support.clock import Clock


def spec(model_id: str, slots: int = 1, idle_ttl: float = 0.0) -> ModelSpec:
    return ModelSpec(id=model_id, kind="llamacpp", image="img", port=8080, health_path="/health",
                     start_timeout=10, slots=slots, source="test", idle_ttl=idle_ttl)


@pytest.fixture
def world():
    clock = Clock(100.0)
    models = {m.id: m for m in (spec("a"), spec("b", slots=2), spec("ttl", idle_ttl=30))}
    sched = Scheduler(lambda m: models[m].slots, backoff_base=1.0, backoff_max=8.0, clock=clock)
    runtime = FakeRuntime()
    driver = Driver(sched, runtime, SimpleNamespace(models=models), Settings(),
                    SwapperMetrics(), sleep=clock.sleep, clock=clock, spawn=inline)
    return SimpleNamespace(sched=sched, runtime=runtime, driver=driver, clock=clock)


def inline(fn, *args):
    """The driver's helper threads, run in place (deterministic tests)."""
    fn(*args)
    return SimpleNamespace(join=lambda: None)


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
    turn(world, 2)                      # idle turns: nothing left but the resident
    resident = world.sched.backend
    assert list(world.runtime.containers) == ([resident.container_id] if resident else [])


# ------------------------------------------------------------------ the swap
def swap_to_b(w):
    """a resident and idle, then a request for b: returns (a's backend, b's ticket)."""
    a = w.sched.submit("a")
    turn(w)
    w.sched.release(a)
    return a.backend, w.sched.submit("b")


def test_a_swap_creates_the_next_container_while_the_old_one_stops():
    """The overlap, with real helper threads: while `docker stop` of a is under
    way b's container is created, and b starts only after the stop returned."""
    models = {m.id: m for m in (spec("a"), spec("b"))}
    sched = Scheduler(lambda m: models[m].slots)
    runtime = FakeRuntime()
    driver = Driver(sched, runtime, SimpleNamespace(models=models), Settings(),
                    SwapperMetrics())
    w = SimpleNamespace(sched=sched, runtime=runtime, driver=driver)
    old, b = swap_to_b(w)
    runtime.stop_gate = threading.Event()
    stopping = threading.Thread(target=turn, args=(w,))
    stopping.start()
    deadline = time.monotonic() + 5
    while ("prepare", "b") not in runtime.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("prepare", "b") in runtime.calls, runtime.calls   # created during the stop
    assert ("stopped", "a") not in runtime.calls and ("start", "b") not in runtime.calls
    runtime.stop_gate.set()
    stopping.join(5)
    turn(w)                                       # the load
    assert b.state == "admitted"
    calls = runtime.calls
    assert calls.index(("stopped", "a")) < calls.index(("start", "b"))
    assert runtime.peak == 1
    created = [cid for cid in runtime.containers if cid != old.container_id]
    assert created == [b.backend.container_id]    # the prepared container is the one started


def test_a_swap_in_order_prepare_stop_start_then_remove(world):
    old, b = swap_to_b(world)
    turn(world, 2)                                # stop a, load b
    assert b.state == "admitted"
    assert world.runtime.calls == [("start", "a"), ("prepare", "b"), ("stop", "a"),
                                   ("stopped", "a"), ("start", "b"),
                                   ("remove", old.container_id)]
    assert list(world.runtime.containers) == [b.backend.container_id]
    assert world.runtime.peak == 1


def test_an_unload_removes_the_container_before_it_answers(world):
    a = world.sched.submit("a")
    turn(world)
    world.sched.release(a)
    u = world.sched.submit(None)
    turn(world)                                   # stop: nothing to prepare
    assert u.state == "done" and ("prepare", "a") not in world.runtime.calls
    assert world.runtime.containers == {}


def test_a_failed_prepare_costs_only_the_overlap(world):
    def fail(spec):
        world.runtime.calls.append(("prepare", spec.id))
        raise BackendError(spec.id, "could not create its container: fake engine down",
                           kind="docker_unreachable")
    world.runtime.prepare = fail
    old, b = swap_to_b(world)
    turn(world, 2)
    assert b.state == "admitted"                  # start created it instead
    turn(world)                                   # idle: swept
    assert list(world.runtime.containers) == [b.backend.container_id]
    assert world.runtime.peak == 1


def test_a_failed_create_is_reported_and_leaves_nothing(world):
    world.runtime.create_errors["b"] = BackendError("b", "docker refused to start it: no")
    old, b = swap_to_b(world)
    turn(world, 2)
    assert b.state == "failed" and "docker refused" in str(b.error)
    assert world.sched.phase == IDLE
    turn(world)
    assert world.runtime.containers == {}


def test_a_failed_start_of_the_prepared_container_is_reported_and_leaves_nothing(world):
    world.runtime.start_errors["b"] = BackendError("b", "failed to start: exited", "boom")
    old, b = swap_to_b(world)
    turn(world, 2)
    assert b.state == "failed" and "boom" in str(b.error)
    turn(world)
    assert world.runtime.containers == {}


def test_an_engine_lost_before_the_start_leaves_nothing_once_it_is_back(world):
    old, b = swap_to_b(world)
    turn(world)                                   # stop a, b prepared
    world.runtime.engine_up = False
    turn(world)                                   # the start fails: b's container stays
    assert b.state == "failed" and b.error.kind == "docker_unreachable"
    assert len(world.runtime.containers) == 2
    turn(world)                                   # idle, engine still down: kept dirty
    world.runtime.engine_up = True
    turn(world)
    assert world.runtime.containers == {}


def test_a_failed_removal_is_swept_when_idle(world):
    world.runtime.remove_failures = 1
    old, b = swap_to_b(world)
    turn(world, 2)
    assert b.state == "admitted" and old.container_id in world.runtime.containers
    turn(world)                                   # idle: sweep all but the resident
    assert list(world.runtime.containers) == [b.backend.container_id]
    assert ("remove_all", b.backend.container_id) in world.runtime.calls


def test_a_prepared_container_nobody_loads_is_removed(world):
    old, b = swap_to_b(world)
    world.sched.cancel(b)                         # the stop is decided; its client leaves
    turn(world)                                   # stop a, prepare b
    assert world.sched.phase == IDLE and ("prepare", "b") in world.runtime.calls
    turn(world)                                   # idle
    assert world.runtime.containers == {}


def test_a_container_prepared_for_another_model_is_not_started(world):
    old, b = swap_to_b(world)
    world.sched.cancel(b)
    turn(world)                                   # stop a, prepare b
    t = world.sched.submit("ttl")
    turn(world)
    assert t.state == "admitted" and ("start", "ttl") in world.runtime.calls
    assert list(world.runtime.containers) == [t.backend.container_id]
    assert world.runtime.peak == 1


# ------------------------------------------------------------ Docker's events
def test_a_death_is_noticed_from_dockers_events_and_the_watch_stops_polling(world):
    resume = threading.Event()

    def sleep(seconds):                           # the follower waits here after a break
        resume.wait(5)
        resume.clear()
    world.driver._sleep = sleep
    a = world.sched.submit("a")
    turn(world)
    world.sched.release(a)
    threading.Thread(target=world.driver.follow_deaths, daemon=True).start()
    wait_until(lambda: world.driver.following, "subscribed")
    polled = world.runtime.inspections            # one look when it subscribed
    turn(world, 3)                                # idle turns: no inspection
    assert world.runtime.inspections == polled
    b = world.sched.submit("b")                   # a swap: the stop's own die event
    turn(world, 2)                                # is no crash
    assert b.state == "admitted" and world.sched.snapshot()["failures"] == {}
    world.sched.release(b)
    world.runtime.kill("b")                       # no watch turn: the event reports it
    wait_until(lambda: world.sched.phase == STOPPING, "crash reported from the event")
    assert world.sched.snapshot()["failures"] == {"b": 1}
    turn(world)                                   # the dead container is removed
    world.runtime.break_events()                  # the engine restarts: back to polling
    wait_until(lambda: not world.driver.following, "the break noticed")
    again = world.sched.submit("a")
    turn(world)
    world.runtime.kill("a")
    turn(world)                                   # the watch inspects again
    assert world.sched.phase == STOPPING and again.state == "admitted"
    resume.set()                                  # the follower subscribes again
    wait_until(lambda: world.driver.following, "subscribed again")
