"""Cost of admission and eviction on one shard's table.

Fills a table to max_rows, then pushes batches of new ids so that every push
evicts a batch (LFU and LRU), and times TTL sweeps and the per-row metadata
memory. Prints one JSON line.

    PYTHONPATH=. python benchmarks/admission_eviction.py --rows 1000000 --batch 10000

Result on the 2-core dev box (1M rows, dim 16, Adagrad, batches of 10k):
163 B/row plain, 167 with one metadata field (LRU or TTL), 171 with two
(LFU + TTL); a push of 10k ids that all need eviction 48 ms (LRU) / 78 ms
(LFU) against 7 ms for a plain push (the victim selection scans the shard);
a full TTL sweep 18 ms; about 60 B per admission candidate.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvsparse import _core


def _table(dim, policy):
    return _core.Table(dim, {"kind": "zeros"}, {"kind": "adagrad"}, 0, policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--pushes", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    fill = np.arange(args.rows, dtype=np.int64)
    grads = np.ones((args.batch, args.dim), np.float32)
    result = {"rows": args.rows, "batch": args.batch, "dim": args.dim}

    plain = _table(args.dim, None)
    for start in range(0, args.rows, args.batch):
        plain.apply_gradients(
            fill[start : start + args.batch], grads[: fill[start : start + args.batch].size]
        )
    result["bytes_per_row_plain"] = plain.memory_bytes() / args.rows
    start = time.perf_counter()
    for _ in range(args.pushes):
        keys = rng.integers(0, args.rows, args.batch)
        plain.apply_gradients(keys, grads)
    result["push_ms_plain"] = 1e3 * (time.perf_counter() - start) / args.pushes

    for eviction in ("lfu", "lru"):
        table = _table(args.dim, {"max_rows": args.rows, "eviction": eviction, "ttl_steps": 10**6})
        for start in range(0, args.rows, args.batch):
            keys = fill[start : start + args.batch]
            table.apply_gradients(keys, grads[: keys.size])
        result[f"bytes_per_row_{eviction}_ttl"] = table.memory_bytes() / args.rows
        start = time.perf_counter()
        for i in range(args.pushes):
            keys = np.arange(args.batch, dtype=np.int64) + args.rows * (i + 2)
            table.apply_gradients(keys, grads)  # all new: evicts `batch` rows
        result[f"push_ms_evicting_{eviction}"] = 1e3 * (time.perf_counter() - start) / args.pushes
        assert len(table) == args.rows
        start = time.perf_counter()
        table.evict_expired()
        result["ttl_sweep_ms"] = 1e3 * (time.perf_counter() - start)

    candidates = _table(args.dim, {"min_count": 2})
    before = candidates.memory_bytes()
    candidates.apply_gradients(fill[: args.batch], grads)
    result["bytes_per_candidate"] = (candidates.memory_bytes() - before) / args.batch
    print(json.dumps(result))


if __name__ == "__main__":
    main()
