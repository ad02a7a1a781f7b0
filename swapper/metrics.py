"""The swapper's Prometheus series."""
from __future__ import annotations

from common.metrics import Registry


class SwapperMetrics:
    def __init__(self, snapshot=None):
        r = self.registry = Registry()
        self.requests = r.counter("swapper_requests_total",
                                  "Requests answered, by model and HTTP status.", ("model", "status"))
        self.loads = r.counter("swapper_loads_total", "Model loads, by result.", ("model", "result"))
        self.load_seconds = r.summary("swapper_load_seconds",
                                      "Seconds from container start to healthy.", ("model",))
        self.swaps = r.counter("swapper_unloads_total", "Backends stopped (swaps, unloads, TTL, crashes).",
                               ("model",))
        self.crashes = r.counter("swapper_crashes_total", "Backends found dead.", ("model",))
        self.queue_seconds = r.summary("swapper_queue_seconds",
                                       "Seconds requests waited before admission.", ("model",))
        self.rejected = r.counter("swapper_rejected_total", "Requests refused, by reason.", ("reason",))
        if snapshot is not None:
            r.gauge("swapper_queue_depth", "Requests waiting.", func=lambda: snapshot()["queued"])
            r.gauge("swapper_in_flight", "Requests admitted to the backend.",
                    func=lambda: snapshot()["in_flight"])

    def render(self) -> str:
        return self.registry.render()
