"""Server CPU per small request, serving fast path on vs off.

One worker (this process) runs row_sparse_pull + push of 512 ids (of 100,000) of a dim-16
Adagrad table on one ``python -m kvsparse.server`` subprocess (ASP), the e2e-shaped loop;
the server's CPU time (utime + stime from /proc/PID/stat) is read around the timed steps.
Each mode runs --rounds times, alternating, and keeps its best round.

Usage:
    python benchmarks/fast_path.py              # 2000 steps, 2 rounds
    python benchmarks/fast_path.py --steps 500 --rounds 3

Writes benchmarks/results/fast_path.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import kvsparse
from kvsparse.optimizers import Adagrad

BATCH, DIM, IDS = 512, 16, 100_000


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(fast: bool, steps: int, warmup: int = 200) -> dict:
    argv = [sys.executable, "-m", "kvsparse.server", "--bind", "tcp://127.0.0.1:0"]
    if not fast:
        argv.append("--no-fast-path")
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[-1]
        kv = kvsparse.create("dist_async", servers=[address], rank=0, num_workers=1)
        kv.init("emb", kvsparse.SparseTable(dim=DIM, optimizer=Adagrad(learning_rate=0.1)))
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, IDS, BATCH) for _ in range(50)]
        grads = np.ones((BATCH, DIM), np.float32)
        for i in range(warmup):
            kv.row_sparse_pull("emb", row_ids=batches[i % 50])
            kv.push("emb", (batches[i % 50], grads))
        cpu, started = cpu_seconds(server.pid), time.perf_counter()
        for i in range(steps):
            kv.row_sparse_pull("emb", row_ids=batches[i % 50])
            kv.push("emb", (batches[i % 50], grads))
        wall = time.perf_counter() - started
        cpu = cpu_seconds(server.pid) - cpu
        kv.close()
        return {"cpu_per_request_us": cpu / (2 * steps) * 1e6, "step_ms": wall / steps * 1e3}
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/fast_path.json")
    args = parser.parse_args()
    rounds: dict = {"fast": [], "python": []}
    for _ in range(args.rounds):
        for name, fast in (("fast", True), ("python", False)):
            rounds[name].append(run(fast, args.steps))
    best = {
        name: {key: min(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()
    }
    print(f"{'server':10} {'CPU us/request':>15} {'step ms':>9}")
    for name, figures in best.items():
        print(f"{name:10} {figures['cpu_per_request_us']:15.1f} {figures['step_ms']:9.3f}")
    ratio = best["python"]["cpu_per_request_us"] / best["fast"]["cpu_per_request_us"]
    step_ratio = best["python"]["step_ms"] / best["fast"]["step_ms"]
    print(f"python / fast: CPU per request {ratio:.2f}x, step time {step_ratio:.2f}x")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as out:
        json.dump({"best": best, "rounds": rounds, "steps": args.steps}, out, indent=2)


if __name__ == "__main__":
    main()
