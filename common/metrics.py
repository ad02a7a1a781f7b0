"""What both services share about Prometheus metrics (prometheus_client).

Each service builds its series in its own `CollectorRegistry` (a test may run
several apps in one process) and renders it with `exposition()`. A service with
several worker processes (the proxy, `PROXY_WORKERS` > 1) runs prometheus_client's
multiprocess mode: its launcher calls `multiprocess_setup()` before any worker
imports prometheus_client, values then live in files under
`PROMETHEUS_MULTIPROC_DIR`, and `exposition()` merges every worker's files, so a
scrape answers for the service, whichever worker it reaches.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import threading
from typing import Callable

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus_client is imported only inside the functions below: it picks its
# mode once, at import, so a launcher must be able to call multiprocess_setup()
# before anything imports it.

# Bucket sets (seconds unless named otherwise).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
                    1800)
LOAD_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
TOKENS_PER_SECOND_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000)
COUNT_BUCKETS = (0, 1, 2, 3, 5, 10, 20)


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def new_registry():
    """An empty prometheus_client CollectorRegistry for one app's series."""
    from prometheus_client import CollectorRegistry, disable_created_metrics
    disable_created_metrics()      # `_created` series double every counter; nobody reads them
    return CollectorRegistry(auto_describe=True)


def exposition(registry, keep=None) -> bytes:
    """The text format of `registry`, or of every process's files in multiprocess mode;
    `keep(family, labels)`, when given, says which samples are shown."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess, values
    source = registry
    if values.ValueClass is not values.MutexValue:    # the mode chosen when it was imported
        source = CollectorRegistry()
        multiprocess.MultiProcessCollector(source, multiprocess_dir())
    return generate_latest(source if keep is None else _Kept(source, keep))


class _Kept:
    """A registry's families with the samples `keep` allows (generate_latest reads
    anything that has collect(); collect() makes new families on every call)."""

    def __init__(self, source, keep):
        self._source, self._keep = source, keep

    def collect(self):
        for family in self._source.collect():
            family.samples = [s for s in family.samples if self._keep(family.name, s.labels)]
            yield family


def response(registry, keep=None):
    """GET /metrics: a Flask response with the text format (`keep`: exposition's)."""
    from flask import Response
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(exposition(registry, keep), content_type=CONTENT_TYPE_LATEST)


def multiprocess_setup(workers: int) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """For a launcher, before prometheus_client is imported by any worker: with
    more than one worker (or PROMETHEUS_MULTIPROC_DIR set by the operator), point
    PROMETHEUS_MULTIPROC_DIR at an empty folder (a new temporary one unless set).
    Returns (child_exit(pid) for the process manager or None, cleanup())."""
    given = multiprocess_dir()
    if given is None and workers <= 1:
        return None, lambda: None
    if given is None:
        path = tempfile.mkdtemp(prefix="coding-stack-metrics-")
        os.environ[MULTIPROC_ENV] = path

        def cleanup() -> None:
            shutil.rmtree(path, ignore_errors=True)
    else:
        path = given
        os.makedirs(path, exist_ok=True)
        for f in glob.glob(os.path.join(path, "*.db")):   # a previous run's values
            os.remove(f)

        def cleanup() -> None:
            pass

    def child_exit(pid: int) -> None:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid, path)

    return child_exit, cleanup


class Children:
    """A labelled metric's children, each looked up in prometheus_client once.

    `metric.labels(...)` stringifies its values, takes a lock and builds the
    child's key on every call (~2 us each, several per request). The child for
    given values never changes (nothing here removes one), so this keeps them:
    `Children(counter)("a", "b").inc()` counts what `counter.labels("a", "b").inc()`
    counts. The cache holds the same values prometheus_client already holds a
    child for, so it is bounded where the label values are."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric):
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def __call__(self, *values):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class BoundedLabel:
    """Values of a label that comes from outside (a model name in an answer):
    the first `limit` distinct values pass, later ones become `other`, so a client
    cannot grow the series without bound."""

    def __init__(self, limit: int = 64, other: str = "other"):
        self.limit, self.other = limit, other
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        value = (value or "unknown")[:128]
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return self.other
