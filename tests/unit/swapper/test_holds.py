"""The hold policy (swapper/policy.py) through the scheduler: a model is held
through its agents' turns, for at most a quantum priced by the waiting model's
load; driven by hand on a hand-moved clock (no Docker, no threads)."""
import random

import pytest

from swapper.loadtimes import LoadTimes
from swapper.policy import FIFO, SwapPolicy
from swapper.scheduler import LOADING, READY, STOPPING, LoadFailed, Scheduler
from tests.support.clock import Clock
from tests.support.scheduler import step


def make(clock, policy=None, slots=None, loads=None):
    lt = LoadTimes()
    for m, secs in (loads or {}).items():
        lt.add(m, secs)
    events = []
    s = Scheduler(lambda m: (slots or {}).get(m, 1), clock=clock, load_times=lt,
                  policy=policy or SwapPolicy(hold=10.0, quantum_factor=3.0, quantum_min=5.0,
                                              quantum_max=300.0))
    s.listeners.subscribe(lambda e, f: events.append((e, f)))
    s.events = events
    return s


def ready(s, model, session=None):
    """A request of `session` for `model`, served at once (loading it if needed)."""
    t = s.submit(model, session)
    while t.state == "waiting":
        step(s)
    assert t.state == "admitted"
    return t


def test_a_held_session_goes_before_another_model_within_its_hold():
    clock = Clock()
    s = make(clock, loads={"x": 3, "y": 3})
    a1 = ready(s, "x", "A")
    b1 = s.submit("y", "B")                 # B waits while A runs its tool
    s.release(a1)
    assert (s.phase, s.model) == (READY, "x") and s.next_action(timeout=0) is None
    clock.now += 1.0                        # A's tool call
    a2 = s.submit("x", "A")
    assert a2.state == "admitted" and b1.state == "waiting"
    assert s.snapshot()["hold"] is None     # a request in flight: not a hold that waits
    s.release(a2)
    hold = s.snapshot()["hold"]
    assert hold["sessions"] == 1 and hold["waiting_model"] == "y"
    # A came back after 1 s: its hold is 2 x 1 s + 1 s (the first one was HOLD_SECONDS)
    assert hold["until_seconds"] == 3.0 and hold["quantum_ends_in"] == pytest.approx(8.0)
    assert [e for e, _ in s.events].count("hold_used") == 1


def test_the_hold_ends_after_its_window_and_the_other_model_loads():
    clock = Clock()
    s = make(clock, policy=SwapPolicy(hold=2.0, quantum_min=50.0))
    a1 = ready(s, "x", "A")
    b1 = s.submit("y", "B")
    s.release(a1)
    clock.now += 1.9
    s.tick()
    assert s.phase == READY
    clock.now += 0.2
    a = s.next_action(timeout=0)            # next_action applies the expiry itself
    assert (a.kind, a.model, a.cause) == ("stop", "x", "swap")
    s.stop_done()
    step(s)
    assert b1.state == "admitted"
    assert "hold_expired" in [e for e, _ in s.events]


def test_the_quantum_ends_a_stint_whose_session_keeps_coming_back():
    clock = Clock()
    s = make(clock, loads={"x": 3, "y": 3})     # quantum 3 x 3 s = 9 s
    a = ready(s, "x", "A")
    b1 = s.submit("y", "B")
    served = 0
    for _ in range(20):
        s.release(a)
        clock.now += 1.0
        a = s.submit("x", "A")
        if a.state != "admitted":
            break
        served += 1
        clock.now += 0.3
    assert served == 7                      # 1.3 s a turn within 9 s
    act = s.next_action(timeout=0)
    assert (act.kind, act.model, act.cause) == ("stop", "x", "quantum")
    s.stop_done()
    step(s)
    assert b1.state == "admitted" and a.state == "waiting"
    assert clock.now - b1.queued_at == pytest.approx(9.1 + 0.0, abs=1.5)


def test_a_session_that_asks_for_another_model_releases_its_hold_at_once():
    clock = Clock()
    s = make(clock)
    x1 = ready(s, "x", "aider")
    s.release(x1)                               # a hold, nobody else waits
    y1 = s.submit("y", "aider")                 # the editor model: its own turn moved on
    act = s.next_action(timeout=0)
    assert (act.kind, act.model) == ("stop", "x")
    s.stop_done()
    step(s)
    assert y1.state == "admitted"
    assert ("hold_broken", {"model": "x", "session": "aider", "reason": "other_model"}) \
        in s.events


def test_a_client_that_hangs_up_or_fails_releases_its_hold():
    clock = Clock()
    s = make(clock)
    a1 = ready(s, "x", "A")
    b1 = s.submit("y", "B")
    s.release(a1, ok=False)                     # the request failed: no hold
    assert s.next_action(timeout=0).kind == "stop"
    s.stop_done()
    step(s)
    assert b1.state == "admitted"
    # hang-up of a queued request of a held session
    c = make(Clock())
    a1 = ready(c, "x", "A")
    c.release(a1)
    a2 = c.submit("x", "A")
    c.release(a2)
    b = c.submit("y", "B")
    assert c.next_action(timeout=0) is None      # held
    a3 = c.submit("z", "A2")                     # (another session: changes nothing)
    assert c.next_action(timeout=0) is None
    gone = c.submit("x", "A")
    assert gone.state == "admitted"
    c.cancel(gone)                               # the client left mid-answer
    assert c.next_action(timeout=0).kind == "stop"
    assert b.state == a3.state == "waiting"


def test_operator_load_and_unload_act_at_once():
    clock = Clock()
    s = make(clock)
    a1 = ready(s, "x", "A")
    s.submit("y", "B")
    s.release(a1)
    assert s.next_action(timeout=0) is None     # held for A
    op = s.submit("z", urgent=True)             # /load z
    act = s.next_action(timeout=0)
    assert (act.kind, act.cause, act.next_model) == ("stop", "operator", "z")
    s.stop_done()
    act = s.next_action(timeout=0)
    assert (act.kind, act.model, act.cause) == ("load", "z", "operator")
    s.load_done(act.epoch, backend="bz")
    assert op.state == "admitted"
    # unload
    s2 = make(Clock())
    a1 = ready(s2, "x", "A")
    s2.submit("y", "B")
    s2.release(a1)
    u = s2.submit(None)
    act = s2.next_action(timeout=0)
    assert (act.kind, act.cause) == ("stop", "unload")
    s2.stop_done()
    assert u.state == "done"


def test_fifo_policy_swaps_at_once():
    clock = Clock()
    s = make(clock, policy=SwapPolicy(name=FIFO))
    a1 = ready(s, "x", "A")
    s.submit("y", "B")
    s.release(a1)
    assert s.next_action(timeout=0).kind == "stop"
    assert s.snapshot()["policy"] == "fifo"


def test_a_request_without_a_session_neither_holds_nor_jumps():
    clock = Clock()
    s = make(clock)
    a1 = ready(s, "x")
    b = s.submit("y", "B")
    s.release(a1)
    assert s.next_action(timeout=0).kind == "stop"      # nothing held
    s2 = make(Clock())
    a1 = ready(s2, "x", "A")
    s2.submit("y", "B")
    anon = s2.submit("x")
    assert anon.state == "waiting"                      # behind the waiting model
    assert b.state == "waiting"


def test_the_next_model_is_the_one_that_waited_most_per_second_of_load():
    clock = Clock()
    s = make(clock, loads={"x": 3, "cheap": 2, "dear": 40})
    a1 = ready(s, "x", "A")
    s.submit("dear", "D")
    clock.now += 1
    s.submit("cheap", "C")
    s.release(a1)
    clock.now += 11                                     # A's hold expires
    act = s.next_action(timeout=0)
    assert (act.kind, act.next_model) == ("stop", "cheap")
    s.stop_done()
    assert s.next_action(timeout=0).model == "cheap"


def test_a_request_that_waited_quantum_max_goes_first_whatever_its_cost():
    clock = Clock()
    s = make(clock, policy=SwapPolicy(quantum_max=60.0), loads={"x": 1, "cheap": 1, "dear": 50})
    a1 = ready(s, "x")
    s.submit("dear", "D")
    clock.now += 59
    for _ in range(5):
        s.submit("cheap", "C")
    clock.now += 2
    s.release(a1)
    act = s.next_action(timeout=0)
    assert act.next_model == "dear"


def test_thousands_of_sessions_gain_nothing_beyond_the_quantum():
    clock = Clock()
    s = make(clock, slots={"x": 4}, loads={"x": 2, "y": 2})    # quantum 6 s
    for n in range(1000):                    # sessions that all hold x
        s.release(ready(s, "x", f"s{n}"))
    assert len(s.policy.holds) == s.policy.settings.max_holds
    b = s.submit("y", "B")
    fresh = s.submit("x", "a-new-id-per-request")
    assert fresh.state == "waiting"          # a new id holds nothing
    s.cancel(fresh)
    t0 = clock.now
    n = 0
    while True:
        clock.now += 0.01
        t = s.submit("x", f"s{n % 100}")     # held sessions coming back every 1 s
        n += 1
        if t.state != "admitted":
            break
        s.release(t)
    assert 5.9 <= clock.now - t0 <= 6.0 + 0.02
    act = s.next_action(timeout=0)
    assert (act.kind, act.cause) == ("stop", "quantum")
    s.stop_done()
    step(s)
    assert b.state == "admitted"


def test_a_crash_under_a_hold_drops_it_and_the_next_request_restarts():
    clock = Clock()
    s = make(clock)
    a1 = ready(s, "x", "A")
    s.release(a1)
    b = s.submit("y", "B")
    assert s.crashed("backend-x", "killed")
    assert s.snapshot()["hold"] is None
    s.stop_done()
    act = s.next_action(timeout=0)
    assert act.model == "y"
    s.load_done(act.epoch, backend="by")
    assert b.state == "admitted"


def test_a_failed_load_under_holds_fails_its_epoch_and_the_rest_goes_on():
    clock = Clock()
    s = make(clock)
    a1 = ready(s, "x", "A")
    b = s.submit("y", "B")
    s.release(a1)
    clock.now += 11
    s.tick()
    s.stop_done()
    a = s.next_action(timeout=0)
    a2 = s.submit("x", "A")
    s.load_done(a.epoch, error=LoadFailed("boom"))
    assert b.state == "failed"
    step(s)
    assert a2.state == "admitted"


def test_idle_ttl_still_unloads_a_held_model():
    clock = Clock()
    s = make(clock)
    a1 = ready(s, "x", "A")
    s.release(a1)
    clock.now += 30
    assert s.expire_idle(20)
    assert s.phase == STOPPING


@pytest.mark.parametrize("seed", range(30))
def test_random_mixes_never_starve_and_never_overlap(seed):
    """Many sessions on three models with holds, requests held in flight for
    random times: every request is answered; no request sees more than a few
    loads of other models before its own (no starvation); a model is never
    kept by holds past its quantum; two models are never resident at once."""
    rng = random.Random(seed)
    clock = Clock()
    s = make(clock, slots={"x": 2, "y": 1, "z": 1}, loads={"x": 3, "y": 5, "z": 1},
             policy=SwapPolicy(hold=rng.choice([2.0, 10.0]), quantum_max=40.0))
    waiting, active = [], []
    skipped: dict[int, int] = {}
    answered = 0
    for _ in range(400):
        clock.now += rng.choice([0.0, 0.1, 0.5, 1.0, 3.0])
        r = rng.random()
        if r < 0.35 and len(waiting) + len(active) < 40:
            waiting.append(s.submit(rng.choice("xyz"), rng.choice(["A", "B", "C", "D", None])))
        elif r < 0.7 and active:
            t = active.pop(rng.randrange(len(active)))
            s.release(t, ok=rng.random() > 0.05)
            answered += 1
        else:
            act = s.next_action(timeout=0)
            if act is not None:
                if act.kind == "load":
                    assert s.phase == LOADING
                    for t in waiting:
                        if t.model != act.model:
                            skipped[t.seq] = skipped.get(t.seq, 0) + 1
                            assert skipped[t.seq] <= 4, (t, s.snapshot())
                    clock.now += {"x": 3, "y": 5, "z": 1}[act.model]
                    s.load_done(act.epoch, backend=f"b{act.model}")
                else:
                    assert s.phase == STOPPING
                    s.stop_done()
        for t in list(waiting):
            if t.state == "admitted":
                waiting.remove(t)
                active.append(t)
                assert t.model == s.model and s.phase == READY
        hold = s.snapshot()["hold"]
        if hold is not None:
            assert hold["quantum_ends_in"] <= 40.0 and s.phase == READY
    # drain everything
    for _ in range(2000):
        for t in list(waiting):
            if t.state == "admitted":
                waiting.remove(t)
                active.append(t)
        if active:
            s.release(active.pop())
            answered += 1
        clock.now += 0.5
        act = s.next_action(timeout=0)
        if act is not None:
            (s.load_done(act.epoch, backend="b") if act.kind == "load" else s.stop_done())
        if not waiting and not active:
            break
    assert not waiting and not active


def test_snapshot_counts_the_last_hours_loads_and_their_seconds():
    clock = Clock()
    s = make(clock)
    t = s.submit("x")
    clock.now += 4.0
    step(s)
    s.release(t)
    clock.now += 10
    t = s.submit("y")
    s.tick()
    step(s)                      # stop x
    clock.now += 6.0
    step(s)                      # load y: 6 s
    snap = s.snapshot()
    assert (snap["loads_last_hour"], snap["load_seconds_last_hour"]) == (2, 10.0)
    clock.now += 3601
    snap = s.snapshot()
    assert (snap["loads_last_hour"], snap["load_seconds_last_hour"]) == (0, 0.0)
    assert snap["load_seconds_total"] == 10.0


def test_a_hold_is_priced_by_the_sessions_own_gaps():
    """HOLD_FIRST_SECONDS after a session's first request (a one-shot client
    holds little), then twice the longest of its last gaps plus a second, at
    most HOLD_SECONDS: an agent whose tools take 0.2 s keeps a model 1.4 s after
    its last turn, not 10."""
    clock = Clock()
    s = make(clock)
    t = ready(s, "x", "fast")
    s.release(t)
    assert s.policy.holds["fast"] - clock.now == 3.0      # never came back yet: first_hold
    for _ in range(3):
        clock.now += 0.2
        t = s.submit("x", "fast")
        s.release(t)
    b = s.submit("y", "B")
    assert s.snapshot()["hold"]["until_seconds"] == 1.4
    clock.now += 1.5
    assert s.next_action(timeout=0).kind == "stop"
    assert b.state == "waiting"
    slow = make(Clock())
    t = ready(slow, "x", "slow")
    for gap in (30.0, 1.0):                                # a long gap is capped at the hold
        slow.release(t)
        slow._clock.now += gap
        t = slow.submit("x", "slow")
    slow.release(t)
    assert slow.policy.holds["slow"] - slow._clock.now == 10.0


def test_a_session_already_waiting_for_another_model_gets_no_hold():
    """One client asks for y while its x request runs: when x ends, no hold
    keeps x from y (its turn moved on before x answered)."""
    clock = Clock()
    s = make(clock)
    x = ready(s, "x", "one-client")
    y = s.submit("y", "one-client")
    s.release(x)
    act = s.next_action(timeout=0)
    assert (act.kind, act.model) == ("stop", "x")
    s.stop_done()
    step(s)
    assert y.state == "admitted"
