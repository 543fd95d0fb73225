"""W1 over several hosts: throughput as server hosts and worker hosts double, every link capped.

    sudo .venv/bin/python benchmarks/cluster.py                 # every row, 100 Mbit/s links
    sudo .venv/bin/python benchmarks/cluster.py --rate 200mbit --steps 6
    sudo .venv/bin/python benchmarks/cluster.py --quick         # a check that all runs

Hosts are Linux network namespaces on one bridge (tests/netns.py; root needed): each
server host runs one ``python -m kvsparse.server`` bound to its 198.18.0.0/15 address,
each worker host one worker, and every host's link is capped at ``--rate`` both ways with
``tc tbf`` (netem delay is not available here, so the links have rate but no latency).
The rows:

    4 worker hosts against 1, 2 and 4 server hosts     (server scaling)
    1, 2 and 4 worker hosts against 4 server hosts     (worker scaling)

each with float32 and float16 rows on the wire (``wire_dtype``), and each with two loops:
``sequential`` (a step pulls, then pushes) and ``prefetch`` (the torch adapter's loop: a
step's push is not waited for, and the next step's pull goes right behind it, so a link's
two directions work at once). A worker's step is W1's:
``row_sparse_pull`` + ``push`` (Adagrad) of a batch of 65,536 ids drawn Zipf(1.1) over
10^8, dim 64, each worker on its own batches, ASP; the workers meet at a barrier before
and after the timed steps. Reported per row:

    rows_per_s      the distinct ids of every worker's batches / the timed seconds
    step_s          the timed seconds / steps
    bound_s         the link bound of a step: the busiest link's bytes during the timed
                    steps (read from the interfaces' counters, so headers and requests
                    count) / the link rate / steps. In the sequential loop a worker
                    host's link counts both directions added (a step's pull, then its
                    push: one direction idles while the other works); otherwise (server
                    hosts, and the prefetch loop) the busier direction
    duplex_bound_s  the busiest direction of any link / rate / steps: the bound if every
                    step's pull and push overlapped
    step_vs_bound   step_s / bound_s (1.0: the busiest link never idles; target <= 1.3)
    efficiency      per doubling: rows_per_s(2x hosts) / (2 * rows_per_s(x hosts)) (target
                    >= 0.9)

Every link carries its own host's traffic only, so doubling the server hosts halves what
the busiest server link carries (while the servers' links bind), and doubling the worker
hosts doubles the work with the per-link bytes unchanged (while the workers' links bind).
On this machine the hosts share its CPU cores: a row is link-bound only while a step's
CPU time stays below its link time, which is why the rate is capped low.

Writes benchmarks/results/cluster.json (every row, raw per-worker seconds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import netns  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results", "cluster.json")

WORKER = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import workload as wl
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import Adagrad

servers, wire, steps, warmup, batch, seed = (sys.argv[2].split(","), sys.argv[3], int(sys.argv[4]),
                                             int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
rank, n, prefetch = int(sys.argv[8]), int(sys.argv[9]), sys.argv[10] == "prefetch"
kv = kvsparse.create("dist_async", servers=servers, rank=rank, num_workers=n, wire_dtype=wire)
kv.init("emb", kvsparse.SparseTable(dim=wl.DIM, initializer=Zeros(),
                                    optimizer=Adagrad(learning_rate=wl.LEARNING_RATE)))
rng = np.random.default_rng(seed * 1000 + rank)
batches = [wl.zipf_ids(rng, batch) for _ in range(warmup + steps)]
grads = (rng.standard_normal((batch, wl.DIM), dtype=np.float32) * 0.01).astype(np.float32)
out = np.empty((batch, wl.DIM), np.float32)
for ids in batches[:warmup]:
    kv.row_sparse_pull("emb", row_ids=ids, out=out)
    kv.push("emb", (ids, grads))
kv.barrier()
print("TIMING", flush=True)
sys.stdin.readline()  # the benchmark reads the links' counters, then lets every worker go
seconds = []
timed = batches[warmup:]
start = time.perf_counter()
if prefetch:
    # The torch adapter's loop: a step's push is not waited for, the next step's pull is
    # sent right behind it; the last push waits.
    pending = kv.row_sparse_pull("emb", row_ids=timed[0], out=out, wait=False)
    for i, ids in enumerate(timed):
        pending.wait()
        last = i == len(timed) - 1
        kv.push("emb", (ids, grads), wait=last)
        if not last:
            pending = kv.row_sparse_pull("emb", row_ids=timed[i + 1], out=out, wait=False)
        seconds.append(time.perf_counter() - start - sum(seconds))
else:
    for ids in timed:
        kv.row_sparse_pull("emb", row_ids=ids, out=out)
        kv.push("emb", (ids, grads))
        seconds.append(time.perf_counter() - start - sum(seconds))
total = time.perf_counter() - start
kv.barrier()
unique = int(sum(np.unique(ids).size for ids in batches[warmup:]))
print("RESULT " + json.dumps({"rank": rank, "seconds": seconds, "total": total,
                              "unique_rows": unique}), flush=True)
kv.close()
"""

RATE_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bytes_per_second(rate: str) -> float:
    """'100mbit' -> 12.5e6 bytes/s."""
    for unit, scale in RATE_BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise SystemExit(f"--rate {rate!r}: give kbit, mbit or gbit (tc's units)")


def counters(network: netns.Network, host: int) -> tuple:
    """(rx_bytes, tx_bytes) of host's eth0."""
    values = []
    for name in ("rx_bytes", "tx_bytes"):
        text = subprocess.run(
            network.command(host, ["cat", f"/sys/class/net/eth0/statistics/{name}"]),
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        values.append(int(text))
    return tuple(values)


def start_server(network: netns.Network, host: int, log) -> tuple:
    child = network.popen(
        host,
        [sys.executable, "-m", "kvsparse.server", "--bind", f"tcp://{network.addresses[host]}:0"],
        stdout=subprocess.PIPE, stderr=log, env=dict(os.environ, PYTHONPATH=REPO),
    )  # fmt: skip
    line = child.stdout.readline().decode()
    address = line.split()[-1] if "tcp://" in line else None
    if address is None:
        raise RuntimeError(f"server on host {host} did not start: {line!r}")
    return child, address


def run_row(server_hosts: int, worker_hosts: int, wire: str, loop: str, args, log) -> dict:
    """One row: a fresh network of server_hosts + worker_hosts namespaces."""
    with netns.Network(server_hosts + worker_hosts, rate=args.rate, queue=args.queue) as network:
        servers = [start_server(network, h, log)[1] for h in range(server_hosts)]
        script = os.path.join(args.workdir, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        workers = []
        for w in range(worker_hosts):
            argv = [
                sys.executable, script, os.path.join(REPO, "benchmarks", "peers"),
                ",".join(servers), wire, str(args.steps), str(args.warmup), str(args.batch),
                str(args.seed), str(w), str(worker_hosts), loop,
            ]  # fmt: skip
            workers.append(
                network.popen(
                    server_hosts + w,
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    stdin=subprocess.PIPE,
                    env=dict(os.environ, PYTHONPATH=REPO),
                )
            )
        # Counters from the moment every worker reached the timed steps (after a barrier).
        for child in workers:
            line = child.stdout.readline()
            if "TIMING" not in line:
                raise RuntimeError(f"a worker failed before timing: {line!r}")
        before = [counters(network, h) for h in range(len(network.hosts))]
        for child in workers:
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for child in workers:
            out, _ = child.communicate(timeout=args.timeout)
            line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
            if line is None or child.returncode != 0:
                raise RuntimeError(f"a worker failed (code {child.returncode}): {out[-2000:]}")
            results.append(json.loads(line[len("RESULT ") :]))
        after = [counters(network, h) for h in range(len(network.hosts))]
    traffic = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    busiest = [
        max(rx, tx) if host < server_hosts or loop == "prefetch" else rx + tx
        for host, (rx, tx) in enumerate(traffic)
    ]
    duplex = max(max(rx, tx) for rx, tx in traffic)
    seconds = max(r["total"] for r in results)
    rows = sum(r["unique_rows"] for r in results)
    bound = max(busiest) / rate_bytes_per_second(args.rate) / args.steps
    step = seconds / args.steps
    return {
        "server_hosts": server_hosts,
        "worker_hosts": worker_hosts,
        "wire_dtype": wire,
        "loop": loop,
        "rows_per_s": rows / seconds,
        "step_s": step,
        "bound_s": bound,
        "step_vs_bound": step / bound,
        "duplex_bound_s": duplex / rate_bytes_per_second(args.rate) / args.steps,
        "busiest_link_bytes": max(busiest),
        "link_rx_tx_bytes": traffic,
        "link_hosts": ["server"] * server_hosts + ["worker"] * worker_hosts,
        "workers": results,
    }


def efficiencies(rows: list, vary: str, fixed: str, fixed_value: int, wire: str, loop: str) -> list:
    series = sorted(
        (
            r
            for r in rows
            if r[fixed] == fixed_value and r["wire_dtype"] == wire and r["loop"] == loop
        ),
        key=lambda r: r[vary],
    )
    return [
        {
            "wire_dtype": wire,
            "loop": loop,
            vary: f"{a[vary]}->{b[vary]}",
            "speedup": b["rows_per_s"] / a["rows_per_s"],
            "efficiency": b["rows_per_s"] / (a["rows_per_s"] * b[vary] / a[vary]),
        }
        for a, b in zip(series, series[1:])
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="100mbit", help="every link's rate (tc units)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per worker")
    parser.add_argument(
        "--queue", default="200ms", help="tbf latency: how long a packet may queue at a link"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=65536, help="ids per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wire", default="float32,float16")
    parser.add_argument(
        "--loops",
        default="sequential,prefetch",
        help="sequential: pull, then push; prefetch: push not waited for, next pull behind it",
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="2 steps, 8,192 ids, 1 Gbit/s")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.batch, args.rate = 2, 1, 8192, "1gbit"
    reason = netns.unavailable()
    if reason is not None:
        print(f"cannot make hosts here: {reason}", file=sys.stderr)
        return 1
    configs = [(s, 4) for s in (1, 2, 4)] + [(4, w) for w in (1, 2)]
    rows = []
    with tempfile.TemporaryDirectory() as workdir, open(os.path.join(workdir, "log"), "w+") as log:
        args.workdir = workdir
        try:
            for loop, wire in itertools.product(args.loops.split(","), args.wire.split(",")):
                for server_hosts, worker_hosts in configs:
                    row = run_row(server_hosts, worker_hosts, wire, loop, args, log)
                    rows.append(row)
                    print(
                        f"{loop:10} {wire:8} servers {server_hosts} workers {worker_hosts}: "
                        f"{row['rows_per_s']:>12,.0f} rows/s  step {row['step_s']:.3f} s  "
                        f"bound {row['bound_s']:.3f} s  ({row['step_vs_bound']:.2f}x)",
                        flush=True,
                    )
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
    scaling = []
    for loop, wire in itertools.product(args.loops.split(","), args.wire.split(",")):
        for vary, fixed in (("server_hosts", "worker_hosts"), ("worker_hosts", "server_hosts")):
            scaling += [dict(e, vary=vary) for e in efficiencies(rows, vary, fixed, 4, wire, loop)]
    print()
    print(f"{'loop':10} {'wire':8} {'doubling':14} {'speedup':>8} {'efficiency':>10}")
    for e in scaling:
        print(f"{e['loop']:10} {e['wire_dtype']:8} {e['vary'][:6] + ' ' + e[e['vary']]:14} "
              f"{e['speedup']:>8.2f} {e['efficiency']:>10.2f}")  # fmt: skip
    report = {
        "benchmark": "cluster (W1 over network-namespace hosts, tbf-capped links)",
        "command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "rate": args.rate,
        "queue": args.queue,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
        "dim": 64,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "scaling": scaling,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
