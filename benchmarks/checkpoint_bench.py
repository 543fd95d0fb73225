"""Checkpoint save and load throughput against writing/reading the same bytes with NumPy.

Workload: one table of 10M rows (any int64 ids), dim 16, float32, no optimizer
(values only: 8 + 64 + 8 bytes a row in the file), on 2 `kvsparse server`
processes on loopback, 1 worker. Timed:

- save:  ``kv.save(dir)`` (each server forks and writes its shard file with
         checksums, fsync, rename; server 0 writes the manifest).
- load:  ``kv.load(dir)`` onto 2 fresh servers (read, checksum, insert).
- numpy_tofile: the same number of bytes written with ``ndarray.tofile``
  into one file, then fsync (the save's durability); also without fsync.
- numpy_fromfile: those bytes read back with ``np.fromfile`` (page cache warm,
  like the load's).

Ratios: save / numpy_tofile+fsync and load / numpy_fromfile (MB/s over MB/s;
target >= 0.5). Each is run --repeat times (default 2) and the best time counts
(the machine may be shared). Note the servers write their halves in parallel
on 2 cores while NumPy writes one file from one process.

Usage:
    python benchmarks/checkpoint_bench.py               # 10M rows
    python benchmarks/checkpoint_bench.py --rows 1000000

Writes benchmarks/results/checkpoint_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kvsparse  # noqa: E402
from kvsparse.server.listening import parse_listening_line, read_first_line  # noqa: E402

SERVER_START_SECONDS = 60


def start_servers(n):
    processes, addresses = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(n):
        process = subprocess.Popen(
            [sys.executable, "-m", "kvsparse.server", "--bind", "tcp://127.0.0.1:0"],
            stdout=subprocess.PIPE,
            env=env,
        )
        processes.append(process)
        line = read_first_line(process.stdout, time.monotonic() + SERVER_START_SECONDS)
        address = parse_listening_line(line)
        if address is None:  # the caller never sees these processes: stopped here
            stop_servers(processes)
            raise RuntimeError(f"server did not start: {line!r}")
        addresses.append(address)
    return processes, addresses


def stop_servers(processes):
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def fill(kv, rows, dim, batch=1 << 20):
    rng = np.random.default_rng(0)
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        ids = np.arange(start, start + n, dtype=np.int64) * 2654435761  # spread, any int64
        kv.push("emb", (ids, rng.standard_normal((n, dim), np.float32)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each; the best counts")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_bench.json")
    )
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="kvsparse-ckpt-bench-"))
    processes = []
    try:
        processes, addresses = start_servers(args.servers)
        kv = kvsparse.create("dist_sparse", servers=addresses, timeout=600)
        kv.init("emb", kvsparse.SparseTable(dim=args.dim))
        t = time.perf_counter()
        fill(kv, args.rows, args.dim)
        fill_seconds = time.perf_counter() - t
        probe = np.arange(0, args.rows, max(1, args.rows // 1000), dtype=np.int64) * 2654435761
        expected = kv.row_sparse_pull("emb", row_ids=probe)

        save_runs = []
        for _ in range(args.repeat):  # full saves each time (checkpoints 1, 2, ...)
            t = time.perf_counter()
            kv.save(workdir / "ckpt")
            save_runs.append(time.perf_counter() - t)
        save_seconds = min(save_runs)
        file_bytes = sum(
            f.stat().st_size
            for f in (workdir / "ckpt").iterdir()
            if f.name.startswith("ckpt-000001.") and f.suffix == ".kvs"
        )
        kv.close()
        stop_servers(processes)

        processes, addresses = start_servers(args.servers)
        kv = kvsparse.create("dist_sparse", servers=addresses, timeout=600)
        load_runs = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            kv.load(workdir / "ckpt")
            load_runs.append(time.perf_counter() - t)
        load_seconds = min(load_runs)
        if not np.array_equal(kv.row_sparse_pull("emb", row_ids=probe), expected):
            raise AssertionError("the loaded table differs from the saved one")
        kv.close()
        stop_servers(processes)
        processes = []

        shutil.rmtree(workdir / "ckpt")
        raw = np.random.default_rng(1).integers(0, 255, file_bytes, dtype=np.uint8)
        tofile_runs, fsync_runs, fromfile_runs = [], [], []
        for run in range(args.repeat):
            target = workdir / f"numpy-{run}.bin"
            t = time.perf_counter()
            raw.tofile(target)
            tofile_runs.append(time.perf_counter() - t)
            fd = os.open(target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            fsync_runs.append(time.perf_counter() - t)
            t = time.perf_counter()
            back = np.fromfile(target, np.uint8)
            fromfile_runs.append(time.perf_counter() - t)
            assert back.size == file_bytes
            del back
            os.unlink(target)
        tofile_seconds, tofile_fsync_seconds = min(tofile_runs), min(fsync_runs)
        fromfile_seconds = min(fromfile_runs)
        del raw

        mb = file_bytes / 1e6
        result = {
            "workload": {
                "rows": args.rows,
                "dim": args.dim,
                "servers": args.servers,
                "optimizer": None,
                "file_bytes": file_bytes,
            },
            "fill_seconds": fill_seconds,
            "runs_seconds": {
                "save": save_runs,
                "load": load_runs,
                "numpy_tofile": tofile_runs,
                "numpy_tofile_fsync": fsync_runs,
                "numpy_fromfile": fromfile_runs,
            },
            "save": {
                "seconds": save_seconds,
                "rows_per_second": args.rows / save_seconds,
                "mb_per_second": mb / save_seconds,
            },
            "load": {
                "seconds": load_seconds,
                "rows_per_second": args.rows / load_seconds,
                "mb_per_second": mb / load_seconds,
            },
            "numpy_tofile": {"seconds": tofile_seconds, "mb_per_second": mb / tofile_seconds},
            "numpy_tofile_fsync": {
                "seconds": tofile_fsync_seconds,
                "mb_per_second": mb / tofile_fsync_seconds,
            },
            "numpy_fromfile": {
                "seconds": fromfile_seconds,
                "mb_per_second": mb / fromfile_seconds,
            },
            "ratio_save_vs_tofile_fsync": tofile_fsync_seconds / save_seconds,
            "ratio_save_vs_tofile": tofile_seconds / save_seconds,
            "ratio_load_vs_fromfile": fromfile_seconds / load_seconds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        }
        print(f"{'':24}{'seconds':>10}{'rows/s':>14}{'MB/s':>10}")
        for name in ("save", "load", "numpy_tofile", "numpy_tofile_fsync", "numpy_fromfile"):
            entry = result[name]
            rows = entry.get("rows_per_second")
            rows_text = f"{rows:14,.0f}" if rows else f"{'':14}"
            print(f"{name:24}{entry['seconds']:10.2f}{rows_text}{entry['mb_per_second']:10.0f}")
        print(
            f"save / tofile+fsync: {result['ratio_save_vs_tofile_fsync']:.2f}x   "
            f"save / tofile: {result['ratio_save_vs_tofile']:.2f}x   "
            f"load / fromfile: {result['ratio_load_vs_fromfile']:.2f}x"
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        stop_servers(processes)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
