"""Server limits: what one peer may make a server allocate or touch.

A raw ZeroMQ peer (no kvsparse client) sends pulls and never reads the
replies; the server's resident memory, read from /proc, must stay far below
what the replies would need. CHECKPOINT paths stay inside --checkpoint-root.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq
from conftest import ServerProcess

import kvsparse
from kvsparse import config, errors
from kvsparse.config import reachable_only_locally
from kvsparse.placement import table_id_of
from kvsparse.server.paths import CheckpointPaths
from kvsparse.table import MAX_DIM
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Header

MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class RawPeer:
    """A DEALER that speaks the wire format by hand and reads only when told to."""

    def __init__(self, address: str, context: zmq.Context):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # Take (almost) nothing off the connection unless asked: replies stay in the server.
        self.socket.setsockopt(zmq.RCVHWM, 1)
        self.socket.setsockopt(zmq.RCVBUF, 1 << 16)
        self.socket.connect(address)
        self.client_id = 0x5EED
        self.request_id = 0

    def send(self, request: ops.Request) -> None:
        self.request_id += 1
        header = Header(
            op=request.op,
            flags=request.flags,
            request_id=self.request_id,
            client_id=self.client_id,
            num_items=request.num_items,
            num_frames=len(request.frames),
        )
        self.socket.send_multipart([header.pack(), *request.frames], copy=False)

    def receive(self, timeout: float = 60.0):
        """(header, payload) of the next reply."""
        assert self.socket.poll(int(timeout * 1000)), "no reply"
        frames = self.socket.recv_multipart()
        return protocol.unpack_header(frames[0], reply=True), frames[1:]

    def call(self, request: ops.Request):
        self.send(request)
        return self.receive()

    def start(self, name: str, dim: int) -> int:
        hello = ops.HelloRequest(1, ops.Mode.ASP, None, 0, 1, 0)
        assert self.call(ops.Hello.encode_request(hello))[0].status == 0
        table_id = table_id_of(name)
        spec = kvsparse.SparseTable(dim=dim).to_dict()
        header, payload = self.call(ops.InitSparse.encode_request(table_id, name, spec))
        assert header.status == 0, bytes(payload[0])
        return table_id


def pull(table_id: int, count: int) -> ops.Request:
    return ops.PullSparse.encode_request([(table_id, np.arange(count, dtype=np.int64))])


def requests_done(address: str, context: zmq.Context) -> int:
    """The server's count of requests handled so far (a monitor's STATS, from another socket)."""
    monitor = context.socket(zmq.DEALER)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(address)
    try:
        request = ops.Stats.encode_request(monitor=True)
        header = Header(op=request.op, flags=request.flags, num_frames=len(request.frames))
        monitor.send_multipart([header.pack(), *request.frames])
        assert monitor.poll(120_000), "no STATS reply"
        frames = monitor.recv_multipart()
        stats = ops.Stats.decode_reply(protocol.unpack_header(frames[0], reply=True), frames[1:])
        return stats["requests"]
    finally:
        monitor.close(0)


def wait_for_requests(address, context, count, timeout=240.0) -> None:
    # The server handles one message at a time: once it counts `count` requests, the
    # ones before were handled (their replies built and queued) when STATS ran.
    deadline = time.monotonic() + timeout
    while requests_done(address, context) < count:
        assert time.monotonic() < deadline, f"the server did not handle {count} requests"
        time.sleep(0.2)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes the peers' sockets too, also after a failed assertion


@pytest.fixture
def server_with(request):
    started = []

    def start(*args):
        server = ServerProcess(extra_args=tuple(map(str, args)))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
        server.stderr.close()


def error_text(payload) -> str:
    return bytes(payload[0]).decode()


def test_unread_pulls_of_a_wide_table_do_not_grow_the_server(server_with, context):
    """Scaled down: before these limits, two such pulls (1.1 GiB of rows each) grew the server
    by 2.3 GiB. With the default limits both are refused before any row is made."""
    server = server_with()
    pid = server.process.pid
    peer = RawPeer(server.address, context)
    table_id = peer.start("wide", dim=4096)
    before = rss_bytes(pid)
    count = 70_000  # 70,000 ids x 4096 floats = 1.07 GiB: just over the default 1 GiB
    peer.send(pull(table_id, count))
    peer.send(pull(table_id, count))
    wait_for_requests(server.address, context, 4)  # HELLO, INIT_SPARSE, two pulls
    grown = rss_bytes(pid) - before
    assert grown < 256 * MiB, f"the server grew by {grown / MiB:.0f} MiB"
    for _ in range(2):
        header, payload = peer.receive()
        assert protocol.ERROR_CLASSES[header.status] is errors.LimitExceeded
        assert "--max-reply-bytes" in error_text(payload), error_text(payload)
        assert "1.0 GiB" in error_text(payload)
    # The server goes on serving this peer.
    header, payload = peer.call(pull(table_id, 10))
    assert header.status == 0
    assert len(payload[1]) == 10 * 4096 * 4
    peer.socket.close(0)


def test_unread_replies_per_connection_are_bounded(server_with, context):
    server = server_with("--max-reply-bytes", "16MiB", "--max-unread-reply-bytes", "48MiB")
    pid = server.process.pid
    peer = RawPeer(server.address, context)
    table_id = peer.start("t", dim=1024)
    count = 2048  # 8 MiB a reply
    peer.call(pull(table_id, count))  # rows made once, so that pulls below allocate replies only
    before = rss_bytes(pid)
    sent = 40  # 320 MiB of replies if nothing stopped them
    for _ in range(sent):
        peer.send(pull(table_id, count))
    wait_for_requests(server.address, context, 3 + sent)
    grown = rss_bytes(pid) - before
    assert grown < 160 * MiB, f"the server grew by {grown / MiB:.0f} MiB"
    answered, refused = 0, []
    for _ in range(sent):
        header, payload = peer.receive()
        if header.status == 0:
            answered += 1
        else:
            assert protocol.ERROR_CLASSES[header.status] is errors.LimitExceeded
            refused.append(error_text(payload))
    assert 1 <= answered <= 12 and refused, (answered, len(refused))
    assert "--max-unread-reply-bytes" in refused[0] and "read the replies" in refused[0]
    # Once the peer has read, it may pull again.
    for _ in range(6):
        assert peer.call(pull(table_id, count))[0].status == 0
    peer.socket.close(0)


def test_limits_on_tables_dim_and_ids_per_request(server_with):
    server = server_with("--max-tables", 2, "--max-dim", 64, "--max-rows-per-request", 1000)
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    try:
        with pytest.raises(errors.LimitExceeded, match=r"dim 128 .* limit of 64 .*--max-dim"):
            kv.init("wide", kvsparse.SparseTable(dim=128))
        kv.init("a", kvsparse.SparseTable(dim=4))
        kv.init("b", np.zeros(3, np.float32))
        with pytest.raises(errors.LimitExceeded, match=r"holds 2 tables .*--max-tables 2"):
            kv.init("c", kvsparse.SparseTable(dim=4))
        with pytest.raises(errors.LimitExceeded, match=r"1,001 ids .*--max-rows-per-request"):
            kv.row_sparse_pull("a", row_ids=np.arange(1001))
        with pytest.raises(errors.LimitExceeded, match="--max-rows-per-request"):
            kv.push("a", (np.arange(1001), np.ones((1001, 4), np.float32)))
        # Nothing was applied and the server goes on serving.
        rows = kv.row_sparse_pull("a", row_ids=np.arange(1000))
        kv.push("a", (np.arange(3), np.ones((3, 4), np.float32)))
        assert rows.shape == (1000, 4)
        assert kv.stats()["tables"]["a"]["rows"] == 3
    finally:
        kv.close()


def test_the_reply_cap_counts_the_bytes_a_half_precision_pull_really_sends(server_with):
    # 1,000 ids x dim 64: 256,000 bytes as float32, 128,000 as float16 on the wire.
    server = server_with("--max-reply-bytes", 200_000)
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    try:
        kv.init("f32", kvsparse.SparseTable(dim=64))
        kv.init("f16", kvsparse.SparseTable(dim=64, wire_dtype="float16"))
        with pytest.raises(errors.LimitExceeded, match="--max-reply-bytes"):
            kv.row_sparse_pull("f32", row_ids=np.arange(1000))
        assert kv.row_sparse_pull("f16", row_ids=np.arange(1000)).shape == (1000, 64)
    finally:
        kv.close()


def test_limit_settings_come_from_flags_then_environment_then_defaults():
    defaults = config.ServerLimits()
    assert defaults.max_dim == MAX_DIM
    assert defaults.max_reply_bytes == 1 << 30 and defaults.max_unread_reply_bytes == 2 << 30
    env = {"KVSPARSE_MAX_REPLY_BYTES": "256MiB", "KVSPARSE_MAX_TABLES": "9"}
    limits = config.server_limits(env, max_tables=3)
    assert (limits.max_reply_bytes, limits.max_tables) == (256 * MiB, 3)
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_MAX_REPLY_BYTES"):
        config.server_limits({"KVSPARSE_MAX_REPLY_BYTES": "lots"})
    with pytest.raises(errors.InvalidArgument, match="max_unread_reply_bytes"):
        config.ServerLimits(max_reply_bytes=2 << 30, max_unread_reply_bytes=1 << 30)
    with pytest.raises(errors.InvalidArgument, match="max_dim"):
        config.ServerLimits(max_dim=MAX_DIM + 1)


def test_server_refuses_malformed_limit_flags(server_with):
    import subprocess
    import sys

    from conftest import subprocess_env

    result = subprocess.run(
        [sys.executable, "-m", "kvsparse.server", "--max-reply-bytes", "lots"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert result.returncode == 2
    assert "--max-reply-bytes" in result.stderr and "Traceback" not in result.stderr


# -- CHECKPOINT paths -------------------------------------------------------------------------


def test_checkpoint_paths_stay_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "inside").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    paths = CheckpointPaths(str(root), address="tcp://0.0.0.0:7000", authenticated=False)
    assert paths.resolve("run1") == str(root / "run1")
    assert paths.resolve(str(root / "inside" / "x")) == str(root / "inside" / "x")
    for bad in (str(outside), "../outside", "inside/../../outside", "escape", "escape/run"):
        with pytest.raises(errors.CheckpointError, match="outside this server's checkpoint root"):
            paths.resolve(bad)


def test_without_a_root_only_local_or_authenticated_servers_take_any_path(tmp_path):
    assert reachable_only_locally("tcp://127.0.0.1:1") and reachable_only_locally("tcp://[::1]:1")
    assert reachable_only_locally("ipc:///tmp/kvsparse/s0")
    assert not reachable_only_locally("tcp://0.0.0.0:1")
    local = CheckpointPaths(None, address="tcp://127.0.0.1:7000", authenticated=False)
    assert local.resolve(str(tmp_path)) == str(tmp_path)
    keyed = CheckpointPaths(None, address="tcp://0.0.0.0:7000", authenticated=True)
    assert keyed.resolve(str(tmp_path)) == str(tmp_path)
    exposed = CheckpointPaths(None, address="tcp://0.0.0.0:7000", authenticated=False)
    with pytest.raises(errors.CheckpointError, match="--checkpoint-root"):
        exposed.resolve(str(tmp_path))


def test_checkpoint_requests_outside_the_root_are_refused(server_with, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    server = server_with("--checkpoint-root", root)
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    try:
        kv.init("t", kvsparse.SparseTable(dim=4))
        kv.push("t", (np.arange(3), np.ones((3, 4), np.float32)))
        for bad in (tmp_path / "outside", root / ".." / "outside", root / "escape"):
            with pytest.raises(errors.CheckpointError, match="--checkpoint-root"):
                kv.save(str(bad))
            with pytest.raises(errors.CheckpointError, match="--checkpoint-root"):
                kv.load(str(bad))
            with pytest.raises(errors.CheckpointError, match="--checkpoint-root"):
                kv.export(str(bad))
        assert os.listdir(tmp_path / "outside") == []
        kv.save(str(root / "ckpt"))  # inside: saved as before
        kv.save("relative")  # taken inside the root
        assert os.path.isdir(root / "ckpt") and os.path.isdir(root / "relative")
        kv.load(str(root / "ckpt"))
    finally:
        kv.close()


def test_optimizer_states_past_the_reply_cap_are_refused_before_they_are_built(
    server_with, tmp_path
):
    """GET_OPTIMIZER_STATES (save_optimizer_states) is a reply like a pull: 2,000 rows of an
    Adagrad dim-64 table hold 2,000 x (8 + 8 + 256) bytes, past a 200,000-byte cap."""
    server = server_with("--max-reply-bytes", 200_000)
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    try:
        kv.init("t", kvsparse.SparseTable(dim=64))
        kv.set_optimizer(kvsparse.optimizers.Adagrad())
        kv.push("t", (np.arange(500), np.ones((500, 64), np.float32)))
        kv.save_optimizer_states(tmp_path / "small.states")  # 136,000 bytes: under the cap
        kv.push("t", (np.arange(2000), np.ones((2000, 64), np.float32)))
        with pytest.raises(errors.LimitExceeded, match=r"optimizer states .*--max-reply-bytes"):
            kv.save_optimizer_states(tmp_path / "big.states")
        assert not (tmp_path / "big.states").exists()
        # The server goes on serving, the rows as they were.
        assert kv.stats()["tables"]["t"]["rows"] == 2000
        assert kv.row_sparse_pull("t", row_ids=np.arange(3)).shape == (3, 64)
    finally:
        kv.close()
