"""The dist store from one worker: every KVStore operation over 1, 2 and 3 real servers.

Each test runs the same operations on ``create('local')`` and on a dist
store whose servers are real subprocesses, and compares the results.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

import kvsparse
from kvsparse import errors, initializers, optimizers
from kvsparse.placement import table_id_of
from kvsparse.store.keys import KeyInfo

SERVER_COUNTS = [1, 2, 3]


@pytest.fixture(scope="module")
def server_sets(module_server_factory):
    """One server set per count, shared by this module's tests (fresh key names per test)."""
    return {n: module_server_factory(n) for n in SERVER_COUNTS}


@pytest.fixture(params=SERVER_COUNTS, ids=lambda n: f"{n}servers")
def pair(request, server_sets):
    """(local store, dist store) with no optimizer on either."""
    dist = kvsparse.create(
        "dist_sparse", servers=server_sets[request.param], rank=0, num_workers=1, timeout=30
    )
    dist.set_optimizer(None)  # the servers are shared: start from no optimizer
    local = kvsparse.create("local")
    yield local, dist
    dist.close()


_names = iter(range(10**9))


def fresh(prefix="k"):
    """A key name no other test in this module used (the servers are shared)."""
    return f"{prefix}{next(_names)}"


def both(pair, method, *args, **kwargs):
    local, dist = pair
    return getattr(local, method)(*args, **kwargs), getattr(dist, method)(*args, **kwargs)


def assert_same(results, exact=True):
    local, dist = results
    if isinstance(local, list):
        assert isinstance(dist, list) and len(local) == len(dist)
        for a, b in zip(local, dist):
            assert_same((a, b), exact)
        return
    local, dist = np.asarray(local), np.asarray(dist)
    assert local.shape == dist.shape and local.dtype == dist.dtype
    if exact:
        np.testing.assert_array_equal(dist, local)
    else:
        np.testing.assert_allclose(dist, local, rtol=1e-6, atol=1e-7)


def test_properties(pair):
    _, dist = pair
    assert (dist.rank, dist.num_workers, dist.type) == (0, 1, "dist_sparse")
    assert dist.num_servers in SERVER_COUNTS
    assert "dist_sparse" in repr(dist)
    assert dist.is_capable("optimizer")
    dist.barrier()  # one worker: returns at once


def test_sparse_init_push_pull_without_optimizer(pair):
    key = fresh()
    table = kvsparse.SparseTable(dim=5, initializer=initializers.Uniform(-1, 1), seed=11)
    both(pair, "init", key, table)
    ids = np.array([[3, -7], [2**62, 3]])
    assert_same(both(pair, "row_sparse_pull", key, row_ids=ids))
    rng = np.random.default_rng(1)
    grads = rng.standard_normal((4, 5)).astype(np.float32)
    both(pair, "push", key, (ids, grads.reshape(2, 2, 5)))  # replaces (duplicates summed)
    assert_same(both(pair, "row_sparse_pull", key, row_ids=np.arange(-10, 10)))
    assert_same(both(pair, "row_sparse_pull", key, row_ids=ids))
    # A pushed list is summed.
    pushes = [
        (np.array([1, 2]), np.ones((2, 5), np.float32)),
        (np.array([2, 9]), np.full((2, 5), 2.0, np.float32)),
    ]
    both(pair, "push", key, pushes)
    assert_same(both(pair, "row_sparse_pull", key, row_ids=np.array([1, 2, 9])))


@pytest.mark.parametrize(
    "optimizer",
    [
        optimizers.SGD(learning_rate=0.5),
        optimizers.Adagrad(learning_rate=0.1),
        optimizers.Adam(learning_rate=0.01),
        optimizers.Ftrl(learning_rate=0.1),
    ],
    ids=lambda o: type(o).__name__,
)
def test_optimizers_match_local(pair, optimizer):
    key, dense = fresh(), fresh("d")
    both(
        pair,
        "init",
        [key, dense],
        [
            kvsparse.SparseTable(dim=8, seed=3),
            np.linspace(-1, 1, 30, dtype=np.float32).reshape(5, 6),
        ],
    )
    both(pair, "set_optimizer", optimizer)
    rng = np.random.default_rng(5)
    for _ in range(4):
        ids = rng.integers(-50, 50, size=(16, 3))
        grads = rng.standard_normal(ids.shape + (8,)).astype(np.float32)
        dense_grad = rng.standard_normal((5, 6)).astype(np.float32)
        both(pair, "push", [key, dense], [(ids, grads), dense_grad])
        assert_same(both(pair, "row_sparse_pull", key, row_ids=ids))
        assert_same(both(pair, "pull", dense))


def test_multi_key_fused_row_sparse_pull_is_one_request_per_server(pair):
    keys = [fresh(), fresh(), fresh()]
    tables = [kvsparse.SparseTable(dim=d, seed=d) for d in (2, 4, 16)]
    both(pair, "init", keys, tables)
    ids = [np.arange(0, 40), np.array([[5, 5], [6, 1]]), np.arange(-30, 0)]
    _, dist = pair
    before = [s["requests"] for s in dist.stats()["shards"]]
    local_rows, dist_rows = both(pair, "row_sparse_pull", keys, row_ids=ids)
    after = [s["requests"] for s in dist.stats()["shards"]]
    # Stats itself counts one request per server; the fused pull one more.
    assert [b - a for a, b in zip(before, after)] == [2] * dist.num_servers
    assert_same((local_rows, dist_rows))
    # With out= arrays, filled in place.
    outs = [np.empty(i.shape + (d,), np.float32) for i, d in zip(ids, (2, 4, 16))]
    returned = dist.row_sparse_pull(keys, out=outs, row_ids=ids)
    for out, ret, expected in zip(outs, returned, local_rows):
        assert ret is out
        np.testing.assert_array_equal(out, expected)


def test_fused_push_of_sparse_and_dense_keys(pair):
    sparse, dense = fresh(), fresh("d")
    both(pair, "init", [sparse, dense], [kvsparse.SparseTable(dim=3), np.zeros(7, np.float32)])
    both(pair, "set_optimizer", optimizers.Adagrad(learning_rate=0.5))
    both(
        pair,
        "push",
        [sparse, dense],
        [(np.array([4, 8, 4]), np.ones((3, 3), np.float32)), np.arange(7, dtype=np.float32)],
    )
    assert_same(both(pair, "row_sparse_pull", sparse, row_ids=np.array([4, 8, 0])))
    assert_same(both(pair, "pull", dense))


def test_dense_keys_push_pull_pushpull_broadcast(pair):
    a, b, c = fresh("d"), fresh("d"), fresh("d")
    both(
        pair,
        "init",
        [a, b],
        [np.arange(12, dtype=np.float32).reshape(3, 4), np.float32(2.5) * np.ones(1, np.float32)],
    )
    assert_same(both(pair, "pull", [a, b]))
    both(pair, "push", a, [np.ones((3, 4), np.float32), np.full((3, 4), 2.0, np.float32)])
    assert_same(both(pair, "pull", a))
    assert_same(both(pair, "pushpull", b, np.array([7.0], np.float32)))
    value = np.linspace(0, 1, 10, dtype=np.float32)
    assert_same(both(pair, "broadcast", c, value))
    # broadcast of an existing key pulls it (the value is not pushed).
    assert_same(both(pair, "broadcast", c, np.zeros(10, np.float32)))
    # pull into out arrays, MXNet style.
    local, dist = pair
    out = np.empty((3, 4), np.float32)
    assert dist.pull(a, out=out) is out
    np.testing.assert_array_equal(out, local.pull(a))
    # A dense key smaller than the number of servers.
    tiny = fresh("d")
    both(pair, "init", tiny, np.array([3.0], np.float32))
    both(pair, "set_optimizer", optimizers.SGD(learning_rate=1.0))
    both(pair, "push", tiny, np.array([1.0], np.float32))
    assert_same(both(pair, "pull", tiny))


def test_int_keys_and_range_partitioner(pair):
    _, dist = pair
    n = dist.num_servers
    boundaries = tuple(range(100, 100 * n, 100))[: n - 1]
    table = kvsparse.SparseTable(dim=4, partitioner=kvsparse.RangePartitioner(boundaries))
    int_dist = kvsparse.create(
        "dist_sparse", servers=[s["address"] for s in dist.stats()["shards"]], timeout=30
    )
    int_local = kvsparse.create("local")
    key = 10**6 + next(_names)
    if n > 1:
        # The local store has one shard: a range partitioner there needs no boundaries.
        int_local.init(key, kvsparse.SparseTable(dim=4))
    else:
        int_local.init(key, table)
    int_dist.init(key, table)
    ids = np.arange(0, 100 * n, 7)
    grads = np.ones((ids.size, 4), np.float32)
    for store in (int_local, int_dist):
        store.push(key, (ids, grads))
    assert_same(
        (int_local.row_sparse_pull(key, row_ids=ids), int_dist.row_sparse_pull(key, row_ids=ids))
    )
    if n > 1:
        shard_rows = [s["tables"][key]["rows"] for s in int_dist.stats()["shards"]]
        expected = np.bincount(np.searchsorted(boundaries, ids, side="right"), minlength=n)
        assert shard_rows == expected.tolist()
    int_dist.close()


def test_save_and_load_optimizer_states(pair, tmp_path):
    key, dense = fresh(), fresh("d")
    both(pair, "init", [key, dense], [kvsparse.SparseTable(dim=4), np.ones(9, np.float32)])
    both(pair, "set_optimizer", optimizers.Adam(learning_rate=0.01))
    rng = np.random.default_rng(2)
    ids = np.arange(30)

    def step():
        grads = rng.standard_normal((30, 4)).astype(np.float32)
        dense_grad = rng.standard_normal(9).astype(np.float32)
        both(pair, "push", [key, dense], [(ids, grads), dense_grad])

    step()
    local, dist = pair
    local.save_optimizer_states(tmp_path / "local.npz")
    dist.save_optimizer_states(tmp_path / "dist.npz")
    with np.load(tmp_path / "local.npz") as a, np.load(tmp_path / "dist.npz") as b:
        # k0 is the sparse key, k1 the dense one (init order); shards order rows differently.
        keys_l, keys_d = a["k0_keys"], b["k0_keys"]
        order_l, order_d = np.argsort(keys_l), np.argsort(keys_d)
        np.testing.assert_array_equal(keys_l[order_l], keys_d[order_d])
        np.testing.assert_allclose(a["k0_slots"][order_l], b["k0_slots"][order_d], rtol=1e-6)
        np.testing.assert_allclose(a["k1_slots"], b["k1_slots"], rtol=1e-6)
    step()
    step()
    # Loading the old state rewinds the slots and step counters (values stay).
    for store, name in ((local, "local.npz"), (dist, "dist.npz")):
        store.load_optimizer_states(tmp_path / name)
    step()
    assert_same(both(pair, "row_sparse_pull", key, row_ids=ids), exact=False)
    assert_same(both(pair, "pull", dense), exact=False)


def test_stats_per_shard(pair):
    key, dense = fresh(), fresh("d")
    both(pair, "init", [key, dense], [kvsparse.SparseTable(dim=16), np.ones(10, np.float32)])
    both(pair, "set_optimizer", optimizers.Adagrad())
    ids = np.arange(1000)
    both(pair, "push", key, (ids, np.ones((1000, 16), np.float32)))
    local, dist = pair
    stats = dist.stats()
    assert stats["tables"][key]["rows"] == 1000
    assert stats["tables"][key]["bytes"] >= 1000 * 16 * 4 * 2
    assert stats["tables"][dense]["rows"] == 10
    shards = stats["shards"]
    assert len(shards) == dist.num_servers
    assert sum(s["tables"][key]["rows"] for s in shards) == 1000
    for shard in shards:
        assert shard["address"].startswith("tcp://127.0.0.1:")
        assert shard["requests"] > 0 and shard["keys"] > 0 and shard["keys_per_second"] > 0
        assert set(shard["waiting"]) >= {"bsp_pushes", "ssp_pulls", "barrier"}
    if dist.num_servers > 1:
        assert all(0 < s["tables"][key]["rows"] < 1000 for s in shards)
    assert local.stats()["tables"][key]["rows"] == 1000


def test_errors_travel_back_as_their_classes(pair):
    _, dist = pair
    key = fresh()
    dist.init(key, kvsparse.SparseTable(dim=4, seed=1))
    # Another client declares the same key with another spec: the server says DuplicateKey.
    other = kvsparse.create(
        "dist_sparse", servers=[s["address"] for s in dist.stats()["shards"]], timeout=30
    )
    with pytest.raises(errors.DuplicateKey, match=key):
        other.init(key, kvsparse.SparseTable(dim=4, seed=2))
    other.init(key, kvsparse.SparseTable(dim=4, seed=1))  # the identical spec is fine
    # A key this client never initialized on the servers: UnknownKey from the server.
    ghost = fresh()
    other._keys.add(KeyInfo(ghost, table_id_of(ghost), True, dim=4))
    with pytest.raises(errors.UnknownKey, match="not initialized"):
        other.row_sparse_pull(ghost, row_ids=np.array([1, 2, 3]))
    with pytest.raises(KeyError):
        other.push(ghost, (np.array([1, 2, 3]), np.ones((3, 4), np.float32)))
    # Client-side checks happen before anything is sent.
    with pytest.raises(errors.NonFiniteGradient):
        dist.push(key, (np.array([1]), np.full((1, 4), np.nan, np.float32)))
    with pytest.raises(errors.ShapeError):
        dist.push(key, (np.array([1]), np.ones((1, 5), np.float32)))
    other.close()


def test_nonfinite_skip_tables(pair):
    key = fresh()
    table = kvsparse.SparseTable(dim=2, initializer=initializers.Constant(1.0), nonfinite="skip")
    both(pair, "init", key, table)
    both(pair, "set_optimizer", optimizers.SGD(learning_rate=1.0))
    grads = np.array([[1.0, 1.0], [np.nan, 0.0], [2.0, 2.0]], np.float32)
    both(pair, "push", key, (np.array([1, 2, 3]), grads))
    assert_same(both(pair, "row_sparse_pull", key, row_ids=np.array([1, 2, 3])))


def test_a_store_without_arguments_reads_the_environment(server_sets, monkeypatch):
    monkeypatch.setenv("KVSPARSE_SERVERS", ",".join(server_sets[2]))
    monkeypatch.setenv("KVSPARSE_TIMEOUT", "30")
    for name in ("KVSPARSE_RANK", "KVSPARSE_NUM_WORKERS", "KVSPARSE_STALENESS"):
        monkeypatch.delenv(name, raising=False)
    kv = kvsparse.create("dist_sparse")
    assert (kv.num_servers, kv.rank, kv.num_workers) == (2, 0, 1)
    assert kv._backend.timeout == 30.0 and kv._backend.mode == "bsp"
    kv.close()


def test_store_kinds_and_bad_arguments(server_sets):
    servers = server_sets[1]
    with pytest.raises(errors.InvalidArgument):
        kvsparse.create("dist_sparse", servers=servers, rank=2, num_workers=2)
    with pytest.raises(errors.InvalidArgument):
        kvsparse.create("dist_sparse", servers="tcp://127.0.0.1:1")
    with pytest.raises(errors.InvalidArgument):
        kvsparse.create("dist_sparse", servers=servers, staleness=-1)
    kv = kvsparse.create("dist", servers=servers, timeout=30)
    assert kv._backend.mode == "bsp" and kv.type == "dist"
    kv.close()
    kv.close()  # idempotent
    with pytest.raises(errors.InvalidArgument, match="closed"):
        kv.stats()


def test_a_push_counts_as_a_table_step_on_shards_that_got_no_keys(pair):
    """Adam(step_mode='table') bias correction uses the table's push count on every shard."""
    key = fresh()
    table = kvsparse.SparseTable(
        dim=2, optimizer=optimizers.Adam(learning_rate=0.1, step_mode="table")
    )
    both(pair, "init", key, table)
    _, dist = pair
    shard = kvsparse._core.shard_of(np.arange(64, dtype=np.int64), dist.num_servers)
    first = np.array([0])  # one shard gets this push, the others none
    others = np.flatnonzero(shard != shard[0])[:3] if dist.num_servers > 1 else np.array([1, 2])
    both(pair, "push", key, (first, np.ones((1, 2), np.float32)))
    both(pair, "push", key, (others, np.ones((others.size, 2), np.float32)))
    assert_same(both(pair, "row_sparse_pull", key, row_ids=np.concatenate([first, others])))


def test_init_twice_identically_is_a_no_op_on_one_dist_store(server_sets):
    kv = kvsparse.create("dist_sparse", servers=server_sets[2], rank=0, num_workers=1, timeout=30)
    try:
        spec = dict(dim=2, initializer=initializers.Zeros(), seed=3)
        kv.init("twice_t", kvsparse.SparseTable(**spec))
        kv.init("twice_w", np.ones(3, np.float32))
        kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
        kv.push("twice_t", (np.array([1]), np.ones((1, 2), np.float32)))
        kv.init("twice_t", kvsparse.SparseTable(**spec))
        kv.init("twice_w", np.ones(3, np.float32))
        assert kv.row_sparse_pull("twice_t", row_ids=np.array([1])).tolist() == [[-1.0, -1.0]]
        with pytest.raises(errors.DuplicateKey, match="twice_t"):
            kv.init("twice_t", kvsparse.SparseTable(**{**spec, "seed": 4}))
        with pytest.raises(errors.DuplicateKey, match="twice_w"):
            kv.init("twice_w", np.ones(4, np.float32))
    finally:
        kv.set_optimizer(None)
        kv.close()


def test_stats_names_int_keys_as_ints_on_a_dist_store(server_sets):
    kv = kvsparse.create("dist_sparse", servers=server_sets[2], rank=0, num_workers=1, timeout=30)
    try:
        kv.init(424242, kvsparse.SparseTable(dim=2, initializer=initializers.Zeros()))
        assert kv.row_sparse_pull(424242, row_ids=np.array([5])).shape == (1, 2)
        stats = kv.stats()
        assert 424242 in stats["tables"] and "424242" not in stats["tables"]
        assert all(424242 in shard["tables"] for shard in stats["shards"])
    finally:
        kv.close()


def _trained_for_fork(servers, name: str):
    kv = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1, timeout=30)
    kv.init(name, kvsparse.SparseTable(dim=2, initializer=initializers.Constant(0.5)))
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    kv.push(name, (np.arange(8), np.arange(16, dtype=np.float32).reshape(8, 2)))
    return kv, kv.row_sparse_pull(name, row_ids=np.arange(10))


def test_a_dist_store_used_in_a_forked_child_reconnects_for_lookups(server_sets):
    # Before: the child's first pull blocked for ever on the parent's sockets, whatever
    # timeout= said. Now it reconnects (its own ZeroMQ context); pushes raise at once.
    kv, expected = _trained_for_fork(server_sets[2], "fork_bare")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            os.close(read_end)
            rows = kv.row_sparse_pull("fork_bare", row_ids=np.arange(10))
            try:
                kv.push("fork_bare", (np.array([1]), np.ones((1, 2), np.float32)))
                refused = "push went through"
            except errors.ForkedStore as exc:
                refused = str(exc)
            report = {"rows": rows.tolist(), "refused": refused, "stats": len(kv.stats()["shards"])}
            os.write(write_end, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    status = _wait_for_child(pid, timeout=60)
    with os.fdopen(read_end, "rb") as pipe:
        report = json.loads(pipe.read() or b"null")
    assert status == 0 and report is not None, (status, report)
    np.testing.assert_array_equal(report["rows"], expected)
    assert "forked" in report["refused"] and "PUSH_SPARSE" in report["refused"], report
    assert report["stats"] == 2
    # The parent's store goes on, and the child's push changed nothing.
    np.testing.assert_array_equal(kv.row_sparse_pull("fork_bare", row_ids=np.arange(10)), expected)
    kv.push("fork_bare", (np.array([9]), np.ones((1, 2), np.float32)))
    assert kv.row_sparse_pull("fork_bare", row_ids=np.array([9])).tolist() == [[-0.5, -0.5]]
    kv.close()


def _wait_for_child(pid: int, timeout: float) -> int:
    """The exit code of child pid, killed if it runs past timeout (then -9)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


class _RowsDataset:
    """A torch map-style Dataset whose items are rows looked up in a dist store."""

    def __init__(self, kv, name: str, size: int):
        self.kv, self.name, self.size = kv, name, size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        import torch

        rows = self.kv.row_sparse_pull(self.name, row_ids=np.array([index]))
        return torch.from_numpy(rows[0]), os.getpid()


def test_a_torch_dataloader_with_workers_looks_rows_up_in_a_dist_store(server_sets):
    torch = pytest.importorskip("torch")
    kv, expected = _trained_for_fork(server_sets[1], "fork_loader")
    loader = torch.utils.data.DataLoader(
        _RowsDataset(kv, "fork_loader", 10),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,  # a worker that hangs fails the test instead of blocking it
    )
    rows, pids = [], set()
    for batch, batch_pids in loader:
        rows.append(batch.numpy())
        pids.update(int(p) for p in batch_pids)
    np.testing.assert_array_equal(np.concatenate(rows), expected)
    assert len(pids) == 2 and os.getpid() not in pids  # looked up in both workers
    np.testing.assert_array_equal(
        kv.row_sparse_pull("fork_loader", row_ids=np.arange(10)), expected
    )
    kv.close()
