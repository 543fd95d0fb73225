"""Hardening: failed batches change nothing; a restarted server goes on as before.

- A push of several keys to one server is applied all or nothing there: one
  key's update failing (an overflow) leaves every key of the request as it
  was, on the local store and on a real server (ASP and BSP).
- A dense key whose finite gradient overflows raises UpdateOverflow and keeps
  its values, as sparse tables do.

Overflow is made with SGD at learning rate 1e38: a gradient of 10 takes a row
to -1e39, past float32; a gradient of 1e-30 moves it by 1e8, which is finite.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import kvsparse
from kvsparse import errors
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD
from tests.conftest import ServerProcess

HUGE_LR = 1e38
SMALL, OVERFLOWING = 1e-30, 10.0


def _store(kind: str, server_factory, **options):
    if kind == "local":
        return kvsparse.create("local")
    return kvsparse.create(kind, servers=server_factory(1), rank=0, num_workers=1, **options)


def _rows(value: float, n: int = 3, dim: int = 2) -> np.ndarray:
    return np.full((n, dim), value, np.float32)


# -- a push of several keys is all or nothing per server ------------------------------------


@pytest.mark.parametrize("kind", ["local", "dist_async", "dist_sync"])
def test_multi_table_push_with_one_overflowing_table_changes_no_table(kind, server_factory):
    kv = _store(kind, server_factory)
    sgd = SGD(learning_rate=HUGE_LR)
    for name in ("a", "b"):
        kv.init(name, kvsparse.SparseTable(dim=2, initializer=Zeros(), optimizer=sgd))
    ids = np.array([1, 2, 3])
    kv.push(["a", "b"], [(ids, _rows(SMALL)), (ids, _rows(SMALL))])  # stored rows in both
    before = [kv.row_sparse_pull(k, row_ids=np.arange(6)) for k in ("a", "b")]
    stats_before = kv._backend.stats()[0]["tables"]
    # "a": existing rows and a new id 4, all finite; "b": id 2's update overflows.
    grads_a = (np.array([1, 4]), _rows(SMALL, 2))
    grads_b = (ids, np.array([[SMALL] * 2, [OVERFLOWING] * 2, [SMALL] * 2], np.float32))
    with pytest.raises(errors.UpdateOverflow, match="id 2"):
        kv.push(["a", "b"], [grads_a, grads_b])
    after = [kv.row_sparse_pull(k, row_ids=np.arange(6)) for k in ("a", "b")]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert kv._backend.stats()[0]["tables"]["a"]["rows"] == stats_before["a"]["rows"] == 3
    # The same push without the overflow is applied to both.
    kv.push(["a", "b"], [grads_a, (ids, _rows(SMALL))])
    assert kv.row_sparse_pull("a", row_ids=np.array([4]))[0, 0] == np.float32(-HUGE_LR * SMALL)
    assert kv.row_sparse_pull("b", row_ids=np.array([2]))[0, 0] == np.float32(-2 * HUGE_LR * SMALL)
    kv.close()


@pytest.mark.parametrize("kind", ["local", "dist_async", "dist_sync"])
def test_multi_key_dense_push_with_one_overflowing_key_changes_no_key(kind, server_factory):
    kv = _store(kind, server_factory)
    kv.set_optimizer(SGD(learning_rate=HUGE_LR))
    kv.init(["w1", "w2"], [np.ones(4, np.float32), np.ones(3, np.float32)])
    with pytest.raises(errors.UpdateOverflow, match="w2"):
        kv.push(["w1", "w2"], [np.full(4, SMALL, np.float32), np.full(3, OVERFLOWING, np.float32)])
    np.testing.assert_array_equal(kv.pull("w1"), np.ones(4))
    np.testing.assert_array_equal(kv.pull("w2"), np.ones(3))
    kv.push(["w1", "w2"], [np.full(4, SMALL, np.float32), np.full(3, SMALL, np.float32)])
    np.testing.assert_allclose(kv.pull("w1"), 1 - HUGE_LR * SMALL, rtol=1e-6)
    kv.close()


# -- a dense key's overflowing update raises and changes nothing ---------------------------------


@pytest.mark.parametrize("kind", ["local", "dist_async"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dense_update_overflow_raises_and_keeps_the_values(kind, optimizer, server_factory):
    kv = _store(kind, server_factory)
    if optimizer == "sgd":
        kv.set_optimizer(SGD(learning_rate=HUGE_LR))
        grad = np.full(5, OVERFLOWING, np.float32)
    else:  # Adam's second moment g*g overflows float32 for |g| > 1.8e19
        kv.set_optimizer(kvsparse.optimizers.Adam(learning_rate=0.1))
        grad = np.full(5, 1e30, np.float32)
    start = np.arange(5, dtype=np.float32)
    kv.init("w", start)
    with pytest.raises(errors.UpdateOverflow, match="'w'") as info:
        kv.push("w", grad)
    assert isinstance(info.value, FloatingPointError)
    np.testing.assert_array_equal(kv.pull("w"), start)
    # The optimizer state did not move either: a finite push gives what it gives on a fresh key.
    kv.push("w", np.full(5, 1e-3, np.float32))
    fresh = kvsparse.create("local")
    fresh.set_optimizer(
        SGD(learning_rate=HUGE_LR)
        if optimizer == "sgd"
        else kvsparse.optimizers.Adam(learning_rate=0.1)
    )
    fresh.init("w", start)
    fresh.push("w", np.full(5, 1e-3, np.float32))
    np.testing.assert_array_equal(kv.pull("w"), fresh.pull("w"))
    kv.close()


# -- what a restarted server needs is in its checkpoint -------------------------------------------


def _restart_from(server: ServerProcess, ckpt: str):
    """Kills server and starts its replacement on the same port from checkpoint ckpt."""
    server.kill()
    args = ("--restore", ckpt, "--shard-index", "0", "--num-shards", "1", "--restarted")
    return ServerProcess(bind=server.address, extra_args=args)


def _stop(*servers) -> None:
    for server in servers:
        if server is not None:
            server.stop()
            server.stderr.close()


def test_per_table_optimizer_survives_a_restart_with_its_slots(tmp_path):
    """A table's own optimizer (set_optimizer(opt, key=...)) and its Adagrad sums after a restart.

    Rank 0's session replays its set_optimizer calls to the restarted server; the
    server knows them from its checkpoint and keeps what it restored, so the next
    pushes give what they give on a server that never stopped.
    """
    ckpt = str(tmp_path / "ckpt")
    server, replacement = ServerProcess(), None
    reference = kvsparse.create("local")
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, retry_window=30
        )
        for store in (kv, reference):
            store.init("t", kvsparse.SparseTable(dim=2, initializer=Zeros()))
            store.init("w", np.ones(3, np.float32))
            store.set_optimizer(SGD(learning_rate=1.0))
            store.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=0.5), key=["t", "w"])
            store.push("t", (np.array([1, 2]), _rows(1.0, 2)))
            store.push("w", np.full(3, 2.0, np.float32))
        kv.save(ckpt)
        replacement = _restart_from(server, ckpt)
        for store in (kv, reference):
            store.push("t", (np.array([1, 3]), _rows(3.0, 2)))
            store.push("w", np.full(3, 1.0, np.float32))
        assert kv._backend.restarts == 1
        ids = np.array([1, 2, 3])
        np.testing.assert_array_equal(
            kv.row_sparse_pull("t", row_ids=ids), reference.row_sparse_pull("t", row_ids=ids)
        )
        np.testing.assert_array_equal(kv.pull("w"), reference.pull("w"))
        kv.close()
    finally:
        _stop(server, replacement)


def _call_in_thread(function, timeout: float):
    """function()'s result or exception, or a TimeoutError if it did not return in time."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return TimeoutError(f"still waiting after {timeout} s")
    return outcome.get("error", outcome.get("value"))


def test_a_late_rank_set_optimizer_after_a_restart_is_answered_and_checked(tmp_path):
    """Late ranks' set_optimizer after a restart: rank 0's call is in the checkpoint.

    Without it the restarted server holds a late rank's call until rank 0
    replays its own, which rank 0 does only once it talks to that server again.
    """
    ckpt = str(tmp_path / "ckpt")
    server, replacement = ServerProcess(), None
    try:
        ranks = [
            kvsparse.create(
                "dist_async", servers=[server.address], rank=r, num_workers=3, retry_window=30
            )
            for r in range(3)
        ]
        adagrad = kvsparse.optimizers.Adagrad(learning_rate=0.5)
        for kv in ranks:
            kv.init("t", kvsparse.SparseTable(dim=2, initializer=Zeros()))
        ranks[0].set_optimizer(adagrad)
        ranks[0].push("t", (np.array([1]), _rows(1.0, 1)))
        ranks[0].save(ckpt)
        replacement = _restart_from(server, ckpt)
        # Rank 0 stays quiet. The same optimizer is accepted, a different one refused.
        assert _call_in_thread(lambda: ranks[1].set_optimizer(adagrad), 10) is None
        outcome = _call_in_thread(lambda: ranks[2].set_optimizer(SGD(learning_rate=1.0)), 10)
        assert isinstance(outcome, errors.InvalidArgument), outcome
        assert "rank 0 set" in str(outcome)
        # The restored Adagrad sum of id 1 is still there.
        ranks[1].push("t", (np.array([1]), _rows(1.0, 1)))
        reference = kvsparse.create("local")
        reference.init("t", kvsparse.SparseTable(dim=2, initializer=Zeros()))
        reference.set_optimizer(adagrad)
        for _ in range(2):
            reference.push("t", (np.array([1]), _rows(1.0, 1)))
        ids = np.array([1])
        np.testing.assert_array_equal(
            ranks[1].row_sparse_pull("t", row_ids=ids), reference.row_sparse_pull("t", row_ids=ids)
        )
        for kv in ranks:
            kv.close()
    finally:
        _stop(server, replacement)


class _Relay:
    """A TCP relay on a free 127.0.0.1 port to a server's port, that can lose replies.

    hold(): what the server sends is dropped from then on (the requests still
    get through): a reply lost on the way. cut(): every connection is closed
    and relaying resumes; a client's ZeroMQ socket then connects again, to
    whatever listens on the server's port by then.
    """

    def __init__(self, target: str):
        self._target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._holding = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._holding.set()

    def cut(self) -> None:
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._open = []
        self._holding.clear()

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, timeout=1)
            except OSError:
                client.close()  # the server is down: the client will try again
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if not (replies and self._holding.is_set()):
                    sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_push_whose_reply_was_lost_is_applied_once_by_the_restarted_server(
    tmp_path, checkpointed
):
    """A push applied, its reply lost, its server killed and restored from a checkpoint.

    The worker resends it (`kvsparse.client.recovery`): under its request id
    if the restored server's resend record has it (applied before the save:
    answered from the record), else under a new one (applied after the save,
    so not in the restored tables: applied there once).
    """
    ckpt = str(tmp_path / "ckpt")
    server, replacement = ServerProcess(), None
    relay = _Relay(server.address)
    try:
        # Rank 0 reaches the server through the relay; rank 1 directly, and saves.
        worker = kvsparse.create(
            "dist_async",
            servers=[relay.address],
            rank=0,
            num_workers=2,
            timeout=1,
            retry_window=30,
        )
        saver = kvsparse.create("dist_async", servers=[server.address], rank=1, num_workers=2)
        table = kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=SGD(learning_rate=1.0))
        for kv in (worker, saver):
            kv.init("t", table)
        worker.push("t", (np.array([5]), -np.ones((1, 1), np.float32)))
        if not checkpointed:
            saver.save(ckpt)
        relay.hold()
        pusher = threading.Thread(
            target=lambda: outcome.update(result=_call_in_thread(push_seven, 60)), daemon=True
        )
        outcome: dict = {}

        def push_seven():
            worker.push("t", (np.array([7]), -np.ones((1, 1), np.float32)))
            return "ok"

        pusher.start()
        _wait_for(lambda: saver._backend.stats()[0]["pushes"] >= 2, "the push to arrive")
        if checkpointed:
            saver.save(ckpt)  # holds the push to 7, and its resend record
        server.kill()
        relay.cut()  # the reply is lost with the connection
        replacement = _restart_from(server, ckpt)
        pusher.join(60)
        assert outcome.get("result") == "ok", outcome
        assert worker._backend.restarts == 1
        rows = worker.row_sparse_pull("t", row_ids=np.array([5, 7]))
        np.testing.assert_array_equal(rows, [[1.0], [1.0]])  # each push applied once
        assert worker._backend.stats()[0]["duplicate_pushes"] == 0
        for kv in (worker, saver):
            kv.close()
    finally:
        relay.close()
        _stop(server, replacement)


def _wait_for(condition, what: str, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize(
    "policy, pushes, after",
    [
        # TTL 3: ids last touched at steps 1, 2, 3; at step 4 only id 1 is 3 steps old.
        (dict(ttl_steps=3), [[1], [2], [3]], [4]),
        # LFU under a cap of 3 rows: id 3 has the fewest touches, so id 4 takes its row.
        (dict(max_rows=3, eviction="lfu"), [[1, 2, 3], [1, 2], [1, 2]], [4]),
        # LRU under a cap of 3 rows: id 2 was touched longest ago (a tie would take id 1).
        (dict(max_rows=3, eviction="lru"), [[1, 2, 3], [1, 3], [1]], [4]),
    ],
    ids=["ttl", "lfu", "lru"],
)
def test_eviction_after_a_restart_picks_the_rows_it_would_have_picked(
    tmp_path, policy, pushes, after
):
    ckpt = str(tmp_path / "ckpt")
    server, replacement = ServerProcess(), None
    reference = kvsparse.create("local")
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, retry_window=30
        )
        table = kvsparse.SparseTable(
            dim=1, initializer=Zeros(), optimizer=SGD(learning_rate=1.0), **policy
        )
        for store in (kv, reference):
            store.init("t", table)
            for ids in pushes:
                store.push("t", (np.array(ids), -np.ones((len(ids), 1), np.float32)))
        kv.save(ckpt)
        replacement = _restart_from(server, ckpt)
        for store in (kv, reference):
            store.push("t", (np.array(after), -np.ones((len(after), 1), np.float32)))
            store.evict()
        assert kv._backend.restarts == 1
        ids = np.arange(1, 5)
        expected = reference.row_sparse_pull("t", row_ids=ids)
        assert (expected == 0).sum() == 1  # exactly one row went
        np.testing.assert_array_equal(kv.row_sparse_pull("t", row_ids=ids), expected)
        kv.close()
    finally:
        _stop(server, replacement)


def test_a_format_3_checkpoint_still_loads_its_rows_without_their_ages(tmp_path):
    from kvsparse.shard import checkpoint
    from tests.test_checkpoint import _rewrite_as_format

    kv = kvsparse.create("local")
    kv.init("t", kvsparse.SparseTable(dim=1, initializer=Zeros(), ttl_steps=3))
    kv.set_optimizer(SGD(learning_rate=1.0))
    for ids in ([1], [2], [3]):
        kv.push("t", (np.array(ids), -np.ones((1, 1), np.float32)))
    kv.save(tmp_path / "new")
    name = checkpoint.shard_file_name(1, 0, 1)
    index = checkpoint.read_shard_file(str(tmp_path / "new" / name)).index
    assert index["version"] == checkpoint.BY_VALUE_VERSION == 4  # no rows on disk: v4
    assert all("meta" in block for block in index["sparse"][0]["blocks"])
    kv.save(tmp_path / "old")
    _rewrite_as_format(tmp_path / "old", 3)
    assert checkpoint.read_shard_file(str(tmp_path / "old" / name)).version == 3
    for path, evicted in (("new", 0), ("old", 3)):
        loaded = kvsparse.create("local")
        assert loaded.load(tmp_path / path) == 1
        np.testing.assert_array_equal(
            loaded.row_sparse_pull("t", row_ids=np.array([1, 2, 3])), [[1.0]] * 3
        )
        # At step 3 no row is 3 steps old; version 3 kept no ages: its rows count as touched
        # at step 0, all expired.
        assert loaded.evict() == {"t": evicted}


# -- the core's two-step push, through its Cython wrapper -------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_core_push_cancelled_after_begin_leaves_the_table_as_it_was(optimizer):
    from kvsparse import _core

    spec = {"kind": optimizer, "learning_rate": 0.1}
    table = _core.Table(4, {"kind": "normal", "b": 0.1}, spec, 7, {"max_rows": 50, "ttl_steps": 9})
    rng = np.random.default_rng(0)
    ids = np.arange(40, dtype=np.int64)
    table.apply_gradients(ids, rng.standard_normal((40, 4)).astype(np.float32))
    before = (table.read_state(ids), table.read_row_meta(ids), table.table_step, len(table))
    push_ids = np.arange(20, 60, dtype=np.int64)  # 20 stored, 20 new (10 over the cap)
    table.begin_push(push_ids, rng.standard_normal((40, 4)).astype(np.float32))
    with pytest.raises(errors.InvalidArgument, match="begun"):
        table.apply_gradients(ids[:1], np.ones((1, 4), np.float32))
    table.cancel_push()
    after = (table.read_state(ids), table.read_row_meta(ids), table.table_step, len(table))
    for a, b in zip([*before[0], *before[1]], [*after[0], *after[1]]):
        np.testing.assert_array_equal(a, b)
    assert before[2:] == after[2:]
    # Begun then finished is apply_gradients.
    twin = _core.Table(4, {"kind": "normal", "b": 0.1}, spec, 7, {"max_rows": 50, "ttl_steps": 9})
    twin.write_state(ids, *before[0])
    twin.write_row_meta(ids, *before[1])
    twin.table_step = before[2]
    grads = rng.standard_normal((40, 4)).astype(np.float32)
    table.begin_push(push_ids, grads)
    assert table.finish_push() == twin.apply_gradients(push_ids, grads)
    every = np.arange(60, dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(every), twin.lookup(every))
