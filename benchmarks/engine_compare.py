"""The disk tier's storage engine against RocksDB, on the same workload.

Candidates (docs/architecture.md, "Disk tier: storage engine", says which
was chosen and why):
- kvsparse's SegmentStore (csrc/segment_store.h): append-only segment files
  of fixed-size CRC32C-checksummed records, an in-RAM index, reads of a batch
  issued together over a thread pool (queue depth --read-threads), garbage
  collection of mostly stale files, --gc-bytes per step at most;
- RocksDB through the `rocksdict` package (pip install rocksdict; not a
  dependency of kvsparse), tuned for point lookups the way Paddle, FBGEMM and
  HugeCTR ship it: no WAL, no compression, a 10-bit bloom filter, 4 KiB
  blocks, a 256 MiB write buffer, multi_get, --rocksdb-cache-mib block cache.

Records: one row of a dim-64 float32 table with Adagrad, as the disk tier
stores it: 64 float32 values + 64 float32 accumulator slots + 8 bytes of
metadata (step, counter) = 520 bytes, keyed by int64 id.

Phases, each engine in turn, the page cache dropped before every read phase
(`echo 3 > /proc/sys/vm/drop_caches` as root; otherwise posix_fadvise
DONTNEED on the engine's files, which leaves RocksDB's block cache warm):
1. load: --rows rows written as write-back batches of --write-batch rows;
2. read: batches of 4,096 and 65,536 ids, uniform and Zipf(1.1) (ranks
   scattered over the ids by a fixed permutation), --read-keys ids each;
3. mixed: what a tiered table does per training step: read a batch of
   --step-keys Zipf(1.1) or uniform ids, write back --step-keys/2 rows
   (overwrites of rows read earlier, as evicted rows go back), and for
   SegmentStore one maintenance(--gc-bytes) call; --steps steps.
Plus this disk's random 4 KiB read limit, measured here: O_DIRECT preads at
queue depth --read-threads over the SegmentStore's files.

Reported: ops/s (records per second), MB/s of record payload, bytes written
to disk per byte updated (write amplification: the engine's own count for
SegmentStore, /proc/self/io write_bytes for both), RAM per key (SegmentStore:
its index; RocksDB: table readers (index + filters) + memtables + block cache).

Run: python benchmarks/engine_compare.py [--rows 4000000] [--dir /work/tmp]
Writes benchmarks/results/engine_compare.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import tempfile
import threading
import time

import numpy as np

from kvsparse import _core

DIM = 64
RECORD_BYTES = DIM * 4 * 2 + 8  # value + Adagrad slot + step/counter


def make_records(keys: np.ndarray, version: int) -> np.ndarray:
    """Records whose bytes depend on key and version (cheap, not compressible by chance)."""
    out = np.empty((len(keys), RECORD_BYTES // 8), dtype=np.int64)
    out[:] = (keys[:, None] * 0x5851F42D4C957F2D + version) ^ np.arange(RECORD_BYTES // 8)
    return out.view(np.uint8)


def zipf_ids(rng: np.random.Generator, count: int, rows: int, permutation: np.ndarray):
    ranks = np.empty(0, dtype=np.int64)
    while len(ranks) < count:
        draw = rng.zipf(1.1, size=count * 2)
        ranks = np.concatenate([ranks, draw[draw <= rows] - 1])
    return permutation[ranks[:count]]


def uniform_ids(rng: np.random.Generator, count: int, rows: int, permutation: np.ndarray):
    return rng.integers(0, rows, size=count, dtype=np.int64)


DISTRIBUTIONS = {"zipf1.1": zipf_ids, "uniform": uniform_ids}


def process_bytes_written() -> int:
    with open("/proc/self/io") as file:
        for line in file:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def drop_page_cache(directory: str) -> str:
    """Empties the page cache of directory's files; returns how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("3\n")
        return "drop_caches"
    except OSError:
        for root, _, names in os.walk(directory):
            for name in names:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise_dontneed"


def directory_bytes(directory: str) -> int:
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            total += os.path.getsize(os.path.join(root, name))
    return total


class SegmentEngine:
    name = "segment_store"

    def __init__(self, directory: str, read_threads: int):
        self.directory = directory
        self.store = _core.SegmentStore(directory, RECORD_BYTES, read_threads=read_threads)

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        self.store.write(keys, records)

    def read(self, keys: np.ndarray) -> int:
        _, found = self.store.read(keys)
        return int(found.sum())

    def maintenance(self, max_bytes: int) -> None:
        self.store.maintenance(max_bytes)

    def finish_writes(self) -> None:
        self.store.sync()

    def settle(self) -> float:
        return 0.0  # garbage collection runs only inside maintenance()

    def engine_bytes(self) -> tuple[int, int]:
        stats = self.store.stats()
        return stats["bytes_written"], stats["bytes_updated"]

    def ram_bytes(self) -> int:
        return self.store.stats()["index_bytes"]

    def close(self) -> None:
        self.store.close()


class RocksEngine:
    name = "rocksdb"

    def __init__(self, directory: str, cache_mib: int):
        import rocksdict

        self.rocksdict = rocksdict
        self.directory = directory
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_compression_type(rocksdict.DBCompressionType.none())
        options.set_write_buffer_size(256 << 20)
        options.set_max_write_buffer_number(4)
        options.set_target_file_size_base(256 << 20)
        options.set_max_bytes_for_level_base(1 << 30)
        options.set_max_background_jobs(4)
        options.set_level_compaction_dynamic_level_bytes(True)
        options.set_max_open_files(-1)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(10, False)
        table.set_block_size(4096)
        table.set_block_cache(rocksdict.Cache(cache_mib << 20))
        table.set_cache_index_and_filter_blocks(False)  # pinned in RAM: counted below
        options.set_block_based_table_factory(table)
        self.db = rocksdict.Rdict(directory, options)
        write_options = rocksdict.WriteOptions()
        write_options.disable_wal = True
        self.db.set_write_options(write_options)
        self.bytes_updated = 0

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        batch = self.rocksdict.WriteBatch(raw_mode=True)
        key_bytes = keys.astype(">i8").tobytes()
        record_bytes = records.tobytes()
        for i in range(len(keys)):
            batch.put(
                key_bytes[i * 8 : i * 8 + 8],
                record_bytes[i * RECORD_BYTES : (i + 1) * RECORD_BYTES],
            )
        self.db.write(batch)
        self.bytes_updated += len(keys) * RECORD_BYTES

    def read(self, keys: np.ndarray) -> int:
        key_bytes = keys.astype(">i8").tobytes()
        values = self.db.get([key_bytes[i * 8 : i * 8 + 8] for i in range(len(keys))])
        return sum(value is not None for value in values)

    def maintenance(self, max_bytes: int) -> None:
        pass  # RocksDB compacts in its own background threads

    def finish_writes(self) -> None:
        self.db.flush(True)

    def settle(self) -> float:
        """Waits for the compactions the writes so far caused (their bytes count too)."""
        start = time.perf_counter()
        while time.perf_counter() - start < 600:
            pending = self.db.property_int_value("rocksdb.compaction-pending") or 0
            running = self.db.property_int_value("rocksdb.num-running-compactions") or 0
            if not pending and not running:
                break
            time.sleep(0.5)
        return time.perf_counter() - start

    def engine_bytes(self) -> tuple[int, int]:
        return 0, self.bytes_updated

    def ram_bytes(self) -> int:
        total = 0
        for name in (
            "rocksdb.estimate-table-readers-mem",
            "rocksdb.cur-size-all-mem-tables",
            "rocksdb.block-cache-usage",
        ):
            total += self.db.property_int_value(name) or 0
        return total

    def close(self) -> None:
        self.db.close()


def disk_random_read_limit(paths: list[str], threads: int, seconds: float) -> dict:
    """Random 4 KiB O_DIRECT preads over paths at queue depth `threads`."""
    files = []
    for path in paths:
        size = os.path.getsize(path) // 4096 * 4096
        if size >= 4096:
            files.append((os.open(path, os.O_RDONLY | os.O_DIRECT), size // 4096))
    counts = [0] * threads
    deadline = time.perf_counter() + seconds
    errors = []

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        buffer = mmap.mmap(-1, 4096)  # page aligned, as O_DIRECT needs
        picks = rng.integers(0, len(files), size=1 << 16)
        blocks = rng.integers(0, 1 << 62, size=1 << 16)
        i = 0
        try:
            while time.perf_counter() < deadline:
                fd, block_count = files[picks[i & 0xFFFF]]
                os.preadv(fd, [buffer], int(blocks[i & 0xFFFF] % block_count) * 4096)
                i += 1
        except OSError as error:
            errors.append(str(error))
        counts[index] = i

    start = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    for fd, _ in files:
        os.close(fd)
    reads = sum(counts)
    return {
        "queue_depth": threads,
        "reads_per_s": reads / elapsed,
        "mb_per_s": reads * 4096 / elapsed / 1e6,
        "seconds": elapsed,
        "errors": errors[:3],
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_engine(engine, args, permutation: np.ndarray) -> dict:
    result = {"engine": engine.name}
    rows = args.rows
    rng = np.random.default_rng(7)

    # 1. Load: write-back batches of new rows.
    written_before = process_bytes_written()
    start = time.perf_counter()
    for begin in range(0, rows, args.write_batch):
        keys = np.arange(begin, min(rows, begin + args.write_batch), dtype=np.int64)
        engine.write(keys, make_records(keys, 0))
    engine.finish_writes()
    load_seconds = time.perf_counter() - start
    settle_seconds = engine.settle()
    result["load"] = {
        "compaction_wait_seconds": settle_seconds,
        "rows": rows,
        "seconds": load_seconds,
        "ops_per_s": rows / load_seconds,
        "mb_per_s": rows * RECORD_BYTES / load_seconds / 1e6,
        "process_write_bytes": process_bytes_written() - written_before,
    }
    result["disk_bytes_after_load"] = directory_bytes(engine.directory)
    result["ram_bytes_per_key"] = engine.ram_bytes() / rows

    # 2. Batched reads, cold page cache at the start of each.
    reads = []
    for distribution, draw in DISTRIBUTIONS.items():
        for batch in (4096, 65536):
            result["cache_drop"] = drop_page_cache(engine.directory)
            batches = max(1, args.read_keys // batch)
            keys = [draw(rng, batch, rows, permutation) for _ in range(batches)]
            found = 0

            def read_all(batches_of_keys=keys):
                nonlocal found
                for k in batches_of_keys:
                    found += engine.read(k)

            seconds = timed(read_all)
            assert found == batches * batch, (engine.name, found)
            reads.append(
                {
                    "distribution": distribution,
                    "batch": batch,
                    "keys": batches * batch,
                    "ops_per_s": batches * batch / seconds,
                    "mb_per_s": batches * batch * RECORD_BYTES / seconds / 1e6,
                }
            )
    result["read"] = reads

    # 3. Mixed: read a step's ids, write half of them back, a little GC.
    mixed = []
    for distribution, draw in DISTRIBUTIONS.items():
        drop_page_cache(engine.directory)
        engine_written, engine_updated = engine.engine_bytes()
        written_before = process_bytes_written()
        updated = 0
        start = time.perf_counter()
        for step in range(args.steps):
            keys = draw(rng, args.step_keys, rows, permutation)
            engine.read(keys)
            back = np.unique(keys[: args.step_keys // 2])
            engine.write(back, make_records(back, step + 1))
            updated += len(back) * RECORD_BYTES
            engine.maintenance(args.gc_bytes)
        engine.finish_writes()
        seconds = time.perf_counter() - start
        settle_seconds = engine.settle()
        engine_written_after, engine_updated_after = engine.engine_bytes()
        process_written = process_bytes_written() - written_before
        entry = {
            "distribution": distribution,
            "steps": args.steps,
            "step_keys": args.step_keys,
            "steps_per_s": args.steps / seconds,
            "compaction_wait_seconds": settle_seconds,
            "read_ops_per_s": args.steps * args.step_keys / seconds,
            "bytes_updated": updated,
            "process_write_bytes": process_written,
            "write_amplification_process": process_written / updated,
        }
        if engine.name == "segment_store":
            entry["write_amplification_engine"] = (engine_written_after - engine_written) / (
                engine_updated_after - engine_updated
            )
        mixed.append(entry)
    result["mixed"] = mixed
    result["disk_bytes_at_end"] = directory_bytes(engine.directory)
    result["ram_bytes_per_key_at_end"] = engine.ram_bytes() / rows
    return result


def print_table(results: list[dict], disk: dict) -> None:
    print(
        f"\ndisk random 4 KiB reads (O_DIRECT, queue depth {disk['queue_depth']}): "
        f"{disk['reads_per_s']:,.0f}/s = {disk['mb_per_s']:,.0f} MB/s"
    )
    header = f"{'phase':34s}" + "".join(f"{r['engine']:>18s}" for r in results)
    print(header)
    print("-" * len(header))

    def row(label, values):
        print(f"{label:34s}" + "".join(f"{v:>18s}" for v in values))

    row("load rows/s", [f"{r['load']['ops_per_s']:,.0f}" for r in results])
    row("load MB/s", [f"{r['load']['mb_per_s']:,.0f}" for r in results])
    for i, read in enumerate(results[0]["read"]):
        row(
            f"read {read['distribution']} x{read['batch']} keys/s",
            [f"{r['read'][i]['ops_per_s']:,.0f}" for r in results],
        )
    for i, mixed in enumerate(results[0]["mixed"]):
        row(
            f"mixed {mixed['distribution']} steps/s",
            [f"{r['mixed'][i]['steps_per_s']:.2f}" for r in results],
        )
        row(
            f"mixed {mixed['distribution']} write amp (io)",
            [f"{r['mixed'][i]['write_amplification_process']:.2f}" for r in results],
        )
    row("RAM bytes per key", [f"{r['ram_bytes_per_key_at_end']:.1f}" for r in results])
    row("disk bytes at end (GB)", [f"{r['disk_bytes_at_end'] / 1e9:.2f}" for r in results])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--write-batch", type=int, default=65536)
    parser.add_argument("--read-keys", type=int, default=262144)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-keys", type=int, default=65536)
    parser.add_argument("--read-threads", type=int, default=32)
    parser.add_argument("--gc-bytes", type=int, default=64 << 20)
    parser.add_argument("--rocksdb-cache-mib", type=int, default=64)
    parser.add_argument("--disk-seconds", type=float, default=5.0)
    parser.add_argument("--engines", default="segment_store,rocksdb")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results", "engine_compare.json"),
    )
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="engine_compare_", dir=args.dir)
    permutation = np.random.default_rng(1).permutation(args.rows).astype(np.int64)
    results = []
    disk = None
    try:
        for name in args.engines.split(","):
            directory = os.path.join(scratch, name)
            if name == "segment_store":
                engine = SegmentEngine(directory, args.read_threads)
            elif name == "rocksdb":
                engine = RocksEngine(directory, args.rocksdb_cache_mib)
            else:
                raise SystemExit(f"unknown engine {name!r}")
            print(f"running {name} ...", flush=True)
            try:
                results.append(run_engine(engine, args, permutation))
                if disk is None:
                    drop_page_cache(directory)
                    paths = [os.path.join(directory, n) for n in sorted(os.listdir(directory))]
                    disk = disk_random_read_limit(paths, args.read_threads, args.disk_seconds)
            finally:
                engine.close()
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print_table(results, disk)
    report = {
        "benchmark": "engine_compare",
        "command": "python benchmarks/engine_compare.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "dir")
        ),
        "record_bytes": RECORD_BYTES,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "crc32c_hardware": _core.CRC32C_HARDWARE,
        },
        "page_cache": results[0].get("cache_drop") if results else None,
        "disk_random_4k_read_limit": disk,
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as file:
        json.dump(report, file, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
