"""Serving replica benchmark (issue 13): lookup latency idle and while deltas land; freshness.

One ``kvsparse serve --follow`` process serves a table of --rows rows (dim
--dim) saved by a local store in this process. Measured, in one run:

1. Lookups of 1, 64 and 4,096 random stored ids, one client in a closed loop
   for --seconds each: QPS and p50/p99 latency, over ZeroMQ
   (`kvsparse.serving.Client`) and HTTP (raw int64 body, one keep-alive
   connection), and in-process `EmbeddingLookup` on an export of the same
   table as the no-network reference.
2. The same ZeroMQ lookups while deltas of --delta-rows rows land back to
   back (the replica applies each to both of its copies); the share of the
   time the replica spent applying is reported from its own metrics.
3. Freshness: pushes every 50 ms and a delta saved every --save-every
   seconds for --freshness-seconds; /healthz sampled every 100 ms.

Targets (the issue): freshness p99 <= save interval + 2 s; p99 lookup latency
during a delta apply <= 3x its idle p99; zero failed lookups.

Run: ``python benchmarks/serving.py`` (writes benchmarks/results/serving.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests

import kvsparse
from kvsparse.server.listening import read_first_line
from kvsparse.serving import Client, EmbeddingLookup
from kvsparse.serving.server import HTTP_PREFIX, LISTENING_PREFIX
from kvsparse.store.periodic import PeriodicSaver

BATCHES = (1, 64, 4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--delta-rows", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--save-every", type=float, default=5.0)
    p.add_argument("--freshness-seconds", type=float, default=30.0)
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "serving.json")
    )
    return p.parse_args(argv)


def start_replica(path: str):
    argv = [sys.executable, "-m", "kvsparse", "serve", "--checkpoint-dir", path, "--follow"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--http-port", "0", "--poll-interval", "0.05"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    first = read_first_line(process.stdout, deadline).decode()
    second = read_first_line(process.stdout, deadline).decode()
    assert first.startswith(LISTENING_PREFIX) and second.startswith(HTTP_PREFIX), (first, second)
    return process, first[len(LISTENING_PREFIX) :].strip(), second[len(HTTP_PREFIX) :].strip()


def closed_loop(lookup, ids: np.ndarray, batch: int, seconds: float, rng) -> dict:
    """Runs lookup(batch ids) for seconds; QPS, p50/p99 latency (ms), failures."""
    latencies, failures = [], 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        query = ids[rng.integers(0, ids.size, batch)]
        started = time.perf_counter()
        try:
            lookup(query)
        except Exception:  # noqa: BLE001 - counted
            failures += 1
            continue
        latencies.append(time.perf_counter() - started)
    lat = np.array(latencies) * 1e3
    return {
        "lookups": int(lat.size),
        "qps": lat.size / seconds,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "failed": failures,
    }


def update_seconds(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("kvsparse_serving_update_seconds_sum"):
            return float(line.split()[1])
    return 0.0


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    path = tempfile.mkdtemp(prefix="kvsparse-serving-bench-")
    kv = kvsparse.create("local")
    kv.init("emb", kvsparse.SparseTable(dim=args.dim, optimizer=None, seed=1))
    ids = rng.integers(-(2**62), 2**62, args.rows)
    for start in range(0, ids.size, 100_000):
        part = ids[start : start + 100_000]
        kv.push("emb", (part, rng.normal(size=(part.size, args.dim)).astype(np.float32)))
    kv.save(path)
    kv.export(os.path.join(path, "export"))
    reference = EmbeddingLookup(os.path.join(path, "export"))
    process, address, url = start_replica(path)
    result = {"config": vars(args), "idle": {}, "during_delta": {}, "freshness": {}}
    client = Client([address])
    session = requests.Session()

    def http_lookup(query):
        answer = session.post(
            url + "/v1/lookup?table=emb",
            data=query.astype("<i8").tobytes(),
            headers={"Content-Type": "application/octet-stream"},
            timeout=30,
        )
        answer.raise_for_status()

    try:
        for batch in BATCHES:
            result["idle"][batch] = {
                "zmq": closed_loop(
                    lambda q: client.lookup("emb", q), ids, batch, args.seconds, rng
                ),
                "http": closed_loop(http_lookup, ids, batch, args.seconds, rng),
                "in_process_export": closed_loop(
                    lambda q: reference.lookup("emb", q), ids, batch, args.seconds, rng
                ),
            }
        # Deltas of delta_rows rows back to back, while one client looks up.
        stop = threading.Event()
        deltas = [0]

        def land_deltas():
            writer_rng = np.random.default_rng(1)
            while not stop.is_set():
                part = ids[writer_rng.integers(0, ids.size, args.delta_rows)]
                kv.push("emb", (part, np.full((part.size, args.dim), deltas[0], np.float32)))
                seq = kv.save(path, incremental=True)
                deltas[0] += 1
                deadline = time.monotonic() + 30
                while not stop.is_set() and time.monotonic() < deadline:
                    health = session_writer.get(url + "/healthz", timeout=10).json()
                    if health["version"]["seq"] >= seq:
                        break
                    time.sleep(0.005)

        session_writer = requests.Session()
        for batch in BATCHES:
            before, started = update_seconds(url), time.perf_counter()
            deltas[0] = 0
            stop.clear()
            writer = threading.Thread(target=land_deltas)
            writer.start()
            measured = closed_loop(
                lambda q: client.lookup("emb", q), ids, batch, args.seconds * 2, rng
            )
            stop.set()
            writer.join()
            applying = (update_seconds(url) - before) / (time.perf_counter() - started)
            measured.update(deltas=deltas[0], replica_applying_share=applying)
            result["during_delta"][batch] = {"zmq": measured}
        # Freshness: small pushes every 50 ms, a delta every save_every seconds.
        saver = PeriodicSaver(kv, args.save_every, path=path)
        saver._deltas = 0  # the full checkpoint exists: deltas from the first save on
        samples = []
        end = time.monotonic() + args.freshness_seconds
        next_sample = time.monotonic()
        while time.monotonic() < end:
            part = ids[rng.integers(0, ids.size, 64)]
            kv.push("emb", (part, np.ones((64, args.dim), np.float32)))
            saver.maybe_save()
            if time.monotonic() >= next_sample:
                samples.append(
                    session.get(url + "/healthz", timeout=10).json()["freshness_seconds"]
                )
                next_sample += 0.1
            time.sleep(0.05)
        fresh = np.array(samples)
        result["freshness"] = {
            "save_every": args.save_every,
            "samples": int(fresh.size),
            "p50_s": float(np.percentile(fresh, 50)),
            "p99_s": float(np.percentile(fresh, 99)),
            "max_s": float(fresh.max()),
        }
    finally:
        client.close()
        process.terminate()
        process.wait(30)

    print(f"{'batch':>6} {'transport':>18} {'QPS':>9} {'p50 ms':>8} {'p99 ms':>8} {'failed':>6}")
    for phase in ("idle", "during_delta"):
        print(f"-- {phase}")
        for batch, cells in result[phase].items():
            for transport, cell in cells.items():
                print(
                    f"{batch:>6} {transport:>18} {cell['qps']:>9.0f} {cell['p50_ms']:>8.3f} "
                    f"{cell['p99_ms']:>8.3f} {cell['failed']:>6}"
                )
    checks = {}
    for batch in BATCHES:
        idle, busy = result["idle"][batch]["zmq"], result["during_delta"][batch]["zmq"]
        ratio = busy["p99_ms"] / idle["p99_ms"]
        checks[f"p99_ratio_batch_{batch}"] = ratio
        print(
            f"batch {batch}: p99 during deltas / idle = {ratio:.2f} (target <= 3); "
            f"{busy['deltas']} deltas of {args.delta_rows} rows landed, replica applying "
            f"{100 * busy['replica_applying_share']:.0f}% of the time"
        )
    fresh = result["freshness"]
    print(
        f"freshness with a delta every {args.save_every:g} s: p50 {fresh['p50_s']:.2f} s, "
        f"p99 {fresh['p99_s']:.2f} s (target <= {args.save_every + 2:g} s)"
    )
    failed = sum(
        c["failed"]
        for p in ("idle", "during_delta")
        for v in result[p].values()
        for c in v.values()
    )
    print(f"failed lookups: {failed}")
    result["checks"] = {**checks, "failed_lookups": failed}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
