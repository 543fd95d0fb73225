"""Prometheus metrics of a live server: /metrics scraped while traffic flows."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
import zmq
from conftest import ServerProcess

import kvsparse
from kvsparse.server.listening import read_first_line
from kvsparse.server.metrics import LATENCY_BUCKETS, ServerMetrics

parser = pytest.importorskip("prometheus_client.parser")

METRICS_LINE = "kvsparse metrics on "


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one scrape."""
    text = urllib.request.urlopen(url, timeout=20).read().decode()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def metrics_server():
    server = ServerProcess(extra_args=("--metrics-port", "0"))
    try:
        line = read_first_line(server.process.stdout, time.monotonic() + 30).decode()
        assert line.startswith(METRICS_LINE), (line, server.error_output())
        url = line[len(METRICS_LINE) :].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert int(url.rsplit(":", 1)[1].split("/")[0]) > 0  # port 0 became a real port
        yield server.address, url
    finally:
        server.stop()
        server.stderr.close()


def test_scraped_counters_move_with_traffic(metrics_server):
    address, url = metrics_server
    before = scrape(url)
    assert value(before, "kvsparse_event_loop_up") == 1.0
    assert value(before, "kvsparse_table_keys_total", op="pull_sparse", table="emb") == 0

    kv = kvsparse.create("dist_sparse", servers=[address], timeout=20)
    try:
        kv.init("emb", kvsparse.SparseTable(dim=4))
        kv.init("w", np.zeros(6, np.float32))
        kv.push("emb", (np.arange(5), np.ones((5, 4), np.float32)))
        kv.row_sparse_pull("emb", row_ids=np.arange(7))
        kv.row_sparse_pull("emb", row_ids=np.array([[1, 2], [3, 100]]))
        kv.pull("w", out=np.zeros(6, np.float32))

        first = scrape(url)
        assert value(first, "kvsparse_table_requests_total", op="pull_sparse", table="emb") == 2
        assert value(first, "kvsparse_table_keys_total", op="pull_sparse", table="emb") == 11
        assert value(first, "kvsparse_table_keys_total", op="push_sparse", table="emb") == 5
        assert value(first, "kvsparse_table_requests_total", op="pull_dense", table="w") == 1
        assert value(first, "kvsparse_requests_total", op="hello") == 1
        assert value(first, "kvsparse_table_rows", table="emb", kind="sparse") == 5
        assert value(first, "kvsparse_table_rows", table="w", kind="dense") == 6
        assert value(first, "kvsparse_table_bytes", table="w", kind="dense") == 24
        assert value(first, "kvsparse_table_bytes", table="emb", kind="sparse") > 0
        count = value(first, "kvsparse_request_duration_seconds_count", op="pull_sparse")
        assert count == 2
        inf = value(first, "kvsparse_request_duration_seconds_bucket", op="pull_sparse", le="+Inf")
        assert inf == 2
        assert value(first, "kvsparse_request_duration_seconds_sum", op="pull_sparse") > 0

        kv.push("emb", (np.arange(10, 13), np.ones((3, 4), np.float32)))
        kv.row_sparse_pull("emb", row_ids=np.arange(4))
        second = scrape(url)
        assert value(second, "kvsparse_table_keys_total", op="pull_sparse", table="emb") == 15
        assert value(second, "kvsparse_table_keys_total", op="push_sparse", table="emb") == 8
        assert value(second, "kvsparse_table_rows", table="emb", kind="sparse") == 8
        assert value(second, "kvsparse_keys_total") > value(first, "kvsparse_keys_total")
        # The same numbers reach KVStore.stats() through the STATS reply.
        ops = kv.stats()["shards"][0]["table_ops"]
        assert ops["emb"]["pull_sparse"] == {"requests": 3, "keys": 15}
    finally:
        kv.close()


def test_error_replies_are_counted_by_kind(metrics_server):
    address, url = metrics_server
    assert value(scrape(url), "kvsparse_errors_total", kind="ProtocolError") == 0
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(b"not a kvsparse header")
        assert sock.poll(20_000), "no error reply"
        sock.recv_multipart()
    finally:
        sock.close(0)
    assert value(scrape(url), "kvsparse_errors_total", kind="ProtocolError") == 1


def test_server_metrics_counts_and_buckets():
    metrics = ServerMetrics()
    metrics.count_table("push_sparse", 1, 4)
    metrics.count_table("push_sparse", 1, 6)
    metrics.observe("push_sparse", LATENCY_BUCKETS[0] / 2)
    metrics.observe("push_sparse", LATENCY_BUCKETS[-1] * 2)
    entry = metrics.latency["push_sparse"]
    assert entry[0] == 1 and entry[len(LATENCY_BUCKETS)] == 1 and sum(entry[:-1]) == 2
    assert metrics.per_table({1: "user"}) == {"user": {"push_sparse": {"requests": 2, "keys": 10}}}
    assert metrics.per_table({}) == {"0x1": {"push_sparse": {"requests": 2, "keys": 10}}}


def test_metrics_port_in_use_is_an_error(tmp_path):
    import socket
    import subprocess
    import sys

    from conftest import REPO_ROOT, subprocess_env

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvsparse.server", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=subprocess_env(),
            cwd=str(REPO_ROOT),
        )
    finally:
        busy.close()
    assert result.returncode == 1
    assert "cannot serve metrics" in result.stderr


def test_admission_and_eviction_counters_are_exported(metrics_server):
    address, url = metrics_server
    kv = kvsparse.create("dist_sparse", servers=[address], timeout=20)
    try:
        kv.init("adm", kvsparse.SparseTable(dim=2, min_count=2, max_rows=3))
        grad = np.ones((4, 2), np.float32)
        kv.push("adm", (np.arange(4), grad))  # seen once: candidates, not rows
        mid = scrape(url)
        assert value(mid, "kvsparse_table_candidates", table="adm", kind="sparse") == 4
        assert value(mid, "kvsparse_table_rows", table="adm", kind="sparse") == 0
        kv.push("adm", (np.arange(4), grad))  # seen twice: admitted, but only 3 fit
        kv.push("adm", (np.arange(10, 14), grad))
        kv.push("adm", (np.arange(10, 14), grad))  # admitting these evicts older rows
        shard = kv.stats()["shards"][0]["tables"]["adm"]
        after = scrape(url)
        for field in ("admissions", "evictions", "rejected"):
            exported = value(after, f"kvsparse_table_{field}_total", table="adm", kind="sparse")
            assert exported == shard[field], field
        assert shard["admissions"] > 0 and shard["evictions"] > 0
    finally:
        kv.close()
