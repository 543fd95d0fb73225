"""Benchmark of one kvsparse table against the in-process NumPy limit.

For 100k-key batches at dims 8 and 64 it times:
- lookup of existing keys        vs np.take(dense, known_indices, axis=0)
- lookup_or_insert of new keys   (no NumPy equivalent: NumPy cannot grow)
- apply_gradients with Adagrad   vs the fancy-index Adagrad update on a dense
                                   array with the (unique) indices known
and the table's memory against the raw bytes of its content (keys + values +
Adagrad slot). Ratios > 1 mean kvsparse is faster.

Initialization (FillInitialRow was once 65% of a server's time): the rows/s
of a Normal(0, 0.01) initializer (Table.initial_values) against a memset of
the same bytes (ndarray.fill(0) of a preallocated array: the write bandwidth
limit) and NumPy's float32 standard_normal of the same count; and a pull of
unseen ids followed by the push of the same ids (fresh ids on a warm table
each time). A bounded cache of the rows a pull generated, for the push to
copy instead of generating again, was measured with this script at commit
e31a12e and removed: it did not pay (0.61x at dim 8, 0.62x at dim 64, 1.15x
at dim 256, one thread).

Threads: the core uses KVSPARSE_NUM_THREADS (default: the cores); run with
KVSPARSE_NUM_THREADS=1 for the single-thread figures.

Run: python benchmarks/table_bench.py [--rows 1000000] [--batch 100000] [--repeat 7]
Writes benchmarks/results/table_bench.json.

Half-precision tables: ``--half-only`` times, for each dim, with no
optimizer and with Adagrad, tables of float32 / float16 / bfloat16 values
and float32 or 16-bit slots: their bytes (memory_bytes without push scratch)
against the float32 table's, and lookup / apply_gradients rates beside the
float32 table's, the same ids and gradients for each. Writes
benchmarks/results/table_bench_half.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from kvsparse import _core


def best_time(fn, repeat: int) -> float:
    """Best of `repeat` runs (the least disturbed by a noisy machine)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def numpy_adagrad(weights, accum, indices, grads, lr=0.1, eps=1e-10):
    accum[indices] += grads * grads
    weights[indices] -= lr * grads / (np.sqrt(accum[indices]) + eps)


def bench_dim(dim: int, rows: int, batch: int, repeat: int, rng) -> dict:
    # Random int64 ids spread over the whole range: what hashed features look like.
    keys = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=rows, dtype=np.int64)
    keys = np.unique(keys)
    rows = keys.size
    table = _core.Table(
        dim,
        {"kind": "uniform", "a": -0.05, "b": 0.05},
        {"kind": "adagrad", "learning_rate": 0.1, "epsilon": 1e-10},
        seed=1,
    )
    insert_out = np.empty((batch, dim), np.float32)
    for start in range(0, rows, batch):
        part = keys[start : start + batch]
        table.lookup_or_insert(part, insert_out[: part.size])
    dense = np.ascontiguousarray(table.lookup(keys))  # the same rows, as a dense array
    accum = np.zeros_like(dense)

    pick = rng.choice(rows, size=batch, replace=False)
    batch_keys = np.ascontiguousarray(keys[pick])
    out = np.empty((batch, dim), np.float32)
    grads = rng.standard_normal((batch, dim)).astype(np.float32)

    t_take = best_time(lambda: np.take(dense, pick, axis=0, out=out), repeat)
    t_lookup = best_time(lambda: table.lookup(batch_keys, out), repeat)
    t_np_adagrad = best_time(lambda: numpy_adagrad(dense, accum, pick, grads), repeat)
    t_apply = best_time(lambda: table.apply_gradients(batch_keys, grads), repeat)

    # New keys: a fresh table each run, so every key is an insert.
    new_keys = rng.integers(
        np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=batch, dtype=np.int64
    )

    def insert_new():
        fresh = _core.Table(
            dim,
            {"kind": "uniform", "a": -0.05, "b": 0.05},
            {"kind": "adagrad", "learning_rate": 0.1},
            seed=1,
        )
        fresh.lookup_or_insert(new_keys, out)

    t_insert = best_time(insert_new, repeat)
    raw_bytes = rows * (8 + dim * 4 * (1 + table.num_slots))
    return {
        "dim": dim,
        "rows": rows,
        "batch": batch,
        "seconds": {
            "np_take": t_take,
            "lookup_existing": t_lookup,
            "numpy_adagrad": t_np_adagrad,
            "apply_gradients_adagrad": t_apply,
            "lookup_or_insert_new": t_insert,
        },
        "keys_per_second": {
            "np_take": batch / t_take,
            "lookup_existing": batch / t_lookup,
            "numpy_adagrad": batch / t_np_adagrad,
            "apply_gradients_adagrad": batch / t_apply,
            "lookup_or_insert_new": batch / t_insert,
        },
        "ratios": {
            "lookup_vs_np_take": t_take / t_lookup,
            "adagrad_vs_numpy": t_np_adagrad / t_apply,
            # The table's state; the push scratch it keeps is reported apart.
            "memory_vs_raw": (table.memory_bytes() - table.scratch_bytes()) / raw_bytes,
        },
        "memory_bytes": table.memory_bytes() - table.scratch_bytes(),
        "push_scratch_bytes": table.scratch_bytes(),
        "raw_bytes": raw_bytes,
    }


def bench_init(dim: int, batch: int, repeat: int, rng) -> dict:
    """Normal(0, 0.01) initialization vs memset and NumPy's standard_normal."""
    keys = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=batch, dtype=np.int64)
    table = _core.Table(dim, {"kind": "normal", "a": 0.0, "b": 0.01}, seed=1)
    out = np.empty((batch, dim), np.float32)
    numpy_rng = np.random.default_rng(1)
    flat = out.reshape(-1)
    t_init = best_time(lambda: table.initial_values(keys, out), repeat)
    t_memset = best_time(lambda: flat.fill(0.0), repeat)
    t_numpy = best_time(
        lambda: numpy_rng.standard_normal(flat.size, dtype=np.float32, out=flat), repeat
    )
    return {
        "dim": dim,
        "rows": batch,
        "seconds": {"normal_init": t_init, "memset": t_memset, "numpy_standard_normal": t_numpy},
        "rows_per_second": {
            "normal_init": batch / t_init,
            "memset": batch / t_memset,
            "numpy_standard_normal": batch / t_numpy,
        },
        "ratios": {"init_vs_memset": t_memset / t_init, "init_vs_numpy": t_numpy / t_init},
    }


def bench_pull_push(dim: int, batch: int, repeat: int, rng) -> float:
    """Best seconds of lookup(unseen ids) + apply_gradients(same ids) on a warm table."""
    table = _core.Table(
        dim,
        {"kind": "normal", "a": 0.0, "b": 0.01},
        {"kind": "adagrad", "learning_rate": 0.1},
        seed=1,
    )
    out = np.empty((batch, dim), np.float32)
    grads = rng.standard_normal((batch, dim)).astype(np.float32)
    best = float("inf")
    for attempt in range(repeat + 1):
        keys = rng.integers(
            np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=batch, dtype=np.int64
        )
        table.reserve(len(table) + batch)  # growth is not what this measures
        start = time.perf_counter()
        table.lookup(keys, out)
        table.apply_gradients(keys, grads)
        if attempt > 0:  # the first one warms the allocations
            best = min(best, time.perf_counter() - start)
    return best


# (value dtype, slot dtype) of the --half-only tables; the first is the baseline.
HALF_CONFIGS = [
    ("float32", "float32"),
    ("float16", "float32"),
    ("bfloat16", "float32"),
    ("float16", "bfloat16"),
    ("bfloat16", "bfloat16"),
]


def bench_half(dim: int, rows: int, batch: int, repeat: int, optimizer, rng) -> list:
    """One row per HALF_CONFIGS entry: bytes and rates of a table of `rows` random ids."""
    keys = np.unique(
        rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=rows, dtype=np.int64)
    )
    pick = rng.choice(keys.size, size=batch, replace=False)
    batch_keys = np.ascontiguousarray(keys[pick])
    grads = rng.standard_normal((batch, dim)).astype(np.float32) * 0.01
    out = np.empty((batch, dim), np.float32)
    results = []
    for dtype, slot_dtype in HALF_CONFIGS:
        if optimizer is None and slot_dtype != "float32":
            continue  # no slots
        table = _core.Table(
            dim,
            {"kind": "uniform", "a": -0.05, "b": 0.05},
            optimizer,
            seed=1,
            dtype=dtype,
            slot_dtype=slot_dtype,
        )
        scratch = np.empty((batch, dim), np.float32)
        for start in range(0, keys.size, batch):
            part = keys[start : start + batch]
            table.lookup_or_insert(part, scratch[: part.size])
        t_lookup = best_time(lambda t=table: t.lookup(batch_keys, out), repeat)
        t_apply = best_time(lambda t=table: t.apply_gradients(batch_keys, grads), repeat)
        results.append(
            {
                "dim": dim,
                "optimizer": None if optimizer is None else optimizer["kind"],
                "dtype": dtype,
                "slot_dtype": slot_dtype,
                "rows": int(keys.size),
                "table_bytes": table.memory_bytes() - table.scratch_bytes(),
                "lookup_keys_per_second": batch / t_lookup,
                "apply_keys_per_second": batch / t_apply,
            }
        )
        del table
    base = results[0]
    for r in results:
        r["bytes_vs_float32"] = r["table_bytes"] / base["table_bytes"]
        r["lookup_vs_float32"] = r["lookup_keys_per_second"] / base["lookup_keys_per_second"]
        r["apply_vs_float32"] = r["apply_keys_per_second"] / base["apply_keys_per_second"]
    return results


def main_half(args) -> list:
    rng = np.random.default_rng(0)
    adagrad = {"kind": "adagrad", "learning_rate": 0.1, "epsilon": 1e-10}
    results = []
    for dim in args.dims:
        for optimizer in (None, adagrad):
            results += bench_half(dim, args.rows, args.batch, args.repeat, optimizer, rng)
    print(
        f"{'dim':>4} {'optimizer':<9} {'values':<9} {'slots':<9} {'MiB':>8} {'bytes/f32':>9} "
        f"{'lookup Mk/s':>11} {'vs f32':>7} {'apply Mk/s':>10} {'vs f32':>7}"
    )
    for r in results:
        print(
            f"{r['dim']:>4} {str(r['optimizer']):<9} {r['dtype']:<9} {r['slot_dtype']:<9} "
            f"{r['table_bytes'] / 2**20:>8.1f} {r['bytes_vs_float32']:>8.3f}x "
            f"{r['lookup_keys_per_second'] / 1e6:>11.2f} {r['lookup_vs_float32']:>6.2f}x "
            f"{r['apply_keys_per_second'] / 1e6:>10.2f} {r['apply_vs_float32']:>6.2f}x"
        )
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "table_bench_half.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "threads": os.environ.get("KVSPARSE_NUM_THREADS", "all cores"),
                "rows": args.rows,
                "batch": args.batch,
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {out}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--half-only",
        action="store_true",
        help="only the half-precision tables against float32",
    )
    args = parser.parse_args(argv)
    if args.half_only:
        return main_half(args)
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", "table_bench.json")
    rng = np.random.default_rng(0)
    results = [bench_dim(d, args.rows, args.batch, args.repeat, rng) for d in args.dims]
    init = [bench_init(d, args.batch, args.repeat, rng) for d in args.dims]
    pull_push = []
    for d in args.dims:
        seconds = bench_pull_push(d, args.batch, args.repeat, rng)
        pull_push.append(
            {
                "dim": d,
                "rows": args.batch,
                "seconds": seconds,
                "keys_per_second": args.batch / seconds,
            }
        )

    print(f"{'dim':>4} {'metric':<28} {'kvsparse Mkeys/s':>17} {'numpy Mkeys/s':>14} {'ratio':>7}")
    for r in results:
        k = r["keys_per_second"]
        print(
            f"{r['dim']:>4} {'lookup existing / np.take':<28} {k['lookup_existing'] / 1e6:>17.1f} "
            f"{k['np_take'] / 1e6:>14.1f} {r['ratios']['lookup_vs_np_take']:>6.2f}x"
        )
        print(
            f"{r['dim']:>4} {'Adagrad apply / numpy':<28} "
            f"{k['apply_gradients_adagrad'] / 1e6:>17.1f} {k['numpy_adagrad'] / 1e6:>14.1f} "
            f"{r['ratios']['adagrad_vs_numpy']:>6.2f}x"
        )
        print(
            f"{r['dim']:>4} {'lookup_or_insert new keys':<28} "
            f"{k['lookup_or_insert_new'] / 1e6:>17.1f} {'-':>14} {'':>7}"
        )
        print(
            f"{r['dim']:>4} {'memory / raw bytes':<28} {r['memory_bytes'] / 2**20:>14.1f}MiB "
            f"{r['raw_bytes'] / 2**20:>11.1f}MiB {r['ratios']['memory_vs_raw']:>6.2f}x"
        )
    print(f"{'dim':>4} {'rows/s (M)':<28} {'Normal init':>12} {'memset':>9} {'numpy':>9}")
    for r in init:
        k = r["rows_per_second"]
        print(
            f"{r['dim']:>4} {'':<28} {k['normal_init'] / 1e6:>12.2f} {k['memset'] / 1e6:>9.1f} "
            f"{k['numpy_standard_normal'] / 1e6:>9.2f}   init/memset "
            f"{r['ratios']['init_vs_memset']:.3f}x, init/numpy {r['ratios']['init_vs_numpy']:.2f}x"
        )
    for r in pull_push:
        print(
            f"{r['dim']:>4} {'pull unseen + push (Adagrad)':<28} "
            f"{r['keys_per_second'] / 1e6:>17.2f} {'-':>14}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "threads": os.environ.get("KVSPARSE_NUM_THREADS", "all cores"),
                "results": results,
                "normal_init": init,
                "pull_push": pull_push,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
