"""The CHECKPOINT request: its actions, and `handle`, which runs one on a shard in-process.

A store's save, load and export (`kvsparse.store.checkpoints`) send one request
body per shard, ``{"action": CheckpointAction..., "path": ..., ...}``; the
local store passes it to `handle`, a server runs the small actions through
`handle` and the save and export in a forked writer.
"""

from __future__ import annotations

import enum
import os

from kvsparse import errors
from kvsparse.shard.checkpoint import manifest as manifests
from kvsparse.shard.checkpoint.disk import link_disk_rows, remove_disk_dir
from kvsparse.shard.checkpoint.export import export_shard
from kvsparse.shard.checkpoint.shard_io import (
    abort_save,
    activate_load,
    begin_save,
    discard_load,
    end_save,
    load_shard_state,
    save_shard,
    settle_saves,
    stage_load,
)
from kvsparse.shard.state import ShardState


class CheckpointAction(str, enum.Enum):
    """The ``action`` field of a CHECKPOINT request body.

    A ``str`` enum: a member equals (and JSON-encodes as) its value, so bodies
    built with it and bodies decoded from the wire compare the same. Immutable,
    so safe to use from any thread.
    """

    PREPARE = "prepare"  # server 0: next sequence number and the latest manifest
    SAVE = "save"  # every server: write its shard file (full or incremental)
    COMMIT = "commit"  # server 0: check the shard files, write the manifest
    LOAD = "load"  # every server: replace its tables with the checkpoint's ("stage": aside)
    ACTIVATE = "activate"  # every server: take the staged load over (all staged fine)
    DISCARD = "discard"  # every server: drop the staged load (one of them failed)
    ABORT = "abort"  # every server: remove its file of a failed save ("seq")
    DESCRIBE = "describe"  # server 0: the manifest a load used (or the latest)
    EXPORT = "export"  # every server: keys and values as .npz for serving


def handle(state: ShardState, body: dict, shard_index: int, num_shards: int) -> dict:
    """Runs a checkpoint request body in-process (the local store; inline server actions).

    Not thread-safe: the caller is the state's only user while it runs.

    Args:
        state: this shard.
        body: {"action": a `CheckpointAction` value, "path": the checkpoint
            directory, and the action's fields ("seq", "incremental",
            "parent", "manifest", "stage", "table_ids", "export_id")}.
        shard_index, num_shards: this shard's place in the store.

    Returns:
        The action's reply (a JSON-able dict).

    Raises:
        InvalidArgument: no path, or an unknown action.
        CheckpointError: a missing or corrupt checkpoint.

    Example:
        >>> handle(state, {"action": "prepare", "path": "/ckpt"}, 0, 1)  # doctest: +SKIP
        {'seq': 1, 'latest': None}
    """
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise errors.InvalidArgument("checkpoint path must be a non-empty str")
    try:
        action = CheckpointAction(body.get("action"))
    except ValueError:
        raise errors.InvalidArgument(f"unknown checkpoint action {body.get('action')!r}") from None
    if action is CheckpointAction.PREPARE:
        return manifests.prepare(path)
    if action is CheckpointAction.COMMIT:
        manifests.commit(path, body["manifest"])
        return {}
    if action is CheckpointAction.LOAD:
        if body.get("stage"):
            return stage_load(state, path, shard_index, num_shards)
        return load_shard_state(state, path, shard_index, num_shards)
    if action is CheckpointAction.ACTIVATE:
        activate_load(state)
        return {}
    if action is CheckpointAction.DISCARD:
        discard_load(state)
        return {}
    if action is CheckpointAction.ABORT:
        return abort_save(state, path, body["seq"], shard_index, num_shards)
    if action is CheckpointAction.DESCRIBE:
        settle_saves(state, path)
        base = state.checkpoint_base
        if base is not None and base[0] == os.path.realpath(path):
            return manifests.read_manifest(path, base[1])
        return manifests.require_manifest(path)
    if action is CheckpointAction.SAVE:
        seq, parent = int(body["seq"]), body.get("parent")
        since, epoch = begin_save(state, bool(body.get("incremental")), path, parent)
        disk = link_disk_rows(state, path, seq, shard_index, num_shards) if since is None else {}
        try:
            result = save_shard(state, path, seq, shard_index, num_shards, since, parent, disk=disk)
        except BaseException:
            remove_disk_dir(path, seq, shard_index, num_shards)
            raise
        end_save(state, path, seq, epoch)
        return result
    return export_shard(state, path, shard_index, num_shards, body["table_ids"], body["export_id"])
