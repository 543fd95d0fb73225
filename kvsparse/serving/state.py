"""What a serving replica holds: its tables, in two copies, and the updates that reach them.

A serving replica (`kvsparse serve`) answers lookups from C++ tables
(`kvsparse._core.Table`: the batch lookup runs without the GIL) and takes
each new checkpoint over *atomically*: a lookup sees the state before an
update or after it, never a mix.

How: left-right (two copies of every table, `ServingState`). Lookups read
the *active* copy; an update is applied to the other one (which no lookup
reads), the copies swap under a lock held for a pointer assignment, and once
the lookups still reading the old copy are done the update is applied to it
too. Lookups never wait for an update, so their latency does not grow while
a large delta lands; the price is twice the rows' memory. Nor do they wait
for the GIL: an update's rows are checked (zlib) and written (C++,
`_core.assign_marked_rows`) with it released, and what runs with it held
lasts under a millisecond at a time (1e5-row deltas). Building the new
state aside and swapping a reference needs a third copy for a delta (or a
copy per delta); a lock that lookups take would stall them for the whole
apply (tens of milliseconds for 10^5 rows).

Each table is stored one column wider than its rows: the last column is 1.0
for a stored id, and the table's initializer is zeros, so a lookup of an id
the replica does not hold comes back all zeros, marker included. That tells
stored ids from unseen ones in the same C++ batch, which the request's
``default`` needs ('zeros', or 'initializer': the value the training store
would give an unseen id, from the table's own initializer and seed).

An `Update` is everything one checkpoint (or export) changes, read and
checked before anything is applied: every block's CRC-32, every table's
shape. A missing, truncated or corrupt file raises `CheckpointError` while
the update is prepared, and the state stays as it was.

Threads: `ServingState.lookup` may be called from any number of threads at
once; `ServingState.apply` from one thread at a time (the follower's), beside
the lookups.

Example:
    >>> state = ServingState()
    >>> state.apply(read_checkpoint("/ckpt"))                   # doctest: +SKIP
    >>> rows, version = state.lookup("user", np.array([1, 2]))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvsparse import _core, errors
from kvsparse.shard.checkpoint import manifest as manifests
from kvsparse.shard.checkpoint.export import (
    EXPORT_FORMAT,
    PART_RE,
    READABLE_EXPORT_VERSIONS,
    array_names,
)
from kvsparse.shard.checkpoint.format import CheckpointError, read_shard_file
from kvsparse.shard.checkpoint.shard_io import Resharding
from kvsparse.shard.tier import ShardTier

DEFAULTS = ("zeros", "initializer")
_ROWS_PER_ASSIGN = 65536  # rows written per call (bounds a float16 export's float32 copy)
_RESHARD_ROWS = 8192  # rows of a checkpoint block sorted by shard at a time (GIL held)


@dataclass(frozen=True)
class Selection:
    """Which part of the checkpoint a replica serves. Immutable.

    tables: table names, or None for every table.
    shard: (index, count): only the ids whose `_core.shard_of(id, count)` is
        index (hash-partitioned like training), or None for every id.
    """

    tables: frozenset | None = None
    shard: tuple | None = None

    def __post_init__(self):
        if self.shard is not None:
            index, count = self.shard
            if not (isinstance(count, int) and count >= 1 and 0 <= index < count):
                raise errors.InvalidArgument(f"shard must be I/N with 0 <= I < N, got {self.shard}")

    def wants(self, name: str) -> bool:
        """True if the replica serves table name."""
        return self.tables is None or name in self.tables

    def resharding(self, num_shards: int) -> Resharding | None:
        """How to pick this replica's ids from a checkpoint of num_shards shards (None: all)."""
        if self.shard is None:
            return None
        return Resharding(self.shard[0], self.shard[1], int(num_shards))

    def describe(self) -> dict:
        """A JSON-able description (status replies)."""
        return {
            "tables": None if self.tables is None else sorted(self.tables),
            "shard": None if self.shard is None else list(self.shard),
        }


@dataclass(frozen=True)
class TableInfo:
    """A served table's name, row width and spec. Immutable; `initial` is read-only.

    initial: a row-less `_core.Table` with the table's initializer and seed,
    whose `initial_values` gives unseen ids what training would.
    """

    name: str
    dim: int
    spec: dict
    initial: _core.Table = field(compare=False, repr=False)

    @classmethod
    def from_spec(cls, name: str, dim: int, spec: dict | None) -> TableInfo:
        """The info of a table of dim with spec (its "initializer" and "seed")."""
        spec = dict(spec or {})
        initial = _core.Table(int(dim), spec.get("initializer"), None, int(spec.get("seed", 0)))
        return cls(str(name), int(dim), spec, initial)


class Side:
    """One copy of the served tables and the version they hold.

    Used by `ServingState` only: lookups read it while it is active; the
    updater writes it while no lookup reads it.
    """

    def __init__(self, tier: ShardTier | None = None):
        self.tables: dict[str, _core.Table] = {}
        self.infos: dict[str, TableInfo] = {}
        self.version: dict | None = None
        self.tier = tier  # this copy's memory budget and spill root (half the replica's)

    def lookup(self, name: str, keys: np.ndarray, default: str) -> np.ndarray:
        """Rows (keys.size, dim) float32 of keys (int64, 1-D contiguous) in table name."""
        info = self.infos.get(name)
        if info is None:
            raise errors.UnknownKey(f"no table {name!r} on this serving replica")
        dim = info.dim
        wide = np.empty((keys.size, dim + 1), np.float32)
        self.tables[name].lookup(keys, wide)  # the GIL is released for the batch
        rows = wide[:, :dim]
        if default == "initializer":
            missing = wide[:, dim] == 0.0
            if missing.any():
                rows[missing] = info.initial.initial_values(np.ascontiguousarray(keys[missing]))
        return np.ascontiguousarray(rows)

    def rows(self) -> dict:
        """{table name: rows held}."""
        return {name: len(table) for name, table in self.tables.items()}

    def copy(self) -> Side:
        """A new Side with the same rows (rebuilds a copy an update failed half-way)."""
        other = Side(self.tier)
        other.infos = dict(self.infos)
        other.version = self.version
        for name, table in self.tables.items():
            fresh = _new_table(self.infos[name], self.tier)
            fresh.reserve(len(table))
            for keys, values, _, _ in table.iter_chunks(_ROWS_PER_ASSIGN):
                fresh.assign(keys, values)
            other.tables[name] = fresh
        return other


def _new_table(info: TableInfo, tier: ShardTier | None = None) -> _core.Table:
    # Zeros initializer, no optimizer: an id not stored reads as all zeros, marker included.
    # Lookups run on several threads at once: rows on disk are read through, not moved.
    tiered = {} if tier is None else {**tier.table_options(info.name), "concurrent_lookups": True}
    return _core.Table(info.dim + 1, {"kind": "zeros"}, None, 0, **tiered)


@dataclass
class TableChange:
    """One table's part of an update: ids to remove, then (keys, values) blocks to write.

    dtype: how the blocks' values are stored: 'float32', 'float16', or
    'bfloat16' (uint16 bit patterns, as exports hold them); they are widened
    to float32 a chunk at a time when applied.
    """

    info: TableInfo
    removed: list = field(default_factory=list)  # int64 arrays
    blocks: list = field(default_factory=list)  # (keys int64, values n x dim)
    dtype: str = "float32"


def _float32_rows(values: np.ndarray, dtype: str) -> np.ndarray:
    """values (stored as dtype, see TableChange) as C-contiguous float32; no copy if they are."""
    if dtype in ("float16", "bfloat16"):
        # Exact, without the GIL; bfloat16 arrives as bit patterns (uint16), which a
        # float32 cast would take for integers.
        return _core.widen(np.ascontiguousarray(values).view(np.uint16), dtype)
    return np.ascontiguousarray(values, np.float32)


@dataclass
class Update:
    """A checkpoint's (or export's) change to the served tables, checked before it is applied.

    reset: True for a full checkpoint or an export: the tables are replaced
    (tables not in it go); False for deltas, applied on top.
    changes: per table, in the order to apply them (a chain holds a table
    once per file that has it).
    version: what the state serves once applied: {"seq", "kind",
    "newest_push", "created", "source"}.

    Not thread-safe; `ServingState.apply` applies it to each copy in turn
    (it only reads it).
    """

    reset: bool
    changes: list
    version: dict

    @property
    def rows(self) -> int:
        """Rows this update writes (each copy)."""
        return sum(int(keys.size) for change in self.changes for keys, _ in change.blocks)

    def apply_to(self, side: Side) -> None:
        """Applies the update to one copy (no lookup may read it meanwhile)."""
        if self.reset:
            side.tables = {}
            side.infos = {}
        for change in self.changes:
            info = change.info
            table = side.tables.get(info.name)
            if table is None or side.infos[info.name].dim != info.dim:
                table = side.tables[info.name] = _new_table(info, side.tier)
            side.infos[info.name] = info
            for removed in change.removed:
                if removed.size:
                    table.remove(removed)
            total = sum(int(keys.size) for keys, _ in change.blocks)
            if total:
                table.reserve(len(table) + total)
            for keys, values in change.blocks:
                for start in range(0, keys.size, _ROWS_PER_ASSIGN):
                    part = slice(start, start + _ROWS_PER_ASSIGN)
                    # Widened to the marker column in C++, without the GIL: the NumPy
                    # widening copy held it about 3 ms per 65,536 rows, the longest
                    # stretch of an apply (0.5 ms now), while lookup threads waited. Rows
                    # of checkpoints are float32 views of the file (no copy here); 16-bit
                    # export parts are widened a chunk at a time.
                    part_values = _float32_rows(values[part], change.dtype)
                    _core.assign_marked_rows(table, keys[part], part_values, 1.0)
        side.version = dict(self.version, applied=time.time())


def _half(tier: ShardTier | None) -> ShardTier | None:
    """A ShardTier with half of tier's budget and its spill directory (None: None)."""
    if tier is None:
        return None
    return ShardTier(max(1, tier.memory_budget // 2), tier.spill_dir)


class ServingState:
    """The served tables (two copies, see the module docstring) and their version.

    tier: a `kvsparse.shard.tier.ShardTier` (``kvsparse serve --memory-budget``):
    each copy gets half its budget (a `ShardTier` of its own under the same spill
    directory: the copy being updated cannot take memory from the one being read).
    None: no budget.

    Threads: `lookup`, `version` and `describe` from any number of threads at
    once; `apply` from one thread at a time, beside them.
    """

    def __init__(self, tier: ShardTier | None = None):
        self.tier = tier
        self._sides = [Side(_half(tier)), Side(_half(tier))]
        self._active = 0
        self._readers = [0, 0]
        self._changed = threading.Condition()
        self._write_lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self):
        """The active copy, for the duration of a ``with`` block (an update waits for it)."""
        with self._changed:
            index = self._active
            self._readers[index] += 1
            side = self._sides[index]
        try:
            yield side
        finally:
            with self._changed:
                self._readers[index] -= 1
                if not self._readers[index]:
                    self._changed.notify_all()

    def lookup(self, table: str, ids, default: str = "zeros") -> tuple:
        """(rows ids.shape + (dim,) float32, version) of ids in table, from one version.

        Args:
            table: the table's name.
            ids: integers of any shape.
            default: what an id the replica does not hold gets: 'zeros' or
                'initializer' (what the training store would give it).

        Raises:
            UnknownKey: no such table here. KeyTypeError: ids are not integers.
            InvalidArgument: a bad default, or nothing loaded yet.

        Example:
            >>> rows, version = state.lookup("user", [[1, 2], [3, 4]])  # doctest: +SKIP
            >>> rows.shape, version["seq"]                               # doctest: +SKIP
            ((2, 2, 16), 7)
        """
        if default not in DEFAULTS:
            raise errors.InvalidArgument(f"default must be one of {DEFAULTS}, got {default!r}")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            if ids.size:
                raise errors.KeyTypeError(f"ids must be integers, got dtype {ids.dtype}")
            ids = ids.astype(np.int64)  # [] arrives as float64
        keys = np.ascontiguousarray(ids.reshape(-1), np.int64)
        with self.reading() as side:
            if side.version is None:
                raise errors.InvalidArgument("this serving replica has loaded no checkpoint yet")
            rows = side.lookup(str(table), keys, default)
            version = side.version
        return rows.reshape(ids.shape + (rows.shape[1],)), version

    def version(self) -> dict | None:
        """The version served now (None before the first update)."""
        with self.reading() as side:
            return side.version

    def describe(self) -> dict:
        """{"version", "tables": {name: {"dim", "rows"}}} of the active copy."""
        with self.reading() as side:
            rows = side.rows()
            tables = {
                name: {"dim": info.dim, "rows": rows[name]} for name, info in side.infos.items()
            }
            return {"version": side.version, "tables": tables}

    def _drain(self, index: int) -> None:
        with self._changed:
            while self._readers[index]:
                self._changed.wait()

    def apply(self, update: Update) -> None:
        """Makes update visible to every later lookup at once; lookups never wait for it.

        On an error (out of memory) the state is as before for lookups; the
        copy the update failed on is rebuilt from the other one.
        """
        with self._write_lock:
            standby = 1 - self._active
            self._drain(standby)
            try:
                update.apply_to(self._sides[standby])
            except BaseException:
                self._sides[standby] = self._sides[self._active].copy()
                raise
            with self._changed:
                self._active = standby
            old = 1 - standby
            self._drain(old)
            try:
                update.apply_to(self._sides[old])
            except BaseException:
                self._sides[old] = self._sides[standby].copy()
                raise


# -- reading checkpoints and exports into updates ---------------------------------------------


def checkpoint_version(manifest: dict) -> dict:
    """The version record of a checkpoint's manifest."""
    return {
        "source": "checkpoint",
        "seq": int(manifest["seq"]),
        "kind": manifest["kind"],
        "created": manifest.get("created"),
        "newest_push": manifest.get("newest_push"),
    }


def read_checkpoints(
    path: str, steps: list, reset: bool, selection: Selection, known: dict | None = None
) -> Update:
    """The update that applies the checkpoints of manifests steps in order.

    Args:
        path: the checkpoint directory.
        steps: manifests: a chain from a full checkpoint (reset) or deltas on
            what is served (each the parent of the next).
        reset: replace the tables (a full checkpoint first in steps).
        selection: the tables and shard this replica serves.
        known: {name: TableInfo} served now (deltas: a table's width must not change).

    Raises:
        CheckpointError: a missing, truncated or corrupt file, or a chain that
            changes a table's width or mixes shard counts.
    """
    known = {} if reset else dict(known or {})
    changes = []
    for manifest in steps:
        num_shards = int(manifest["num_shards"])
        reshard = selection.resharding(num_shards)
        indices = range(num_shards) if reshard is None else reshard.files()
        for index in indices:
            name = os.path.join(path, manifest["shards"][index]["file"])
            f = read_shard_file(name)
            if f.index["kind"] != manifest["kind"] or int(f.index["seq"]) != int(manifest["seq"]):
                raise CheckpointError(f"{f.path}: does not belong to checkpoint {manifest['seq']}")
            for section in f.index["sparse"]:
                table = str(section["name"])
                if not selection.wants(table):
                    continue
                dim = int(section["dim"])
                info = known.get(table)
                if info is None:
                    info = known[table] = TableInfo.from_spec(table, dim, section.get("spec"))
                elif info.dim != dim:
                    raise CheckpointError(f"{f.path}: table {table!r} changed width to {dim}")
                change = TableChange(info)
                change.removed.append(np.array(f.removed(section)))
                # The rows in the file, then those on disk of a checkpoint by reference
                # (read in place: new arrays, where the file's blocks are views of it).
                disk = ((k, v) for k, v, *_ in f.disk_rows(section))
                blocks = ((k, v) for k, v, *_ in f.sparse_blocks(section))
                for keys, values in itertools.chain(blocks, disk):
                    if reshard is None or reshard.same:
                        change.blocks.append((keys, values))
                        continue
                    # This replica's ids of a checkpoint saved on another shard count. In
                    # parts: a NumPy gather holds the GIL (about 3 ms for a 65,536-row
                    # block of dim 32, 0.3 ms for _RESHARD_ROWS), and lookups wait for it.
                    for start in range(0, keys.size, _RESHARD_ROWS):
                        part = slice(start, start + _RESHARD_ROWS)
                        mine = _core.shard_of(keys[part], reshard.count) == reshard.index
                        if mine.any():
                            change.blocks.append((keys[part][mine], values[part][mine]))
                changes.append(change)
    return Update(reset, changes, checkpoint_version(steps[-1]))


def read_checkpoint(path: str, selection: Selection | None = None, seq: int | None = None):
    """The update that loads checkpoint seq (default: the latest complete one) in full.

    Returns (update, manifest). Raises CheckpointError (no checkpoint, a bad file).
    """
    manifest = manifests.require_manifest(path, seq)
    steps = manifests.chain(path, manifest)
    if len({int(m["num_shards"]) for m in steps}) != 1:
        raise CheckpointError(f"{path}: checkpoint chain mixes shard counts")
    return read_checkpoints(path, steps, True, selection or Selection()), manifest


def is_export(path: str) -> bool:
    """True if path holds an inference export (part-*.npz) rather than checkpoints."""
    try:
        return any(PART_RE.match(name) for name in os.listdir(path))
    except OSError:
        return False


def read_export(path: str, selection: Selection | None = None) -> Update:
    """The update that loads an export directory (`KVStore.export`) in full.

    Raises:
        InvalidArgument: no export, parts missing, or parts of several exports.
    """
    selection = selection or Selection()
    names = sorted(n for n in os.listdir(path) if PART_RE.match(n))
    if not names:
        raise errors.InvalidArgument(f"{path}: no exported parts (part-*.npz)")
    changes, export_ids, counts, parts = [], set(), set(), []
    created = 0.0
    for name in names:
        full = os.path.join(path, name)
        try:
            with np.load(full) as data:
                arrays = {key: data[key] for key in data.files}
            meta = json.loads(bytes(arrays["meta"]).decode())
            created = max(created, os.path.getmtime(full))
        except (OSError, ValueError, KeyError) as exc:
            raise errors.InvalidArgument(f"{full}: unreadable export part ({exc})") from None
        if (
            meta.get("format") != EXPORT_FORMAT
            or meta.get("version") not in READABLE_EXPORT_VERSIONS
        ):
            raise errors.InvalidArgument(f"{full}: unknown export format")
        export_ids.add(meta["export_id"])
        counts.add(meta["num_parts"])
        parts.append(meta["part"])
        for position, table in enumerate(meta["tables"]):
            if not selection.wants(str(table["name"])):
                continue
            keys_name, values_name = array_names(table, position)
            keys = arrays[keys_name]
            values = arrays[values_name]
            if selection.shard is not None:
                index, count = selection.shard
                mine = _core.shard_of(np.ascontiguousarray(keys), count) == index
                keys, values = keys[mine], values[mine]
            info = TableInfo.from_spec(str(table["name"]), int(table["dim"]), table.get("spec"))
            dtype = str(table.get("dtype", "float32"))  # export version 1: float32, no dtype
            changes.append(TableChange(info, [], [(keys, values)], dtype))
    if len(export_ids) != 1 or len(counts) != 1:
        raise errors.InvalidArgument(f"{path}: parts of different exports are mixed")
    if sorted(parts) != list(range(counts.pop())):
        raise errors.InvalidArgument(f"{path}: export parts are missing")
    version = {
        "source": "export",
        "seq": None,
        "kind": "export",
        "export_id": export_ids.pop(),
        "created": created,
        "newest_push": None,
    }
    return Update(True, changes, version)


__all__ = [
    "DEFAULTS",
    "Selection",
    "ServingState",
    "TableInfo",
    "Update",
    "checkpoint_version",
    "is_export",
    "read_checkpoint",
    "read_checkpoints",
    "read_export",
]
