"""What a server needs to go on after a crash or a failed checkpoint.

Real `kvsparse server` processes: killed during a save and replaced on the
same port, restarted from a checkpoint (``--restore ... --restarted``), made
to fail a save with a full disk, or fed a corrupt checkpoint to load.

Disk full is simulated with RLIMIT_FSIZE set on the running server process
from outside (``resource.prlimit``): its forked writer inherits the limit, and
a write past it fails with EFBIG (CPython ignores SIGXFSZ), as a write to a
full disk fails with ENOSPC; raising the limit again frees the "disk". The
server killed during a save runs ``tests/test_checkpoint.py``'s hooked
server, whose forked writer sleeps after its first block (a patch made in the
test's server process, not a hook in kvsparse).
"""

from __future__ import annotations

import glob
import json
import os
import resource
import signal
import threading
import time

import numpy as np
import pytest

import kvsparse
from kvsparse import errors
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD
from tests.conftest import ServerProcess
from tests.test_checkpoint import _HookedServer

WAIT_SECONDS = 30.0


def _children(pid: int) -> list[int]:
    """The child processes of pid (every thread's), from /proc."""
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as f:
                found += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return found


def _wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(*servers) -> None:
    for server in servers:
        if server is not None:
            server.stop()
            server.stderr.close()


def _sgd_table(dim: int = 2, **policy) -> kvsparse.SparseTable:
    return kvsparse.SparseTable(
        dim=dim, initializer=Zeros(), optimizer=SGD(learning_rate=1.0), **policy
    )


# -- the forked writer keeps no inherited socket -----------------------------------------------


def test_server_killed_during_a_save_is_replaced_on_its_port_at_once(tmp_path):
    hook = tmp_path / "hook"
    hook.write_text("sleep")  # the writer stops for a minute after its first block
    ckpt = tmp_path / "ckpt"
    server = _HookedServer(hook)
    replacement = None
    writers = []
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=2
        )
        kv.init("t", _sgd_table())
        kv.push("t", (np.array([1, 2]), np.ones((2, 2), np.float32)))
        outcome = {}

        def save():
            try:
                kv.save(str(ckpt))
            except errors.KVSparseError as exc:
                outcome["error"] = exc

        saver = threading.Thread(target=save, daemon=True)
        saver.start()
        _wait_for(
            lambda: ckpt.exists() and any(".tmp-" in name for name in os.listdir(ckpt)),
            "the checkpoint writer's file",
        )
        writers = _children(server.process.pid)
        server.kill()  # its writer sleeps on
        replacement = ServerProcess(bind=server.address)
        saver.join(WAIT_SECONDS)
        assert not saver.is_alive()
        assert isinstance(outcome.get("error"), errors.ServerUnavailable), outcome
        kv.close()
    finally:
        for writer in writers:  # the forked writer this test's server started
            try:
                os.kill(writer, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _stop(server, replacement)


# -- a failed save cleans up, and the next delta builds on the last real checkpoint ----------------


def _push_ids(kv, ids, value: float = 1.0, key: str = "t") -> None:
    ids = np.asarray(ids, np.int64)
    kv.push(key, (ids, -value * np.ones((ids.size, 2), np.float32)))


def test_save_failed_by_a_full_disk_leaves_no_file_and_the_next_delta_is_accepted(
    server_factory, tmp_path
):
    servers = server_factory(2)
    ckpt = str(tmp_path / "ckpt")
    kv = kvsparse.create("dist_async", servers=servers, rank=0, num_workers=1, timeout=10)
    kv.init("t", _sgd_table())
    _push_ids(kv, range(10))
    assert kv.save(ckpt) == 1
    _push_ids(kv, range(10, 3000))  # server 1's next shard file needs more than 4 KiB
    full_disk = server_factory.processes[1].process.pid
    _, hard = resource.prlimit(full_disk, resource.RLIMIT_FSIZE)
    resource.prlimit(full_disk, resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(errors.KVSparseError, match="File too large"):
            kv.save(ckpt)
    finally:
        resource.prlimit(full_disk, resource.RLIMIT_FSIZE, (hard, hard))
    # Server 0's file of the failed save is gone, and no temporary file is left.
    assert sorted(os.listdir(ckpt)) == [
        "ckpt-000001.manifest.json",
        "ckpt-000001.shard-00000-of-00002.kvs",
        "ckpt-000001.shard-00001-of-00002.kvs",
    ]
    _push_ids(kv, [5, 3001])
    # A delta on checkpoint 1, not on the failed save (whose number is free again).
    assert kv.save(ckpt, incremental=True) == 2
    with open(os.path.join(ckpt, "ckpt-000002.manifest.json")) as f:
        assert json.load(f)["parent"] == 1
    expected = kv.row_sparse_pull("t", row_ids=np.arange(3002))
    fresh = kvsparse.create("dist_async", servers=server_factory(2), rank=0, num_workers=1)
    assert fresh.load(ckpt) == 2
    np.testing.assert_array_equal(fresh.row_sparse_pull("t", row_ids=np.arange(3002)), expected)
    fresh.close()
    kv.close()


# -- a load is all or nothing per store ----------------------------------------------------------


def _corrupt_first_block(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(16)  # the first section, right after the header
        byte = f.read(1)
        f.seek(16)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_load_of_a_corrupt_delta_changes_no_server_and_a_later_init_starts_fresh(
    server_factory, tmp_path
):
    ckpt = str(tmp_path / "ckpt")
    kv = kvsparse.create("dist_async", servers=server_factory(2), rank=0, num_workers=1)
    kv.init("t", _sgd_table())
    _push_ids(kv, range(100))
    kv.save(ckpt)
    _push_ids(kv, range(100))
    kv.save(ckpt, incremental=True)
    kv.close()
    _corrupt_first_block(os.path.join(ckpt, "ckpt-000002.shard-00001-of-00002.kvs"))

    # Servers that already serve "t": a failed load leaves their rows as they were.
    kv = kvsparse.create("dist_async", servers=server_factory(2), rank=0, num_workers=1)
    kv.init("t", _sgd_table())
    _push_ids(kv, range(0, 100, 2), value=7.0)
    before = kv.row_sparse_pull("t", row_ids=np.arange(100))
    with pytest.raises(errors.InvalidArgument, match="checksum mismatch"):
        kv.load(ckpt)
    np.testing.assert_array_equal(kv.row_sparse_pull("t", row_ids=np.arange(100)), before)
    kv.close()

    # Blank servers: nothing is left that a later identical init would adopt.
    kv = kvsparse.create("dist_async", servers=server_factory(2), rank=0, num_workers=1)
    with pytest.raises(errors.InvalidArgument, match="checksum mismatch"):
        kv.load(ckpt)
    assert all(not shard["tables"] for shard in kv._backend.stats())
    kv.init("t", _sgd_table())
    assert not kv.row_sparse_pull("t", row_ids=np.arange(100)).any()
    kv.close()


# -- admission counters are in the checkpoint ---------------------------------------------------


def _restart_from(server: ServerProcess, ckpt: str, index: int = 0, count: int = 1):
    """Kills server and starts its replacement on the same port from checkpoint ckpt."""
    server.kill()
    args = ("--restore", ckpt, "--shard-index", str(index), "--num-shards", str(count))
    return ServerProcess(bind=server.address, extra_args=(*args, "--restarted"))


def test_a_push_that_admits_an_id_after_a_restart_is_applied(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    server = ServerProcess()
    replacement = None
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, retry_window=30
        )
        kv.init("t", _sgd_table(min_count=2))
        _push_ids(kv, [5, 6])  # seen once: candidates, not stored
        kv.save(ckpt)
        replacement = _restart_from(server, ckpt)
        _push_ids(kv, [5])  # the second sighting: admitted, and this push applied
        assert kv._backend.restarts == 1
        rows = kv.row_sparse_pull("t", row_ids=np.array([5, 6]))
        np.testing.assert_array_equal(rows, [[1.0, 1.0], [0.0, 0.0]])
        kv.close()
    finally:
        _stop(server, replacement)


def test_admission_counts_survive_a_delta_chain_loaded_onto_more_servers(server_factory, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ids = np.arange(40)
    kv = kvsparse.create("dist_async", servers=server_factory(2), rank=0, num_workers=1)
    kv.init("t", _sgd_table(min_count=3))
    _push_ids(kv, ids)  # every id seen once
    kv.save(ckpt)
    _push_ids(kv, ids[:20])  # the first half twice: still candidates
    kv.save(ckpt, incremental=True)
    kv.close()
    kv = kvsparse.create("dist_async", servers=server_factory(3), rank=0, num_workers=1)
    assert kv.load(ckpt) == 2
    assert sum(s["tables"]["t"]["candidates"] for s in kv._backend.stats()) == 40
    _push_ids(kv, ids)  # third sighting of the first half only
    rows = kv.row_sparse_pull("t", row_ids=ids)
    np.testing.assert_array_equal(rows[:20], np.ones((20, 2)))
    np.testing.assert_array_equal(rows[20:], np.zeros((20, 2)))
    kv.close()


def test_a_format_2_checkpoint_still_loads_without_candidates(tmp_path):
    from tests.test_checkpoint import _rewrite_as_format

    kv = kvsparse.create("local")
    kv.init("t", _sgd_table(min_count=2))
    _push_ids(kv, [1, 2])
    _push_ids(kv, [1])  # 1 stored, 2 a candidate
    kv.save(tmp_path / "old")
    _rewrite_as_format(tmp_path / "old", 2)
    from kvsparse.shard import checkpoint

    name = tmp_path / "old" / checkpoint.shard_file_name(1, 0, 1)
    assert checkpoint.read_shard_file(str(name)).version == 2
    loaded = kvsparse.create("local")
    assert loaded.load(tmp_path / "old") == 1
    np.testing.assert_array_equal(
        loaded.row_sparse_pull("t", row_ids=np.array([1, 2])), [[1.0, 1.0], [0.0, 0.0]]
    )
    assert loaded._backend.stats()[0]["tables"]["t"]["candidates"] == 0  # format 2 kept none


# -- dense keys created after the last checkpoint are created again --------------------------------


def test_dense_key_created_after_the_checkpoint_is_there_after_a_restart(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    server = ServerProcess()
    replacement = None
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, retry_window=30
        )
        kv.init("t", _sgd_table())
        kv.init("old", np.full(3, 5.0, np.float32))
        kv.push("old", np.ones(3, np.float32))  # no optimizer: replaces the values
        kv.save(ckpt)
        kv.init("new", np.arange(4, dtype=np.float32))
        replacement = _restart_from(server, ckpt)
        # Created again with its initial values; the key in the checkpoint keeps its own.
        np.testing.assert_array_equal(kv.pull("new"), np.arange(4))
        np.testing.assert_array_equal(kv.pull("old"), np.ones(3))
        kv.push("new", np.full(4, 2.0, np.float32))
        np.testing.assert_array_equal(kv.pull("new"), np.full(4, 2.0))
        assert kv._backend.restarts == 1
        kv.close()
    finally:
        _stop(server, replacement)
