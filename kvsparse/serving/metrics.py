"""A serving replica's Prometheus metrics (``GET /metrics`` of `kvsparse serve --http-port`).

Families (``transport`` is ``zmq`` or ``http``):

- ``kvsparse_serving_freshness_seconds``: now minus the wall time of the
  newest push the served checkpoint holds (its manifest's ``newest_push``;
  its ``created`` time where the manifest has none). NaN before the first load.
- ``kvsparse_serving_version``: the sequence number of the checkpoint served
  (-1 for an export, NaN before the first load).
- ``kvsparse_serving_lookups_total{transport}``, ``kvsparse_serving_lookup_ids_total{transport}``:
  lookups answered and the ids they held.
- ``kvsparse_serving_lookup_errors_total{transport,kind}``: requests refused, by error class.
- ``kvsparse_serving_lookup_seconds{transport}``: histogram, request received to reply ready.
- ``kvsparse_serving_updates_total{kind}``: checkpoints applied (``full``, ``delta``, ``export``).
- ``kvsparse_serving_update_errors_total``: checkpoints refused (corrupt, missing...).
- ``kvsparse_serving_update_seconds``: histogram of the time to apply one update (both copies).
- ``kvsparse_serving_rows{table}``: rows held per table.

Thread-safe: prometheus_client's metrics are; `freshness` reads the state.
prometheus-client is optional (``pip install 'kvsparse[serve]'``): without it a
replica without HTTP uses `NoMetrics`.
"""

from __future__ import annotations

import math
import time

from kvsparse import extras
from kvsparse.serving.state import ServingState

# prometheus-client is optional (the serve extra): imported by ServingMetrics, so that
# `kvsparse serve` over ZeroMQ runs without it (NoMetrics then counts nothing).
FEATURE = "kvsparse serve's /metrics"

LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
UPDATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def freshness(version: dict | None, now: float | None = None) -> float:
    """Seconds since the newest push the version holds (NaN without a version or a time)."""
    if version is None:
        return math.nan
    stamp = version.get("newest_push")
    if stamp is None:
        stamp = version.get("created")
    if stamp is None:
        return math.nan
    return (time.time() if now is None else now) - float(stamp)


class _StateCollector:
    """Reads the served version and rows at scrape time."""

    def __init__(self, state: ServingState):
        self._state = state

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        described = self._state.describe()
        version = described["version"]
        fresh = GaugeMetricFamily(
            "kvsparse_serving_freshness_seconds",
            "Now minus the wall time of the newest push in the checkpoint served",
        )
        fresh.add_metric([], freshness(version))
        yield fresh
        seq = GaugeMetricFamily(
            "kvsparse_serving_version", "Sequence number of the checkpoint served (-1: an export)"
        )
        if version is None:
            seq.add_metric([], math.nan)
        else:
            seq.add_metric([], -1 if version.get("seq") is None else float(version["seq"]))
        yield seq
        rows = GaugeMetricFamily("kvsparse_serving_rows", "Rows held per table", labels=["table"])
        for name, table in sorted(described["tables"].items()):
            rows.add_metric([name], table["rows"])
        yield rows


class ServingMetrics:
    """The counters and histograms of one serving replica, in their own registry."""

    def __init__(self, state: ServingState):
        """Raises MissingDependency without prometheus-client (`pip install 'kvsparse[serve]'`)."""
        prometheus = extras.require("prometheus_client", FEATURE)
        CollectorRegistry, Counter, Gauge, Histogram = (  # noqa: N806 - prometheus' names
            prometheus.CollectorRegistry,
            prometheus.Counter,
            prometheus.Gauge,
            prometheus.Histogram,
        )
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state))
        r = self.registry
        self.lookups = Counter(
            "kvsparse_serving_lookups", "Lookups answered", ["transport"], registry=r
        )
        self.lookup_ids = Counter(
            "kvsparse_serving_lookup_ids", "Ids looked up", ["transport"], registry=r
        )
        self.lookup_errors = Counter(
            "kvsparse_serving_lookup_errors",
            "Lookup requests refused",
            ["transport", "kind"],
            registry=r,
        )
        self.lookup_seconds = Histogram(
            "kvsparse_serving_lookup_seconds",
            "Time from a lookup request to its reply",
            ["transport"],
            buckets=LOOKUP_BUCKETS,
            registry=r,
        )
        self.updates = Counter(
            "kvsparse_serving_updates", "Checkpoints applied", ["kind"], registry=r
        )
        self.update_errors = Counter(
            "kvsparse_serving_update_errors", "Checkpoints refused", registry=r
        )
        self.update_seconds = Histogram(
            "kvsparse_serving_update_seconds",
            "Time to apply one checkpoint to both copies",
            buckets=UPDATE_BUCKETS,
            registry=r,
        )
        self.info = Gauge(
            "kvsparse_serving_up", "1 while the replica serves", registry=r
        )  # a constant: lets a scrape tell "up, empty" from "down"
        self.info.set(1)

    def looked_up(self, transport: str, ids: int, seconds: float) -> None:
        """Counts one answered lookup."""
        self.lookups.labels(transport).inc()
        self.lookup_ids.labels(transport).inc(ids)
        self.lookup_seconds.labels(transport).observe(seconds)

    def refused(self, transport: str, exc: BaseException) -> None:
        """Counts one refused lookup request."""
        self.lookup_errors.labels(transport, type(exc).__name__).inc()

    def on_update(self, update, seconds_or_error) -> None:
        """`Follower` callback: an update applied (update, seconds) or refused (None, error)."""
        if update is None:
            self.update_errors.inc()
            return
        self.updates.labels(update.version["kind"]).inc()
        self.update_seconds.observe(seconds_or_error)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every family."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class NoMetrics:
    """ServingMetrics' calls, counting nothing: a replica without HTTP and without
    prometheus-client (nothing could read the counts)."""

    def looked_up(self, transport: str, ids: int, seconds: float) -> None:
        """Counts nothing."""

    def refused(self, transport: str, exc: BaseException) -> None:
        """Counts nothing."""

    def on_update(self, update, seconds_or_error) -> None:
        """Counts nothing."""


__all__ = ["CONTENT_TYPE", "FEATURE", "NoMetrics", "ServingMetrics", "freshness"]
