"""The stress harness of issue 32: many short jobs under load and pauses; every row checked.

    python benchmarks/soak.py stress --runs 5                      # every mode, 5 runs each
    python benchmarks/soak.py stress --modes ipc-bsp --runs 200    # the issue's scenario
    python benchmarks/soak.py stress --modes ipc-bsp --runs 100 --hogs 2
    python benchmarks/soak.py stress --quick                       # CI: every mode once

Each run is one ``kvsparse launch`` job of the mode (servers over ipc or tcp,
or colocated; BSP, SSP or ASP; with or without ``--save-every``; one or two
threads per worker) running the scenario that hung (issue 32): every worker
thread pushes 100 rows of ones (50 shared ids, 50 of its own) to a
``SparseTable(dim=4, initializer=Zeros(), optimizer=SGD(learning_rate=0.5))``
every 30 ms for ``--seconds`` (a fixed time, so the workers' push counts
differ), pulls now and then (some sent before a push and read after it,
checked for whole push counts), sends ``row_sparse_prefetch`` requests it never
reads (the next call reads their replies), calls ``kv.barrier()``, then checks every row
exactly: each thread's own rows give its push count, and the shared rows must
be the sum of them all. Beside the job run ``--hogs`` CPU-bound processes,
and a pauser sends SIGSTOP to a random server or worker of the job for
0.1-2 s (``--pauses``), then SIGCONT.

A run that has not ended ``--hang-seconds`` after its training time counts as
a hang: its workers' Python stacks are dumped (faulthandler, SIGUSR1) into the
report before the job is killed. The JSON report (default
``benchmarks/results/stress-<time>.json``) has per mode the runs, hangs,
failures (a wrong row, an error) and run times. Exit code 0 when no run hung
or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mode -> (launch arguments, store kind, threads per worker, save every second)
MODES = {
    "ipc-bsp": (["-s", "2", "-n", "2"], "dist_sparse", 1, False),
    "tcp-bsp": (["-s", "2", "-n", "2", "--transport", "tcp"], "dist_sparse", 1, False),
    "colocated-bsp": (["-n", "2", "--colocated"], "dist_sparse", 1, False),
    "ipc-ssp": (["-s", "2", "-n", "2", "--staleness", "1"], "dist_sparse", 1, False),
    "colocated-ssp": (["-n", "2", "--colocated", "--staleness", "1"], "dist_sparse", 1, False),
    "ipc-asp": (["-s", "2", "-n", "2"], "dist_async", 1, False),
    "tcp-asp": (["-s", "2", "-n", "2", "--transport", "tcp"], "dist_async", 1, False),
    "colocated-asp": (["-n", "2", "--colocated"], "dist_async", 1, False),
    "ipc-bsp-save": (["-s", "2", "-n", "2"], "dist_sparse", 1, True),
    "colocated-bsp-save": (["-n", "2", "--colocated"], "dist_sparse", 1, True),
    "tcp-asp-save": (["-s", "2", "-n", "2", "--transport", "tcp"], "dist_async", 1, True),
    "ipc-bsp-threads": (["-s", "2", "-n", "2"], "dist_sparse", 2, False),
    "tcp-ssp-threads": (
        ["-s", "2", "-n", "2", "--transport", "tcp", "--staleness", "1"],
        "dist_sparse",
        2,
        False,
    ),
    "colocated-asp-threads": (["-n", "2", "--colocated"], "dist_async", 2, False),
}
LEARNING_RATE = 0.5
SHARED = 50  # ids every thread pushes
OWN = 50  # ids of one thread


def own_ids(rank: int, thread: int):
    import numpy as np

    return 1_000_000 + 1000 * (rank * 16 + thread) + np.arange(OWN, dtype=np.int64)


def worker(args) -> int:
    """One worker of a stress run: push for a fixed time, barrier, check every row exactly."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.path.insert(0, REPO)
    import numpy as np

    import kvsparse
    from kvsparse.initializers import Zeros
    from kvsparse.optimizers import SGD

    kv = kvsparse.create(args.kind)
    table = kvsparse.SparseTable(
        dim=4, initializer=Zeros(), optimizer=SGD(learning_rate=LEARNING_RATE)
    )
    kv.init("t", table)
    shared = np.arange(SHARED, dtype=np.int64)
    counts = [0] * args.threads
    failures = []

    def check_pending(rows, thread: int) -> None:
        """A pull read after a later push: whole push counts, as of when it was sent."""
        pushes = -rows / LEARNING_RATE
        if rows.shape != (SHARED, 4) or not np.all(pushes == np.round(pushes)) or pushes.min() < 0:
            failures.append(f"thread {thread}: a deferred pull read {rows}")

    def train(thread: int) -> None:
        ids = np.concatenate([shared, own_ids(kv.rank, thread)])
        ones = np.ones((ids.size, 4), np.float32)
        deadline = time.monotonic() + args.seconds
        try:
            pending = None
            while time.monotonic() < deadline:
                if counts[thread] % 3 == 1:
                    # A prefetch left unread: the store's next call reads its reply
                    # (sent only where pulls are deferred; a no-op on a table in RAM).
                    kv.row_sparse_prefetch("t", row_ids=ids)
                kv.push("t", (ids, ones))
                counts[thread] += 1
                if pending is not None:
                    check_pending(pending.wait(), thread)
                    pending = None
                if counts[thread] % 7 == 0:
                    # A pull sent before the next push and read after it.
                    pending = kv.row_sparse_pull("t", row_ids=shared, wait=False)
                elif counts[thread] % 5 == 0:
                    kv.row_sparse_pull("t", row_ids=shared)
                time.sleep(0.03)
            if pending is not None:
                check_pending(pending.wait(), thread)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON line
            failures.append(repr(exc))

    threads = [threading.Thread(target=train, args=(t,)) for t in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kv.barrier()
    seen = {}
    for rank in range(kv.num_workers):
        for thread in range(args.threads):
            rows = kv.row_sparse_pull("t", row_ids=own_ids(rank, thread))
            pushes = -rows / LEARNING_RATE
            if not (np.all(pushes == pushes.flat[0]) and pushes.flat[0] == round(pushes.flat[0])):
                failures.append(f"rank {rank} thread {thread}: rows not one push count: {rows}")
            seen[(rank, thread)] = int(round(float(pushes.flat[0])))
    for thread in range(args.threads):
        if seen[(kv.rank, thread)] != counts[thread]:
            failures.append(
                f"thread {thread}: {counts[thread]} pushes made, rows say {seen[(kv.rank, thread)]}"
            )
    total = sum(seen.values())
    rows = kv.row_sparse_pull("t", row_ids=shared)
    if not np.all(rows == -LEARNING_RATE * total):
        failures.append(f"shared rows {rows[0]} != {-LEARNING_RATE * total} ({total} pushes)")
    kv.barrier()  # nobody closes while another still reads
    print(json.dumps({"rank": kv.rank, "pushes": counts, "total": total, "failures": failures}))
    kv.close()
    return 0 if not failures else 1


def _descendants(pid: int) -> list:
    """Every process below pid (from /proc: Linux)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found.extend(children)
            queue.extend(children)
    return found


def _python_processes(pid: int) -> list:
    """The servers and workers of a launch (python processes below it)."""
    chosen = []
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and b"python" in os.path.basename(argv[0]):
            chosen.append(child)
    return chosen


class Pauser(threading.Thread):
    """SIGSTOPs a random server or worker of the job for 0.1-2 s, then SIGCONTs it, in a loop."""

    def __init__(self, launch_pid: int, rng: random.Random, gap: float = 0.5):
        super().__init__(daemon=True)
        self.launch_pid, self.rng, self.gap = launch_pid, rng, gap
        self.stopping = threading.Event()
        self.pauses = 0

    def run(self) -> None:
        while not self.stopping.wait(self.rng.uniform(0.2, 2 * self.gap)):
            targets = _python_processes(self.launch_pid)
            if not targets:
                continue
            target = self.rng.choice(targets)
            try:
                os.kill(target, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            self.pauses += 1
            self.stopping.wait(self.rng.uniform(0.1, 2.0))
            try:
                os.kill(target, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPARSE_")}
    for name in ("DMLC_ROLE", "PORT", "TF_CONFIG"):
        env.pop(name, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_once(
    mode: str, seconds: float, hang_seconds: float, pauses: bool, rng, worker_argv=None
) -> dict:
    """One launch of mode: {"outcome": ok|hang|fail, "seconds", "pauses", "detail"}.

    worker_argv: the workers' command instead of this script's worker (tests).
    """
    launch_args, kind, threads, save = MODES[mode]
    with tempfile.TemporaryDirectory(prefix="kvsparse-stress-") as workdir:
        argv = [sys.executable, "-m", "kvsparse", "launch", *launch_args]
        if save:
            argv += ["--checkpoint-dir", os.path.join(workdir, "ckpt"), "--save-every", "1"]
        if worker_argv is None:
            worker_argv = [sys.executable, os.path.abspath(__file__), "--worker", "--kind", kind]
            worker_argv += ["--threads", str(threads), "--seconds", str(seconds)]
        argv += ["--", *worker_argv]
        out = open(os.path.join(workdir, "out"), "w+")
        started = time.monotonic()
        launch = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=workdir,
            start_new_session=True,
        )
        pauser = Pauser(launch.pid, rng) if pauses else None
        if pauser is not None:
            pauser.start()
        outcome = "ok"
        try:
            launch.wait(seconds + hang_seconds)
        except subprocess.TimeoutExpired:
            outcome = "hang"
        finally:
            if pauser is not None:
                pauser.stopping.set()
                pauser.join()
                for pid in _python_processes(launch.pid):  # nothing stays stopped
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
        if outcome == "hang":
            for pid in _python_processes(launch.pid):  # the workers' stacks, into out
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        elapsed = time.monotonic() - started
        out.seek(0)
        text = out.read()
        out.close()
        if outcome == "ok":
            outcome = parse_outcome(launch.returncode, text)
        return {
            "outcome": outcome,
            "seconds": round(elapsed, 2),
            "pauses": pauser.pauses if pauser is not None else 0,
            "detail": "" if outcome == "ok" else text[-6000:],
        }


def parse_outcome(returncode: int, text: str) -> str:
    """ "ok" when the launch exited 0 and both workers printed a report without failures."""
    if returncode != 0:
        return "fail"
    reports = []
    for line in text.splitlines():
        if line.startswith("[worker ") and "] {" in line:
            reports.append(json.loads(line.split("] ", 1)[1]))
    if len(reports) != 2 or any(report["failures"] for report in reports):
        return "fail"
    return "ok"


def _hog() -> subprocess.Popen:
    """A CPU-bound process (the load beside the job)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; default all")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument("--seconds", type=float, default=5.0, help="training time of a run")
    parser.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside the job")
    parser.add_argument("--pauses", action="store_true", help="SIGSTOP servers and workers")
    parser.add_argument("--hang-seconds", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="CI: every mode once, 2 s, pauses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="dist_sparse", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.runs, args.seconds, args.pauses = 1, 2.0, True
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    rng = random.Random(args.seed)
    hogs = [_hog() for _ in range(args.hogs)]
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "kind", "threads")},
        "modes": {},
    }
    started = time.monotonic()
    try:
        for run in range(args.runs):
            for mode in modes:
                result = run_once(mode, args.seconds, args.hang_seconds, args.pauses, rng)
                entry = report["modes"].setdefault(
                    mode, {"runs": 0, "hangs": 0, "failures": 0, "seconds": [], "problems": []}
                )
                entry["runs"] += 1
                entry["hangs"] += result["outcome"] == "hang"
                entry["failures"] += result["outcome"] == "fail"
                entry["seconds"].append(result["seconds"])
                if result["outcome"] != "ok":
                    entry["problems"].append(result)
                print(
                    f"{mode:24s} run {run + 1:3d}: {result['outcome']:4s} "
                    f"{result['seconds']:6.1f} s, {result['pauses']} pauses",
                    flush=True,
                )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["hangs"] = sum(m["hangs"] for m in report["modes"].values())
    report["failures"] = sum(m["failures"] for m in report["modes"].values())
    print(f"{'mode':24s} {'runs':>5s} {'hangs':>6s} {'fails':>6s} {'median s':>9s}")
    for mode, entry in report["modes"].items():
        median = sorted(entry["seconds"])[len(entry["seconds"]) // 2]
        print(
            f"{mode:24s} {entry['runs']:5d} {entry['hangs']:6d} {entry['failures']:6d} "
            f"{median:9.1f}"
        )
    output = args.output or os.path.join(
        REPO, "benchmarks", "results", time.strftime("stress-%Y%m%d-%H%M%S.json")
    )
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {output}")
    return 0 if report["hangs"] == 0 and report["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
