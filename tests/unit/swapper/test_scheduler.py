"""The scheduler's policy, driven by hand (no Docker, no threads unless stated)."""
import random
import threading

import pytest

from swapper.scheduler import (IDLE, LOADING, READY, STOPPING, Cancelled, LoadFailed,
                               QueueFull, Scheduler)
from tests.support.clock import Clock
from tests.support.scheduler import step


def make(slots=None, max_queue=64, clock=None):
    slots = slots or {}
    return Scheduler(lambda m: slots.get(m, 1), max_queue=max_queue,
                     backoff_base=1.0, backoff_max=8.0, clock=clock or Clock())


def admitted(*tickets):
    return [t.state == "admitted" for t in tickets]


def test_first_request_loads_then_admits():
    s = make()
    t = s.submit("a")
    assert (s.phase, s.model) == (LOADING, "a")
    assert t.state == "waiting"
    a = step(s)
    assert (a.kind, a.model) == ("load", "a")
    assert t.state == "admitted" and t.backend == "backend-a"
    assert s.phase == READY


def test_slots_limit_concurrency_fifo():
    s = make(slots={"a": 2})
    ts = [s.submit("a") for _ in range(4)]
    step(s)
    assert admitted(*ts) == [True, True, False, False]
    s.release(ts[1])
    assert admitted(*ts) == [True, False, True, False]   # FIFO: the third goes next
    s.release(ts[0])
    assert ts[3].state == "admitted"


def test_concurrent_requests_join_the_load():
    s = make(slots={"a": 8})
    t1 = s.submit("a")
    t2 = s.submit("a")
    assert s.next_action(timeout=0).kind == "load"
    t3 = s.submit("a")            # arrives while loading
    assert s.next_action(timeout=0) is None   # no second load
    s.load_done(s.epoch, backend="x")
    assert admitted(t1, t2, t3) == [True, True, True]


def test_swap_drains_then_stops_then_loads():
    s = make()
    a1 = s.submit("a")
    step(s)
    b1 = s.submit("b")
    assert s.phase == READY and s.next_action(timeout=0) is None   # a1 still in flight
    s.release(a1)
    a = step(s)
    assert (a.kind, a.model) == ("stop", "a")
    a = step(s)
    assert (a.kind, a.model) == ("load", "b")
    assert b1.state == "admitted"


def test_grouping_abab_becomes_aabb():
    s = make(slots={"a": 1, "b": 1})
    order = []
    ts = [s.submit(m) for m in "abab"]     # a loads; b a b queue
    step(s)                                 # a ready: a1 admitted
    # a2 joined the load of a (it arrived while a was loading)
    def run_admitted():
        for t in ts:
            if t.state == "admitted" and t not in order:
                order.append(t)
                s.release(t)
                return True
        return False
    while len(order) < 4:
        if not run_admitted():
            step(s)
    assert [t.model for t in order] == ["a", "a", "b", "b"]


def test_no_starvation_new_requests_for_resident_wait_behind_pending_swap():
    s = make(slots={"a": 1})
    a1 = s.submit("a")
    step(s)
    b1 = s.submit("b")
    a2 = s.submit("a")                      # must not jump the queue
    s.release(a1)
    assert a2.state == "waiting"
    step(s)                                 # stop a
    step(s)                                 # load b
    assert b1.state == "admitted" and a2.state == "waiting"
    s.release(b1)
    step(s)                                 # stop b
    step(s)                                 # load a
    assert a2.state == "admitted"


def test_resident_keeps_serving_while_nothing_else_waits():
    s = make(slots={"a": 1})
    t = s.submit("a")
    step(s)
    for _ in range(5):
        s.release(t)
        t = s.submit("a")
        assert t.state == "admitted"
        assert s.next_action(timeout=0) is None


def test_queue_full_is_refused():
    s = make(max_queue=2)
    s.submit("a")
    s.submit("a")
    with pytest.raises(QueueFull):
        s.submit("a")


def test_load_failure_fails_its_epoch_only_and_next_model_loads():
    s = make()
    a1 = s.submit("a")
    b1 = s.submit("b")
    a2 = s.submit("a")
    step(s, fail="boom: exited with code 1")
    for t in (a1, a2):
        with pytest.raises(LoadFailed, match="boom"):
            s.wait(t, 0)
    assert (s.phase, s.model) == (LOADING, "b")
    step(s)
    assert b1.state == "admitted"


def test_cancel_while_queued_leaves_queue_and_unblocks_swap():
    s = make()
    a1 = s.submit("a")
    step(s)
    b1 = s.submit("b")
    a2 = s.submit("a")
    s.cancel(b1)
    with pytest.raises(Cancelled):
        s.wait(b1, 0)
    s.release(a1)
    # No swap: the only waiter is for the resident model.
    assert s.next_action(timeout=0) is None
    assert a2.state == "admitted"


def test_unload_after_drain():
    s = make()
    a1 = s.submit("a")
    step(s)
    u = s.submit(None)
    assert u.state == "waiting"
    s.release(a1)
    assert step(s).kind == "stop"
    assert u.state == "done" and s.phase == IDLE and s.model is None


def test_unload_when_idle_is_immediate():
    s = make()
    u = s.submit(None)
    assert u.state == "done" and s.next_action(timeout=0) is None


def test_crash_reloads_with_backoff_and_success_resets_it():
    s = make(slots={"a": 1})
    a1 = s.submit("a")
    step(s)
    a2 = s.submit("a")                      # waits for the slot
    assert s.crashed("backend-a", "exited with code 137")
    assert s.phase == STOPPING
    step(s)                                 # remove the dead container
    act = s.next_action(timeout=0)          # a2 triggers a reload...
    assert (act.kind, act.model, act.delay) == ("load", "a", 1.0)   # ...after backoff
    s.load_done(act.epoch, backend="b2")
    assert a2.state == "admitted"
    s.release(a1, ok=False)                 # the in-flight one failed
    s.release(a2, ok=True)
    assert s.snapshot()["failures"] == {}
    # crash twice in a row: backoff doubles
    assert not s.crashed("backend-a")       # a report about an earlier backend: ignored
    assert s.crashed("b2")
    step(s)
    s.submit("a")
    assert s.next_action(timeout=0).delay == 1.0
    s.load_done(s.epoch, backend="b3")
    s.crashed("b3")
    step(s)
    s.submit("a")
    assert s.next_action(timeout=0).delay == 2.0


def test_crash_of_a_model_not_resident_is_ignored():
    s = make()
    s.submit("a")
    step(s)
    assert not s.crashed("backend-b")
    assert s.phase == READY


def test_idle_ttl():
    clock = Clock()
    s = make(clock=clock)
    t = s.submit("a")
    step(s)
    clock.now += 100
    assert not s.expire_idle(30)            # in flight: never
    s.release(t)
    clock.now += 29
    assert not s.expire_idle(30)
    clock.now += 2
    assert s.expire_idle(30)
    assert step(s).kind == "stop" and s.phase == IDLE


def test_adopt_makes_model_ready_without_load():
    s = make()
    s.found_resident("a", "adopted")
    t = s.submit("a")
    assert t.state == "admitted" and t.backend == "adopted"
    assert s.next_action(timeout=0) is None


def test_random_interleavings_never_overlap_and_answer_everyone():
    """Many threads, random models, a driver thread with a fake runtime that
    records how many backends 'run' at once: never more than one, and every
    request is answered."""
    rng = random.Random(7)
    s = Scheduler(lambda m: {"a": 2, "b": 1, "c": 3}[m], max_queue=1000)
    running: set[str] = set()
    peak = [0]
    stop = threading.Event()
    lock = threading.Lock()

    def driver():
        while not stop.is_set():
            a = s.next_action(timeout=0.05)
            if a is None:
                continue
            with lock:
                if a.kind == "load":
                    running.add(a.model)
                    peak[0] = max(peak[0], len(running))
                else:
                    running.discard(a.model)
            if a.kind == "load":
                s.load_done(a.epoch, backend=a.model)
            else:
                s.stop_done()

    served = []

    def client(model):
        t = s.submit(model)
        s.wait(t, 30)
        assert t.state == "admitted"
        with lock:
            assert running == {model}, f"{model} admitted while {running} runs"
            served.append(model)
        s.release(t)

    d = threading.Thread(target=driver, daemon=True)
    d.start()
    threads = [threading.Thread(target=client, args=(rng.choice("abc"),)) for _ in range(200)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    stop.set()
    d.join(5)
    assert len(served) == 200
    assert peak[0] == 1


def test_a_stop_names_the_model_that_waits_first():
    """The driver creates that model's container while the old one stops."""
    s = make()
    a = s.submit("a")
    step(s)
    u = s.submit(None)                      # an unload first: nothing to load for it
    b = s.submit("b")
    s.release(a)
    stop = s.next_action(timeout=0)
    assert (stop.kind, stop.model, stop.next_model) == ("stop", "a", "b")
    s.stop_done()
    assert u.state == "done" and s.next_action(timeout=0).model == "b"
    s.load_done(s.epoch, backend="backend-b")
    assert b.state == "admitted"
    s.release(b)
    s.submit(None)
    assert s.next_action(timeout=0).next_model is None   # a plain unload
