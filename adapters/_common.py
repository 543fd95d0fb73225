"""What every adapter needs: creating a table on first use, and one lock per store.

Plain Python with no framework import, so that each adapter can share it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from kvsparse import errors
from kvsparse.arrays import table_dtype
from kvsparse.table import SparseTable

# One lock per store, shared by all adapters. A KVStore is safe to call from
# several threads; the adapters still take this lock around their calls, which
# come from threads of their own (a prefetch) or of the framework (JAX and
# TensorFlow host callbacks), so that a check and the call it guards
# (ensure_table's lookup and init) run as one.
_store_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_store_locks_guard = threading.Lock()


def store_lock(kv) -> threading.Lock:
    """The lock the adapters take around every call to `kv`.

    A store is safe to call from several threads without it; take it to
    make several calls one unit with respect to the adapters (none of them
    runs in between). Safe to call from several threads at once.

    Example:
        >>> with store_lock(kv):
        ...     rows = kv.row_sparse_pull('user', row_ids=ids)
    """
    with _store_locks_guard:
        lock = _store_locks.get(kv)
        if lock is None:
            lock = _store_locks[kv] = threading.Lock()
        return lock


def ensure_table(
    kv,
    key,
    embedding_dim=None,
    *,
    initializer=None,
    optimizer=None,
    seed: int = 0,
    partitioner=None,
    nonfinite: str = "raise",
) -> int:
    """Creates sparse table `key` on `kv` unless it exists; returns its dim.

    Safe to call from several threads at once (it runs under `store_lock`).

    Args:
        kv: a kvsparse.KVStore.
        key: the table's key.
        embedding_dim: row width; needed when the table does not exist yet,
            checked against it when it does.
        initializer, optimizer, seed, partitioner, nonfinite: passed to
            kvsparse.SparseTable when the table is created (ignored otherwise).

    Raises:
        kvsparse.errors.UnknownKey: no table and no embedding_dim.
        kvsparse.errors.ShapeError: the table exists with another dim.
        kvsparse.errors.InvalidArgument: `key` is a dense key.

    Example:
        >>> ensure_table(kv, 'user', 16, optimizer=kvsparse.optimizers.Adagrad(0.05))
        16
    """
    return TableOptions(initializer, optimizer, seed, partitioner, nonfinite).ensure(
        kv, key, embedding_dim
    )


def check_trainable(kv, key) -> None:
    """Raises unless a push of gradients to sparse table `key` runs an optimizer.

    With no optimizer (neither ``SparseTable(optimizer=...)`` nor
    ``kv.set_optimizer``) a push replaces the rows by the pushed values: an
    adapter's backward would silently overwrite the table with its gradients.
    Adapters call this before every gradient push. A table whose optimizer
    this store cannot know (keys learned from a checkpoint) passes. Safe to
    call from several threads at once.

    Raises:
        kvsparse.errors.InvalidArgument: the table has no optimizer.

    Example:
        >>> check_trainable(kv, 'user')  # kv.set_optimizer(...) was called: passes
    """
    if kv.optimizer is not None:
        return
    if kv.key_info(key).own_optimizer is False:
        raise errors.InvalidArgument(
            f"table {key!r} has no optimizer, so pushing its gradients would replace its rows "
            f"by the gradients; call kv.set_optimizer(kvsparse.optimizers.SGD(...)) or give the "
            f"table one (optimizer= here, or SparseTable(optimizer=...))"
        )


@dataclass(frozen=True)
class TableOptions:
    """The kvsparse.SparseTable settings an adapter creates a missing table with.

    The adapters' ``initializer=, optimizer=, seed=, partitioner=, nonfinite=``
    arguments, kept together until the table is looked up. Immutable; `ensure`
    may be called from several threads at once (it takes the store's lock).
    """

    initializer: object = None
    optimizer: object = None
    seed: int = 0
    partitioner: object = None
    nonfinite: str = "raise"
    # The table's storage dtype: a name or a framework dtype; None: float32.
    dtype: object = None

    def ensure(self, kv, key, embedding_dim=None) -> int:
        """Creates sparse table `key` on `kv` with these settings unless it exists; its dim.

        Raises: as `ensure_table`.
        """
        with store_lock(kv):
            if key in kv:
                info = kv.key_info(key)
                if not info.sparse:
                    raise errors.InvalidArgument(f"key {key!r} is a dense key, not a sparse table")
                if embedding_dim is not None and int(embedding_dim) != info.dim:
                    raise errors.ShapeError(
                        f"table {key!r} has dim {info.dim}, "
                        f"but embedding_dim={embedding_dim} was asked"
                    )
                if self.dtype is not None and table_dtype(self.dtype) != info.dtype:
                    raise errors.InvalidArgument(
                        f"table {key!r} holds {info.dtype}, but dtype={self.dtype} was asked"
                    )
                return info.dim
            if embedding_dim is None:
                raise errors.UnknownKey(
                    f"table {key!r} does not exist; pass embedding_dim= to create it, "
                    "or kv.init it first"
                )
            settings = {"dim": int(embedding_dim), "optimizer": self.optimizer, "seed": self.seed}
            if self.initializer is not None:
                settings["initializer"] = self.initializer
            if self.dtype is not None:
                settings["dtype"] = table_dtype(self.dtype)
            table = SparseTable(partitioner=self.partitioner, nonfinite=self.nonfinite, **settings)
            kv.init(key, table)
            return int(embedding_dim)
