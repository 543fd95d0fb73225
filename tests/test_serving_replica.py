"""`kvsparse serve`: real replica processes on 127.0.0.1, driven over ZeroMQ and HTTP.

The HTTP side is driven with `requests` and with `curl`; each test compares
the replica's rows with the training store's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import requests
from conftest import REPO_ROOT, subprocess_env

import kvsparse
from kvsparse import errors, initializers
from kvsparse.server.listening import read_first_line
from kvsparse.serving import Client
from kvsparse.serving.server import HTTP_PREFIX, LISTENING_PREFIX
from kvsparse.wire import protocol
from kvsparse.wire.protocol import Header, Op

START_TIMEOUT = 30.0
CURL = shutil.which("curl")


class Replica:
    """One ``python -m kvsparse serve`` process; stopped by stop()."""

    def __init__(self, checkpoint_dir, *args, http=True):
        self.stderr = tempfile.TemporaryFile()
        argv = [sys.executable, "-m", "kvsparse", "serve", "--checkpoint-dir", str(checkpoint_dir)]
        argv += ["--bind", "tcp://127.0.0.1:0", *args]
        if http:
            argv += ["--http-port", "0"]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self.stderr, env=subprocess_env(), cwd=REPO_ROOT
        )
        deadline = time.monotonic() + START_TIMEOUT
        line = read_first_line(self.process.stdout, deadline).decode()
        if not line.startswith(LISTENING_PREFIX):
            self.stop()
            raise RuntimeError(f"kvsparse serve did not start: {line!r} {self.log()!r}")
        self.address = line[len(LISTENING_PREFIX) :].strip()
        self.url = None
        if http:
            line = read_first_line(self.process.stdout, deadline).decode()
            assert line.startswith(HTTP_PREFIX), line
            self.url = line[len(HTTP_PREFIX) :].strip()

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def health(self) -> dict:
        return requests.get(self.url + "/healthz", timeout=10).json()

    def wait_version(self, seq: int, timeout: float = 20.0) -> dict:
        """Polls /healthz until the replica serves checkpoint seq (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = self.health()
            if (health["version"] or {}).get("seq") == seq:
                return health
            time.sleep(0.02)
        raise AssertionError(f"replica never served {seq}: {self.health()} {self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        return self.process.returncode


@pytest.fixture
def replicas():
    started = []

    def start(*args, **kwargs):
        replica = Replica(*args, **kwargs)
        started.append(replica)
        return replica

    try:
        yield start
    finally:
        for replica in started:
            replica.stop()
            replica.stderr.close()


def _store(num_rows=300):
    kv = kvsparse.create("local")
    kv.init(
        "user",
        kvsparse.SparseTable(dim=6, initializer=initializers.Normal(0.1), seed=11),
    )
    kv.init("item", kvsparse.SparseTable(dim=3, seed=12))
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**62), 2**62, num_rows)
    kv.push("user", (ids, rng.normal(size=(ids.size, 6)).astype(np.float32)))
    kv.push("item", (ids[:50], rng.normal(size=(50, 3)).astype(np.float32)))
    return kv, ids


def _curl(*args) -> bytes:
    return subprocess.run(
        [CURL, "-s", "-S", *args], check=True, capture_output=True, timeout=30
    ).stdout


def test_zmq_http_and_curl_answer_the_store_s_rows(tmp_path, replicas):
    kv, ids = _store()
    kv.save(tmp_path)
    replica = replicas(tmp_path)
    unseen = np.array([[123, 456, 789]], np.int64)
    query = np.concatenate([ids[:9].reshape(3, 3), unseen])  # (4, 3): stored and unseen
    expected = kv.row_sparse_pull("user", row_ids=query)  # unseen ids: their initial rows
    with Client([replica.address]) as client:
        zeros = client.lookup("user", query)
        initial = client.lookup("user", query, default="initializer")
        assert client.last_versions[replica.address] == 1
    assert zeros.shape == (4, 3, 6) and zeros.dtype == np.float32
    np.testing.assert_array_equal(zeros[:3], expected[:3])
    np.testing.assert_array_equal(zeros[3], np.zeros((3, 6), np.float32))
    np.testing.assert_array_equal(initial, expected)

    # HTTP JSON, with a real client: the same rows, bit for bit (float32 -> JSON -> float32).
    answer = requests.post(
        replica.url + "/v1/lookup", json={"table": "user", "ids": query.tolist()}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["shape"] == [4, 3, 6] and body["version"] == 1
    np.testing.assert_array_equal(np.array(body["rows"], np.float32), zeros)
    answer = requests.post(
        replica.url + "/v1/lookup",
        json={"table": "user", "ids": query.tolist(), "default": "initializer"},
        timeout=10,
    )
    np.testing.assert_array_equal(np.array(answer.json()["rows"], np.float32), initial)

    # HTTP raw: little-endian int64 in, float32 out, the shape in a header.
    raw = requests.post(
        replica.url + "/v1/lookup?table=user&shape=4,3",
        data=query.astype("<i8").tobytes(),
        headers={"Content-Type": "application/octet-stream"},
        timeout=10,
    )
    assert raw.status_code == 200, raw.text
    assert raw.headers["X-Kvsparse-Shape"] == "4,3,6"
    assert raw.headers["X-Kvsparse-Version"] == "1"
    np.testing.assert_array_equal(np.frombuffer(raw.content, "<f4").reshape(4, 3, 6), zeros)

    if CURL is None:
        pytest.fail("curl is not installed: the HTTP side must be checked with it too")
    body_file = tmp_path / "ids.bin"
    body_file.write_bytes(query.astype("<i8").tobytes())
    out = _curl(
        "-X",
        "POST",
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        f"@{body_file}",
        replica.url + "/v1/lookup?table=user&default=initializer",
    )
    np.testing.assert_array_equal(np.frombuffer(out, "<f4").reshape(4, 3, 6), initial)
    out = _curl(
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps({"table": "item", "ids": ids[:5].tolist()}),
        replica.url + "/v1/lookup",
    )
    np.testing.assert_array_equal(
        np.array(json.loads(out)["rows"], np.float32), kv.row_sparse_pull("item", row_ids=ids[:5])
    )
    health = json.loads(_curl(replica.url + "/healthz"))
    assert health["status"] == "ok" and health["version"]["seq"] == 1
    assert health["tables"] == {"user": {"dim": 6, "rows": 300}, "item": {"dim": 3, "rows": 50}}
    metrics = _curl(replica.url + "/metrics").decode()
    assert "kvsparse_serving_version 1.0" in metrics
    assert 'kvsparse_serving_lookups_total{transport="zmq"} 2.0' in metrics
    assert 'kvsparse_serving_rows{table="user"} 300.0' in metrics


def _raw_request(address: str, frames: list) -> tuple:
    """Sends frames as is on a DEALER; returns the parsed reply (header, payload)."""
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 10000)
    socket.connect(address)
    try:
        socket.send_multipart(frames)
        return protocol.parse_message(socket.recv_multipart(), reply=True)
    finally:
        socket.close()
        context.term()


def test_a_replica_behind_curvezmq_answers_keyed_clients_only(tmp_path, replicas):
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "kvsparse", "keys", str(keys)],
        check=True,
        capture_output=True,
        env=subprocess_env(),
        timeout=60,
    )
    kv, ids = _store()
    kv.save(tmp_path / "ckpt")
    replica = replicas(tmp_path / "ckpt", "--keys", str(keys), http=False)
    expected = kv.row_sparse_pull("user", row_ids=ids[:5])
    with Client([replica.address], keys=keys) as client:
        np.testing.assert_array_equal(client.lookup("user", ids[:5]), expected)
    # Without keys: refused and named as such, well before the client's timeout.
    started = time.monotonic()
    with Client([replica.address], timeout=30) as keyless:
        with pytest.raises(errors.ServerUnavailable, match="CurveZMQ|security handshake"):
            keyless.lookup("user", ids[:5])
    assert time.monotonic() - started < 25
    # Keys of another job: refused too.
    other = tmp_path / "other"
    subprocess.run(
        [sys.executable, "-m", "kvsparse", "keys", str(other)],
        check=True,
        capture_output=True,
        env=subprocess_env(),
        timeout=60,
    )
    with Client([replica.address], timeout=30, keys=other) as stranger:
        with pytest.raises(errors.ServerUnavailable):
            stranger.lookup("user", ids[:5])
    # The replica goes on serving its clients.
    with Client([replica.address], keys=keys) as client:
        np.testing.assert_array_equal(client.lookup("user", ids[:5]), expected)


def test_bad_requests_get_4xx_or_a_kvsparse_error_and_the_replica_goes_on(tmp_path, replicas):
    kv, ids = _store()
    kv.save(tmp_path)
    replica = replicas(tmp_path, "--max-batch", "100")
    url = replica.url + "/v1/lookup"
    cases = [
        ({"json": {"table": "nope", "ids": [1]}}, 404, "UnknownKey"),
        ({"json": {"table": "user", "ids": [1.5, 2]}}, 400, "KeyTypeError"),
        ({"json": {"table": "user", "ids": ["1"]}}, 400, "KeyTypeError"),
        ({"json": {"table": "user", "ids": [[1, 2], [3]]}}, 400, "KeyTypeError"),
        ({"json": {"table": "user", "ids": [True]}}, 400, "KeyTypeError"),
        ({"json": {"table": "user"}}, 400, "InvalidArgument"),
        ({"json": {"table": "user", "ids": [1], "default": "ones"}}, 400, "InvalidArgument"),
        ({"json": {"table": "user", "ids": list(range(101))}}, 413, "LimitExceeded"),
        ({"json": [1, 2]}, 400, "InvalidArgument"),
        (
            {
                "data": b'{"table": "user", "ids": [1,',
                "headers": {"Content-Type": "application/json"},
            },
            400,
            "InvalidArgument",
        ),
        ({"data": b"12345", "headers": {"Content-Type": "text/plain"}}, 415, "InvalidArgument"),
    ]
    raw = {"Content-Type": "application/octet-stream"}
    cases += [
        ({"data": b"\0" * 12, "headers": raw, "params": {"table": "user"}}, 400, "ShapeError"),
        ({"data": b"\0" * 16, "headers": raw}, 400, "InvalidArgument"),
        (
            {"data": b"\0" * 16, "headers": raw, "params": {"table": "user", "shape": "3"}},
            400,
            "ShapeError",
        ),
        ({"data": b"\0" * 808, "headers": raw, "params": {"table": "user"}}, 413, "LimitExceeded"),
    ]
    for kwargs, status, kind in cases:
        answer = requests.post(url, timeout=10, **kwargs)
        assert answer.status_code == status, (kwargs, answer.text)
        assert answer.json()["error"] == kind, (kwargs, answer.text)
    if CURL is not None:
        out = _curl(
            "-w",
            "%{http_code}",
            "-o",
            "/dev/null",
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "-d",
            "{not json",
            url,
        )
        assert out == b"400"

    # The same over ZeroMQ: the kvsparse error class crosses over.
    with Client([replica.address]) as client:
        with pytest.raises(errors.UnknownKey, match="nope"):
            client.lookup("nope", [1])
        with pytest.raises(errors.KeyTypeError):
            client.lookup("user", [1.5])
        with pytest.raises(errors.LimitExceeded, match="100"):
            client.lookup("user", np.arange(101))
        # A malformed message, and a training server's op, get an error reply.
        header, payload = _raw_request(replica.address, [b"garbage"])
        assert protocol.ERROR_CLASSES[header.status] is errors.ProtocolError
        push = Header(op=Op.PUSH_SPARSE, request_id=1, client_id=1)
        header, payload = _raw_request(replica.address, [push.pack()])
        assert protocol.ERROR_CLASSES[header.status] is errors.ProtocolError
        assert b"serving replica answers LOOKUP" in bytes(payload[0])
        lookup = Header(op=Op.LOOKUP, request_id=2, client_id=1, num_frames=2)
        header, payload = _raw_request(
            replica.address,
            [lookup.pack(), b'{"table":"user","default":"zeros","shape":[2]}', b"1"],
        )
        assert protocol.ERROR_CLASSES[header.status] is errors.ProtocolError
        # ... and the replica goes on serving.
        np.testing.assert_array_equal(
            client.lookup("user", ids[:4]), kv.row_sparse_pull("user", row_ids=ids[:4])
        )
    assert requests.get(replica.url + "/healthz", timeout=10).status_code == 200
    assert replica.process.poll() is None


def test_a_training_server_refuses_serving_ops(server_factory):
    (address,) = server_factory(1)
    header, payload = _raw_request(address, [Header(op=Op.SERVING_STATUS, request_id=1).pack()])
    assert protocol.ERROR_CLASSES[header.status] is errors.ProtocolError
    assert b"kvsparse serve" in bytes(payload[0])


def _constant_store(num_rows: int, dim: int = 8):
    """A table whose pushes replace rows (no optimizer): every row set to one constant."""
    kv = kvsparse.create("local")
    kv.init("emb", kvsparse.SparseTable(dim=dim, optimizer=None, seed=1))
    ids = np.arange(num_rows, dtype=np.int64) * 7919
    return kv, ids


def _set_all(kv, ids, value: float, dim: int = 8):
    kv.push("emb", (ids, np.full((ids.size, dim), value, np.float32)))


def test_follow_applies_each_delta_atomically(tmp_path, replicas):
    num_rows, rounds = 100_000, 6
    kv, ids = _constant_store(num_rows)
    _set_all(kv, ids, 0.0)
    assert kv.save(tmp_path) == 1
    replica = replicas(tmp_path, "--follow", "--poll-interval", "0.02", "--workers", "2")
    replica.wait_version(1)
    seen, problems, done = set(), [], threading.Event()

    def hammer(transport):
        client = Client([replica.address])
        session = requests.Session()
        try:
            while not done.is_set():
                if transport == "zmq":
                    rows = client.lookup("emb", ids)
                    seq = client.last_versions[replica.address]
                else:
                    answer = session.post(
                        replica.url + "/v1/lookup?table=emb",
                        data=ids.astype("<i8").tobytes(),
                        headers={"Content-Type": "application/octet-stream"},
                        timeout=30,
                    )
                    rows = np.frombuffer(answer.content, "<f4")
                    seq = int(answer.headers["X-Kvsparse-Version"])
                values = np.unique(rows)
                # Checkpoint seq k holds the constant k - 1 everywhere.
                if values.size != 1 or values[0] != seq - 1:
                    problems.append((transport, seq, values[:5]))
                seen.add(seq)
        except Exception as exc:  # noqa: BLE001 - reported below
            problems.append((transport, repr(exc)))
        finally:
            client.close()

    threads = [threading.Thread(target=hammer, args=(t,)) for t in ("zmq", "http")]
    for thread in threads:
        thread.start()
    try:
        for seq in range(2, rounds + 2):
            _set_all(kv, ids, float(seq - 1))
            assert kv.save(tmp_path, incremental=True) == seq
            replica.wait_version(seq)
            time.sleep(0.05)  # let the readers see this version too
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
    assert not problems, problems[:5]
    assert len(seen) >= rounds // 2, seen  # the readers saw versions change under them
    health = replica.health()
    assert health["status"] == "ok" and health["version"]["kind"] == "delta"
    metrics = requests.get(replica.url + "/metrics", timeout=10).text
    assert f"kvsparse_serving_version {rounds + 1}.0" in metrics
    assert 'kvsparse_serving_updates_total{kind="delta"} 6.0' in metrics


def test_a_corrupt_delta_is_refused_and_the_old_state_served(tmp_path, replicas):
    kv, ids = _constant_store(1000)
    _set_all(kv, ids, 1.0)
    kv.save(tmp_path)
    _set_all(kv, ids, 2.0)
    kv.save(tmp_path, incremental=True)
    # Hide delta 2 (its manifest) and damage one byte of its rows: a corrupt file arriving.
    manifest = tmp_path / "ckpt-000002.manifest.json"
    hidden = tmp_path.parent / "hidden-manifest.json"
    os.replace(manifest, hidden)
    (shard,) = tmp_path.glob("ckpt-000002.shard-*.kvs")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    replica = replicas(tmp_path, "--follow", "--poll-interval", "0.02")
    # A shard file without its manifest is not a checkpoint: never looked at.
    assert replica.wait_version(1)["status"] == "ok"
    os.replace(hidden, manifest)
    deadline = time.monotonic() + 20
    while replica.health()["last_error"] is None and time.monotonic() < deadline:
        time.sleep(0.02)
    health = replica.health()
    assert health["status"] == "degraded" and health["version"]["seq"] == 1, health
    assert health["last_error"]["seq"] == 2
    assert "checksum mismatch" in health["last_error"]["message"]
    assert shard.name in health["last_error"]["message"]
    with Client([replica.address]) as client:
        np.testing.assert_array_equal(client.lookup("emb", ids), np.ones((ids.size, 8)))
    assert (
        "kvsparse_serving_update_errors_total 1.0"
        in requests.get(replica.url + "/metrics", timeout=10).text
    )
    assert "checkpoint 2 refused" in replica.log()
    # A new full checkpoint heals it.
    _set_all(kv, ids, 3.0)
    assert kv.save(tmp_path) == 3
    health = replica.wait_version(3)
    assert health["status"] == "ok" and health["last_error"] is None
    with Client([replica.address]) as client:
        np.testing.assert_array_equal(client.lookup("emb", ids), np.full((ids.size, 8), 3.0))


def test_replicas_serve_a_table_subset_and_hash_shards(tmp_path, replicas, server_factory):
    kv = kvsparse.create("dist_sparse", servers=server_factory(2))
    kv.init("user", kvsparse.SparseTable(dim=4, initializer=initializers.Uniform(-1, 1), seed=5))
    kv.init("item", kvsparse.SparseTable(dim=2, seed=6))
    ids = np.arange(-500, 500, dtype=np.int64) * 104729
    kv.push("user", (ids, np.ones((ids.size, 4), np.float32)))
    kv.push("item", (ids[:10], np.ones((10, 2), np.float32)))
    kv.save(tmp_path)
    # Three shards from a two-server checkpoint: each replica reads both files, keeps its ids.
    parts = [
        replicas(tmp_path, "--tables", "user", "--shard", f"{i}/3", http=False) for i in range(3)
    ]
    query = np.concatenate([ids, [7, 8, 9]]).reshape(-1, 1)
    expected = kv.row_sparse_pull("user", row_ids=query)
    with Client([p.address for p in parts]) as client:
        np.testing.assert_array_equal(client.lookup("user", query, default="initializer"), expected)
        statuses = client.status()
        rows = [s["tables"]["user"]["rows"] for s in statuses]
        assert sum(rows) == ids.size and min(rows) > 0
        assert all(list(s["tables"]) == ["user"] for s in statuses)
        with pytest.raises(errors.UnknownKey, match="item"):
            client.lookup("item", ids[:3])
    # One shard alone cannot answer for every id.
    with Client([parts[0].address]) as client:
        with pytest.raises(errors.ServerUnavailable, match=r"shard\(s\) \[1, 2\]"):
            client.lookup("user", ids[:3])


def test_freshness_is_recorded_and_exported(tmp_path, replicas):
    kv, ids = _constant_store(10)
    before = time.time()
    _set_all(kv, ids, 1.0)
    after = time.time()
    kv.save(tmp_path)
    manifest = json.loads((tmp_path / "ckpt-000001.manifest.json").read_text())
    assert before <= manifest["newest_push"] <= after
    assert manifest["shards"][0]["newest_push"] == manifest["newest_push"]
    replica = replicas(tmp_path, "--follow")
    health = replica.health()
    assert health["version"]["newest_push"] == manifest["newest_push"]
    assert 0 <= health["freshness_seconds"] < time.time() - before + 1
    metrics = requests.get(replica.url + "/metrics", timeout=10).text
    (line,) = [
        x for x in metrics.splitlines() if x.startswith("kvsparse_serving_freshness_seconds ")
    ]
    assert 0 <= float(line.split()[1]) < time.time() - before + 1


def _thread_nice_values(pid: int) -> list:
    values = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            # After "(comm)": state is field 3, nice field 19 (proc(5)).
            fields = f.read().rsplit(")", 1)[1].split()
        values.append(int(fields[16]))
    return values


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and per-thread nice")
def test_the_follower_thread_alone_runs_at_a_lower_priority(tmp_path, replicas):
    kv, ids = _constant_store(10)
    _set_all(kv, ids, 1.0)
    kv.save(tmp_path)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    replica = replicas(tmp_path, "--follow", "--apply-niceness", "7", http=False)
    deadline = time.monotonic() + 10
    while base + 7 not in _thread_nice_values(replica.process.pid):
        assert time.monotonic() < deadline, _thread_nice_values(replica.process.pid)
        time.sleep(0.02)
    values = _thread_nice_values(replica.process.pid)
    assert values.count(base + 7) == 1 and values.count(base) == len(values) - 1, values
    replica.stop()
    # --apply-niceness 0: every thread at the process's priority.
    replica = replicas(tmp_path, "--follow", "--apply-niceness", "0", http=False)
    with Client([replica.address]) as client:
        np.testing.assert_array_equal(client.lookup("emb", ids), np.ones((ids.size, 8)))
    assert set(_thread_nice_values(replica.process.pid)) == {base}


def test_serve_an_export_and_refuse_bad_directories(tmp_path, replicas):
    kv, ids = _store()
    kv.export(tmp_path / "emb")
    replica = replicas(tmp_path / "emb", http=False)
    with Client(replica.address) as client:
        np.testing.assert_array_equal(
            client.lookup("user", ids[:20]), kv.row_sparse_pull("user", row_ids=ids[:20])
        )
        assert client.status()[0]["version"]["source"] == "export"
    for args in ([tmp_path / "empty"], [tmp_path / "emb", "--follow"]):
        (tmp_path / "empty").mkdir(exist_ok=True)
        result = subprocess.run(
            [sys.executable, "-m", "kvsparse", "serve", "--checkpoint-dir", *map(str, args)],
            capture_output=True,
            env=subprocess_env(),
            cwd=REPO_ROOT,
            timeout=60,
        )
        assert result.returncode == 1
        assert result.stderr.decode().startswith("kvsparse serve: error:"), result.stderr


def test_periodic_saver_bounds_the_chain_and_deletes_old_checkpoints(tmp_path):
    from kvsparse.store.periodic import PeriodicSaver

    kv, ids = _constant_store(20)
    now = [0.0]
    saver = PeriodicSaver(kv, 5.0, keep=2, path=tmp_path, clock=lambda: now[0])
    kinds = []
    for step in range(1, 11):
        _set_all(kv, ids, float(step))
        assert saver.maybe_save() is None  # not due: no save between two due times
        now[0] += 5.0
        seq = saver.maybe_save()
        kinds.append(json.loads((tmp_path / f"ckpt-{seq:06d}.manifest.json").read_text())["kind"])
    # keep=2: two deltas at most on a full checkpoint.
    assert kinds == ["full", "delta", "delta"] * 3 + ["full"]
    # Checkpoints before the previous full one (7) are gone, manifests and shard files.
    left = sorted({int(name[5:11]) for name in os.listdir(tmp_path)})
    assert left == [7, 8, 9, 10]
    with pytest.raises(errors.InvalidArgument):
        PeriodicSaver(kv, 0)
    with pytest.raises(errors.InvalidArgument):
        PeriodicSaver(kv, 1.0, keep=-1)


TRAIN_FOR_SECONDS = r"""
import sys, time
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse")
kv.init("emb", kvsparse.SparseTable(dim=4, optimizer=None))
ids = np.arange(1000, dtype=np.int64)
start, step = time.monotonic(), 0
while time.monotonic() - start < float(sys.argv[1]):
    step += 1
    kv.push("emb", (ids, np.full((ids.size, 4), step, np.float32)))
    time.sleep(0.01)
print("steps", step)
"""


def test_launch_save_every_feeds_a_following_replica(tmp_path, replicas):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_FOR_SECONDS)
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    # Started before the first checkpoint exists: it serves once one arrives.
    replica = replicas(checkpoints, "--follow", "--poll-interval", "0.05")
    assert requests.get(replica.url + "/healthz", timeout=10).status_code == 503
    command = [sys.executable, "-m", "kvsparse", "launch", "--checkpoint-dir", str(checkpoints)]
    command += ["--save-every", "0.4", "--keep", "2", "--", sys.executable, str(script), "4"]
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), cwd=tmp_path
    )
    seqs, freshness, values = set(), [], []
    with Client([replica.address]) as client:
        deadline = time.monotonic() + 60
        while job.poll() is None and time.monotonic() < deadline:
            health = replica.health()
            if health["version"] is not None:
                seqs.add(health["version"]["seq"])
                freshness.append(health["freshness_seconds"])
                rows = client.lookup("emb", np.arange(1000))
                values.append(np.unique(rows).size)
            time.sleep(0.05)
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err.decode()
    assert len(seqs) >= 4, seqs  # it followed the saves as they came
    assert max(freshness) < 0.4 + 2.0, freshness  # the bound: interval + 2 s
    assert set(values) == {1}  # every answer one step of the job, never a mix
    manifests = sorted(checkpoints.glob("ckpt-*.manifest.json"))
    kinds = [json.loads(m.read_text())["kind"] for m in manifests]
    # --keep 2: chains of at most 1 full + 2 deltas, and only the last two chains kept.
    assert kinds.count("full") <= 2 and kinds[0] == "full", kinds
    assert "delta, delta, delta" not in ", ".join(kinds), kinds


def test_a_replica_serves_a_table_larger_than_its_memory_budget(tmp_path, replicas):
    """`kvsparse serve --memory-budget --spill-dir`: a table 5x the budget is served
    exactly, its cold rows read back from the replica's disk tier."""
    kv = kvsparse.create("local")
    # 1 KiB a row: 40,000 rows are 40 MiB against 8 MiB (4 MiB for each of the replica's
    # two copies, the room for their disk index's next doubling included).
    dim = 256
    kv.init("user", kvsparse.SparseTable(dim=dim, initializer=initializers.Normal(0.1), seed=3))
    ids = np.arange(40_000, dtype=np.int64) * 7919
    rng = np.random.default_rng(4)
    for start in range(0, ids.size, 2000):
        part = ids[start : start + 2000]
        kv.push("user", (part, rng.normal(size=(part.size, dim)).astype(np.float32)))
    kv.save(tmp_path / "ckpt")
    spill = tmp_path / "spill"
    replica = replicas(
        tmp_path / "ckpt", "--memory-budget", "8MiB", "--spill-dir", str(spill), http=False
    )
    assert any(spill.rglob("run-*.kvr")), "the replica's rows did not spill"
    with Client([replica.address]) as client:
        for start in range(0, ids.size, 500):
            part = ids[start : start + 500]
            np.testing.assert_array_equal(
                client.lookup("user", part), kv.row_sparse_pull("user", row_ids=part)
            )
    kv.close()
