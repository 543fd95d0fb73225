"""The serving fast path: PULL_SPARSE and PUSH_SPARSE answered by a C++ thread without the
GIL must be indistinguishable from the Python path.

Each comparison runs the same requests against a server with the fast path on and
one with it off (both real servers on 127.0.0.1, served from a thread of this
process, or a subprocess for the GIL test) and compares every reply byte (but the
incarnation, random per server) and the tables afterwards. `fast_path_requests`
proves that the fast server answered them on its C++ thread.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import zmq
from conftest import subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dist_server import RawClient

import kvsparse
from kvsparse import errors
from kvsparse.config import ServerLimits
from kvsparse.initializers import Uniform, Zeros
from kvsparse.optimizers import SGD, Adagrad
from kvsparse.placement import table_id_of
from kvsparse.server.embedded import EmbeddedServer
from kvsparse.server.server import Server
from kvsparse.wire import protocol
from kvsparse.wire.protocol import ITEM_FLAG_STEP, Op, item_dtype_flags

DIMS = {11: 4, 12: 8, 13: 3}  # table id -> dim of the tables every test creates
SKIP_TABLE = 13  # nonfinite="skip"


@contextlib.contextmanager
def serving(fast: bool, **options):
    server = Server("tcp://127.0.0.1:0", fast_path=fast, **options)
    assert server.fast_path is fast
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(30)
        server.close()


def answered_fast(server: Server) -> int:
    with server._guard:
        return server.fast_path_requests


def requests_handled(server: Server) -> int:
    with server._guard:
        server.sync_fast_path()
        return server.state.counters.requests


def setup_client(server: Server, client_id: int, mode: str = "asp") -> RawClient:
    client = RawClient(server.address, client_id=client_id)
    assert client.hello(num_workers=1, mode=mode)[0].status == 0
    for table_id, dim in DIMS.items():
        spec = kvsparse.SparseTable(
            dim=dim,
            initializer=Uniform(-1.0, 1.0),
            optimizer=Adagrad(learning_rate=0.1),
            seed=table_id,
            nonfinite="skip" if table_id == SKIP_TABLE else "raise",
        ).to_dict()
        body = {"table_id": table_id, "name": f"t{table_id}", "spec": spec}
        header, payload = client.request(Op.INIT_SPARSE, [protocol.encode_json(body)])
        assert header.status == 0, bytes(payload[0])
    return client


def masked(frames) -> list:
    """Reply frames as bytes, the header's incarnation (random per server) zeroed."""
    frames = [bytes(frame) for frame in frames]
    frames[0] = frames[0][:52] + b"\0\0\0\0"
    return frames


def exchange(client: RawClient, op: Op, frames, num_items: int, clock: int = 0) -> list:
    request_id = client.send(op, frames, num_items=num_items, clock=clock)
    assert client.socket.poll(10_000), "no reply"
    reply = client.socket.recv_multipart()
    assert protocol.unpack_header(reply[0], reply=True).request_id == request_id
    return masked(reply)


def pull_request(entries) -> tuple:
    """entries: [(table_id, keys, wire dtype flags)] -> (frames, num_items)."""
    items = protocol.make_items([(t, len(k), 0, flags) for t, k, flags in entries])
    return [items.tobytes(), *(np.asarray(k, np.int64).tobytes() for _, k, _ in entries)], len(
        entries
    )


def push_request(entries) -> tuple:
    """entries: [(table_id, keys, rows (float32, or uint16 patterns), item flags)]."""
    items = protocol.make_items(
        [(t, len(k), np.shape(r)[1] if np.ndim(r) == 2 else 0, f) for t, k, r, f in entries]
    )
    frames = [items.tobytes()]
    for _, keys, rows, _ in entries:
        frames += [np.asarray(keys, np.int64).tobytes(), np.ascontiguousarray(rows).tobytes()]
    return frames, len(entries)


def table_rows(client: RawClient, keys=range(40)) -> list:
    keys = np.asarray(list(keys), np.int64)
    frames, n = pull_request([(t, keys, 0) for t in DIMS])
    return exchange(client, Op.PULL_SPARSE, frames, n)


def f16(rows) -> np.ndarray:
    return np.asarray(rows, np.float32).astype(np.float16).view(np.uint16)


SCRIPT = [
    # (op, entries); pulls: (table, keys, flags); pushes: (table, keys, rows, flags)
    (Op.PULL_SPARSE, [(11, [1, 2, 3], 0)]),
    (Op.PULL_SPARSE, [(11, [5, 5, 1], 0), (12, [], 0), (13, [7, 8], 0)]),
    (Op.PUSH_SPARSE, [(11, [1, 2, 2], np.ones((3, 4), np.float32), ITEM_FLAG_STEP)]),
    (Op.PULL_SPARSE, [(11, [1, 2, 3, 9], 0), (12, [1], item_dtype_flags("float16"))]),
    # Several tables, one table twice, an empty item with the step flag, a 16-bit item.
    (
        Op.PUSH_SPARSE,
        [
            (11, [4, 1], np.full((2, 4), 0.5, np.float32), ITEM_FLAG_STEP),
            (12, [3], np.full((1, 8), -2.0, np.float32), 0),
            (11, [1], np.full((1, 4), 0.25, np.float32), 0),
            (13, [], np.zeros((0, 3), np.float32), ITEM_FLAG_STEP),
            (12, [6, 7], f16(np.full((2, 8), 1.5)), item_dtype_flags("float16") | ITEM_FLAG_STEP),
        ],
    ),
    (Op.PUSH_SPARSE, [(13, [2], np.array([[np.nan, 1.0, 2.0]], np.float32), 0)]),  # skipped
    (Op.PUSH_SPARSE, []),
    (Op.PULL_SPARSE, []),
    (
        Op.PULL_SPARSE,
        [(11, [1, 4, 2], item_dtype_flags("bfloat16")), (12, [3, 6, 7], 0), (13, [2], 0)],
    ),
]


def run_script(client: RawClient, script) -> list:
    replies = []
    for clock, (op, entries) in enumerate(script):
        frames, n = (pull_request if op == Op.PULL_SPARSE else push_request)(entries)
        replies.append(exchange(client, op, frames, n, clock=clock))
    return replies


def test_fast_replies_are_byte_identical_to_the_python_paths():
    results = {}
    for fast in (True, False):
        with serving(fast) as server:
            client = setup_client(server, client_id=77)
            before = answered_fast(server)
            results[fast] = run_script(client, SCRIPT) + [table_rows(client)]
            if fast:
                assert answered_fast(server) - before == len(SCRIPT) + 1
            client.close()
    assert results[True] == results[False]


# Hypothesis: random pulls and pushes, then the tables compared.
_requests = st.lists(
    st.tuples(
        st.sampled_from([Op.PULL_SPARSE, Op.PUSH_SPARSE]),
        st.lists(
            st.tuples(
                st.sampled_from(sorted(DIMS)),
                st.lists(st.integers(0, 39), max_size=6),
                st.sampled_from([0, 1, 2]),  # row dtype code
                st.booleans(),  # step flag (pushes)
            ),
            max_size=3,
        ),
    ),
    min_size=1,
    max_size=8,
)


def _entries(op, spec, rng):
    entries = []
    for table_id, keys, code, step in spec:
        flags = code << protocol.ITEM_DTYPE_SHIFT
        if op == Op.PULL_SPARSE:
            entries.append((table_id, keys, flags))
            continue
        rows = rng.uniform(-1, 1, (len(keys), DIMS[table_id])).astype(np.float32)
        if code == 1:
            rows = f16(rows)
        elif code == 2:
            rows = (rows.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16, truncated
        entries.append((table_id, keys, rows, flags | (ITEM_FLAG_STEP if step else 0)))
    return entries


def test_random_sequences_give_identical_replies_and_tables():
    with serving(True) as fast_server, serving(False) as python_server:
        clients = {
            True: setup_client(fast_server, client_id=5),
            False: setup_client(python_server, client_id=5),
        }

        @settings(
            max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(_requests, st.integers(0, 2**32 - 1))
        def check(requests, seed):
            replies = {}
            for fast, client in clients.items():
                rng = np.random.default_rng(seed)
                script = [(op, _entries(op, spec, rng)) for op, spec in requests]
                replies[fast] = run_script(client, script) + [table_rows(client)]
            assert replies[True] == replies[False]

        check()
        assert answered_fast(fast_server) > 25
        for client in clients.values():
            client.close()


def test_a_resent_push_is_replayed_not_applied_twice():
    frames, n = push_request([(11, [3], np.ones((1, 4), np.float32), 0)])
    with serving(False) as server:  # the reference: the push applied once
        client = setup_client(server, client_id=9)
        exchange(client, Op.PUSH_SPARSE, frames, n)
        once = table_rows(client, [3])[1:]
        client.close()
    with serving(True) as server:
        client = setup_client(server, client_id=9)
        first = exchange(client, Op.PUSH_SPARSE, frames, n)
        assert answered_fast(server) == 1
        # The same request id again (a worker that timed out): the kept reply, nothing applied.
        client.send(Op.PUSH_SPARSE, frames, num_items=n, request_id=client.next_id - 1)
        assert client.socket.poll(10_000)
        assert masked(client.socket.recv_multipart()) == first
        assert answered_fast(server) == 1  # the resend was Python's
        assert table_rows(client, [3])[1:] == once
        _, ping = client.request(Op.PING)
        assert int(np.frombuffer(bytes(ping[0]), np.uint64)[0]) == client.next_id - 2
        with server._guard:
            assert server._resend.pushes == 1 and server._resend.duplicate_pushes == 0
        client.close()


def _error_cases():
    nan = np.array([[1.0, np.nan, 0.0, 0.0]], np.float32)
    ok = np.ones((1, 4), np.float32)
    return {
        "unknown table pull": (Op.PULL_SPARSE, pull_request([(99, [1], 0)])),
        "unknown table push": (Op.PUSH_SPARSE, push_request([(11, [1], ok, 0), (99, [1], ok, 0)])),
        "shape": (Op.PUSH_SPARSE, push_request([(12, [1], ok, 0)])),
        "nan gradient": (Op.PUSH_SPARSE, push_request([(11, [1], ok, 0), (11, [2], nan, 0)])),
        "overflow": (
            Op.PUSH_SPARSE,
            push_request(
                [(12, [1], np.ones((1, 8), np.float32), 0), (11, [1], np.full((1, 4), 3e38), 0)]
            ),
        ),
        "keys frame size": (
            Op.PULL_SPARSE,
            ([protocol.make_items([(11, 2, 0)]).tobytes(), b"\0" * 8], 1),
        ),
        "rows over the limit": (Op.PULL_SPARSE, pull_request([(11, list(range(31)), 0)])),
        "push over the limit": (
            Op.PUSH_SPARSE,
            push_request([(11, list(range(31)), np.ones((31, 4), np.float32), 0)]),
        ),
        "reply over the limit": (Op.PULL_SPARSE, pull_request([(12, list(range(25)), 0)])),
    }


def test_every_error_is_the_python_paths_reply_and_changes_nothing():
    limits = ServerLimits(max_rows_per_request=30, max_reply_bytes=600)
    results = {}
    for fast in (True, False):
        with serving(fast, limits=limits) as server:
            client = setup_client(server, client_id=3)
            # SGD with a huge rate on table 11 makes a gradient of 3e38 overflow.
            header, _ = client.request(
                Op.SET_OPTIMIZER,
                [
                    protocol.encode_json(
                        {"spec": SGD(learning_rate=1e38).to_dict(), "epoch": 1, "table_ids": [11]}
                    )
                ],
            )
            assert header.status == 0
            before = table_rows(client, range(8))[1:]
            replies = {}
            for name, (op, (frames, n)) in _error_cases().items():
                replies[name] = exchange(client, op, frames, n)
                assert table_rows(client, range(8))[1:] == before, name
            results[fast] = replies
            with server._guard:
                assert server._resend.pushes == 5  # failed pushes count as pushes run
            client.close()
    for name, reply in results[False].items():
        assert protocol.unpack_header(reply[0], reply=True).status != 0, name
        assert results[True][name] == reply, name


def test_stats_ping_clocks_and_freshness_see_fast_pushes():
    with serving(True) as server:
        client = setup_client(server, client_id=21)
        for clock in range(1, 6):
            frames, n = push_request([(11, [clock], np.ones((1, 4), np.float32), 0)])
            exchange(client, Op.PUSH_SPARSE, frames, n, clock=clock)
        frames, n = pull_request([(12, [1, 2], 0)])
        exchange(client, Op.PULL_SPARSE, frames, n, clock=5)
        assert answered_fast(server) == 6
        header, payload = client.request(Op.STATS)
        stats = protocol.decode_json(payload[0], what="stats")
        assert stats["pushes"] == 5 and stats["duplicate_pushes"] == 0
        assert stats["clocks"] == [5]
        assert stats["table_ops"]["t11"]["push_sparse"] == {"requests": 5, "keys": 5}
        assert stats["table_ops"]["t12"]["pull_sparse"] == {"requests": 1, "keys": 2}
        # HELLO, 3 INIT_SPARSE, 6 fast requests and this STATS.
        assert stats["requests"] == 11
        assert stats["keys"] == 7
        with server._guard:
            assert server.state.newest_push is not None
            assert time.time() - server.state.newest_push < 60
        metrics = server.metrics_snapshot()
        assert metrics["requests"]["push_sparse"] == 5
        assert sum(metrics["latency"]["push_sparse"][:-1]) == 5
        _, ping = client.request(Op.PING)
        assert int(np.frombuffer(bytes(ping[0]), np.uint64)[0]) == client.next_id - 2
        client.close()


def test_a_checkpoint_after_fast_pushes_replays_the_last_one_after_a_restart(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with serving(True) as server:
        kv = kvsparse.create("dist_async", servers=[server.address], rank=0, num_workers=2)
        kv.init(
            "t", kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=SGD(learning_rate=1.0))
        )
        client = RawClient(server.address, client_id=44, rank=1)
        assert client.hello(num_workers=2, mode="asp")[0].status == 0
        table_id = table_id_of("t")
        for key in (1, 2, 3):
            frames, n = push_request([(table_id, [key], -np.ones((1, 1), np.float32), 0)])
            last = exchange(client, Op.PUSH_SPARSE, frames, n)
        last_id = client.next_id - 1
        assert answered_fast(server) >= 3
        kv.save(ckpt)
        kv.close()
        client.close()
    restored = Server("tcp://127.0.0.1:0", fast_path=True)
    restored.restore(ckpt, 0, 1)
    thread = threading.Thread(target=restored.serve, daemon=True)
    thread.start()
    try:
        client = RawClient(restored.address, client_id=44, rank=1)
        client.send(Op.PUSH_SPARSE, frames, num_items=n, request_id=last_id)  # the last push
        assert client.socket.poll(10_000)
        assert masked(client.socket.recv_multipart()) == last
        rows = pull_request([(table_id, [1, 2, 3], 0)])
        reply = exchange(client, Op.PULL_SPARSE, *rows)
        np.testing.assert_array_equal(np.frombuffer(reply[2], np.float32), [1.0, 1.0, 1.0])
        client.close()
    finally:
        restored.stop()
        thread.join(30)
        restored.close()


@pytest.mark.parametrize(
    "mode, num_workers, fast",
    [
        ("bsp", 2, 1),  # a round waits for every worker: the push is Python's, the pull fast
        ("ssp", 1, 0),  # the SSP gate: neither
        ("bsp", 1, 2),  # one worker: each push completes its round at once, both fast
    ],
)
def test_a_push_that_a_round_may_hold_stays_pythons(mode, num_workers, fast):
    def run(fast_path: bool) -> tuple:
        with serving(fast_path) as server:
            client = RawClient(server.address, client_id=8)
            staleness = 2 if mode == "ssp" else None
            hello = client.hello(num_workers=num_workers, mode=mode, staleness=staleness)
            assert hello[0].status == 0
            other = None
            if num_workers == 2:  # the second worker's push completes the round
                other = RawClient(server.address, client_id=9, rank=1)
                assert other.hello(num_workers=2, mode=mode)[0].status == 0
            spec = kvsparse.SparseTable(dim=4, optimizer=SGD(learning_rate=0.5)).to_dict()
            init = {"table_id": 11, "name": "t", "spec": spec}
            assert client.request(Op.INIT_SPARSE, [protocol.encode_json(init)])[0].status == 0
            frames, n = push_request([(11, [1], np.ones((1, 4), np.float32), 0)])
            if other is None:
                reply = exchange(client, Op.PUSH_SPARSE, frames, n)
            else:
                client.send(Op.PUSH_SPARSE, frames, num_items=n)
                assert not client.socket.poll(300)  # held: its round waits for rank 1
                done = exchange(other, Op.PUSH_SPARSE, frames, n)
                assert protocol.unpack_header(done[0], reply=True).status == 0
                assert client.socket.poll(10_000)
                reply = client.socket.recv_multipart()
                other.close()
            assert protocol.unpack_header(reply[0], reply=True).status == 0
            frames, n = pull_request([(11, [1], 0)])
            rows = exchange(client, Op.PULL_SPARSE, frames, n)[2]
            client.close()
            return bytes(rows), answered_fast(server)

    rows, answered = run(True)
    assert answered == fast
    assert run(False) == (rows, 0)  # the same row as Python's path gives


# -- a colocated worker busy in Python does not stall its peers --------------------------------

_BUSY_HOST = textwrap.dedent(
    """
    import sys, time
    from kvsparse.server.embedded import EmbeddedServer
    shard = EmbeddedServer("tcp://127.0.0.1:0")
    print(shard.address, flush=True)
    sys.stdin.readline()  # the peer said HELLO and created its table
    sys.setswitchinterval(100)  # this thread keeps the GIL for 100 s unless it waits
    print("busy", flush=True)
    end = time.perf_counter() + float(sys.argv[1])
    n = 0
    while time.perf_counter() < end:
        n += 1  # pure Python: never lets the GIL go
    print("done", n, flush=True)
    sys.stdin.readline()  # the peer's last request was answered: only now may the shard go
    shard.close()
    """
)


def _busy_host_latencies(env: dict, busy_seconds: float) -> list:
    host = subprocess.Popen(
        [sys.executable, "-c", _BUSY_HOST, str(busy_seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        address = host.stdout.readline().strip()
        kv = kvsparse.create("dist_async", servers=[address], rank=0, num_workers=1, timeout=60)
        kv.init("t", kvsparse.SparseTable(dim=16, optimizer=SGD(learning_rate=0.1)))
        ids = np.arange(512)
        kv.row_sparse_pull("t", row_ids=ids)  # the rows exist, as in a job's later steps
        kv.push("t", (ids, np.ones((512, 16), np.float32)))
        # The host's Python serving thread finishes what it does after a reply (holding the
        # shard lock) before the busy loop takes the GIL: if it were still at it, it would
        # hold the lock until the busy loop ends, and the C++ thread would wait with it.
        time.sleep(0.5)
        host.stdin.write("go\n")
        host.stdin.flush()
        assert host.stdout.readline().strip() == "busy"
        latencies = []
        end = time.monotonic() + busy_seconds * 0.8
        while time.monotonic() < end:
            started = time.monotonic()
            kv.row_sparse_pull("t", row_ids=ids)
            kv.push("t", (ids, np.ones((512, 16), np.float32)))
            latencies.append(time.monotonic() - started)
        # The shard closes only when told: a loaded machine may start the last request after
        # the busy loop ended, and a shard closed under it answered "connection refused".
        assert host.stdout.readline().startswith("done")
        kv.close()
        host.stdin.write("close\n")
        host.stdin.flush()
        assert host.wait(30) == 0
        return latencies
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_a_peer_is_served_while_the_colocated_worker_holds_the_gil():
    latencies = _busy_host_latencies(subprocess_env(), busy_seconds=3.0)
    assert len(latencies) > 3
    assert max(latencies) < 1.0, max(latencies)


def test_embedded_server_lock_is_the_shard_lock_and_locked_sees_fast_work():
    shard = EmbeddedServer("tcp://127.0.0.1:0")
    try:
        assert shard.server.fast_path
        kv = kvsparse.create("dist_async", servers=[shard.address], rank=0, num_workers=1)
        kv.init("t", kvsparse.SparseTable(dim=2, optimizer=SGD(learning_rate=1.0)))
        kv.push("t", (np.array([1, 2]), np.ones((2, 2), np.float32)))
        with shard.locked():
            assert shard.state.counters.keys == 2
            assert shard.state.newest_push is not None
        kv.close()
    finally:
        shard.close()


def test_the_fast_path_is_off_with_the_environment_variable():
    from kvsparse import config

    assert config.fast_path({}) is True
    assert config.fast_path({"KVSPARSE_FAST_PATH": "0"}) is False
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_FAST_PATH"):
        config.fast_path({"KVSPARSE_FAST_PATH": "maybe"})
    # `kvsparse server` resolves it once and hands it to the Server it makes.
    code = (
        "import kvsparse.server.main as main\n"
        "def made(bind, **options):\n"
        "    print(options['fast_path'], options['heartbeat_timeout']); raise SystemExit(0)\n"
        "main.Server = made\n"
        "main.main(['--bind', 'tcp://127.0.0.1:0'])\n"
    )
    for variables, expected in (({}, b"True 30.0"), ({"KVSPARSE_FAST_PATH": "0"}, b"False 30.0")):
        variables["KVSPARSE_HEARTBEAT_TIMEOUT"] = "30s"
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=subprocess_env(variables),
            capture_output=True,
            timeout=60,
        )
        assert out.stdout.strip() == expected, out.stderr
    assert zmq.zmq_version_info()[0] >= 4


def test_large_pulls_are_served_fast_and_count_against_the_unread_budget():
    limits = ServerLimits(max_reply_bytes=16 << 20, max_unread_reply_bytes=48 << 20)
    with serving(True, limits=limits) as server:
        client = RawClient(server.address, client_id=12)
        # A peer that does not read: its socket takes one message and a small TCP buffer.
        client.socket.close(0)
        client.socket = zmq.Context.instance().socket(zmq.DEALER)
        client.socket.setsockopt(zmq.LINGER, 0)
        client.socket.setsockopt(zmq.RCVHWM, 1)
        client.socket.setsockopt(zmq.RCVBUF, 1 << 16)
        client.socket.connect(server.address)
        assert client.hello(num_workers=1, mode="asp")[0].status == 0
        spec = kvsparse.SparseTable(dim=1024, initializer=Zeros()).to_dict()
        body = {"table_id": 11, "name": "wide", "spec": spec}
        assert client.request(Op.INIT_SPARSE, [protocol.encode_json(body)])[0].status == 0
        frames, n = pull_request([(11, np.arange(2048), 0)])  # an 8 MiB reply
        sent = 40
        for _ in range(sent):  # none read before all are sent and handled
            client.send(Op.PULL_SPARSE, frames, num_items=n)
        deadline = time.monotonic() + 60
        while requests_handled(server) < sent + 2:  # HELLO, INIT_SPARSE and the pulls
            assert time.monotonic() < deadline
            time.sleep(0.05)
        answered, refused = 0, []
        for _ in range(sent):
            header, payload = client.recv(timeout=60)
            if header.status == 0:
                answered += 1
                assert len(payload[1]) == 8 << 20
            else:
                assert protocol.ERROR_CLASSES[header.status] is errors.LimitExceeded
                refused.append(bytes(payload[0]).decode())
        assert answered >= 1 and refused, (answered, len(refused))
        assert "--max-unread-reply-bytes" in refused[0] and "read the replies" in refused[0]
        assert answered_fast(server) >= 1  # large replies are the C++ thread's too
        # Read now: pulls are answered again.
        for _ in range(3):
            request_id = client.send(Op.PULL_SPARSE, frames, num_items=n)
            header, _ = client.recv(timeout=60)
            assert header.request_id == request_id and header.status == 0
        client.close()


def test_find_libzmq_takes_pyzmqs_own_copy_or_none_when_unsure(tmp_path):
    import os

    from kvsparse.server.fastpath import find_libzmq

    bundled = os.path.join(os.path.dirname(os.path.dirname(zmq.__file__)), "pyzmq.libs")
    ours = os.path.realpath(os.path.join(bundled, "libzmq-abc.so.5.2.5"))
    other = "/usr/lib/x86_64-linux-gnu/libzmq.so.5.2.4"
    third = "/opt/mxnet/libzmq.so.5"

    def maps(*paths) -> str:
        text = "".join(
            f"7f00{i:04x}000-7f00{i:04x}100 r-xp 00000000 08:01 {i} {path}\n"
            for i, path in enumerate(paths)
        )
        text += "7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]\n"
        path = tmp_path / f"maps{len(paths)}-{abs(hash(paths))}"
        path.write_text(text)
        return str(path)

    assert find_libzmq(maps(other, ours, other)) == ours  # pyzmq's bundled copy wins
    assert find_libzmq(maps(other, other)) == other  # the only one (pyzmq built against it)
    assert find_libzmq(maps(other, third)) is None  # which one is pyzmq's? not known: off
    assert find_libzmq(maps()) is None
    assert find_libzmq(str(tmp_path / "missing")) is None
