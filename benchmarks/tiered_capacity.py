"""How many rows a server's memory budget holds with the disk tier (issue 33's baseline).

Run as `python benchmarks/tiered.py capacity [options]` (this module holds the phase;
benchmarks/tiered.py the server, RSS and counter helpers it shares with the throughput
benchmark).

Per configuration (dim 16, 32, 64 x SGD, Adagrad by default), one fresh
`kvsparse server --memory-budget BUDGET --spill-dir DIR` (48 MiB by default) holds one
float32 table with Normal(0, 0.01) init. A worker pushes blocks of new ids (sequential,
zero gradients: --sgd-batch 65,536 ids for SGD, --adagrad-batch 16,384 for Adagrad)
until the server refuses one (LimitExceeded), the table reaches --max-ratio x the
budget (30 by default: the issue's target), or --config-seconds pass. Then a short
Zipf(1.1) phase on the filled table counts disk reads per missed row.

Reported per configuration:
- rows_held: the table's rows when the fill stopped (a refused push applies nothing);
- table_over_budget: rows_held x row_bytes / budget, row_bytes = dim x 4 x (1 + the
  optimizer's slots per value: 0 for SGD, 1 for Adagrad), the table's values and state
  as the issue sizes it (target >= 30); disk_over_budget: the spill files' bytes / budget;
- ram_per_disk_row: disk_index_bytes / rows_on_disk from the tier's counters
  (kv.stats()["tables"][name]["tier"]): the RAM the disk index holds per row on disk
  (target <= 2 B); the index is counted at its capacity (16-byte slots, a power of two,
  80% full at most), so the figure moves between ~20 and ~40 B as the index doubles;
- holds_at_stop: what held the budget then: the table's in-memory arrays and row index
  (memory_bytes - disk_index_bytes, allocated rows even when empty), the disk index, the
  shard's budget_used_at_stop, and the room MakeRoom keeps for the
  index to double (2 x disk_index_bytes once the rows in memory and on disk plus one
  block would fill it past 80%: csrc/table_tier.cc, recomputed here from the counters);
- refusal: the LimitExceeded message, and the bytes it says the request needed;
- rss: the server's RSS growth (VmRSS at the end of each block minus VmRSS of the idle
  server with the table made), its max over the blocks and over a 0.2 s sampler, against
  the issue's bound budget x 1.15 + 32 MiB;
- zipf: --zipf-steps steps (after --zipf-warmup untimed ones) of a pull, then a push, of
  the distinct ids among --zipf-batch Zipf(1.1) draws over the rows held (ranks scattered
  by a fixed permutation, benchmarks/engine_compare.py's draw). A step the filled table
  refuses (LimitExceeded) ends the phase: outcome "refused", with the message, the
  operation and what held the budget.

Reads per miss (the issue: <= 1.1), per measured step and summed over them:

    missed rows = distinct ids of the step on disk when the step began
                = the pull's disk_hits (the tier counts each distinct id it finds on disk);
    disk reads  = records read from disk by the step's pull and push
                = the tier's `disk_reads` counter where it has one, else the disk_hits
                  of the pull and the push together (this store reads each disk hit
                  with exactly one pread of its record: SegmentStore::ReadBatch);
    reads_per_miss = sum(disk reads) / sum(missed rows).

A row the pull brings into memory and the tier moves out again before the push (to
settle the budget) is read twice: 2 reads for 1 miss. Cross-check, `bytes_reads_per_miss`:
the tier's bytes_read over the same steps / the record's slot bytes (bytes written per row
moved out during the fill) / missed rows; it also counts garbage collection's reads
(gc_bytes_moved is given beside it). A pull the budget cannot take is read through
without bringing rows back, and the tier then counts its disk rows twice (once before
refusing to make room): keep --zipf-batch well below the budget's rows.

Usage:
    python benchmarks/tiered.py capacity                      # 6 configurations, 48 MiB
                                                              # (~15 s on main, <= ~10 min)
    python benchmarks/tiered.py capacity --budget 4MiB --sgd-batch 4096 \\
        --adagrad-batch 2048 --dims 16 --zipf-steps 3          # smoke (tests/)

Writes benchmarks/results/tiered_capacity.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import tiered  # benchmarks/ is on sys.path: this module runs under tiered.py

import kvsparse

TABLE = tiered.TABLE
OPTIMIZER_SLOTS = {"sgd": 0, "adagrad": 1}  # optimizer state floats per value
RATIO_TARGET = 30.0
RAM_PER_DISK_ROW_TARGET = 2.0
READS_PER_MISS_TARGET = 1.1
RSS_FACTOR, RSS_SLACK = 1.15, 32 << 20  # growth <= budget x 1.15 + 32 MiB
# MakeRoom keeps room for the disk index to double once it would pass 80% full.
INDEX_SLOT_BYTES, INDEX_MAX_LOAD = 16, 0.8
NEEDED = re.compile(r"\(([\d.]+) (B|KiB|MiB|GiB|TiB) in all")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def row_bytes(dim: int, optimizer: str) -> int:
    """A row's values and optimizer state in float32: what the issue sizes a table by."""
    return dim * 4 * (1 + OPTIMIZER_SLOTS[optimizer])


def make_optimizer(name: str):
    if name == "sgd":
        return kvsparse.optimizers.SGD(learning_rate=tiered.wl.LEARNING_RATE)
    return kvsparse.optimizers.Adagrad(learning_rate=tiered.wl.LEARNING_RATE, eps=tiered.wl.EPS)


def needed_bytes(message: str) -> int | None:
    """The bytes a LimitExceeded message says the request needed ('(48.2 MiB in all')."""
    match = NEEDED.search(message)
    return None if match is None else int(float(match.group(1)) * UNITS[match.group(2)])


def what_holds(tier: dict, incoming: int) -> dict:
    """The budget's holders by the tier's counters (see the module docstring)."""
    index = tier.get("disk_index_bytes", 0)
    entries = index // INDEX_SLOT_BYTES
    filling = tier.get("rows_on_disk", 0) + tier.get("rows_in_memory", 0) + incoming
    reserve = 2 * index if index and filling > entries * INDEX_MAX_LOAD else 0
    return {
        "table_memory_bytes": tier.get("memory_bytes", 0) - index,
        "disk_index_bytes": index,
        "index_doubling_reserve": reserve,
    }


def tier_of(kv) -> dict:
    return tiered.tier_counters(tiered.table_stats(kv))


def budget_used(kv) -> int | None:
    shards = kv.stats().get("shards", [])
    memory = shards[0].get("memory", {}) if shards else {}
    return memory.get("used")


# -- the fill ------------------------------------------------------------------------------------


def fill(kv, dim: int, optimizer: str, batch: int, args, pid: int, idle_rss: int, sampler):
    """Blocks of new ids until refused, --max-ratio x the budget, or --config-seconds."""
    per_row = row_bytes(dim, optimizer)
    cap_rows = math.ceil(args.max_ratio * args.budget / per_row)
    zeros = np.zeros((batch, dim), np.float32)
    blocks, rows, outcome, refusal = [], 0, "cap_reached", None
    slot_bytes = None
    sampler.phase = "fill"
    started = time.perf_counter()
    while rows < cap_rows:
        if time.perf_counter() - started > args.config_seconds:
            outcome = "time_limit"
            break
        count = min(batch, cap_rows - rows)
        ids = np.arange(rows, rows + count, dtype=np.int64)
        try:
            kv.push(TABLE, (ids, zeros[:count]))
        except kvsparse.errors.LimitExceeded as error:
            outcome, refusal = "refused", str(error)
            break
        rows += count
        tier = tier_of(kv)
        rss = tiered.vm_rss(pid) or 0
        blocks.append(
            {
                "rows": rows,
                "rows_on_disk": tier.get("rows_on_disk", 0),
                "disk_index_bytes": tier.get("disk_index_bytes", 0),
                "rss_growth": rss - idle_rss,
                "seconds": time.perf_counter() - started,
            }
        )
        if tier.get("evictions") and not tier.get("gc_bytes_moved"):
            # New ids leave no garbage: every byte written is a row moved out.
            slot_bytes = tier["bytes_written"] / tier["evictions"]
    sampler.sample()
    seconds = time.perf_counter() - started
    tier = tier_of(kv)
    stored = int(tiered.table_stats(kv)["rows"])
    if stored != rows:
        raise RuntimeError(f"the table holds {stored} rows, {rows} were pushed")
    on_disk = tier.get("rows_on_disk", 0)
    growth = [b["rss_growth"] for b in blocks]
    result = {
        "outcome": outcome,
        "rows_held": rows,
        "row_bytes": per_row,
        "table_bytes": rows * per_row,
        "table_over_budget": rows * per_row / args.budget,
        "disk_over_budget": tier.get("disk_bytes", 0) / args.budget,
        "rows_in_memory": tier.get("rows_in_memory", 0),
        "rows_on_disk": on_disk,
        "ram_per_disk_row": tier.get("disk_index_bytes", 0) / on_disk if on_disk else None,
        "disk_index_bytes_per_row_held": tier.get("disk_index_bytes", 0) / rows if rows else None,
        "holds_at_stop": what_holds(tier, batch),
        "budget_used_at_stop": budget_used(kv),
        "fill_seconds": seconds,
        "rows_per_s": rows / seconds if seconds else None,
        "blocks": len(blocks),
        "slot_bytes": slot_bytes,
        "tier_at_stop": tier,
        "rss": {
            "idle_server_rss": idle_rss,
            "max_growth_at_block_ends": max(growth, default=0),
            "max_growth_sampled": max(
                (s[1] for s in sampler.samples if s[2] == "fill"), default=idle_rss
            )
            - idle_rss,
            "bound": args.budget * RSS_FACTOR + RSS_SLACK,
        },
        "block_series": thin(blocks, 120),
    }
    rss = result["rss"]
    worst = max(rss["max_growth_at_block_ends"], rss["max_growth_sampled"])
    rss["max_growth_over_budget"] = worst / args.budget
    rss["within_bound"] = worst <= rss["bound"]
    if refusal is not None:
        result["refusal"] = {
            "message": refusal,
            "request_rows": batch,
            "request_row_bytes": batch * per_row,
            "needed_bytes": needed_bytes(refusal),
        }
    return result


def thin(points: list, most: int) -> list:
    step = max(1, math.ceil(len(points) / most))
    kept = points[::step]
    if points and kept[-1] is not points[-1]:
        kept.append(points[-1])
    return kept


# -- the Zipf phase ------------------------------------------------------------------------------


def zipf_phase(kv, dim: int, rows: int, args, slot_bytes, sampler) -> dict:
    """Reads per missed row over Zipf(1.1) pull + push steps (the module docstring)."""
    rng = np.random.default_rng(args.seed)
    permutation = rng.permutation(rows).astype(np.int64)
    grads = (rng.standard_normal((args.zipf_batch, dim)) * 0.01).astype(np.float32)
    out = np.empty((args.zipf_batch, dim), np.float32)
    sampler.phase = "zipf"
    misses, reads, per_step, refusal = 0, 0, [], None
    first = tier_of(kv)
    for step in range(args.zipf_warmup + args.zipf_steps):
        ids = np.unique(tiered.draw_ids("zipf1.1", rng, args.zipf_batch, rows, permutation))
        measured = step >= args.zipf_warmup
        if measured and step == args.zipf_warmup:
            first = tier_of(kv)
        before = tier_of(kv) if measured else None
        operation = "pull"
        try:
            kv.row_sparse_pull(TABLE, out=out[: ids.size], row_ids=ids)
            pulled = tier_of(kv) if measured else None
            operation = "push"
            kv.push(TABLE, (ids, grads[: ids.size]))
        except kvsparse.errors.LimitExceeded as error:
            # The filled table's budget cannot take one step's rows: that is the finding.
            refusal = {
                "step": step,
                "measured": measured,
                "operation": operation,
                "distinct_ids": int(ids.size),
                "message": str(error),
                "needed_bytes": needed_bytes(str(error)),
                "holds": what_holds(tier_of(kv), int(ids.size)),
            }
            break
        if not measured:
            continue
        after = tier_of(kv)
        missed = pulled["disk_hits"] - before["disk_hits"]
        if "disk_reads" in after:
            read = after["disk_reads"] - before["disk_reads"]
        else:
            read = after["disk_hits"] - before["disk_hits"]
        misses += missed
        reads += read
        per_step.append({"distinct_ids": int(ids.size), "missed_rows": missed, "disk_reads": read})
    sampler.sample()
    last = tier_of(kv)
    delta = tiered.counter_delta(first, last)
    result = {
        "outcome": "done" if refusal is None else "refused",
        "steps": args.zipf_steps,
        "steps_measured": len(per_step),
        "warmup": args.zipf_warmup,
        "draws_per_step": args.zipf_batch,
        "disk_reads_counter": "disk_reads" if "disk_reads" in last else "disk_hits",
        "missed_rows": misses,
        "disk_reads": reads,
        "reads_per_miss": reads / misses if misses else None,
        # Over the measured steps only (a refused warm-up step measured none).
        "hit_rate": tiered.derived(delta).get("hit_rate") if per_step else None,
        "per_step": per_step,
        "tier_delta": delta,
    }
    if refusal is not None:
        result["refusal"] = refusal
    if slot_bytes and misses:
        result["bytes_reads_per_miss"] = delta.get("bytes_read", 0) / slot_bytes / misses
        result["gc_bytes_moved"] = delta.get("gc_bytes_moved", 0)
    return result


# -- one configuration -----------------------------------------------------------------------------


def run_config(dim: int, optimizer: str, args, log_dir: str, result: dict) -> None:
    """One fresh server: the fill, then the Zipf phase; fills `result` as it goes."""
    batch = args.sgd_batch if optimizer == "sgd" else args.adagrad_batch
    result.update(dim=dim, optimizer=optimizer, batch=batch, budget=args.budget)
    spill_dir = tempfile.mkdtemp(prefix="kvsparse_capacity_spill_", dir=args.spill_root)
    extra = ["--memory-budget", str(args.budget), "--spill-dir", spill_dir]
    name = f"server_d{dim}_{optimizer}"
    try:
        with tiered.procs.Processes(log_dir) as processes:
            address, pid = tiered.start_server(processes, name, extra, None)
            sampler = tiered.RssSampler(pid)
            try:
                with kvsparse.create("dist_sparse", servers=[address], rank=0, num_workers=1) as kv:
                    kv.init(
                        TABLE,
                        kvsparse.SparseTable(
                            dim=dim, initializer=kvsparse.initializers.Normal(0.0, 0.01), seed=0
                        ),
                    )
                    kv.set_optimizer(make_optimizer(optimizer))
                    time.sleep(0.3)
                    idle = sampler.sample() or 0
                    result["fill"] = fill(kv, dim, optimizer, batch, args, pid, idle, sampler)
                    rows = result["fill"]["rows_held"]
                    if args.zipf_steps > 0 and rows > 0:
                        result["zipf"] = zipf_phase(
                            kv, dim, rows, args, result["fill"]["slot_bytes"], sampler
                        )
                    result["load_average"] = os.getloadavg()[0]
            finally:
                sampler.stop()
                result["rss_max"] = max((s[1] for s in sampler.samples), default=0)
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)


def print_config(config: dict) -> None:
    f, z = config.get("fill", {}), config.get("zipf", {})
    ram = f.get("ram_per_disk_row")
    rpm = z.get("reads_per_miss")
    zipf_refused = (
        ""
        if z.get("outcome") != "refused"
        else (
            f" (Zipf {z['refusal']['operation']} of {z['refusal']['distinct_ids']:,} rows refused "
            f"at step {z['refusal']['step']})"
        )
    )
    print(
        f"  dim {config['dim']} {config['optimizer']}: {f.get('outcome')} at "
        f"{f.get('rows_held', 0):,} rows = {f.get('table_over_budget', 0):.2f}x the budget; "
        f"{'-' if ram is None else f'{ram:.1f}'} B RAM per disk row; RSS growth "
        f"{f.get('rss', {}).get('max_growth_over_budget', 0):.2f}x the budget; reads per miss "
        f"{'-' if rpm is None else f'{rpm:.2f}'}{zipf_refused}",
        flush=True,
    )


def print_table(report: dict) -> None:
    header = (
        f"{'dim':>4} {'optimizer':<9}{'batch':>8}{'outcome':>13}{'rows held':>12}"
        f"{'table/budget':>14}{'B RAM/disk row':>16}{'RSS growth/budget':>19}"
        f"{'reads/miss':>12}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for config in report["configs"]:
        if "fill" not in config:
            print(f"{config['dim']:>4} {config['optimizer']:<9}failed: {config.get('reason')}")
            continue
        f, z = config["fill"], config.get("zipf", {})
        ram, rpm = f["ram_per_disk_row"], z.get("reads_per_miss")
        rpm_text = "-" if rpm is None else f"{rpm:.2f}"
        if z.get("outcome") == "refused":
            rpm_text = "refused" if rpm is None else rpm_text + " (refused)"
        print(
            f"{config['dim']:>4} {config['optimizer']:<9}{config['batch']:>8,}"
            f"{f['outcome']:>13}{f['rows_held']:>12,}{f['table_over_budget']:>13.2f}x"
            f"{'-' if ram is None else f'{ram:.1f}':>16}"
            f"{f['rss']['max_growth_over_budget']:>18.2f}x"
            f"{rpm_text:>12}"
        )


def targets(report: dict) -> dict:
    """Per configuration, the issue's bounds and whether each was met."""
    found = {}
    for config in report["configs"]:
        f, z = config.get("fill"), config.get("zipf", {})
        if not f:
            continue
        entry = {
            "table_over_budget": f["table_over_budget"],
            "table_over_budget_met": f["table_over_budget"] >= RATIO_TARGET,
            "ram_per_disk_row": f["ram_per_disk_row"],
            "ram_per_disk_row_met": f["ram_per_disk_row"] is not None
            and f["ram_per_disk_row"] <= RAM_PER_DISK_ROW_TARGET,
            "rss_growth_within_bound": f["rss"]["within_bound"],
        }
        if z.get("outcome") == "refused":
            entry["zipf_step_refused"] = True
        if z.get("reads_per_miss") is not None:
            entry["reads_per_miss"] = z["reads_per_miss"]
            entry["reads_per_miss_met"] = z["reads_per_miss"] <= READS_PER_MISS_TARGET
        found[f"dim{config['dim']}_{config['optimizer']}"] = entry
    return found


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="tiered.py capacity", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="48MiB", help="each server's --memory-budget")
    parser.add_argument("--dims", default="16,32,64")
    parser.add_argument("--optimizers", default="sgd,adagrad")
    parser.add_argument("--sgd-batch", type=int, default=65536, help="new ids per SGD push")
    parser.add_argument("--adagrad-batch", type=int, default=16384, help="per Adagrad push")
    parser.add_argument(
        "--max-ratio", type=float, default=RATIO_TARGET, help="stop at this table / budget"
    )
    parser.add_argument(
        "--config-seconds",
        type=float,
        default=90.0,
        help="stop a configuration's fill after this long (reported as time_limit; 6 x 90 s "
        "keeps a run that fills every table to 30x within ~10 minutes)",
    )
    parser.add_argument("--zipf-batch", type=int, default=16384, help="Zipf draws per step")
    parser.add_argument("--zipf-steps", type=int, default=20, help="measured Zipf steps")
    parser.add_argument("--zipf-warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="what else ran on the machine, for the JSON")
    parser.add_argument("--spill-root", default=None, help="where spill dirs go (default: TMPDIR)")
    parser.add_argument(
        "--output", default=os.path.join(tiered.HERE, "results", "tiered_capacity.json")
    )
    args = parser.parse_args(argv)
    args.budget = tiered.parse_size(args.budget)
    args.dims = [int(d) for d in args.dims.split(",") if d]
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    bad = set(args.optimizers) - set(OPTIMIZER_SLOTS)
    if bad:
        parser.error(f"unknown optimizers: {sorted(bad)}")
    return args


def load() -> dict:
    """The machine's load: uptime's line and the 1/5/15-minute load averages."""
    uptime = ""
    with contextlib.suppress(OSError):
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": uptime, "load_average": list(os.getloadavg())}


def main(argv=None) -> int:
    """The capacity phase; argv: its options (without the word 'capacity')."""
    if argv is None:
        argv = sys.argv[1:]
        argv = argv[1:] if argv[:1] == ["capacity"] else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    print(
        f"tiered capacity: budget {args.budget / 2**20:.0f} MiB, dims {args.dims} x "
        f"{args.optimizers}, blocks of {args.sgd_batch:,} (SGD) / {args.adagrad_batch:,} "
        f"(Adagrad) new ids until refused or {args.max_ratio:g}x the budget",
        flush=True,
    )
    report: dict = {
        "benchmark": "tiered_capacity",
        "command": shlex.join(
            ["python", os.path.relpath(tiered.__file__, tiered.REPO), "capacity", *argv]
        ),
        "workload": {
            "memory_budget": args.budget,
            "dims": args.dims,
            "optimizers": args.optimizers,
            "sgd_batch": args.sgd_batch,
            "adagrad_batch": args.adagrad_batch,
            "max_ratio": args.max_ratio,
            "config_seconds": args.config_seconds,
            "initializer": "normal(0, 0.01)",
            "fill": "blocks of new sequential ids pushed with zero gradients",
            "zipf": {
                "draws_per_step": args.zipf_batch,
                "warmup": args.zipf_warmup,
                "steps": args.zipf_steps,
                "exponent": 1.1,
            },
        },
        "notes": [
            "table_over_budget = rows_held x dim x 4 x (1 + optimizer slots) / budget",
            "ram_per_disk_row = tier disk_index_bytes / rows_on_disk at the fill's end",
            "reads_per_miss = disk reads of the measured Zipf steps' pulls and pushes / the "
            "distinct ids on disk when each step began (the pulls' disk_hits); see "
            "benchmarks/tiered_capacity.py",
            "rss growth = server VmRSS - VmRSS of the idle server with its table made; bound "
            "budget x 1.15 + 32 MiB",
        ],
        "targets_of_issue_33": {
            "table_over_budget_at_least": RATIO_TARGET,
            "ram_per_disk_row_at_most": RAM_PER_DISK_ROW_TARGET,
            "reads_per_miss_at_most": READS_PER_MISS_TARGET,
            "rss_growth_at_most": "budget x 1.15 + 32 MiB",
        },
        "machine": tiered.pull_push.machine(),
        "load_before": load(),
        "load_note": args.note,
        "configs": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvsparse_capacity_") as log_dir:
        for optimizer in args.optimizers:
            for dim in args.dims:
                print(f"running dim {dim} {optimizer} ...", flush=True)
                config: dict = {}
                report["configs"].append(config)
                try:
                    run_config(dim, optimizer, args, log_dir, config)
                except Exception as error:  # reported; the other configurations still run
                    log = ""
                    with contextlib.suppress(OSError):
                        path = os.path.join(log_dir, f"server_d{dim}_{optimizer}.log")
                        with open(path) as f:
                            log = f.read()[-3000:]
                    config.update(
                        status="failed", reason=f"{type(error).__name__}: {error}", log=log
                    )
                    print(f"  failed: {error}\n{log}", flush=True)
                    continue
                print_config(config)
    report["load_after"] = load()
    report["targets"] = targets(report)
    report["total_s"] = time.monotonic() - started
    print_table(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {os.path.relpath(args.output)} in {report['total_s']:.0f} s total")
    return 0
