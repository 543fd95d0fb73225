"""A plain NumPy model of a whole KVStore: sparse tables, dense keys, store optimizer.

Built on tests/reference.py's ReferenceTable and ReferenceOptimizer. It
applies the documented semantics (kvsparse/store/kvstore.py) with no C++ at all,
so any store (local, or dist_sparse over any number of servers) fed the same
operations must end with the same tables.

Example:
    >>> store = ReferenceStore()
    >>> store.init("w", np.zeros(3, np.float32))
    >>> store.push("w", [np.ones(3, np.float32)] * 2)
    >>> store.pull("w")
    array([2., 2., 2.], dtype=float32)
"""

from __future__ import annotations

import numpy as np
from reference import ReferenceOptimizer, ReferenceTable

from kvsparse import errors


class _Dense:
    def __init__(self, values: np.ndarray, optimizer_spec):
        self.values = np.array(values, np.float32).reshape(-1)
        self.shape = np.shape(values)
        self.reset(optimizer_spec)

    def reset(self, spec):
        self.optimizer = ReferenceOptimizer(spec)
        self.slots = self.optimizer.initial_slots(self.values.size)
        self.step = 0


class ReferenceStore:
    """The store's semantics, one key at a time, in NumPy."""

    def __init__(self):
        self.tables: dict = {}  # key -> (ReferenceTable, spec dict)
        self.dense: dict = {}
        self.optimizer = None  # store-wide spec dict

    def init(self, key, value) -> None:
        if key in self.tables or key in self.dense:
            raise errors.DuplicateKey(f"key {key!r} is already initialized")
        if hasattr(value, "to_dict"):
            spec = value.to_dict()
            optimizer = spec["optimizer"] if spec["optimizer"] is not None else self.optimizer
            table = ReferenceTable(spec["dim"], spec["initializer"], optimizer, spec["seed"])
            self.tables[key] = (table, spec)
        else:
            self.dense[key] = _Dense(np.asarray(value, np.float32), self.optimizer)

    def set_optimizer(self, spec) -> None:
        self.optimizer = spec
        for table, table_spec in self.tables.values():
            if table_spec["optimizer"] is None:
                table.optimizer = ReferenceOptimizer(spec)
                table.slots = {k: table.optimizer.initial_slots(table.dim) for k in table.rows}
                table.steps = dict.fromkeys(table.rows, 0)
                table.table_step = 0
        for dense in self.dense.values():
            dense.reset(spec)

    def push(self, key, value) -> None:
        if key in self.tables:
            table, spec = self.tables[key]
            pairs = value if isinstance(value, list) else [value]
            ids = np.concatenate([np.asarray(p[0], np.int64).reshape(-1) for p in pairs])
            grads = np.concatenate(
                [np.asarray(p[1], np.float32).reshape(-1, table.dim) for p in pairs]
            )
            table.apply_gradients(ids, grads, skip_nonfinite=spec["nonfinite"] == "skip")
            return
        dense = self.dense[key]
        parts = value if isinstance(value, list) else [value]
        total = np.array(parts[0], np.float32).reshape(-1)
        for part in parts[1:]:
            total = total + np.asarray(part, np.float32).reshape(-1)
        if not np.isfinite(total).all():
            raise errors.NonFiniteGradient(f"key {key!r}: gradient has a NaN or inf value")
        if dense.optimizer.kind in (None, "none"):
            dense.values[...] = total
            return
        dense.step += 1
        dense.optimizer.update(dense.values, dense.slots, total, dense.step)

    def pull(self, key) -> np.ndarray:
        dense = self.dense[key]
        return dense.values.reshape(dense.shape).copy()

    def row_sparse_pull(self, key, row_ids) -> np.ndarray:
        table, _ = self.tables[key]
        ids = np.asarray(row_ids, np.int64)
        return table.lookup(ids.reshape(-1)).reshape(ids.shape + (table.dim,))
