"""Checkpoints by reference: a tiered table's rows on disk enter a full save as links.

A full save of a table with a disk tier (`Table.has_disk_store`) writes only
its rows in memory into the shard file. Its rows on disk are the tier's run
files, which are immutable: the save hard-links them into

    ckpt-{seq:06d}.shard-{i:05d}-of-{n:05d}.disk/table-{table_id}/

beside the shard file, with a MANIFEST of their in-memory index (page hashes,
filters, live bits: ~2 bytes a row), and the table's section names that
directory (``"disk": {"dir", "rows", "stamps_through"}``). So a save of a
table thirty times its budget writes the budget's rows and the manifests, not
the table; a load onto as many shards, into a server with a disk tier, links
the files into the new tier and loads the index without reading a row.

The halves run where the snapshot needs them: `link_disk_rows` in the process
that owns the tables, right before the fork (a merge there may remove a run
file the moment after); `finish_disk_rows` in the snapshot, which syncs the
files and writes the manifest of the index as it was at the fork. Files that
are linked but never named by a committed shard file are removed with the
save's other leftovers (`remove_disk_dir`).

Other readers (a load onto another shard count or into a table without a
disk tier, serving replicas) read the rows in place (`ShardFile.disk_rows`).

Links need one file system: a checkpoint directory elsewhere than the spill
directory gets every row in its shard file, as before.

Threads: these functions follow ShardState's rule (one thread at a time).
"""

from __future__ import annotations

import logging
import os
import shutil

from kvsparse import errors
from kvsparse.shard.checkpoint.files import fsync_dir
from kvsparse.shard.state import ShardState

log = logging.getLogger(__name__)


def disk_dir_name(seq: int, shard_index: int, num_shards: int) -> str:
    """The directory of shard shard_index's rows on disk in checkpoint seq. Thread-safe."""
    return f"ckpt-{seq:06d}.shard-{shard_index:05d}-of-{num_shards:05d}.disk"


def _same_file_system(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def link_disk_rows(state: ShardState, path: str, seq: int, shard_index: int, num_shards: int):
    """First half, in the owning process before the snapshot: links every tiered table's
    run files into this save's directory. Returns {table_id: the directory relative to
    path} of the tables linked ({} when none have a disk tier, or the checkpoint lies on
    another file system than the spill directory).

    A table whose links fail (a full disk, a file system without hard links) is left
    out with a warning: its rows go into the shard file.
    """
    tier = state.tier
    tables = [(tid, e.table) for tid, e in state.sparse.items() if e.table.has_disk_store]
    if not tables or tier is None or tier.root is None:
        return {}
    if not _same_file_system(tier.root, path):
        log.info(
            "checkpoint %s is on another file system than %s: rows on disk are copied",
            path,
            tier.root,
        )
        return {}
    root = disk_dir_name(seq, shard_index, num_shards)
    shutil.rmtree(os.path.join(path, root), ignore_errors=True)  # a failed save's, if any
    try:
        os.makedirs(os.path.join(path, root))
    except OSError as exc:
        raise errors.CheckpointError(f"cannot create {os.path.join(path, root)}: {exc}") from None
    linked = {}
    for table_id, table in tables:
        relative = os.path.join(root, f"table-{table_id}")
        try:
            table.link_disk_checkpoint(os.path.join(path, relative))
        except errors.StorageError as exc:
            log.warning("table %s: its rows on disk are copied, not linked: %s", table_id, exc)
            shutil.rmtree(os.path.join(path, relative), ignore_errors=True)
            continue
        linked[table_id] = relative
    return linked


def finish_disk_rows(table, path: str, relative: str) -> dict:
    """Second half, in the snapshot: syncs the table's linked files and writes their
    MANIFEST; returns the section's ``"disk"`` entry."""
    directory = os.path.join(path, relative)
    rows = table.finish_disk_checkpoint(directory)  # syncs directory itself
    fsync_dir(os.path.dirname(directory))
    return {
        "dir": relative,
        "rows": int(rows),
        # The rows' change stamps are at most this: a load continues past it, so that
        # its next delta holds what changed after the load, not these rows again.
        "stamps_through": int(table.change_epoch),
        "manifest_bytes": os.path.getsize(os.path.join(directory, "MANIFEST")),
    }


def remove_disk_dir(path: str, seq: int, shard_index: int, num_shards: int) -> bool:
    """Removes shard shard_index's directory of rows on disk of checkpoint seq (a save
    that failed or was aborted); returns whether there was one. Thread-safe."""
    directory = os.path.join(path, disk_dir_name(seq, shard_index, num_shards))
    if not os.path.isdir(directory):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


__all__ = ["disk_dir_name", "finish_disk_rows", "link_disk_rows", "remove_disk_dir"]
