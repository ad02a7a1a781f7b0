"""The metrics modules without servers: multiprocess set-up, label bounds, the
swapper's swap rule (on a fake clock), read back with prometheus_client's parser."""
import os

from common import metrics as common
from swapper.metrics import SwapperMetrics
from tests.support.metrics import Scrape, record_labels
from tests.support.clock import Clock


def _unset(monkeypatch):
    """Unset now, and whatever the test sets is undone at its end."""
    monkeypatch.setenv(common.MULTIPROC_ENV, "")
    monkeypatch.delenv(common.MULTIPROC_ENV)


def test_one_worker_needs_no_multiprocess_dir(monkeypatch):
    _unset(monkeypatch)
    child_exit, cleanup = common.multiprocess_setup(1)
    assert child_exit is None and common.MULTIPROC_ENV not in os.environ
    cleanup()


def test_several_workers_get_a_fresh_dir_removed_at_exit(monkeypatch):
    _unset(monkeypatch)
    child_exit, cleanup = common.multiprocess_setup(2)
    path = os.environ[common.MULTIPROC_ENV]
    assert os.path.isdir(path) and os.listdir(path) == [] and callable(child_exit)
    cleanup()
    assert not os.path.exists(path)


def test_an_operator_dir_is_emptied_of_old_values(monkeypatch, tmp_path):
    (tmp_path / "counter_123.db").write_bytes(b"old")
    (tmp_path / "keep.txt").write_text("not ours")
    monkeypatch.setenv(common.MULTIPROC_ENV, str(tmp_path))
    child_exit, cleanup = common.multiprocess_setup(1)
    assert child_exit is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    cleanup()
    assert tmp_path.exists()


def test_bounded_label():
    label = common.BoundedLabel(limit=2)
    assert [label("a"), label("b"), label("c"), label("a"), label(None)] == \
        ["a", "b", "other", "a", "other"]


def _scrape(m: SwapperMetrics) -> Scrape:
    return Scrape(common.exposition(m.collectors).decode())


def test_swap_is_a_stop_followed_at_once_by_a_load_of_another_model():
    clock = Clock(100.0)
    m = SwapperMetrics(clock=clock)
    m.load_done("a", 5.0, ok=True)                 # first load: no swap
    clock.now = 200.0
    m.unloaded("a", 2.0)                           # stop of a: 198..200
    clock.now = 206.0
    m.load_done("b", 5.5, ok=True)                 # load of b: 200.5..206
    s = _scrape(m)
    assert s.value("swapper_swap_seconds_count", model="b") == 1
    assert s.value("swapper_swap_seconds_sum", model="b") == 8.0
    assert s.value("swapper_swap_seconds_count") == 1
    assert s.value("swapper_loads_total", result="ok") == 2
    assert s.value("swapper_unload_seconds_sum", model="a") == 2.0


def test_not_swaps():
    clock = Clock(100.0)
    m = SwapperMetrics(clock=clock)
    m.unloaded("a", 1.0)                           # crash restart: the same model again
    clock.now += 3
    m.load_done("a", 3.0, ok=True)
    m.unloaded("a", 1.0)                           # /unload, and much later a load
    clock.now += 600
    m.load_done("b", 3.0, ok=True)
    m.unloaded("b", 1.0)                           # a swap whose load failed
    clock.now += 2
    m.load_done("c", 2.0, ok=False)
    s = _scrape(m)
    assert s.value("swapper_swap_seconds_count") == 0
    assert s.value("swapper_loads_total", model="c", result="failed") == 1
    assert s.value("swapper_load_seconds_count", model="c") == 0


def test_scheduler_gauges_read_the_snapshot():
    snap = {"model": "a", "state": "loading", "queued": 3, "in_flight": 1}
    s = _scrape(SwapperMetrics(lambda: snap))
    assert s.value("swapper_queue_depth") == 3 and s.value("swapper_in_flight") == 1
    assert s.value("swapper_resident", model="a", phase="loading") == 1
    snap.update(model=None, state="idle", queued=0, in_flight=0)
    assert _scrape(SwapperMetrics(lambda: snap)).labels("swapper_resident", "model") == set()


def test_request_series_children_are_looked_up_once(monkeypatch):
    """labels() runs once per series, not on every request."""
    looked_up = record_labels(monkeypatch)
    m = SwapperMetrics()
    for status in (200, 200, 502, 200):
        m.queued("a", 0.5)
        m.request_done("a", status)
    assert len(looked_up) == len(set(looked_up))
    s = _scrape(m)
    assert s.value("swapper_requests_total", model="a", status="200") == 3
    assert s.value("swapper_requests_total", model="a", status="502") == 1
    assert s.value("swapper_queue_wait_seconds_count", model="a") == 4
