"""A push sent without waiting for the servers' acknowledgements (``push(..., wait=False)``).

Over real servers on 127.0.0.1: the next call of the store collects the
acknowledgements before it sends anything, so it reads what the push wrote,
and it raises the push's failure (a server's UpdateOverflow here: the servers
refuse it, the client cannot know). close() collects them too.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import ServerProcess, subprocess_env

import kvsparse
from kvsparse import errors, initializers, optimizers
from kvsparse.client.session import Session
from kvsparse.wire import ops

_names = itertools.count()
ZEROS = initializers.Zeros()
SGD_1 = optimizers.SGD(learning_rate=1.0)


@pytest.fixture(scope="module")
def servers(module_server_factory):
    return module_server_factory(2)


@pytest.fixture
def kv(servers):
    store = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1, timeout=30)
    yield store
    store.close()


def fresh() -> str:
    return f"push_wait_{next(_names)}"


def overflowing_table(kv) -> str:
    """A table whose SGD step overflows float32 for a gradient of 1e10 (the server refuses)."""
    key = fresh()
    spec = kvsparse.SparseTable(
        dim=2, initializer=ZEROS, optimizer=optimizers.SGD(learning_rate=1e30)
    )
    kv.init(key, spec)
    return key


def test_the_next_pull_reads_what_a_push_sent_without_waiting_wrote(kv):
    key = fresh()
    table = kvsparse.SparseTable(dim=3, optimizer=optimizers.Adagrad(learning_rate=0.1), seed=4)
    local = kvsparse.create("local")
    ids = np.array([5, -7, 5, 2**40, 11], np.int64)
    grads = np.arange(15, dtype=np.float32).reshape(5, 3) / 7
    for store in (kv, local):
        store.init(key, table)
        for step in range(3):
            store.push(key, (ids, grads * (step + 1)), wait=False)
    assert kv.clock == local.clock == 3
    np.testing.assert_array_equal(
        kv.row_sparse_pull(key, row_ids=ids), local.row_sparse_pull(key, row_ids=ids)
    )


def test_dense_pushes_sent_without_waiting_apply_in_order(kv):
    key = fresh()
    kv.init(key, np.zeros(6, np.float32))
    kv.push(key, np.ones(6, np.float32), wait=False)
    kv.push(key, np.full(6, 2.0, np.float32), wait=False)  # collects the first one's
    np.testing.assert_array_equal(kv.pull(key), np.full(6, 2.0, np.float32))


def test_a_failed_push_is_raised_by_the_next_call_which_sends_nothing(kv):
    key = overflowing_table(kv)
    other = fresh()
    kv.init(other, kvsparse.SparseTable(dim=2, initializer=ZEROS))
    # One id: a push is all or nothing per server, not across servers (docs/operations.md).
    bad = (np.array([1], np.int64), np.array([[1e10, 0.0]], np.float32))
    kv.push(key, bad, wait=False)  # returns: the servers have not answered yet
    with pytest.raises(errors.UpdateOverflow, match="id 1 overflows") as raised:
        kv.push(other, (np.array([3], np.int64), np.ones((1, 2), np.float32)))
    if hasattr(raised.value, "__notes__"):  # Python 3.11+
        assert "earlier push" in " ".join(raised.value.__notes__)
    # Nothing of the failed push was applied, and the push that raised was not sent.
    np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=[1]), np.zeros((1, 2)))
    np.testing.assert_array_equal(kv.row_sparse_pull(other, row_ids=[3]), np.zeros((1, 2)))
    # The store goes on: the same push without the overflowing gradient goes through.
    kv.push(key, (np.array([2], np.int64), np.array([[1e-30, 0.0]], np.float32)), wait=False)
    np.testing.assert_allclose(kv.row_sparse_pull(key, row_ids=[2])[0], [-1.0, 0.0])


def test_close_collects_a_pending_push_and_raises_its_failure(servers):
    kv = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1, timeout=30)
    key = overflowing_table(kv)
    kv.push(key, (np.array([4], np.int64), np.array([[1e10, 0.0]], np.float32)), wait=False)
    with pytest.raises(errors.UpdateOverflow, match="id 4"):
        kv.close()
    kv.close()  # closed all the same: idempotent, and nothing left to raise
    with pytest.raises(errors.InvalidArgument, match="closed"):
        kv.row_sparse_pull(key, row_ids=[4])


def test_close_collects_a_pending_push_that_succeeded(servers):
    key = fresh()
    with kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1) as kv:
        kv.init(key, kvsparse.SparseTable(dim=2, initializer=ZEROS, optimizer=SGD_1))
        kv.push(key, (np.array([8], np.int64), np.ones((1, 2), np.float32)), wait=False)
    with kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1) as kv:
        kv.init(key, kvsparse.SparseTable(dim=2, initializer=ZEROS, optimizer=SGD_1))
        np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=[8]), [[-1.0, -1.0]])


def run_program(servers, body: str) -> subprocess.CompletedProcess:
    """Runs a program that opens a store on servers, runs body, and ends without close()."""
    program = textwrap.dedent(
        f"""
        import numpy as np
        import kvsparse
        from kvsparse import initializers, optimizers
        kv = kvsparse.create("dist_sparse", servers={list(servers)!r}, rank=0, num_workers=1)
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip


def test_a_program_ending_right_after_a_push_without_waiting_still_applies_it(servers):
    # The sockets close with LINGER 0: without the exit hook that reads the replies, a
    # 64 MB push still queued when the program ended was dropped (seen here: all zeros).
    key = fresh()
    done = run_program(
        servers,
        f"""
        spec = kvsparse.SparseTable(
            dim=16, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
        )
        kv.init({key!r}, spec)
        ids = np.arange(1_000_000, dtype=np.int64)
        kv.push({key!r}, (ids, np.ones((ids.size, 16), np.float32)), wait=False)
        """,
    )
    assert done.returncode == 0, done.stderr
    with kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1) as kv:
        kv.init(key, kvsparse.SparseTable(dim=16, initializer=ZEROS, optimizer=SGD_1))
        rows = kv.row_sparse_pull(key, row_ids=np.arange(0, 1_000_000, 997, dtype=np.int64))
    np.testing.assert_array_equal(rows, -np.ones_like(rows))


def test_a_push_without_waiting_that_fails_at_exit_is_logged(servers):
    key = fresh()
    done = run_program(
        servers,
        f"""
        spec = kvsparse.SparseTable(
            dim=2, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1e30)
        )
        kv.init({key!r}, spec)
        kv.push({key!r}, (np.array([5], np.int64), np.array([[1e10, 0.0]], np.float32)), wait=False)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "at exit, a push sent with wait=False failed" in done.stderr
    assert "id 5" in done.stderr


def test_an_exit_waits_at_most_ten_seconds_for_a_server_that_does_not_answer():
    # The store's timeout is 60 s; at exit the wait is capped (a dead server must not
    # hang the program's end), and the lost push is logged.
    server = ServerProcess()
    try:
        started = time.monotonic()
        done = run_program(
            [server.address],
            f"""
            import os, signal, time
            kv.init("t", kvsparse.SparseTable(dim=2))
            os.kill({server.process.pid}, signal.SIGSTOP)
            # A stop takes effect asynchronously: on a loaded machine a server thread that
            # is running may still take the push. Send it once the whole process stopped.
            def stopped():
                task = "/proc/{server.process.pid}/task"
                for thread in os.listdir(task):
                    with open(f"{{task}}/{{thread}}/stat") as stat:
                        if stat.read().rpartition(")")[2].split()[0] not in ("T", "t"):
                            return False
                return True
            for _ in range(500):
                if stopped():
                    break
                time.sleep(0.01)
            assert stopped(), "the server did not stop"
            kv.push("t", (np.array([1], np.int64), np.ones((1, 2), np.float32)), wait=False)
            """,
        )
        elapsed = time.monotonic() - started
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
    assert done.returncode == 0, done.stderr
    assert "at exit, a push sent with wait=False failed" in done.stderr
    assert elapsed < 40, elapsed


def test_a_local_store_applies_a_push_without_waiting_at_once():
    kv = kvsparse.create("local")
    key = overflowing_table(kv)
    with pytest.raises(errors.UpdateOverflow):  # nothing to defer in process
        kv.push(key, (np.array([1], np.int64), np.array([[1e10, 0.0]], np.float32)), wait=False)
    kv.close()


def test_only_a_push_may_skip_waiting(servers):
    session = Session(servers, timeout=5)
    try:
        for kwargs in ({}, {"push": True, "gather": True}):
            with pytest.raises(errors.InvalidArgument, match="wait=False"):
                session.exchange({0: ops.Ping.encode_request()}, wait=False, **kwargs)
    finally:
        session.close()


def test_frames_below_the_copy_threshold_are_copied(servers):
    # pyzmq sends frames of copy_threshold bytes and more from their own memory; below,
    # a copy is cheaper than the zero-copy bookkeeping (kvsparse.client.sockets).
    from kvsparse.client.sockets import COPY_THRESHOLD

    session = Session(servers, timeout=5)
    try:
        assert session.exchange({0: ops.Ping.encode_request()})  # the sockets exist
        assert session._links.socket(0).copy_threshold == COPY_THRESHOLD == 256 * 1024
    finally:
        session.close()


def _spy_on_session(session, monkeypatch) -> list:
    """Records the ops sent and when pending push replies are collected, in order."""
    events = []
    send, settle = session._send, session._settle_deferred

    def spied_send(server, request, request_id=None):
        events.append(("send", ops.Op(request.op).name))
        return send(server, request, request_id)

    def spied_settle():
        if session._deferred:
            events.append(("collect", None))
        settle()

    monkeypatch.setattr(session, "_send", spied_send)
    monkeypatch.setattr(session, "_settle_deferred", spied_settle)
    return events


def test_a_pull_goes_out_behind_a_push_whose_acknowledgements_are_pending(kv, monkeypatch):
    key = fresh()
    kv.init(key, kvsparse.SparseTable(dim=2, initializer=ZEROS, optimizer=SGD_1))
    events = _spy_on_session(kv._backend.session, monkeypatch)
    ids = np.arange(-8, 8, dtype=np.int64)
    kv.push(key, (ids, np.ones((16, 2), np.float32)), wait=False)
    rows = kv.row_sparse_pull(key, row_ids=ids)
    np.testing.assert_array_equal(rows, -np.ones((16, 2)))  # the pull read the push
    pushes = [("send", "PUSH_SPARSE")] * 2
    assert events == pushes + [("send", "PULL_SPARSE")] * 2 + [("collect", None)]
    events.clear()
    kv.push(key, (ids, np.ones((16, 2), np.float32)), wait=False)
    kv.push(key, (ids, np.ones((16, 2), np.float32)))  # a push never goes out behind one
    assert events == pushes + [("collect", None)] + pushes


def test_a_failed_push_is_raised_by_the_pull_that_went_out_behind_it(kv):
    key = overflowing_table(kv)
    kv.push(key, (np.array([6], np.int64), np.array([[1e10, 0.0]], np.float32)), wait=False)
    with pytest.raises(errors.UpdateOverflow, match="id 6"):
        kv.row_sparse_pull(key, row_ids=[6, 7])
    # The pull's own replies arrive later and are left unread; the next calls are not
    # confused by them.
    for _ in range(3):
        np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=[6, 7]), np.zeros((2, 2)))
        kv.push(key, (np.array([7], np.int64), np.zeros((1, 2), np.float32)), wait=False)


@pytest.mark.parametrize(
    "mode, workers, retry_window, local, allowed",
    [
        ("bsp", 1, 0.0, False, True),
        ("asp", 4, 0.0, False, True),
        ("ssp", 4, 0.0, False, True),
        ("bsp", 2, 0.0, False, False),  # the server holds the push for the round
        ("bsp", 1, 5.0, False, False),  # a restarted server gets the request in flight only
        ("asp", 1, 0.0, True, False),  # a colocated worker's own shard
    ],
)
def test_pulls_follow_pending_pushes_only_where_pushes_are_answered_at_once(
    mode, workers, retry_window, local, allowed
):
    from kvsparse.client.remote import pulls_may_follow_pending_pushes

    assert pulls_may_follow_pending_pushes(mode, workers, retry_window, local) is allowed


# -- pulls sent without waiting (row_sparse_pull(..., wait=False)) --------------------------


def test_a_deferred_pull_reads_the_rows_as_of_when_it_was_sent(kv, monkeypatch):
    key = fresh()
    kv.init(key, kvsparse.SparseTable(dim=2, initializer=ZEROS, optimizer=SGD_1))
    assert kv.defers_pulls
    events = _spy_on_session(kv._backend.session, monkeypatch)
    ids = np.arange(-8, 8, dtype=np.int64)
    kv.push(key, (ids, np.ones((16, 2), np.float32)), wait=False)
    out = np.full((16, 2), np.nan, np.float32)
    pending = kv.row_sparse_pull(key, out=out, row_ids=ids, wait=False)
    # Sent behind the push, nothing read yet: the store returned at once.
    pushes, pulls = [("send", "PUSH_SPARSE")] * 2, [("send", "PULL_SPARSE")] * 2
    assert events == pushes + pulls and not pending.done
    # A push after it (which first reads the replies before it) does not change its rows.
    kv.push(key, (ids, np.ones((16, 2), np.float32)), wait=False)
    assert events == pushes + pulls + [("collect", None)] + pushes
    assert pending.wait() is out and pending.done
    np.testing.assert_array_equal(out, -np.ones((16, 2)))
    assert pending.wait() is out  # again: the same result
    np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=ids), -2 * np.ones((16, 2)))


def test_deferred_pulls_of_several_tables_stack_and_are_read_in_order(kv):
    first, second = fresh(), fresh()
    for key in (first, second):
        kv.init(key, kvsparse.SparseTable(dim=3, initializer=ZEROS, optimizer=SGD_1))
    ids = np.array([4, 9, 4, 2**50], np.int64)
    pendings = []
    for _ in range(3):
        kv.push([first, second], [(ids, np.ones((4, 3), np.float32))] * 2, wait=False)
        pendings.append(kv.row_sparse_pull([first, second], row_ids=[ids, ids[:2]], wait=False))
    for step, pending in reversed(list(enumerate(pendings))):  # read in any order
        rows_first, rows_second = pending.wait()
        expected = np.where(ids[:, None] == 4, -2.0, -1.0) * (step + 1)
        np.testing.assert_array_equal(rows_first, np.broadcast_to(expected, (4, 3)))
        np.testing.assert_array_equal(rows_second, np.broadcast_to(expected[:2], (2, 3)))


def test_a_failed_push_is_raised_by_the_deferred_pull_behind_it(kv):
    key = overflowing_table(kv)
    kv.push(key, (np.array([6], np.int64), np.array([[1e10, 0.0]], np.float32)), wait=False)
    pending = kv.row_sparse_pull(key, row_ids=[6, 7], wait=False)
    with pytest.raises(errors.UpdateOverflow, match="id 6"):
        pending.wait()
    with pytest.raises(errors.UpdateOverflow):  # asked again: the same failure
        pending.wait()
    np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=[6, 7]), np.zeros((2, 2)))


def test_a_deferred_pulls_failure_waits_for_it_and_close_reads_its_replies(servers):
    """A pull's own failure (an unknown table here) is raised by its result only; the
    exchanges in between and close() go on."""
    session = Session(servers, timeout=30)
    try:
        session.open(
            {
                s: ops.Hello.encode_request(ops.HelloRequest(1, ops.Mode.BSP, None, 0, 2, s))
                for s in range(2)
            }
        )
        bad = ops.PullSparse.encode_request([(0xBAD, np.array([1], np.int64), "float32")])
        pending = session.exchange({0: bad}, pipelined=True, wait=False)
        assert session.exchange({1: ops.Ping.encode_request()})  # reads the pull's reply first
        assert pending.done
        with pytest.raises(errors.KVSparseError, match="(?i)table"):
            pending.result()
        later = session.exchange({0: bad}, pipelined=True, wait=False)
    finally:
        session.close()  # reads the replies of later, keeps its failure
    assert later.done
    with pytest.raises(errors.KVSparseError):
        later.result()


def test_a_pull_without_waiting_is_done_at_once_where_pulls_are_not_deferred():
    local = kvsparse.create("local")
    key = fresh()
    local.init(key, kvsparse.SparseTable(dim=2, initializer=ZEROS, optimizer=SGD_1))
    assert not local.defers_pulls
    pending = local.row_sparse_pull(key, row_ids=[1, 2], wait=False)
    local.push(key, (np.array([1], np.int64), np.ones((1, 2), np.float32)))
    np.testing.assert_array_equal(pending.wait(), np.zeros((2, 2)))  # pulled before the push
    session = Session(["tcp://127.0.0.1:1"], timeout=0.1, monitor=True)
    try:
        with pytest.raises(errors.InvalidArgument, match="pipelined"):
            session.exchange({0: ops.Ping.encode_request()}, wait=False)
    finally:
        session.close()


def _wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.005)


def test_a_deferred_pull_another_thread_is_reading_waits_for_its_replies(server_factory):
    """Thread A's push reads the replies of thread B's deferred pull first, and hands the
    session to B mid-way (the servers are stopped): B's wait must not return before them.

    Found by the stress harness (two threads sharing a store, tcp-ssp-threads): B's
    result came back without server 0's reply (a KeyError(0)).
    """
    servers = [ServerProcess(), ServerProcess()]
    server_factory.processes.extend(servers)
    addresses = [server.address for server in servers]
    kv = kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1, timeout=30)
    try:
        key = fresh()
        kv.init(key, kvsparse.SparseTable(dim=2, initializer=ZEROS, optimizer=SGD_1))
        ids = np.arange(-6, 6, dtype=np.int64)
        kv.push(key, (ids, np.ones((12, 2), np.float32)))
        session = kv._backend.session
        for server in servers:
            server.process.send_signal(signal.SIGSTOP)
        try:
            pending = kv.row_sparse_pull(key, row_ids=ids, wait=False)
            assert len(session._deferred) == 1 and not pending.done
            errors_seen = []

            def push_in_a_thread():
                try:
                    kv.push(key, (ids, np.ones((12, 2), np.float32)))
                except BaseException as exc:  # noqa: BLE001 - checked below
                    errors_seen.append(exc)

            other = threading.Thread(target=push_in_a_thread)
            other.start()
            # The push reads the pull's replies first, and waits for them.
            first = session._deferred[0]
            _wait_until(lambda: first._reading)
            timer = threading.Timer(
                0.5, lambda: [s.process.send_signal(signal.SIGCONT) for s in servers]
            )
            timer.start()
            rows = pending.wait()  # hands A a turn, then waits for A to read the replies
            timer.join()
            other.join(30)
            assert not other.is_alive() and not errors_seen
        finally:
            for server in servers:
                server.process.send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(rows, -np.ones((12, 2), np.float32))
        assert pending.done
        np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=ids), -2 * np.ones((12, 2)))
    finally:
        kv.close()
