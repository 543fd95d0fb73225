"""LocalBackend: the `local` store's one in-process shard (a `kvsparse.store.backend.Backend`)."""

from __future__ import annotations

import functools
import threading

from kvsparse import _core, errors
from kvsparse.shard.state import ShardState

FLOAT32 = "float32"


def _serialized(method):
    """Runs method under the backend's lock (see LocalBackend: threads).

    Raises InvalidArgument once the backend is closed: a closed store takes
    nothing (a table created or saved after close would be lost or empty).
    """

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            self._check_open()
            return method(self, *args, **kwargs)

    return locked


class LocalBackend:
    """Serves the KVStore frontend from a ShardState in this process.

    The same ShardState code runs inside each `kvsparse server`, so `local`
    and `dist_sparse` compute the same results.

    Threads: safe to call from several threads at once. Every method runs
    under one lock, because the C++ table is not thread-safe and the bridge
    releases the GIL inside each table call (a local store used from 4
    threads crashed). The GIL stays released inside the C++ work, so other
    Python threads keep running; the store's own preparation (id planning,
    summing duplicate rows, gathering pulled rows) runs outside this lock,
    in parallel.
    """

    num_shards = 1
    rank = 0
    num_workers = 1

    def __init__(self, memory_budget: int = 0, spill_dir: str | None = None):
        """memory_budget, spill_dir: the shard's (`kvsparse.shard.state.ShardState`)."""
        self.clock = 0  # pushes made (`kvsparse.KVStore.clock`)
        self.state = ShardState(memory_budget, spill_dir)
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidArgument("this store is closed")

    @_serialized
    def init_sparse(self, table_id, name, spec):
        """Creates the sparse table (an identical existing one is kept)."""
        self.state.create_sparse(table_id, name, spec)

    @_serialized
    def init_dense(self, table_id, name, values, dtype="float32"):
        """Creates the dense key holding values (stored in dtype)."""
        self.state.create_dense(table_id, name, values, dtype)

    @_serialized
    def set_optimizer(self, spec, table_ids=None):
        """Sets (spec) or removes (None) the store-wide optimizer, or tables' own."""
        if table_ids is None:
            self.state.set_optimizer(spec)
        else:
            self.state.set_table_optimizers(table_ids, spec)

    @_serialized
    def set_learning_rate(self, learning_rate, table_ids=None):
        """Changes the optimizers' learning rate (every table's, or table_ids'); slots stay."""
        self.state.set_learning_rate(learning_rate, table_ids)

    @_serialized
    def assign_sparse(self, items):
        """items: [(table_id, keys, offsets, rows)]; all checked before any is written."""
        self.state.counters.requests += 1
        for table_id, keys, _, rows in items:
            self.state.check_sparse_assign(table_id, keys, rows)
        for table_id, keys, _, rows in items:
            self.state.assign_sparse(table_id, keys, rows)

    defers_pulls = False
    """pull_sparse(wait=False) pulls at once: there is nothing to wait for in process."""

    def pull_sparse(self, items, wait=True):
        """items: [(table_id, keys, offsets[, wire_dtype])] -> [[rows of shard 0]].

        Rows of a 16-bit wire dtype are rounded to it (uint16 bit patterns), as
        a server's reply is: `local` gives the numbers `dist_sparse` gives.
        wait=False: a callable returning that list (pulled already).
        """
        wires = [wire[0] if wire else FLOAT32 for _, _, _, *wire in items]
        rows = self._pull_rows([(table_id, keys) for table_id, keys, *_ in items])
        # Rounded outside the lock, like the rest of the store's own preparation.
        result = [
            [shard_rows if wire == FLOAT32 else _core.narrow(shard_rows, wire)]
            for shard_rows, wire in zip(rows, wires)
        ]
        return result if wait else lambda: result

    def prefetch_sparse(self, items):
        """None: in process a pull reads its rows at once, there is nothing to start early."""
        del items
        return None

    @_serialized
    def _pull_rows(self, pulls):
        self.state.counters.requests += 1
        return [self.state.pull_sparse(table_id, keys) for table_id, keys in pulls]

    def rows_buffer(self, count, dim):
        """None: a push's summed rows may be any array in process."""
        del count, dim
        return None

    def push_sparse(self, items, wait=True):
        """items: [(table_id, keys, offsets, summed rows[, wire_dtype])]; rows of a 16-bit
        wire dtype are widened as a server widens them. All of them or none. Applied
        before it returns, whatever wait says (nothing to wait for in process)."""
        del wait
        self.clock += 1
        pushes = []
        for table_id, keys, _, rows, *wire in items:
            if wire and wire[0] != FLOAT32:
                rows = _core.widen(rows, wire[0])
            pushes.append((table_id, keys, rows))
        self._push_rows(pushes)

    @_serialized
    def _push_rows(self, pushes):
        self.state.counters.requests += 1
        for table_id, keys, rows in pushes:
            self.state.check_sparse_push(table_id, keys, rows)
        # All the tables or none, as a server applies a request.
        self.state.push_sparse_tables([(t, keys, rows, False) for t, keys, rows in pushes])

    @_serialized
    def pull_dense(self, items):
        """items: [(table_id, flat out)]."""
        self.state.counters.requests += 1
        for table_id, out in items:
            out[...] = self.state.pull_dense(table_id)

    @_serialized
    def push_dense(self, items, wait=True):
        """items: [(table_id, flat gradient)]: all of them or none; applied
        before it returns, whatever wait says."""
        del wait
        self.clock += 1
        self.state.counters.requests += 1
        self.state.push_dense_keys(items)  # all checked and computed before any is written

    @_serialized
    def optimizer_states(self):
        """[{table_id: state}] of the one shard."""
        return [self.state.optimizer_state()]

    @_serialized
    def load_optimizer_states(self, loads):
        """loads: [(shard, table_id, state)]; the shard is always 0 here."""
        for _, table_id, state in loads:
            self.state.load_optimizer_state(table_id, state)

    @_serialized
    def checkpoint(self, requests, gather=False):
        """{shard: request body} -> {shard: reply}, run in this process (`checkpoint.handle`).

        gather: a failed shard's error (a KVSparseError) is its value. A file system error
        (a path under a file, no permission, a full disk) is the request's problem and
        becomes a CheckpointError, as a server answers it.
        """
        from kvsparse.shard import checkpoint

        replies = {}
        for s, body in requests.items():
            try:
                try:
                    replies[s] = checkpoint.handle(self.state, body, 0, 1)
                except OSError as exc:
                    raise errors.CheckpointError(f"checkpoint: {exc}") from None
            except errors.KVSparseError as exc:
                if not gather:
                    raise
                replies[s] = exc
        return replies

    def barrier(self):
        """One worker: nothing to wait for (InvalidArgument once closed)."""
        self._check_open()

    @_serialized
    def evict(self):
        """TTL eviction now: [{table name: rows evicted}] (one shard)."""
        return [self.state.evict()]

    @_serialized
    def stats(self):
        """[stats of the one shard], its address 'local'."""
        return [{"address": "local", **self.state.stats()}]

    def close(self):
        """Drops the tables; every later call raises InvalidArgument (idempotent)."""
        with self._lock:
            self._closed = True
            self.state.close()  # the spill directory goes now, not at exit
            self.state = ShardState()
