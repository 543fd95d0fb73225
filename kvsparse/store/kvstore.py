"""The KVStore frontend: MXNet's KVStore API over any backend.

`KVStore` validates every input, turns it into arrays, batches ids (unique
ids grouped by shard, duplicate gradients summed, in C++) and hands the
result to a backend: `LocalBackend` (one in-process shard) for
``create('local')``, the ZeroMQ client for ``create('dist_sparse')``. Every
check runs before the first byte leaves, so a rejected call changes nothing.

Semantics (MXNet's, where MXNet has them):
- With no optimizer set, a push replaces the value (the sum of a pushed list).
- With an optimizer, a push is a gradient: the optimizer runs on the servers,
  only on the rows the push touched.
- Keys are all int or all str within one store.

Example:
    >>> import numpy as np, kvsparse
    >>> kv = kvsparse.create('local')
    >>> kv.init('user', kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Zeros()))
    >>> kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
    >>> kv.push('user', (np.array([3, 3]), np.ones((2, 4), np.float32)))
    >>> kv.row_sparse_pull('user', row_ids=np.array([3]))[0]
    array([-2., -2., -2., -2.], dtype=float32)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kvsparse import _core, errors, optimizers
from kvsparse.arrays import as_float32, as_ids, as_numpy, flat_ids, rows_view
from kvsparse.placement import dense_ranges, table_id_of
from kvsparse.table import SparseTable


@dataclass
class KeyInfo:
    key: object
    table_id: int
    sparse: bool
    dim: int = 0  # sparse
    shape: tuple = ()  # dense
    boundaries: list | None = None  # sparse, range partitioner
    nonfinite: str = "raise"  # sparse: 'raise' or 'skip'

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


_POLICY_COUNTERS = (
    "admissions",
    "evictions",
    "evicted_ttl",
    "evicted_capacity",
    "rejected",
    "candidates",
)


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


class KVStore:
    """MXNet-style key-value store whose sparse tables live on shards.

    Use ``kvsparse.create(kind)`` rather than this constructor.
    """

    def __init__(self, backend, kind: str):
        self._backend = backend
        self._type = kind
        self._keys: dict = {}
        self._key_type: type | None = None
        self._optimizer: optimizers.Optimizer | None = None

    # -- properties -------------------------------------------------------------------------

    @property
    def type(self) -> str:
        """The store kind: 'local', 'dist_sparse', 'dist_sync', 'dist_async'."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank, 0..num_workers-1."""
        return self._backend.rank

    @property
    def num_workers(self) -> int:
        """How many workers share the store."""
        return self._backend.num_workers

    @property
    def num_servers(self) -> int:
        """How many shards hold the tables."""
        return self._backend.num_shards

    # -- keys -------------------------------------------------------------------------------

    def _check_key_type(self, key) -> None:
        if isinstance(key, bool) or not isinstance(key, (int, str, np.integer)):
            raise errors.KeyTypeError(f"keys must be int or str, got {type(key).__name__} {key!r}")
        kind = str if isinstance(key, str) else int
        if self._key_type is not None and kind is not self._key_type:
            raise errors.KeyTypeError(
                f"key {key!r} is {kind.__name__} but this store uses "
                f"{self._key_type.__name__} keys; int and str keys cannot be mixed"
            )

    def _info(self, key) -> KeyInfo:
        self._check_key_type(key)
        info = self._keys.get(int(key) if not isinstance(key, str) else key)
        if info is None:
            raise errors.UnknownKey(f"key {key!r} is not initialized; call kv.init first")
        return info

    @staticmethod
    def _normalize(key):
        return key if isinstance(key, str) else int(key)

    # -- init -------------------------------------------------------------------------------

    def init(self, key, value) -> None:
        """Initializes key(s): a SparseTable makes a sparse table, an array a dense key.

        Args:
            key: int or str, or a list of them.
            value: a SparseTable, or an array (NumPy / DLPack) of float32; a
                list matching a list of keys.

        Raises:
            DuplicateKey: the key was initialized already.
            KeyTypeError: int and str keys mixed.
        """
        keys, values = _as_list(key), _as_list(value)
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        prepared = []
        seen = set()
        for k, v in zip(keys, values):
            self._check_key_type(k)
            k = self._normalize(k)
            if k in self._keys or k in seen:
                raise errors.DuplicateKey(f"key {k!r} is already initialized")
            seen.add(k)
            if isinstance(v, SparseTable):
                if v.partitioner is not None and (
                    len(v.partitioner.boundaries) != self._backend.num_shards - 1
                ):
                    raise errors.InvalidArgument(
                        f"key {k!r}: a RangePartitioner needs {self._backend.num_shards - 1} "
                        f"boundaries for {self._backend.num_shards} servers"
                    )
                spec = v.to_dict()
                info = KeyInfo(
                    k,
                    table_id_of(k),
                    True,
                    dim=v.dim,
                    boundaries=spec["boundaries"],
                    nonfinite=v.nonfinite,
                )
                prepared.append((info, spec))
            else:
                array = as_float32(v, what=f"value of key {k!r}")
                info = KeyInfo(k, table_id_of(k), False, shape=tuple(array.shape))
                prepared.append((info, np.ascontiguousarray(array).reshape(-1)))
        for info, payload in prepared:
            if info.sparse:
                self._backend.init_sparse(info.table_id, str(info.key), payload)
            else:
                self._backend.init_dense(info.table_id, str(info.key), payload)
            self._keys[info.key] = info
            if self._key_type is None:
                self._key_type = str if isinstance(info.key, str) else int

    def __contains__(self, key) -> bool:
        return self._normalize(key) in self._keys if isinstance(key, (int, str)) else False

    def key_info(self, key) -> KeyInfo:
        """What the store knows of an initialized key (sparse or dense, dim, shape)."""
        return self._info(key)

    # -- sparse ------------------------------------------------------------------------------

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Pulls the rows of row_ids from sparse table(s).

        Args:
            key: a sparse key, or a list of them (one request per server for all).
            out: optional output(s) of shape row_ids.shape + (dim,), float32,
                filled in place (NumPy array or a writable DLPack tensor).
            row_ids: int ids of any shape (duplicates allowed), or a list.

        Returns:
            The output array (or list of them).

        Raises:
            UnknownKey, DTypeError (non-integer ids), ShapeError (bad out).
        """
        del priority  # requests are issued in call order
        if row_ids is None:
            raise errors.InvalidArgument("row_sparse_pull needs row_ids")
        single = not isinstance(key, (list, tuple))
        keys = _as_list(key)
        ids_list = [row_ids] if single else _as_list(row_ids)
        outs = [out] if single else (_as_list(out) if out is not None else [None] * len(keys))
        if len(ids_list) != len(keys) or len(outs) != len(keys):
            raise errors.InvalidArgument("row_sparse_pull: keys, row_ids and out differ in length")
        items, results, targets = [], [], []
        for k, ids, o in zip(keys, ids_list, outs):
            info = self._info(k)
            if not info.sparse:
                raise errors.InvalidArgument(f"key {k!r} is dense; use pull")
            ids = as_ids(ids, key=k)
            shape = ids.shape + (info.dim,)
            if o is None:
                result = np.empty(shape, np.float32)
                target = result
            else:
                result = o
                target = as_numpy(o, what=f"out of key {k!r}", writable=True)
                if target.dtype != np.float32:
                    raise errors.DTypeError(f"out of key {k!r} must be float32, got {target.dtype}")
                if target.shape != shape and target.size != int(np.prod(shape)):
                    raise errors.ShapeError(
                        f"out of key {k!r} must have shape {shape}, got {target.shape}"
                    )
            plan = _core.plan_batch(flat_ids(ids), self._backend.num_shards, info.boundaries)
            items.append((info, plan))
            results.append(result)
            targets.append(target)
        shard_rows = self._backend.pull_sparse(
            [(info.table_id, plan[0], plan[1]) for info, plan in items]
        )
        for (info, (_, offsets, slot)), rows, target in zip(items, shard_rows, targets):
            if target.flags.c_contiguous:
                _core.gather_from_shards(rows, offsets, slot, target.reshape(-1, info.dim))
            else:
                tmp = np.empty((slot.size, info.dim), np.float32)
                _core.gather_from_shards(rows, offsets, slot, tmp)
                target[...] = tmp.reshape(target.shape)
        return results[0] if single else results

    def _prepare_sparse_push(self, info: KeyInfo, value):
        """(keys grouped by shard, offsets, summed gradient rows) of a sparse push."""
        pairs = [value] if isinstance(value, tuple) else _as_list(value)
        id_parts, grad_parts = [], []
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise errors.InvalidArgument(
                    f"a push to sparse key {info.key!r} takes (ids, rows) or a list of them"
                )
            ids = flat_ids(as_ids(pair[0], key=info.key))
            grads = as_float32(pair[1], what=f"rows pushed to key {info.key!r}")
            id_parts.append(ids)
            grad_parts.append(
                rows_view(grads, ids.size, info.dim, what=f"rows pushed to key {info.key!r}")
            )
        ids = id_parts[0] if len(id_parts) == 1 else np.concatenate(id_parts)
        grads = grad_parts[0] if len(grad_parts) == 1 else np.concatenate(grad_parts)
        keys, offsets, slot = _core.plan_batch(ids, self._backend.num_shards, info.boundaries)
        summed = _core.sum_rows(grads, slot, keys.size)
        return keys, offsets, summed

    @staticmethod
    def _check_finite(info: KeyInfo, keys, summed) -> None:
        if info.nonfinite == "skip":
            return  # the shard leaves rows with NaN/inf untouched
        bad = _core.first_nonfinite_row(summed)
        if bad >= 0:
            raise errors.NonFiniteGradient(
                f"key {info.key!r}: gradient for id {int(keys[bad])} has a NaN or inf value; "
                "nothing was applied (SparseTable(nonfinite='skip') drops such rows instead)"
            )

    # -- push / pull ------------------------------------------------------------------------

    def push(self, key, value, priority=0) -> None:
        """Pushes gradients (or values, with no optimizer) to key(s).

        Args:
            key: a key or a list of keys; all go out in one request per server.
            value: sparse key: (ids, rows) or a list of them (summed); rows has
                shape ids.shape + (dim,). Dense key: an array or a list (summed).

        Raises:
            NonFiniteGradient: NaN/inf in a gradient (nothing applied).
            ShapeError, DTypeError, UnknownKey.
        """
        del priority
        keys = _as_list(key)
        values = [value] if not isinstance(key, (list, tuple)) else _as_list(value)
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        sparse_items, dense_items = [], []
        for k, v in zip(keys, values):
            info = self._info(k)
            if info.sparse:
                table_keys, offsets, summed = self._prepare_sparse_push(info, v)
                self._check_finite(info, table_keys, summed)
                sparse_items.append((info.table_id, table_keys, offsets, summed))
            else:
                dense_items.append((info.table_id, self._sum_dense(info, v)))
        if sparse_items:
            self._backend.push_sparse(sparse_items)
        if dense_items:
            self._backend.push_dense(dense_items)

    def _sum_dense(self, info: KeyInfo, value) -> np.ndarray:
        parts = _as_list(value)
        total = None
        for part in parts:
            array = as_float32(part, what=f"value pushed to key {info.key!r}")
            if array.size != info.size:
                raise errors.ShapeError(
                    f"value pushed to key {info.key!r} must have shape {info.shape}, "
                    f"got {array.shape}"
                )
            array = array.reshape(-1)
            total = np.array(array, copy=True) if total is None else total + array
        if total is None:
            raise errors.InvalidArgument(f"empty push to key {info.key!r}")
        if not np.isfinite(total).all():
            raise errors.NonFiniteGradient(
                f"key {info.key!r}: gradient has a NaN or inf value; nothing was applied"
            )
        return np.ascontiguousarray(total, np.float32)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Pulls dense key(s) into out (an array of the key's shape, or a list of them).

        Returns the filled output (a new array if out is None). Sparse tables
        have no whole value to pull: use row_sparse_pull.
        """
        del priority, ignore_sparse
        single = not isinstance(key, (list, tuple))
        keys = _as_list(key)
        outs = [out] if single else (_as_list(out) if out is not None else [None] * len(keys))
        if len(outs) != len(keys):
            raise errors.InvalidArgument("pull: keys and out differ in length")
        items, results, fills = [], [], []
        for k, o in zip(keys, outs):
            info = self._info(k)
            if info.sparse:
                raise errors.InvalidArgument(
                    f"key {k!r} is a sparse table; use row_sparse_pull(key, row_ids=...)"
                )
            flat = np.empty(info.size, np.float32)
            items.append((info.table_id, flat))
            targets = [] if o is None else _as_list(o)  # MXNet: out may be a list of copies
            for t in targets:
                array = as_numpy(t, what=f"out of key {k!r}", writable=True)
                if array.size != info.size or array.dtype != np.float32:
                    raise errors.ShapeError(
                        f"out of key {k!r} must be float32 of shape {info.shape}, "
                        f"got {array.dtype} {array.shape}"
                    )
                fills.append((array, flat))
            results.append(o if o is not None else flat.reshape(info.shape))
        self._backend.pull_dense(items)
        for array, flat in fills:
            array[...] = flat.reshape(array.shape)
        return results[0] if single else results

    def pushpull(self, key, value, out=None, priority=0):
        """push(key, value) then pull(key, out): the updated value after this push."""
        self.push(key, value, priority)
        return self.pull(key, out, priority)

    def broadcast(self, key, value, out=None, priority=0):
        """init(key, value) if the key is new, then pull(key, out) (MXNet semantics)."""
        keys = _as_list(key)
        values = [value] if not isinstance(key, (list, tuple)) else _as_list(value)
        new = [(k, v) for k, v in zip(keys, values) if self._normalize(k) not in self._keys]
        if new:
            self.init([k for k, _ in new], [v for _, v in new])
        return self.pull(key, out, priority)

    # -- optimizer --------------------------------------------------------------------------

    def set_optimizer(self, optimizer) -> None:
        """Runs `optimizer` on the servers for every key without its own.

        Slots of those keys restart from their initial values. None removes
        the updater (a push then replaces values).
        """
        if optimizer is not None and not isinstance(optimizer, optimizers.Optimizer):
            raise errors.InvalidArgument(
                f"set_optimizer takes a kvsparse.optimizers object, got {type(optimizer).__name__}"
            )
        self._backend.set_optimizer(None if optimizer is None else optimizer.to_dict())
        self._optimizer = optimizer

    @property
    def optimizer(self):
        """The store-wide optimizer, or None."""
        return self._optimizer

    def is_capable(self, capability: str) -> bool:
        """MXNet's capability query: optimizers run on the servers."""
        return capability.lower() == "optimizer"

    def save_optimizer_states(self, fname, dump_optimizer=False) -> None:
        """Writes every key's optimizer slots and step counters to fname (NumPy .npz)."""
        per_shard = self._backend.optimizer_states()
        arrays, meta = {}, {"version": 1, "keys": []}
        for index, info in enumerate(self._keys.values()):
            states = [shard[info.table_id] for shard in per_shard]
            if info.sparse:
                arrays[f"k{index}_keys"] = np.concatenate([s["keys"] for s in states])
                arrays[f"k{index}_slots"] = np.concatenate([s["slots"] for s in states])
                arrays[f"k{index}_steps"] = np.concatenate([s["steps"] for s in states])
                steps = [int(s["table_step"]) for s in states]
            else:
                arrays[f"k{index}_slots"] = np.concatenate([s["slots"] for s in states], axis=-1)
                steps = [int(s["step"]) for s in states]
            meta["keys"].append({"key": info.key, "sparse": info.sparse, "steps": steps})
        if dump_optimizer and self._optimizer is not None:
            meta["optimizer"] = self._optimizer.to_dict()
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        with open(fname, "wb") as f:
            np.savez(f, **arrays)

    def load_optimizer_states(self, fname) -> None:
        """Restores what save_optimizer_states wrote (the keys must be initialized)."""
        with np.load(fname) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta.get("version") != 1:
                raise errors.InvalidArgument(f"{fname}: unknown optimizer-state version")
            loads = []
            for index, entry in enumerate(meta["keys"]):
                info = self._info(entry["key"])
                step = max(entry["steps"]) if entry["steps"] else 0
                if info.sparse:
                    keys = data[f"k{index}_keys"]
                    plan_keys, offsets, slot = _core.plan_batch(
                        np.ascontiguousarray(keys), self._backend.num_shards, info.boundaries
                    )
                    order = np.empty(keys.size, np.int64)
                    order[slot] = np.arange(keys.size)
                    slots, steps = data[f"k{index}_slots"][order], data[f"k{index}_steps"][order]
                    for s in range(self._backend.num_shards):
                        a, b = offsets[s], offsets[s + 1]
                        state = {
                            "keys": plan_keys[a:b],
                            "slots": slots[a:b],
                            "steps": steps[a:b],
                            "table_step": step,
                        }
                        loads.append((s, info.table_id, state))
                else:
                    slots = data[f"k{index}_slots"]
                    for s, (a, b) in enumerate(dense_ranges(info.size, self._backend.num_shards)):
                        loads.append((s, info.table_id, {"slots": slots[..., a:b], "step": step}))
        self._backend.load_optimizer_states(loads)

    # -- checkpoints and export (issue 5; format: docs/checkpoint-format.md) --------------

    def _checkpoint_path(self, path):
        """path, or the launcher's --checkpoint-dir when path is None."""
        if path is not None:
            return path
        from kvsparse import config

        path = config.checkpoint_dir()
        if path is None:
            raise errors.InvalidArgument(
                "no checkpoint path given and KVSPARSE_CHECKPOINT_DIR is not set "
                "(kvsparse launch --checkpoint-dir DIR sets it for the workers)"
            )
        return path

    def save(self, path=None, incremental: bool = False) -> int:
        """Writes a checkpoint of every table into directory path; returns its number.

        Each server writes its own shard (values, every optimizer slot, step
        counters, table configurations) as of one moment, while training
        goes on; server 0 then writes the manifest that makes the checkpoint
        exist. Call it from one worker (usually rank 0); with BSP the
        checkpoint then holds one whole step.

        Args:
            path: a directory (created if missing) that every server can write;
                None: the launcher's ``--checkpoint-dir`` (KVSPARSE_CHECKPOINT_DIR).
            incremental: write only the rows changed since this store's last
                save or load in path (a delta on top of it).

        Raises:
            InvalidArgument: incremental without a base checkpoint in path
                that these servers saved or loaded.
            ServerError / CheckpointError: a server failed to write; the
                previous checkpoint stays intact.

        Example:
            >>> kv.save("/ckpt")                      # doctest: +SKIP
            1
            >>> kv.save("/ckpt", incremental=True)    # doctest: +SKIP
            2
        """
        import os
        import time

        path = os.fspath(self._checkpoint_path(path))
        n = self._backend.num_shards
        prepared = self._backend.checkpoint({0: {"action": "prepare", "path": path}})[0]
        seq, latest, parent = int(prepared["seq"]), prepared["latest"], None
        if incremental:
            if latest is None:
                raise errors.InvalidArgument(f"{path}: no checkpoint yet; make a full save first")
            if int(latest["num_shards"]) != n:
                raise errors.InvalidArgument(
                    f"{path}: the latest checkpoint has {latest['num_shards']} shards, this "
                    f"store {n}; make a full save first"
                )
            parent = int(latest["seq"])
        body = {"action": "save", "path": path, "seq": seq, "incremental": bool(incremental)}
        replies = self._backend.checkpoint({s: {**body, "parent": parent} for s in range(n)})
        manifest = {
            "seq": seq,
            "kind": "delta" if incremental else "full",
            "parent": parent,
            "num_shards": n,
            "created": time.time(),
            "shards": [replies[s] for s in range(n)],
            "keys": [self._key_record(info) for info in self._keys.values()],
            "optimizer": None if self._optimizer is None else self._optimizer.to_dict(),
        }
        self._backend.checkpoint({0: {"action": "commit", "path": path, "manifest": manifest}})
        return seq

    @staticmethod
    def _key_record(info: KeyInfo) -> dict:
        return {
            "key": info.key,
            "table_id": info.table_id,
            "sparse": info.sparse,
            "dim": info.dim,
            "shape": list(info.shape),
            "boundaries": info.boundaries,
            "nonfinite": info.nonfinite,
        }

    def load(self, path=None) -> int:
        """Restores the latest complete checkpoint in path (base + deltas); returns its number.

        Every table comes back with its optimizer, slots and step counters,
        so training continues as if it had not stopped; onto another number
        of servers the rows are resharded by key hash. Collective: every
        worker calls it (rank 0 loads, the others wait at a barrier and learn
        the keys). Keys initialized before the load are replaced.

        Raises:
            CheckpointError (an InvalidArgument): no checkpoint, or a missing,
                truncated or corrupt file; nothing partial is served as valid.

        Example:
            >>> kv = kvsparse.create('dist_sparse', servers=new_servers)   # doctest: +SKIP
            >>> kv.load("/ckpt")                                          # doctest: +SKIP
            3
        """
        import os

        path = os.fspath(self._checkpoint_path(path))
        n = self._backend.num_shards
        if self.rank == 0:
            replies = self._backend.checkpoint(
                {s: {"action": "load", "path": path} for s in range(n)}
            )
            manifest = replies[0]
        if self.num_workers > 1:
            self._backend.barrier()
        if self.rank != 0:
            manifest = self._backend.checkpoint({0: {"action": "describe", "path": path}})[0]
        self._keys = {}
        self._key_type = None
        for record in manifest["keys"]:
            key = record["key"]
            self._keys[key] = KeyInfo(
                key,
                int(record["table_id"]),
                bool(record["sparse"]),
                dim=int(record["dim"]),
                shape=tuple(record["shape"]),
                boundaries=record["boundaries"],
                nonfinite=record["nonfinite"],
            )
            self._key_type = str if isinstance(key, str) else int
        spec = manifest.get("optimizer")
        self._optimizer = None if spec is None else optimizers.from_dict(spec)
        return int(manifest["seq"])

    def export(self, path, tables=None) -> str:
        """Writes keys and values (no optimizer slots) of sparse tables for inference.

        The directory gets one NumPy ``.npz`` per server (sorted int64 keys
        and float32 rows per table), read by `kvsparse.serving.EmbeddingLookup`
        or by anything that reads .npz.

        Args:
            path: a directory every server can write.
            tables: key or list of keys of sparse tables (default: all).

        Returns:
            path.

        Example:
            >>> kv.export("/serve/emb", tables=["user"])                      # doctest: +SKIP
            >>> emb = kvsparse.serving.EmbeddingLookup("/serve/emb")         # doctest: +SKIP
            >>> emb["user"].lookup([1, 2]).shape                              # doctest: +SKIP
            (2, 16)
        """
        import os
        import secrets

        path = os.fspath(path)
        if tables is None:
            infos = [info for info in self._keys.values() if info.sparse]
        else:
            infos = [self._info(k) for k in _as_list(tables)]
            for info in infos:
                if not info.sparse:
                    raise errors.InvalidArgument(f"key {info.key!r} is dense; export takes tables")
        body = {
            "action": "export",
            "path": path,
            "table_ids": [info.table_id for info in infos],
            "export_id": secrets.token_hex(8),
        }
        self._backend.checkpoint({s: body for s in range(self._backend.num_shards)})
        return path

    # -- coordination and stats ---------------------------------------------------------

    def barrier(self) -> None:
        """Blocks until every worker reaches the barrier."""
        self._backend.barrier()

    def stats(self) -> dict:
        """Rows and bytes per key (summed over shards) and per-shard counters."""
        shards = self._backend.stats()
        totals: dict = {}
        for shard in shards:
            for name, table in shard["tables"].items():
                total = totals.setdefault(name, {"kind": table["kind"], "rows": 0, "bytes": 0})
                total["rows"] += table["rows"]
                total["bytes"] += table["bytes"]
                # Admission/eviction counters of sparse tables (issue 5).
                for field in _POLICY_COUNTERS:
                    if field in table:
                        total[field] = total.get(field, 0) + table[field]
        return {"tables": totals, "shards": shards}

    def evict(self) -> dict:
        """Runs TTL eviction now on every shard: {table key: rows evicted, summed over shards}.

        Rows of tables with ``ttl_steps`` that no push touched for ttl_steps
        steps are dropped (tables without a TTL report 0). In a job with
        several workers call it from one worker (e.g. rank 0 after a barrier):
        it runs when each server receives it.

        Example:
            >>> kv = kvsparse.create('local')
            >>> kv.init('user', kvsparse.SparseTable(dim=4, ttl_steps=100))
            >>> kv.evict()
            {'user': 0}
        """
        totals: dict = {}
        for shard in self._backend.evict():
            for name, count in shard.items():
                totals[name] = totals.get(name, 0) + int(count)
        # Shards name tables by str(key); give int keys back as ints.
        keys = {str(key): key for key in self._keys}
        return {keys.get(name, name): count for name, count in totals.items()}

    def close(self) -> None:
        """Releases the connections (dist) or the tables (local)."""
        self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (
            f"<kvsparse.KVStore type={self.type} rank={self.rank} "
            f"num_workers={self.num_workers} servers={self.num_servers}>"
        )
