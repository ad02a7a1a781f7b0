"""Load ETAs from each model's past loads (swapper/loadtimes.py, kept by the
scheduler), the last swap's time, and each request's queue wait: driven by hand
with a fake clock (no Docker, no threads)."""
import json

from swapper.lease import waiting_for
from swapper.loadtimes import HISTORY, LoadTimes
from swapper.scheduler import LoadFailed, Scheduler
from swapper.settings import Settings
from tests.support.clock import Clock


def make(tmp_path=None):
    clock = Clock()
    events = []
    s = Scheduler(lambda m: 1, clock=clock,
                  load_times=LoadTimes(tmp_path / "load-times.json" if tmp_path else None))
    s.listeners.subscribe(lambda e, f: events.append((e, f)))
    return s, clock, events


def remembered(path):
    """What the swapper keeps of each model's loads: the file it reads back at start."""
    return json.loads(path.read_text())["models"]


def load(s, clock, seconds, error=None):
    a = s.next_action(timeout=0)
    assert a.kind == "load"
    clock.now += seconds
    s.load_done(a.epoch, backend=f"b-{a.model}", error=error)
    return a


def stop(s, clock, seconds=0.0):
    a = s.next_action(timeout=0)
    assert a.kind == "stop"
    clock.now += seconds
    s.stop_done()


def test_median_of_the_last_loads_bounded(tmp_path):
    path = tmp_path / "load-times.json"
    lt = LoadTimes(path)
    assert lt.expected("a") is None and lt.remaining("a", 3) is None
    for x in (10, 30, 20):
        lt.add("a", x)
    assert lt.expected("a") == 20
    assert lt.remaining("a", 5) == 15 and lt.remaining("a", 25) == 0
    for x in range(100, 100 + HISTORY):
        lt.add("a", x)
    assert remembered(path) == {"a": list(range(100, 100 + HISTORY))}   # the oldest went
    lt.add("b", -1)
    assert lt.expected("b") is None                          # nonsense is not remembered


def test_persisted_and_read_back(tmp_path):
    path = tmp_path / "state" / "load-times.json"
    lt = LoadTimes(path)
    lt.add("a", 12.5)
    lt.add("a", 14.5)
    assert json.loads(path.read_text()) == {"models": {"a": [12.5, 14.5]}}
    assert LoadTimes(path).expected("a") == 13.5
    assert not [p for p in path.parent.iterdir() if p.name != path.name]   # no temp left


def test_a_bad_file_costs_the_history_only(tmp_path):
    path = tmp_path / "load-times.json"
    path.write_text("{not json")
    assert LoadTimes(path).expected("a") is None
    path.write_text(json.dumps({"models": {"a": ["x", True, 3, -2, 5.0], "b": "no"}}))
    lt = LoadTimes(path)
    assert lt.expected("a") == 4.0 and lt.expected("b") is None
    lt.add("c", 1.0)                                # written back: what was read, and c
    assert remembered(path) == {"a": [3.0, 5.0], "c": [1.0]}
    blocked = tmp_path / "file"
    blocked.write_text("")
    lt = LoadTimes(blocked / "load-times.json")     # its folder is a file: cannot write
    lt.add("a", 1.0)                                # no raise
    assert lt.expected("a") == 1.0                  # in memory still


def test_kept_in_kv_cache_dir_when_there_is_one(tmp_path):
    assert LoadTimes.for_settings(Settings(env={})).path is None
    lt = LoadTimes.for_settings(Settings(KV_CACHE_DIR=str(tmp_path), env={}))
    assert lt.path == tmp_path / "load-times.json"


def test_no_eta_before_a_first_load_then_in_events_status_and_comments(tmp_path):
    s, clock, events = make(tmp_path)
    t = s.submit("a")
    started = [f for e, f in events if e == "load_started"][-1]
    assert "expected_seconds" not in started
    assert s.model_status("a") == {"value": "loading", "elapsed_seconds": 0.0}
    assert "left" not in waiting_for(s.snapshot(), "a")
    load(s, clock, 8.0)
    s.release(t)
    assert remembered(s.load_times.path) == {"a": [8.0]}

    s.submit(None)                   # unload
    stop(s, clock)
    t = s.submit("a")
    started = [f for e, f in events if e == "load_started"][-1]
    assert started["expected_seconds"] == 8.0 and started["eta_seconds"] == 8.0
    assert s.snapshot()["expected_seconds"] == 8.0
    assert waiting_for(s.snapshot(), "a") == "loading model a, ~8 s left"
    clock.now += 3
    assert s.model_status("a") == {"value": "loading", "elapsed_seconds": 3.0,
                                   "expected_seconds": 8.0, "eta_seconds": 5.0}
    s.load_progress(s.epoch, 3.0, "llama_model_loader: loaded meta data")
    progress = [f for e, f in events if e == "progress"][-1]
    assert progress["eta_seconds"] == 5.0 and progress["expected_seconds"] == 8.0
    assert waiting_for(s.snapshot(), "a") == \
        "loading model a (3 s: llama_model_loader: loaded meta data), ~5 s left"
    clock.now += 20                  # slower than ever: 0 left, never negative
    assert s.model_status("a")["eta_seconds"] == 0
    a = s.next_action(timeout=0)
    s.load_done(a.epoch, backend="b-a")
    assert remembered(s.load_times.path) == {"a": [8.0, 23.0]}
    assert s.load_times.expected("a") == 15.5
    assert s.snapshot()["expected_seconds"] is None        # not loading
    assert s.model_status("a") == {"value": "loaded"}
    s.release(t)


def test_a_failed_load_is_not_remembered_nor_the_backoff_before_a_retry(tmp_path):
    s, clock, _ = make(tmp_path)
    s.submit("a")
    load(s, clock, 2.0, error=LoadFailed("boom"))
    assert s.load_times.expected("a") is None and not s.load_times.path.exists()
    s.submit("a")
    a = s.next_action(timeout=0)
    assert a.delay == 1.0                          # backoff_base: waited before the start
    clock.now += a.delay + 4.0
    s.load_done(a.epoch, backend="b-a")
    assert remembered(s.load_times.path) == {"a": [4.0]}


def test_last_swap_time_from_the_stop_to_the_next_ready():
    s, clock, _ = make()
    assert s.snapshot()["last_swap_seconds"] is None
    ta = s.submit("a")
    load(s, clock, 5.0)
    assert s.snapshot()["last_swap_seconds"] is None       # a first load is no swap
    tb = s.submit("b")
    s.release(ta)                                          # drained: a stops
    stop(s, clock, 1.5)
    load(s, clock, 4.0)
    assert s.snapshot()["last_swap_seconds"] == 5.5
    s.release(tb)
    s.submit(None)                                         # an unload, later a load:
    stop(s, clock, 1.0)                                    # no swap
    clock.now += 100
    tc = s.submit("a")
    load(s, clock, 3.0)
    assert s.snapshot()["last_swap_seconds"] == 5.5
    s.release(tc)


def test_a_tickets_queue_wait():
    s, clock, _ = make()
    t1 = s.submit("a")
    assert t1.wait_seconds is None
    load(s, clock, 6.0)
    assert t1.wait_seconds == 6.0                          # it waited for the load
    clock.now += 1
    t2 = s.submit("a")
    assert t2.wait_seconds is None                         # one slot: waits for t1
    clock.now += 2
    s.release(t1)
    assert t2.wait_seconds == 2.0
    clock.now += 1
    s.release(t2)
    t3 = s.submit("a")
    assert t3.wait_seconds == 0.0                          # admitted at once
