"""Rows through a worker's shared memory to the servers on its host.

Real server processes on ipc:// sockets (the default turns shared memory on
for them) and on tcp (off unless asked for). Tables built with shared memory
must be bit for bit those built through the sockets, with the C++ fast path
and with Python serving every request; a bad shared request gets an error
that names it and changes nothing; the arena never hands out a region in use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import REPO_ROOT, ServerProcess, subprocess_env
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsparse
from kvsparse import errors
from kvsparse.client import recovery, remote
from kvsparse.client.shared import SharedArena
from kvsparse.wire import ops, protocol

DIM = 8


@pytest.fixture(autouse=True)
def every_size_shared(monkeypatch):
    """Shared memory for the small tables here too (else only from SHARED_MIN_BYTES)."""
    monkeypatch.setattr(remote, "SHARED_MIN_BYTES", 0)


@pytest.fixture(params=[(), ("--no-fast-path",)], ids=["fast_path", "python_path"])
def ipc_servers(request, socket_dir):
    servers = [
        ServerProcess(bind=f"ipc://{socket_dir}/s{i}", extra_args=request.param) for i in range(2)
    ]
    try:
        yield [server.address for server in servers]
    finally:
        for server in servers:
            server.stop()


def spy_offsets(monkeypatch) -> list:
    """Records what each push sends per server: its shared offsets, or None (the socket)."""
    seen = []
    original = remote.RemoteBackend._shared_offsets

    def spy(self, server, entries):
        offsets = original(self, server, entries)
        seen.append(offsets)
        return offsets

    monkeypatch.setattr(remote.RemoteBackend, "_shared_offsets", spy)
    return seen


def train(kv, name: str, seed: int, steps: int = 12, deferred: bool = False) -> np.ndarray:
    """Pulls and pushes Zipf-ish batches; returns every touched row at the end."""
    kv.init(name, kvsparse.SparseTable(dim=DIM, initializer=kvsparse.initializers.Normal(0, 0.1)))
    kv.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=0.1))
    rng = np.random.default_rng(seed)
    touched = set()
    pending = None
    for _ in range(steps):
        ids = (rng.zipf(1.3, 300) % 5000).astype(np.int64)
        touched.update(ids.tolist())
        grads = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        out = np.empty((ids.size, DIM), np.float32)
        if deferred:
            pending = kv.row_sparse_pull(name, out=out, row_ids=ids, wait=False)
            pending.wait()
            kv.push(name, (ids, grads + out), wait=False)
        else:
            kv.row_sparse_pull(name, out=out, row_ids=ids)
            kv.push(name, (ids, grads + out))
    keys = np.array(sorted(touched), np.int64)
    final = np.empty((keys.size, DIM), np.float32)
    kv.row_sparse_pull(name, out=final, row_ids=keys)
    return final


@pytest.mark.parametrize("mode", ["dist_sparse", "dist_async"])
def test_shared_memory_gives_the_tables_the_sockets_give(ipc_servers, monkeypatch, mode):
    seen = spy_offsets(monkeypatch)
    with kvsparse.create(mode, servers=ipc_servers, shared_memory=False) as kv:
        assert kv._backend.shared_servers == frozenset()
        through_sockets = train(kv, "plain", seed=3)
    assert seen and all(offsets is None for offsets in seen)
    seen.clear()
    with kvsparse.create(mode, servers=ipc_servers) as kv:  # ipc: shared by default
        assert kv._backend.shared_servers == frozenset({0, 1})
        through_memory = train(kv, "shared", seed=3)
    assert seen and all(offsets is not None for offsets in seen)
    np.testing.assert_array_equal(through_memory, through_sockets)


def test_small_calls_go_through_the_socket(ipc_servers, monkeypatch):
    monkeypatch.setattr(remote, "SHARED_MIN_BYTES", 256 << 10)
    seen = spy_offsets(monkeypatch)
    blocks = []
    original = remote.RemoteBackend._shared_blocks

    def spy_blocks(self, *args):
        found = original(self, *args)
        blocks.append(bool(found))
        return found

    monkeypatch.setattr(remote.RemoteBackend, "_shared_blocks", spy_blocks)
    with kvsparse.create("dist_sparse", servers=ipc_servers) as kv:
        assert kv._backend.shared_servers == frozenset({0, 1})
        kv.init("t", kvsparse.SparseTable(dim=64))
        small, large = np.arange(100), np.arange(2000)  # 25 KiB, 500 KiB of rows
        for ids in (small, large):
            kv.row_sparse_pull("t", out=np.empty((ids.size, 64), np.float32), row_ids=ids)
            kv.push("t", (ids, np.ones((ids.size, 64), np.float32)))
    assert seen[0] is None and seen[1] is None  # the small push, to each server
    assert seen[2] is not None and seen[3] is not None
    assert blocks == [False, True]  # the small pull through the socket, the large one not


def test_deferred_pulls_and_pushes_through_shared_memory(ipc_servers):
    with kvsparse.create("dist_async", servers=ipc_servers, shared_memory=False) as kv:
        expected = train(kv, "plain", seed=5, deferred=True)
    with kvsparse.create("dist_async", servers=ipc_servers) as kv:
        assert kv._backend.defers_pulls
        got = train(kv, "shared", seed=5, deferred=True)
    np.testing.assert_array_equal(got, expected)


def test_pulled_rows_stay_valid_while_later_steps_run(ipc_servers):
    """A pull's rows in the segment are not reused while the caller holds them."""
    with kvsparse.create("dist_sparse", servers=ipc_servers) as kv:
        kv.init("t", kvsparse.SparseTable(dim=DIM, initializer=kvsparse.initializers.Normal()))
        ids = np.arange(100, dtype=np.int64)
        table_id = kv._keys.info("t").table_id
        plan_keys = np.sort(ids)  # any grouping: the backend takes keys and offsets as given
        offsets = np.array([0, 50, 100], np.int64)
        held = kv._backend.pull_sparse([(table_id, plan_keys, offsets)])
        copy = [rows.copy() for rows in held[0]]
        assert kv._backend._arena.offset_of(held[0][0]) is not None  # in the segment
        for _ in range(50):  # many more pulls, which would wrap a ring that reused it
            kv.row_sparse_pull("t", out=np.empty((100, DIM), np.float32), row_ids=ids + 1000)
        for rows, before in zip(held[0], copy):
            np.testing.assert_array_equal(rows, before)


def test_kvsparse_launch_gives_its_workers_shared_memory(tmp_path):
    """The launcher's default: servers on ipc sockets, which map each worker's segment."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import kvsparse\n"
        "kv = kvsparse.create('dist_async')\n"
        "print('servers', *kv._backend.servers)\n"
        "print('shared', *sorted(kv._backend.shared_servers))\n"
        "kv.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvsparse", "launch", "-s", "2", "-n", "1", "--"]
        + [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    servers = next(line for line in done.stdout.splitlines() if " servers " in line).split()
    assert all(address.startswith("ipc://") for address in servers[3:]), servers
    assert "[worker 0] shared 0 1" in done.stdout, done.stdout


def test_tcp_servers_share_memory_when_asked(server_factory, monkeypatch):
    addresses = server_factory(2)
    with kvsparse.create("dist_sparse", servers=addresses) as kv:
        assert kv._backend.shared_servers == frozenset()  # tcp: the socket by default
    with kvsparse.create("dist_sparse", servers=addresses, shared_memory=True) as kv:
        assert kv._backend.shared_servers == frozenset({0, 1})
    with kvsparse.create("dist_sparse", servers=addresses, shared_memory=1 << 20) as kv:
        assert kv._backend._arena.size == 1 << 20


@pytest.mark.parametrize("value", ["yes", 1.5, 4096, -1])
def test_a_bad_shared_memory_setting_is_refused(ipc_servers, value):
    with pytest.raises(errors.InvalidArgument, match="shared_memory"):
        kvsparse.create("dist_sparse", servers=ipc_servers, shared_memory=value)


@pytest.mark.parametrize("first", ["small", "shared"])
@pytest.mark.parametrize("path", [(), ("--no-fast-path",)], ids=["fast_path", "python_path"])
def test_a_restarted_server_maps_the_segment_again(socket_dir, tmp_path, monkeypatch, first, path):
    """With a retry window rows go through shared memory too. A server restarted from its
    checkpoint holds no segment until greeted: a shared request that finds it first is
    refused and recovered (the greeting maps the segment, then the resend); a small
    request (through the socket) that finds it first is answered, and the next shared
    one is refused with SharedMemoryMissing: the worker greets it again and resends. No
    push is lost or applied twice: the table equals a local store's."""
    monkeypatch.setattr(remote, "SHARED_MIN_BYTES", 1024)  # one row goes through the socket
    seen = spy_offsets(monkeypatch)
    greeted_again = []
    original = recovery.Recovery.greet_again

    def spy(self, server, request, deadline):
        greeted_again.append(server)
        return original(self, server, request, deadline)

    monkeypatch.setattr(recovery.Recovery, "greet_again", spy)
    address, ckpt = f"ipc://{socket_dir}/restarted", str(tmp_path / "ckpt")
    server, replacement = ServerProcess(bind=address, extra_args=path), None
    big, small = np.arange(500, dtype=np.int64), np.array([7], np.int64)
    reference = kvsparse.create("local")
    try:
        kv = kvsparse.create(
            "dist_async", servers=[address], rank=0, num_workers=1, retry_window=30
        )
        assert kv._backend.shared_servers == frozenset({0})
        table = kvsparse.SparseTable(dim=DIM, initializer=kvsparse.initializers.Normal(0, 0.1))
        for store in (kv, reference):
            store.init("t", table)
            store.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=0.1))
            store.push("t", (big, np.ones((big.size, DIM), np.float32)))
        assert seen[-1] is not None  # through the segment
        kv.save(ckpt)
        server.kill()
        restore = ("--restore", ckpt, "--shard-index", "0", "--num-shards", "1", "--restarted")
        replacement = ServerProcess(bind=address, extra_args=(*path, *restore))
        ids = small if first == "small" else big
        for store in (kv, reference):
            store.push("t", (ids, np.full((ids.size, DIM), 0.5, np.float32)))
            store.push("t", (big, np.full((big.size, DIM), 0.25, np.float32)))
        assert seen[-1] is not None  # through the segment again
        assert greeted_again == ([0] if first == "small" else [])
        np.testing.assert_array_equal(
            kv.row_sparse_pull("t", row_ids=big), reference.row_sparse_pull("t", row_ids=big)
        )
        kv.close()
    finally:
        server.stop()
        if replacement is not None:
            replacement.stop()


def test_sixteen_bit_rows_go_through_the_socket(ipc_servers, monkeypatch):
    seen = spy_offsets(monkeypatch)
    with kvsparse.create("dist_sparse", servers=ipc_servers, wire_dtype="bfloat16") as kv:
        assert kv._backend.shared_servers == frozenset({0, 1})
        got = train(kv, "half", seed=7, steps=4)
    assert seen and all(offsets is None for offsets in seen)
    with kvsparse.create("local", wire_dtype="bfloat16") as kv:
        expected = train(kv, "half", seed=7, steps=4)
    np.testing.assert_array_equal(got, expected)


def test_a_server_that_cannot_map_the_segment_leaves_the_rows_on_the_socket(
    ipc_servers, monkeypatch
):
    original = SharedArena.offer

    def wrong_token(self):
        offer = original(self)
        offer["token"] = "00" * 16
        return offer

    monkeypatch.setattr(SharedArena, "offer", wrong_token)
    with kvsparse.create("dist_sparse", servers=ipc_servers) as kv:
        assert kv._backend.shared_servers == frozenset()
        assert kv._backend._arena is None
        rows = train(kv, "t", seed=9, steps=3)
    with kvsparse.create("local") as kv:
        np.testing.assert_array_equal(rows, train(kv, "t", seed=9, steps=3))


def test_hello_reply_names_why_a_segment_was_refused(ipc_servers):
    with kvsparse.create("dist_sparse", servers=ipc_servers, shared_memory=False) as kv:
        session = kv._backend.session
        hello = ops.HelloRequest(1, ops.Mode.BSP, None, 0, 2, 0)
        bad = hello._replace(shared={"pid": 1, "fd": 0, "bytes": 4096, "token": "00" * 16})
        answer = session.exchange({0: ops.Hello.encode_request(bad)})[0]
        reply = ops.Hello.decode_reply(answer.header, answer.payload)
        assert reply.shared is False and reply.shared_error


def test_a_segment_that_could_shrink_is_refused(ipc_servers):
    """A mapped file that shrinks would fault in the server: only sealed memfds are taken."""
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 1 << 16)
        token = os.urandom(16)
        os.pwrite(fd, token, 0)
        offer = {"pid": os.getpid(), "fd": fd, "bytes": 1 << 16, "token": token.hex()}
        with kvsparse.create("dist_sparse", servers=ipc_servers, shared_memory=False) as kv:
            hello = ops.HelloRequest(1, ops.Mode.BSP, None, 0, 2, 0, offer)
            answer = kv._backend.session.exchange({0: ops.Hello.encode_request(hello)})[0]
            reply = ops.Hello.decode_reply(answer.header, answer.payload)
            assert reply.shared is False and "sealed" in reply.shared_error
    finally:
        os.close(fd)


def shared_request(kv, op, offsets, rows=None, dim=DIM):
    """A FLAG_SHARED PULL_SPARSE or PUSH_SPARSE of 10 keys of table "t" to server 0."""
    table_id = kv._keys.info("t").table_id
    keys = np.arange(10, dtype=np.int64) * 2  # any keys: a server takes what it is sent
    if op == "pull":
        request = ops.PullSparse.encode_request([(table_id, keys)], offsets, [dim])
    else:
        push = ops.SparsePush(table_id, keys, rows, True)
        request = ops.PushSparse.encode_request([push], offsets)
    return kv._backend.session.exchange({0: request})


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("where", ["past_the_end", "misaligned", "no_segment"])
def test_bad_shared_requests_are_refused_and_change_nothing(ipc_servers, op, where):
    shared = where != "no_segment"
    with kvsparse.create("dist_async", servers=ipc_servers, shared_memory=shared) as kv:
        kv.init("t", kvsparse.SparseTable(dim=DIM, initializer=kvsparse.initializers.Normal()))
        kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
        ids = np.arange(10, dtype=np.int64) * 2
        before = np.empty((10, DIM), np.float32)
        kv.row_sparse_pull("t", out=before, row_ids=ids)
        size = kv._backend._arena.size if shared else 1 << 20
        offset = {"past_the_end": size - 64, "misaligned": 4098, "no_segment": 4096}[where]
        rows = np.ones((10, DIM), np.float32)
        with pytest.raises(errors.ProtocolError) as raised:
            shared_request(kv, op, [offset], rows)
        message = str(raised.value)
        assert "shared" in message or "offset" in message
        after = np.empty((10, DIM), np.float32)
        kv.row_sparse_pull("t", out=after, row_ids=ids)  # the server still serves
        np.testing.assert_array_equal(after, before)
        kv.push("t", (ids, np.ones((10, DIM), np.float32)))  # and applies good pushes
        kv.row_sparse_pull("t", out=after, row_ids=ids)
        np.testing.assert_allclose(after, before - 1.0, rtol=1e-6)


def test_a_pull_into_room_for_another_dim_writes_nothing(ipc_servers):
    """The rows of a table wider than the client made room for would spill into the next
    region: refused before anything is written."""
    with kvsparse.create("dist_async", servers=ipc_servers) as kv:
        kv.init("t", kvsparse.SparseTable(dim=DIM, initializer=kvsparse.initializers.Normal()))
        room = kv._backend._arena.rows(20, DIM // 2)  # 10 rows of DIM: 20 of DIM // 2
        room[...] = 7.0
        with pytest.raises(errors.ShapeError, match="dim"):
            shared_request(kv, "pull", [kv._backend._arena.offset_of(room)], dim=DIM // 2)
        assert (room == 7.0).all()


def test_a_lost_exchange_keeps_its_region(socket_dir):
    """A server that never answers may still write into the region later: never reused."""
    server = ServerProcess(bind=f"ipc://{socket_dir}/s0")
    try:
        kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=1.0)
        kv.init("t", kvsparse.SparseTable(dim=DIM))
        arena = kv._backend._arena
        server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(errors.KVSparseError):
                kv.row_sparse_pull("t", out=np.empty((5, DIM), np.float32), row_ids=np.arange(5))
            assert len(arena._kept) == 1 and arena._kept[0].shape == (5, DIM)
        finally:
            server.process.send_signal(signal.SIGCONT)
        kv.close()
    finally:
        server.stop()


# -- the arena's ring ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), min_size=1, max_size=60
    )
)
def test_the_arena_never_hands_out_a_region_in_use(script):
    arena = SharedArena.create(1 << 16)
    held = []
    try:
        for allocate, rows, pick in script:
            if allocate or not held:
                array = arena.rows(rows, DIM)
                if array is None:
                    # Full: it may only be full if the regions in use leave no gap that fits.
                    assert held, "an empty arena refused a region that fits"
                    continue
                offset = arena.offset_of(array)
                assert offset is not None and offset % 64 == 0
                assert offset + array.nbytes <= arena.size
                array[...] = len(held) + 1
                held.append((array, len(held) + 1))
            else:
                held.pop(pick % len(held))
            for array, mark in held:  # nobody else wrote into a region in use
                assert (array == mark).all()
                array[...] = mark
            spans = sorted((arena.offset_of(a), arena.offset_of(a) + a.nbytes) for a, _ in held)
            assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    finally:
        held.clear()
        arena.close()


def test_the_arena_shared_by_threads_never_hands_out_a_region_in_use():
    """Regions are handed out on one thread and come back on whichever drops the last view
    (the store's caller, an adapter's thread): each thread's regions keep their contents."""
    arena = SharedArena.create(1 << 18)
    errors_seen = []

    def work(mark: float):
        rng = np.random.default_rng(int(mark))
        held = []
        try:
            for _ in range(3000):
                if held and (rng.random() < 0.5 or len(held) > 6):
                    array = held.pop(int(rng.integers(len(held))))
                    assert (array == mark).all(), "another thread wrote into a region in use"
                    continue
                array = arena.rows(int(rng.integers(1, 60)), DIM)
                if array is not None:
                    array[...] = mark
                    held.append(array)
        except AssertionError as exc:
            errors_seen.append(exc)

    threads = [threading.Thread(target=work, args=(float(k + 1),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors_seen
    assert arena.rows((arena.size - 4096) // (4 * DIM), DIM) is not None  # all came back
    arena.close()


def test_an_arena_region_comes_back_only_when_every_view_is_gone():
    arena = SharedArena.create(4096 + 64 * 100)
    whole = arena.rows(100, 16)  # 64-byte rows: the whole ring
    assert whole is not None and arena.rows(1, 16) is None
    view = whole[10:20]
    del whole
    assert arena.rows(1, 16) is None  # a view still holds the region
    del view
    assert arena.rows(100, 16) is not None  # (dropped at once: free again)
    again = arena.rows(10, 16)
    assert again is not None
    arena.keep_forever([again])
    del again
    assert arena.rows(100, 16) is None  # a kept region is never handed out again
    assert arena.rows(90, 16) is not None  # the rest of the ring is
    arena.close()


def test_shared_flag_on_another_op_is_refused():
    header = protocol.Header(op=protocol.Op.PING, flags=protocol.FLAG_SHARED)
    with pytest.raises(errors.ProtocolError, match="FLAG_SHARED"):
        protocol.unpack_header(header.pack())


def test_shared_flag_is_known_to_the_protocol():
    assert protocol.FLAG_SHARED & protocol.KNOWN_FLAGS
    request = ops.PullSparse.encode_request([(1, np.arange(3, dtype=np.int64))], [4096], [8])
    header = protocol.Header(
        op=request.op, flags=request.flags, num_items=1, num_frames=len(request.frames)
    )
    decoded = ops.PullSparse.decode_request(header, request.frames)
    assert decoded.offsets.tolist() == [4096]
