"""The inference export: one NumPy ``.npz`` per shard with the keys and values of sparse tables.

``KVStore.export(path)`` makes each shard write ``part-{i:05d}-of-{n:05d}.npz``
(`part_name`): for the j-th table, ``t{j}_keys`` (int64, sorted ascending,
unique) and ``t{j}_values`` (rows x dim, in the table's dtype: float32,
float16, or bfloat16 as uint16 bit patterns), and ``meta``, UTF-8 JSON as a
uint8 array: ``{"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
"export_id", "part", "num_parts", "tables": [{"name", "dim", "dtype", "spec"}]}``.
`kvsparse.serving.EmbeddingLookup` reads it (versions 1 and 2). Optimizer
slots are not exported.

Version 2 (issue 12): tables record their "dtype" and 16-bit tables' values
are stored in it; version 1 had float32 values and no dtype.
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
EXPORT_VERSION = 2
# Versions EmbeddingLookup reads.
READABLE_EXPORT_VERSIONS = (1, 2)
# The name part_name gives; group 1 is the part, group 2 the number of parts.
PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.npz$")


def part_name(part: int, num_parts: int) -> str:
    """The file name of export part `part` of `num_parts`."""
    return f"part-{part:05d}-of-{num_parts:05d}.npz"


def export_shard(state: ShardState, path, shard_index, num_shards, table_ids, export_id) -> dict:
    """Writes this shard's export part into path: keys and values of the chosen sparse tables.

    Not thread-safe: the state must not change while this runs (a server's
    forked writer, or the local store's caller).

    Args:
        state: this shard.
        path: the export directory (created if missing).
        shard_index, num_shards: this shard's place; the part's number and count.
        table_ids: the sparse tables to export, in order (t0, t1, ...).
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
    for position, table_id in enumerate(table_ids):
        entry = state.sparse_entry(int(table_id))
        chunks = list(entry.table.iter_chunks(BLOCK_ROWS))
        keys = np.concatenate([c[0] for c in chunks]) if chunks else np.empty(0, np.int64)
        values = (
            np.concatenate([c[1] for c in chunks])
            if chunks
            else np.empty((0, entry.table.dim), np.float32)
        )
        order = np.argsort(keys, kind="stable")
        arrays[f"t{position}_keys"] = keys[order]
        dtype = entry.table.dtype
        values = values[order]
        if dtype == "float16":
            values = _core.narrow(values, dtype).view(np.float16)
        elif dtype == "bfloat16":  # bit patterns: .npz readers need no ml_dtypes
            values = _core.narrow(values, dtype)
        arrays[f"t{position}_values"] = values
        meta["tables"].append(
            {"name": entry.name, "dim": entry.table.dim, "dtype": dtype, "spec": entry.spec}
        )
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    final = os.path.join(path, part_name(shard_index, num_shards))
    with AtomicFile(final, suffix=".npz") as f:
        np.savez(f, **arrays)
    rows = sum(int(a.shape[0]) for k, a in arrays.items() if k.endswith("_keys"))
    return {"file": os.path.basename(final), "rows": rows}
