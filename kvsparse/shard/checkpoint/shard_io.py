"""A shard's state to and from checkpoint files: save, load (resharding), restore.

What the index of a shard file says (one section per sparse table, with its
spec, optimizer and blocks of rows; one per dense key) is written and read
here; the bytes themselves are `kvsparse.shard.checkpoint.format`'s.

Loading onto another number of shards than were saved reads every old shard
file and keeps the rows whose `_core.shard_of(keys, num_shards)` is this
shard (`Resharding`); dense keys are re-split by
`kvsparse.placement.dense_ranges`.

None of these functions may run on one ShardState from several threads at
once (ShardState is single-threaded); the state must not change while a
shard file is written from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from kvsparse import _core, errors
from kvsparse.arrays import TABLE_DTYPES
from kvsparse.placement import dense_ranges
from kvsparse.shard.checkpoint.disk import finish_disk_rows, remove_disk_dir
from kvsparse.shard.checkpoint.files import fsync_dir
from kvsparse.shard.checkpoint.format import (
    BLOCK_ROWS,
    BY_VALUE_VERSION,
    FORMAT,
    VERSION,
    BlockWriter,
    CheckpointError,
    ShardFile,
    progress_bar,
    read_shard_file,
)
from kvsparse.shard.checkpoint.manifest import (
    chain,
    manifest_name,
    require_manifest,
    shard_file_name,
)
from kvsparse.shard.state import DenseEntry, ShardState, SparseEntry, with_stream_version

# -- saving -----------------------------------------------------------------------------------


def table_optimizer_spec(state: ShardState, entry: SparseEntry) -> dict | None:
    """The optimizer a sparse table runs: its own, else the store-wide one (reads only)."""
    return entry.spec.get("optimizer") if entry.own_optimizer else state.default_optimizer


def write_shard_file(
    state: ShardState, final_path: str, *, since: int | None, info: dict, disk: dict | None = None
) -> dict:
    """Writes state's tables to final_path (tmp + fsync + rename).

    Args:
        state: the shard; it must not change while this runs (a forked
            child's image, or the caller's own thread).
        final_path: the shard file to create.
        since: None for a full snapshot; else only rows written at a change
            epoch > since, and the ids removed since then.
        info: extra fields for the index (seq, shard_index, num_shards, ...).
        disk: {table_id: directory relative to the file's} of tables whose rows on
            disk `disk.link_disk_rows` linked (a full save): their sections hold
            the rows in memory and name the directory (`disk.finish_disk_rows`).

    Returns:
        {"file", "bytes", "rows"}.

    Only reads state, so nothing may change it meanwhile (not thread-safe with writers).
    """
    disk = disk or {}
    total = sum(len(e.table) for e in state.sparse.values())
    # Version 4 unless a section names rows on disk: older readers then read the file.
    version = VERSION if disk else BY_VALUE_VERSION
    writer = BlockWriter(final_path, total, desc=os.path.basename(final_path), version=version)
    folder = os.path.dirname(final_path)
    try:
        index = {
            "format": FORMAT,
            "version": version,
            **info,
            "kind": "full" if since is None else "delta",
            "default_optimizer": state.default_optimizer,
            # Wall time of the newest push this file holds (freshness), or None.
            "newest_push": state.newest_push,
            "sparse": [],
            "dense": [],
        }
        rows_written = 0
        for table_id, entry in state.sparse.items():
            section = _sparse_section(state, table_id, entry)
            if since is not None:
                section["removed"] = writer.removed_block(entry.table.removed_since(since))
            # Whole in every delta too (they are not stamped with epochs): a restarted
            # server that lost them drops the push that admits an id.
            section["candidates"] = writer.candidates_block(*entry.table.candidates())
            # Rows are stamped with epochs >= 1: since 0 is every row.
            # Buffers reused: each block is written out before the next is read.
            # The rows' touch counts and last steps, for a table whose eviction ranks by them:
            # a restarted server evicts what the old one would have.
            tracks_meta = entry.table.tracks_row_meta
            by_reference = since is None and table_id in disk
            if by_reference:  # the rows on disk: links and a manifest
                section["disk"] = finish_disk_rows(entry.table, folder, disk[table_id])
                rows_written += section["disk"]["rows"]
            rows = entry.table.iter_state(since or 0, BLOCK_ROWS, True, by_reference)
            for keys, values, slots, steps in rows:
                meta = entry.table.read_row_meta(keys) if tracks_meta else None
                section["blocks"].append(writer.sparse_block(keys, values, slots, steps, meta))
                rows_written += int(keys.size)
            index["sparse"].append(section)
        for table_id, entry in state.dense.items():
            slots = np.ascontiguousarray(entry.slots_array(), np.float32)
            # float32 (a 16-bit key's values widened exactly, or its master copy).
            block = writer.block([np.ascontiguousarray(entry.float_values()), slots])
            index["dense"].append(
                {
                    "table_id": table_id,
                    "name": entry.name,
                    "size": int(entry.values.size),
                    "num_slots": int(slots.shape[0]),
                    "optimizer": entry.optimizer_spec,
                    "own_optimizer": entry.own_optimizer,
                    "step": int(entry.step),
                    # A per-key field (absent: float32) read by any version.
                    **({} if entry.dtype == "float32" else {"dtype": entry.dtype}),
                    **block,
                }
            )
        size = writer.finish(index)
    except BaseException:
        writer.abort()
        raise
    return {
        "file": os.path.basename(final_path),
        "bytes": size,
        "rows": rows_written,
        "newest_push": state.newest_push,
    }


def _sparse_section(state: ShardState, table_id: int, entry: SparseEntry) -> dict:
    """A sparse table's index section, before its blocks are written."""
    table = entry.table
    return {
        "table_id": table_id,
        "name": entry.name,
        "spec": entry.spec,
        # What its INIT_SPARSE said, when a set_optimizer(key=...) changed the spec since:
        # an init sent again after a restart must still find the table identical.
        "init_spec": entry.init_spec if entry.init_spec != entry.spec else None,
        "own_optimizer": entry.own_optimizer,
        "optimizer": table_optimizer_spec(state, entry),
        "dim": table.dim,
        "num_slots": table.num_slots,
        "table_step": int(table.table_step),
        "blocks": [],
        "removed": None,
        "candidates": None,
    }


def begin_save(state: ShardState, incremental: bool, path: str, parent: int | None) -> tuple:
    """Runs in the serving process right before the snapshot: (since, snapshot_epoch).

    Advances the change epoch, so that writes after this moment belong to the
    next delta. Not thread-safe: the state's own thread calls it.

    Raises:
        InvalidArgument: an incremental save whose parent is not the
            checkpoint this shard last saved (and saw committed) or loaded.
    """
    since = None
    if incremental:
        settle_saves(state, path)
        base = state.checkpoint_base
        if base is None or base != (os.path.realpath(path), parent):
            raise errors.InvalidArgument(
                f"incremental save: this shard's last checkpoint is {base}, not "
                f"checkpoint {parent} of {path}; make a full save first"
            )
        since = state.saved_epoch
    snapshot_epoch = state.change_epoch
    state.set_change_epoch(snapshot_epoch + 1)
    return since, snapshot_epoch


# Uncommitted saves a shard remembers (the newest): more would mean saves failing in a row.
_UNCOMMITTED_KEPT = 16


def end_save(state: ShardState, path: str, seq: int, snapshot_epoch: int) -> None:
    """Runs in the serving process once its shard file is written.

    The save becomes the next delta's base only once its manifest exists
    (`settle_saves`): until then it may still fail on another shard or at
    the commit. Not thread-safe: the state's own thread calls it.
    """
    entry = (os.path.realpath(path), int(seq), int(snapshot_epoch))
    state.uncommitted_saves = [*state.uncommitted_saves[1 - _UNCOMMITTED_KEPT :], entry]


def settle_saves(state: ShardState, path: str) -> None:
    """Makes the newest of this shard's saves in path that has a manifest its checkpoint base.

    Older saves are forgotten (a delta on them would miss the removals that
    the new base lets go). Not thread-safe: the state's own thread calls it.
    """
    real = os.path.realpath(path)
    saves = state.uncommitted_saves
    for i in range(len(saves) - 1, -1, -1):
        saved_path, seq, epoch = saves[i]
        if saved_path == real and os.path.exists(os.path.join(path, manifest_name(seq))):
            state.saved_epoch = epoch
            state.checkpoint_base = (saved_path, seq)
            for entry in state.sparse.values():
                entry.table.prune_removed(epoch)
            state.uncommitted_saves = saves[i + 1 :]
            return


def abort_save(state: ShardState, path: str, seq: int, shard_index: int, num_shards: int) -> dict:
    """Removes this shard's file of a save that failed (unless its manifest exists).

    The store sends it to every shard when a save failed on one of them or
    at the commit, so no unmanifested shard file stays behind. Returns
    {"removed": True/False}. Not thread-safe: the state's own thread calls it.
    """
    seq = int(seq)
    if os.path.exists(os.path.join(path, manifest_name(seq))):
        return {"removed": False}  # committed after all: it exists
    real = os.path.realpath(path)
    state.uncommitted_saves = [s for s in state.uncommitted_saves if s[:2] != (real, seq)]
    removed = remove_disk_dir(path, seq, shard_index, num_shards)
    try:
        os.unlink(os.path.join(path, shard_file_name(seq, shard_index, num_shards)))
        removed = True
    except FileNotFoundError:
        pass
    if removed:
        fsync_dir(path)
    return {"removed": removed}


def save_shard(
    state: ShardState, path, seq, shard_index, num_shards, since, parent, server=None, disk=None
) -> dict:
    """Writes this shard's file of checkpoint seq; returns {"file", "bytes", "rows"}.

    server: a server's own state at the same moment (`kvsparse.server.restart.snapshot`),
    which `restore_shard` gives back; None (the local store): none.
    disk: what `link_disk_rows` returned before the snapshot (None: every row by value).
    Reads state only; it must not change meanwhile (see write_shard_file).
    """
    final = os.path.join(path, shard_file_name(seq, shard_index, num_shards))
    info = {
        "seq": seq,
        "shard_index": shard_index,
        "num_shards": num_shards,
        "parent": parent,
        "server": server,
    }
    return write_shard_file(state, final, since=since, info=info, disk=disk)


# -- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resharding:
    """Which rows of a checkpoint saved on old_count shards belong to shard index of count.

    Immutable: safe to share between threads.
    """

    index: int
    count: int
    old_count: int

    @property
    def same(self) -> bool:
        """True when the shard count did not change: each shard reads only its own file."""
        return self.old_count == self.count

    def files(self) -> list[int]:
        """The old shard files this shard reads."""
        return [self.index] if self.same else list(range(self.old_count))

    def sparse_rows(self, keys, values, slots, steps, meta=None) -> tuple:
        """(keys, values, slots, steps, meta) of a block's rows that belong to this shard.

        meta: None, or the rows' (touches, last_steps).
        """
        if self.same:
            return keys, values, slots, steps, meta
        mine = _core.shard_of(keys, self.count) == self.index
        if meta is not None:
            meta = (meta[0][mine], meta[1][mine])
        return keys[mine], values[mine], slots[mine], steps[mine], meta

    def dense_slice(self, values: np.ndarray, slots: np.ndarray) -> tuple:
        """This shard's slice of a dense key's whole (values, slots)."""
        if self.same:
            return values, slots
        a, b = dense_ranges(values.size, self.count)[self.index]
        return values[a:b], slots[:, a:b]


def load_shard_state(state: ShardState, path: str, shard_index: int, num_shards: int, seq=None):
    """Replaces state's tables with shard shard_index of num_shards of a checkpoint.

    Reads the chain (full + deltas) of checkpoint seq (default: the latest
    complete one). With as many shards as were saved, only this shard's files
    are read; otherwise every old shard file is read and the rows whose
    `_core.shard_of(keys, num_shards)` is shard_index are kept (dense keys are
    re-split by `kvsparse.placement.dense_ranges`).

    All or nothing: the checkpoint is read into a new ShardState (`read_shard_state`)
    that replaces state's tables only once complete; a missing or corrupt file
    leaves state as it was. Not thread-safe: it replaces
    every table of state.

    Returns:
        The manifest loaded.

    Raises:
        CheckpointError: no checkpoint, or a missing/corrupt/truncated file.
        InvalidArgument: a range-partitioned table onto another shard count.
    """
    loaded, manifest = read_shard_state(state, path, shard_index, num_shards, seq)
    state.replace_tables(loaded)
    return manifest


def read_shard_state(state: ShardState, path: str, shard_index: int, num_shards: int, seq=None):
    """(a new ShardState holding shard shard_index of a checkpoint, the manifest read).

    state is only read (its change epoch, which the new state continues), so
    it can go on serving meanwhile; load_shard_state's arguments and errors.
    Not thread-safe with writers of state's change epoch.
    """
    manifest = require_manifest(path, seq)
    steps = chain(path, manifest)
    for m in steps:
        if int(m["num_shards"]) != int(steps[0]["num_shards"]):
            raise CheckpointError(f"{path}: checkpoint chain mixes shard counts")
    reshard = Resharding(shard_index, num_shards, int(steps[0]["num_shards"]))
    files = reshard.files()
    loaded = state.like()
    # Epochs only grow: stamps of the old tables never meet the new ones' anyway.
    loaded.change_epoch = state.change_epoch
    dense_parts: dict[int, dict] = {}
    stamps_through = 0  # the highest change stamp of rows adopted on disk
    total_rows = sum(int(m["shards"][i].get("rows", 0)) for m in steps for i in files)
    progress = progress_bar(total_rows, f"load shard {shard_index}")
    try:
        for m in steps:
            for old_index in files:
                f = read_shard_file(os.path.join(path, m["shards"][old_index]["file"]))
                if f.index["kind"] != m["kind"] or int(f.index["seq"]) != int(m["seq"]):
                    raise CheckpointError(f"{f.path}: does not belong to checkpoint {m['seq']}")
                # The store-wide optimizer is in each shard file (the manifest has none
                # under this name): read from the manifest, a loaded store saved tables of
                # the store-wide optimizer without it, and could not load that save again.
                loaded.default_optimizer = f.index.get("default_optimizer")
                for section in f.index["sparse"]:
                    stamps = _load_sparse_section(loaded, f, section, reshard, progress)
                    stamps_through = max(stamps_through, stamps)
                    if m is steps[-1]:  # each file holds all its candidates: the newest count
                        _load_candidates(loaded, f, section, reshard)
                # A delta holds every dense key in full: the newest copy wins.
                for section in f.index["dense"]:
                    part = dense_parts.setdefault(section["table_id"], {})
                    part[old_index] = f.dense(section)
                    part["section"] = section
    finally:
        if progress is not None:
            progress.close()
    for table_id, parts in dense_parts.items():
        loaded.dense[table_id] = _dense_entry(path, parts, reshard)
    loaded.set_change_epoch(max(loaded.change_epoch, stamps_through) + 1)
    loaded.saved_epoch = loaded.change_epoch - 1
    loaded.checkpoint_base = (os.path.realpath(path), int(manifest["seq"]))
    return loaded, manifest


def stage_load(state: ShardState, path: str, shard_index: int, num_shards: int) -> dict:
    """First step of a store-wide load: reads the checkpoint aside; state keeps serving.

    `activate_load` then makes every shard take its staged tables over, once
    every shard staged its part; `discard_load` drops them when one failed
    (a load is all or nothing per store). Holds the old and the new tables
    until then. Returns the manifest. Not thread-safe (ShardState's rule).

    Raises:
        what load_shard_state raises; state is unchanged.
    """
    state.staged_load = None  # a load staged before and never activated
    loaded, manifest = read_shard_state(state, path, shard_index, num_shards)
    state.staged_load = loaded
    return manifest


def activate_load(state: ShardState) -> None:
    """Second step of a store-wide load: state takes its staged tables over.

    Raises:
        InvalidArgument: no load is staged (it was discarded, or never made).
    """
    loaded = state.staged_load
    if loaded is None:
        raise errors.InvalidArgument("no staged checkpoint load to activate on this shard")
    state.replace_tables(loaded)


def discard_load(state: ShardState) -> None:
    """Drops a staged load (another shard failed to stage its part); no error if none."""
    state.staged_load = None


def _load_sparse_section(
    state: ShardState, f: ShardFile, section: dict, reshard: Resharding, progress
) -> int:
    """Loads a file's section of a sparse table into state; returns the highest change
    stamp its rows kept (those of rows on disk it adopted), else 0."""
    table_id = int(section["table_id"])
    spec = section["spec"]
    if f.version == 1:  # written before tables recorded their initializer's streams
        spec = with_stream_version(spec, 1)
    entry = state.sparse.get(table_id)
    if entry is None:
        if not reshard.same and spec.get("boundaries") is not None:
            raise errors.InvalidArgument(
                f"table {section['name']!r} has a RangePartitioner for {reshard.old_count} "
                f"servers; it cannot be loaded onto {reshard.count}"
            )
        state.create_sparse(table_id, section["name"], spec)
        entry = state.sparse[table_id]
        if section.get("init_spec") is not None:
            entry.init_spec = section["init_spec"]
        if not entry.own_optimizer:
            entry.table.set_optimizer(section["optimizer"])
    table = entry.table
    if table.dim != int(section["dim"]) or table.num_slots != int(section["num_slots"]):
        raise CheckpointError(f"{f.path}: table {section['name']!r} changed shape in the chain")
    removed = f.removed(section)
    if removed.size:
        table.remove(removed)
    stamps = _load_disk_rows(table, f, section, reshard, progress)
    # Views of the file: no copy. Each block with its rows' eviction metadata (or None).
    blocks = [
        reshard.sparse_rows(*rows, meta=f.row_meta(entry))
        for entry, rows in zip(section["blocks"], f.sparse_blocks(section))
    ]
    # All at once: rows come in the saved map's bucket order, and a map growing meanwhile
    # would make linear probing cluster (see EmbeddingTable::ReserveRows).
    table.reserve(len(table) + sum(b[0].size for b in blocks))
    tracks_meta = table.tracks_row_meta
    for keys, values, slots, steps, meta in blocks:
        table.write_state(keys, values, slots, steps)
        if meta is not None and tracks_meta:
            table.write_row_meta(keys, *meta)
        if progress is not None:
            progress.update(int(keys.size) if reshard.same else 0)
    if progress is not None and not reshard.same:
        progress.update(sum(int(b["rows"]) for b in section["blocks"]))
    table.table_step = int(section["table_step"])
    return stamps


def _load_disk_rows(table, f: ShardFile, section: dict, reshard: Resharding, progress) -> int:
    """The section's rows on disk (a checkpoint by reference), before its rows in memory.

    Adopted as the table's disk tier when it has one, is empty and the shard count is
    the same: the files are linked, no row is read, and the rows keep their change
    stamps (returned: the load's epoch continues past them). Otherwise read and written
    like the blocks (returns 0).
    """
    entry = section.get("disk")
    if not entry:
        return 0
    rows = int(entry["rows"])
    if reshard.same and table.has_disk_store and len(table) == 0:
        directory = os.path.join(os.path.dirname(f.path), str(entry["dir"]))
        try:
            table.adopt_disk_checkpoint(directory)
        except errors.StorageError as exc:  # a missing or damaged MANIFEST or run file
            raise CheckpointError(f"{f.path}: its rows on disk in {directory}: {exc}") from None
        if len(table) != rows:
            raise CheckpointError(f"{directory}: holds {len(table)} rows, {f.path} says {rows}")
        if progress is not None:
            progress.update(rows)
        return int(entry["stamps_through"])
    table.reserve(len(table) + rows)
    tracks_meta = table.tracks_row_meta
    for keys, values, slots, steps, meta in f.disk_rows(section):
        keys, values, slots, steps, meta = reshard.sparse_rows(keys, values, slots, steps, meta)
        table.write_state(keys, values, slots, steps)
        if tracks_meta:
            table.write_row_meta(keys, *meta)
        if progress is not None:
            progress.update(int(keys.size) if reshard.same else 0)
    if progress is not None and not reshard.same:
        progress.update(rows)
    return 0


def _load_candidates(state: ShardState, f: ShardFile, section: dict, reshard: Resharding) -> None:
    """Adds a file's admission candidates of this shard to the section's (loaded) table."""
    keys, counts, last_steps = f.candidates(section)
    if not reshard.same and keys.size:
        mine = _core.shard_of(keys, reshard.count) == reshard.index
        keys, counts, last_steps = keys[mine], counts[mine], last_steps[mine]
    if keys.size:
        state.sparse[int(section["table_id"])].table.write_candidates(keys, counts, last_steps)


def _dense_entry(path: str, parts: dict, reshard: Resharding) -> DenseEntry:
    """A dense key's entry from its newest section and its parts by old shard index."""
    section = parts["section"]
    files = reshard.files()
    values = np.concatenate([parts[i][0] for i in files])
    slots = np.concatenate([parts[i][1] for i in files], axis=-1)
    values, slots = reshard.dense_slice(values, slots)
    dtype = section.get("dtype", "float32")
    if dtype not in TABLE_DTYPES:
        raise CheckpointError(f"{path}: dense key {section['name']!r} has dtype {dtype!r}")
    entry = DenseEntry.create(section["name"], values, dtype)
    entry.own_optimizer = bool(section["own_optimizer"])
    entry.set_optimizer(section["optimizer"])
    if entry.master is not None:
        entry.master[...] = values  # the saved master copy, not its rounding
    if entry.slots is not None:
        if entry.slots.shape != slots.shape:
            raise CheckpointError(f"{path}: dense key {section['name']!r} slots do not fit")
        entry.slots[...] = slots
    entry.step = int(section["step"])
    return entry


def restore_shard(state: ShardState, path: str, shard_index: int, num_shards: int) -> dict | None:
    """Loads the latest complete checkpoint in path (base + deltas) into state.

    For a server restarting after a crash (``kvsparse server --restore PATH
    --shard-index I --num-shards N``): the state then holds exactly what
    shard I of N held at that checkpoint, optimizer slots and step counters
    included, resharded by key hash if the checkpoint had another shard count.
    Not thread-safe: it replaces every table of state.

    Returns:
        The ``server`` section of this shard's newest file: what a server
        keeps besides the tables (`kvsparse.server.restart`), or None (a
        local store's checkpoint, a file of format < 4, another shard count).

    Raises:
        CheckpointError: no complete checkpoint, or a corrupt/truncated file.

    Example:
        >>> state = ShardState()                                   # doctest: +SKIP
        >>> restore_shard(state, "/ckpt", shard_index=1, num_shards=3)  # doctest: +SKIP
    """
    manifest = load_shard_state(state, path, shard_index, num_shards)
    if int(manifest["num_shards"]) != num_shards:
        return None  # the records are of other shards' requests
    f = read_shard_file(os.path.join(path, manifest["shards"][shard_index]["file"]))
    return f.index.get("server")
