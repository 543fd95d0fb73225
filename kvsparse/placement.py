"""Where a key's data lives: its wire id, and which slice of a dense array each shard holds.

Every worker and every server computes these the same way, so they agree on
placement without asking each other. A sparse id's shard is chosen in C++
(`_core.plan_batch`: a fixed 64-bit mix of the id modulo the shard count).

Safe to call from any thread (pure functions).

Example:
    >>> dense_ranges(10, 3)
    [(0, 3), (3, 6), (6, 10)]
"""

from __future__ import annotations

import hashlib


def table_id_of(key) -> int:
    """The 64-bit wire id of a key: a fixed hash, so every worker agrees on it."""
    text = ("s:" if isinstance(key, str) else "i:") + str(key)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def dense_ranges(size: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of a flat dense array, one per shard (TensorNet)."""
    return [(s * size // num_shards, (s + 1) * size // num_shards) for s in range(num_shards)]
