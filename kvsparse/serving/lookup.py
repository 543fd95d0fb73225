"""Lookup-only use of exported tables, without servers ("a sparse table as a dictionary").

`KVStore.export(path)` writes one NumPy ``.npz`` per server into path; the
layout is `kvsparse.shard.checkpoint.export`'s (its writer), read here. NumPy
.npz was chosen because numpy is the one dependency kvsparse already has
(pyarrow is not installed in its environment) and every array tool reads it.

`EmbeddingLookup(path)` merges the parts into one sorted key array per table
and answers lookups with a vectorized ``np.searchsorted``.

Example:
    >>> kv.export("/serve/emb")                                  # doctest: +SKIP
    >>> emb = EmbeddingLookup("/serve/emb")                      # doctest: +SKIP
    >>> emb["user"].lookup([[3, 7], [9, 3]]).shape               # doctest: +SKIP
    (2, 2, 16)
"""

from __future__ import annotations

import json
import os

import numpy as np

from kvsparse import errors
from kvsparse.arrays import numpy_dtype
from kvsparse.shard.checkpoint.export import (
    EXPORT_FORMAT,
    PART_RE,
    READABLE_EXPORT_VERSIONS,
    array_names,
)

DEFAULTS = ("zeros", "initializer")


class LookupTable:
    """One exported table: sorted keys and their rows.

    Args:
        name: the table's key.
        keys: int64, sorted ascending, unique.
        values: (len(keys), dim): float32, float16 or bfloat16 (what lookups return).
        spec: the table's SparseTable.to_dict() (for default='initializer').
        default: what a missing id gets: 'zeros' (default) or 'initializer'
            (the value the training store would have given an unseen id:
            the table's initializer with its seed).

    Read-only once built: lookup and contains may be called from several
    threads at once.
    """

    def __init__(self, name, keys, values, spec=None, default="zeros"):
        if default not in DEFAULTS:
            raise errors.InvalidArgument(f"default must be one of {DEFAULTS}, got {default!r}")
        self.name = name
        self.keys = np.ascontiguousarray(keys, np.int64)
        values = np.asarray(values)
        if values.dtype.name not in ("float16", "bfloat16"):
            values = values.astype(np.float32, copy=False)
        self.values = np.ascontiguousarray(values)
        self.dtype = self.values.dtype.name  # what lookups return
        self.dim = int(self.values.shape[1])
        self.spec = spec
        self.default = default
        self._initial = None
        if default == "initializer":
            from kvsparse import _core

            spec = spec or {}
            self._initial = _core.Table(
                self.dim,
                spec.get("initializer"),
                None,
                int(spec.get("seed", 0)),
                dtype=spec.get("dtype", "float32"),
            )

    def __len__(self) -> int:
        return int(self.keys.size)

    def lookup(self, ids) -> np.ndarray:
        """Rows of ids (any shape) -> ids.shape + (dim,); missing ids get the default.

        Raises:
            KeyTypeError: ids are not integers.
        """
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise errors.KeyTypeError(f"ids must be integers, got dtype {ids.dtype}")
        flat = ids.astype(np.int64, copy=False).reshape(-1)
        position = np.searchsorted(self.keys, flat)
        position_clipped = np.minimum(position, max(self.keys.size - 1, 0))
        found = (
            (self.keys[position_clipped] == flat) if self.keys.size else np.zeros(flat.size, bool)
        )
        out = np.empty((flat.size, self.dim), self.values.dtype)
        out[found] = self.values[position_clipped[found]]
        missing = ~found
        if missing.any():
            if self._initial is None:
                out[missing] = 0.0
            else:
                out[missing] = self._initial.initial_values(np.ascontiguousarray(flat[missing]))
        return out.reshape(ids.shape + (self.dim,))

    def contains(self, ids) -> np.ndarray:
        """Boolean array: which ids are in the exported table."""
        flat = np.asarray(ids, np.int64).reshape(-1)
        if not self.keys.size:
            return np.zeros(np.shape(ids), bool)
        position = np.minimum(np.searchsorted(self.keys, flat), self.keys.size - 1)
        return (self.keys[position] == flat).reshape(np.shape(ids))


class EmbeddingLookup:
    """The tables of an export directory, for lookups without servers.

    Args:
        path: a directory written by `KVStore.export`.
        default: for missing ids: 'zeros' or 'initializer' (see LookupTable).

    Raises:
        InvalidArgument: no export there, parts missing, or parts of
            different exports mixed.

    Read-only once built: lookups may run from several threads at once.

    Example:
        >>> emb = EmbeddingLookup("/serve/emb")          # doctest: +SKIP
        >>> emb.tables                                   # doctest: +SKIP
        ['item', 'user']
        >>> emb.lookup("user", [1, 2, 3]).shape          # doctest: +SKIP
        (3, 16)
    """

    def __init__(self, path, default: str = "zeros"):
        path = os.fspath(path)
        try:
            names = sorted(n for n in os.listdir(path) if PART_RE.match(n))
        except OSError as exc:
            raise errors.InvalidArgument(f"{path}: cannot read the export ({exc})") from None
        if not names:
            raise errors.InvalidArgument(f"{path}: no exported parts (part-*.npz)")
        parts, metas = [], []
        for name in names:
            try:
                data = np.load(os.path.join(path, name))
                meta = json.loads(bytes(data["meta"]).decode())
            except (OSError, ValueError, KeyError) as exc:
                raise errors.InvalidArgument(
                    f"{path}/{name}: unreadable export part ({exc})"
                ) from None
            if (
                meta.get("format") != EXPORT_FORMAT
                or meta.get("version") not in READABLE_EXPORT_VERSIONS
            ):
                raise errors.InvalidArgument(f"{path}/{name}: unknown export format")
            parts.append(data)
            metas.append(meta)
        ids = {m["export_id"] for m in metas}
        counts = {m["num_parts"] for m in metas}
        if len(ids) != 1 or len(counts) != 1:
            raise errors.InvalidArgument(f"{path}: parts of different exports are mixed")
        if sorted(m["part"] for m in metas) != list(range(counts.pop())):
            raise errors.InvalidArgument(f"{path}: export parts are missing")
        self._tables: dict = {}
        for position, table in enumerate(metas[0]["tables"]):
            keys_name, values_name = array_names(table, position)
            keys = np.concatenate([p[keys_name] for p in parts])
            values = np.concatenate([p[values_name] for p in parts])
            dtype = table.get("dtype", "float32")
            if dtype == "bfloat16":
                values = values.view(numpy_dtype("bfloat16"))
            order = np.argsort(keys, kind="stable")
            self._tables[table["name"]] = LookupTable(
                table["name"], keys[order], values[order], table.get("spec"), default
            )
        for data in parts:
            data.close()

    @property
    def tables(self) -> list[str]:
        """The exported tables' names, sorted."""
        return sorted(self._tables)

    def __getitem__(self, name) -> LookupTable:
        """The table called name; UnknownKey if the export has none."""
        try:
            return self._tables[str(name)]
        except KeyError:
            raise errors.UnknownKey(f"no table {name!r} in this export") from None

    def __contains__(self, name) -> bool:
        return str(name) in self._tables

    def lookup(self, name, ids) -> np.ndarray:
        """Rows of ids in table name -> ids.shape + (dim,)."""
        return self[name].lookup(ids)


__all__ = ["EmbeddingLookup", "LookupTable"]
