"""What a store's save, load and export ask of the shards, and the optimizer-state file.

`Checkpoints` runs a checkpoint from the worker's side: the shards write and
read their own files (`kvsparse.shard.checkpoint`, format:
docs/checkpoint-format.md); this side numbers the checkpoint, asks every shard
in turn and writes the manifest's key records through server 0.
`OptimizerStateFile` is MXNet's ``save_optimizer_states`` file: one NumPy
``.npz`` on the worker holding every key's optimizer slots and step counters.

Neither class is safe to call from several threads at once (their store is not).
"""

from __future__ import annotations

import json
import os
import secrets
import time

import numpy as np

from kvsparse import _core, errors, optimizers
from kvsparse.arrays import as_list
from kvsparse.placement import dense_ranges
from kvsparse.shard.checkpoint import CheckpointAction
from kvsparse.store.backend import Backend
from kvsparse.store.keys import KeyInfo, KeyRegistry

# Version of the optimizer-state .npz layout ("meta" JSON + k{index}_* arrays).
OPTIMIZER_STATE_VERSION = 1


class Checkpoints:
    """Save, load and export of one store's tables (`KVStore.save` / `load` / `export`).

    Threads: keeps no state of its own; save and export may run in several
    threads at once, and beside pushes and pulls (the backend serializes the
    shard operations). A load replaces the keys: `KVStore.load` runs it under
    the store's lock.

    Args:
        backend: the store's backend.
        keys: the store's key registry; `load` replaces its keys.
        checkpoint_dir: where a save or load without a path goes (the
            launcher's ``--checkpoint-dir``, resolved when the store was made).
    """

    def __init__(self, backend: Backend, keys: KeyRegistry, checkpoint_dir=None):
        self._backend = backend
        self._keys = keys
        self._checkpoint_dir = checkpoint_dir

    def resolve(self, path) -> str:
        """path, or the launcher's --checkpoint-dir when path is None.

        Raises:
            InvalidArgument: path is None and the store was made without
                KVSPARSE_CHECKPOINT_DIR set.
        """
        if path is None:
            path = self._checkpoint_dir
            if path is None:
                raise errors.InvalidArgument(
                    "no checkpoint path given and KVSPARSE_CHECKPOINT_DIR is not set "
                    "(kvsparse launch --checkpoint-dir DIR sets it for the workers)"
                )
        return os.fspath(path)

    def save(self, path, optimizer, incremental: bool) -> int:
        """Writes a checkpoint (full, or a delta on the latest one); returns its number.

        Three steps: server 0 numbers it (PREPARE), every server writes its
        shard (SAVE), server 0 checks the shard files and writes the manifest
        that makes the checkpoint exist (COMMIT).
        """
        path = self.resolve(path)
        n = self._backend.num_shards
        prepared = self._backend.checkpoint({0: {"action": CheckpointAction.PREPARE, "path": path}})
        seq, latest, parent = int(prepared[0]["seq"]), prepared[0]["latest"], None
        if incremental:
            if latest is None:
                raise errors.InvalidArgument(f"{path}: no checkpoint yet; make a full save first")
            if int(latest["num_shards"]) != n:
                raise errors.InvalidArgument(
                    f"{path}: the latest checkpoint has {latest['num_shards']} shards, this "
                    f"store {n}; make a full save first"
                )
            parent = int(latest["seq"])
        body = {
            "action": CheckpointAction.SAVE,
            "path": path,
            "seq": seq,
            "incremental": bool(incremental),
            "parent": parent,
        }
        # A save that failed on any shard leaves no shard file behind.
        replies = self._everywhere(body, undo={"action": CheckpointAction.ABORT, "seq": seq})
        pushes = [replies[s].get("newest_push") for s in range(n)]
        pushes = [p for p in pushes if p is not None]
        manifest = {
            "seq": seq,
            "kind": "delta" if incremental else "full",
            "parent": parent,
            "num_shards": n,
            "created": time.time(),
            # Wall time of the newest push any shard file holds (a serving
            # replica's freshness is now minus this); None if no shard saw a push.
            "newest_push": max(pushes) if pushes else None,
            "shards": [replies[s] for s in range(n)],
            "keys": [info.to_record() for info in self._keys.infos()],
            "optimizer": None if optimizer is None else optimizer.to_dict(),
        }
        commit = {"action": CheckpointAction.COMMIT, "path": path, "manifest": manifest}
        try:
            self._backend.checkpoint({0: commit})
        except (errors.KVSparseError, OSError):
            # No manifest: no checkpoint; its shard files go.
            self._undo({"action": CheckpointAction.ABORT, "path": path, "seq": seq})
            raise
        return seq

    def _everywhere(self, body: dict, undo: dict) -> dict:
        """Sends body to every shard; if one fails, sends undo to every shard, then raises.

        Returns {shard: reply}. Raises the failure of the lowest shard that failed.
        """
        n = self._backend.num_shards
        replies = self._backend.checkpoint(dict.fromkeys(range(n), body), gather=True)
        failed = [replies[s] for s in range(n) if isinstance(replies[s], BaseException)]
        if failed:
            # A shard that did not answer is not asked again (another timeout).
            gone = {s for s in range(n) if isinstance(replies[s], errors.ServerUnavailable)}
            self._undo({**undo, "path": body["path"]}, skip=gone)
            raise failed[0]
        return replies

    def _undo(self, body: dict, skip=()) -> None:
        """Sends body (ABORT of a save, DISCARD of a staged load) to every shard not in skip.

        Best effort: a shard that fails it (or is gone) is left as it is: a
        failed save's stray file is never taken for a checkpoint, a staged
        load is dropped by the next one.
        """
        shards = [s for s in range(self._backend.num_shards) if s not in skip]
        if shards:
            self._backend.checkpoint(dict.fromkeys(shards, body), gather=True)

    def load(self, path) -> tuple:
        """Restores the latest complete checkpoint in path: (its number, its optimizer or None).

        Rank 0 has every server load its shard; the other workers wait at a
        barrier, then read the manifest. Every worker's key registry becomes
        the checkpoint's keys.
        """
        path = self.resolve(path)
        backend = self._backend
        if backend.rank == 0:
            # All or nothing: every server reads its part aside first;
            # only when all of them could does each take it over.
            load = {"action": CheckpointAction.LOAD, "path": path, "stage": True}
            manifest = self._everywhere(load, undo={"action": CheckpointAction.DISCARD})[0]
            activate = {"action": CheckpointAction.ACTIVATE, "path": path}
            backend.checkpoint(dict.fromkeys(range(backend.num_shards), activate))
        if backend.num_workers > 1:
            backend.barrier()
        if backend.rank != 0:
            describe = {"action": CheckpointAction.DESCRIBE, "path": path}
            manifest = backend.checkpoint({0: describe})[0]
        self._keys.replace(KeyInfo.from_record(record) for record in manifest["keys"])
        spec = manifest.get("optimizer")
        return int(manifest["seq"]), None if spec is None else optimizers.from_dict(spec)

    def export(self, path, tables=None) -> str:
        """Has every server write keys and values of sparse tables (default: all); returns path.

        Raises:
            InvalidArgument: a dense key among tables. UnknownKey, KeyTypeError.
        """
        path = os.fspath(path)
        if tables is None:
            infos = [info for info in self._keys.infos() if info.sparse]
        else:
            infos = [self._keys.info(k) for k in as_list(tables)]
            for info in infos:
                if not info.sparse:
                    raise errors.InvalidArgument(f"key {info.key!r} is dense; export takes tables")
        body = {
            "action": CheckpointAction.EXPORT,
            "path": path,
            "table_ids": [info.table_id for info in infos],
            "export_id": secrets.token_hex(8),
        }
        self._backend.checkpoint({s: body for s in range(self._backend.num_shards)})
        return path


class OptimizerStateFile:
    """Every key's optimizer slots and step counters in one NumPy .npz on the worker.

    Layout (version 1): a uint8 array ``meta`` holding JSON ``{"version",
    "keys": [{"key", "sparse", "steps": [per shard]}], "optimizer"?}``, and per
    key number ``i`` (its position in ``keys``): ``k{i}_slots`` and, for a
    sparse table, ``k{i}_keys`` and ``k{i}_steps`` (rows in any order; loading
    re-plans them onto the store's shards).

    Threads: keeps no state of its own; may be called from several threads
    at once (the backend serializes the shard operations).

    Args:
        backend: the store's backend.
        keys: the store's key registry (the keys a file names must be in it to load).
    """

    def __init__(self, backend: Backend, keys: KeyRegistry):
        self._backend = backend
        self._keys = keys

    def save(self, fname, optimizer_spec: dict | None = None) -> None:
        """Writes every key's slots to fname; optimizer_spec, if given, goes in the meta."""
        per_shard = self._backend.optimizer_states()
        arrays, meta = {}, {"version": OPTIMIZER_STATE_VERSION, "keys": []}
        for index, info in enumerate(self._keys.infos()):
            states = [shard[info.table_id] for shard in per_shard]
            if info.sparse:
                for field in ("keys", "slots", "steps"):
                    arrays[f"k{index}_{field}"] = np.concatenate([s[field] for s in states])
                steps = [int(s["table_step"]) for s in states]
            else:
                arrays[f"k{index}_slots"] = np.concatenate([s["slots"] for s in states], axis=-1)
                steps = [int(s["step"]) for s in states]
            meta["keys"].append({"key": info.key, "sparse": info.sparse, "steps": steps})
        if optimizer_spec is not None:
            meta["optimizer"] = optimizer_spec
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        with open(fname, "wb") as f:
            np.savez(f, **arrays)

    def load(self, fname) -> None:
        """Restores what `save` wrote onto this store's shards.

        Raises:
            InvalidArgument: an unknown version. UnknownKey: a key the store lacks.
        """
        with np.load(fname) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta.get("version") != OPTIMIZER_STATE_VERSION:
                raise errors.InvalidArgument(f"{fname}: unknown optimizer-state version")
            loads = []
            for index, entry in enumerate(meta["keys"]):
                info = self._keys.info(entry["key"])
                step = max(entry["steps"]) if entry["steps"] else 0
                if info.sparse:
                    loads += self._sparse_loads(info, data, f"k{index}_", step)
                else:
                    slots = data[f"k{index}_slots"]
                    for s, (a, b) in enumerate(dense_ranges(info.size, self._backend.num_shards)):
                        loads.append((s, info.table_id, {"slots": slots[..., a:b], "step": step}))
        self._backend.load_optimizer_states(loads)

    def _sparse_loads(self, info: KeyInfo, data, prefix: str, step: int) -> list:
        """[(shard, table_id, state)] of one sparse table: its rows re-planned onto the shards."""
        keys = data[prefix + "keys"]
        num_shards = self._backend.num_shards
        plan_keys, offsets, slot = _core.plan_batch(
            np.ascontiguousarray(keys), num_shards, info.boundaries
        )
        order = np.empty(keys.size, np.int64)
        order[slot] = np.arange(keys.size)
        slots, steps = data[prefix + "slots"][order], data[prefix + "steps"][order]
        loads = []
        for s in range(num_shards):
            a, b = offsets[s], offsets[s + 1]
            state = {
                "keys": plan_keys[a:b],
                "slots": slots[a:b],
                "steps": steps[a:b],
                "table_step": step,
            }
            loads.append((s, info.table_id, state))
        return loads


__all__ = ["Checkpoints", "OptimizerStateFile", "OPTIMIZER_STATE_VERSION"]
