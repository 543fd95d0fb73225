"""ShardState: what one shard holds, and the operations applied to it.

The `local` store keeps one ShardState in its own process; each `kvsparse
server` process keeps one and applies the requests it receives to it. Both
paths run the same code, so `local` and `dist_sparse` give the same results.

A shard holds, per key (identified on the wire by a 64-bit table id):
- sparse tables: its share of the rows (a kvsparse._core.Table);
- dense keys: one contiguous slice of the flattened array, with the
  optimizer's slots for that slice and a step counter.

Everything arriving here is validated again: a server never trusts a client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvsparse import _core, errors
from kvsparse.shard.tier import ShardTier
from kvsparse.table import TIER_COUNTERS, policy_of, tier_stats  # noqa: F401 (re-exported)

# What sparse_entry / dense_entry say when the key exists as the other kind.
_DENSE_NOT_SPARSE = (
    "key {name!r} is dense; use pull/push, not row_sparse_pull or a push of (ids, rows)"
)
_SPARSE_NOT_DENSE = "key {name!r} is a sparse table; use row_sparse_pull and push (ids, rows)"


def with_stream_version(spec: dict, version: int) -> dict:
    """A table spec whose initializer names its stream version (`version` if it names none).

    The version is stored with the table (and so in its checkpoints): rows of ids never
    stored depend on it (`_core.INITIALIZER_VERSION` is the current one).
    """
    initializer = spec["initializer"]
    if "version" in initializer:
        return spec
    return {**spec, "initializer": {**initializer, "version": int(version)}}


def _without_stream_version(spec: dict) -> dict:
    initializer = {k: v for k, v in spec["initializer"].items() if k != "version"}
    return {**spec, "initializer": initializer}


class TableDict(dict):
    """A dict that counts its changes in `version` (the serving fast path re-registers the
    tables when it moved: `kvsparse.server.fastpath`). Not thread-safe (ShardState's rule)."""

    version = 0

    def __setitem__(self, key, value):
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.version += 1
        super().__delitem__(key)

    def clear(self):
        self.version += 1
        super().clear()

    def update(self, *args, **kwargs):
        self.version += 1
        super().update(*args, **kwargs)

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def setdefault(self, key, default=None):
        self.version += 1
        return super().setdefault(key, default)


@dataclass
class SparseEntry:
    """A sparse table of this shard: its key name, spec and rows (ShardState's thread rule)."""

    name: str
    spec: dict
    table: _core.Table
    own_optimizer: bool
    # The spec its INIT_SPARSE gave (spec also records an own optimizer set later): an
    # identical INIT_SPARSE sent again (another rank's, a replay after a restart) matches it.
    init_spec: dict | None = None

    def __post_init__(self):
        if self.init_spec is None:
            self.init_spec = dict(self.spec)


@dataclass
class DenseEntry:
    """This shard's slice of a dense key, its optimizer slots and step counter.

    A float16 / bfloat16 key stores its values as 16-bit patterns (`dtype`);
    pushes widen them, run the optimizer in float32 and round the result
    once (nearest, ties to even). With an optimizer whose spec says
    multi_precision, such a key also keeps `master`, a float32 copy the
    optimizer updates; the values are then that copy rounded (MXNet's
    multi_precision). Slots are float32.

    Part of a ShardState: used by one thread at a time, like it.
    """

    name: str
    values: np.ndarray  # this shard's slice, 1-D: float32, or uint16 patterns of dtype
    optimizer_spec: dict | None
    own_optimizer: bool
    optimizer: _core.Optimizer | None = None
    slots: np.ndarray | None = None
    step: int = 0
    dtype: str = "float32"
    master: np.ndarray | None = None

    @classmethod
    def create(cls, name: str, values: np.ndarray, dtype: str = "float32") -> DenseEntry:
        """A new entry holding float32 values (a copy), stored in dtype, without optimizer."""
        values = np.array(values, dtype=np.float32, copy=True).reshape(-1)
        if dtype != "float32":
            values = _core.narrow(values, dtype)
        return cls(name, values, None, own_optimizer=False, dtype=dtype)

    def float_values(self) -> np.ndarray:
        """The values as float32: the live array of a float32 key, else a new one (the
        master copy's values under multi_precision)."""
        if self.dtype == "float32":
            return self.values
        if self.master is not None:
            return self.master.copy()
        return _core.widen(self.values, self.dtype)

    def write(self, values: np.ndarray) -> None:
        """Sets the values (float32, this slice's size): rounded once for a 16-bit key."""
        values = np.ascontiguousarray(values, np.float32).reshape(-1)
        if self.dtype == "float32":
            self.values[...] = values
            return
        _core.narrow(values, self.dtype, out=self.values)
        if self.master is not None:
            self.master[...] = values

    def set_optimizer(self, spec: dict | None) -> None:
        """Runs spec from now on (None: pushes replace the values); slots and step restart."""
        self.optimizer_spec = spec
        self.step = 0
        if spec is None or spec.get("kind") in (None, "none"):
            self.optimizer = None
            self.slots = None
        else:
            self.optimizer = _core.Optimizer(spec)
            self.slots = self.optimizer.initial_slots(self.values.size)
        multi = spec is not None and bool(spec.get("multi_precision"))
        if self.dtype == "float32" or not multi:
            self.master = None
        elif self.master is None:
            self.master = _core.widen(self.values, self.dtype)

    def set_learning_rate(self, learning_rate: float) -> None:
        """Changes only the learning rate of the optimizer it runs: slots and step stay."""
        self.optimizer_spec = {**self.optimizer_spec, "learning_rate": learning_rate}
        self.optimizer = _core.Optimizer(self.optimizer_spec)

    def push(self, grad: np.ndarray) -> None:
        """One update with the flat float32 gradient (checked already by the caller).

        Raises:
            UpdateOverflow: the result is not finite (or a 16-bit key's rounds to inf);
                the values, slots and step stay as they were.
        """
        self.commit(self.updated(grad))

    def nbytes(self) -> int:
        """Bytes of values, slots and master copy."""
        return (
            self.values.nbytes
            + (0 if self.slots is None else self.slots.nbytes)
            + (0 if self.master is None else self.master.nbytes)
        )

    def updated(self, grad: np.ndarray) -> tuple:
        """(values, slots, step, master) after applying grad, computed aside (the entry
        unchanged); `commit` writes them.

        values are in the stored form (float32, or the 16-bit patterns of dtype, rounded
        once); master is the new float32 master copy (None without multi_precision). No
        optimizer: the gradient replaces the values.

        Raises:
            UpdateOverflow: a value or slot of the result is not finite, or a 16-bit key's
                result rounds to inf.
        """
        work = self.values.copy() if self.dtype == "float32" else self.float_values()
        if self.optimizer is None:
            work[...] = grad
            slots, step = None, self.step
        else:
            slots, step = self.slots.copy(), self.step + 1
            self.optimizer.update(work, slots, grad, step)
        finite = bool(np.isfinite(work).all()) and (slots is None or np.isfinite(slots).all())
        stored = work
        if self.dtype != "float32":
            stored = _core.narrow(work, self.dtype)
            finite = (
                finite and _core.first_nonfinite_half_row(stored.reshape(1, -1), self.dtype) < 0
            )
        if not finite:
            raise errors.UpdateOverflow(
                f"key {self.name!r}: the update overflows {self.dtype} (its gradient and values "
                "are finite; the result is inf or NaN): nothing of this push was applied; "
                "lower the learning rate or clip the gradients"
            )
        return stored, slots, step, (work if self.master is not None else None)

    def commit(self, update: tuple) -> None:
        """Writes what `updated` computed."""
        values, slots, step, master = update
        self.values[...] = values
        if slots is not None:
            self.slots[...] = slots
        self.step = step
        if master is not None:
            self.master[...] = master

    def check_size(self, size: int, got: str) -> None:
        """Raises ShapeError unless size is this slice's size; got says what came instead."""
        if size != self.values.size:
            raise errors.ShapeError(
                f"key {self.name!r}: this shard holds {self.values.size} values, {got}"
            )

    def slots_array(self) -> np.ndarray:
        """The slots, (num_slots, size) float32; (0, size) when the key has no optimizer."""
        if self.slots is None:
            return np.empty((0, self.values.size), np.float32)
        return self.slots


@dataclass
class ShardCounters:
    """Requests and keys a shard served, since started (ShardState's thread rule)."""

    requests: int = 0
    keys: int = 0
    started: float = field(default_factory=time.monotonic)


class ShardState:
    """One shard's tables and dense slices.

    Args:
        memory_budget: bytes the shard may hold in memory (0: no budget).
        spill_dir: where rows beyond the budget go (None: no disk tier; an
            insert past the budget raises LimitExceeded). Needs a budget.
        tier: a `ShardTier` to share instead (a load's new state takes the
            serving state's, so both count against one budget).

    Not thread-safe: one thread uses a ShardState at a time (a server's loop
    thread; the local store's caller). A server's forked checkpoint writer
    reads its own copy-on-write image of it.

    Example:
        >>> state = ShardState()
        >>> state.create_sparse(1, "user", SparseTable(dim=4).to_dict())  # doctest: +SKIP
    """

    def __init__(
        self,
        memory_budget: int = 0,
        spill_dir: str | None = None,
        *,
        tier: ShardTier | None = None,
    ):
        if tier is None and (memory_budget or spill_dir is not None):
            tier = ShardTier(memory_budget, spill_dir)
        # None: no budget, and tables are made as they were before there was one.
        self.tier = tier
        self.sparse: TableDict = TableDict()  # table id -> SparseEntry
        self.dense: dict[int, DenseEntry] = {}
        self.default_optimizer: dict | None = None
        self.counters = ShardCounters()
        # Checkpoints (kvsparse.shard.checkpoint): rows written now are stamped with
        # change_epoch; saved_epoch is the epoch the checkpoint_base covered.
        self.change_epoch = 1
        self.saved_epoch = 0
        # (realpath, seq) of the last checkpoint this shard saved (with a manifest) or loaded.
        self.checkpoint_base: tuple | None = None
        # (realpath, seq, epoch) of this shard's saves not known to be committed yet: one
        # becomes the base once its manifest exists, never before (a save that failed on
        # another shard must not become the next delta's parent).
        self.uncommitted_saves: list[tuple] = []
        # A store-wide load in two steps: every shard loads into a new ShardState (kept
        # here), and only once all of them succeeded does each take it over.
        self.staged_load: ShardState | None = None
        # Wall time (time.time()) of the newest push or assign applied, None before the
        # first: checkpoints record it, serving replicas measure freshness by it.
        self.newest_push: float | None = None

    def clear(self) -> None:
        """Drops every table and dense key and the store-wide optimizer (before a load)."""
        self.sparse.clear()
        self.dense.clear()
        self.default_optimizer = None
        self.count_dense_bytes()

    def like(self) -> ShardState:
        """A new, empty ShardState with this one's memory budget and spill root (a load's)."""
        return ShardState(tier=self.tier)

    def count_dense_bytes(self) -> None:
        """Tells the memory budget what the dense keys hold (no budget: nothing to do)."""
        if self.tier is not None:
            self.tier.set_other_bytes(sum(entry.nbytes() for entry in self.dense.values()))

    def close(self) -> None:
        """Drops every table and removes the spill root (in the process that made it)."""
        self.clear()
        if self.tier is not None:
            self.tier.close()

    def replace_tables(self, loaded: ShardState) -> None:
        """Takes over loaded's tables, dense keys, optimizer and checkpoint bookkeeping.

        A load builds a new ShardState and hands it over here only once it is
        complete, so a failed load changes nothing. Counters stay. Not thread-safe
        (ShardState's rule); loaded is not used after.
        """
        self.sparse.clear()
        self.sparse.update(loaded.sparse)
        self.dense.clear()
        self.dense.update(loaded.dense)
        self.default_optimizer = loaded.default_optimizer
        self.change_epoch = loaded.change_epoch
        self.saved_epoch = loaded.saved_epoch
        self.checkpoint_base = loaded.checkpoint_base
        self.uncommitted_saves = list(loaded.uncommitted_saves)
        self.staged_load = None
        self.count_dense_bytes()

    def set_change_epoch(self, epoch: int) -> None:
        """Stamps later writes of every sparse table with epoch (see kvsparse.shard.checkpoint)."""
        self.change_epoch = epoch
        for entry in self.sparse.values():
            entry.table.change_epoch = epoch

    # -- lookup helpers -------------------------------------------------------------------

    def sparse_entry(self, table_id: int) -> SparseEntry:
        """The sparse table table_id; UnknownKey if absent, InvalidArgument if it is dense."""
        return _entry_of(table_id, self.sparse, self.dense, _DENSE_NOT_SPARSE)

    def dense_entry(self, table_id: int) -> DenseEntry:
        """The dense key table_id; UnknownKey if absent, InvalidArgument if it is sparse."""
        return _entry_of(table_id, self.dense, self.sparse, _SPARSE_NOT_DENSE)

    # -- creation and configuration ----------------------------------------------------------

    def create_sparse(self, table_id: int, name: str, spec: dict) -> bool:
        """Creates a sparse table; True if created, False if an identical one exists.

        Raises DuplicateKey when the key exists with another configuration.
        """
        pinned = "version" in spec["initializer"]
        spec = with_stream_version(spec, _core.INITIALIZER_VERSION)
        existing = self.sparse.get(table_id)
        if existing is not None or table_id in self.dense:
            # A spec that names no stream version matches a table of any version: the
            # same init after loading an old checkpoint adopts its (v1) table.
            if existing is not None and any(
                known == spec
                or (not pinned and _without_stream_version(known) == _without_stream_version(spec))
                for known in (existing.spec, existing.init_spec)
            ):
                return False
            raise errors.DuplicateKey(f"key {name!r} is already initialized differently")
        own = spec.get("optimizer") is not None
        optimizer = spec["optimizer"] if own else self.default_optimizer
        # Without a budget the table is made exactly as before (no budget argument at all).
        tiered = {} if self.tier is None else self.tier.table_options(name)
        table = _core.Table(
            int(spec["dim"]),
            spec["initializer"],
            optimizer,
            int(spec["seed"]),
            policy_of(spec),
            dtype=spec.get("dtype", "float32"),
            slot_dtype=spec.get("slot_dtype"),
            **tiered,
        )
        table.change_epoch = self.change_epoch
        self.sparse[table_id] = SparseEntry(name, dict(spec), table, own)
        return True

    def create_dense(
        self, table_id: int, name: str, values: np.ndarray, dtype: str = "float32"
    ) -> bool:
        """Creates this shard's slice of a dense key (stored in dtype); False if it exists."""
        if table_id in self.dense:
            if self.dense[table_id].values.size == values.size:
                return False
            raise errors.DuplicateKey(f"key {name!r} is already initialized with another shape")
        if table_id in self.sparse:
            raise errors.DuplicateKey(f"key {name!r} is already initialized as a sparse table")
        entry = DenseEntry.create(name, values, dtype)
        entry.set_optimizer(self.default_optimizer)
        self.dense[table_id] = entry
        self.count_dense_bytes()
        return True

    def set_optimizer(self, spec: dict | None) -> None:
        """Sets the store-wide optimizer: every key without its own restarts its slots."""
        if spec is not None:
            _core.Optimizer(spec)  # validate before changing anything
        self.default_optimizer = spec
        for entry in self.sparse.values():
            if not entry.own_optimizer:
                entry.table.set_optimizer(spec)
        for entry in self.dense.values():
            if not entry.own_optimizer:
                entry.set_optimizer(spec)
        self.count_dense_bytes()  # slots come and go with the optimizer

    def set_table_optimizers(self, table_ids: list, spec: dict | None) -> None:
        """Gives each table (sparse or dense) of table_ids its own optimizer spec.

        Such a table keeps it when the store-wide optimizer changes; spec None
        puts the tables back on the store-wide optimizer. Slots and steps of
        the tables restart. Every table is checked before any changes.

        Raises:
            UnknownKey: a table this shard does not hold. InvalidArgument: a bad spec.
        """
        if spec is not None:
            _core.Optimizer(spec)  # validate before changing anything
        entries = []
        for table_id in table_ids:
            entry = self.sparse.get(table_id)
            entries.append(entry if entry is not None else self.dense_entry(table_id))
        effective = spec if spec is not None else self.default_optimizer
        for entry in entries:
            entry.own_optimizer = spec is not None
            if isinstance(entry, SparseEntry):
                # The spec records it, so that checkpoints bring the table back with it.
                entry.spec = {**entry.spec, "optimizer": spec}
                entry.table.set_optimizer(effective)
            else:
                entry.set_optimizer(effective)
        self.count_dense_bytes()

    def set_learning_rate(self, learning_rate: float, table_ids: list | None = None) -> None:
        """Changes the learning rate of the optimizers tables run; every slot, row step and
        table step stays (a learning-rate schedule, where set_optimizer restarts them).

        table_ids None: the store-wide optimizer and every table's optimizer (their own
        ones included). Else those tables' optimizer: a table that ran the store-wide
        one then has its own, at the new rate (as ``set_optimizer(key=...)`` gives it).
        The specs record the rate, so that checkpoints keep it. Everything is checked
        before anything changes.

        Raises:
            InvalidArgument: a rate the optimizer refuses; a table of table_ids that
                runs no optimizer; table_ids None and no optimizer anywhere.
            UnknownKey: a table this shard does not hold.
        """
        if table_ids is None:
            entries = [*self.sparse.values(), *self.dense.values()]
        else:
            entries = [
                self.sparse[table_id] if table_id in self.sparse else self.dense_entry(table_id)
                for table_id in table_ids
            ]
        default = self.default_optimizer
        if table_ids is None and _runs(default):
            default = _with_rate(default, learning_rate)
        changes = []
        for entry in entries:
            if isinstance(entry, SparseEntry):
                spec = entry.spec.get("optimizer") if entry.own_optimizer else default
            else:
                spec = entry.optimizer_spec
            if _runs(spec):
                changes.append((entry, _with_rate(spec, learning_rate)))
            elif table_ids is not None:
                raise errors.InvalidArgument(
                    f"set_learning_rate: key {entry.name!r} runs no optimizer "
                    "(kv.set_optimizer first)"
                )
        if table_ids is None and not _runs(default) and not changes:
            raise errors.InvalidArgument(
                "set_learning_rate: no optimizer is set (kv.set_optimizer first)"
            )
        self.default_optimizer = default
        for entry, spec in changes:
            if table_ids is not None:
                entry.own_optimizer = True
            if isinstance(entry, SparseEntry):
                if entry.own_optimizer:
                    # The spec records it, so that checkpoints bring the table back with it.
                    entry.spec = {**entry.spec, "optimizer": spec}
                entry.table.set_learning_rate(learning_rate)
            else:
                entry.set_learning_rate(learning_rate)

    # -- sparse ------------------------------------------------------------------------------

    def pull_sparse(self, table_id: int, keys: np.ndarray, out: np.ndarray | None = None):
        """Rows of keys (missing ids: their initial value, not stored)."""
        entry = self.sparse_entry(table_id)
        self.counters.keys += keys.size
        return entry.table.lookup(keys, out)

    def prefetch_sparse(self, table_id: int, keys: np.ndarray) -> int:
        """Brings the rows of keys that are on disk into memory now; returns how many.

        The next batch's ids sent ahead (PREFETCH_SPARSE): the pull that names
        them later finds them in memory. Changes no row; 0 without a disk tier,
        and 0 when the rows do not fit the budget (nothing moved: the pull then
        reads them through, as it would have).

        Raises:
            UnknownKey: no such table. CorruptRecord, StorageError: as a pull.
        """
        table = self.sparse_entry(table_id).table
        try:
            return table.prefetch_rows(keys)
        except errors.LimitExceeded:
            return 0

    def push_sparse(self, table_id: int, keys: np.ndarray, grads: np.ndarray) -> int:
        """Applies the table's optimizer (or replaces rows) for keys; returns rows changed."""
        entry = self.sparse_entry(table_id)
        self.counters.keys += keys.size
        skip = entry.spec.get("nonfinite") == "skip"
        self.newest_push = time.time()
        return entry.table.apply_gradients(keys, grads, skip_nonfinite=skip)

    def push_sparse_tables(self, pushes: list) -> None:
        """Applies one request's pushes to several tables: all of them or none.

        pushes: (table_id, keys, grads, step) tuples, one per table (a table
        twice: its keys and rows are concatenated; duplicate ids are summed).
        A table with no keys here counts a step when step is true (the push
        had keys of it on other shards: `advance_sparse_step`).

        Every table's update is begun (checked, stored rows updated with
        their old state saved); if one fails (UpdateOverflow, NonFiniteGradient,
        a shape error...) the begun ones are put back and its error raised,
        with no table changed. Only then are they all finished. One table: the
        one-call path (`push_sparse`). Not atomic against a lack of memory
        while finishing (a MemoryError then leaves the tables finished before
        it applied).

        Raises:
            what push_sparse raises; nothing is changed then.
        """
        grouped: dict[int, list] = {}
        for table_id, keys, grads, step in pushes:
            grouped.setdefault(int(table_id), []).append((keys, grads, bool(step)))
        work = []
        for table_id, parts in grouped.items():
            entry = self.sparse_entry(table_id)
            keys = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
            grads = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
            work.append((table_id, entry, keys, grads, any(p[2] for p in parts)))
        updates = [w for w in work if w[2].size]
        if len(updates) <= 1:
            for table_id, _, keys, grads, step in work:
                if keys.size:
                    self.push_sparse(table_id, keys, grads)
                elif step:
                    self.advance_sparse_step(table_id)
            return
        begun = []
        try:
            for _, entry, keys, grads, _ in updates:
                skip = entry.spec.get("nonfinite") == "skip"
                entry.table.begin_push(keys, grads, skip_nonfinite=skip)
                begun.append(entry)
        except BaseException:
            for entry in reversed(begun):
                entry.table.cancel_push()
            raise
        try:
            for i, (_, entry, keys, _, _) in enumerate(updates):
                self.counters.keys += keys.size
                entry.table.finish_push()
                begun[i] = None
        except BaseException:
            for entry in begun:
                if entry is not None:
                    entry.table.cancel_push()
            raise
        self.newest_push = time.time()
        for table_id, _, keys, _, step in work:
            if not keys.size and step:
                self.advance_sparse_step(table_id)

    def advance_sparse_step(self, table_id: int) -> None:
        """Counts a push of the table that brought this shard none of its ids.

        Keeps the table step (Adam's per-table step, TTL ages) equal on every
        shard; runs the automatic TTL eviction when it is due.
        """
        self.sparse_entry(table_id).table.advance_step()

    def evict(self) -> dict:
        """Runs TTL eviction now on every sparse table: {table name: rows evicted}."""
        return {entry.name: entry.table.evict_expired() for entry in self.sparse.values()}

    def check_sparse_push(self, table_id: int, keys: np.ndarray, grads: np.ndarray) -> None:
        """Raises what push_sparse would raise, without changing anything."""
        entry = self._sparse_rows_entry(table_id, keys, grads, "gradient rows")
        if entry.spec.get("nonfinite") != "skip":
            bad = _core.first_nonfinite_row(grads)
            if bad >= 0:
                raise errors.NonFiniteGradient(
                    f"key {entry.name!r}: gradient for id {int(keys[bad])} has a NaN or inf value"
                )

    def _sparse_rows_entry(self, table_id: int, keys, rows, what: str) -> SparseEntry:
        """The table table_id, once rows is checked to be (keys.size, dim) of it."""
        entry = self.sparse_entry(table_id)
        dim = entry.table.dim
        if rows.ndim != 2 or rows.shape != (keys.size, dim):
            raise errors.ShapeError(
                f"key {entry.name!r}: {what} must have shape ({keys.size}, {dim}), got {rows.shape}"
            )
        return entry

    def check_sparse_assign(self, table_id: int, keys: np.ndarray, rows: np.ndarray) -> None:
        """Raises what assign_sparse would raise, without changing anything."""
        entry = self._sparse_rows_entry(table_id, keys, rows, "assigned rows")
        bad = _core.first_nonfinite_row(rows)
        if bad >= 0:
            raise errors.InvalidArgument(
                f"key {entry.name!r}: the row assigned to id {int(keys[bad])} "
                "has a NaN or inf value"
            )

    def assign_sparse(self, table_id: int, keys: np.ndarray, rows: np.ndarray) -> None:
        """Writes rows (keys.size, dim) verbatim: no optimizer, no admission counting.

        Inserted rows get initial slots; existing rows keep theirs (`_core.Table.assign`).
        Duplicate keys: the last row wins.
        """
        self.check_sparse_assign(table_id, keys, rows)
        self.counters.keys += keys.size
        self.newest_push = time.time()
        self.sparse[table_id].table.assign(keys, rows)

    # -- dense -------------------------------------------------------------------------------

    def pull_dense(self, table_id: int) -> np.ndarray:
        """This shard's slice of a dense key as float32 (a float32 key's live array, not a
        copy; a 16-bit key's values widened, exactly)."""
        entry = self.dense_entry(table_id)
        self.counters.keys += 1
        if entry.dtype == "float32":
            return entry.values
        return _core.widen(entry.values, entry.dtype)

    def check_dense_push(self, table_id: int, grad: np.ndarray) -> None:
        """Raises what push_dense would raise, without changing anything."""
        entry = self.dense_entry(table_id)
        entry.check_size(grad.size, f"the push has {grad.size}")
        if not np.isfinite(grad).all():
            raise errors.NonFiniteGradient(f"key {entry.name!r}: gradient has a NaN or inf value")

    def push_dense(self, table_id: int, grad: np.ndarray) -> None:
        """Applies the optimizer to the slice, or replaces it when there is none.

        Raises:
            NonFiniteGradient, ShapeError: a bad gradient. UpdateOverflow: a
            finite gradient whose update is not finite (inf or NaN in the new
            values or slots), as sparse tables do. The slice is unchanged then.
        """
        self.push_dense_keys([(table_id, grad)])

    def push_dense_keys(self, pushes: list) -> None:
        """Applies one request's pushes to several dense keys: all of them or none.

        pushes: (table_id, gradient) pairs (a key twice: its gradients are
        summed). Every update is computed on copies and checked first; only
        when all are finite are they written. Raises what push_dense raises,
        changing nothing.
        """
        grouped: dict[int, np.ndarray] = {}
        for table_id, grad in pushes:
            self.check_dense_push(table_id, grad)
            grad = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
            table_id = int(table_id)
            grouped[table_id] = grad if table_id not in grouped else grouped[table_id] + grad
        updates = [(self.dense[t], self.dense[t].updated(g)) for t, g in grouped.items()]
        if updates:
            self.newest_push = time.time()
        for entry, update in updates:
            self.counters.keys += 1
            entry.commit(update)

    def assign_dense(self, table_id: int, values: np.ndarray) -> None:
        """Replaces this shard's slice of a dense key with values (no optimizer)."""
        entry = self.dense_entry(table_id)
        entry.check_size(values.size, f"got {values.size}")
        entry.write(values)

    # -- optimizer state and stats ---------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of the arrays optimizer_state() would build, without building them."""
        total = 0
        for entry in self.sparse.values():
            table = entry.table
            total += len(table) * (8 + 8 + 4 * table.num_slots * table.dim)  # keys, steps, slots
        for entry in self.dense.values():
            total += entry.slots_array().nbytes
        return total

    def optimizer_state(self) -> dict:
        """{table_id: {"keys", "slots", "steps"} | {"slots", "step"}} of this shard."""
        state = {}
        for table_id, entry in self.sparse.items():
            chunks = list(entry.table.iter_chunks())
            dim, n_slots = entry.table.dim, entry.table.num_slots
            if chunks:
                keys = np.concatenate([c[0] for c in chunks])
                slots = np.concatenate([c[2] for c in chunks])
                steps = np.concatenate([c[3] for c in chunks])
            else:
                keys = np.empty(0, np.int64)
                slots = np.empty((0, n_slots, dim), np.float32)
                steps = np.empty(0, np.int64)
            state[table_id] = {
                "keys": keys,
                "slots": slots,
                "steps": steps,
                "table_step": entry.table.table_step,
            }
        for table_id, entry in self.dense.items():
            state[table_id] = {"slots": entry.slots_array(), "step": entry.step}
        return state

    def load_optimizer_state(self, table_id: int, state: dict) -> None:
        """Sets slots and step counters from optimizer_state()'s form."""
        if table_id in self.sparse:
            table = self.sparse[table_id].table
            keys = np.ascontiguousarray(state["keys"], np.int64)
            slots = np.ascontiguousarray(state["slots"], np.float32)
            if slots.shape[1:] != (table.num_slots, table.dim):
                raise errors.ShapeError(
                    f"key {self.sparse[table_id].name!r}: saved slots have shape "
                    f"{slots.shape[1:]}, the optimizer needs {(table.num_slots, table.dim)}"
                )
            values = table.lookup(keys)
            table.write_state(keys, values, slots, np.ascontiguousarray(state["steps"], np.int64))
            table.table_step = int(state.get("table_step", 0))
            return
        entry = self.dense_entry(table_id)
        slots = np.ascontiguousarray(state["slots"], np.float32)
        current = entry.slots_array()
        if slots.shape != current.shape:
            raise errors.ShapeError(
                f"key {entry.name!r}: saved slots have shape {slots.shape}, "
                f"the optimizer needs {current.shape}"
            )
        if entry.slots is not None:
            entry.slots[...] = slots
        entry.step = int(state["step"])

    def stats(self) -> dict:
        """Rows and bytes per key, requests and keys served, keys/s since start.

        With a memory budget, each sparse table also has ``"tier"``
        (`tier_stats`: rows in memory and on disk, hit rate, disk bytes, bytes
        read and written, evictions to disk, GC), and the shard ``"memory"``:
        ``{"budget": bytes, "used": bytes}``.
        """
        elapsed = max(time.monotonic() - self.counters.started, 1e-9)
        tables = {}
        for entry in self.sparse.values():
            policy = entry.table.policy_stats()
            tables[entry.name] = {
                "kind": "sparse",
                "rows": len(entry.table),
                "bytes": entry.table.memory_bytes(),
                "admissions": policy["admissions"],
                "evictions": policy["evicted_ttl"] + policy["evicted_capacity"],
                "evicted_ttl": policy["evicted_ttl"],
                "evicted_capacity": policy["evicted_capacity"],
                "rejected": policy["rejected"],
                "candidates": policy["candidates"],
            }
            if self.tier is not None:
                tables[entry.name]["tier"] = tier_stats(entry.table.tier_stats())
        for entry in self.dense.values():
            tables[entry.name] = {
                "kind": "dense",
                "rows": entry.values.size,
                "bytes": entry.nbytes(),
            }
        found = {
            "tables": tables,
            "requests": self.counters.requests,
            "keys": self.counters.keys,
            "keys_per_second": self.counters.keys / elapsed,
        }
        if self.tier is not None:
            found["memory"] = {"budget": self.tier.memory_budget, "used": self.tier.used()}
        return found


def _runs(spec: dict | None) -> bool:
    """Whether an optimizer spec updates rows (None and kind 'none': a push replaces them)."""
    return spec is not None and spec.get("kind") not in (None, "none")


def _with_rate(spec: dict, learning_rate: float) -> dict:
    """spec at another learning rate, checked by the core's rules (InvalidArgument)."""
    changed = {**spec, "learning_rate": learning_rate}
    _core.Optimizer(changed)
    return changed


def _entry_of(table_id: int, entries: dict, other_kind: dict, wrong_kind: str):
    """entries[table_id], else the error that says why the key is not there."""
    entry = entries.get(table_id)
    if entry is not None:
        return entry
    if table_id in other_kind:
        raise errors.InvalidArgument(wrong_kind.format(name=other_kind[table_id].name))
    raise errors.UnknownKey(f"table id {table_id:#x} is not initialized on this shard")
