"""The keys a store has initialized: what each one is, and which kind of key it uses.

A `KeyRegistry` belongs to one `KVStore`. It refuses keys that are neither
int nor str, mixing int and str keys, and a second init of a key; it gives
each key its `KeyInfo` (table id, sparse or dense, dim or shape, partitioner
boundaries), and writes and reads the key records of a checkpoint manifest.

Example:
    >>> import kvsparse
    >>> registry = KeyRegistry()
    >>> info = registry.sparse_info("user", kvsparse.SparseTable(dim=4), num_shards=1)
    >>> registry.add(info)
    >>> registry.info("user").dim
    4
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsparse import errors
from kvsparse.arrays import table_dtype
from kvsparse.placement import table_id_of
from kvsparse.table import SparseTable, check_wire_dtype


@dataclass
class KeyInfo:
    """What the store knows of one initialized key (`KVStore.key_info`).

    A plain record; do not change one that a store handed out. Read it from
    any number of threads at once.
    """

    key: object
    table_id: int
    sparse: bool
    dim: int = 0  # sparse
    shape: tuple = ()  # dense
    boundaries: list | None = None  # sparse, range partitioner
    nonfinite: str = "raise"  # sparse: 'raise' or 'skip'
    # sparse: SparseTable(optimizer=...) was given; None: not known here (a key
    # learned from a checkpoint manifest, which does not record it).
    own_optimizer: bool | None = None
    # sparse: SparseTable(wire_dtype=...), None: the store's (`KVStore.wire_dtype_of`).
    wire_dtype: str | None = None
    # What the servers store and pulls return by default: a sparse
    # table's SparseTable(dtype=...), a dense key's value dtype at init.
    dtype: str = "float32"

    @property
    def size(self) -> int:
        """How many values a dense key holds."""
        return int(np.prod(self.shape, dtype=np.int64))

    def to_record(self) -> dict:
        """The key's record in a checkpoint manifest (docs/checkpoint-format.md)."""
        return {
            "key": self.key,
            "table_id": self.table_id,
            "sparse": self.sparse,
            "dim": self.dim,
            "shape": list(self.shape),
            "boundaries": self.boundaries,
            "nonfinite": self.nonfinite,
            "wire_dtype": self.wire_dtype,
            "dtype": self.dtype,
        }

    @classmethod
    def from_record(cls, record: dict) -> KeyInfo:
        """The KeyInfo of a manifest record written by `to_record`.

        Raises:
            InvalidArgument: a wire dtype that is not one.
        """
        wire_dtype = record.get("wire_dtype")
        if wire_dtype is not None:
            check_wire_dtype(wire_dtype, f"key {record['key']!r}: the manifest's wire_dtype")
        return cls(
            record["key"],
            int(record["table_id"]),
            bool(record["sparse"]),
            dim=int(record["dim"]),
            shape=tuple(record["shape"]),
            boundaries=record["boundaries"],
            nonfinite=record["nonfinite"],
            # Manifests from before per-table wire dtypes have none: the store's wire dtype.
            wire_dtype=wire_dtype,
            # Manifests from before half-precision tables have none: float32.
            dtype=table_dtype(record.get("dtype", "float32"), f"key {record['key']!r}: dtype"),
        )


class KeyRegistry:
    """The initialized keys of one store, in init order, and the key kind they use.

    Keys are int or str (NumPy integers count as int and are stored as int);
    once a key is added, keys of the other kind are refused.

    Threads: lookups (info, ``in``, infos, names) may run in several threads
    at once, also while one thread adds or replaces keys; adding and
    replacing must be serialized by the caller (`KVStore` does, under its lock).
    """

    def __init__(self):
        self._infos: dict = {}
        self._key_type: type | None = None

    @staticmethod
    def normalize(key):
        """The form a key is stored under: str as it is, integers as int."""
        return key if isinstance(key, str) else int(key)

    def check_type(self, key) -> None:
        """Raises KeyTypeError unless key is an int or str of this store's kind."""
        if isinstance(key, bool) or not isinstance(key, (int, str, np.integer)):
            raise errors.KeyTypeError(f"keys must be int or str, got {type(key).__name__} {key!r}")
        kind = str if isinstance(key, str) else int
        if self._key_type is not None and kind is not self._key_type:
            raise errors.KeyTypeError(
                f"key {key!r} is {kind.__name__} but this store uses "
                f"{self._key_type.__name__} keys; int and str keys cannot be mixed"
            )

    def check_new(self, key, seen: set):
        """The normalized key, checked to be of the right kind and not twice in one init call.

        A key initialized already passes: `check_same` then says whether the
        new init is identical (a no-op) or not (DuplicateKey).

        Args:
            key: the key to check.
            seen: keys already accepted in the same init call; key is added.

        Raises:
            KeyTypeError, DuplicateKey (key twice in the same call).
        """
        self.check_type(key)
        key = self.normalize(key)
        if key in seen:
            raise errors.DuplicateKey(f"key {key!r} is given twice")
        seen.add(key)
        return key

    def check_same(self, info: KeyInfo) -> bool:
        """True if info's key is initialized already, exactly as info says (init is a no-op).

        Raises:
            DuplicateKey: the key is initialized with another kind, shape,
                dim or configuration.
        """
        known = self._infos.get(info.key)
        if known is None:
            return False
        if known != info:
            raise errors.DuplicateKey(f"key {info.key!r} is already initialized differently")
        return True

    def info(self, key) -> KeyInfo:
        """The KeyInfo of an initialized key.

        Raises:
            KeyTypeError: key is not int or str, or not of this store's kind.
            UnknownKey: the key is not initialized.
        """
        self.check_type(key)
        info = self._infos.get(self.normalize(key))
        if info is None:
            raise errors.UnknownKey(f"key {key!r} is not initialized; call kv.init first")
        return info

    def __contains__(self, key) -> bool:
        return self.normalize(key) in self._infos

    def infos(self) -> list:
        """Every KeyInfo, in init order."""
        return list(self._infos.values())

    def names(self) -> dict:
        """{the name a shard gives a table (str(key)): key}."""
        return {str(key): key for key in self._infos}

    @staticmethod
    def sparse_info(key, table: SparseTable, num_shards: int) -> tuple:
        """(KeyInfo, the spec a backend gets) of sparse table `table` under normalized `key`.

        Raises:
            InvalidArgument: a RangePartitioner without num_shards - 1 boundaries.
        """
        if table.partitioner is not None and len(table.partitioner.boundaries) != num_shards - 1:
            raise errors.InvalidArgument(
                f"key {key!r}: a RangePartitioner needs {num_shards - 1} "
                f"boundaries for {num_shards} servers"
            )
        spec = table.to_dict()
        # The wire dtype is the workers' concern: servers hold float32 whatever it is.
        spec.pop("wire_dtype", None)
        info = KeyInfo(
            key,
            table_id_of(key),
            True,
            dim=table.dim,
            boundaries=spec["boundaries"],
            nonfinite=table.nonfinite,
            own_optimizer=table.optimizer is not None,
            wire_dtype=table.wire_dtype,
            dtype=table.dtype,
        )
        return info, spec

    @staticmethod
    def dense_info(key, shape: tuple, dtype: str = "float32") -> KeyInfo:
        """The KeyInfo of a dense key of this shape and storage dtype under normalized `key`."""
        return KeyInfo(key, table_id_of(key), False, shape=tuple(shape), dtype=dtype)

    def add(self, info: KeyInfo) -> None:
        """Registers an initialized key; the first one fixes the store's key kind."""
        self._infos[info.key] = info
        if self._key_type is None:
            self._key_type = str if isinstance(info.key, str) else int

    def replace(self, infos) -> None:
        """Forgets every key, then registers infos (a checkpoint's keys)."""
        # Built aside, then swapped in: a reader in another thread sees the old keys or
        # the new ones, never an empty registry.
        replacement, key_type = {}, None
        for info in infos:
            replacement[info.key] = info
            key_type = str if isinstance(info.key, str) else int
        self._infos, self._key_type = replacement, key_type


__all__ = ["KeyInfo", "KeyRegistry"]
