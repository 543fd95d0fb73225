"""What a server needs to go on after a crash or a failed checkpoint (issue 11, defects 6, 12-15).

Real `kvsparse server` processes: killed during a save and replaced on the
same port, restarted from a checkpoint (``--restore ... --restarted``), made
to fail a save with a full disk, or fed a corrupt checkpoint to load.

Disk full is simulated with RLIMIT_FSIZE set on the running server process
from outside (``resource.prlimit``): its forked writer inherits the limit, and
a write past it fails with EFBIG (CPython ignores SIGXFSZ), as a write to a
full disk fails with ENOSPC; raising the limit again frees the "disk". The
one test-only hook is ``KVSPARSE_FAULT_INJECTION=checkpoint-writer-stall``
(`kvsparse.config.fault_injection`): the writer waits before it writes, so
that a test can kill its server during a save.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import numpy as np

import kvsparse
from kvsparse import errors
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD
from tests.conftest import ServerProcess

WAIT_SECONDS = 30.0


def _children(pid: int) -> list[int]:
    """The child processes of pid (every thread's), from /proc."""
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as f:
                found += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return found


def _wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(*servers) -> None:
    for server in servers:
        if server is not None:
            server.stop()
            server.stderr.close()


def _sgd_table(dim: int = 2, **policy) -> kvsparse.SparseTable:
    return kvsparse.SparseTable(
        dim=dim, initializer=Zeros(), optimizer=SGD(learning_rate=1.0), **policy
    )


# -- defect 14: the forked writer keeps no inherited socket ------------------------------------


def test_server_killed_during_a_save_is_replaced_on_its_port_at_once(tmp_path):
    server = ServerProcess(env={"KVSPARSE_FAULT_INJECTION": "checkpoint-writer-stall"})
    replacement = None
    writer = None
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=2
        )
        kv.init("t", _sgd_table())
        kv.push("t", (np.array([1, 2]), np.ones((2, 2), np.float32)))
        outcome = {}

        def save():
            try:
                kv.save(str(tmp_path / "ckpt"))
            except errors.KVSparseError as exc:
                outcome["error"] = exc

        saver = threading.Thread(target=save, daemon=True)
        saver.start()
        writer = _wait_for(lambda: _children(server.process.pid), "the checkpoint writer")[0]
        server.kill()  # the writer (stalled) lives on
        replacement = ServerProcess(bind=server.address)
        saver.join(WAIT_SECONDS)
        assert not saver.is_alive()
        assert isinstance(outcome.get("error"), errors.ServerUnavailable), outcome
        kv.close()
    finally:
        if writer is not None:
            try:
                os.kill(writer, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _stop(server, replacement)
