"""The swapper's Prometheus series, written through one method per event.

Callers say what happened (`request_done`, `queued`, `rejected`, `load_done`,
`unloaded`, `crashed`); this module alone knows the series, their names and
labels (listed in docs/api.md's metrics table). The swapper is one process, so
there is no multiprocess mode here. Queue depth, in-flight requests and the
resident model are read from the scheduler's snapshot at scrape time.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from common import metrics as common

from .tenants import TenantLabels

# A load that starts within this many seconds of the previous model's stop
# ending is the second half of a swap.
SWAP_GAP = 1.0


class SwapperMetrics:
    def __init__(self, snapshot: Callable[[], dict] | None = None,
                 clock: Callable[[], float] = time.monotonic, tenants: int = 16):
        self.collectors = r = common.new_registry()
        self._clock = clock
        # The tenant label is bounded: the first `tenants` seen, then "other".
        self.tenant_label = TenantLabels(tenants)
        self._tenant_load = Counter(
            "swapper_tenant_load_seconds", "Load seconds charged to each tenant (split "
            "by weight among the tenants whose waiting requests caused the load; the first "
            "METRICS_TENANTS tenants seen by name, later ones as other).", ("tenant",),
            registry=r)
        self._requests = Counter(
            "swapper_requests", "Requests answered, by model and HTTP status.",
            ("model", "status"), registry=r)
        self._queue_wait = Histogram(
            "swapper_queue_wait_seconds", "Seconds a request waited for a slot (loads and "
            "swaps included), by model.", ("model",), buckets=common.DURATION_BUCKETS, registry=r)
        self._rejected = Counter(
            "swapper_rejected", "Requests refused before a slot, by reason.", ("reason",),
            registry=r)
        self._loads = Counter(
            "swapper_loads", "Model loads, by result (ok, failed).", ("model", "result"),
            registry=r)
        self._load_seconds = Histogram(
            "swapper_load_seconds", "Seconds from container start to healthy (successful "
            "loads).", ("model",), buckets=common.LOAD_BUCKETS, registry=r)
        self._unloads = Counter(
            "swapper_unloads", "Backends stopped (swaps, unloads, idle TTL, crashes).",
            ("model",), registry=r)
        self._unload_seconds = Histogram(
            "swapper_unload_seconds", "Seconds to stop and remove a backend.", ("model",),
            buckets=common.LOAD_BUCKETS, registry=r)
        self._swap_seconds = Histogram(
            "swapper_swap_seconds", "Seconds from the start of the resident model's stop "
            "to the next model being ready, by the model swapped in.", ("model",),
            buckets=common.LOAD_BUCKETS, registry=r)
        self._load_causes = Counter(
            "swapper_load_causes", "Loads started, by model and cause (request, operator: "
            "/load or the console, restart: after a crash or a failed load).",
            ("model", "cause"), registry=r)
        self._stops = Counter(
            "swapper_stops", "Backends stopped, by model and cause (swap: drained, nothing "
            "held it; quantum: its sessions were still coming when another model's wait "
            "reached the quantum; operator, unload, idle, crash).", ("model", "cause"),
            registry=r)
        self._holds = Counter(
            "swapper_holds", "Holds while another model waited, by outcome (used: a held "
            "session's next request went first; expired; quantum; broken by other_model, "
            "client_gone, failed).", ("outcome",), registry=r)
        self._crashes = Counter(
            "swapper_crashes", "Backends found dead.", ("model",), registry=r)
        self._mapped = Counter(
            "swapper_models_mapped", "Requests naming no registry model that a "
            "model_patterns entry answered (agents' own tier names), by pattern and the "
            "model used.", ("pattern", "model"), registry=r)
        self._kv_bytes = Counter(
            "swapper_kv_cache_bytes", "Bytes of llama.cpp slot state saved (a backend "
            "stopping) and restored (a backend loaded), by model and direction.",
            ("model", "direction"), registry=r)
        self._kv_tokens = Counter(
            "swapper_kv_cache_tokens", "Prompt tokens in the slots saved and restored, by "
            "model and direction (restored: the prefix the next requests need not prefill).",
            ("model", "direction"), registry=r)
        self._kv_seconds = Histogram(
            "swapper_kv_cache_seconds", "Seconds the save (before a stop) or the restore "
            "(before admission) added, by model and direction.", ("model", "direction"),
            buckets=common.LATENCY_BUCKETS, registry=r)
        self._kv_failures = Counter(
            "swapper_kv_cache_failures", "Slot saves and restores that did not happen, by "
            "direction and reason (timeout, refused, unreachable, incomplete, disk, "
            "mismatch, corrupt, crashed).", ("direction", "reason"), registry=r)
        self._kv_first = Counter(
            "swapper_kv_cache_first_answer_tokens", "Prompt tokens of the first answer after "
            "each restore, by model and prompt (reused: taken from the cache, as "
            "llama-server's timings.cache_n says; processed: prefilled, prompt_n).",
            ("model", "prompt"), registry=r)
        self._swap_phase = Histogram(
            "swapper_swap_phase_seconds", "Seconds of each phase of a swap (stop, save, "
            "start, healthy, restore) and of each restored conversation's first prompt "
            "(reprefill).", ("phase",), buckets=common.LOAD_BUCKETS, registry=r)
        self._kv_disk = Gauge(
            "swapper_kv_cache_disk_bytes", "Bytes of saved slot state on disk (all models).",
            registry=r)
        # The children each request writes, looked up once per label values.
        self._requests_of = common.Children(self._requests)
        self._queue_wait_of = common.Children(self._queue_wait)
        self._lock = threading.Lock()
        self._last_stop: tuple[str, float, float] | None = None   # model, started, ended
        if snapshot is not None:
            r.register(_SchedulerCollector(snapshot, self.tenant_label))

    # ------------------------------------------------------------- requests
    def request_done(self, model: str, status: int | str) -> None:
        """An admitted request ended with this HTTP status (499: client went away)."""
        self._requests_of(model, str(status)).inc()

    def queued(self, model: str, seconds: float) -> None:
        """A request got its slot after waiting `seconds`."""
        self._queue_wait_of(model).observe(seconds)

    def mapped(self, pattern: str, model: str) -> None:
        """A request's model name matched `pattern` and went to `model`."""
        self._mapped.labels(pattern, model).inc()

    def rejected(self, reason: str) -> None:
        """A request was refused before admission (queue_full...)."""
        self._rejected.labels(reason).inc()

    # ------------------------------------------------------------- backends
    def load_done(self, model: str, seconds: float, ok: bool) -> None:
        """A load ended: healthy after `seconds`, or failed."""
        self._loads.labels(model, "ok" if ok else "failed").inc()
        with self._lock:
            stop, self._last_stop = self._last_stop, None
        if not ok:
            return
        self._load_seconds.labels(model).observe(seconds)
        if stop is not None:
            stopped, started, ended = stop
            load_started = self._clock() - seconds
            if stopped != model and load_started - ended <= SWAP_GAP:
                self._swap_seconds.labels(model).observe(self._clock() - started)

    def unloaded(self, model: str, seconds: float) -> None:
        """The backend of `model` was stopped and removed, which took `seconds`."""
        self._unloads.labels(model).inc()
        self._unload_seconds.labels(model).observe(seconds)
        now = self._clock()
        with self._lock:
            self._last_stop = (model, now - seconds, now)

    def scheduler_event(self, event: str, fields: dict) -> None:
        """A scheduler listener: the swap policy's series (causes and holds)."""
        if event == "load_started" and fields.get("cause"):
            self._load_causes.labels(fields["model"], fields["cause"]).inc()
        elif event == "stop":
            self._stops.labels(fields["model"], fields["cause"]).inc()
        elif event == "charged":
            self._tenant_load.labels(self.tenant_label(fields["tenant"])).inc(fields["seconds"])
        elif event in _HOLD_OUTCOMES:
            self._holds.labels(_HOLD_OUTCOMES[event] or fields.get("reason", "broken")).inc()

    def crashed(self, model: str) -> None:
        """The resident backend was found dead."""
        self._crashes.labels(model).inc()

    # ------------------------------------------------------------- kv cache
    def kv_done(self, model: str, direction: str, nbytes: int, tokens: int,
                seconds: float) -> None:
        """Slots of `model` were saved or restored (`direction`)."""
        self._kv_bytes.labels(model, direction).inc(nbytes)
        self._kv_tokens.labels(model, direction).inc(tokens)
        self._kv_seconds.labels(model, direction).observe(seconds)

    def kv_failed(self, direction: str, reason: str) -> None:
        """A slot's save or restore did not happen (the stop or the load went on)."""
        self._kv_failures.labels(direction, reason).inc()

    def kv_first_answer(self, model: str, reused: int, processed: int) -> None:
        """The first answer after a restore of `model` reused and processed these."""
        self._kv_first.labels(model, "reused").inc(reused)
        self._kv_first.labels(model, "processed").inc(processed)

    def swap_phase(self, phase: str, seconds: float) -> None:
        """One phase of a swap took `seconds` (swapper/swaps.py: stop, save, start,
        healthy, restore; reprefill: a restored conversation's first prompt)."""
        self._swap_phase.labels(phase).observe(seconds)

    def kv_disk(self, nbytes: int) -> None:
        self._kv_disk.set(nbytes)

    def response(self):
        return common.response(self.collectors)


_HOLD_OUTCOMES = {"hold_used": "used", "hold_expired": "expired", "quantum_spent": "quantum",
                  "hold_broken": None}       # None: the event's reason


class _SchedulerCollector:
    """Gauges read from the scheduler's snapshot when scraped."""

    def __init__(self, snapshot: Callable[[], dict], tenant_label: Callable[[str], str]):
        self._snapshot = snapshot
        self._tenant_label = tenant_label

    def describe(self):
        return []

    def collect(self):
        snap = self._snapshot()
        yield GaugeMetricFamily("swapper_queue_depth", "Requests waiting for a slot.",
                                value=snap["queued"])
        yield GaugeMetricFamily("swapper_in_flight", "Requests admitted to the backend.",
                                value=snap["in_flight"])
        resident = GaugeMetricFamily(
            "swapper_resident", "1 for the model holding the backend, labelled with its "
            "phase (loading, ready, stopping); no sample when none is.", labels=("model", "phase"))
        if snap.get("model"):
            resident.add_metric((snap["model"], snap["state"]), 1)
        yield resident
        queued = GaugeMetricFamily(
            "swapper_tenant_queued", "Requests waiting for a slot, by tenant (bounded: "
            "see swapper_tenant_load_seconds).", labels=("tenant",))
        by_label: dict[str, int] = {}
        for tenant, row in (snap.get("tenants") or {}).items():
            label = self._tenant_label(tenant)
            by_label[label] = by_label.get(label, 0) + row.get("queued", 0)
        for label, n in sorted(by_label.items()):
            queued.add_metric((label,), n)
        yield queued
