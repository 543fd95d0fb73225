"""Servers on Unix sockets (``ipc:///path``): addresses, servers, launch, CurveZMQ and Ray.

Real server processes on socket paths in a short private directory under
/tmp (`socket_dir`): pytest's tmp_path can be longer than the 107 bytes a
Unix socket path may have. Tables built over ipc must be bit for bit those
built over tcp for the same pushes and pulls.
"""

from __future__ import annotations

import io
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest
import zmq
from conftest import REPO_ROOT, ServerProcess, subprocess_env

import kvsparse
from kvsparse import config, errors
from kvsparse.client.remote import ping
from kvsparse.cluster import process as server_process
from kvsparse.cluster.launch import local_cluster

MAX = config.IPC_PATH_MAX_BYTES
JOB_TIMEOUT = 120.0


def cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "kvsparse", *map(str, args)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
        timeout=timeout,
    )


# -- addresses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ipc:///tmp/kvs/server-0", "ipc:///tmp/kvs/server-0"),
        (" IPC:///tmp/a b ", "ipc:///tmp/a b"),
        ("ipc:///" + "a" * (MAX - 1), "ipc:///" + "a" * (MAX - 1)),  # the longest path
        ("ipc:///tmp/" + "é" * ((MAX - 5) // 2), "ipc:///tmp/" + "é" * ((MAX - 5) // 2)),
    ],
)
def test_ipc_addresses_are_accepted_as_given(text, expected):
    assert config.parse_server_address(text) == expected
    assert config.parse_bind_address(text) == expected
    assert config.ipc_path(expected) == expected[len("ipc://") :]


@pytest.mark.parametrize(
    "text, message",
    [
        ("ipc://", "'ipc://' has no socket path"),
        ("ipc://relative/s0", "has a relative socket path 'relative/s0'"),
        ("ipc://@abstract", "has a relative socket path '@abstract'"),
        ("ipc://*", "has a relative socket path"),
        ("ipc:///tmp/a,b", "may not hold a comma"),
        ("ipc:///" + "a" * MAX, f"is {MAX + 1} bytes, longer than the {MAX} bytes"),
        # Bytes, not characters: each 'é' is two bytes in the file system's encoding.
        ("ipc:///tmp/" + "é" * ((MAX - 3) // 2), "longer than the"),
        ("unix:///tmp/s0", "has an unknown scheme 'unix'"),
        ("inproc://s0", "has an unknown scheme 'inproc'"),
        # tcp errors keep their messages.
        ("tcp://h", "is not 'host:port'"),
        ("tcp://h:70000", "has no valid TCP port"),
    ],
)
def test_bad_addresses_name_the_problem(text, message):
    for parse in (config.parse_server_address, config.parse_bind_address):
        with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
            parse(text, "KVSPARSE_SERVERS")


def test_ipc_servers_through_the_environment():
    env = {"KVSPARSE_SERVERS": "ipc:///tmp/kvs/s0, tcp://h:1", "RANK": "1", "WORLD_SIZE": "2"}
    found = config.from_environment(env)
    assert found.servers == ["ipc:///tmp/kvs/s0", "tcp://h:1"]
    assert config.from_environment(found.to_environment()) == found
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_SERVERS: 'ipc://s0' has a relative"):
        config.from_environment({"KVSPARSE_SERVERS": "ipc://s0"})
    # Servers bind their entry as is (no interface to choose for a socket file).
    env = {"KVSPARSE_SERVERS": "ipc:///tmp/kvs/s0,ipc:///tmp/kvs/s1", "KVSPARSE_SERVER_ID": "1"}
    assert config.server_bind_address(env) == "ipc:///tmp/kvs/s1"
    assert config.server_bind_address({"KVSPARSE_BIND": "ipc:///tmp/b"}) == "ipc:///tmp/b"
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_BIND: 'ipc://b' has a relative"):
        config.server_bind_address({"KVSPARSE_BIND": "ipc://b"})
    with pytest.raises(errors.InvalidArgument, match="listed twice"):
        config.ClusterConfig(servers=["ipc:///tmp/s", " ipc:///tmp/s"])


def test_socket_directory_is_private_and_short(tmp_path, monkeypatch):
    directory = server_process.socket_directory()
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        address = server_process.ipc_bind_address(directory, "server-0")
        assert address == "ipc://" + os.path.join(directory, "server-0")
    finally:
        shutil.rmtree(directory)
    # A temporary directory too deep for a socket name: the directory goes under /tmp.
    deep = tmp_path / ("d" * (MAX - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    directory = server_process.socket_directory()
    try:
        assert os.path.dirname(directory) == "/tmp"
    finally:
        shutil.rmtree(directory)
    with pytest.raises(errors.InvalidArgument, match="longer than the"):
        server_process.ipc_bind_address(str(deep), "server-0")


# -- one server -------------------------------------------------------------------------


def test_server_binds_a_socket_and_removes_it_when_it_stops(socket_dir):
    path = os.path.join(socket_dir, "s0")
    server = ServerProcess(bind="ipc://" + path)
    try:
        assert server.first_line.strip() == f"kvsparse server listening on ipc://{path}"
        assert server.address == "ipc://" + path
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert ping(server.address, 10.0)
        # ZeroMQ would bind over a live server's socket and take its workers: refused.
        second = cli("server", "--bind", "ipc://" + path)
        assert second.returncode == 1, second.stderr
        assert "a server already listens on that socket" in second.stderr
        assert ping(server.address, 10.0)
    finally:
        code = server.stop()
        server.stderr.close()
    assert code == 0
    assert not os.path.exists(path)
    assert os.listdir(socket_dir) == []


def test_a_killed_servers_socket_file_does_not_prevent_a_restart(socket_dir):
    path = os.path.join(socket_dir, "s0")
    server = ServerProcess(bind="ipc://" + path)
    server.kill()
    server.stop()
    server.stderr.close()
    assert os.path.exists(path)  # SIGKILL: nobody removed it
    again = ServerProcess(bind="ipc://" + path)
    try:
        assert ping(again.address, 10.0)
    finally:
        assert again.stop() == 0
        again.stderr.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize(
    "bind, message",
    [
        ("ipc://s0", "--bind: 'ipc://s0' has a relative socket path"),
        ("ipc:///" + "a" * MAX, "longer than the"),
        ("udp://h:1", "has an unknown scheme 'udp'"),
    ],
)
def test_server_refuses_a_bad_bind_address(bind, message):
    result = cli("server", "--bind", bind)
    assert result.returncode == 2
    assert message in result.stderr


# -- tables over ipc and tcp ---------------------------------------------------------------


def _train(kv, seed: int) -> list:
    """A fixed random sequence of pulls and pushes on two tables; returns every pulled array."""
    kv.init(
        "adagrad",
        kvsparse.SparseTable(
            dim=8,
            initializer=kvsparse.initializers.Normal(0.0, 0.01),
            optimizer=kvsparse.optimizers.Adagrad(learning_rate=0.1),
        ),
    )
    kv.init(
        "adam",
        kvsparse.SparseTable(dim=4, optimizer=kvsparse.optimizers.Adam(learning_rate=0.01)),
    )
    rng = np.random.default_rng(seed)
    pulled = []
    for _ in range(6):
        for name, dim in (("adagrad", 8), ("adam", 4)):
            ids = rng.integers(0, 400, size=300)  # with repeats
            pulled.append(kv.row_sparse_pull(name, row_ids=ids))
            kv.push(name, (ids, rng.standard_normal((300, dim)).astype(np.float32)))
    for name in ("adagrad", "adam"):
        pulled.append(kv.row_sparse_pull(name, row_ids=np.arange(450)))
    return pulled


def _optimizer_state(kv, path) -> dict:
    """Every key's optimizer slots and steps, rows sorted by id (shards list them in any order)."""
    kv.save_optimizer_states(str(path))
    with np.load(str(path)) as saved:
        arrays = dict(saved)
    state = {}
    for name in [n for n in arrays if n.endswith("_keys")]:
        prefix = name[: -len("keys")]
        order = np.argsort(arrays[name], kind="stable")
        for field in ("keys", "slots", "steps"):
            state[prefix + field] = arrays[prefix + field][order]
    return state


def test_ipc_and_tcp_give_identical_tables(tmp_path):
    results = {}
    for transport in ("tcp", "ipc"):
        with local_cluster(2, transport=transport, stderr=io.StringIO()) as servers:
            assert all(a.startswith(transport + "://") for a in servers), servers
            if transport == "ipc":
                directory = os.path.dirname(config.ipc_path(servers[0]))
                assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
            kv = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1, timeout=60)
            try:
                pulled = _train(kv, seed=7)
                state = _optimizer_state(kv, tmp_path / f"{transport}.npz")
            finally:
                kv.close()
        results[transport] = pulled, state
    assert not os.path.exists(directory)  # local_cluster removed the sockets' directory
    (tcp_pulled, tcp_state), (ipc_pulled, ipc_state) = results["tcp"], results["ipc"]
    assert len(tcp_pulled) == len(ipc_pulled)
    for a, b in zip(tcp_pulled, ipc_pulled):
        np.testing.assert_array_equal(a, b)
    assert sorted(tcp_state) == sorted(ipc_state) and len(tcp_state) == 6
    for name in tcp_state:
        np.testing.assert_array_equal(tcp_state[name], ipc_state[name], err_msg=name)


# -- CurveZMQ ---------------------------------------------------------------------------


@pytest.mark.skipif(not zmq.has("curve"), reason="this pyzmq's libzmq was built without CURVE")
def test_curve_keys_work_over_ipc(tmp_path, socket_dir):
    from kvsparse.wire import security

    keys = str(tmp_path / "keys")
    security.make_keys(keys)
    server = ServerProcess(bind=f"ipc://{socket_dir}/s0", extra_args=("--keys", keys))
    try:
        kv = kvsparse.create(
            "dist_sparse", servers=[server.address], rank=0, num_workers=1, keys=keys, timeout=30
        )
        try:
            assert kv._backend.session.security_mechanism(0) == zmq.CURVE
            kv.init("secure", kvsparse.SparseTable(dim=2))
            kv.push("secure", (np.array([3]), np.ones((1, 2), np.float32)))
            assert kv.row_sparse_pull("secure", row_ids=np.array([3])).shape == (1, 2)
        finally:
            kv.close()
        with pytest.raises(errors.ServerUnavailable, match="requires CurveZMQ keys"):
            kvsparse.create(
                "dist_sparse", servers=[server.address], rank=0, num_workers=1, timeout=30
            )
    finally:
        server.stop()
        server.stderr.close()


# -- kvsparse launch --transport ipc ------------------------------------------------------

TRAIN = """
import os, stat
import numpy as np
import kvsparse

servers = os.environ["KVSPARSE_SERVERS"].split(",")
directory = os.path.dirname(servers[0][len("ipc://"):])
print("transport", sorted({s.split("://")[0] for s in servers}),
      "mode", oct(stat.S_IMODE(os.stat(directory).st_mode)))
kv = kvsparse.create("dist_sparse")
kv.init("emb", kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Zeros()))
kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
ids = np.arange(64)
kv.push("emb", (ids, np.full((64, 4), kv.rank + 1, np.float32)))
kv.barrier()
print("values", sorted(set(kv.row_sparse_pull("emb", row_ids=ids).ravel().tolist())))
print("rows per server", [s["tables"]["emb"]["rows"] for s in kv.stats()["shards"]])
kv.close()
"""

LISTENING_LINE = re.compile(r"server (\d+) \(pid (\d+)\) (?:listening|restarted) on (\S+)")


class Job:
    """A ``python -m kvsparse launch ...`` subprocess; its output lines, as they come."""

    def __init__(self, args, cwd):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvsparse", "launch", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=str(cwd),
            env=subprocess_env(),
            text=True,
        )
        self.lines: list = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            self._queue.put(line)

    def wait_for(self, pattern, timeout=JOB_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                pytest.fail(f"no {pattern!r} within {timeout} s:\n{self.output()}")
            match = re.search(pattern, line)
            if match:
                return match

    def finish(self, timeout=JOB_TIMEOUT) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the launcher did not finish within {timeout} s:\n{self.output()}")
        self._reader.join(10)
        return code

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the launcher stops its children
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def output(self) -> str:
        return "".join(self.lines)

    def servers(self) -> dict:
        """{index: (pid, address)} from the launcher's messages, the latest per server."""
        found = {}
        for line in self.lines:
            match = LISTENING_LINE.search(line)
            if match:
                found[int(match.group(1))] = (int(match.group(2)), match.group(3))
        return found


def test_launch_runs_a_job_over_ipc_and_removes_its_sockets(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = Job(["-s", 2, "-n", 2, "--transport", "ipc", "--", sys.executable, script], tmp_path)
    try:
        code = job.finish()
    finally:
        job.stop()
    output = job.output()
    assert code == 0, output
    for rank in (0, 1):
        assert f"[worker {rank}] transport ['ipc'] mode 0o700" in output
        assert f"[worker {rank}] values [-3.0]" in output
    assert "rows per server" in output
    paths = [config.ipc_path(address) for _, address in job.servers().values()]
    assert len(paths) == 2 and all(paths), output
    assert os.path.dirname(paths[0]) == os.path.dirname(paths[1])
    assert not os.path.exists(os.path.dirname(paths[0])), "the sockets' directory is left"


def test_launch_restarts_a_killed_ipc_server_on_its_socket(tmp_path):
    go = tmp_path / "go"
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, time
            import numpy as np
            import kvsparse

            kv = kvsparse.create("dist_sparse")
            table = kvsparse.SparseTable(
                dim=2,
                initializer=kvsparse.initializers.Zeros(),
                optimizer=kvsparse.optimizers.SGD(learning_rate=1.0),
            )
            kv.init("t", table)
            ids = np.arange(8)
            kv.push("t", (ids, np.ones((8, 2), np.float32)))
            print("ready", flush=True)
            while not os.path.exists({str(go)!r}):
                time.sleep(0.05)
            kv.push("t", (ids, np.ones((8, 2), np.float32)))
            print("after", sorted(set(kv.row_sparse_pull("t", row_ids=ids).ravel().tolist())))
            kv.close()
            """
        )
    )
    args = ["-s", 1, "-n", 1, "--transport", "ipc", "--restart-servers", "--retry-window", 60]
    job = Job([*args, "--", sys.executable, script], tmp_path)
    try:
        job.wait_for(r"\[worker 0\] ready")
        pid, address = job.servers()[0]
        os.kill(pid, signal.SIGKILL)
        restarted = job.wait_for(r"server 0 \(pid \d+\) restarted on (\S+)")
        assert restarted.group(1) == address
        go.touch()
        code = job.finish()
    finally:
        job.stop()
    output = job.output()
    assert code == 0, output
    # No checkpoint: the restarted shard started empty and got the second push only.
    assert "[worker 0] after [-1.0]" in output
    assert not os.path.exists(os.path.dirname(config.ipc_path(address)))


def test_launch_refuses_host_with_ipc_and_an_unknown_transport():
    both = cli("launch", "--transport", "ipc", "--host", "0.0.0.0", "--", sys.executable, "-c", "")
    assert both.returncode == 1
    assert "kvsparse launch: error: host is the interface of tcp servers" in both.stderr
    unknown = cli("launch", "--transport", "udp", "--", sys.executable, "-c", "")
    assert unknown.returncode == 2
    assert "invalid choice: 'udp'" in unknown.stderr


# -- Ray ----------------------------------------------------------------------------------


def test_ray_servers_over_ipc_on_the_drivers_node():
    ray = pytest.importorskip("ray")
    import kvsparse.ray as kvsparse_ray

    with pytest.raises(errors.InvalidArgument, match="transport must be 'tcp' or 'ipc'"):
        kvsparse_ray.start_servers(1, transport="shm")
    with pytest.raises(errors.InvalidArgument, match="host is the interface of tcp servers"):
        kvsparse_ray.start_servers(1, transport="ipc", host="127.0.0.1")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    try:
        group = kvsparse_ray.start_servers(2, transport="ipc", name_prefix="kvsparse-ipc")
        try:
            paths = [config.ipc_path(address) for address in group.addresses]
            assert all(paths), group.addresses
            for path in paths:
                assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
            node = ray.get_runtime_context().get_node_id()
            assert {info["node_id"] for info in group.info()} == {node}
            kv = kvsparse.create("dist_sparse", **group.store_arguments(0, 1))
            try:
                kv.init("t", kvsparse.SparseTable(dim=2, initializer=kvsparse.initializers.Zeros()))
                kv.push("t", (np.arange(10), np.ones((10, 2), np.float32)))
                assert kv.row_sparse_pull("t", row_ids=np.arange(10)).shape == (10, 2)
            finally:
                kv.close()
        finally:
            group.shutdown()
        assert not any(os.path.exists(os.path.dirname(path)) for path in paths)
    finally:
        ray.shutdown()
