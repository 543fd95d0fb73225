"""kvsparse's disk engines against RocksDB's C++ API and the disk's own limit (issue 33).

Builds (if needed) and runs benchmarks/engine_cpp/engine_bench, one C++ program that
puts the same batches of the same ids through every engine in one process:

- segment: kvsparse's SegmentStore and run: kvsparse's RunStore (when csrc/run_store.h
  exists), both through the RowStore interface, with the Maintenance credit a tiered
  table gives them (8x the bytes just written);
- rocksdb: RocksDB through its C++ API, DB::MultiGet on each batch (split into --threads
  slices read at once: Debian's RocksDB has no io_uring, so one MultiGet reads its blocks
  one after another), WriteBatch writes, tuned for point lookups as Paddle, FBGEMM and
  HugeCTR ship it: WAL off, no compression, a 10-bit full bloom filter, 4 KiB blocks,
  index and filters pinned outside a --rocksdb-cache-mib block cache (8 MiB: kvsparse's
  point is a small memory budget);
- disk: the disk's own limit: the records as a dense array of 4 KiB pages, one O_DIRECT
  4 KiB pread per lookup at the same queue depth, loaded by sequential O_DIRECT writes,
  updated in place (a 4 KiB page written per record written back).

Record sizes, the rows of a tiered table (values + optimizer slots + 16 bytes of
metadata): dim-16 SGD 80 bytes, dim-16 Adagrad 144 bytes, dim-64 Adagrad 528 bytes.

Phases (engine_compare.py's): load --rows records in shuffled id order in batches of
--write-batch; read batches of 4,096 and 16,384 distinct ids, uniform and Zipf(1.1)
(ranks scattered over the ids by a fixed permutation), --read-keys ids each, the page
cache dropped before each phase (drop_caches as root, else posix_fadvise DONTNEED on the
engine's files: the JSON says which); mixed: --steps steps of reading --step-keys ids and
writing half of them back. Every phase ends with its writes on disk (syncfs) and the
engine's background work done (RocksDB's compactions, RunStore's merges); the records/s
compared include that time. Every record read is checked against the bytes written.

Reported per record size, engine and phase: records/s, MB/s, RAM bytes per key (kvsparse:
RowStoreStats.index_bytes / live records; RocksDB: estimate-table-readers-mem +
cur-size-all-mem-tables + block-cache-usage), write amplification (/proc/self/io
write_bytes, all threads, / bytes of records written), reads per lookup (the engine's
reads, RocksDB's perf-context block reads) and bytes read from the disk per lookup.

RocksDB is not a kvsparse dependency; this benchmark is run by hand, never by CI:
    apt-get install -y librocksdb-dev              # Debian 12: RocksDB 7.8.3

Run: python benchmarks/engine_cpp_compare.py [--rows 2000000] [--record-bytes 80,144,528]
(~4 minutes on the 2-core VM). Writes benchmarks/results/engine_cpp_compare.json.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAM_DIR = REPO / "benchmarks" / "engine_cpp"
BUILD_DIR = PROGRAM_DIR / "build"
PROGRAM = BUILD_DIR / "engine_bench"
ROCKSDB_HEADER = Path("/usr/include/rocksdb/db.h")
INSTALL_HINT = "apt-get install -y librocksdb-dev (RocksDB's headers and library)"

# record bytes -> what row it is: dim x 4 x (1 + optimizer slots) + 16 bytes of metadata
RECORDS = {80: "dim 16 SGD", 144: "dim 16 Adagrad", 528: "dim 64 Adagrad"}
KVSPARSE_ENGINES = ("segment", "run")


def default_engines() -> str:
    engines = ["segment", "rocksdb", "disk"]
    if (REPO / "csrc" / "run_store.h").exists():
        engines.insert(1, "run")
    return ",".join(engines)


def build(force: bool = False, build_dir: Path = BUILD_DIR) -> Path:
    """Builds engine_bench with build.sh unless it is newer than its sources; returns its path.

    Raises RuntimeError naming the package to install when RocksDB's headers are missing,
    and subprocess.CalledProcessError when the compiler fails.

    Example: ``subprocess.run([build(), "--help"])``.
    """
    if not ROCKSDB_HEADER.exists():
        raise RuntimeError(f"RocksDB headers missing ({ROCKSDB_HEADER}): {INSTALL_HINT}")
    program = build_dir / "engine_bench"
    sources = [PROGRAM_DIR / "engine_bench.cc", PROGRAM_DIR / "build.sh"]
    sources += sorted((REPO / "csrc").glob("*.h")) + sorted((REPO / "csrc").glob("*.cc"))
    if not force and program.exists():
        built = program.stat().st_mtime
        if all(source.stat().st_mtime <= built for source in sources):
            return program
    subprocess.run(["bash", str(PROGRAM_DIR / "build.sh"), str(build_dir)], check=True)
    return program


def program_args(args: argparse.Namespace, record_bytes: int, directory: str, out: str):
    argv = [
        "--engines", args.engines, "--rows", str(args.rows),
        "--record-bytes", str(record_bytes), "--write-batch", str(args.write_batch),
        "--read-batches", args.read_batches, "--read-keys", str(args.read_keys),
        "--steps", str(args.steps), "--step-keys", str(args.step_keys),
        "--threads", str(args.threads), "--rocksdb-cache-mib", str(args.rocksdb_cache_mib),
        "--rocksdb-write-buffer-mib", str(args.rocksdb_write_buffer_mib),
        "--dir", directory, "--json", out,
    ]  # fmt: skip
    if not args.no_verify:
        argv.append("--verify")
    return argv


def phase_rows(report: dict) -> list[tuple[str, dict]]:
    """(label, {engine: records/s}) for every phase, in the program's order."""
    engines = {name: e for name, e in report["engines"].items() if "error" not in e}
    first = next(iter(engines.values()))
    rows = [("load", {n: e["load"]["records_per_s_with_settle"] for n, e in engines.items()})]
    for i, phase in enumerate(first["read"]):
        label = f"read {phase['distribution']} x{phase['batch']}"
        rows.append((label, {n: e["read"][i]["records_per_s"] for n, e in engines.items()}))
    for i, phase in enumerate(first["mixed"]):
        label = f"mixed {phase['distribution']} x{phase['step_keys']}"
        values = {n: e["mixed"][i]["records_per_s_with_settle"] for n, e in engines.items()}
        rows.append((label, values))
    return rows


def ratios(report: dict) -> dict:
    """Per phase: each kvsparse engine's records/s over RocksDB's, each engine's over the disk's."""
    out = {}
    for label, values in phase_rows(report):
        entry = {}
        for name in KVSPARSE_ENGINES:
            if name in values and "rocksdb" in values:
                entry[f"{name}/rocksdb"] = values[name] / values["rocksdb"]
        if "disk" in values:
            for name, value in values.items():
                if name != "disk":
                    entry[f"{name}/disk"] = value / values["disk"]
        out[label] = entry
    return out


def disk_bandwidth_share(report: dict) -> dict:
    """Per read phase and engine: bytes it had the disk read per second over the disk limit's.

    Above 1: the engine reads more than 4 KiB per lookup (larger pages, readahead), which a
    disk serves at more bytes per second than 4 KiB random reads; below its records/s ratio:
    lookups answered from the page cache.
    """
    engines = {name: e for name, e in report["engines"].items() if "error" not in e}
    if "disk" not in engines:
        return {}
    out = {}
    for i, phase in enumerate(engines["disk"]["read"]):
        limit = phase["records_per_s"] * phase["disk_read_bytes_per_lookup"]
        out[f"read {phase['distribution']} x{phase['batch']}"] = {
            name: e["read"][i]["records_per_s"] * e["read"][i]["disk_read_bytes_per_lookup"] / limit
            for name, e in engines.items()
            if name != "disk"
        }
    return out


def print_table(report: dict, label: str) -> None:
    engines = [n for n, e in report["engines"].items() if "error" not in e]
    failed = [f"{n}: {e['error']}" for n, e in report["engines"].items() if "error" in e]
    rows = phase_rows(report)
    ratio_names = list(next(iter(ratios(report).values())).keys())
    some = report["engines"][engines[0]]
    print(
        f"\n{label}: {report['record_bytes']} B records, {report['rows']:,} rows, queue depth "
        f"{report['threads']}, page cache: {some['read'][0]['page_cache']}"
    )
    header = f"{'records/s':24s}" + "".join(f"{n:>11s}" for n in engines)
    header += "  " + "".join(f"{r:>15s}" for r in ratio_names)
    print(header)
    print("-" * len(header))
    all_ratios = ratios(report)
    for phase, values in rows:
        line = f"{phase:24s}" + "".join(f"{values[n]:>11,.0f}" for n in engines) + "  "
        line += "".join(f"{all_ratios[phase][r]:>15.2f}" for r in ratio_names)
        print(line)

    def row(title, fn, fmt):
        print(f"{title:24s}" + "".join(f"{fmt(fn(report['engines'][n])):>11s}" for n in engines))

    row(
        "RAM B/key after load",
        lambda e: e["memory"]["ram_bytes_per_key_after_load"],
        "{:.2f}".format,
    )
    row("RAM B/key at end", lambda e: e["memory"]["ram_bytes_per_key_at_end"], "{:.2f}".format)
    row("RAM B/key peak", lambda e: e["memory"]["ram_bytes_per_key_peak"], "{:.2f}".format)
    row("write amp load", lambda e: e["load"]["write_amplification"], "{:.2f}".format)
    for i, phase in enumerate(some["mixed"]):
        row(
            f"write amp mixed {phase['distribution']}",
            lambda e, i=i: e["mixed"][i]["write_amplification"],
            "{:.2f}".format,
        )
    uniform = max(
        (i for i, p in enumerate(some["read"]) if p["distribution"] == "uniform"),
        key=lambda i: some["read"][i]["batch"],
    )
    row(
        "reads/lookup uniform",
        lambda e: e["read"][uniform].get("engine_reads_per_lookup", float("nan")),
        "{:.2f}".format,
    )
    row(
        "disk KiB/lookup uniform",
        lambda e: e["read"][uniform]["disk_read_bytes_per_lookup"] / 1024,
        "{:.1f}".format,
    )
    share = disk_bandwidth_share(report)
    uniform_label = f"read uniform x{some['read'][uniform]['batch']}"
    if uniform_label in share:
        row(
            "disk MB/s / limit's",
            lambda e: share[uniform_label].get(e["engine"], 1.0),
            "{:.2f}".format,
        )
    row(
        "disk bytes/record bytes",
        lambda e: e["disk_bytes_at_end"] / (report["rows"] * report["record_bytes"]),
        "{:.2f}".format,
    )
    for line in failed:
        print(f"FAILED {line}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--record-bytes", default="80,144,528")
    parser.add_argument("--engines", default=default_engines())
    parser.add_argument("--write-batch", type=int, default=65536)
    parser.add_argument("--read-batches", default="4096,16384")
    parser.add_argument("--read-keys", type=int, default=65536, help="ids per read phase")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--step-keys", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=16, help="queue depth of every engine")
    parser.add_argument("--rocksdb-cache-mib", type=int, default=8)
    parser.add_argument("--rocksdb-write-buffer-mib", type=int, default=64)
    parser.add_argument("--no-verify", action="store_true", help="skip the byte check")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--dir", default="/work/tmp", help="parent of the scratch directory")
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results" / "engine_cpp_compare.json")
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        program = build(force=args.rebuild)
    except RuntimeError as error:
        print(f"engine_cpp_compare: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="engine_cpp_", dir=args.dir)
    runs = []
    failed = False
    try:
        for record_bytes in (int(b) for b in args.record_bytes.split(",")):
            label = RECORDS.get(record_bytes, f"{record_bytes} B")
            out = os.path.join(scratch, f"report-{record_bytes}.json")
            directory = os.path.join(scratch, f"data-{record_bytes}")
            command = [str(program), *program_args(args, record_bytes, directory, out)]
            print(f"{label}: {' '.join(command[1:])}", flush=True)
            completed = subprocess.run(command)
            if not os.path.exists(out):
                print(f"engine_cpp_compare: no report for {record_bytes} B", file=sys.stderr)
                failed = True
                continue
            with open(out) as file:
                report = json.load(file)
            failed |= completed.returncode != 0
            runs.append(
                {
                    "label": label,
                    "report": report,
                    "ratios": ratios(report),
                    "disk_bandwidth_share": disk_bandwidth_share(report),
                }
            )
            print_table(report, label)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    given = sys.argv[1:] if argv is None else argv
    result = {
        "benchmark": "engine_cpp_compare",
        "command": " ".join(["python", "benchmarks/engine_cpp_compare.py", *given]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "disk": disk_description(args.dir),
        },
        "ok": not failed,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as file:
        json.dump(result, file, indent=2)
    print(f"\nwrote {args.out}")
    return 1 if failed else 0


def disk_description(directory: str) -> str:
    """The block device under directory and its model, as far as /sys tells."""
    try:
        device = os.stat(directory).st_dev
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(device)}:0"))
        model = Path(f"/sys/block/{name}/device/model")
        text = model.read_text().strip() if model.exists() else "virtual"
        return f"{name} ({text})"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
