"""Ids sent ahead (PREFETCH_SPARSE) start a tiered server's disk reads at once; no result moves.

A worker that knows the next batch's ids before this step's backward sends them
ahead (``kv.row_sparse_prefetch``, the torch adapter's ``warm_together``): the
server brings their rows on disk into memory when the request arrives, and the
pull sent after the push finds them there. These tests run real servers on
127.0.0.1 with a memory budget far below their rows and check, through the
tier's counters, that the reads happened before the push was sent and that
neither the push nor the pull read the disk again; and that every pulled row
equals a plain dict model's, exactly (SGD on dyadic numbers: no rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ServerProcess

import kvsparse
from kvsparse import _core, initializers, optimizers

DIM = 8
ROWS = 80_000  # about 5 MB of rows and key index against a 2 MiB budget
LEARNING_RATE = 0.5


class DictModel:
    """SGD from zero rows, one row per id in a dict: what every pull must return."""

    def __init__(self):
        self.rows: dict[int, np.ndarray] = {}

    def pull(self, ids: np.ndarray) -> np.ndarray:
        zero = np.zeros(DIM, np.float32)
        return np.stack([self.rows.get(int(i), zero) for i in ids.reshape(-1)])

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.reshape(-1).tolist(), grads.reshape(-1, DIM)):
            summed[i] = summed.get(i, np.zeros(DIM, np.float32)) + g
        for i, g in summed.items():
            self.rows[i] = (
                self.rows.get(i, np.zeros(DIM, np.float32)) - np.float32(LEARNING_RATE) * g
            )


def _grads(rng, count: int) -> np.ndarray:
    # Multiples of 1/4 in [-2, 2]: every sum and update below is exact in float32.
    return (rng.integers(-8, 9, size=(count, DIM)) / 4).astype(np.float32)


def _tier(kv) -> dict:
    return kv.stats()["tables"]["emb"]["tier"]


@pytest.fixture
def tiered_store(tmp_path):
    servers = [
        ServerProcess(
            extra_args=["--memory-budget", "2MiB", "--spill-dir", str(tmp_path / f"spill-{i}")]
        )
        for i in range(2)
    ]
    kv = kvsparse.create("dist_sparse", servers=[s.address for s in servers], timeout=30)
    try:
        kv.init(
            "emb",
            kvsparse.SparseTable(
                dim=DIM,
                initializer=initializers.Zeros(),
                optimizer=optimizers.SGD(LEARNING_RATE),
            ),
        )
        yield kv
    finally:
        kv.close()
        for server in servers:
            server.stop()


def _populate(kv, model: DictModel, rng) -> None:
    for begin in range(0, ROWS, 4_000):
        ids = np.arange(begin, begin + 4_000, dtype=np.int64)
        grads = _grads(rng, ids.size)
        kv.push("emb", (ids, grads))
        model.push(ids, grads)


def test_ids_sent_ahead_are_read_in_on_arrival_and_the_pull_after_the_push_reads_no_disk(
    tiered_store,
):
    kv, model, rng = tiered_store, DictModel(), np.random.default_rng(0)
    assert kv.defers_pulls
    _populate(kv, model, rng)
    tier = _tier(kv)
    assert tier["rows_on_disk"] > ROWS // 2, tier
    ids = rng.integers(0, ROWS, size=512)
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=ids), model.pull(ids))
    read_ahead = 0
    for _ in range(6):
        next_ids = rng.integers(0, ROWS, size=512)
        next_ids[:8] = ids[:8]  # ids of both batches: the pull must see this step's update
        before = _tier(kv)
        # Sent ahead, answered before this step's push is even sent: the reads are done.
        brought_in = kv.row_sparse_prefetch("emb", next_ids).wait()
        after_prefetch = _tier(kv)
        assert brought_in == after_prefetch["rows_read"] - before["rows_read"] > 0
        assert after_prefetch["disk_hits"] - before["disk_hits"] == brought_in
        read_ahead += brought_in
        grads = _grads(rng, ids.size)
        kv.push("emb", (ids, grads), wait=False)
        model.push(ids, grads)
        pulled = kv.row_sparse_pull("emb", row_ids=next_ids)
        np.testing.assert_array_equal(pulled, model.pull(next_ids))
        # Neither the push nor the pull went to the disk: the rows read ahead stayed in.
        after_pull = _tier(kv)
        assert after_pull["rows_read"] == after_prefetch["rows_read"], (after_prefetch, after_pull)
        assert after_pull["disk_hits"] == after_prefetch["disk_hits"]
        ids = next_ids
    assert read_ahead > 0
    everything = np.arange(ROWS, dtype=np.int64)
    np.testing.assert_array_equal(
        kv.row_sparse_pull("emb", row_ids=everything), model.pull(everything)
    )


def test_a_prefetch_changes_no_row_and_inserts_no_id(tiered_store):
    kv, model, rng = tiered_store, DictModel(), np.random.default_rng(1)
    _populate(kv, model, rng)
    unknown = np.arange(ROWS, ROWS + 100, dtype=np.int64)
    ids = np.concatenate([rng.integers(0, ROWS, size=300), unknown])
    stored = kv.stats()["tables"]["emb"]["rows"]
    assert kv.row_sparse_prefetch("emb", ids).wait() > 0
    assert kv.stats()["tables"]["emb"]["rows"] == stored  # ids stored nowhere stay so
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=ids), model.pull(ids))


def test_a_store_that_does_not_defer_pulls_sends_nothing():
    kv = kvsparse.create("local")
    try:
        kv.init("emb", kvsparse.SparseTable(dim=DIM))
        assert kv.row_sparse_prefetch("emb", np.arange(4)) is None
    finally:
        kv.close()


def test_torch_warm_together_reads_ahead_and_trains_as_without_it(tiered_store):
    torch = pytest.importorskip("torch")
    from kvsparse.adapters.torch import Embedding, prefetch_together, push_together, warm_together

    kv, model, rng = tiered_store, DictModel(), np.random.default_rng(2)
    _populate(kv, model, rng)
    embedding = Embedding(kv, "emb", DIM)
    batches = [torch.from_numpy(rng.integers(0, ROWS, size=(64, 4))) for _ in range(6)]
    for step, ids in enumerate(batches):
        rows = embedding(ids)
        np.testing.assert_array_equal(
            rows.detach().numpy().reshape(-1, DIM), model.pull(ids.numpy())
        )
        upstream = torch.from_numpy(_grads(rng, ids.numel()).reshape(64, 4, DIM))
        if step + 1 < len(batches):
            warm_together([embedding], batches[step + 1])
        with push_together(kv, wait=False):
            (rows * upstream).sum().backward()
        model.push(ids.numpy(), upstream.numpy())
        if step + 1 < len(batches):
            prefetch_together([embedding], batches[step + 1])
    assert embedding.prefetch_hits == len(batches) - 1
    assert embedding.warmed_rows > 0


@pytest.mark.parametrize("first_read", ["lookup", "prefetch_rows"])
def test_rows_a_read_brought_in_stay_in_while_another_table_makes_room(tmp_path, first_read):
    """The rows of a table's last two reads (pulls, prefetches) are not moved out for
    another table's room.

    Two tables share a budget, their rows all equally cold (assigned once). The first
    reads ids from disk; the second then reads a large batch of its own disk rows, and
    the budget asks the first table for room: the first's other rows go. The push of
    the ids the first table read finds them in memory. (Before: the victims were drawn
    among rows of equal score at random, the rows just read included, and that push
    read the disk again.)
    """
    budget = _core.MemoryBudget(2 << 20)
    first, second = (
        _core.Table(
            DIM,
            {"kind": "zeros"},
            optimizers.SGD(LEARNING_RATE).to_dict(),
            budget=budget,
            spill_dir=str(tmp_path / name),
            name=name,
        )
        for name in ("first", "second")
    )
    rng = np.random.default_rng(3)
    for table in (second, first):  # the first populated last: it holds most of the memory
        for begin in range(0, ROWS, 4_000):
            ids = np.arange(begin, begin + 4_000, dtype=np.int64)
            table.assign(ids, _grads(rng, ids.size))
    assert first.tier_stats()["rows_in_memory"] > 4 * second.tier_stats()["rows_in_memory"]
    ids = rng.choice(ROWS, size=256, replace=False).astype(np.int64)
    before = first.tier_stats()
    if first_read == "lookup":
        first.lookup(ids)
    else:
        first.prefetch_rows(ids)
    read = first.tier_stats()
    assert read["rows_read"] - before["rows_read"] > 200
    second.lookup(rng.choice(ROWS, size=8_000, replace=False).astype(np.int64))
    assert first.tier_stats()["evictions"] - read["evictions"] > 1_000  # the first gave room
    first.apply_gradients(ids, _grads(rng, ids.size))
    assert first.tier_stats()["rows_read"] == read["rows_read"]


def test_a_servers_merges_run_in_its_idle_time_and_change_no_row(tiered_store):
    """The disk tier's merges run between requests (the C++ serving loop's idle work), not
    inside the pushes that earned them; every row stays exact."""
    kv, model, rng = tiered_store, DictModel(), np.random.default_rng(4)
    for _ in range(3):  # each pass moves every row out once more: runs to merge
        _populate(kv, model, rng)
    tier = _tier(kv)
    assert tier["rows_on_disk"] > ROWS // 4 and tier["gc_bytes_moved"] > 0, tier
    # Idle after each push: the merges ran there.
    assert tier["idle_bytes_moved"] > tier["gc_bytes_moved"] // 2, tier
    everything = np.arange(ROWS, dtype=np.int64)
    np.testing.assert_array_equal(
        kv.row_sparse_pull("emb", row_ids=everything), model.pull(everything)
    )
