"""The downloads as the scheduler sees them (swapper/downloadqueue.py), on their
own: which models miss files, which downloads run (and park their requests),
the downloader's jobs in order, and the progress it reports."""
import threading

from swapper.downloadqueue import DownloadQueue
from swapper.tickets import LoadFailed


def make(now=100.0, resident=None):
    clock = [now]
    events = []
    q = DownloadQueue(threading.Condition(), lambda: clock[0],
                      lambda event, **f: events.append((event, f)), lambda: resident)
    return q, clock, events


def start(q, model):
    with q._cv:                 # the scheduler calls it with its lock held
        q.start(model)


def test_a_missing_model_is_wanted_once_and_parks_its_requests_while_it_runs():
    q, clock, events = make()
    assert not q.wanted("a") and not q.parks("a") and not q.wanted(None)
    q.missing.add("a")
    assert q.wanted("a") and not q.parks("a")
    start(q, "a")
    assert not q.wanted("a") and q.parks("a") and not q.parks("b") and not q.parks(None)
    assert events == [("download_started", {"model": "a"})]
    assert q.status() == {"a": {"model": "a", "done_bytes": 0, "total_bytes": None,
                                "bytes_per_second": None, "eta_seconds": None,
                                "waiting_for": None}}
    clock[0] = 112.5
    q.end("a")
    assert events[-1] == ("downloaded", {"model": "a", "seconds": 12.5, "total_bytes": None})
    assert not q.parks("a") and not q.wanted("a") and q.status() == {}
    q.end("a")
    assert len(events) == 2                         # none runs: nothing told


def test_a_failed_download_leaves_the_model_missing_for_the_next_request():
    q, _, events = make()
    q.missing.add("a")
    start(q, "a")
    q.end("a", LoadFailed("no room", "download_failed"))
    assert q.wanted("a")
    assert events[-1] == ("download_failed", {"model": "a", "error": "no room",
                                              "cause": "download_failed", "seconds": 0.0})
    with q._cv:
        q.asked("a")                                # the next request starts it again
    assert q.parks("a")


def test_missing_files_are_noted_except_the_resident_models():
    q, _, _ = make(resident="a")
    q.mark_missing(["a", "b"])
    assert q.missing == {"b"}


def test_the_downloader_takes_the_jobs_in_order_and_waits_for_one():
    q, _, _ = make()
    assert q.next_job(timeout=0) is None
    got = []
    t = threading.Thread(target=lambda: got.append(q.next_job(timeout=5)))
    t.start()
    with q._cv:
        q.start("a")
        q.start("b")
    t.join(5)
    assert got == ["a"] and q.next_job(timeout=0) == "b"


def test_progress_is_reported_while_the_download_runs_only():
    q, _, events = make()
    q.progress("a", 10, 100)                        # none runs: nothing
    start(q, "a")
    q.progress("a", 40, 100, rate=10.4, eta=5.54)
    q.progress("a", 40, 100, waiting_for="b")
    assert events[1:] == [
        ("download_progress", {"model": "a", "done_bytes": 40, "total_bytes": 100,
                               "bytes_per_second": 10, "eta_seconds": 5.5,
                               "waiting_for": None}),
        ("download_progress", {"model": "a", "done_bytes": 40, "total_bytes": 100,
                               "bytes_per_second": None, "eta_seconds": None,
                               "waiting_for": "b"})]
    assert q.status()["a"]["waiting_for"] == "b"
