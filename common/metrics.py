"""A minimal Prometheus text-format registry (counters, gauges, summaries).

No dependency: both services expose a handful of series, and the text format
is simple. Thread- and greenlet-safe.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{n}="{esc(v)}"' for n, v in zip(names, values)) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str, labels: Iterable[str] = ()):
        self.name, self.help, self.labelnames = name, help_, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple[str, ...]:
        return tuple(str(labels.get(n, "")) for n in self.labelnames)

    def samples(self) -> list[tuple[str, str, float]]:
        with self._lock:
            return [(self.name, _labels(self.labelnames, k), v) for k, v in sorted(self._values.items())]

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{n}{l} {_num(v)}" for n, l, v in self.samples()]
        return "\n".join(lines)


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels) -> None:
        k = self._key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + amount


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_: str, labels: Iterable[str] = (),
                 func: Callable[[], float] | None = None):
        super().__init__(name, help_, labels)
        self._func = func

    def set(self, value: float, **labels) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)

    def samples(self):
        if self._func is not None:
            return [(self.name, "", float(self._func()))]
        return super().samples()


class Summary(_Metric):
    """Count and sum (seconds, rounds...) per label set."""
    kind = "summary"

    def __init__(self, name: str, help_: str, labels: Iterable[str] = ()):
        super().__init__(name, help_, labels)
        self._counts: dict[tuple[str, ...], int] = {}

    def observe(self, value: float, **labels) -> None:
        k = self._key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + value
            self._counts[k] = self._counts.get(k, 0) + 1

    def samples(self):
        with self._lock:
            out = []
            for k in sorted(self._values):
                l = _labels(self.labelnames, k)
                out.append((f"{self.name}_count", l, self._counts[k]))
                out.append((f"{self.name}_sum", l, self._values[k]))
            return out


class Registry:
    def __init__(self):
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def counter(self, name, help_, labels=()) -> Counter:
        return self.add(Counter(name, help_, labels))

    def gauge(self, name, help_, labels=(), func=None) -> Gauge:
        return self.add(Gauge(name, help_, labels, func))

    def summary(self, name, help_, labels=()) -> Summary:
        return self.add(Summary(name, help_, labels))

    def render(self) -> str:
        return "\n".join(m.render() for m in self._metrics) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
