"""kvsparse: a parameter server for huge sparse embedding tables.

Example:
    >>> import numpy as np, kvsparse
    >>> kv = kvsparse.create('local')
    >>> kv.init('user', kvsparse.SparseTable(dim=8))
    >>> kv.row_sparse_pull('user', row_ids=np.array([1, 2])).shape
    (2, 8)
"""

try:
    from kvsparse import _core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised on an unbuilt tree
    raise ImportError(
        "kvsparse's compiled core (kvsparse._core) is not built. Build it from the "
        "source tree with `pip install -e .` (or `python setup.py build_ext --inplace`); "
        f"original error: {exc}"
    ) from exc

from kvsparse import errors, initializers, optimizers
from kvsparse.kvstore import KVStore
from kvsparse.table import RangePartitioner, SparseTable

__version__ = "0.1.0"

_DIST_KINDS = ("dist_sparse", "dist_sync", "dist_async", "dist_sparse_async", "dist")


def create(name: str = "local", **kwargs) -> KVStore:
    """Creates a KVStore.

    Args:
        name: 'local' (one in-process shard), or 'dist_sparse' / 'dist_sync'
            (BSP), 'dist_async' (ASP) for the ZeroMQ servers; ``staleness=k``
            gives SSP.
        **kwargs: for dist kinds: servers=[addresses], rank=, num_workers=,
            timeout=, staleness= (default: what the launcher or the
            environment set).

    Raises:
        ValueError: an unknown kind.
    """
    if not isinstance(name, str):
        raise errors.InvalidArgument(f"store kind must be a str, got {name!r}")
    kind = name.lower()
    if kind in ("local", "device", "local_update_cpu", "local_allreduce_cpu"):
        if kwargs:
            raise errors.InvalidArgument(f"the local store takes no options, got {sorted(kwargs)}")
        from kvsparse.local import LocalBackend

        return KVStore(LocalBackend(), "local")
    if kind in _DIST_KINDS:
        from kvsparse.dist import create_dist_store

        return create_dist_store(kind, **kwargs)
    raise errors.InvalidArgument(
        f"unknown store kind {name!r}; use 'local', 'dist_sparse', 'dist_sync' or 'dist_async'"
    )


__all__ = [
    "KVStore",
    "RangePartitioner",
    "SparseTable",
    "create",
    "errors",
    "initializers",
    "optimizers",
]
