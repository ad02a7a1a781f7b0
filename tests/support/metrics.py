"""Scrape a service's /metrics with prometheus_client's own text parser."""
from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, text: str):
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels) -> float:
        """The sum of the samples called `name` whose labels include `labels`
        (0 when there is none)."""
        want = {k: str(v) for k, v in labels.items()}
        return sum(s.value for s in self.samples
                   if s.name == name and want.items() <= s.labels.items())

    def labels(self, name: str, label: str) -> set[str]:
        """The values `label` takes in the samples called `name`."""
        return {s.labels[label] for s in self.samples if s.name == name and label in s.labels}

    def type(self, family: str) -> str | None:
        f = self.families.get(family)
        return f.type if f else None


def scrape(base_url: str, headers: dict | None = None) -> Scrape:
    r = requests.get(base_url + "/metrics", timeout=10, headers=headers)
    r.raise_for_status()
    return Scrape(r.text)


def record_labels(monkeypatch) -> list[tuple[str, tuple]]:
    """Every prometheus_client labels() call from now on, as (metric, values)."""
    from prometheus_client.metrics import MetricWrapperBase
    calls: list[tuple[str, tuple]] = []
    real = MetricWrapperBase.labels

    def labels(self, *values, **kw):
        calls.append((self._name, values))
        return real(self, *values, **kw)

    monkeypatch.setattr(MetricWrapperBase, "labels", labels)
    return calls
