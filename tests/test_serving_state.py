"""A serving replica's state in process: the C++ write of a delta's rows, updates
refused or failing half-way, and what concurrent lookups see.

`test_serving_replica.py` drives whole replica processes; these tests reach the
pieces those processes are made of: `_core.assign_marked_rows` (through its Cython
wrapper, against a NumPy reference), `ServingState` and `Follower.poll_once`.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import kvsparse
from kvsparse import _core, errors
from kvsparse.serving import EmbeddingLookup
from kvsparse.serving import state as serving_state
from kvsparse.serving.follow import Follower
from kvsparse.serving.state import Selection, ServingState, read_checkpoint, read_export
from kvsparse.shard.checkpoint.format import BLOCK_ROWS, read_shard_file

DIM = 4


def _marked_table(dim: int = DIM) -> _core.Table:
    return _core.Table(dim + 1, {"kind": "zeros"}, None, 0)


def _read_only(array: np.ndarray) -> np.ndarray:
    array = array.copy()
    array.flags.writeable = False
    return array


# -- _core.assign_marked_rows ------------------------------------------------------------------


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 4095, 4096, 4097, 10_000])
def test_assign_marked_rows_matches_a_numpy_reference(rows, read_only):
    rng = np.random.default_rng(rows)
    table = _marked_table()
    # A few rows there already, duplicates in the batch (the last one wins), chunks of
    # 4,096 rows crossed.
    table.assign(np.array([3, 5], np.int64), np.full((2, DIM + 1), 9.0, np.float32))
    keys = rng.integers(0, max(1, rows // 2), rows).astype(np.int64)
    values = rng.normal(size=(rows, DIM)).astype(np.float32)
    if read_only:
        keys, values = _read_only(keys), _read_only(values)
    _core.assign_marked_rows(table, keys, values, 1.0)
    expected = {3: np.full(DIM + 1, 9.0, np.float32), 5: np.full(DIM + 1, 9.0, np.float32)}
    for key, row in zip(keys.tolist(), values):
        expected[key] = np.append(row, np.float32(1.0))
    assert len(table) == len(expected)
    ordered = np.array(sorted(expected), np.int64)
    np.testing.assert_array_equal(table.lookup(ordered), np.stack([expected[k] for k in ordered]))


def test_assign_marked_rows_takes_a_non_contiguous_view_and_any_marker():
    table = _marked_table()
    wide = np.arange(3 * 2 * DIM, dtype=np.float32).reshape(3, 2 * DIM)
    values = wide[:, ::2]  # every other column: not contiguous
    _core.assign_marked_rows(table, np.array([1, 2, 3]), values, 0.5)
    expected = np.hstack([values, np.full((3, 1), 0.5, np.float32)])
    np.testing.assert_array_equal(table.lookup(np.array([1, 2, 3])), expected)


def test_assign_marked_rows_refuses_bad_input_and_changes_nothing():
    table = _marked_table()
    keys = np.array([1, 2], np.int64)
    table.assign(keys, np.ones((2, DIM + 1), np.float32))
    before = table.lookup(keys)
    with pytest.raises(errors.InvalidArgument, match="dim \\+ 1"):
        _core.assign_marked_rows(table, keys, np.zeros((2, DIM + 1), np.float32))
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError too
        _core.assign_marked_rows(table, keys, np.zeros((2, DIM - 1), np.float32))
    with pytest.raises(errors.DTypeError):
        _core.assign_marked_rows(table, keys, np.zeros((2, DIM), np.float64))
    with pytest.raises(errors.DTypeError):
        _core.assign_marked_rows(table, keys.astype(np.int32), np.zeros((2, DIM), np.float32))
    with pytest.raises(errors.ShapeError):
        _core.assign_marked_rows(table, keys, np.zeros((3, DIM), np.float32))
    with pytest.raises(errors.ShapeError):
        _core.assign_marked_rows(table, keys, np.zeros(2 * DIM, np.float32))
    with pytest.raises(TypeError):
        _core.assign_marked_rows(object(), keys, np.zeros((2, DIM), np.float32))
    np.testing.assert_array_equal(table.lookup(keys), before)
    assert len(table) == 2


# -- checkpoints followed in process -----------------------------------------------------------


def _store(num_rows: int):
    kv = kvsparse.create("local")
    kv.init("emb", kvsparse.SparseTable(dim=DIM, optimizer=None, seed=1))
    return kv, np.arange(num_rows, dtype=np.int64) * 7919 - 10**12


def _set_all(kv, ids, value: float):
    kv.push("emb", (ids, np.full((ids.size, DIM), value, np.float32)))


def _both_copies(state: ServingState, ids) -> list:
    return [side.lookup("emb", ids, "zeros") for side in state._sides]


def _follow_one(path) -> tuple:
    state = ServingState()
    follower = Follower(str(path), state, Selection())
    assert follower.poll_once()
    return state, follower


def _damage_last_block(shard) -> None:
    # One byte of the last block's values: the first block and the framing stay
    # intact, so only that block's checksum tells (after the first block was read).
    (section,) = read_shard_file(os.fspath(shard)).index["sparse"]
    assert len(section["blocks"]) == 2
    last = section["blocks"][-1]
    data = bytearray(shard.read_bytes())
    data[int(last["offset"]) + 8 * int(last["rows"]) + 4] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(shard) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])


@pytest.mark.parametrize("damage", [_damage_last_block, _truncate])
def test_a_corrupt_delta_is_refused_and_neither_copy_changes(tmp_path, damage):
    num_rows = BLOCK_ROWS + 5000  # a delta of two blocks
    kv, ids = _store(num_rows)
    _set_all(kv, ids, 1.0)
    kv.save(tmp_path)
    state, follower = _follow_one(tmp_path)
    _set_all(kv, ids, 2.0)
    assert kv.save(tmp_path, incremental=True) == 2
    (shard,) = tmp_path.glob("ckpt-000002.shard-*.kvs")
    damage(shard)
    assert not follower.poll_once()
    assert follower.last_error["seq"] == 2
    assert shard.name in follower.last_error["message"]
    assert ("checksum mismatch" if damage is _damage_last_block else "truncated") in (
        follower.last_error["message"]
    )
    rows, version = state.lookup("emb", ids)
    assert version["seq"] == 1
    np.testing.assert_array_equal(rows, np.ones((num_rows, DIM)))
    for copy in _both_copies(state, ids):
        np.testing.assert_array_equal(copy, np.ones((num_rows, DIM)))
    # The next checkpoint, whole, is taken.
    _set_all(kv, ids, 3.0)
    assert kv.save(tmp_path) == 3
    assert follower.poll_once() and follower.last_error is None
    for copy in _both_copies(state, ids):
        np.testing.assert_array_equal(copy, np.full((num_rows, DIM), 3.0))


def test_an_apply_failing_half_way_keeps_lookups_on_the_old_version(tmp_path, monkeypatch):
    num_rows = BLOCK_ROWS + 5000
    kv, ids = _store(num_rows)
    _set_all(kv, ids, 1.0)
    kv.save(tmp_path)
    state, follower = _follow_one(tmp_path)
    _set_all(kv, ids, 2.0)
    kv.save(tmp_path, incremental=True)
    calls = []
    real = _core.assign_marked_rows

    def fails_on_the_second_block(table, keys, values, marker):
        calls.append(keys.size)
        if len(calls) == 2:
            raise MemoryError("no memory for the rows being assigned")
        return real(table, keys, values, marker)

    monkeypatch.setattr(serving_state._core, "assign_marked_rows", fails_on_the_second_block)
    with pytest.raises(MemoryError):  # the polling thread keeps it as its last error
        follower.poll_once()
    assert len(calls) == 2
    rows, version = state.lookup("emb", ids)
    assert version["seq"] == 1
    np.testing.assert_array_equal(rows, np.ones((num_rows, DIM)))
    # The copy written half-way was rebuilt from the one served.
    for copy in _both_copies(state, ids):
        np.testing.assert_array_equal(copy, np.ones((num_rows, DIM)))
    monkeypatch.setattr(serving_state._core, "assign_marked_rows", real)
    _set_all(kv, ids, 3.0)
    assert kv.save(tmp_path, incremental=True) == 3
    assert follower.poll_once()
    for copy in _both_copies(state, ids):
        np.testing.assert_array_equal(copy, np.full((num_rows, DIM), 3.0))


def test_lookups_from_threads_see_each_delta_whole(tmp_path):
    num_rows, deltas = BLOCK_ROWS + 5000, 6
    kv, ids = _store(num_rows)
    _set_all(kv, ids, 0.0)
    kv.save(tmp_path)
    state, follower = _follow_one(tmp_path)
    problems, seen, done = [], set(), threading.Event()

    def reader(batch):
        rng = np.random.default_rng(batch)
        while not done.is_set():
            query = ids[rng.integers(0, ids.size, batch)]
            rows, version = state.lookup("emb", query)
            values = np.unique(rows)
            # Checkpoint seq k holds the constant k - 1 everywhere.
            if values.size != 1 or values[0] != version["seq"] - 1:
                problems.append((version["seq"], values[:5]))
            seen.add(version["seq"])

    threads = [threading.Thread(target=reader, args=(b,)) for b in (64, num_rows)]
    for thread in threads:
        thread.start()
    try:
        for seq in range(2, deltas + 2):
            _set_all(kv, ids, float(seq - 1))
            assert kv.save(tmp_path, incremental=True) == seq
            assert follower.poll_once()
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
    assert not problems, problems[:5]
    assert state.version()["seq"] == deltas + 1 and len(seen) >= 2
    for copy in _both_copies(state, ids):
        np.testing.assert_array_equal(copy, np.full((num_rows, DIM), float(deltas)))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_an_export_is_served_with_its_values_whatever_its_dtype(tmp_path, dtype):
    # bfloat16 exports hold bit patterns (uint16): before, a replica served those
    # integers as floats (0.5 came back as 16128.0).
    kv = kvsparse.create("local")
    kv.init("emb", kvsparse.SparseTable(dim=DIM, optimizer=None, seed=1, dtype=dtype))
    ids = np.arange(BLOCK_ROWS + 10, dtype=np.int64)  # two chunks of the apply
    rng = np.random.default_rng(0)
    kv.push("emb", (ids, rng.normal(size=(ids.size, DIM)).astype(np.float32)))
    kv.export(os.fspath(tmp_path))
    state = ServingState()
    state.apply(read_export(os.fspath(tmp_path)))
    rows, version = state.lookup("emb", ids)
    assert version["kind"] == "export" and rows.dtype == np.float32
    expected = np.asarray(EmbeddingLookup(os.fspath(tmp_path)).lookup("emb", ids))
    np.testing.assert_array_equal(rows, expected.astype(np.float32))


def test_a_hash_shard_of_a_checkpoint_saved_on_another_shard_count(tmp_path):
    # Blocks are sorted by shard in parts (state._RESHARD_ROWS): ids across parts and blocks.
    num_rows = BLOCK_ROWS + 5000
    kv, ids = _store(num_rows)
    rng = np.random.default_rng(0)
    values = rng.normal(size=(num_rows, DIM)).astype(np.float32)
    kv.push("emb", (ids, values))
    kv.save(tmp_path)
    owner = _core.shard_of(ids, 3)
    held = 0
    for index in range(3):
        state = ServingState()
        state.apply(read_checkpoint(os.fspath(tmp_path), Selection(shard=(index, 3)))[0])
        rows, _ = state.lookup("emb", ids)
        mine = owner == index
        np.testing.assert_array_equal(rows[mine], values[mine])
        np.testing.assert_array_equal(rows[~mine], np.zeros((int((~mine).sum()), DIM)))
        held += state.describe()["tables"]["emb"]["rows"]
    assert held == num_rows


def _nice_of(thread_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread_id)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread: Linux")
def test_the_polling_thread_lowers_its_own_priority_only(tmp_path):
    base = _nice_of(threading.get_native_id())
    follower = Follower(str(tmp_path), ServingState(), Selection(), interval=0.01, niceness=3)
    follower.start()
    try:
        deadline = time.monotonic() + 10
        while _nice_of(follower._thread.native_id) != base + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _nice_of(follower._thread.native_id) == base + 3
        assert _nice_of(threading.get_native_id()) == base  # the caller's thread keeps its own
    finally:
        follower.stop()


@pytest.mark.parametrize("niceness", [-1, 1.5, True, "10"])
def test_a_bad_niceness_is_refused(tmp_path, niceness):
    with pytest.raises(errors.InvalidArgument, match="niceness"):
        Follower(str(tmp_path), ServingState(), Selection(), niceness=niceness)


def test_status_never_shows_a_newer_checkpoint_with_the_error_of_an_older_one(tmp_path):
    # The follower makes the new state visible, then clears the error of the checkpoint
    # it had refused: a /healthz read in between said "degraded" about the checkpoint
    # that had just healed it (seen once in CI: test_serving_replica's corrupt delta).
    from kvsparse.serving.server import ServingConfig, ServingServer

    kv, ids = _store(100)
    _set_all(kv, ids, 1.0)
    kv.save(tmp_path)
    state, follower = _follow_one(tmp_path)
    server = ServingServer(ServingConfig(path=str(tmp_path), bind="tcp://127.0.0.1:0"))
    server.state, server.follower = state, follower
    _set_all(kv, ids, 2.0)
    kv.save(tmp_path, incremental=True)
    (shard,) = tmp_path.glob("ckpt-000002.shard-*.kvs")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not follower.poll_once()  # refused: checksum mismatch
    status = server.status()
    assert status["status"] == "degraded" and status["last_error"]["seq"] == 2
    assert status["version"]["seq"] == 1
    _set_all(kv, ids, 3.0)
    assert kv.save(tmp_path) == 3
    seen = []
    real_apply = state.apply

    def apply_then_look(update):
        real_apply(update)
        seen.append(server.status())  # the new state shows; the error is not cleared yet

    state.apply = apply_then_look
    assert follower.poll_once()
    (between,) = seen
    assert between["version"]["seq"] == 3
    assert between["status"] == "ok" and between["last_error"] is None, between
    assert server.status()["status"] == "ok"
