"""Checkpoints of a store's shards: full and incremental saves, loads with resharding.

A checkpoint directory holds numbered checkpoints. Checkpoint ``seq`` is

- one shard file per server, ``ckpt-{seq:06d}.shard-{i:05d}-of-{n:05d}.kvs``,
  written by that server (see docs/checkpoint-format.md for the layout), and
- ``ckpt-{seq:06d}.manifest.json``, written by server 0 after every shard
  file is in place.

Every file is written to a temporary name, fsynced and renamed, and the
manifest comes last: a checkpoint without a manifest does not exist, so a
crash in the middle of a save leaves the previous checkpoint loadable. A
delta checkpoint (``kind: "delta"``) holds only the rows written since its
parent (plus the ids removed since then); loading it applies the chain
``full, delta, delta, ...`` in order.

Each server's shard file is a snapshot of one moment: the server forks and
the child writes its copy-on-write image while the parent keeps serving
(`kvsparse.server`). The local store writes inline.

The modules, one concern each:

- `files`: crash-safe writing (temporary name, fsync, rename) and cleanup
  after a dead writer.
- `format`: the shard file's bytes: header, checksummed blocks, index,
  trailer, version (`BlockWriter`, `read_shard_file`).
- `manifest`: file names, manifests, the delta chain, `prepare` / `commit`
  (server 0's part of a save).
- `shard_io`: a `ShardState` to and from shard files: `save_shard`,
  `load_shard_state` (with resharding), `restore_shard` (what a restarting
  server runs).
- `disk`: checkpoints by reference of tiered tables' rows on disk (hard-linked
  run files and their index; `link_disk_rows` before the snapshot).
- `export`: `export_shard`, the inference export (NumPy .npz) that
  `kvsparse.serving` reads.
- `actions`: the CHECKPOINT request's `CheckpointAction` and `handle`.

Errors: a missing, truncated or corrupt file raises `CheckpointError`
(a `kvsparse.errors.InvalidArgument`, so also a ValueError), naming the file.

Example:
    >>> from kvsparse.shard import checkpoint
    >>> checkpoint.latest_manifest("/ckpt")["seq"]                    # doctest: +SKIP
    3
"""

from kvsparse.shard.checkpoint.actions import CheckpointAction, handle
from kvsparse.shard.checkpoint.disk import disk_dir_name, link_disk_rows, remove_disk_dir
from kvsparse.shard.checkpoint.export import export_shard
from kvsparse.shard.checkpoint.files import remove_temporary_files
from kvsparse.shard.checkpoint.format import (
    BY_VALUE_VERSION,
    FORMAT,
    VERSION,
    CheckpointError,
    ShardFile,
    read_shard_file,
)
from kvsparse.shard.checkpoint.manifest import (
    chain,
    commit,
    latest_manifest,
    list_manifests,
    manifest_name,
    prepare,
    read_manifest,
    shard_file_name,
)
from kvsparse.shard.checkpoint.shard_io import (
    begin_save,
    end_save,
    load_shard_state,
    restore_shard,
    save_shard,
    write_shard_file,
)

__all__ = [
    "BY_VALUE_VERSION",
    "CheckpointAction",
    "CheckpointError",
    "FORMAT",
    "ShardFile",
    "VERSION",
    "begin_save",
    "chain",
    "commit",
    "disk_dir_name",
    "end_save",
    "export_shard",
    "handle",
    "latest_manifest",
    "link_disk_rows",
    "list_manifests",
    "load_shard_state",
    "manifest_name",
    "prepare",
    "read_manifest",
    "read_shard_file",
    "remove_disk_dir",
    "remove_temporary_files",
    "restore_shard",
    "save_shard",
    "shard_file_name",
    "write_shard_file",
]
