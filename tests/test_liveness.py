"""Liveness: nothing waits for ever for a worker or server that is gone.

- A worker that leaves a BSP job (exits cleanly, is killed, or is stopped past
  the servers' heartbeat timeout) makes the others' rounds, barriers and
  follower calls fail with `WorkerLeft` naming its rank, instead of blocking
  for ever while the servers answer pings.
- ``kvsparse launch`` logs a worker's clean early exit and names it when the
  others then fail.
- A restarted server serves a late rank's ``set_optimizer``,
  also under ``kvsparse launch --restart-servers`` in ASP.
- A refused or unresolvable server address fails at once, named.

Every worker is a real process against real servers, under a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ServerProcess, run_workers, subprocess_env
from test_launch import Job
from test_recovery import _Job

import kvsparse
from kvsparse import errors
from kvsparse.server.listening import read_first_line

WORKER_TIMEOUT = 60.0

# Rank 1 leaves after the barrier (how: argv[1]); rank 0 then waits for it in a BSP push and
# in a barrier, and prints what each raised.
LEAVER = r"""
import json, os, signal, sys, time
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse", timeout=5)
kv.init("t", kvsparse.SparseTable(dim=2))
kv.barrier()
if kv.rank == 1:
    if sys.argv[1] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "stopped":
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)
outcomes = {}
for what, call in [
    ("push", lambda: kv.push("t", (np.array([1, 2]), np.ones((2, 2), np.float32)))),
    ("barrier", kv.barrier),
]:
    try:
        call()
        outcomes[what] = "returned"
    except kvsparse.errors.KVSparseError as exc:
        outcomes[what] = [type(exc).__name__, str(exc)]
print(json.dumps(outcomes), flush=True)
"""


def _start(script: str, servers: list, rank: int, num_workers: int, tmp_path, *args, env=None):
    """One worker process (stdout piped) with the cluster variables set."""
    path = tmp_path / f"worker_{rank}.py"
    path.write_text(script)
    worker_env = {
        "KVSPARSE_SERVERS": ",".join(servers),
        "KVSPARSE_RANK": rank,
        "KVSPARSE_NUM_WORKERS": num_workers,
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(worker_env),
        cwd=str(tmp_path),
        text=True,
    )


def _finish(process: subprocess.Popen, timeout: float = WORKER_TIMEOUT) -> tuple:
    """(exit code, stdout, stderr); a process still running after timeout is killed (fails)."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"worker still blocked after {timeout} s:\n{out}\n{err}")
    return process.returncode, out, err


def _assert_left(outcome, rank: int) -> None:
    assert outcome != "returned", "a call waiting for a worker that left returned"
    name, message = outcome
    assert name == "WorkerLeft", outcome
    assert re.search(rf"\brank {rank}\b", message), message


@pytest.mark.parametrize("how", ["exited", "killed"])
def test_bsp_push_and_barrier_fail_naming_a_worker_that_left(server_factory, tmp_path, how):
    servers = server_factory(2)
    workers = [_start(LEAVER, servers, rank, 2, tmp_path, how) for rank in range(2)]
    code, out, err = _finish(workers[0])
    _finish(workers[1])
    assert code == 0, err
    outcomes = json.loads(out.splitlines()[-1])
    _assert_left(outcomes["push"], 1)
    _assert_left(outcomes["barrier"], 1)
    for server in server_factory.processes:
        log = server.error_output()
        if how == "killed":  # each server says so
            assert re.search(r"worker rank 1 left", log), log
        else:  # its store said goodbye at exit: a normal end, logged only if it failed a call
            assert "killed" not in log and "left" not in log, log


def test_worker_stopped_past_the_heartbeat_timeout_counts_as_left(tmp_path):
    servers = [ServerProcess(env={"KVSPARSE_HEARTBEAT_TIMEOUT": "1"})]
    stopped = None
    try:
        stopped = _start(LEAVER, [servers[0].address], 1, 2, tmp_path, "stopped")
        waiting = _start(LEAVER, [servers[0].address], 0, 2, tmp_path, "stopped")
        code, out, err = _finish(waiting)
        assert code == 0, err
        outcomes = json.loads(out.splitlines()[-1])
        _assert_left(outcomes["push"], 1)
        _assert_left(outcomes["barrier"], 1)
    finally:
        if stopped is not None:
            stopped.kill()  # SIGKILL ends a stopped process too
            stopped.communicate()
        for server in servers:
            server.stop()
            server.stderr.close()


SSP_AND_FOLLOWERS = r"""
import json, sys, time
import numpy as np
import kvsparse
from kvsparse.optimizers import SGD

kv = kvsparse.create("dist_sparse_async", timeout=5, staleness=0)
kv.init("t", kvsparse.SparseTable(dim=2))
kv.barrier()
if kv.rank == 0:
    sys.exit(0)  # leaves: rank 1 pulls ahead of it, and waits for its set_optimizer
outcomes = {}
kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
for what, call in [
    ("ssp pull", lambda: kv.row_sparse_pull("t", row_ids=np.array([1]))),
    ("set_optimizer", lambda: kv.set_optimizer(SGD(learning_rate=0.1))),
]:
    try:
        call()
        outcomes[what] = "returned"
    except kvsparse.errors.KVSparseError as exc:
        outcomes[what] = [type(exc).__name__, str(exc)]
print(json.dumps(outcomes), flush=True)
"""


def test_ssp_pull_and_set_optimizer_fail_when_rank_0_left(server_factory, tmp_path):
    outputs = run_workers(SSP_AND_FOLLOWERS, server_factory(1), 2, tmp_path, timeout=WORKER_TIMEOUT)
    outcomes = json.loads(outputs[1].splitlines()[-1])
    _assert_left(outcomes["ssp pull"], 0)
    _assert_left(outcomes["set_optimizer"], 0)


def test_a_rank_that_left_fails_the_round_and_is_waited_for_again_once_back(server_factory):
    """A store closed in a BSP job fails the others' round; a new store of that rank rejoins."""
    servers = server_factory(1)
    table = kvsparse.SparseTable(dim=1, initializer=kvsparse.initializers.Zeros())
    ones = (np.array([3]), np.ones((1, 1), np.float32))

    def create(rank):
        store = kvsparse.create("dist_sparse", servers=servers, rank=rank, num_workers=2, timeout=5)
        store.init("t", table)
        return store

    stores = [create(0), create(1)]
    try:
        stores[1].close()  # rank 1 leaves
        outcome = {}

        def push():
            try:
                stores[0].push("t", ones)
                outcome["returned"] = True
            except errors.KVSparseError as exc:
                outcome["error"] = exc

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        pusher.join(WORKER_TIMEOUT)
        assert not pusher.is_alive(), "the push still waits for rank 1, which left"
        assert isinstance(outcome.get("error"), errors.WorkerLeft), outcome
        assert re.search(r"\brank 1\b", str(outcome["error"]))
        stores[1] = create(1)  # back: the next round waits for it, and completes
        pusher = threading.Thread(target=stores[1].push, args=("t", ones), daemon=True)
        pusher.start()
        stores[0].push("t", ones)
        pusher.join(WORKER_TIMEOUT)
        # No optimizer: the round's sum of both workers' pushes replaces the row.
        assert stores[0].row_sparse_pull("t", row_ids=np.array([3])).tolist() == [[2.0]]
        # Every worker leaves: the job is over. The next one's workers arrive one by one,
        # and rank 0's barrier waits for rank 1 instead of failing at once.
        for store in stores:
            store.close()
        time.sleep(2)  # past the server's 1 s wait for a reconnection: both have left
        stores = [create(0)]
        barriers = {}

        def wait_at_barrier(rank):
            try:
                stores[rank].barrier()
                barriers[rank] = "returned"
            except errors.KVSparseError as exc:
                barriers[rank] = exc

        waiters = [threading.Thread(target=wait_at_barrier, args=(0,), daemon=True)]
        waiters[0].start()
        time.sleep(0.5)  # rank 0's barrier reaches the server before rank 1 exists
        stores.append(create(1))
        waiters.append(threading.Thread(target=wait_at_barrier, args=(1,), daemon=True))
        waiters[1].start()
        for waiter in waiters:
            waiter.join(WORKER_TIMEOUT)
        assert barriers == {0: "returned", 1: "returned"}, barriers
    finally:
        for store in stores:
            # Bounded: a store whose call still blocks holds its session's lock.
            closer = threading.Thread(target=store.close, daemon=True)
            closer.start()
            closer.join(10)


# -- kvsparse launch: a worker's clean early exit --------------------------------------------

EARLY_EXIT = r"""
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse")
kv.init("t", kvsparse.SparseTable(dim=2))
kv.barrier()
if kv.rank == 0:
    kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))  # waits for rank 1
"""


def test_launch_names_the_worker_that_left_early(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(EARLY_EXIT)
    job = Job(
        ["-s", "1", "-n", "2", "--timeout", "5", "--", sys.executable, str(script)],
        str(tmp_path),
    )
    code = job.wait(WORKER_TIMEOUT * 2)
    output = job.output()
    assert code == 1, output  # worker 0's uncaught WorkerLeft
    assert "still run" not in output  # an exit with code 0 is a normal end, said below
    assert "worker 0 exited with code 1; stopping the job (after worker 1 left early" in output
    assert re.search(r"\[worker 0\] kvsparse\.errors\.WorkerLeft: worker rank 1 ", output), output


# -- a restarted server and a late rank's set_optimizer ---------------------------------------

LATE_FOLLOWER = r"""
import kvsparse
from kvsparse.optimizers import SGD

kv = kvsparse.create("dist_async", timeout=5, retry_window=30)
kv.set_optimizer(SGD(learning_rate=1.0))
print("set", flush=True)
"""


def test_restarted_server_serves_a_late_ranks_set_optimizer(tmp_path):
    first = ServerProcess()
    second = None
    kv = None
    try:
        kv = kvsparse.create(
            "dist_async",
            servers=[first.address],
            rank=0,
            num_workers=2,
            timeout=5,
            retry_window=30,
        )
        kv.init("t", kvsparse.SparseTable(dim=1, initializer=kvsparse.initializers.Zeros()))
        kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
        first.kill()
        second = ServerProcess(bind=first.address, extra_args=["--restarted"])
        kv.push("t", (np.array([1]), np.ones((1, 1), np.float32)))  # rank 0 meets the new one
        code, out, err = _finish(_start(LATE_FOLLOWER, [first.address], 1, 2, tmp_path))
        assert code == 0 and out.strip() == "set", err
        # The optimizer rank 0 set is the one in force on the restarted server.
        assert kv.row_sparse_pull("t", row_ids=np.array([1])).tolist() == [[-1.0]]
        assert kv._backend.restarts == 1
    finally:
        if kv is not None:
            kv.close()
        for server in (first, second):
            if server is not None:
                server.stop()
                server.stderr.close()


ASP_LATE_RANK = r"""
import os, sys, time
import numpy as np
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

go = sys.argv[1]
if os.environ["KVSPARSE_RANK"] == "1":
    while not os.path.exists(go):  # the test lets rank 1 start once server 0 restarted
        time.sleep(0.05)
kv = kvsparse.create("dist_async")
kv.init("t", kvsparse.SparseTable(dim=1, initializer=Zeros()))
kv.set_optimizer(SGD(learning_rate=1.0))
for step in range(40):
    kv.push("t", (np.array([step * 2 + kv.rank]), -np.ones((1, 1), np.float32)))
    if kv.rank == 0 and step == 5:
        kv.save(os.environ["KVSPARSE_CHECKPOINT_DIR"])
    print(f"step {step}", flush=True)
    time.sleep(0.05)
kv.barrier()
print("done", flush=True)
"""


def test_asp_job_survives_a_kill_of_shard_0_before_a_late_rank_starts(tmp_path):
    script = tmp_path / "asp.py"
    script.write_text(ASP_LATE_RANK)
    go = tmp_path / "go"
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
        "--restart-servers",
        "--retry-window",
        "60",
        "--",
        sys.executable,
        str(script),
        str(go),
    ]
    job = _Job(argv, subprocess_env())
    try:
        pid = int(job.wait_for(r"server 0 \(pid (\d+)\) listening", 60).group(1))
        job.wait_for(r"\[worker 0\] step 10$", 60)
        os.kill(pid, signal.SIGKILL)
        job.wait_for(r"server 0 \(pid \d+\) restarted on", 60)
        go.write_text("")
        code = job.finish(120)
    finally:
        job.stop()
    output = job.output()
    assert code == 0, output
    assert re.search(r"\[worker 1\] done", output), output


# -- refused and unresolvable addresses ---------------------------------------------------------


def _closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("closed port", r"cannot be reached \(connection refused"),
        ("unresolvable host", r"cannot resolve host 'no-such-host\.invalid'"),
        ("missing socket file", r"cannot be reached \(no server listens on that socket path"),
    ],
)
def test_unreachable_server_is_reported_at_once_with_its_address(tmp_path, kind, expected):
    address = {
        "closed port": _closed_port(),
        "unresolvable host": "tcp://no-such-host.invalid:7000",
        "missing socket file": f"ipc://{tmp_path}/no-server",
    }[kind]
    # The timeout is far above what the failure takes: the old wait ended in "did not answer".
    with pytest.raises(errors.ServerUnavailable, match=expected) as info:
        kvsparse.create("dist_sparse", servers=[address], rank=0, num_workers=1, timeout=10)
    assert info.value.address == address
    assert address in str(info.value)


def test_refused_address_is_retried_within_the_retry_window_then_named(tmp_path):
    address = _closed_port()
    with pytest.raises(errors.ServerUnavailable, match="retry window") as info:
        kvsparse.create(
            "dist_sparse", servers=[address], rank=0, num_workers=1, timeout=0.5, retry_window=1
        )
    assert "connection refused" in str(info.value)


def test_server_started_after_the_worker_within_the_retry_window_is_reached(tmp_path):
    """Servers that start after their workers (Kubernetes) are waited for with a retry window.

    A guard, not a defect: passes before and after the change that fails refused
    connections at once, which must keep this working.
    """
    address = _closed_port()
    worker = _start(LATE_FOLLOWER, [address], 0, 1, tmp_path)
    time.sleep(1)  # the worker's connection is refused meanwhile
    server = ServerProcess(bind=address)
    try:
        code, out, err = _finish(worker)
        assert code == 0 and out.strip() == "set", err
    finally:
        server.stop()
        server.stderr.close()


# Stores made and dropped without close(), as MXNet users call mx.kv.create again and again
# (issue 32): each says GOODBYE (no "left" on the servers, which count one GOODBYE per
# store while the worker still runs) and leaves no file descriptor behind. How they were
# kept: each one's shared-memory segment stayed open; a cycle (session -> its recovery ->
# the session's bound method) left a dropped store to the cyclic collector ("unreferenced":
# the collector off, as a program that seldom runs it); a store with a push sent with
# wait=False stayed in a module-level set until the process ended ("pending").
DROPPED = r"""
import gc, json, os, re, sys, time, urllib.request
import numpy as np
how, metrics = sys.argv[1], sys.argv[2:]
if how == "mxnet":
    np.bool = bool
    import mxnet as mx
    import kvsparse.adapters.mxnet  # noqa: F401 - registers dist_sparse
import kvsparse

CYCLES = 20
ids, rows = np.arange(300), np.ones((300, 2), np.float32)

def make(i):
    if how == "mxnet":
        kv = mx.kv.create("dist_sparse")
        kv.init(f"w{i}", mx.nd.ones((4, 2)))
        return kv
    kv = kvsparse.create("dist_sparse", shared_memory=True)
    kv.init("t", kvsparse.SparseTable(dim=2))
    if how == "pending":
        kv.push("t", (ids, rows), wait=False)  # its replies are never read by the store
        kv.row_sparse_pull("t", row_ids=ids, wait=False)  # nor this pull's
        return kv
    kv.push("t", (ids, rows))
    kv.row_sparse_pull("t", row_ids=ids)
    return kv

def fds():
    return len(os.listdir("/proc/self/fd"))

if how == "unreferenced":
    gc.disable()
counts = []
for i in range(CYCLES):
    kv = make(i)
    del kv
    if how != "unreferenced":
        gc.collect()
    counts.append(fds())
time.sleep(2)  # past the servers' wait for a closed connection's rank to come back

def requests(url, op):
    text = urllib.request.urlopen(url, timeout=20).read().decode()
    found = re.search(r'^kvsparse_requests_total\{op="%s"\} (\S+)$' % op, text, re.M)
    return int(float(found.group(1))) if found else 0

# Counted now: at exit, the stores still alive would be closed (and say GOODBYE) anyway.
seen = {op: [requests(url, op) for url in metrics] for op in ("hello", "goodbye", "push_sparse")}
print(json.dumps({"fds": counts, "cycles": CYCLES, **seen}))
"""


@pytest.fixture
def metrics_servers():
    """Two servers with --metrics-port: [(address, /metrics URL)], and their processes."""
    pytest.importorskip("prometheus_client")  # what --metrics-port serves with
    processes = []
    try:
        for _ in range(2):
            server = ServerProcess(extra_args=("--metrics-port", "0"))
            processes.append(server)
            line = read_first_line(server.process.stdout, time.monotonic() + 30).decode()
            assert line.startswith("kvsparse metrics on "), (line, server.error_output())
            server.metrics_url = line.split()[-1]
        yield processes
    finally:
        for server in processes:
            server.stop()
            server.stderr.close()


@pytest.mark.parametrize("how", ["kvsparse", "mxnet", "unreferenced", "pending"])
def test_a_store_dropped_without_close_says_goodbye_and_leaks_nothing(
    metrics_servers, tmp_path, how
):
    servers = [server.address for server in metrics_servers]
    urls = [server.metrics_url for server in metrics_servers]
    (out,) = run_workers(DROPPED, servers, 1, tmp_path, timeout=120, args=(how, *urls))
    seen = json.loads(out.splitlines()[-1])
    counts, cycles = seen["fds"], seen["cycles"]
    # ZeroMQ closes tcp sockets in its own thread, a few at a time: the count wobbles by a few;
    # a store kept alive grew it by 4 (its sockets and monitors), a segment left open by 1.
    assert max(counts[-5:]) - max(counts[:5]) < 10, counts
    # Every store greeted every server, and said GOODBYE to each before the worker ended.
    assert seen["hello"] == [cycles, cycles], seen
    assert seen["goodbye"] == [cycles, cycles], seen
    if how == "pending":
        # The pushes sent last reached the servers before the dropped stores' sockets closed.
        assert seen["push_sparse"] == [cycles, cycles], seen
    for server in metrics_servers:
        log = server.error_output()
        assert "left" not in log and "killed" not in log and "failed" not in log, log


# -- a timeout says how far the connection got ---------------------------------------------------


def test_a_stopped_server_times_out_naming_a_connection_that_was_up():
    server = ServerProcess()
    try:
        kv = kvsparse.create(
            "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=1
        )
        kv.init("t", kvsparse.SparseTable(dim=2))
        server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(errors.ServerUnavailable) as info:
                kv.row_sparse_pull("t", row_ids=np.array([1, 2]))
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert "did not answer within 1 s (connected and handshake done" in str(info.value)
        kv.close()
    finally:
        server.stop()
        server.stderr.close()


def test_a_peer_that_never_speaks_times_out_naming_the_unfinished_handshake():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted = []
    done = threading.Event()

    def accept_and_stay_silent():
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_stay_silent, daemon=True)
    thread.start()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(errors.ServerUnavailable) as info:
            kvsparse.create("dist_sparse", servers=[address], rank=0, num_workers=1, timeout=1)
        assert "did not answer within 1 s (connected, but the handshake never finished)" in str(
            info.value
        )
        assert accepted
    finally:
        done.set()
        thread.join(5)
        for connection in accepted:
            connection.close()
        listener.close()
