"""Fault injection: kill -9, SIGSTOP/SIGCONT and disk full under `kvsparse launch`, counted.

    python benchmarks/faults.py                       # every scenario, ASP and BSP, 3 runs each
    python benchmarks/faults.py --scenario server-kill-1 --mode bsp --runs 1 --steps 60

Each run is a real job: `kvsparse launch -s 2 -n 2 --restart-servers --checkpoint-dir D`
with a marker worker (the colocated-* scenarios: `kvsparse launch --colocated --restart-
workers -n 2 --checkpoint-dir D`, where a killed worker takes its shard along, is started
again and resumes at `kv.clock`). The marker table is SGD(lr=1) over zeros, dim 1; at step s
worker r pushes a gradient of -1 to its own marker id s * n + r, so a marker ends holding
the number of times its push was applied: 0 = lost, 1 = applied once, 2 = applied twice.
Rank 0 saves a checkpoint every few steps and once at the end; the final state is read back
by loading the newest complete checkpoint into a `local` store, so a run whose job failed is
counted too.

Every line a worker prints carries its wall time (one host, one clock): a push acknowledged
(`push` returned) before rank 0 *started* a checkpoint that later committed must be in it.
Counted per run:
    applied_once, lost, applied_twice  over every marker acknowledged by a worker
    lost_covered                       lost although no fault may lose it (must be 0): any
                                       push when no server was killed; with a server killed,
                                       one acknowledged before the last checkpoint committed
                                       before the kill started, or after the kill
    lost_exposed                       acknowledged between that checkpoint's start and the
                                       kill, lost with the killed server (allowed: a
                                       restarted server restores its last checkpoint)
    unacknowledged_applied             sent but never acknowledged (a killed worker), found
Exit code 0 when no run applied a push twice, lost one covered by a checkpoint, or ended
other than the scenario expects (finished, or stopped naming the killed worker).
JSON report: benchmarks/results/faults-<time>.json.

The test suite runs a short version of each scenario (tests/test_faults.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys, time
import numpy as np
import kvsparse
from kvsparse import errors
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

kind, steps, every, pace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
kv = kvsparse.create(kind)
rank, n = kv.rank, kv.num_workers
path = os.environ["KVSPARSE_CHECKPOINT_DIR"]
sgd = SGD(learning_rate=1.0)
kv.init("marker", kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=sgd))


def say(**fields):
    print(json.dumps(dict(fields, time=time.time())), flush=True)


saved_once = False


def save(step):
    # Deltas after the first full checkpoint, as long jobs do (a save that fails must
    # not become the next delta's parent).
    global saved_once
    say(saving=step)
    try:
        say(saved=step, seq=kv.save(path, incremental=saved_once))
        saved_once = True
    except errors.KVSparseError as exc:  # a failed save (disk full) is reported, not fatal
        say(save_failed=step, error=f"{type(exc).__name__}: {exc}")


minus_one = -np.ones((1, 1), np.float32)
# kv.clock: 0, or for a colocated worker restarted by `launch --restart-workers`, the pushes
# its rank had made less the last one (redone): one push a step, so the step to resume at.
if kv.clock:
    say(resumed=kv.clock)
for step in range(kv.clock, steps):
    say(sending=step)
    kv.push("marker", (np.array([step * n + rank]), minus_one))
    say(acked=step)
    if rank == 0 and (step + 1) % every == 0:
        save(step)
    time.sleep(pace)
kv.barrier()
if rank == 0:
    save(steps)
say(done=True)
"""

# name -> (what is done, to whom, at which step of worker 0)
SCENARIOS = {
    "none": None,
    "server-kill-0": ("kill", "server 0"),
    "server-kill-1": ("kill", "server 1"),
    "server-stop-1": ("stop", "server 1"),
    "worker-stop-1": ("stop", "worker 1"),
    "worker-kill-1": ("kill", "worker 1"),
    "disk-full-1": ("disk-full", "server 1"),
    # `kvsparse launch --colocated --restart-workers -n 2`: the worker dies with its shard,
    # is started again, restores its shard from the last checkpoint and resumes.
    "colocated-worker-kill-0": ("kill", "worker 0"),
    "colocated-worker-kill-1": ("kill", "worker 1"),
}
MODES = {"asp": "dist_async", "bsp": "dist_sparse"}
PID_LINE = re.compile(r"(server|worker) (\d+) \(pid (\d+)\) (?:listening|started)")
WORKER_LINE = re.compile(r"^\[worker (\d+)\] (\{.*\})$")


class Job:
    """`kvsparse launch` in a subprocess; its lines collected with the pids it announces."""

    def __init__(self, argv: list, env: dict):
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.changed = threading.Condition()
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in iter(self.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.changed:
                self.lines.append(line)
                match = PID_LINE.search(line)
                if match:  # a restarted server announces its new pid the same way
                    self.pids[f"{match[1]} {match[2]}"] = int(match[3])
                self.changed.notify_all()

    def wait_until(self, predicate, timeout: float) -> bool:
        """Waits until predicate(lines) holds; False on timeout or when the job has ended."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(self.lines):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.reader.is_alive():
                    return False
                self.changed.wait(min(remaining, 0.5))
            return True

    def finish(self, timeout: float) -> int | None:
        """The job's exit code, or None if it had to be killed after timeout."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            code = None
        self.reader.join(10)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def worker_records(lines: list) -> list:
    """(rank, record) for every JSON line a worker printed."""
    records = []
    for line in lines:
        match = WORKER_LINE.match(line)
        if match:
            records.append((int(match[1]), json.loads(match[2])))
    return records


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSPARSE_", "DMLC_"))}
    for name in ("PORT", "TF_CONFIG"):
        env.pop(name, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _inject(job: Job, action: str, target: str, hold: float) -> dict:
    """Does the fault to target's current pid; returns what was done, with times."""
    pid = job.pids[target]
    done = {"action": action, "target": target, "pid": pid}
    if action == "kill":
        os.kill(pid, signal.SIGKILL)
    done["time"] = time.time()
    if action == "stop":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(hold)
        os.kill(pid, signal.SIGCONT)
    elif action == "disk-full":
        # The server's forked checkpoint writer inherits the limit: its shard file cannot
        # grow past 64 bytes, as on a full disk. Lifted once a save has failed (or after
        # a minute); the saves after it must work again.
        limit = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (64, limit[1]))
        done["save_failed"] = job.wait_until(
            lambda lines: any("save_failed" in r for _, r in worker_records(lines)), 60
        )
        try:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limit)
        except ProcessLookupError:  # the server died of it: the run reports that
            done["target_died"] = True
    done["released"] = time.time()
    return done


def _final_markers(checkpoint_dir: str, count: int) -> tuple:
    """(markers of the newest complete checkpoint, its number), loaded into a local store."""
    sys.path.insert(0, REPO)
    import kvsparse

    kv = kvsparse.create("local")
    try:
        seq = kv.load(checkpoint_dir)
        values = kv.row_sparse_pull("marker", row_ids=np.arange(count, dtype=np.int64))[:, 0]
    finally:
        kv.close()
    return values, seq


# An acknowledgement this close after a kill may still be the dead server's reply: the
# worker reads its clock after the reply arrives, the harness right after os.kill.
KILL_GRACE_SECONDS = 1.0


def count(
    records: list, values: np.ndarray, workers: int, killed_server_at=None, stopped=False
) -> dict:
    """The counts of the module docstring, from the workers' records and the final markers.

    killed_server_at: the wall time a server was killed, or None. Only then may a push be
    lost, and only one acknowledged after the last checkpoint committed before the kill
    started (up to the kill): the restarted server restores that checkpoint.
    stopped: the job stopped early (a killed worker): its servers, and every push after
    the last committed checkpoint's start, went with it.
    """
    acked, sent = {}, set()
    saving, committed = {}, []  # committed: (start, end) of each checkpoint
    for rank, record in records:
        if "acked" in record:
            acked[(rank, record["acked"])] = record["time"]
        elif "sending" in record:
            sent.add((rank, record["sending"]))
        elif "saving" in record:
            saving[record["saving"]] = record["time"]
        elif "saved" in record:
            committed.append((saving[record["saved"]], record["time"]))
    exposed_from = exposed_to = float("inf")
    if killed_server_at is not None:
        before = [start for start, end in committed if end < killed_server_at]
        exposed_from = max(before) if before else float("-inf")
        exposed_to = killed_server_at + KILL_GRACE_SECONDS
    if stopped:
        starts = [start for start, _ in committed]
        exposed_from = min(exposed_from, max(starts) if starts else float("-inf"))
        exposed_to = float("inf")
    result = dict.fromkeys(
        (
            "applied_once",
            "lost",
            "applied_twice",
            "lost_covered",
            "lost_exposed",
            "unacknowledged_applied",
            "applied_never_sent",
        ),
        0,
    )
    for marker, value in enumerate(values):
        key = (marker % workers, marker // workers)
        if value > 1:
            result["applied_twice"] += 1
        if key not in sent:
            result["applied_never_sent"] += int(value != 0)
        elif key not in acked:
            result["unacknowledged_applied"] += int(value == 1)
        elif value == 1:
            result["applied_once"] += 1
        elif value == 0:
            result["lost"] += 1
            exposed = exposed_from <= acked[key] <= exposed_to
            result["lost_exposed" if exposed else "lost_covered"] += 1
    result["acknowledged"] = len(acked)
    result["checkpoints_committed"] = len(committed)
    result["saves_failed"] = sum("save_failed" in r for _, r in records)
    return result


def run(
    scenario: str,
    mode: str,
    steps: int,
    every: int,
    pace: float,
    at_step: int,
    hold: float,
    timeout: float,
    workdir: str,
) -> dict:
    """One job under one fault; returns its counts, outcome and the job's output."""
    checkpoint_dir = os.path.join(workdir, "ckpt")
    script = os.path.join(workdir, "marker_worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    colocated = scenario.startswith("colocated-")
    placement = (
        ["--colocated", "--restart-workers"] if colocated else ["-s", "2", "--restart-servers"]
    )
    argv = [
        sys.executable, "-m", "kvsparse", "launch", *placement, "-n", "2",
        "--timeout", str(timeout), "--retry-window", "60",
        "--checkpoint-dir", checkpoint_dir, "--",
        sys.executable, script, MODES[mode], str(steps), str(every), str(pace),
    ]  # fmt: skip
    fault = SCENARIOS[scenario]
    started = time.monotonic()
    job = Job(argv, _env())
    injected = None
    try:
        if fault is not None:
            reached = job.wait_until(
                lambda lines: any(
                    rank == 0 and r.get("acked") == at_step for rank, r in worker_records(lines)
                ),
                120,
            )
            if reached:
                injected = _inject(job, fault[0], fault[1], hold)
        code = job.finish(300)
    finally:
        job.stop()
    records = worker_records(job.lines)
    output = "\n".join(job.lines)
    workers = 2
    finished = all(any(r.get("done") for k, r in records if k == rank) for rank in range(workers))
    try:
        values, seq = _final_markers(checkpoint_dir, steps * workers)
        killed_server_at = None
        # A colocated worker hosts a shard: its kill is a server's kill too.
        if (
            injected
            and injected["action"] == "kill"
            and (colocated or fault[1].startswith("server"))
        ):
            killed_server_at = injected["time"]
        counts = count(records, values, workers, killed_server_at, stopped=not finished)
        counts["checkpoint"] = seq
    except Exception as exc:  # noqa: BLE001 - reported as the run's failure
        counts = {"error": f"reading the final checkpoint: {type(exc).__name__}: {exc}"}
    expected = _expected_outcome(scenario, code, finished, output)
    ok = (
        expected
        and counts.get("applied_twice") == 0
        and counts.get("lost_covered") == 0
        and counts.get("applied_never_sent") == 0
    )
    return {
        "scenario": scenario,
        "mode": mode,
        "exit_code": code,
        "finished": finished,
        "injected": injected,
        "seconds": round(time.monotonic() - started, 1),
        "counts": counts,
        "outcome_ok": expected,
        "ok": ok,
        # A failed run keeps the launcher's lines other than the per-step ones.
        "output": output[-2000:]
        if ok
        else "\n".join(x for x in job.lines if '"sending"' not in x and '"acked"' not in x),
    }


def _expected_outcome(scenario: str, code, finished: bool, output: str) -> bool:
    """A killed worker stops the job, naming it; every other fault is survived."""
    if scenario == "worker-kill-1":
        return code not in (0, None) and "worker 1 exited with code" in output
    if scenario.startswith("disk-full"):  # the limit must have made a save fail
        return code == 0 and finished and '"save_failed"' in output
    return code == 0 and finished


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--mode", action="append", choices=sorted(MODES))
    parser.add_argument("--runs", type=int, default=3, help="runs per scenario and mode")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=5, help="rank 0 saves every N steps")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds between steps")
    parser.add_argument("--at-step", type=int, default=23, help="fault when worker 0 is here")
    parser.add_argument("--hold", type=float, default=2.0, help="seconds a SIGSTOP lasts")
    parser.add_argument("--timeout", type=float, default=5.0, help="the job's --timeout")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    runs = []
    for scenario in args.scenario or list(SCENARIOS):
        for mode in args.mode or sorted(MODES):
            for index in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="kvsparse-faults-") as workdir:
                    result = run(
                        scenario, mode, args.steps, args.every, args.pace, args.at_step,
                        args.hold, args.timeout, workdir,
                    )  # fmt: skip
                runs.append(result)
                c = result["counts"]
                print(
                    f"{scenario:14s} {mode} #{index}: {'ok ' if result['ok'] else 'BAD'} "
                    f"exit {result['exit_code']} once {c.get('applied_once')} "
                    f"lost {c.get('lost')} (covered {c.get('lost_covered')}) "
                    f"twice {c.get('applied_twice')} {result['seconds']} s"
                    + (f" {c['error']}" if "error" in c else ""),
                    flush=True,
                )
    output = args.output or os.path.join(
        REPO, "benchmarks", "results", f"faults-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"settings": vars(args), "runs": runs}, f, indent=1)
    print(f"wrote {output}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
