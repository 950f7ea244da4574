"""Prometheus metrics of one coordinator, in its own registry (scraped at /metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class _StateGauges(Collector):
    """Work units, results and hosts by state, read from the live records at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.snapshot = snapshot

    def collect(self):
        status = self.snapshot()
        for name, key, label, help_text in (
            ("tilehive_workunits", "workunits", "state", "Work units in memory by state"),
            ("tilehive_results", "results", "state", "Results in memory by server state"),
            ("tilehive_hosts", "host_states", "state", "Registered hosts by state"),
        ):
            family = GaugeMetricFamily(name, help_text, labels=[label])
            for value, count in sorted(status.get(key, {}).items()):
                family.add_metric([value], count)
            yield family


class Metrics:
    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.results = Counter(
            "tilehive_results_reported",
            "Results reported by hosts, by outcome",
            ["outcome"],
            registry=r,
        )
        self.validations = Counter(
            "tilehive_validations",
            "Validation verdicts by method and outcome",
            ["method", "outcome"],
            registry=r,
        )
        self.bytes = Counter(
            "tilehive_bytes", "Bytes received from and sent to hosts", ["direction"], registry=r
        )
        self.requests = Histogram(
            "tilehive_request_seconds",
            "Time to answer an HTTP request",
            ["endpoint"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.steps = Histogram(
            "tilehive_step_seconds",
            "Duration of a training step",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.loss = Gauge("tilehive_loss", "Training loss of the last step", registry=r)
        self.step = Gauge("tilehive_step", "Last completed training step", registry=r)
        r.register(_StateGauges(snapshot))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def labelled(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus_client checks and locks on every
        labels() call, and a result meets several (each request, report and verdict)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def validation(self, method: str, outcome: str) -> None:
        self.labelled(self.validations, method, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
