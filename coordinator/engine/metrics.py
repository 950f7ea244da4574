"""Prometheus metrics of one coordinator, in its own registry (scraped at /metrics)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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


class _Tallies(Collector):
    """Counters that the event loop adds to as plain integers, exposed as Prometheus counters
    at scrape time: each result costs a report and a verdict, and prometheus_client's
    counters take a lock and check their state on every increment."""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...]) -> None:
        self.name, self.help_text, self.labels = name, help_text, labels
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()

    def collect(self):
        family = CounterMetricFamily(self.name, self.help_text, labels=self.labels)
        for labels, count in sorted(self.counts.items()):
            family.add_metric(labels, count)
        yield family


class Metrics:
    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.results = _Tallies(
            "tilehive_results_reported", "Results reported by hosts, by outcome", ("outcome",)
        )
        self.validations = _Tallies(
            "tilehive_validations",
            "Validation verdicts by method and outcome",
            ("method", "outcome"),
        )
        r.register(self.results)
        r.register(self.validations)
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
        labels() call, and every request meets two (its time and its bytes)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def result(self, outcome: str) -> None:
        self.results.counts[(outcome,)] += 1

    def validation(self, method: str, outcome: str) -> None:
        self.validations.counts[(method, outcome)] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
