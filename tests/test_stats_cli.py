"""`kvsparse stats`: the table it prints for live servers."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import REPO_ROOT, subprocess_env

import kvsparse
from kvsparse.cli import stats as stats_cli

pytest.importorskip("rich")


def run_stats(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvsparse", "stats", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(env),
        cwd=str(REPO_ROOT),
    )


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


@pytest.fixture(scope="module")
def cluster(module_server_factory):
    servers = module_server_factory(2)
    kv = kvsparse.create("dist_sparse", servers=servers, timeout=30)
    kv.init("user", kvsparse.SparseTable(dim=8))
    kv.init("bias", np.zeros(10, np.float32))
    ids = np.arange(0, 2000, 7)  # 286 ids spread over both shards
    kv.push("user", (ids, np.ones((ids.size, 8), np.float32)))
    kv.row_sparse_pull("user", row_ids=np.arange(50))
    kv.pull("bias", out=np.zeros(10, np.float32))
    try:
        yield servers, kv, ids.size
    finally:
        kv.close()


def test_once_prints_every_shard_and_table(cluster):
    servers, kv, pushed = cluster
    result = run_stats("--servers", ",".join(servers), "--once")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for address in servers:
        assert address in out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    user = [c.strip() for c in lines["user"].split("│")[1:-1]]
    # table, kind, rows, bytes, requests, keys pulled, keys pushed, keys/s
    assert user[:3] == ["user", "sparse", str(pushed)]
    assert user[5] == "50" and user[6] == str(pushed)
    bias = [c.strip() for c in lines["bias"].split("│")[1:-1]]
    assert bias[:4] == ["bias", "dense", "10", "40 B"]

    shard_rows = [
        [c.strip() for c in line.split("│")[1:-1]]
        for line in out.splitlines()
        if any(a in line for a in servers)
    ]
    truth = kv.stats()["shards"]
    assert [r[1] for r in shard_rows] == servers
    for row, shard in zip(shard_rows, truth):
        assert row[3] == f"{sum(t['rows'] for t in shard['tables'].values()):,}"
        assert row[6] == f"{shard['keys']:,}"


def test_json_matches_the_store_and_monitoring_is_not_traffic(cluster):
    servers, kv, pushed = cluster
    before = [s["requests"] for s in kv.stats()["shards"]]
    result = run_stats("--once", "--json", env={"KVSPARSE_SERVERS": ",".join(servers)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tables"]["user"]["rows"] == pushed
    assert report["tables"]["user"]["push_keys"] == pushed
    assert report["tables"]["bias"]["rows"] == 10
    # One kv.stats() request per server in between, none for the monitor's STATS.
    after = [s["requests"] for s in kv.stats()["shards"]]
    assert after == [b + 1 for b in before]
    assert [s["requests"] for s in report["shards"]] == before


def test_a_fresh_server_answers_without_hello(server_factory):
    (address,) = server_factory(1)
    (stats,) = stats_cli.fetch_stats([address], timeout=20)
    assert stats["tables"] == {} and stats["requests"] == 0 and stats["address"] == address


def test_sessions_may_be_used_from_several_threads(cluster):
    """fetch_stats (a session per call) and one backend's session shared by threads."""
    servers, kv, pushed = cluster
    backend = kv._backend  # noqa: SLF001 - its session serializes concurrent exchanges
    results, failures = [], []

    def work():
        try:
            for _ in range(5):
                monitor = stats_cli.fetch_stats(servers, timeout=20)
                worker = backend.stats()
                results.append(
                    (
                        [s["tables"]["user"]["rows"] for s in monitor],
                        [s["tables"]["user"]["rows"] for s in worker],
                    )
                )
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert len(results) == 20
    for monitor_rows, worker_rows in results:
        assert monitor_rows == worker_rows and sum(monitor_rows) == pushed


def test_unreachable_server_is_shown_and_fails(cluster):
    servers, _, _ = cluster
    missing = free_address()
    out = io.StringIO()
    code = stats_cli.main(["--servers", f"{servers[0]},{missing}", "--once", "--timeout", "1"], out)
    assert code == 1
    assert "unreachable" in out.getvalue() and missing in out.getvalue()
    assert servers[0] in out.getvalue()


def test_live_mode_refreshes_count_times(cluster):
    servers, kv, _ = cluster
    out = io.StringIO()
    code = stats_cli.main(
        ["--servers", ",".join(servers), "--count", "2", "--interval", "0.2"], out
    )
    assert code == 0
    assert out.getvalue().count("kvsparse tables") >= 1 and "user" in out.getvalue()


def test_no_server_list_is_a_usage_error():
    result = run_stats("--once")
    assert result.returncode == 2
    assert "kvsparse stats:" in result.stderr and "KVSPARSE_SERVERS" in result.stderr


def test_human_bytes():
    assert stats_cli.human_bytes(0) == "0 B"
    assert stats_cli.human_bytes(1024) == "1.0 KiB"
    assert stats_cli.human_bytes(3 * 1024**3) == "3.0 GiB"


def test_runs_in_a_server_pod_environment(cluster):
    """A server pod has the server list and the worker count but no rank: enough for stats."""
    servers, _, _ = cluster
    env = {"KVSPARSE_SERVERS": ",".join(servers), "KVSPARSE_NUM_WORKERS": "4"}
    assert run_stats("--once", "--json", env=env).returncode == 0
    tf_config = {
        "cluster": {"ps": [s[len("tcp://") :] for s in servers], "worker": ["w0:1", "w1:1"]},
        "task": {"type": "ps", "index": 1},
    }
    result = run_stats("--once", "--json", env={"TF_CONFIG": json.dumps(tf_config)})
    assert result.returncode == 0, result.stderr
    assert [s["address"] for s in json.loads(result.stdout)["shards"]] == servers


def test_live_mode_into_a_pipe_prints_each_refresh_as_plain_lines(cluster):
    # Into a pipe (not a terminal) the live view wrote nothing while it ran, then only its
    # last snapshot: each refresh must come as it happens, with no terminal control codes.
    servers, _, _ = cluster
    process = subprocess.Popen(
        [sys.executable, "-m", "kvsparse", "stats", "--servers", ",".join(servers),
         "--count", "20", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
    )  # fmt: skip
    try:
        lines = []
        for line in process.stdout:  # blocks until the process writes (or ends)
            lines.append(line)
            if sum("kvsparse tables" in seen for seen in lines) >= 2:
                break
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()
    text = "".join(lines)
    assert text.count("kvsparse tables") == 2 and "user" in text
    assert "\x1b" not in text
