"""Server metrics: cheap counters on the event loop, Prometheus exposition at scrape time.

A `kvsparse server` always keeps a `ServerMetrics`: plain Python ints in
dicts, updated once per request (and once per table item of a request), never
per key. With ``--metrics-port`` the server also runs Prometheus'
HTTP exposition thread (the ``prometheus-client`` library) with a custom
collector (`ServerCollector`). Nothing is converted to Prometheus objects
until someone scrapes ``/metrics``: a scrape asks the event loop, through its
wake-up socket, for a snapshot (`SnapshotChannel`), so the tables (which have
no locks of their own) are only ever read on the thread that changes them.

Exported families (``op`` is the wire op name in lower case, e.g.
``pull_sparse``; ``table`` is the key's name):

- ``kvsparse_requests_total{op}``: requests received.
- ``kvsparse_table_requests_total{op,table}``, ``kvsparse_table_keys_total{op,table}``:
  table operations and the keys they carried (a dense pull/push counts 1 key).
- ``kvsparse_request_duration_seconds{op}``: histogram of the time from
  receiving a request to sending its reply (includes waiting for the other
  workers in BSP rounds, SSP pulls and barriers).
- ``kvsparse_errors_total{kind}``: error replies by error class
  (``ProtocolError``, ``ShapeError``, ...).
- ``kvsparse_table_rows{table,kind}``, ``kvsparse_table_bytes{table,kind}``:
  what the shard holds now.
- ``kvsparse_table_<field>{table,kind}``: every other numeric field that
  `kvsparse.shard.state.ShardState.stats` reports for a table: for sparse tables
  ``admissions``, ``evictions``, ``evicted_ttl``, ``evicted_capacity``,
  ``rejected`` (counters, ``_total``) and ``candidates`` (a gauge: ids seen
  but not admitted yet). A field the shard does not report is not exported.
- ``kvsparse_table_tier_<field>{table,kind}``: with a memory budget, each
  sparse table's tier statistics (`kvsparse.shard.state.tier_stats`):
  ``rows_read``, ``row_lookups``, ``disk_hits``, ``evictions`` (rows moved to
  disk), ``bytes_read``, ``bytes_written``, ``bytes_updated``,
  ``gc_segments_freed``, ``gc_bytes_moved``, ``idle_bytes_moved`` (of those, moved
  by merges in the server's idle time), ``compactions`` (counters,
  ``_total``); ``memory_budget``, ``rows_in_memory``, ``rows_on_disk``,
  ``memory_bytes``, ``disk_bytes``, ``disk_index_bytes``, ``hit_rate``,
  ``write_amplification`` (gauges).
- ``kvsparse_memory_budget_bytes``, ``kvsparse_memory_used_bytes``: with a
  memory budget, the shard's budget and what it holds as the budget counts it.
- ``kvsparse_keys_total``, ``kvsparse_uptime_seconds``.

Example:
    $ kvsparse server --bind tcp://127.0.0.1:0 --metrics-port 0
    kvsparse server listening on tcp://127.0.0.1:40123
    kvsparse metrics on http://127.0.0.1:40124/metrics
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable, Optional

from kvsparse import extras

# Seconds; a request on a warm server takes tens of microseconds, a BSP push
# waits for the slowest worker.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# ShardState.stats table fields that only grow (exported as counters; others as gauges).
_COUNTER_FIELDS = frozenset(
    {"admissions", "evictions", "evicted_ttl", "evicted_capacity", "rejected"}
)
# The tier statistics that only grow; the others (rows and bytes held now, ratios) are gauges.
_TIER_COUNTER_FIELDS = frozenset(
    {
        "rows_read",
        "row_lookups",
        "disk_hits",
        "evictions",
        "disk_reads",
        "bytes_read",
        "bytes_written",
        "bytes_updated",
        "gc_segments_freed",
        "gc_bytes_moved",
        "idle_bytes_moved",
        "compactions",
    }
)


class ServerMetrics:
    """Counters a server's event loop updates; plain ints, no locks (one thread writes).

    Threads: not thread-safe; the event loop's thread only (others read
    copies through `SnapshotChannel`).

    Example:
        >>> m = ServerMetrics()
        >>> m.count_table("pull_sparse", 7, 3)
        >>> m.table_ops[("pull_sparse", 7)]
        [1, 3]
    """

    def __init__(self):
        self.requests: dict[str, int] = {}
        self.table_ops: dict[tuple[str, int], list] = {}  # (op, table_id) -> [requests, keys]
        self.errors: dict[str, int] = {}
        # op -> [count per bucket (last: above the largest bound)..., sum of seconds]
        self.latency: dict[str, list] = {}

    def count_request(self, op: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1

    def count_table(self, op: str, table_id: int, keys: int) -> None:
        entry = self.table_ops.get((op, table_id))
        if entry is None:
            self.table_ops[(op, table_id)] = [1, keys]
        else:
            entry[0] += 1
            entry[1] += keys

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def observe(self, op: str, seconds: float) -> None:
        entry = self.latency.get(op)
        if entry is None:
            entry = self.latency[op] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        entry[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        entry[-1] += seconds

    def per_table(self, names: dict) -> dict:
        """{table name: {op: {"requests", "keys"}}}, for the STATS reply."""
        result: dict = {}
        for (op, table_id), (requests, keys) in self.table_ops.items():
            name = names.get(table_id, f"{table_id:#x}")
            result.setdefault(name, {})[op] = {"requests": requests, "keys": keys}
        return result

    def snapshot(self, names: dict, shard_stats: dict) -> dict:
        """Copies of everything, taken on the event loop's thread, for a collector."""
        return {
            "requests": dict(self.requests),
            "table_ops": self.per_table(names),
            "errors": dict(self.errors),
            "latency": {op: list(entry) for op, entry in self.latency.items()},
            "shard": shard_stats,
        }


def table_names(state) -> dict:
    """{table id: name} of every table a ShardState holds: the metrics' table labels.

    Threads: reads the state unlocked; the thread that changes it only.
    """
    names = {table_id: entry.name for table_id, entry in state.sparse.items()}
    names.update((table_id, entry.name) for table_id, entry in state.dense.items())
    return names


class SnapshotChannel:
    """Hands snapshots from the event loop to scraping threads.

    A scraping thread calls `request` (which wakes the loop through `wake`
    and waits); the loop calls `answer` whenever it wakes up.

    Threads: request() may be called from several threads at once; answer()
    from the event loop's thread only.
    """

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._lock = threading.Lock()
        self._waiting: list[tuple[threading.Event, list]] = []

    def request(self, timeout: float = 5.0) -> Optional[dict]:
        """The loop's next snapshot, or None if it did not answer within timeout seconds."""
        event, box = threading.Event(), []
        with self._lock:
            self._waiting.append((event, box))
        self._wake()
        if event.wait(timeout):
            return box[0]
        with self._lock:
            if (event, box) in self._waiting:
                self._waiting.remove((event, box))
        return box[0] if box else None

    def answer(self, make_snapshot: Callable[[], dict]) -> None:
        """Gives every waiting request one fresh snapshot (call on the loop's thread)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        snapshot = make_snapshot()
        for event, box in waiting:
            box.append(snapshot)
            event.set()


class ServerCollector:
    """A prometheus_client collector that turns a server snapshot into metric families.

    Args:
        channel: where to get snapshots (`SnapshotChannel`).
        timeout: seconds a scrape waits for the event loop.

    Threads: collect() may run on several scraping threads at once.
    """

    def __init__(self, channel: SnapshotChannel, timeout: float = 5.0):
        self.channel = channel
        self.timeout = timeout
        self.started = time.monotonic()

    def describe(self):
        return []  # families depend on the data: no up-front description

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        yield GaugeMetricFamily(
            "kvsparse_uptime_seconds",
            "Seconds since the metrics endpoint started",
            value=time.monotonic() - self.started,
        )
        snap = self.channel.request(self.timeout)
        up = GaugeMetricFamily(
            "kvsparse_event_loop_up", "1 if the event loop answered this scrape in time"
        )
        up.add_metric([], 0.0 if snap is None else 1.0)
        yield up
        if snap is None:
            return

        def counter_by(name: str, help_text: str, label: str, counts: dict):
            family = CounterMetricFamily(name, help_text, labels=[label])
            for value, count in sorted(counts.items()):
                family.add_metric([value], count)
            return family

        yield counter_by("kvsparse_requests", "Requests received, by op", "op", snap["requests"])

        table_requests = CounterMetricFamily(
            "kvsparse_table_requests",
            "Table operations (one per table per request), by op and table",
            labels=["op", "table"],
        )
        table_keys = CounterMetricFamily(
            "kvsparse_table_keys",
            "Keys carried by table operations (a dense pull or push counts 1), by op and table",
            labels=["op", "table"],
        )
        for table, ops in sorted(snap["table_ops"].items()):
            for op, counts in sorted(ops.items()):
                table_requests.add_metric([op, table], counts["requests"])
                table_keys.add_metric([op, table], counts["keys"])
        yield table_requests
        yield table_keys

        yield counter_by("kvsparse_errors", "Error replies, by error class", "kind", snap["errors"])

        latency = HistogramMetricFamily(
            "kvsparse_request_duration_seconds",
            "Seconds from receiving a request to sending its reply, by op",
            labels=["op"],
        )
        for op, entry in sorted(snap["latency"].items()):
            buckets, cumulative = [], 0
            for bound, count in zip(LATENCY_BUCKETS, entry):
                cumulative += count
                buckets.append((repr(bound), cumulative))
            cumulative += entry[len(LATENCY_BUCKETS)]
            buckets.append(("+Inf", cumulative))
            latency.add_metric([op], buckets, sum_value=entry[-1])
        yield latency

        shard = snap["shard"]
        keys = CounterMetricFamily("kvsparse_keys", "Keys served by this shard (all tables)")
        keys.add_metric([], shard.get("keys", 0))
        yield keys
        memory = shard.get("memory")
        if memory is not None:
            for field, help_text in (
                ("budget", "Bytes this shard may hold in memory (--memory-budget)"),
                ("used", "Bytes this shard holds in memory, as its memory budget counts them"),
            ):
                gauge = GaugeMetricFamily(f"kvsparse_memory_{field}_bytes", help_text)
                gauge.add_metric([], memory.get(field, 0))
                yield gauge
        yield from _table_families(shard.get("tables", {}))
        yield from _tier_families(shard.get("tables", {}))


def _table_families(tables: dict):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: dict = {}
    for name, table in sorted(tables.items()):
        kind = str(table.get("kind", ""))
        for field, value in table.items():
            if field == "kind" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            family = families.get(field)
            if family is None:
                help_text = {
                    "rows": "Rows (sparse) or values (dense) this shard holds, by table",
                    "bytes": "Bytes this shard holds, by table (values and optimizer slots)",
                }.get(field, f"The shard's '{field}' statistic, by table")
                kind_of_family = (
                    CounterMetricFamily if field in _COUNTER_FIELDS else GaugeMetricFamily
                )
                family = families[field] = kind_of_family(
                    f"kvsparse_table_{_metric_name(field)}", help_text, labels=["table", "kind"]
                )
            family.add_metric([name, kind], value)
    yield from families.values()


def _tier_families(tables: dict):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: dict = {}
    for name, table in sorted(tables.items()):
        tier = table.get("tier")
        if not isinstance(tier, dict):
            continue
        kind = str(table.get("kind", ""))
        for field, value in tier.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            family = families.get(field)
            if family is None:
                kind_of_family = (
                    CounterMetricFamily if field in _TIER_COUNTER_FIELDS else GaugeMetricFamily
                )
                family = families[field] = kind_of_family(
                    f"kvsparse_table_tier_{_metric_name(field)}",
                    f"The disk tier's '{field}' statistic, by table",
                    labels=["table", "kind"],
                )
            family.add_metric([name, kind], value)
    yield from families.values()


def _metric_name(field: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in field.lower())


def start_http_server(channel: SnapshotChannel, port: int = 0, host: str = "127.0.0.1"):
    """Serves ``/metrics`` on host:port from a fresh registry holding one ServerCollector.

    Args:
        channel: the server's snapshot channel.
        port: TCP port; 0 picks a free one.
        host: interface to listen on.

    Returns:
        (httpd, thread, port): stop with ``httpd.shutdown(); httpd.server_close()``.

    Raises:
        MissingDependency: prometheus-client is not installed (an ImportError whose
            message says ``pip install 'kvsparse[serve]'``).
        OSError: the port cannot be bound.

    Example:
        >>> httpd, thread, port = start_http_server(channel, 0)  # doctest: +SKIP
    """
    prometheus = extras.require("prometheus_client", "kvsparse server --metrics-port")
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(channel))
    httpd, thread = prometheus.start_http_server(port, addr=host, registry=registry)
    return httpd, thread, httpd.server_port


__all__ = [
    "LATENCY_BUCKETS",
    "ServerCollector",
    "ServerMetrics",
    "SnapshotChannel",
    "start_http_server",
    "table_names",
]
