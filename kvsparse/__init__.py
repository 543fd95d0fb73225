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
from kvsparse.store.factory import create
from kvsparse.store.kvstore import KVStore, PendingPull
from kvsparse.table import RangePartitioner, SparseTable

__version__ = "0.1.0"

__all__ = [
    "KVStore",
    "PendingPull",
    "RangePartitioner",
    "SparseTable",
    "create",
    "errors",
    "initializers",
    "optimizers",
]
