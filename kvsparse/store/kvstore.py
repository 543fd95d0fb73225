"""The KVStore frontend: MXNet's KVStore API over any backend.

`KVStore` validates every input, turns it into arrays, batches ids (unique
ids grouped by shard, duplicate gradients summed, in C++: `batching`; a push
of the ids just pulled reuses the pull's plan: `plans`) and hands
the result to a `backend.Backend`: `LocalBackend` (one in-process shard) for
``create('local')``, the ZeroMQ client for ``create('dist_sparse')``. Every
check runs before the first byte leaves, so a rejected call changes nothing.
Its keys are a `keys.KeyRegistry`; save, load and export run through
`checkpoints.Checkpoints`, the optimizer-state file through
`checkpoints.OptimizerStateFile`.

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

import dataclasses
import functools
import math
import numbers
import threading

import numpy as np

from kvsparse import errors, optimizers
from kvsparse.arrays import (
    as_float32,
    as_ids,
    as_list,
    as_numpy,
    dtype_name,
    flat_ids,
    outputs_per_key,
    per_key,
    table_dtype,
)
from kvsparse.store import batching
from kvsparse.store.backend import Backend
from kvsparse.store.keys import KeyInfo, KeyRegistry
from kvsparse.store.plans import PlanCache
from kvsparse.table import TIER_COUNTERS, SparseTable, check_wire_dtype, tier_stats

# Admission/eviction counters of sparse tables, summed over shards by stats().
_POLICY_COUNTERS = (
    "admissions",
    "evictions",
    "evicted_ttl",
    "evicted_capacity",
    "rejected",
    "candidates",
)


class StoreFront:
    """What every store front shares: ``with`` closes it, and its repr.

    For `KVStore` and the MXNet adapter's store; a subclass provides close(),
    type, rank, num_workers and num_servers, and names itself in _repr_name.
    As thread-safe as its subclass.
    """

    _repr_name = "kvsparse.KVStore"

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (
            f"<{self._repr_name} type={self.type} rank={self.rank} "
            f"num_workers={self.num_workers} servers={self.num_servers}>"
        )


class PendingPull:
    """A `KVStore.row_sparse_pull` sent with ``wait=False``: `wait` fills its outputs.

    Until then the outputs hold nothing meaningful, and must stay alive and
    unchanged. The store's later calls may read the servers' replies first
    (they keep them for `wait`); `wait` reads them if none did. A failure of
    the pull (or of a push with ``wait=False`` sent before it) is raised by
    `wait`. Not thread-safe beyond the store's own rules: one thread waits.
    """

    def __init__(self, finish):
        self._finish = finish
        self._result = None

    @property
    def done(self) -> bool:
        """Whether `wait` has filled the outputs."""
        return self._finish is None

    def wait(self):
        """Fills the outputs; returns what ``row_sparse_pull`` returns (again if asked again).

        Raises:
            what the pull raises: the servers' failures (ServerUnavailable...),
            or that of an earlier push sent with ``wait=False``.
        """
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return self._result


class KVStore(StoreFront):
    """MXNet-style key-value store whose sparse tables live on shards.

    Use ``kvsparse.create(kind)`` rather than this constructor.

    Threads: safe to call from several threads at once (data-loader threads,
    ``tf.py_function``, Keras workers), every push applied exactly once.
    What runs in parallel: checking and converting inputs, planning ids and
    summing duplicate rows (C++, without the GIL), and gathering pulled rows.
    What is serialized: the shard operations (the local backend's lock; a
    dist store's `kvsparse.client.session.Session` lock, one exchange with
    the servers at a time), and init, set_optimizer and load (this store's
    lock). Calls may interleave in any order (one thread's pull, another's
    pull, then the first one's push): the plan a push reuses is always that
    of equal ids (`kvsparse.store.plans`). Concurrent pushes to the same rows
    are applied one after the other, in an order the caller does not choose.

    A step's ``row_sparse_pull(key, row_ids=ids)`` then ``push(key, (ids,
    grads))`` plans the ids once: the pull keeps its plan (the last
    `plans.PLANS_PER_TABLE` per table, released by close), and a push whose
    flat int64 ids equal a kept batch's uses it.

    Args:
        backend: where the tables live (`kvsparse.store.backend.Backend`).
        kind: what ``type`` reports.
        wire_dtype: how sparse tables' rows travel unless a table says
            otherwise (`SparseTable.wire_dtype`): 'float32' (default),
            'float16' or 'bfloat16' (`kvsparse.table.check_wire_dtype`).

    Raises:
        InvalidArgument: a wire_dtype that is not one of those.
    """

    def __init__(
        self, backend: Backend, kind: str, wire_dtype: str = "float32", checkpoint_dir=None
    ):
        self._backend = backend
        self._checkpoint_dir = checkpoint_dir
        # Where a push's summed rows go: the backend's shared memory, if it has some.
        self._rows_buffer = backend.rows_buffer
        self._type = kind
        self._wire_dtype = check_wire_dtype(wire_dtype)
        self._keys = KeyRegistry()
        self._optimizer: optimizers.Optimizer | None = None
        self._plans = PlanCache()
        # init, set_optimizer and load change what every later call reads (the keys, the
        # optimizer): one at a time. Pushes and pulls only read those.
        self._lock = threading.RLock()
        self._saver = None  # a PeriodicSaver (save_every): saves after a push when due

    # The checkpoint code (and the shard's file format under it) loads on the first save,
    # load or export: `import kvsparse` stays light for launchers and for workers that
    # never checkpoint.
    @functools.cached_property
    def _checkpoints(self):
        from kvsparse.store.checkpoints import Checkpoints

        return Checkpoints(self._backend, self._keys, self._checkpoint_dir)

    @functools.cached_property
    def _optimizer_file(self):
        from kvsparse.store.checkpoints import OptimizerStateFile

        return OptimizerStateFile(self._backend, self._keys)

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
    def defers_pulls(self) -> bool:
        """Whether ``row_sparse_pull(..., wait=False)`` returns before the rows arrive.

        True for a dist store whose servers answer a push once applied (ASP,
        SSP, or BSP with one worker; no retry window; not colocated): the
        requests go out at once, behind any pending push, and
        `PendingPull.wait` reads the replies. Else such a pull is done at once
        (a local store; a BSP round of several workers holds a push until
        every worker's arrives, and a pull behind it would wait as long).
        """
        return self._backend.defers_pulls

    @property
    def clock(self) -> int:
        """This worker's push count: one per `push` of sparse keys, one more if it has dense keys.

        Every request carries it (SSP staleness counts it). A colocated worker
        that ``kvsparse launch --colocated --restart-workers`` started again
        (``KVSPARSE_RESTARTED`` >= 1) starts with the count its rank had
        reached less the last push, which it must redo: a loop with one push
        per step resumes at ``step = kv.clock`` (`kvsparse.store.colocated`).
        0 for a new store otherwise.

        Example:
            >>> kv = kvsparse.create('local')                    # doctest: +SKIP
            >>> for step in range(kv.clock, steps):             # doctest: +SKIP
            ...     kv.push('emb', (ids[step], grads(step)))
        """
        return self._backend.clock

    @property
    def num_servers(self) -> int:
        """How many shards hold the tables."""
        return self._backend.num_shards

    @property
    def wire_dtype(self) -> str:
        """How sparse tables' rows travel unless a table sets its own: 'float32' (default),
        'float16' or 'bfloat16' (``kvsparse.create(..., wire_dtype=...)``).

        Settable: later requests travel in the new dtype (the MXNet adapter's
        ``set_gradient_compression({'type': 'fp16'})``).

        Raises:
            InvalidArgument: set to a dtype that is not one of those.
        """
        return self._wire_dtype

    @wire_dtype.setter
    def wire_dtype(self, dtype: str) -> None:
        self._wire_dtype = check_wire_dtype(dtype)

    def wire_dtype_of(self, key) -> str:
        """How key's values travel: a sparse table's wire_dtype, else the store's;
        'float32' for a dense key (dense values always travel as float32).

        The local store rounds the same way, so it gives the numbers a dist
        store with the same setting gives.

        Raises:
            UnknownKey: key is not initialized.
        """
        info = self._keys.info(key)
        return (info.wire_dtype or self._wire_dtype) if info.sparse else "float32"

    # -- init -------------------------------------------------------------------------------

    def init(self, key, value) -> None:
        """Initializes key(s): a SparseTable makes a sparse table, an array a dense key.

        Args:
            key: int or str, or a list of them.
            value: a SparseTable, or an array (NumPy / DLPack) for a dense
                key; a list matching a list of keys. A float16 or bfloat16
                array makes a dense key stored in that dtype (the optimizer
                runs in float32, each update rounds once; pulls return that
                dtype); other float dtypes are stored as float32.

        Raises:
            DuplicateKey: the key was initialized already, differently (an
                identical init is a no-op), or is given twice.
            KeyTypeError: int and str keys mixed.
        """
        keys, values = as_list(key), as_list(value)
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        with self._lock:
            self._init_locked(keys, values)

    def _init_locked(self, keys: list, values: list) -> None:
        prepared = []
        seen: set = set()
        for k, v in zip(keys, values):
            k = self._keys.check_new(k, seen)
            if isinstance(v, SparseTable):
                prepared.append(self._keys.sparse_info(k, v, self._backend.num_shards))
            else:
                what = f"value of key {k!r}"
                source = v if type(v) in (int, float) else as_numpy(v, what=what)
                name = dtype_name(source) if isinstance(source, np.ndarray) else "float32"
                dtype = name if name in ("float16", "bfloat16") else "float32"
                array = as_float32(source, what=what)
                info = self._keys.dense_info(k, array.shape, dtype)
                prepared.append((info, np.ascontiguousarray(array).reshape(-1)))
        # An identical init of a known key is a no-op (docs/api.md), as across two stores: the
        # backend still sees a sparse spec, so a table whose KeyInfo matches but whose spec
        # (initializer, optimizer, seed) differs raises DuplicateKey there; a dense key keeps
        # its values, as the servers keep a dense key another worker initialized first.
        prepared = [
            (info, payload)
            for info, payload in prepared
            if not self._keys.check_same(info) or info.sparse
        ]
        for info, payload in prepared:
            if info.sparse:
                self._backend.init_sparse(info.table_id, str(info.key), payload)
            elif info.dtype != "float32":
                self._backend.init_dense(info.table_id, str(info.key), payload, info.dtype)
            else:
                self._backend.init_dense(info.table_id, str(info.key), payload)
            self._keys.add(info)

    def __contains__(self, key) -> bool:
        return isinstance(key, (int, str)) and key in self._keys

    def key_info(self, key) -> KeyInfo:
        """What the store knows of an initialized key (sparse or dense, dim, shape)."""
        return self._keys.info(key)

    # -- sparse ------------------------------------------------------------------------------

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None, dtype=None, wait=True):
        """Pulls the rows of row_ids from sparse table(s).

        Args:
            key: a sparse key, or a list of them (one request per server for all).
            out: optional output(s) of shape row_ids.shape + (dim,), filled in
                place (NumPy array or a writable DLPack tensor), of the table's
                dtype or float32 (a float32 out widens, exactly).
            row_ids: int ids of any shape (duplicates allowed), or a list.
            dtype: the dtype of a new output: None (default) the table's
                (`SparseTable.dtype`; bfloat16 as ml_dtypes.bfloat16), or
                'float32'.
            wait: False: return a `PendingPull` once the requests are sent
                (where `defers_pulls`; else once pulled); its ``wait()``
                fills the outputs and returns them. The pull reads the rows
                as of when it was sent: a push sent after it does not change
                them. (The torch adapter's prefetch relies on this.)

        Returns:
            The output array (or list of them); a `PendingPull` with wait=False.

        Raises:
            UnknownKey, DTypeError (non-integer ids), ShapeError (bad out).

        The ids' plan (unique ids grouped by shard) is kept for the push of
        the same batch; ids may be refilled in place afterwards (the store
        compares with its own copy).
        """
        del priority  # requests are issued in call order
        if row_ids is None:
            raise errors.InvalidArgument("row_sparse_pull needs row_ids")
        single = not isinstance(key, (list, tuple))
        keys = as_list(key)
        ids_list = per_key(row_ids, single)
        outs = outputs_per_key(out, single, len(keys))
        if len(ids_list) != len(keys) or len(outs) != len(keys):
            raise errors.InvalidArgument("row_sparse_pull: keys, row_ids and out differ in length")
        items, results, targets = [], [], []
        for k, ids, o in zip(keys, ids_list, outs):
            info = self._keys.info(k)
            if not info.sparse:
                raise errors.InvalidArgument(f"key {k!r} is dense; use pull")
            ids = as_ids(ids, key=k)
            result, target = batching.rows_output(info, ids, o, dtype)
            plan = self._plans.for_pull(
                info.table_id, flat_ids(ids), self._backend.num_shards, info.boundaries
            )
            # A 16-bit table's rows travel in its dtype: exact, and half the bytes.
            wire = info.dtype if info.dtype != "float32" else info.wire_dtype or self._wire_dtype
            items.append((info, plan, wire))
            results.append(result)
            targets.append(target)
        pulled = self._backend.pull_sparse(
            [(info.table_id, plan.keys, plan.offsets, wire) for info, plan, wire in items],
            wait=wait,
        )

        def fill(shard_rows):
            for (info, plan, wire), rows, target in zip(items, shard_rows, targets):
                batching.gather_rows(rows, plan.offsets, plan.slot, target, info.dim, wire)
            return results[0] if single else results

        if wait:
            return fill(pulled)
        return PendingPull(lambda: fill(pulled()))

    def row_sparse_prefetch(self, key, row_ids):
        """Tells the servers which rows a pull will ask for soon, so they read them now.

        A server with a disk tier (``--memory-budget`` with ``--spill-dir``)
        brings those of the rows that are on disk into memory at once, while
        the worker computes; the `row_sparse_pull` of these ids that follows
        then finds them in memory instead of reading the disk. It changes no
        row and no result: the pull still reads the table as of when the pull
        is sent (after this step's push, say). Only where `defers_pulls` (the
        request goes out at once, behind any pending push); elsewhere nothing
        is sent.

        Args:
            key: a sparse key, or a list of them (one request per server for all).
            row_ids: int ids of any shape (duplicates allowed), or a list.

        Returns:
            A `PendingPull` whose ``wait()`` gives the rows brought in from disk
            (summed over the servers; one int, or a list for a list of keys), or
            None where nothing was sent. Reading it is optional: an unread
            prefetch's reply is read by the store's next call and dropped.

        Raises:
            UnknownKey, DTypeError (non-integer ids); its ``wait()``: what the
            servers answer (UnknownKey, StorageError...).

        Example:
            >>> kv.row_sparse_prefetch('user', next_ids)   # while computing this step
            >>> kv.push('user', (ids, grads))
            >>> kv.row_sparse_pull('user', row_ids=next_ids)  # its disk rows: in memory
        """
        if not self.defers_pulls:
            return None
        single = not isinstance(key, (list, tuple))
        keys = as_list(key)
        ids_list = per_key(row_ids, single)
        if len(ids_list) != len(keys):
            raise errors.InvalidArgument("row_sparse_prefetch: keys and row_ids differ in length")
        items = []
        for k, ids in zip(keys, ids_list):
            info = self._keys.info(k)
            if not info.sparse:
                raise errors.InvalidArgument(f"key {k!r} is dense; there are no rows to prefetch")
            # The pull's own plan: kept, so the pull of these ids does not make it again.
            plan = self._plans.for_pull(
                info.table_id,
                flat_ids(as_ids(ids, key=k)),
                self._backend.num_shards,
                info.boundaries,
            )
            items.append((info.table_id, plan.keys, plan.offsets))
        read = self._backend.prefetch_sparse(items)
        if read is None:
            return None
        return PendingPull(lambda: read()[0] if single else read())

    # -- push / pull ------------------------------------------------------------------------

    def push(self, key, value, priority=0, wait=True) -> None:
        """Pushes gradients (or values, with no optimizer) to key(s).

        Args:
            key: a key or a list of keys; all go out in one request per server.
            value: sparse key: (ids, rows) or a list of them (summed); rows has
                shape ids.shape + (dim,). Dense key: an array or a list (summed).
                One (ids, rows) pair whose flat int64 ids equal those of a recent
                row_sparse_pull of the key reuses that pull's plan (same result).
            wait: False: return once the push is sent (dist stores; a local
                store applies it at once either way). The servers'
                acknowledgements are collected by this store's next call that
                reaches them (a pull, push, barrier, save, stats...) or by
                close(), which raises the push's failure then, before sending
                anything; a program that ends without either has them collected
                at exit (a failure logged). A pull after the push still reads
                what it wrote.
                The arrays pushed must not change until then. (The torch
                adapter's ``push_together(kv, wait=False)`` relies on this.)

        Raises:
            NonFiniteGradient: NaN/inf in a gradient (nothing applied).
            ShapeError, DTypeError, UnknownKey.
            With wait=True, what the servers answer (LimitExceeded,
            WorkerLeft, ServerUnavailable...).
        """
        del priority
        keys = as_list(key)
        values = per_key(value, not isinstance(key, (list, tuple)))
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        sparse_items, dense_items = [], []
        for k, v in zip(keys, values):
            info = self._keys.info(k)
            if info.sparse:
                wire = info.wire_dtype or self._wire_dtype
                sparse_items.append(
                    batching.sparse_push(
                        info, v, self._backend.num_shards, self._plans, wire, self._rows_buffer
                    )
                )
            else:
                dense_items.append((info.table_id, batching.dense_push(info, v)))
        # Sparse and dense: two exchanges; the second collects the first's acknowledgements.
        if sparse_items:
            self._backend.push_sparse(sparse_items, wait=wait)
        if dense_items:
            self._backend.push_dense(dense_items, wait=wait)
        if self._saver is not None and self._saver.due():
            self._saver.save()

    def pull(self, key, out=None, priority=0, ignore_sparse=True, dtype=None):
        """Pulls dense key(s) into out (an array of the key's shape, or a list of them).

        Returns the filled output (a new array if out is None: of the key's
        dtype, or float32 with dtype='float32'). Sparse tables have no whole
        value to pull: use row_sparse_pull.

        Raises:
            ShapeError: an out not of the key's exact shape. DTypeError: an out
            neither float32 nor the key's dtype.
        """
        del priority, ignore_sparse
        single = not isinstance(key, (list, tuple))
        items, results, fills = self._dense_targets(key, out, dtype)
        self._backend.pull_dense(items)
        for array, flat in fills:
            batching.fill_dense(array, flat)
        return results[0] if single else results

    def _dense_targets(self, key, out, dtype=None) -> tuple:
        """(backend items, what pull returns, [(out array, flat)]) of a pull; checks out."""
        single = not isinstance(key, (list, tuple))
        keys = as_list(key)
        outs = outputs_per_key(out, single, len(keys))
        if len(outs) != len(keys):
            raise errors.InvalidArgument("pull: keys and out differ in length")
        items, results, fills = [], [], []
        for k, o in zip(keys, outs):
            info = self._keys.info(k)
            if info.sparse:
                raise errors.InvalidArgument(
                    f"key {k!r} is a sparse table; use row_sparse_pull(key, row_ids=...)"
                )
            flat = np.empty(info.size, np.float32)
            items.append((info.table_id, flat))
            fills += [(array, flat) for array in batching.dense_outputs(info, o)]
            if o is not None:
                results.append(o)
            elif info.dtype == "float32" or (dtype is not None and table_dtype(dtype) == "float32"):
                results.append(flat.reshape(info.shape))
            else:  # a float16 / bfloat16 key: its values, exactly
                result = np.empty(info.shape, batching.numpy_dtype(info.dtype))
                fills.append((result, flat))
                results.append(result)
        return items, results, fills

    def pushpull(self, key, value, out=None, priority=0):
        """push(key, value) then pull(key, out): the updated value after this push.

        out is checked before the push: a bad out changes nothing.
        """
        self._dense_targets(key, out)
        self.push(key, value, priority)
        return self.pull(key, out, priority)

    def broadcast(self, key, value, out=None, priority=0):
        """init(key, value) if the key is new, then pull(key, out) (MXNet semantics)."""
        keys = as_list(key)
        values = per_key(value, not isinstance(key, (list, tuple)))
        new = [(k, v) for k, v in zip(keys, values) if k not in self._keys]
        if new:
            self.init([k for k, _ in new], [v for _, v in new])
        return self.pull(key, out, priority)

    def assign(self, key, value) -> None:
        """Writes rows of sparse table(s) verbatim, at any time.

        No optimizer runs and admission does not count the rows: what MXNet's
        ``init`` of a key's value does, and what restoring weights needs.
        Inserted rows get initial optimizer slots; rows that exist keep theirs.
        Not collective: every worker that calls it writes (call it from one
        worker, then ``barrier()``, for "rank 0's value wins").

        Args:
            key: a sparse key or a list of them (one request per server for all).
            value: (ids, rows) per key: int ids of any shape, float rows of
                shape ids.shape + (dim,); a duplicated id gets its last row.

        Raises:
            UnknownKey, ShapeError, DTypeError; InvalidArgument: a dense key,
            or a NaN or inf row (nothing is written).

        Example:
            >>> kv = kvsparse.create('local')
            >>> kv.init('user', kvsparse.SparseTable(dim=2))
            >>> kv.assign('user', (np.array([4]), np.array([[1.0, 2.0]], np.float32)))
            >>> kv.row_sparse_pull('user', row_ids=np.array([4]))
            array([[1., 2.]], dtype=float32)
        """
        keys = as_list(key)
        values = per_key(value, not isinstance(key, (list, tuple)))
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        items = []
        for k, v in zip(keys, values):
            info = self._keys.info(k)
            if not info.sparse:
                raise errors.InvalidArgument(
                    f"key {k!r} is dense; assign writes rows of sparse tables"
                )
            items.append(batching.sparse_assign(info, v, self._backend.num_shards))
        self._backend.assign_sparse(items)

    # -- optimizer --------------------------------------------------------------------------

    def set_optimizer(self, optimizer, key=None) -> None:
        """Runs `optimizer` on the servers for every key without its own, or for key(s).

        Slots of those keys restart from their initial values. None removes
        the updater (a push then replaces values).

        Args:
            optimizer: a kvsparse.optimizers object, or None.
            key: None: the store-wide optimizer. A key or a list of keys
                (sparse or dense): their own optimizer from now on, kept when the
                store-wide one changes (as ``SparseTable(optimizer=...)``); with
                optimizer None they go back to the store-wide one. Per-parameter
                learning rates (MXNet's lr_mult / wd_mult) use it.

        Raises:
            InvalidArgument: not a kvsparse optimizer. UnknownKey: key not initialized.
        """
        if optimizer is not None and not isinstance(optimizer, optimizers.Optimizer):
            raise errors.InvalidArgument(
                f"set_optimizer takes a kvsparse.optimizers object, got {type(optimizer).__name__}"
            )
        spec = None if optimizer is None else optimizer.to_dict()
        with self._lock:
            if key is None:
                self._backend.set_optimizer(spec)
                self._optimizer = optimizer
                return
            infos = [self._keys.info(k) for k in as_list(key)]
            if infos:
                self._backend.set_optimizer(spec, [info.table_id for info in infos])
            for info in infos:
                self._keys.add(dataclasses.replace(info, own_optimizer=optimizer is not None))

    def set_learning_rate(self, learning_rate: float, key=None) -> None:
        """Changes the learning rate of the optimizers on the servers, keeping their state.

        Unlike ``set_optimizer``, nothing restarts: every slot (Adagrad's
        accumulator, Adam's moments...), every row's step count and the table
        steps stay, so a learning-rate schedule continues the same training.
        Checkpoints record the new rate. On a distributed store every worker
        makes the same calls, as for set_optimizer (rank 0's applies; the
        others wait for it and must agree).

        Args:
            learning_rate: the new rate (a finite number >= 0; FTRL: > 0).
            key: None: the store-wide optimizer and every table's, their own
                ones included. A key or a list of keys (sparse or dense): their
                optimizer only; a key that ran the store-wide optimizer then has
                its own (as after ``set_optimizer(..., key=...)``), at the new rate.

        Raises:
            InvalidArgument: a rate the optimizer refuses; a key without an
                optimizer; key None and no optimizer anywhere. Nothing changes then.
            UnknownKey: key not initialized.

        Example:
            >>> kv.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=0.1))
            >>> kv.set_learning_rate(0.01)  # the accumulators stay
        """
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
            raise errors.InvalidArgument(
                f"set_learning_rate takes a number, got {type(learning_rate).__name__}"
            )
        learning_rate = float(learning_rate)
        if not math.isfinite(learning_rate) or learning_rate < 0:
            raise errors.InvalidArgument(
                f"learning_rate must be a finite number >= 0, got {learning_rate!r}"
            )
        with self._lock:
            if key is None:
                store_wide = self._optimizer
                if store_wide is not None and store_wide.kind not in (None, "none"):
                    store_wide = store_wide.with_learning_rate(learning_rate)
                self._backend.set_learning_rate(learning_rate)
                self._optimizer = store_wide
                return
            infos = [self._keys.info(k) for k in as_list(key)]
            if infos:
                self._backend.set_learning_rate(learning_rate, [info.table_id for info in infos])
            for info in infos:
                self._keys.add(dataclasses.replace(info, own_optimizer=True))

    @property
    def optimizer(self):
        """The store-wide optimizer, or None."""
        return self._optimizer

    def is_capable(self, capability: str) -> bool:
        """MXNet's capability query: optimizers run on the servers."""
        return capability.lower() == "optimizer"

    def save_optimizer_states(self, fname, dump_optimizer=False) -> None:
        """Writes every key's optimizer slots and step counters to fname (NumPy .npz).

        With dump_optimizer, the store-wide optimizer's settings go in the file too
        (layout: `kvsparse.store.checkpoints.OptimizerStateFile`).
        """
        dump = dump_optimizer and self._optimizer is not None
        self._optimizer_file.save(fname, self._optimizer.to_dict() if dump else None)

    def load_optimizer_states(self, fname) -> None:
        """Restores what save_optimizer_states wrote (the keys must be initialized)."""
        self._optimizer_file.load(fname)

    # -- checkpoints and export (format: docs/checkpoint-format.md) -----------------------

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
        return self._checkpoints.save(path, self._optimizer, incremental)

    def save_every(self, seconds, keep=None, path=None) -> None:
        """Saves into path every `seconds` while training runs: full first, then deltas.

        A save is made after a push once `seconds` passed since the last one
        (in the pushing thread, between steps: what ``kv.save`` there would
        give). ``kvsparse launch --save-every S --keep N`` calls it on rank 0.
        Call it on one worker only (rank 0); None as seconds stops it.

        Args:
            seconds: the interval (> 0), or None to stop saving.
            keep: at most this many deltas on a full checkpoint; the next save
                is full, and checkpoints before the previous full one are
                deleted (see `kvsparse.store.periodic`). None: no limit.
            path: the directory (None: the launcher's ``--checkpoint-dir``).

        Raises:
            InvalidArgument: a bad interval or keep, or no path and no
                ``--checkpoint-dir``.

        Example:
            >>> kv.save_every(5.0, keep=10)   # doctest: +SKIP
        """
        if seconds is None:
            self._saver = None
            return
        from kvsparse.store.periodic import PeriodicSaver

        self._checkpoints.resolve(path)  # fails now without a directory
        self._saver = PeriodicSaver(self, seconds, keep, path)

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
        with self._lock:
            seq, self._optimizer = self._checkpoints.load(path)
            self._plans.clear()  # the loaded tables may have other partitioners
            return seq

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
        return self._checkpoints.export(path, tables)

    # -- coordination and stats ---------------------------------------------------------

    def barrier(self) -> None:
        """Blocks until every worker reaches the barrier."""
        self._backend.barrier()

    def stats(self) -> dict:
        """Rows and bytes per key (summed over shards) and per-shard counters.

        Servers with a memory budget (``--memory-budget``) add, per sparse
        table, ``"tier"``: rows_in_memory, rows_on_disk, memory_bytes,
        disk_bytes, disk_index_bytes, rows_read, row_lookups, disk_hits,
        evictions (rows moved to disk), bytes_read, bytes_written,
        bytes_updated, gc_segments_freed, gc_bytes_moved, compactions (summed
        over shards), hit_rate and write_amplification (computed from the
        sums); and, per shard, ``"memory": {"budget", "used"}``.

        Tables are named by their keys as given to init: an int key stays an
        int (the shards name tables by str(key)), so a name from stats() is
        a key every other call takes.

        Example:
            >>> import kvsparse
            >>> kv = kvsparse.create('local')
            >>> kv.init(7, kvsparse.SparseTable(dim=2))
            >>> list(kv.stats()["tables"])
            [7]
        """
        keys = self._keys.names()
        shards = self._backend.stats()
        for shard in shards:
            shard["tables"] = {keys.get(n, n): t for n, t in shard["tables"].items()}
        totals: dict = {}
        for shard in shards:
            for name, table in shard["tables"].items():
                total = totals.setdefault(name, {"kind": table["kind"], "rows": 0, "bytes": 0})
                total["rows"] += table["rows"]
                total["bytes"] += table["bytes"]
                # Admission/eviction counters of sparse tables.
                for field in _POLICY_COUNTERS:
                    if field in table:
                        total[field] = total.get(field, 0) + table[field]
                # A shard with a memory budget: its disk tier's counters.
                if "tier" in table:
                    tier = total.setdefault("tier", dict.fromkeys(TIER_COUNTERS, 0))
                    for field in TIER_COUNTERS:
                        tier[field] += table["tier"].get(field, 0)
        for total in totals.values():
            if "tier" in total:  # the ratios of the sums, not a sum of ratios
                total["tier"] = tier_stats(total["tier"])
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
        keys = self._keys.names()
        return {keys.get(name, name): count for name, count in totals.items()}

    def close(self) -> None:
        """Releases the connections (dist) or the tables (local), and the kept plans."""
        self._plans.clear()
        self._backend.close()
