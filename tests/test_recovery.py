"""A server killed mid-training: restarted from its checkpoint, or a clear ServerUnavailable.

The trace table makes every applied push countable: SGD with lr=1 on a table
of zeros, and each worker pushes a gradient of -1 to a key of its own at each
step (key = step * num_workers + rank). A key then holds exactly the number of
times its push was applied: 1 once, 2 if a retried push were applied twice,
0 if it were lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import REPO_ROOT, ServerProcess, subprocess_env

import kvsparse
from kvsparse import errors

STEPS = 60
CHECKPOINT_EVERY = 5
KILL_AT_STEP = 23

WORKER = r"""
import json, os, sys, time
import numpy as np
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

steps, every = int(sys.argv[1]), int(sys.argv[2])
kv = kvsparse.create("dist_sparse")
rank, n = kv.rank, kv.num_workers
path = os.environ["KVSPARSE_CHECKPOINT_DIR"]
kv.init("trace", kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=SGD(learning_rate=1.0)))
minus_one = -np.ones((1, 1), np.float32)
for step in range(steps):
    kv.push("trace", (np.array([step * n + rank]), minus_one))
    if rank == 0 and (step + 1) % every == 0:
        seq = kv.save(path)
        print(json.dumps({"checkpoint": step, "seq": seq}), flush=True)
    print(f"step {step}", flush=True)
    time.sleep(0.05)  # paced, so that the kill lands mid-training
kv.barrier()
if rank == 0:
    values = kv.row_sparse_pull("trace", row_ids=np.arange(steps * n))[:, 0]
    stats = kv._backend.stats()
    print(json.dumps({
        "values": values.tolist(),
        "restarts": kv._backend.restarts,
        "duplicate_pushes": [s["duplicate_pushes"] for s in stats],
    }), flush=True)
"""


class _Job:
    """`kvsparse launch` in a subprocess, its output lines collected as they come."""

    def __init__(self, argv, env):
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in iter(self.process.stdout.readline, b""):
            with self.changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.changed:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.process.poll() is not None and not self.reader.is_alive():
                    raise AssertionError(f"no line matching {pattern!r}:\n" + self.output())
                self.changed.wait(min(remaining, 0.5))

    def finish(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError("the job did not finish:\n" + self.output()) from None
        self.reader.join(10)
        return code

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def output(self) -> str:
        return "\n".join(self.lines)


def _launch(tmp_path, *options):
    script = tmp_path / "trace_worker.py"
    script.write_text(WORKER)
    argv = [
        sys.executable,
        "-m",
        "kvsparse",
        "launch",
        "-s",
        "2",
        "-n",
        "2",
        "--timeout",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        *options,
        "--",
        sys.executable,
        str(script),
        str(STEPS),
        str(CHECKPOINT_EVERY),
    ]
    return _Job(argv, subprocess_env())


# Server 0 also coordinates barriers and checkpoint manifests; server 1 only serves.
@pytest.mark.parametrize("killed", [0, 1])
def test_killed_server_is_restarted_from_its_checkpoint_and_training_finishes(tmp_path, killed):
    job = _launch(tmp_path, "--restart-servers", "--retry-window", "60")
    try:
        pid = int(job.wait_for(rf"server {killed} \(pid (\d+)\) listening", 60).group(1))
        job.wait_for(rf"\[worker 0\] step {KILL_AT_STEP}$", 60)
        os.kill(pid, signal.SIGKILL)
        code = job.finish(180)
    finally:
        job.stop()
    output = job.output()
    assert code == 0, output
    restarted = rf"server {killed} \(pid \d+\) restarted on (?:tcp|ipc)://\S+ from "
    assert re.search(restarted, output), output
    checkpoints = [
        json.loads(line.split("] ", 1)[1])["checkpoint"]
        for line in job.lines[: next(i for i, x in enumerate(job.lines) if "restarted on" in x)]
        if line.startswith("[worker 0] {")
    ]
    assert checkpoints, "no checkpoint before the kill:\n" + output
    result = json.loads(
        job.lines[[i for i, x in enumerate(job.lines) if '"values"' in x][-1]].split("] ", 1)[1]
    )
    values = np.array(result["values"])
    # No push applied twice, anywhere.
    assert set(np.unique(values)) <= {0.0, 1.0}, values
    assert result["duplicate_pushes"] == [0, 0]
    assert result["restarts"] >= 1
    # Everything up to the last checkpoint taken before the kill survived it.
    covered = (checkpoints[-1] + 1) * 2
    assert (values[:covered] == 1).all(), values[:covered]
    # Lost at most: pushes acknowledged after that checkpoint, on the killed shard.
    assert (values == 0).sum() <= 2 * (CHECKPOINT_EVERY + 1), values
    # Training went on after the restart: the later steps all landed once.
    later = (KILL_AT_STEP + CHECKPOINT_EVERY + 2) * 2
    assert (values[later:] == 1).all(), values[later:]


def test_without_restart_the_job_stops_on_a_dead_server(tmp_path):
    job = _launch(tmp_path)
    try:
        pid = int(job.wait_for(r"server 1 \(pid (\d+)\) listening", 60).group(1))
        job.wait_for(r"\[worker 0\] step 3$", 60)
        os.kill(pid, signal.SIGKILL)
        code = job.finish(60)
    finally:
        job.stop()
    assert code == 1, job.output()
    assert "server 1 exited with code 137; stopping the job" in job.output()


def test_worker_gets_server_unavailable_naming_the_dead_server():
    server = ServerProcess()
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=1
        )
        kv.init("t", kvsparse.SparseTable(dim=2))
        server.kill()
        with pytest.raises(errors.ServerUnavailable, match=re.escape(server.address)) as info:
            kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
        assert info.value.address == server.address
        kv.close()
    finally:
        server.stop()
        server.stderr.close()


def test_retry_window_expires_into_server_unavailable():
    server = ServerProcess()
    try:
        kv = kvsparse.create(
            "dist_async",
            servers=[server.address],
            rank=0,
            num_workers=1,
            timeout=0.5,
            retry_window=1.5,
        )
        kv.init("t", kvsparse.SparseTable(dim=2))
        server.kill()
        with pytest.raises(errors.ServerUnavailable, match="did not come back within"):
            kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
        kv.close()
    finally:
        server.stop()
        server.stderr.close()


def test_client_resends_in_flight_push_once_to_a_restarted_server():
    """A push in flight when its server dies is applied exactly once by the new one."""
    first = ServerProcess()
    second = None
    try:
        kv = kvsparse.create(
            "dist_async", servers=[first.address], rank=0, num_workers=1, timeout=1, retry_window=30
        )
        from kvsparse.initializers import Zeros
        from kvsparse.optimizers import SGD

        kv.init(
            "t", kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=SGD(learning_rate=1.0))
        )
        first.kill()
        done = {}

        def push():
            try:
                kv.push("t", (np.array([7]), -np.ones((1, 1), np.float32)))
                done["ok"] = True
            except Exception as exc:  # noqa: BLE001 - reported below
                done["error"] = exc

        pusher = threading.Thread(target=push)
        pusher.start()
        time.sleep(0.5)  # the push is sent to the dead server and waits
        second = ServerProcess(bind=first.address)  # same port, fresh state
        pusher.join(30)
        assert done == {"ok": True}, done
        # The table was declared again on the blank server, and the push applied once.
        assert kv.row_sparse_pull("t", row_ids=np.array([7])).tolist() == [[1.0]]
        assert kv._backend.restarts == 1
        assert kv._backend.stats()[0]["duplicate_pushes"] == 0
        kv.close()
    finally:
        first.stop()
        first.stderr.close()
        if second is not None:
            second.stop()
            second.stderr.close()
