"""The interface between the KVStore API and where the tables live.

`KVStore` checks and batches every call, then hands it to a `Backend`:
`kvsparse.store.local.LocalBackend` (one shard in this process) or
`kvsparse.client.remote.RemoteBackend` (one shard per `kvsparse server`).
Both implement every member below with the same signature
(tests/test_backend.py checks it), so an operation cannot be added to one of
them only.

What a backend receives is already validated and planned by the frontend:
keys of a sparse request are unique, grouped by shard (``offsets[s]`` to
``offsets[s + 1]`` belong to shard ``s``), gradient rows summed per key, and
every array C-contiguous. Sparse rows move in the item's *wire dtype*
('float32' where an item does not name one): a push's rows come already
rounded to it, as uint16 bit patterns for 'float16' / 'bfloat16', and a pull
returns its rows in it; the frontend widens them into the caller's output.
The local backend rounds as the servers' replies are rounded, so both
backends give the same numbers. A backend never sees a user's key: tables
are named by their 64-bit table id (`kvsparse.placement.table_id_of`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    """What `KVStore` calls; see the module docstring for the shape of the items.

    Neither backend is safe to call from several threads at once: the
    frontend (and the adapters' `store_lock`) call one from one thread at a time.
    """

    num_shards: int
    """How many shards hold the tables (1 for the local backend)."""
    rank: int
    """This worker's rank, 0..num_workers-1."""
    num_workers: int
    """How many workers share the shards."""
    clock: int
    """Pushes made (push_sparse and push_dense calls): `kvsparse.KVStore.clock`."""
    defers_pulls: bool
    """Whether pull_sparse(wait=False) returns before the rows are there (its requests
    sent, the replies read by the callable it returns); else it pulls at once."""

    def init_sparse(self, table_id: int, name: str, spec: dict) -> None:
        """Creates sparse table `table_id` (`SparseTable.to_dict()` spec) on every shard."""

    def init_dense(
        self, table_id: int, name: str, values: np.ndarray, dtype: str = "float32"
    ) -> None:
        """Creates dense key `table_id` holding flat float32 `values` (rank 0's win), stored
        in dtype ('float32', 'float16' or 'bfloat16')."""

    def set_optimizer(self, spec: dict | None, table_ids: list | None = None) -> None:
        """Sets (`Optimizer.to_dict()`) or removes (None) the store-wide optimizer; with
        table_ids, those tables' own optimizer instead (None: back to the store-wide one)."""

    def set_learning_rate(self, learning_rate: float, table_ids: list | None = None) -> None:
        """Changes the learning rate of the optimizers of every table and the store-wide
        one (table_ids None), or of table_ids' (then their own); slots and steps stay."""

    def assign_sparse(self, items: list) -> None:
        """items: [(table_id, unique keys, offsets, float32 rows)]: rows written verbatim
        (no optimizer, no admission counting); all checked before any is written."""

    def pull_sparse(self, items: list, wait: bool = True):
        """items: [(table_id, keys, offsets[, wire_dtype])] -> per item, [rows of each shard].

        Each shard's rows: (n, dim), float32 or uint16 bit patterns of the item's wire dtype.
        wait=False: a callable returning that list instead (see `defers_pulls`); a later
        call of the backend may read the replies first, and keeps them for it.
        """

    def prefetch_sparse(self, items: list):
        """items: [(table_id, keys, offsets)]: ids a pull will name soon. Where `defers_pulls`,
        sent now (each shard brings their rows on disk into memory) and a callable returned
        that gives the rows each item brought in; elsewhere None (nothing sent)."""

    def rows_buffer(self, count: int, dim: int) -> np.ndarray | None:
        """A fresh (count, dim) float32 array for a push's summed rows that push_sparse
        sends without a copy (the remote backend's shared memory), or None: any array."""

    def push_sparse(self, items: list, wait: bool = True) -> None:
        """items: [(table_id, keys, offsets, summed rows[, wire_dtype])], rows in the wire
        dtype; all checked before any applies. wait=False: may return once sent, the
        acknowledgements collected by the next call (`kvsparse.KVStore.push`)."""

    def pull_dense(self, items: list) -> None:
        """items: [(table_id, flat float32 out)]; fills each out."""

    def push_dense(self, items: list, wait: bool = True) -> None:
        """items: [(table_id, flat float32 gradient)]; all checked before any applies;
        wait as in push_sparse."""

    def optimizer_states(self) -> list:
        """Per shard, {table_id: state} (what `ShardState.optimizer_state` returns)."""

    def load_optimizer_states(self, loads: list) -> None:
        """loads: [(shard, table_id, state)]; restores optimizer slots and step counters."""

    def checkpoint(self, requests: dict, gather: bool = False) -> dict:
        """{shard: CHECKPOINT request body} -> {shard: reply}.

        The bodies' actions are `kvsparse.shard.checkpoint.CheckpointAction` members.
        gather: wait for every shard, and give a failed shard's error as its
        value instead of raising the first one (a save or load that failed
        somewhere is then undone everywhere).
        """

    def barrier(self) -> None:
        """Blocks until every worker called barrier."""

    def evict(self) -> list:
        """Runs TTL eviction now: per shard, {table name: rows evicted}."""

    def stats(self) -> list:
        """Per shard, {'address', 'tables': {name: {'kind', 'rows', 'bytes', ...}}, ...}."""

    def close(self) -> None:
        """Releases the connections or the tables (idempotent)."""


__all__ = ["Backend"]
