"""A bounded soak run: servers and workers train for N minutes; RSS sampled; JSON out.

    python benchmarks/soak.py --minutes 3                 # 2 servers, 4 workers
    python benchmarks/soak.py --minutes 1 --servers 1 --workers 2 --output /tmp/soak.json
    python benchmarks/soak.py stress --runs 5 --hogs 2 --pauses   # benchmarks/stress.py

Starts ``--servers`` ``kvsparse server`` processes on free 127.0.0.1 ports and
``--workers`` worker processes (this script with ``--worker``) with the
``KVSPARSE_*`` configuration. Each worker trains an Adagrad table with
Zipf-distributed ids (a skewed, growing key set like real CTR traffic) in
ASP mode (``dist_async``) until the deadline: pull a batch, push a gradient,
and every ``--dense-every`` steps a dense key too. The parent samples the
RSS of every server and worker every ``--sample-seconds`` and writes a JSON
report (default ``benchmarks/results/soak-<time>.json``): configuration,
samples, per-worker steps and errors, server stats at the end, and per
process the RSS growth from the first sample after warm-up (a quarter of
the run) to the last. Exit code 0 if every worker finished without error
and every server is still up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENING = "kvsparse server listening on "


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPARSE_")}
    for name in ("DMLC_ROLE", "PORT", "TF_CONFIG"):
        env.pop(name, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def worker(args) -> int:
    """One worker: train until the deadline, then print a JSON line with its counts."""
    sys.path.insert(0, REPO)
    import kvsparse
    from kvsparse.optimizers import Adagrad

    kv = kvsparse.create("dist_async")
    rng = np.random.default_rng(1000 + kv.rank)
    kv.init("soak", kvsparse.SparseTable(dim=args.dim, optimizer=Adagrad(learning_rate=0.05)))
    kv.init("dense", np.zeros(1024, np.float32))
    steps = pulls = keys = 0
    errors = []
    deadline = float(args.deadline)
    dense = np.zeros(1024, np.float32)
    while time.time() < deadline:
        ids = rng.zipf(1.2, size=args.batch) % args.key_space
        try:
            rows = kv.row_sparse_pull("soak", row_ids=ids)
            kv.push("soak", (ids, 0.01 * rows + 0.001))
            if steps % args.dense_every == 0:
                kv.push("dense", np.full(1024, 0.001, np.float32))
                kv.pull("dense", out=dense)
        except Exception as exc:  # noqa: BLE001 - counted and reported, the soak goes on
            errors.append(repr(exc))
            if len(errors) > 10:
                break
        steps += 1
        pulls += 1
        keys += ids.size
    print(json.dumps({"rank": kv.rank, "steps": steps, "keys": keys, "errors": errors}))
    kv.close()
    return 0 if not errors else 1


def _start_server(max_message_size=None) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "kvsparse.server", "--bind", "tcp://127.0.0.1:0"]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env({}), text=True
    )
    line = process.stdout.readline()
    if not line.startswith(LISTENING):
        process.kill()
        raise RuntimeError(f"server did not start: {line!r} {process.stderr.read()!r}")
    return process, line[len(LISTENING) :].strip()


def _rss(pid: int):
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["stress"]:  # many short jobs under load and pauses (issue 32)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import stress

        return stress.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--key-space", type=int, default=2_000_000)
    parser.add_argument("--dense-every", type=int, default=10)
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    servers = []
    workers = []
    started = time.time()
    deadline = started + 60 * args.minutes
    try:
        for _ in range(args.servers):
            servers.append(_start_server())
        addresses = [address for _, address in servers]
        for rank in range(args.workers):
            env = _env(
                {
                    "KVSPARSE_SERVERS": ",".join(addresses),
                    "KVSPARSE_RANK": rank,
                    "KVSPARSE_NUM_WORKERS": args.workers,
                    "KVSPARSE_TIMEOUT": 60,
                }
            )
            argv = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--deadline",
                repr(deadline),
                "--dim",
                str(args.dim),
                "--batch",
                str(args.batch),
                "--key-space",
                str(args.key_space),
                "--dense-every",
                str(args.dense_every),
            ]
            workers.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            )
        samples = []
        while any(w.poll() is None for w in workers) and time.time() < deadline + 120:
            samples.append(
                {
                    "t": round(time.time() - started, 1),
                    "servers": [_rss(p.pid) for p, _ in servers],
                    "workers": [_rss(w.pid) for w in workers],
                }
            )
            time.sleep(args.sample_seconds)
        results, worker_errors = [], []
        for rank, w in enumerate(workers):
            try:
                out, err = w.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
                out, err = w.communicate()
            lines = [line for line in out.decode().splitlines() if line.startswith("{")]
            results.append(json.loads(lines[-1]) if lines else None)
            if w.returncode != 0:
                worker_errors.append(f"worker {rank} exit {w.returncode}: {err.decode()[-2000:]}")
        servers_up = [p.poll() is None for p, _ in servers]
        sys.path.insert(0, REPO)
        from kvsparse.client.remote import RemoteBackend

        stats = None
        if all(servers_up):
            probe = RemoteBackend(addresses, 0, args.workers, mode="asp", timeout=30)
            stats = probe.stats()
            probe.close()
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        for p, _ in servers:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    elapsed = time.time() - started
    warm = [s for s in samples if s["t"] >= 15 * args.minutes] or samples

    def growth(role, index):
        values = [s[role][index] for s in warm if s[role][index] is not None]
        return None if len(values) < 2 else values[-1] - values[0]

    steps = sum(r["steps"] for r in results if r)
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "deadline")},
        "elapsed_s": round(elapsed, 1),
        "servers_up_at_end": servers_up,
        "workers": results,
        "worker_failures": worker_errors,
        "steps_total": steps,
        "steps_per_s": round(steps / (60 * args.minutes), 1),
        "keys_per_s": round(sum(r["keys"] for r in results if r) / (60 * args.minutes)),
        "rss_mib": {
            "servers_last": [round(v / 2**20, 1) if v else None for v in samples[-1]["servers"]]
            if samples
            else [],
            "servers_peak": [
                round(max(s["servers"][i] or 0 for s in samples) / 2**20, 1)
                for i in range(len(servers))
            ],
            "workers_peak": [
                round(max(s["workers"][i] or 0 for s in samples) / 2**20, 1)
                for i in range(len(workers))
            ],
            "servers_growth_after_warmup": [
                None if growth("servers", i) is None else round(growth("servers", i) / 2**20, 1)
                for i in range(len(servers))
            ],
            "workers_growth_after_warmup": [
                None if growth("workers", i) is None else round(growth("workers", i) / 2**20, 1)
                for i in range(len(workers))
            ],
        },
        "server_stats": stats,
        "samples": samples,
    }
    output = args.output or os.path.join(
        REPO, "benchmarks", "results", time.strftime("soak-%Y%m%d-%H%M%S.json")
    )
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=1, default=str)
    summary = {k: report[k] for k in ("elapsed_s", "steps_total", "steps_per_s", "keys_per_s")}
    print(json.dumps({**summary, "rss_mib": report["rss_mib"], "output": output}, indent=1))
    ok = all(servers_up) and not worker_errors and all(results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
