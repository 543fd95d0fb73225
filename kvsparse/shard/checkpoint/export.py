"""The inference export: one NumPy ``.npz`` per shard with the keys and values of sparse tables.

``KVStore.export(path)`` makes each shard write ``part-{i:05d}-of-{n:05d}.npz``
(`part_name`): for each table, ``{name}_keys`` (int64, sorted ascending,
unique) and ``{name}_values`` (rows x dim, in the table's dtype: float32,
float16, or bfloat16 as uint16 bit patterns), named by the table's name, and
``meta``, UTF-8 JSON as a uint8 array: ``{"format": EXPORT_FORMAT, "version":
EXPORT_VERSION, "export_id", "part", "num_parts", "tables": [{"name", "dim",
"dtype", "spec", "keys", "values"}]}`` ("keys" and "values" name the table's
arrays). `kvsparse.serving.EmbeddingLookup` reads it (versions 1 to 3;
`array_names`). Optimizer slots are not exported.

Version 3: arrays named by the table (``user_keys``); versions 1 and 2 named
them by position (``t0_keys``). Version 2: tables record their "dtype" and
16-bit tables' values are stored in it; version 1 had float32 values and no
dtype.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from kvsparse import _core
from kvsparse.shard.checkpoint.files import AtomicFile
from kvsparse.shard.checkpoint.format import BLOCK_ROWS
from kvsparse.shard.state import ShardState

EXPORT_FORMAT = "kvsparse-export"
EXPORT_VERSION = 3
# Versions EmbeddingLookup reads.
READABLE_EXPORT_VERSIONS = (1, 2, 3)
# The name part_name gives; group 1 is the part, group 2 the number of parts.
PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.npz$")


def part_name(part: int, num_parts: int) -> str:
    """The file name of export part `part` of `num_parts`."""
    return f"part-{part:05d}-of-{num_parts:05d}.npz"


def array_names(table: dict, position: int) -> tuple:
    """(keys array, values array) of a table of an export part's meta, at position in it.

    Version 3 names them in the meta (by the table's name); older parts by position.

    Example:
        >>> array_names({"name": "user", "keys": "user_keys", "values": "user_values"}, 0)
        ('user_keys', 'user_values')
        >>> array_names({"name": "user"}, 1)
        ('t1_keys', 't1_values')
    """
    return (
        str(table.get("keys", f"t{position}_keys")),
        str(table.get("values", f"t{position}_values")),
    )


def export_shard(state: ShardState, path, shard_index, num_shards, table_ids, export_id) -> dict:
    """Writes this shard's export part into path: keys and values of the chosen sparse tables.

    Not thread-safe: the state must not change while this runs (a server's
    forked writer, or the local store's caller).

    Args:
        state: this shard.
        path: the export directory (created if missing).
        shard_index, num_shards: this shard's place; the part's number and count.
        table_ids: the sparse tables to export, in order.
        export_id: the same for every part of one export.

    Returns:
        {"file": the part's name, "rows": rows written}.

    Example:
        >>> export_shard(state, "/serve/emb", 0, 2, [table_id], "a1b2")  # doctest: +SKIP
        {'file': 'part-00000-of-00002.npz', 'rows': 1000}
    """
    os.makedirs(path, exist_ok=True)
    arrays, meta = {}, {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "export_id": export_id}
    meta.update({"part": shard_index, "num_parts": num_shards, "tables": []})
    for table_id in table_ids:
        entry = state.sparse_entry(int(table_id))
        keys_name, values_name = f"{entry.name}_keys", f"{entry.name}_values"
        chunks = list(entry.table.iter_chunks(BLOCK_ROWS))
        keys = np.concatenate([c[0] for c in chunks]) if chunks else np.empty(0, np.int64)
        values = (
            np.concatenate([c[1] for c in chunks])
            if chunks
            else np.empty((0, entry.table.dim), np.float32)
        )
        order = np.argsort(keys, kind="stable")
        arrays[keys_name] = keys[order]
        dtype = entry.table.dtype
        values = values[order]
        if dtype == "float16":
            values = _core.narrow(values, dtype).view(np.float16)
        elif dtype == "bfloat16":  # bit patterns: .npz readers need no ml_dtypes
            values = _core.narrow(values, dtype)
        arrays[values_name] = values
        meta["tables"].append(
            {
                "name": entry.name,
                "dim": entry.table.dim,
                "dtype": dtype,
                "spec": entry.spec,
                "keys": keys_name,
                "values": values_name,
            }
        )
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    final = os.path.join(path, part_name(shard_index, num_shards))
    with AtomicFile(final, suffix=".npz") as f:
        np.savez(f, **arrays)
    rows = sum(int(arrays[table["keys"]].shape[0]) for table in meta["tables"])
    return {"file": os.path.basename(final), "rows": rows}
