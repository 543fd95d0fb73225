"""CLI and error messages: one line, the right class, the real flag."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import zmq
from conftest import REPO_ROOT, ServerProcess, subprocess_env

import kvsparse
from kvsparse import errors
from kvsparse.server.server import Server


def cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvsparse", *map(str, args)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
        timeout=timeout,
    )


def assert_one_line_error(result, code, *words):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, last


@pytest.fixture
def servers():
    started = []

    def start(*args):
        server = ServerProcess(extra_args=tuple(map(str, args)))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
        server.stderr.close()


needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


# -- kvsparse keys --------------------------------------------------------------------------


@needs_curve
def test_keys_in_an_unwritable_place_is_a_one_line_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = cli("keys", tmp_path / "a-file" / "keys")
    assert_one_line_error(result, 1, "kvsparse keys: error: cannot write CurveZMQ keys")


@needs_curve
def test_keys_hint_names_the_force_flag(tmp_path):
    assert cli("keys", tmp_path / "k").returncode == 0
    result = cli("keys", tmp_path / "k")
    assert_one_line_error(result, 1, "already exist", "--force")
    assert "pass overwrite" not in result.stderr


# -- kvsparse server ------------------------------------------------------------------------


def test_metrics_port_out_of_range_is_a_usage_error():
    result = cli("server", "--metrics-port", 70000)
    assert_one_line_error(result, 2, "--metrics-port", "70000")


def test_server_class_takes_host_port_as_clients_do():
    server = Server("127.0.0.1:0")
    try:
        assert server.address.startswith("tcp://127.0.0.1:")
    finally:
        server.close()
    with pytest.raises(errors.InvalidArgument, match="no valid TCP port"):
        Server("127.0.0.1:70000")
    with pytest.raises(errors.InvalidArgument, match="no valid TCP port"):
        kvsparse.config.ClusterConfig(servers=["127.0.0.1:70000"])


def test_server_command_takes_host_port(servers):
    server = servers("--bind", "127.0.0.1:0")  # ServerProcess passes its own --bind first
    assert server.address.startswith("tcp://127.0.0.1:")


# -- kvsparse --help ------------------------------------------------------------------------


def test_main_help_lists_one_command_a_line():
    result = cli("--help")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    for command in ("launch", "server", "stats", "keys"):
        assert sum(line.split()[:1] == [command] for line in lines) == 1, result.stdout


# -- kvsparse stats -------------------------------------------------------------------------


def test_stats_json_into_a_closed_pipe_exits_quietly(servers):
    server = servers()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvsparse", "stats", "--servers", server.address, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
    )
    process.stdout.close()  # as `| head` does once it has read enough
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    assert b"Traceback" not in stderr and b"BrokenPipeError" not in stderr, stderr


@needs_curve
def test_stats_against_a_curve_server_says_it_needs_keys(servers, tmp_path):
    keys = tmp_path / "keys"
    assert cli("keys", keys).returncode == 0
    server = servers("--keys", keys)
    result = cli("stats", "--servers", server.address, "--json", "--timeout", 5)
    assert result.returncode == 1
    (shard,) = json.loads(result.stdout)["shards"]
    assert shard["problem"] == "needs keys" and "--keys" in shard["error"], shard
    table = cli("stats", "--servers", server.address, "--once", "--timeout", 5)
    assert "needs keys" in table.stdout and "unreachable" not in table.stdout


def test_stats_totals_with_a_dead_shard_are_marked_partial(servers):
    alive, dead = servers(), servers()
    kv = kvsparse.create("dist_sparse", servers=[alive.address, dead.address], timeout=30)
    kv.init("user", kvsparse.SparseTable(dim=2))
    kv.push("user", (np.arange(100), np.ones((100, 2), np.float32)))
    kv.close()
    dead.stop()
    both = f"{alive.address},{dead.address}"
    result = cli("stats", "--servers", both, "--json", "--timeout", 2)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["partial"] is True and report["missing"] == [dead.address]
    assert 0 < report["tables"]["user"]["rows"] < 100
    table = cli("stats", "--servers", both, "--once", "--timeout", 2)
    assert table.returncode == 1
    assert "PARTIAL" in table.stdout and "1 of 2 shards" in table.stdout


# -- errors through the API -----------------------------------------------------------------


def test_distributed_checkpoint_errors_keep_their_class_and_log_no_traceback(servers, tmp_path):
    server = servers()
    (tmp_path / "a-file").write_text("")
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    try:
        kv.init("t", kvsparse.SparseTable(dim=2))
        kv.push("t", (np.arange(4), np.ones((4, 2), np.float32)))
        with pytest.raises(errors.CheckpointError, match="Not a directory"):
            kv.save(str(tmp_path / "a-file" / "ckpt"))
        with pytest.raises(errors.CheckpointError, match="Not a directory"):
            kv.export(str(tmp_path / "a-file" / "export"))
        with pytest.raises(errors.CheckpointError, match="no complete checkpoint"):
            kv.load(str(tmp_path / "nothing"))
        kv.save(str(tmp_path / "good"))
        (shard_file,) = (tmp_path / "good").glob("*.kvs")
        shard_file.write_bytes(shard_file.read_bytes()[:10])
        with pytest.raises(errors.CheckpointError, match="truncated"):
            kv.load(str(tmp_path / "good"))
        assert kv.stats()["shards"][0]["address"]  # still serving (what a failed load leaves
        # in the tables is tested with the checkpoints: a load is all or nothing per store)
    finally:
        kv.close()
    server.stop()
    assert "Traceback" not in server.error_output()


def test_empty_id_lists_are_empty_id_arrays():
    kv = kvsparse.create("local")
    kv.init("t", kvsparse.SparseTable(dim=3))
    assert kv.row_sparse_pull("t", row_ids=[]).shape == (0, 3)
    kv.push("t", ([], np.zeros((0, 3), np.float32)))
    with pytest.raises(errors.DTypeError, match="float64"):  # a float array is still refused
        kv.row_sparse_pull("t", row_ids=np.array([], np.float64))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: kvsparse.optimizers.SGD(lr="0.1"), "learning_rate must be a number"),
        (lambda: kvsparse.optimizers.SGD(learning_rate="0.1"), "learning_rate must be a number"),
        (lambda: kvsparse.optimizers.SGD(lr=-0.1), "learning_rate must be a finite number >= 0"),
        (lambda: kvsparse.optimizers.Adam(learning_rate=-1), "learning_rate"),
        (lambda: kvsparse.optimizers.Adagrad(eps=float("nan")), "eps must be finite"),
        (lambda: kvsparse.optimizers.Adam(beta1=1.5), r"beta1 must be in \[0, 1\)"),
        (lambda: kvsparse.initializers.Normal(0.0, -0.1), "std >= 0"),
        (lambda: kvsparse.initializers.TruncatedNormal(std=-1), "std >= 0"),
        (lambda: kvsparse.initializers.Normal(0.0, "0.1"), "std must be a number"),
        (lambda: kvsparse.initializers.Uniform(1.0, -1.0), "low <= high"),
    ],
)
def test_bad_settings_are_refused_at_construction(make, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        make()


def test_lr_is_another_name_of_learning_rate():
    assert kvsparse.optimizers.SGD(lr=0.5) == kvsparse.optimizers.SGD(learning_rate=0.5)
    assert kvsparse.optimizers.SGD(learning_rate=np.float32(0.5)).to_dict()["learning_rate"] == 0.5
    with pytest.raises(TypeError, match="not both"):
        kvsparse.optimizers.SGD(lr=0.5, learning_rate=0.5)
