"""Checkpoints of a tiered table: bytes a full save writes, and restore time against fill time.

Run as `python benchmarks/tiered.py checkpoint [options]` (benchmarks/tiered.py holds the
server helpers).

One `kvsparse server --memory-budget BUDGET --spill-dir DIR` holds one dim-16 float32
table (Normal(0, 0.01) init, Adagrad by default: the issue's DLRM width) filled with
--ratio x the budget of rows (values + optimizer state, as the issue sizes a table) in
blocks of --batch new ids, each pushed once with a random gradient (fill_s, timed). Then:

- save: a full checkpoint (`kv.save`) into --checkpoint-root (the spill directory's file
  system: the rows on disk are linked). bytes_written = the bytes the save created: the
  shard file, every MANIFEST, and any run file that is not a hard link (st_nlink 1: a
  copy); linked_bytes = the run files linked. Target: bytes_written <= 15% of the
  table's bytes.
- by value, for comparison (--by-value): the same save into a directory on another file
  system (/dev/shm), where nothing can be linked: every row is written, as before the
  checkpoints by reference.
- restore: a fresh server with the same budget and a spill directory loads the
  checkpoint (`kv.load`; the server adopts the linked files); restore_s against fill_s
  (target: <= 2x). --verify random ids pulled from the original right after its save and
  from the restored server right after its load must agree; the restored server's tier
  counters say how many rows it read back (rows_read).
- zipf: --zipf-steps pull + push steps of Zipf(1.1) ids on the restored server after the
  restore, against the same steps on the original (steps/s ratio): the restored tier works.

Usage:
    python benchmarks/tiered.py checkpoint                     # 48 MiB x 30, dim 16 Adagrad
    python benchmarks/tiered.py checkpoint --budget 8MiB --ratio 10 --batch 4096  # smoke

Writes benchmarks/results/tiered_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import tiered  # benchmarks/ is on sys.path: this module runs under tiered.py

import kvsparse

TABLE = tiered.TABLE
SLOTS = {"sgd": 0, "adagrad": 1}
BYTES_TARGET = 0.15
RESTORE_TARGET = 2.0


def optimizer_of(name: str):
    return kvsparse.optimizers.create(name, learning_rate=0.05)


def checkpoint_bytes(path: str, seq: int) -> dict:
    """What checkpoint seq's files in path hold: created (not linked) and linked bytes."""
    prefix = f"ckpt-{seq:06d}."
    written = linked = files = 0
    for root, _, names in os.walk(path):
        top = os.path.relpath(root, path).split(os.sep)[0]
        for name in names:
            if not (top.startswith(prefix) or (top == "." and name.startswith(prefix))):
                continue
            info = os.stat(os.path.join(root, name))
            files += 1
            if name.startswith("run-") and info.st_nlink > 1:
                linked += info.st_size
            else:
                written += info.st_size
    return {"bytes_written": written, "linked_bytes": linked, "files": files}


def zipf_steps(kv, rows: int, args, dim: int) -> float:
    """steps/s of --zipf-steps pull + push steps of distinct Zipf(1.1) ids."""
    rng = np.random.default_rng(7)
    permutation = np.random.default_rng(1).permutation(rows).astype(np.int64)
    start = time.perf_counter()
    for _ in range(args.zipf_steps):
        ids = np.unique(permutation[(rng.zipf(1.1, args.zipf_batch) - 1) % rows])
        kv.row_sparse_pull(TABLE, row_ids=ids)
        kv.push(TABLE, (ids, np.full((ids.size, dim), 0.01, np.float32)))
    return args.zipf_steps / (time.perf_counter() - start)


def run(args, log_dir: str) -> dict:
    dim, slots = args.dim, SLOTS[args.optimizer]
    row_bytes = dim * 4 * (1 + slots)
    rows = int(args.ratio * args.budget / row_bytes) // args.batch * args.batch
    report: dict = {
        "dim": dim,
        "optimizer": args.optimizer,
        "budget": args.budget,
        "rows": rows,
        "row_bytes": row_bytes,
        "table_bytes": rows * row_bytes,
        "table_over_budget": rows * row_bytes / args.budget,
        "batch": args.batch,
    }
    root = tempfile.mkdtemp(prefix="kvsparse_ckpt_bench_", dir=args.checkpoint_root)
    spills = [tempfile.mkdtemp(prefix="spill_", dir=root) for _ in range(2)]
    path = os.path.join(root, "ckpt")
    make = lambda: kvsparse.SparseTable(  # noqa: E731
        dim=dim, initializer=kvsparse.initializers.Normal(0.0, 0.01), seed=0
    )
    try:
        with tiered.procs.Processes(log_dir) as processes:
            servers = []
            for i, spill in enumerate(spills):
                extra = ["--memory-budget", str(args.budget), "--spill-dir", spill]
                servers.append(tiered.start_server(processes, f"server_{i}", extra, None))
            (a_address, _), (b_address, b_pid) = servers
            with kvsparse.create("dist_sparse", servers=[a_address], rank=0, num_workers=1) as kv:
                kv.init(TABLE, make())
                kv.set_optimizer(optimizer_of(args.optimizer))
                rng = np.random.default_rng(0)
                grads = rng.normal(0, 0.01, (args.batch, dim)).astype(np.float32)
                start = time.perf_counter()
                for begin in range(0, rows, args.batch):
                    kv.push(TABLE, (np.arange(begin, begin + args.batch, dtype=np.int64), grads))
                report["fill_s"] = time.perf_counter() - start
                report["tier_after_fill"] = tiered.tier_counters(tiered.table_stats(kv))
                print(f"  filled {rows:,} rows in {report['fill_s']:.1f} s", flush=True)
                start = time.perf_counter()
                seq = kv.save(path)
                report["save_s"] = time.perf_counter() - start
                report["save"] = checkpoint_bytes(path, seq)
                report["save"]["over_table_bytes"] = report["save"]["bytes_written"] / (
                    rows * row_bytes
                )
                print(f"  save: {report['save']} in {report['save_s']:.1f} s", flush=True)
                probe = np.random.default_rng(3).integers(0, rows, args.verify)
                want = kv.row_sparse_pull(TABLE, row_ids=probe)
                if args.by_value:
                    shm = tempfile.mkdtemp(prefix="kvsparse_ckpt_by_value_", dir="/dev/shm")
                    try:
                        start = time.perf_counter()
                        by_value_seq = kv.save(shm)
                        seconds = time.perf_counter() - start
                        report["save_by_value"] = checkpoint_bytes(shm, by_value_seq)
                        report["save_by_value"]["seconds"] = seconds
                        report["save_by_value"]["over_table_bytes"] = report["save_by_value"][
                            "bytes_written"
                        ] / (rows * row_bytes)
                    finally:
                        shutil.rmtree(shm, ignore_errors=True)
                    print(f"  by value: {report['save_by_value']}", flush=True)
                report["zipf_original_steps_per_s"] = zipf_steps(kv, rows, args, dim)
            with kvsparse.create("dist_sparse", servers=[b_address], rank=0, num_workers=1) as kv:
                start = time.perf_counter()
                kv.load(path)
                report["restore_s"] = time.perf_counter() - start
                tier = tiered.tier_counters(tiered.table_stats(kv))
                report["tier_after_restore"] = tier
                got = kv.row_sparse_pull(TABLE, row_ids=probe)
                report["verified_rows"] = int(args.verify)
                report["restore_over_fill"] = report["restore_s"] / report["fill_s"]
                report["zipf_restored_steps_per_s"] = zipf_steps(kv, rows, args, dim)
                report["restored_rss"] = tiered.vm_rss(b_pid)
            report["verify_mismatches"] = int((want != got).any(axis=1).sum())
            print(
                f"  restore {report['restore_s']:.2f} s ({report['restore_over_fill']:.3f}x the "
                f"fill), mismatches {report['verify_mismatches']}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["targets"] = {
        "bytes_written_le_15pct": report["save"]["over_table_bytes"] <= BYTES_TARGET,
        "restore_le_2x_fill": report["restore_over_fill"] <= RESTORE_TARGET,
        "exact": report["verify_mismatches"] == 0,
    }
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="48MiB")
    parser.add_argument("--ratio", type=float, default=30.0, help="table / budget")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--optimizer", default="adagrad", choices=sorted(SLOTS))
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--verify", type=int, default=20000)
    parser.add_argument("--zipf-steps", type=int, default=20)
    parser.add_argument("--zipf-batch", type=int, default=16384)
    parser.add_argument("--by-value", action="store_true", help="also save to /dev/shm")
    parser.add_argument("--checkpoint-root", default=None, help="default: TMPDIR")
    parser.add_argument(
        "--output", default=os.path.join(tiered.HERE, "results", "tiered_checkpoint.json")
    )
    args = parser.parse_args(argv)
    args.budget = tiered.parse_size(args.budget)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvsparse_ckpt_logs_") as log_dir:
        result = run(args, log_dir)
    report = {
        "benchmark": "tiered_checkpoint",
        "command": " ".join(["python benchmarks/tiered.py checkpoint", *(argv or sys.argv[2:])]),
        "machine": tiered.pull_push.machine(),
        "load_average": os.getloadavg()[0],
        "result": result,
        "total_s": time.monotonic() - started,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(result["targets"]), f"\nwrote {os.path.relpath(args.output)}")
    return 0
