"""The server process at the protocol level: startup, shutdown, bad input, resends, timeouts.

Every test talks to real ``python -m kvsparse.server`` subprocesses on free
127.0.0.1 ports (conftest.server_factory) through raw ZeroMQ sockets or the
dist store.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest
import zmq
from conftest import ServerProcess

import kvsparse
from kvsparse import errors
from kvsparse.client import remote as dist
from kvsparse.placement import table_id_of
from kvsparse.wire import protocol
from kvsparse.wire.protocol import FLAG_DECLARE, HEADER, ITEM_DTYPE, Header, Op

PROTOCOL_ERROR = protocol.ERROR_CODES[errors.ProtocolError]


class RawClient:
    """A DEALER socket that sends hand-built messages, for protocol-level tests."""

    def __init__(self, address, client_id=None, rank=0):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.client_id = (
            client_id if client_id is not None else int.from_bytes(os.urandom(8), "little")
        )
        self.rank = rank
        self.next_id = 1

    def send_raw(self, frames):
        self.socket.send_multipart(frames)

    def send(self, op, frames=(), *, request_id=None, flags=0, num_items=0, clock=0, rank=None):
        if request_id is None:
            request_id = self.next_id
        self.next_id = max(self.next_id, request_id + 1)
        header = Header(
            op=int(op),
            flags=flags,
            request_id=request_id,
            client_id=self.client_id,
            rank=self.rank if rank is None else rank,
            num_items=num_items,
            clock=clock,
            num_frames=len(frames),
        )
        self.socket.send_multipart([header.pack(), *frames])
        return request_id

    def recv(self, timeout=10.0):
        assert self.socket.poll(timeout * 1000), "no reply from the server"
        return protocol.parse_message(self.socket.recv_multipart(), reply=True)

    def poll(self, timeout):
        return bool(self.socket.poll(timeout * 1000))

    def request(self, op, frames=(), **kwargs):
        request_id = self.send(op, frames, **kwargs)
        header, payload = self.recv()
        assert header.request_id == request_id
        return header, payload

    def hello(self, num_workers=1, mode="bsp", staleness=None, num_servers=1, server_index=0):
        body = {
            "num_workers": num_workers,
            "mode": mode,
            "staleness": staleness,
            "rank": self.rank,
            "num_servers": num_servers,
            "server_index": server_index,
        }
        header, payload = self.request(Op.HELLO, [protocol.encode_json(body)])
        return header, payload

    def close(self):
        self.socket.close(0)


def error_text(payload):
    return bytes(payload[0]).decode()


def init_table(client, table_id, dim=4, optimizer=None, name="t"):
    spec = kvsparse.SparseTable(
        dim=dim, initializer=kvsparse.initializers.Zeros(), optimizer=optimizer
    ).to_dict()
    header, payload = client.request(
        Op.INIT_SPARSE, [protocol.encode_json({"table_id": table_id, "name": name, "spec": spec})]
    )
    assert header.status == 0, error_text(payload)


def push_frames(entries):
    """PUSH_SPARSE payload frames for [(table_id, keys, rows)]."""
    items = protocol.make_items([(t, len(k), np.shape(r)[1]) for t, k, r in entries])
    frames = [items.tobytes()]
    for _, keys, rows in entries:
        frames += [np.asarray(keys, np.int64).tobytes(), np.asarray(rows, np.float32).tobytes()]
    return frames


def pull_rows(client, table_id, keys, dim):
    items = protocol.make_items([(table_id, len(keys), 0)])
    header, payload = client.request(
        Op.PULL_SPARSE, [items.tobytes(), np.asarray(keys, np.int64).tobytes()], num_items=1
    )
    assert header.status == 0, error_text(payload)
    return np.frombuffer(payload[1], np.float32).reshape(len(keys), dim)


# -- startup and shutdown -----------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_port_zero_prints_one_line_and_stops_cleanly(sig):
    server = ServerProcess()
    try:
        assert re.fullmatch(
            r"kvsparse server listening on tcp://127\.0\.0\.1:\d+\n", server.first_line
        )
        assert int(server.address.rsplit(":", 1)[1]) > 0
        assert dist.ping(server.address, timeout=10)
        # A request deferred in a barrier must not keep the server from stopping.
        client = RawClient(server.address)
        assert client.hello(num_workers=2)[0].status == 0
        client.send(Op.BARRIER)
        assert not client.poll(0.2)
        client.close()
        assert server.stop(sig, timeout=20) == 0
        assert server.later_output == b""  # exactly one line was printed
        assert "Traceback" not in server.error_output()
    finally:
        server.stop(signal.SIGKILL)


def test_binding_a_taken_port_fails_with_a_message(server_factory):
    (address,) = server_factory(1)
    with pytest.raises(RuntimeError, match="cannot bind"):
        ServerProcess(bind=address)


def test_ping(server_factory):
    (address,) = server_factory(1)
    assert dist.ping(address, timeout=10) is True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    assert dist.ping(free, timeout=0.3) is False


# -- malformed input ----------------------------------------------------------------------


def valid_header(op=Op.PULL_SPARSE, **fields):
    return Header(op=int(op), client_id=77, **fields).pack()


def raw_header(**fields):
    values = dict(
        magic=protocol.MAGIC,
        version=protocol.VERSION,
        op=int(Op.STATS),
        flags=0,
        status=0,
        request_id=1,
        client_id=77,
        rank=0,
        num_items=0,
        clock=0,
        num_frames=0,
        reserved=0,
    )
    values.update(fields)
    return HEADER.pack(*values.values())


def test_malformed_messages_get_error_replies_and_the_server_keeps_serving(server_factory):
    (address,) = server_factory(1)
    bad = RawClient(address, client_id=77)
    bad.send_raw([raw_header(op=int(Op.STATS), request_id=1)])
    header, payload = bad.recv()
    assert header.status == PROTOCOL_ERROR and "before HELLO" in error_text(payload)

    good = kvsparse.create("dist_sparse", servers=[address], timeout=20)
    good.init("emb", kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Zeros()))
    ids = np.array([1, 2, 3])
    good.push("emb", (ids, np.arange(12, dtype=np.float32).reshape(3, 4)))
    table_id = table_id_of("emb")

    rng = np.random.default_rng(0)

    def expect_error(frames, message, request_id=0, code=PROTOCOL_ERROR):
        bad.send_raw(frames)
        header, payload = bad.recv()
        assert header.status == code, error_text(payload)
        assert header.request_id == request_id
        assert re.search(message, error_text(payload)), error_text(payload)

    # Random bytes of many sizes, one or several frames.
    for size in [0, 1, 7, 55, 56, 57, 100, 4096]:
        expect_error([rng.bytes(size)], "header|magic")
        expect_error([rng.bytes(size), rng.bytes(3), b""], "header|magic")
    # Truncated and padded headers.
    expect_error([raw_header()[:20]], "56 bytes")
    expect_error([raw_header() + b"\0"], "56 bytes")
    # Header fields.
    expect_error([raw_header(version=2, request_id=5)], "version 2", request_id=5)
    expect_error([raw_header(version=0, request_id=6)], "version 0", request_id=6)
    expect_error([raw_header(op=77, request_id=7)], "unknown op 77", request_id=7)
    expect_error([raw_header(op=0, request_id=8)], "unknown op 0", request_id=8)
    expect_error([raw_header(flags=0x100, request_id=9)], "flags", request_id=9)
    expect_error([raw_header(status=1, request_id=10)], "status", request_id=10)
    expect_error([raw_header(reserved=3, request_id=11)], "reserved", request_id=11)
    expect_error([raw_header(num_items=2**31, request_id=12)], "num_items", request_id=12)
    expect_error([raw_header(num_frames=3, request_id=13), b"x"], "announces 3", request_id=13)

    assert bad.hello()[0].status == 0
    next_id = iter(range(100, 10_000))

    def request_error(op, frames, message, code=PROTOCOL_ERROR, **kwargs):
        request_id = next(next_id)
        bad.send(op, frames, request_id=request_id, **kwargs)
        header, payload = bad.recv()
        assert header.request_id == request_id
        assert header.status == code, error_text(payload)
        assert re.search(message, error_text(payload)), error_text(payload)

    keys = np.array([1, 2], np.int64).tobytes()
    items = protocol.make_items([(table_id, 2, 0)]).tobytes()
    # Items frame of the wrong length, counts that do not match the frames.
    request_error(Op.PULL_SPARSE, [items[:-1], keys], "items frame", num_items=1)
    request_error(Op.PULL_SPARSE, [items, keys[:-3]], "expected 16", num_items=1)
    request_error(Op.PULL_SPARSE, [items, keys, keys], "takes 2 payload frames", num_items=1)
    request_error(Op.PULL_SPARSE, [], "needs an items frame", num_items=1)
    huge = protocol.make_items([(table_id, 2**60, 0)]).tobytes()
    request_error(Op.PULL_SPARSE, [huge, keys], "expected", num_items=1)
    negative = np.zeros(1, ITEM_DTYPE)
    negative["count"] = -1
    request_error(Op.PULL_SPARSE, [negative.tobytes(), b""], "negative count", num_items=1)
    # Pushes: rows of the wrong length, a dim of 0, a dim that is not the table's.
    push_items = protocol.make_items([(table_id, 2, 4)]).tobytes()
    request_error(Op.PUSH_SPARSE, [push_items, keys, b"\0" * 31], "expected 32", num_items=1)
    zero_dim = protocol.make_items([(table_id, 2, 0)]).tobytes()
    request_error(Op.PUSH_SPARSE, [zero_dim, keys, b""], "dim must be >= 1", num_items=1)
    wrong_dim = protocol.make_items([(table_id, 2, 3)]).tobytes()
    request_error(
        Op.PUSH_SPARSE,
        [wrong_dim, keys, b"\0" * 24],
        "shape",
        code=protocol.ERROR_CODES[errors.ShapeError],
        num_items=1,
    )
    nan_rows = np.full((2, 4), np.nan, np.float32).tobytes()
    request_error(
        Op.PUSH_SPARSE,
        [push_items, keys, nan_rows],
        "NaN",
        code=protocol.ERROR_CODES[errors.NonFiniteGradient],
        num_items=1,
    )
    # Unknown tables, dense/sparse confusion, dense lengths.
    unknown = protocol.make_items([(12345, 2, 0)]).tobytes()
    request_error(
        Op.PULL_SPARSE,
        [unknown, keys],
        "not initialized",
        code=protocol.ERROR_CODES[errors.UnknownKey],
        num_items=1,
    )
    request_error(
        Op.PULL_DENSE,
        [items],
        "sparse table",
        code=protocol.ERROR_CODES[errors.InvalidArgument],
        num_items=1,
    )
    # JSON payloads.
    request_error(Op.INIT_SPARSE, [b"{oops"], "not valid JSON")
    request_error(Op.INIT_SPARSE, [b"[1]"], "must be an object")
    request_error(
        Op.INIT_SPARSE,
        [protocol.encode_json({"table_id": -1, "name": "x", "spec": {}})],
        "table_id",
    )
    request_error(
        Op.INIT_SPARSE,
        [protocol.encode_json({"table_id": 5, "name": "x", "spec": {"dim": 4}})],
        "bad table spec",
        code=protocol.ERROR_CODES[errors.InvalidArgument],
    )
    spec = {**kvsparse.SparseTable(dim=4).to_dict(), "dim": 0}
    request_error(
        Op.INIT_SPARSE,
        [protocol.encode_json({"table_id": 5, "name": "x", "spec": spec})],
        "dim must be in",
        code=protocol.ERROR_CODES[errors.InvalidArgument],
    )
    request_error(
        Op.INIT_DENSE,
        [protocol.encode_json({"table_id": 5, "name": "x", "size": 4})],
        "takes 2 payload frames",
    )
    request_error(
        Op.INIT_DENSE,
        [protocol.encode_json({"table_id": 5, "name": "x", "size": 4}), b"\0" * 15],
        "expected 16",
    )
    request_error(
        Op.SET_OPTIMIZER,
        [protocol.encode_json({"spec": {"kind": "nope"}, "epoch": 1})],
        "optimizer",
        code=protocol.ERROR_CODES[errors.InvalidArgument],
    )
    request_error(Op.LOAD_OPTIMIZER_STATES, [b'{"__array__": 3}'], "bad array")
    request_error(Op.BARRIER, [b"x"], "no payload")
    request_error(Op.STATS, [], "rank 5 out of range", rank=5)
    request_error(Op.HELLO, [protocol.encode_json({"num_workers": 0})], "num_workers")
    # A fused push whose second table fails changes nothing, not even the first table.
    before = good.row_sparse_pull("emb", row_ids=ids)
    fused = push_frames([(table_id, [1, 2], np.ones((2, 4))), (999, [1], np.ones((1, 4)))])
    request_error(
        Op.PUSH_SPARSE,
        fused,
        "not initialized",
        code=protocol.ERROR_CODES[errors.UnknownKey],
        num_items=2,
    )
    np.testing.assert_array_equal(good.row_sparse_pull("emb", row_ids=ids), before)

    # The server is alive and still serves the correct data to another client.
    np.testing.assert_array_equal(
        good.row_sparse_pull("emb", row_ids=ids), np.arange(12, dtype=np.float32).reshape(3, 4)
    )
    assert good.stats()["tables"]["emb"]["rows"] == 3
    bad.close()
    good.close()


# -- resends ----------------------------------------------------------------------------------


def test_a_resent_push_is_applied_once(server_factory):
    (address,) = server_factory(1)
    client = RawClient(address)
    assert client.hello()[0].status == 0
    sgd = kvsparse.optimizers.SGD(learning_rate=1.0)
    init_table(client, 42, dim=2, optimizer=sgd)
    frames = push_frames([(42, [7, 8], [[1.0, 2.0], [3.0, 4.0]])])

    first = client.request(Op.PUSH_SPARSE, frames, request_id=10, num_items=1)
    again = client.request(Op.PUSH_SPARSE, frames, request_id=10, num_items=1)
    assert first[0] == again[0] and first[0].status == 0
    np.testing.assert_array_equal(pull_rows(client, 42, [7, 8], 2), [[-1, -2], [-3, -4]])

    # A new request id is a new push.
    client.request(Op.PUSH_SPARSE, frames, request_id=20, num_items=1)
    np.testing.assert_array_equal(pull_rows(client, 42, [7, 8], 2), [[-2, -4], [-6, -8]])
    # An id older than the last one is refused, not applied.
    header, payload = client.request(Op.PUSH_SPARSE, frames, request_id=15, num_items=1)
    assert header.status == PROTOCOL_ERROR and "stale" in error_text(payload)
    np.testing.assert_array_equal(pull_rows(client, 42, [7, 8], 2), [[-2, -4], [-6, -8]])
    # The same request id from another client is that client's own request.
    other = RawClient(address)
    assert other.hello()[0].status == 0
    other.request(Op.PUSH_SPARSE, frames, request_id=20, num_items=1)
    np.testing.assert_array_equal(pull_rows(client, 42, [7, 8], 2), [[-3, -6], [-9, -12]])
    client.close()
    other.close()


def test_a_resent_deferred_bsp_push_joins_its_round_once(server_factory):
    (address,) = server_factory(1)
    worker0, worker1 = RawClient(address, rank=0), RawClient(address, rank=1)
    assert worker0.hello(num_workers=2)[0].status == 0
    assert worker1.hello(num_workers=2)[0].status == 0
    init_table(worker0, 42, dim=1, optimizer=kvsparse.optimizers.SGD(learning_rate=1.0))
    frames = push_frames([(42, [5], [[1.0]])])
    worker0.send(Op.PUSH_SPARSE, frames, request_id=50, num_items=1)
    assert not worker0.poll(0.2)  # held until worker 1 pushes
    worker0.send(Op.PUSH_SPARSE, frames, request_id=50, num_items=1)  # a resend while held
    assert not worker0.poll(0.2)
    assert (
        worker1.request(Op.PUSH_SPARSE, push_frames([(42, [5], [[10.0]])]), num_items=1)[0].status
        == 0
    )
    header, _ = worker0.recv()
    assert header.request_id == 50 and header.status == 0
    assert not worker0.poll(0.2)  # one reply, not two
    np.testing.assert_array_equal(pull_rows(worker0, 42, [5], 1), [[-11.0]])
    worker0.close()
    worker1.close()


def test_dense_init_of_other_ranks_waits_for_rank_0(server_factory):
    (address,) = server_factory(1)
    rank0, rank1 = RawClient(address, rank=0), RawClient(address, rank=1)
    assert rank1.hello(num_workers=2)[0].status == 0
    assert rank0.hello(num_workers=2)[0].status == 0
    body = protocol.encode_json({"table_id": 9, "name": "w", "size": 3})
    rank1.send(Op.INIT_DENSE, [body], flags=FLAG_DECLARE)
    assert not rank1.poll(0.2)
    values = np.array([1.0, 2.0, 3.0], np.float32)
    assert rank0.request(Op.INIT_DENSE, [body, values.tobytes()])[0].status == 0
    assert rank1.recv()[0].status == 0
    items = protocol.make_items([(9, 3, 0)]).tobytes()
    header, payload = rank1.request(Op.PULL_DENSE, [items], num_items=1)
    np.testing.assert_array_equal(np.frombuffer(payload[1], np.float32), values)
    # A declaration with another size is refused.
    other = protocol.encode_json({"table_id": 9, "name": "w", "size": 4})
    header, payload = rank1.request(Op.INIT_DENSE, [other], flags=FLAG_DECLARE)
    assert header.status == protocol.ERROR_CODES[errors.DuplicateKey]
    rank0.close()
    rank1.close()


def test_a_client_with_another_configuration_is_refused(server_factory):
    addresses = server_factory(2)
    first = kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1, timeout=20)
    with pytest.raises(errors.InvalidArgument, match=r"num_workers=2 \(server has 1\)"):
        kvsparse.create("dist_sparse", servers=addresses, rank=1, num_workers=2, timeout=20)
    with pytest.raises(errors.InvalidArgument, match="mode='asp'"):
        kvsparse.create("dist_async", servers=addresses, timeout=20)
    with pytest.raises(errors.InvalidArgument, match="server_index"):
        kvsparse.create("dist_sparse", servers=addresses[::-1], timeout=20)
    with pytest.raises(errors.InvalidArgument, match="num_servers"):
        kvsparse.create("dist_sparse", servers=addresses[:1], timeout=20)
    # The same configuration is welcome.
    second = kvsparse.create("dist_sync", servers=addresses, rank=0, num_workers=1, timeout=20)
    assert second.num_servers == 2
    first.close()
    second.close()


# -- unavailable servers ---------------------------------------------------------------------


def free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_never_started_server_raises_server_unavailable_naming_it(server_factory):
    (live,) = server_factory(1)
    dead = free_address()
    with pytest.raises(errors.ServerUnavailable, match=re.escape(dead)) as info:
        kvsparse.create("dist_sparse", servers=[live, dead], timeout=2.0)
    assert info.value.address == dead
    assert isinstance(info.value, ConnectionError)


def test_a_killed_server_raises_server_unavailable_and_the_rest_still_works(server_factory):
    addresses = server_factory(2)
    kv = kvsparse.create("dist_sparse", servers=addresses, timeout=20)
    kv.init("emb", kvsparse.SparseTable(dim=2, initializer=kvsparse.initializers.Constant(1.0)))
    ids = np.arange(100)
    assert kv.row_sparse_pull("emb", row_ids=ids).shape == (100, 2)
    server_factory.processes[1].kill()
    kv._backend.timeout = 1.0  # short only now, so that a loaded machine cannot fail the setup
    with pytest.raises(errors.ServerUnavailable, match=re.escape(addresses[1])) as info:
        kv.row_sparse_pull("emb", row_ids=ids)
    assert info.value.address == addresses[1]
    with pytest.raises(errors.ServerUnavailable, match=re.escape(addresses[1])):
        kv.stats()
    # Ids that live on the surviving server are still served.
    shard = kvsparse._core.shard_of(ids.astype(np.int64), 2)
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=ids[shard == 0]), 1.0)
    kv.close()


class SlowFakeServer(threading.Thread):
    """A ROUTER that answers its first STATS only after a delay, and wrongly."""

    def __init__(self, delay):
        super().__init__(daemon=True)
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.delay = delay
        self.stop_flag = False
        self.stats_seen = 0

    def run(self):
        held = []
        while not self.stop_flag:
            now = time.monotonic()
            for when, frames in list(held):
                if now >= when:
                    self.socket.send_multipart(frames)
                    held.remove((when, frames))
            if not self.socket.poll(20):
                continue
            routing, *message = self.socket.recv_multipart()
            header, _ = protocol.parse_message(message)
            if header.op == Op.STATS:
                self.stats_seen += 1
                body = {"tables": {}, "late": self.stats_seen == 1}
                reply = [routing, header.reply(num_frames=1).pack(), protocol.encode_json(body)]
                if self.stats_seen == 1:
                    # Silent (no pings answered either) until after the client gave up.
                    held.append((now + self.delay, reply))
                    deadline = now + self.delay
                    while time.monotonic() < deadline and not self.stop_flag:
                        time.sleep(0.01)
                    continue
                self.socket.send_multipart(reply)
            elif header.op == Op.HELLO:
                body = protocol.encode_json({"address": self.address, "version": 1})
                self.socket.send_multipart([routing, header.reply(num_frames=1).pack(), body])
            else:
                self.socket.send_multipart([routing, header.reply().pack()])
        self.socket.close(0)


def test_a_late_reply_is_not_mistaken_for_the_next_one():
    fake = SlowFakeServer(delay=2.0)
    fake.start()
    try:
        backend = dist.RemoteBackend([fake.address], rank=0, num_workers=1, timeout=20)
        backend.timeout = 0.4  # the fake stays silent for 2 s
        with pytest.raises(errors.ServerUnavailable, match=re.escape(fake.address)):
            backend.stats()
        backend.timeout = 20
        # The late reply is sent while this call waits (to the abandoned socket); the
        # answer must be the reply to this call.
        assert backend.stats()[0]["late"] is False
        backend.close()
    finally:
        fake.stop_flag = True
        fake.join(5)


def test_waiting_on_other_workers_is_not_a_timeout(server_factory):
    """A barrier held longer than the timeout returns: the server answers liveness pings."""
    (address,) = server_factory(1)
    worker0 = dist.RemoteBackend([address], rank=0, num_workers=2, timeout=20)
    worker1 = RawClient(address, rank=1)
    assert worker1.hello(num_workers=2)[0].status == 0
    worker0.timeout = 1.0
    release = threading.Timer(3.5, lambda: worker1.send(Op.BARRIER))
    release.start()
    try:
        worker0.barrier()  # waits ~3.5 s with a 1 s timeout
    finally:
        release.join()
    assert worker1.recv()[0].status == 0
    worker0.close()
    worker1.close()


def test_a_second_bsp_push_of_one_rank_waits_for_the_next_round(server_factory):
    (address,) = server_factory(1)
    first, again, other = (
        RawClient(address, rank=0),
        RawClient(address, rank=0),
        RawClient(address, rank=1),
    )
    for client in (first, again, other):
        assert client.hello(num_workers=2)[0].status == 0
    init_table(first, 42, dim=1, optimizer=kvsparse.optimizers.SGD(learning_rate=1.0))
    first.send(Op.PUSH_SPARSE, push_frames([(42, [5], [[1.0]])]), num_items=1)
    again.send(Op.PUSH_SPARSE, push_frames([(42, [5], [[100.0]])]), num_items=1)
    # Two pushes of rank 0 do not make a round of two workers.
    assert not first.poll(0.2) and not again.poll(0.01)
    other.request(Op.PUSH_SPARSE, push_frames([(42, [5], [[10.0]])]), num_items=1)
    assert first.recv()[0].status == 0
    assert not again.poll(0.2)
    np.testing.assert_array_equal(pull_rows(other, 42, [5], 1), [[-11.0]])
    other.request(Op.PUSH_SPARSE, push_frames([(42, [5], [[1000.0]])]), num_items=1)
    assert again.recv()[0].status == 0
    np.testing.assert_array_equal(pull_rows(other, 42, [5], 1), [[-1111.0]])
    for client in (first, again, other):
        client.close()
