"""Benchmark: W1 with 2 workers, colocated against 2 workers + 2 servers.

Workload W1 of benchmarks/pull_push.py (one table of dim 64, float32, Adagrad;
batches of 65,536 ids drawn Zipf(1.1) over 10^8 ids; a step is
row_sparse_pull + push), run by 2 worker processes under BSP, each on its own
batches (worker r takes batches r, r + 2, ...). In the same run, on the same
machine:

- dist_sparse: 2 workers + 2 ``python -m kvsparse.server`` processes (tcp, 127.0.0.1).
- colocated:   2 workers only, each hosting one shard (``KVSPARSE_PEERS``, tcp,
               127.0.0.1): the rows of a worker's own shard are read and
               updated in process, the others over ZeroMQ.

Both run the same worker code, ``kvsparse.create('dist_sparse')``; the
environment alone makes it colocated. The figure of merit is unique rows per
second per worker (a batch's distinct ids / its step time, median over steps);
the report gives colocated / dist_sparse for step, pull and push, and the
share of rows each colocated worker served in process.

Usage:
    python benchmarks/colocated.py              # 20 timed steps per phase
    python benchmarks/colocated.py --quick      # 3 steps, batches of 8,192: a check that it runs

Writes benchmarks/results/colocated.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, REPO)

import common  # noqa: E402
import procs  # noqa: E402
import workload as wl  # noqa: E402

NUM_WORKERS = 2
SERVER_LINE = r"kvsparse server listening on (tcp://\S+)"


def worker(args) -> int:
    """One worker: W1 on its batches through kvsparse.create('dist_sparse'); writes its result."""
    import kvsparse

    work = wl.Workload.load(args.workload)
    kv = kvsparse.create("dist_sparse", timeout=120)
    rank = kv.rank
    batches = work.batches[rank::NUM_WORKERS]
    kv.init("embedding", kvsparse.SparseTable(dim=wl.DIM, seed=0))
    kv.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS))
    out = np.empty((work.batch_size, wl.DIM), np.float32)

    def pull(b):
        kv.row_sparse_pull("embedding", out=out, row_ids=batches[b])

    def push(b):
        kv.push("embedding", (batches[b], work.grads))

    kv.barrier()
    times = common.run_phases(args.warmup, args.steps, pull, push)
    backend = kv._backend
    extra = {
        "backend": type(backend).__name__,
        "unique": [int(np.unique(b).size) for b in batches],
        "rows_in_process": getattr(backend, "rows_in_process", 0),
        "rows_total": getattr(backend, "rows_total", None),
    }
    kv.close()
    common.write_result(args.result, times, **extra)
    return 0


def run_job(name: str, workload_path: str, args, log_dir: str) -> list:
    """Runs the 2 workers of one system; their results, by rank."""
    with procs.Processes(log_dir) as processes:
        if name == "dist_sparse":
            servers = [
                processes.start(
                    f"server{i}",
                    [
                        sys.executable,
                        "-m",
                        "kvsparse.server",
                        "--bind",
                        "tcp://127.0.0.1:0",
                    ],  # fmt: skip
                )
                for i in range(NUM_WORKERS)
            ]
            addresses = [processes.wait_for_line(s, SERVER_LINE, timeout=60) for s in servers]
            cluster = {"KVSPARSE_SERVERS": ",".join(addresses)}
        else:
            peers = [f"tcp://127.0.0.1:{procs.free_port()}" for _ in range(NUM_WORKERS)]
            cluster = {"KVSPARSE_PEERS": ",".join(peers)}
        workers = []
        for rank in range(NUM_WORKERS):
            result = os.path.join(log_dir, f"{name}-{rank}.json")
            env = procs.child_env(
                {**cluster, "KVSPARSE_RANK": str(rank), "KVSPARSE_NUM_WORKERS": str(NUM_WORKERS)}
            )
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--workload",
                    workload_path, "--result", result, "--steps", str(args.steps),
                    "--warmup", str(args.warmup)]  # fmt: skip
            workers.append((processes.start(f"{name}-worker{rank}", argv, env), result))
        results = []
        for proc, result in workers:
            code = processes.wait(proc, timeout=args.timeout)
            if code != 0:
                raise RuntimeError(f"{name}: a worker exited {code}; see {processes.log_of(proc)}")
            with open(result) as f:
                results.append(json.load(f))
        return results


def summarize(results: list, args) -> dict:
    """Median unique rows/s per worker for each phase, and the in-process share."""
    plan = common.phase_batches(args.warmup, args.steps)
    summary = {}
    for phase in common.PHASES:
        rates = []
        for result in results:
            unique = np.array(result["unique"])[list(plan[phase])]
            rates.append(float(np.median(unique / np.array(result["times"][phase]))))
        summary[phase] = {"rows_per_s_per_worker": float(np.mean(rates)), "per_worker": rates}
    totals = [r["rows_total"] for r in results if r["rows_total"]]
    if totals:
        share = [r["rows_in_process"] / r["rows_total"] for r in results]
        summary["in_process_share"] = share
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20, help="timed batches per phase")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument("--quick", action="store_true", help="3 steps of 8,192 ids")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "colocated.json"))
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.steps, args.warmup, args.batch_size = 3, 1, 8192
    batches = NUM_WORKERS * common.num_batches(args.warmup, args.steps)
    work = wl.make(batches, args.batch_size, fold_rows=2, seed=0)
    log_dir = tempfile.mkdtemp(prefix="kvsparse-colocated-bench-")
    workload_path = os.path.join(log_dir, "w1.npz")
    work.save(workload_path)
    systems = {}
    for name in ("dist_sparse", "colocated"):
        started = time.monotonic()
        systems[name] = summarize(run_job(name, workload_path, args, log_dir), args)
        systems[name]["wall_s"] = time.monotonic() - started
    ratios = {
        phase: systems["colocated"][phase]["rows_per_s_per_worker"]
        / systems["dist_sparse"][phase]["rows_per_s_per_worker"]
        for phase in common.PHASES
    }
    print(f"W1, {NUM_WORKERS} workers, BSP, batches of {args.batch_size}, {args.steps} steps")
    print(f"{'phase':6} {'dist_sparse rows/s':>20} {'colocated rows/s':>18} {'ratio':>7}")
    for phase in common.PHASES:
        dist = systems["dist_sparse"][phase]["rows_per_s_per_worker"]
        colo = systems["colocated"][phase]["rows_per_s_per_worker"]
        print(f"{phase:6} {dist:20,.0f} {colo:18,.0f} {ratios[phase]:7.2f}")
    share = systems["colocated"]["in_process_share"]
    print("rows served in process, per colocated worker: " + ", ".join(f"{s:.1%}" for s in share))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "workload": {
                    "batch_size": args.batch_size,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "workers": NUM_WORKERS,
                },  # fmt: skip
                "systems": systems,
                "ratio_colocated_over_dist_sparse": ratios,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "command": "python benchmarks/colocated.py" + (" --quick" if args.quick else ""),
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}; logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
