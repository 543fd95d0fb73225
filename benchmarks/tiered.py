"""A table four times larger than the server's memory budget: the disk tier against all-RAM.

One `kvsparse server --memory-budget BUDGET --spill-dir DIR` holds one dim-64 float32
table with Adagrad and Normal(0, 0.01) init (W1's table, benchmarks/pull_push.py) of
--rows rows: 64 values + 64 Adagrad slots = 512 bytes a row, so the default 1 GiB budget
gets 8.4 million rows (4.3 GB of rows and state, 4x the budget). ``--dim 16`` (Criteo
DLRM's width) makes it 128 bytes a row and 33.6 million rows. A worker drives W1-style
steps (row_sparse_pull + push of --batch-size ids) with ids drawn

- zipf:    Zipf(1.1) over the table's ids (ranks scattered by a fixed permutation, as in
           benchmarks/engine_compare.py), and
- uniform: uniformly over the table's ids (almost every row a miss: the disk's case).

In the same run, side by side:
- all_ram:  the same table, steps and ids on a server without a budget;
- engines:  benchmarks/engine_compare.py's `run_engine` on the chosen engine
            (SegmentStore) and on RocksDB (rocksdict), same 520-byte record
            (--engine-rows rows; skipped with a reason if rocksdict is missing);
- disk:     this disk's random 4 KiB read limit (O_DIRECT preads at queue depth
            --read-threads over the tiered server's spill files), measured here.

Filling: every id of the table is pushed once with a zero gradient, in blocks of
--batch-size sequential ids, before any timed step (untimed, reported as populate_s).
Then per distribution: --warmup untimed steps, --steps timed steps.

Reported per configuration and distribution: steps/s, unique rows/s, hit rate
(1 - disk_hits / row_lookups over the timed steps), bytes written per byte updated
(the table's tier_stats from kv.stats()), the server's RSS over time (VmRSS sampled in a
thread; the max is checked against budget + 15%).

Page cache: the spill dir would sit in the page cache of this 24 GiB machine and flatter
the disk figures. The tiered server runs in a memory cgroup (v2 memory.max, else v1
memory.limit_in_bytes, under this process's own cgroup) limited to
budget * (1 + --cgroup-headroom) + the idle server's RSS (headroom 0.5 by default), which
bounds its RSS and page cache together (a server that passes it is OOM-killed: reported);
without a writable cgroup the page cache is dropped before every phase (drop_caches as
root, else posix_fadvise DONTNEED on the spill files). The JSON says which.
The engine comparison drops the page cache before each of its phases (engine_compare's
own method).

Targets (issue "What it must show"): zipf tiered >= 0.5x all_ram rows/s; uniform tiered
rows/s >= 0.5x the disk's random 4 KiB reads/s; server RSS max <= budget * 1.15.

Usage:
    python benchmarks/tiered.py                  # 1 GiB budget, 8.4M rows (~5 min here)
    python benchmarks/tiered.py --budget 256MiB --cgroup-headroom 1.0   # smoke (~1 min)
    python benchmarks/tiered.py --configs all_ram --no-engines   # without the disk tier
    python benchmarks/tiered.py --configs all_ram,tiered,tiered_ahead  # with prefetch too
    python benchmarks/tiered.py capacity         # rows per budget, dims 16/32/64 x SGD,
                                                 # Adagrad (benchmarks/tiered_capacity.py)
    python benchmarks/tiered.py checkpoint       # bytes a full save writes, restore time
                                                 # against fill (tiered_checkpoint.py)
    python benchmarks/tiered.py dlrm --scale 16  # the torch DLRM (benchmarks/tiered_dlrm.py)

A small budget may not take W1's batch: the core counts a 65,536-row push's rows, its
scratch (each row's state saved or computed aside) and its records in transit, and the
disk index (~1.5-2 bytes a row on disk) in the budget, and refuses a request that does not
fit (LimitExceeded, naming what holds the room; reported); use --batch-size to go smaller.

Writes benchmarks/results/tiered.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import engine_compare  # noqa: E402
import procs  # noqa: E402
import pull_push  # noqa: E402
import workload as wl  # noqa: E402

import kvsparse  # noqa: E402

TABLE = "embedding"


def row_bytes(dim: int) -> int:
    """Bytes of one row and its Adagrad state: dim float32 values + dim float32 slots.

    What the issue sizes the table by (512 at the default dim 64); the disk tier's record
    adds 8 bytes of step/counter (engine_compare.RECORD_BYTES at dim 64).
    """
    return dim * 4 * 2


RSS_TARGET = 1.15
ZIPF_TARGET = 0.5
UNIFORM_TARGET = 0.5
SIZE_SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


# -- sizes and ids ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'1GiB' -> 1073741824, '2M' -> 2000000, '8400000' -> 8400000."""
    lowered = text.strip().lower().replace("_", "")
    for suffix in sorted(SIZE_SUFFIXES, key=len, reverse=True):
        if lowered.endswith(suffix) and lowered[: -len(suffix)]:
            return int(float(lowered[: -len(suffix)]) * SIZE_SUFFIXES[suffix])
    return int(float(lowered))


def draw_ids(distribution: str, rng, count: int, rows: int, permutation) -> np.ndarray:
    """`count` ids of the table [0, rows): engine_compare's Zipf(1.1) or uniform draw."""
    return engine_compare.DISTRIBUTIONS[distribution](rng, count, rows, permutation)


# -- memory: RSS sampling and the cgroup -------------------------------------------------------


def vm_rss(pid: int) -> int | None:
    """Resident set of pid in bytes (VmRSS of /proc/pid/status); None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples a process's VmRSS every `interval` s in a thread, labelled by phase.

    Not thread-safe beyond its own thread: set `phase` and read the results from one thread.
    """

    def __init__(self, pid: int, interval: float = 0.2, cgroup=None):
        self.pid = pid
        self.interval = interval
        self.cgroup = cgroup
        self.phase = "start"
        self.samples: list[tuple[float, int, str, int | None]] = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int | None:
        rss = vm_rss(self.pid)
        if rss is not None:
            charged = self.cgroup.usage() if self.cgroup else None
            self.samples.append((time.monotonic() - self._start, rss, self.phase, charged))
        return rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, max_points: int = 400) -> dict:
        by_phase: dict = {}
        for _, rss, phase, _ in self.samples:
            by_phase[phase] = max(by_phase.get(phase, 0), rss)
        step = max(1, math.ceil(len(self.samples) / max_points))
        series = [
            {"t_s": round(t, 2), "rss": rss, "phase": phase, "cgroup_charged": charged}
            for t, rss, phase, charged in self.samples[::step]
        ]
        return {
            "interval_s": self.interval,
            "samples": len(self.samples),
            "max_rss": max((s[1] for s in self.samples), default=0),
            "max_rss_by_phase": by_phase,
            "series": series,
        }


class MemoryCgroup:
    """A memory cgroup of our own, under this process's cgroup; removed by `close`.

    v2: memory.max (needs the memory controller in the parent's subtree_control); v1:
    memory.limit_in_bytes of the memory hierarchy. Both bound RSS + page cache together.
    """

    def __init__(self, path: str, version: int):
        self.path = path
        self.version = version
        self.limit = None

    @classmethod
    def create(cls, name: str) -> tuple[MemoryCgroup | None, str]:
        """(the cgroup, how) or (None, why not)."""
        try:
            with open("/proc/self/cgroup") as f:
                lines = [line.rstrip("\n").split(":", 2) for line in f]
        except OSError as error:
            return None, f"no /proc/self/cgroup: {error}"
        reasons = []
        v2_root = "/sys/fs/cgroup"
        for _, controllers, path in lines:
            if controllers == "" and os.path.exists(os.path.join(v2_root, "cgroup.controllers")):
                parent = os.path.join(v2_root, path.lstrip("/"))
                try:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        if "memory" not in f.read().split():
                            raise OSError("memory controller not enabled for children")
                    os.mkdir(os.path.join(parent, name))
                    return cls(os.path.join(parent, name), 2), "cgroup v2 memory.max"
                except OSError as error:
                    reasons.append(f"v2 at {parent}: {error}")
        for _, controllers, path in lines:
            if "memory" in controllers.split(","):
                parent = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
                try:
                    os.mkdir(os.path.join(parent, name))
                    return cls(os.path.join(parent, name), 1), "cgroup v1 memory.limit_in_bytes"
                except OSError as error:
                    reasons.append(f"v1 at {parent}: {error}")
        return None, "; ".join(reasons) or "no memory cgroup found"

    def _file(self, v1: str, v2: str) -> str:
        return os.path.join(self.path, v2 if self.version == 2 else v1)

    def set_limit(self, limit: int) -> None:
        with open(self._file("memory.limit_in_bytes", "memory.max"), "w") as f:
            f.write(str(int(limit)))
        self.limit = int(limit)

    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def _read_int(self, v1: str, v2: str) -> int | None:
        try:
            with open(self._file(v1, v2)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def usage(self) -> int | None:
        return self._read_int("memory.usage_in_bytes", "memory.current")

    def report(self) -> dict:
        stat = {}
        with contextlib.suppress(OSError):
            with open(os.path.join(self.path, "memory.stat")) as f:
                for line in f:
                    key, value = line.split()
                    if key in ("cache", "rss", "file", "anon", "file_dirty", "dirty", "writeback"):
                        stat[key] = int(value)
        events = {}
        if self.version == 2:
            with contextlib.suppress(OSError):
                with open(os.path.join(self.path, "memory.events")) as f:
                    events = {k: int(v) for k, v in (line.split() for line in f)}
        else:
            events["failcnt"] = self._read_int("memory.failcnt", "")
            with contextlib.suppress(OSError):
                with open(os.path.join(self.path, "memory.oom_control")) as f:
                    for line in f:
                        key, value = line.split()
                        if key == "oom_kill":
                            events["oom_kill"] = int(value)
        return {
            "version": self.version,
            "limit": self.limit,
            "peak": self._read_int("memory.max_usage_in_bytes", "memory.peak"),
            "stat_at_end": stat,
            "events": events,
        }

    def close(self) -> None:
        for _ in range(50):  # a stopped server leaves its group a moment later
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache(directory: str) -> str:
    return engine_compare.drop_page_cache(directory)


# -- one server configuration ------------------------------------------------------------------


def tier_counters(table_stats: dict) -> dict:
    """The table's tier counters out of kv.stats()['tables'][name], wherever they sit.

    The core's Table.tier_stats() names them (row_lookups, disk_hits, bytes_written, ...);
    the store may nest them ('tier', 'tier_stats') or prefix them ('tier_').
    """
    for key in ("tier", "tier_stats", "disk_tier"):
        if isinstance(table_stats.get(key), dict):
            return dict(table_stats[key])
    if any(k.startswith("tier_") for k in table_stats):
        return {k[len("tier_") :]: v for k, v in table_stats.items() if k.startswith("tier_")}
    if "row_lookups" in table_stats:
        return dict(table_stats)
    return {}


def counter_delta(before: dict, after: dict) -> dict:
    return {
        k: after[k] - before.get(k, 0)
        for k in after
        if isinstance(after[k], int) and not isinstance(after[k], bool)
    }


def derived(delta: dict) -> dict:
    """hit rate and write amplification from a delta of tier counters."""
    out = {}
    if delta.get("row_lookups"):
        out["hit_rate"] = 1 - delta.get("disk_hits", 0) / delta["row_lookups"]
    if delta.get("bytes_updated"):
        out["bytes_written_per_byte_updated"] = (
            delta.get("bytes_written", 0) / delta["bytes_updated"]
        )
    return out


def table_stats(kv) -> dict:
    return kv.stats()["tables"][TABLE]


def start_server(processes, name: str, extra_args: list, cgroup: MemoryCgroup | None):
    """One `kvsparse server` on a free port, in `cgroup` when given; (address, pid)."""
    argv = [sys.executable, "-m", "kvsparse.server", "--bind", "tcp://127.0.0.1:0", *extra_args]
    if cgroup is not None:
        # The shell joins the cgroup, then becomes the server: nothing runs outside it.
        argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs_file(), *argv]
    server = processes.start(name, argv)
    address = processes.wait_for_line(server, pull_push.SERVER_LINE, timeout=60)
    return address, server.pid


def populate(kv, rows: int, batch_size: int, sampler: RssSampler, dim: int = wl.DIM) -> dict:
    """Every id of [0, rows) pushed once with a zero gradient, in sequential blocks."""
    sampler.phase = "populate"
    zeros = np.zeros((batch_size, dim), np.float32)
    start = time.perf_counter()
    for begin in range(0, rows, batch_size):
        ids = np.arange(begin, min(rows, begin + batch_size), dtype=np.int64)
        kv.push(TABLE, (ids, zeros[: ids.size]))
    seconds = time.perf_counter() - start
    stored = int(table_stats(kv)["rows"])
    if stored != rows:
        raise RuntimeError(f"populate stored {stored} rows, expected {rows}")
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}


def run_steps(
    kv, distribution: str, args, permutation, grads, sampler, cache_note, ahead=False
) -> dict:
    """Warm-up + --steps W1 steps (pull + push) of `distribution` ids; their figures.

    ahead: each step first sends the next step's ids (`kv.row_sparse_prefetch`, not
    waited for), as the adapters' prefetch does. The server reads their disk rows as it
    handles that request, just before this step's pull: W1 computes nothing between
    requests, so the reads have nothing to hide behind (the DLRM's steps do).

    Zipf gets --zipf-warmup steps first: eviction takes the rows with the fewest updates,
    and the counts tell the hot rows apart only over hundreds of steps (the share of a
    step's distinct ids read from disk still falls from step 60 to step 600: a training
    run's steady state is nearer the latter); uniform ids have no hot set (--warmup).
    The tier's counters are read after every timed step, outside its timing.
    """
    rng = np.random.default_rng(args.seed + (1 if distribution == "zipf1.1" else 2))
    warmup = args.zipf_warmup if distribution == "zipf1.1" else args.warmup
    out = np.empty((args.batch_size, args.dim), np.float32)
    result = {"distribution": distribution}
    if cache_note is not None:
        result["page_cache"] = cache_note()
    sampler.phase = f"{distribution}_warmup"
    warm = [draw_ids(distribution, rng, args.batch_size, args.rows, permutation)]
    for w in range(warmup):
        warm.append(draw_ids(distribution, rng, args.batch_size, args.rows, permutation))
        if ahead:
            kv.row_sparse_prefetch(TABLE, warm[w + 1])
        kv.row_sparse_pull(TABLE, out=out, row_ids=warm[w])
        kv.push(TABLE, (warm[w], grads))
    batches = [warm[-1]] + [
        draw_ids(distribution, rng, args.batch_size, args.rows, permutation)
        for _ in range(args.steps - 1)
    ]
    unique = np.array([np.unique(b).size for b in batches], np.int64)
    before = tier_counters(table_stats(kv))
    sampler.phase = distribution
    seconds, step_hit_rates = [], []
    previous = before
    for i, ids in enumerate(batches):
        start = time.perf_counter()
        if ahead and i + 1 < len(batches):
            kv.row_sparse_prefetch(TABLE, batches[i + 1])
        kv.row_sparse_pull(TABLE, out=out, row_ids=ids)
        kv.push(TABLE, (ids, grads))
        seconds.append(time.perf_counter() - start)
        if previous:
            now = tier_counters(table_stats(kv))
            step_hit_rates.append(derived(counter_delta(previous, now)).get("hit_rate"))
            previous = now
    sampler.sample()  # a phase shorter than the sampling interval still gets its sample
    after_stats = table_stats(kv)
    after = tier_counters(after_stats)
    total = float(np.sum(seconds))
    result.update(
        {
            "steps": args.steps,
            "warmup": warmup,
            "step_seconds": seconds,
            "ms_p50": float(np.median(seconds) * 1e3),
            "steps_per_s": args.steps / total,
            "unique_rows_per_s": float(unique.sum() / total),
            "ids_per_s": args.steps * args.batch_size / total,
            "unique_per_step_mean": float(unique.mean()),
            "rows_stored": int(after_stats["rows"]),
            "load_average": os.getloadavg()[0],
        }
    )
    if after:
        delta = counter_delta(before, after)
        result["tier_delta"] = delta
        result["step_hit_rates"] = step_hit_rates
        result.update(derived(delta))
        if delta.get("rows_read"):
            result["disk_rows_read_per_s"] = delta["rows_read"] / total
            result["disk_rows_read_per_step"] = delta["rows_read"] / args.steps
            # Beside oracle_miss_fraction: the share of a step's distinct ids read from
            # disk (a pull brings its rows in, so the push after it reads none).
            result["disk_rows_read_per_distinct_id"] = delta["rows_read"] / float(unique.sum())
            # Bytes read per row brought back, in records (row, slots and 8 bytes of
            # step/counter): 1 = each missing row read alone; a page holds several.
            result["record_reads_per_row_read"] = delta.get("bytes_read", 0) / (
                delta["rows_read"] * (row_bytes(args.dim) + 8)
            )
        resident = after.get("rows_in_memory")
        if distribution == "zipf1.1" and resident:
            # An oracle cache holding the `resident` hottest ranks would still miss these:
            # the share of a batch's distinct ids that Zipf puts beyond them.
            rank = np.empty_like(permutation)
            rank[permutation] = np.arange(permutation.size, dtype=permutation.dtype)
            result["oracle_miss_fraction"] = float(
                np.mean([(rank[np.unique(b)] >= resident).mean() for b in batches])
            )
    return result


def run_config(name: str, args, permutation, grads, log_dir: str, result: dict) -> dict:
    """One server (tiered or all in RAM): populate, then each distribution's steps.

    Fills `result` as it goes, so a run that fails keeps what it measured until then
    (the RSS series, the cgroup's counters).
    """
    tiered = name in ("tiered", "tiered_ahead")
    result["config"] = name
    cgroup, cache_note = None, None
    spill_dir = None
    extra: list = []
    if tiered:
        spill_dir = tempfile.mkdtemp(prefix="kvsparse_tiered_spill_", dir=args.spill_root)
        extra = ["--memory-budget", str(args.budget), "--spill-dir", spill_dir]
        if not args.no_cgroup:
            cgroup, how = MemoryCgroup.create(f"kvsparse-tiered-{os.getpid()}")
            result["page_cache_control"] = how
        else:
            result["page_cache_control"] = "not bounded (--no-cgroup)"
        if cgroup is None:

            def cache_note():
                return drop_page_cache(spill_dir)

            result["page_cache_control"] += "; fallback: page cache dropped before each phase"
    try:
        with procs.Processes(log_dir) as processes:
            address, pid = start_server(processes, f"server_{name}", extra, cgroup)
            result["server_pid"] = pid
            sampler = RssSampler(pid, cgroup=cgroup)
            try:
                time.sleep(0.5)
                idle = sampler.sample() or 0
                result["idle_server_rss"] = idle
                if cgroup is not None:
                    # RSS + page cache of the server bounded together; its interpreter's own
                    # RSS (measured idle) on top, as the budget does not cover it.
                    cgroup.set_limit(args.budget * (1 + args.cgroup_headroom) + idle)
                with kvsparse.create("dist_sparse", servers=[address], rank=0, num_workers=1) as kv:
                    kv.init(
                        TABLE,
                        kvsparse.SparseTable(
                            dim=args.dim,
                            initializer=kvsparse.initializers.Normal(0.0, 0.01),
                            seed=0,
                        ),
                    )
                    kv.set_optimizer(
                        kvsparse.optimizers.Adagrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS)
                    )
                    print(f"  {name}: populating {args.rows:,} rows ...", flush=True)
                    result["populate"] = populate(kv, args.rows, args.batch_size, sampler, args.dim)
                    result["after_populate"] = tier_counters(table_stats(kv))
                    print(
                        f"  {name}: populated in {result['populate']['seconds']:.1f} s; "
                        f"RSS {sampler.sample() / 2**20:,.0f} MiB",
                        flush=True,
                    )
                    phases = []
                    for distribution in args.distributions:
                        phase = run_steps(
                            kv,
                            distribution,
                            args,
                            permutation,
                            grads,
                            sampler,
                            cache_note,
                            ahead=name == "tiered_ahead",
                        )
                        phases.append(phase)
                        print_phase(name, phase)
                    result["phases"] = phases
                    result["tier_stats_at_end"] = tier_counters(table_stats(kv))
                    # Over the server's whole life, populate included.
                    result["overall"] = derived(result["tier_stats_at_end"])
                    if tiered and not args.no_disk_limit:
                        sampler.phase = "disk_limit"
                        result["disk_random_4k_read_limit"] = measure_disk(spill_dir, args)
            finally:
                sampler.stop()
                result["rss"] = sampler.summary()
    finally:
        if cgroup is not None:
            result["cgroup"] = cgroup.report()
            cgroup.close()
        if spill_dir:
            shutil.rmtree(spill_dir, ignore_errors=True)
    return result


def measure_disk(spill_dir: str, args) -> dict:
    """The disk's random 4 KiB read limit over the spill files (O_DIRECT: no page cache).

    The server is still up and merges in its idle time, removing run files: the files are
    hard-linked aside first (a link keeps a removed file's blocks; one that went before it
    was linked is skipped), and the links removed afterwards.
    """
    aside = tempfile.mkdtemp(prefix="disk_limit_", dir=os.path.dirname(spill_dir))
    try:
        paths = []
        for root, _, names in os.walk(spill_dir):
            for name in names:
                link = os.path.join(aside, f"{len(paths)}_{name}")
                try:
                    os.link(os.path.join(root, name), link)
                except FileNotFoundError:
                    continue
                if os.path.getsize(link) >= 1 << 20:
                    paths.append(link)
        if not paths:
            return {"error": f"no spill files of 1 MiB or more under {spill_dir}"}
        disk = engine_compare.disk_random_read_limit(paths, args.read_threads, args.disk_seconds)
        disk["files"] = len(paths)
        disk["bytes"] = sum(os.path.getsize(p) for p in paths)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    print(
        f"  disk: {disk['reads_per_s']:,.0f} random 4 KiB reads/s (O_DIRECT, queue depth "
        f"{disk['queue_depth']}, over {disk['bytes'] / 1e9:.2f} GB of spill files)",
        flush=True,
    )
    return disk


def print_phase(name: str, phase: dict) -> None:
    extra = ""
    if "hit_rate" in phase:
        extra += f", hit rate {phase['hit_rate']:.3f}"
    if "bytes_written_per_byte_updated" in phase:
        extra += f", {phase['bytes_written_per_byte_updated']:.2f} B written/B updated"
    print(
        f"  {name} {phase['distribution']}: {phase['steps_per_s']:.2f} steps/s, "
        f"{phase['unique_rows_per_s']:,.0f} unique rows/s (p50 {phase['ms_p50']:.0f} ms){extra}",
        flush=True,
    )


# -- the storage engines ---------------------------------------------------------------------------


def run_engines(args, disk: dict | None) -> dict:
    """engine_compare.run_engine on SegmentStore and RocksDB, --engine-rows records."""
    options = argparse.Namespace(
        rows=args.engine_rows,
        write_batch=args.batch_size,
        read_keys=args.engine_read_keys,
        steps=args.engine_steps,
        step_keys=args.engine_step_keys,
        gc_bytes=64 << 20,
    )
    permutation = np.random.default_rng(1).permutation(args.engine_rows).astype(np.int64)
    results = {"options": vars(options), "record_bytes": engine_compare.RECORD_BYTES}
    scratch = tempfile.mkdtemp(prefix="kvsparse_tiered_engines_", dir=args.spill_root)
    try:
        for name in ("segment_store", "rocksdb"):
            directory = os.path.join(scratch, name)
            print(f"  engine {name}: {args.engine_rows:,} records ...", flush=True)
            try:
                if name == "segment_store":
                    engine = engine_compare.SegmentEngine(directory, args.read_threads)
                else:
                    engine = engine_compare.RocksEngine(directory, 64)
            except ImportError as error:
                results[name] = {"status": "skipped", "reason": f"{error} (pip install rocksdict)"}
                print(f"  engine {name} skipped: {error}", flush=True)
                continue
            try:
                started = time.perf_counter()
                results[name] = engine_compare.run_engine(engine, options, permutation)
                results[name]["wall_s"] = time.perf_counter() - started
            finally:
                engine.close()
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    engines = [results[n] for n in ("segment_store", "rocksdb") if "mixed" in results.get(n, {})]
    if engines:
        engine_compare.print_table(
            engines, disk or {"queue_depth": 0, "reads_per_s": 0, "mb_per_s": 0}
        )
    return results


# -- report ----------------------------------------------------------------------------------------


def phase_of(config: dict | None, distribution: str) -> dict | None:
    if not config:
        return None
    return next((p for p in config.get("phases", []) if p["distribution"] == distribution), None)


def targets(report: dict, args) -> dict:
    """The issue's three targets, each with its measured ratio and whether it was met."""
    configs = report["configs"]
    tiered, all_ram = configs.get("tiered"), configs.get("all_ram")
    found = {}
    zipf_r = phase_of(all_ram, "zipf1.1")
    for name in ("tiered", "tiered_ahead"):
        zipf_t = phase_of(configs.get(name), "zipf1.1")
        if zipf_t and zipf_r:
            ratio = zipf_t["unique_rows_per_s"] / zipf_r["unique_rows_per_s"]
            found[f"zipf_{name}_over_all_ram"] = {
                "ratio": ratio,
                "target": ZIPF_TARGET,
                "met": ratio >= ZIPF_TARGET,
            }
    uniform_t = phase_of(tiered, "uniform")
    disk = (tiered or {}).get("disk_random_4k_read_limit", {})
    if uniform_t and disk.get("reads_per_s"):
        ratio = uniform_t["unique_rows_per_s"] / disk["reads_per_s"]
        entry = {"ratio": ratio, "target": UNIFORM_TARGET, "met": ratio >= UNIFORM_TARGET}
        if uniform_t.get("disk_rows_read_per_s"):
            entry["disk_rows_read_per_s_over_limit"] = (
                uniform_t["disk_rows_read_per_s"] / disk["reads_per_s"]
            )
        found["uniform_tiered_rows_over_disk_reads"] = entry
    if tiered and "phases" in tiered:  # a server that failed early says nothing of RSS
        max_rss = tiered["rss"]["max_rss"]
        ratio = max_rss / args.budget
        found["tiered_max_rss_over_budget"] = {
            "ratio": ratio,
            "target_at_most": RSS_TARGET,
            "met": ratio <= RSS_TARGET,
            "max_rss": max_rss,
            "idle_server_rss": tiered.get("idle_server_rss"),
            "max_rss_minus_idle_over_budget": (max_rss - tiered.get("idle_server_rss", 0))
            / args.budget,
        }
    return found


def print_table(report: dict) -> None:
    header = (
        f"{'config':<13}{'ids':<9}{'steps/s':>9}{'rows/s':>11}{'hit rate':>10}"
        f"{'disk rows/s':>13}{'B wr/B upd':>12}{'max RSS MiB':>13}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, config in report["configs"].items():
        if "phases" not in config:
            print(f"{name:<13}{config.get('status', '?')}: {config.get('reason', '')[:80]}")
            continue
        for phase in config["phases"]:
            hit = phase.get("hit_rate")
            amp = phase.get("bytes_written_per_byte_updated")
            disk = phase.get("disk_rows_read_per_s")
            rss = config["rss"]["max_rss_by_phase"].get(phase["distribution"], 0)
            print(
                f"{name:<13}{phase['distribution']:<9}{phase['steps_per_s']:>9.2f}"
                f"{phase['unique_rows_per_s']:>11,.0f}"
                f"{'-' if hit is None else f'{hit:.3f}':>10}"
                f"{'-' if disk is None else f'{disk:,.0f}':>13}"
                f"{'-' if amp is None else f'{amp:.2f}':>12}{rss / 2**20:>13,.0f}"
            )


def print_targets(found: dict) -> None:
    print("\ntargets:")
    for name, entry in found.items():
        bound = entry.get("target", entry.get("target_at_most"))
        sign = ">=" if "target" in entry else "<="
        verdict = "met" if entry["met"] else "NOT met"
        print(f"  {name:<42}{entry['ratio']:>7.3f}  (target {sign} {bound}): {verdict}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="1GiB", help="the tiered server's --memory-budget")
    parser.add_argument(
        "--rows",
        default=None,
        help="table rows (suffixes k, M; default: 4x the budget at 512 B a row, rounded up "
        "to 100k: 8.4M for 1 GiB)",
    )
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument(
        "--dim",
        type=int,
        default=wl.DIM,
        help="the table's width (default 64; 16 is Criteo DLRM's); rows default to 4x the "
        "budget at this width",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per distribution (default 10; 3 below 4M rows)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed uniform steps first (default 3; 1)"
    )
    parser.add_argument(
        "--zipf-warmup",
        type=int,
        default=None,
        help="untimed Zipf steps first, so the tier learns the hot rows (default 60; 5; "
        "600 nears the steady state)",
    )
    parser.add_argument("--configs", default="all_ram,tiered")
    parser.add_argument("--distributions", default="zipf1.1,uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spill-root", default=None, help="where spill dirs go (default: TMPDIR)")
    parser.add_argument(
        "--cgroup-headroom",
        type=float,
        default=0.5,
        help="cgroup limit = budget * (1 + this) + the idle server's RSS (default 0.5: the "
        "RSS target's 15%% and 35%% for page cache; a server past it is OOM-killed, reported)",
    )
    parser.add_argument("--no-cgroup", action="store_true", help="drop the page cache instead")
    parser.add_argument("--read-threads", type=int, default=32, help="disk limit queue depth")
    parser.add_argument("--disk-seconds", type=float, default=5.0)
    parser.add_argument("--no-disk-limit", action="store_true")
    parser.add_argument("--no-engines", action="store_true", help="skip SegmentStore vs RocksDB")
    parser.add_argument(
        "--engine-rows", default=None, help="records per engine (default: min(2M, rows / 4))"
    )
    parser.add_argument("--engine-read-keys", type=int, default=None)
    parser.add_argument("--engine-step-keys", type=int, default=None)
    parser.add_argument("--engine-steps", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "tiered.json"))
    args = parser.parse_args(argv)
    args.budget = parse_size(args.budget)
    if args.rows is None:
        args.rows = math.ceil(4 * args.budget / row_bytes(args.dim) / 100_000) * 100_000
    else:
        args.rows = parse_size(args.rows)
    small = args.rows < 4_000_000
    args.steps = args.steps if args.steps is not None else (3 if small else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 3)
    if args.zipf_warmup is None:
        args.zipf_warmup = 5 if small else 60
    args.engine_rows = (
        parse_size(args.engine_rows)
        if args.engine_rows is not None
        else min(2_000_000, args.rows // 4)
    )
    args.engine_read_keys = args.engine_read_keys or (65536 if not small else 8192)
    args.engine_step_keys = args.engine_step_keys or (args.batch_size if not small else 8192)
    args.configs = [c for c in args.configs.split(",") if c]
    args.distributions = [d for d in args.distributions.split(",") if d]
    bad = set(args.configs) - {"all_ram", "tiered", "tiered_ahead"}
    bad |= set(args.distributions) - set(engine_compare.DISTRIBUTIONS)
    if bad:
        parser.error(f"unknown configs or distributions: {sorted(bad)}")
    return args


def main(argv=None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["capacity"]:
        # Rows per budget, RAM per disk row, reads per miss: benchmarks/tiered_capacity.py.
        import tiered_capacity

        return tiered_capacity.main(given[1:])
    if given[:1] == ["checkpoint"]:
        # Bytes a full save writes, restore time against fill time: tiered_checkpoint.py.
        import tiered_checkpoint

        return tiered_checkpoint.main(given[1:])
    if given[:1] == ["dlrm"]:
        # The torch DLRM at Criteo-Kaggle cardinalities: benchmarks/tiered_dlrm.py.
        import tiered_dlrm

        return tiered_dlrm.main(given[1:])
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the servers are stopped and the cgroup removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    table_bytes = args.rows * row_bytes(args.dim)
    print(
        f"tiered: {args.rows:,} rows x {row_bytes(args.dim)} B = {table_bytes / 2**30:.2f} GiB "
        f"of rows + Adagrad state, budget {args.budget / 2**30:.3g} GiB "
        f"({table_bytes / args.budget:.1f}x); steps of {args.batch_size:,} ids, "
        f"{args.zipf_warmup} (Zipf) or {args.warmup} (uniform) warmup + {args.steps} timed "
        "per distribution",
        flush=True,
    )
    permutation = np.random.default_rng(1).permutation(args.rows).astype(np.int64)
    grads = (
        np.random.default_rng(args.seed).standard_normal((args.batch_size, args.dim)) * 0.01
    ).astype(np.float32)
    report: dict = {
        "benchmark": "tiered",
        "command": " ".join(["python", os.path.relpath(__file__, REPO)] + (argv or sys.argv[1:])),
        "workload": {
            "rows": args.rows,
            "row_bytes": row_bytes(args.dim),
            "table_bytes": table_bytes,
            "memory_budget": args.budget,
            "table_over_budget": table_bytes / args.budget,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup_uniform": args.warmup,
            "warmup_zipf": args.zipf_warmup,
            "dim": args.dim,
            "optimizer": "adagrad",
            "initializer": "normal(0, 0.01)",
            "distributions": args.distributions,
            "zipf_exponent": 1.1,
            "populate": "every id pushed once with a zero gradient, sequential blocks, untimed",
        },
        "notes": [
            "unique_rows_per_s = the timed steps' distinct ids / their seconds (a step = "
            "row_sparse_pull + push of batch_size ids)",
            "hit_rate = 1 - disk_hits / row_lookups over the timed steps (tier_stats)",
            "bytes_written_per_byte_updated over the timed steps (tier_stats)",
            "max_rss: the server's VmRSS sampled every 0.2 s over its life, including the "
            "interpreter (idle_server_rss) that the budget does not cover",
        ],
        "machine": pull_push.machine(),
        "configs": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvsparse_tiered_") as log_dir:
        for name in args.configs:
            print(f"running {name} (load average {os.getloadavg()[0]:.2f}) ...", flush=True)
            result = report["configs"][name] = {}
            try:
                run_config(name, args, permutation, grads, log_dir, result)
            except Exception as error:  # reported; the other configurations still run
                log = ""
                with contextlib.suppress(OSError):
                    with open(os.path.join(log_dir, f"server_{name}.log")) as f:
                        log = f.read()[-3000:]
                result.update(
                    status="failed",
                    reason=f"{type(error).__name__}: {error}",
                    server_log_tail=log,
                )
                print(f"  {name} failed: {error}\n{log}", flush=True)
        if not args.no_engines:
            print("running engines (SegmentStore vs RocksDB) ...", flush=True)
            disk = report["configs"].get("tiered", {}).get("disk_random_4k_read_limit")
            report["engines"] = run_engines(args, disk)
    report["targets"] = targets(report, args)
    report["total_s"] = time.monotonic() - started
    print_table(report)
    print_targets(report["targets"])
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {os.path.relpath(args.output)} in {report['total_s']:.0f} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
