"""Prometheus text exposition, by hand (no client library). Per worker process."""
from __future__ import annotations

import threading
from collections import defaultdict

TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ROUND_BUCKETS = (0, 1, 2, 3, 5, 10, 20)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1


def _labels(d: dict) -> str:
    if not d:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)          # (route, method, status) -> n
        self.searches = 0
        self.search_failures = defaultdict(int)   # kind -> n
        self.search_rounds = Histogram(ROUND_BUCKETS)
        self.ttfb = defaultdict(lambda: Histogram(TTFB_BUCKETS))  # route -> hist

    def request(self, route: str, method: str, status: int) -> None:
        with self._lock:
            self.requests[(route, method, str(status))] += 1

    def search(self, failure_kind: str | None) -> None:
        with self._lock:
            self.searches += 1
            if failure_kind:
                self.search_failures[failure_kind] += 1

    def rounds(self, n: int) -> None:
        with self._lock:
            self.search_rounds.observe(n)

    def first_byte(self, route: str, seconds: float) -> None:
        with self._lock:
            self.ttfb[route].observe(seconds)

    def render(self) -> str:
        with self._lock:
            out = [
                "# HELP proxy_requests_total HTTP requests answered, by route, method and status.",
                "# TYPE proxy_requests_total counter",
            ]
            for (route, method, status), n in sorted(self.requests.items()):
                out.append(f"proxy_requests_total{_labels(dict(route=route, method=method, status=status))} {n}")
            out += ["# HELP proxy_searches_total Web searches sent to SearXNG.",
                    "# TYPE proxy_searches_total counter",
                    f"proxy_searches_total {self.searches}",
                    "# HELP proxy_search_failures_total Failed web searches, by kind.",
                    "# TYPE proxy_search_failures_total counter"]
            from .search.searxng import FAILURE_KINDS
            for kind in FAILURE_KINDS:
                out.append(f"proxy_search_failures_total{_labels(dict(kind=kind))} "
                           f"{self.search_failures.get(kind, 0)}")
            out += ["# HELP proxy_search_rounds Search rounds per chat request with web_search.",
                    "# TYPE proxy_search_rounds histogram"]
            out += _hist("proxy_search_rounds", {}, self.search_rounds)
            out += ["# HELP proxy_time_to_first_byte_seconds Time to the first response byte.",
                    "# TYPE proxy_time_to_first_byte_seconds histogram"]
            for route, h in sorted(self.ttfb.items()):
                out += _hist("proxy_time_to_first_byte_seconds", {"route": route}, h)
            return "\n".join(out) + "\n"


def _hist(name: str, labels: dict, h: Histogram) -> list[str]:
    lines = []
    for b, c in zip(h.buckets, h.counts):
        lines.append(f"{name}_bucket{_labels({**labels, 'le': f'{b:g}'})} {c}")
    lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {h.count}")
    lines.append(f"{name}_sum{_labels(labels)} {h.sum:.6f}")
    lines.append(f"{name}_count{_labels(labels)} {h.count}")
    return lines
