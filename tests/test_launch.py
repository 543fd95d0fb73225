"""kvsparse launch: real servers and workers, prefixed output, exit codes, no orphans.

Every job here is a real ``python -m kvsparse launch`` subprocess (or the
in-process `launch()` / `local_cluster()` API) whose workers use
``kvsparse.create('dist_sparse')`` with no arguments. Each test collects the
pids the launcher reports (``kvsparse launch: worker 0 (pid N) ...``) and the
pids the workers' own children print, and checks that all are gone at the end.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
from conftest import REPO_ROOT, subprocess_env

import kvsparse
from kvsparse import errors
from kvsparse.cluster import process as server_process
from kvsparse.cluster.launch import launch, local_cluster

JOB_TIMEOUT = 120.0
PID_LINE = re.compile(r"kvsparse launch: (server|worker) (\d+) \(pid (\d+)\)")
CHILD_PID = re.compile(r"child pid (\d+)")

# Real pushes and pulls through two servers: SGD with lr 1 from zero rows, each worker
# pushes gradient rank + 1 to the same ids, so after the step every row is -(1 + 2).
TRAIN = """
import json, os, sys
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse")
print(f"rank {kv.rank} of {kv.num_workers} with {kv.num_servers} servers")
kv.init("emb", kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Zeros()))
kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
ids = np.arange(64)
kv.push("emb", (ids, np.full((64, 4), kv.rank + 1, np.float32)))
kv.barrier()
rows = kv.row_sparse_pull("emb", row_ids=ids)
print("values", sorted(set(rows.ravel().tolist())))
print("rows per server", [s["tables"]["emb"]["rows"] for s in kv.stats()["shards"]])
names = ["FOO", "DMLC_ROLE", "PORT", "TF_CONFIG", "KVSPARSE_SERVERS"]
print("env", json.dumps({n: os.environ.get(n) for n in names}), file=sys.stderr)
kv.close()
"""


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


class Job:
    """A `python -m kvsparse launch ...` subprocess whose output lines are collected."""

    def __init__(self, args, cwd, env=None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvsparse", "launch", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=subprocess_env(env),
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self._passed: list[str] = []  # lines read by a wait_for that did not match
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._threads = [
            threading.Thread(
                target=self._read, args=(self.process.stdout, self.stdout), daemon=True
            ),
            threading.Thread(
                target=self._read, args=(self.process.stderr, self.stderr), daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, stream, into):
        for line in stream:
            into.append(line)
            self.lines.put(line)

    def wait_for(self, pattern, count=1, timeout=JOB_TIMEOUT):
        """Blocks until `count` output lines matched `pattern` (bounded).

        Lines an earlier wait read past are kept for later waits: workers' lines are
        relayed by one thread each, so worker 0's "ready" can arrive before worker 1's
        "child pid" although worker 1 printed first (a wait for "child pid" used to
        drop it, and the wait for "ready" then timed out).
        """
        seen = [line for line in self._passed if re.search(pattern, line)][:count]
        for line in seen:
            self._passed.remove(line)
        deadline = time.monotonic() + timeout
        while len(seen) < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                pytest.fail(f"no {pattern!r} within {timeout} s; output:\n{self.output()}")
            if re.search(pattern, line):
                seen.append(line)
            else:
                self._passed.append(line)
        return seen

    def wait(self, timeout=JOB_TIMEOUT):
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the launcher did not finish within {timeout} s:\n{self.output()}")
        for thread in self._threads:
            thread.join(10)
        return code

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()  # only the launcher; its children are checked by the test
            self.process.wait()

    def output(self):
        return "".join(self.stdout) + "\n--- stderr ---\n" + "".join(self.stderr)

    def pids(self):
        """{'server 0': pid, 'worker 1': pid, ...} from the launcher's messages."""
        found = {}
        for line in self.stderr:
            match = PID_LINE.search(line)
            if match:
                found[f"{match.group(1)} {match.group(2)}"] = int(match.group(3))
        return found


def run_job(args, cwd, env=None):
    job = Job(args, cwd, env)
    try:
        code = job.wait()
    finally:
        job.stop()
    return job, code


def assert_all_gone(pids, timeout=30.0):
    """Every pid has exited (a zombie waiting for init to reap it counts as exited)."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    running = []
    for process in alive:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append((process.pid, process.cmdline()))
        except psutil.NoSuchProcess:
            pass
    assert not running, f"processes left running: {running}"


# -- full jobs --------------------------------------------------------------------------


def test_two_servers_two_workers_real_training_step(tmp_path):
    script = write(tmp_path, "train.py", TRAIN)
    job, code = run_job(
        ["-s", "2", "-n", "2", "--env", "FOO=bar", "--", sys.executable, script],
        cwd=tmp_path,
        # Set for the launcher; the workers must not see them (ps-lite would take over).
        env={"DMLC_ROLE": "worker", "PORT": "9999", "TF_CONFIG": '{"cluster": {}}'},
    )
    assert code == 0, job.output()
    for rank in (0, 1):
        assert f"[worker {rank}] rank {rank} of 2 with 2 servers\n" in job.stdout
        assert f"[worker {rank}] values [-3.0]\n" in job.stdout
    per_server = [line for line in job.stdout if "rows per server" in line]
    assert len(per_server) == 2
    counts = json.loads(per_server[0].split("rows per server ", 1)[1])
    assert len(counts) == 2 and sum(counts) == 64 and min(counts) > 0  # both shards used
    envs = [line for line in job.stderr if line.startswith("[worker ") and " env " in line]
    assert len(envs) == 2, job.output()
    for line in envs:
        seen = json.loads(line.split(" env ", 1)[1])
        assert seen["FOO"] == "bar"
        assert seen["DMLC_ROLE"] is None and seen["PORT"] is None and seen["TF_CONFIG"] is None
        assert len(seen["KVSPARSE_SERVERS"].split(",")) == 2
    pids = job.pids()
    assert sorted(pids) == ["server 0", "server 1", "worker 0", "worker 1"], job.output()
    assert_all_gone(pids.values())


FAIL_IN_TIME_ORDER = """
import os, signal, sys, time
import kvsparse

kv = kvsparse.create("dist_sparse")
if kv.rank == 0:
    def stopped(signum, frame):
        print("rank 0 got SIGTERM", flush=True)
        os._exit(3)
    signal.signal(signal.SIGTERM, stopped)
kv.barrier()  # rank 0's handler is in place before rank 1 fails
if kv.rank == 1:
    print("rank 1 fails", file=sys.stderr)
    sys.exit(5)
time.sleep(300)
"""


def test_exit_code_is_the_first_failing_workers_in_time_order(tmp_path):
    # Rank 1 fails first with 5; rank 0 then exits with 3 when the launcher stops it.
    # The job's code is 5: neither the lowest rank's code nor the smallest code.
    script = write(tmp_path, "fail.py", FAIL_IN_TIME_ORDER)
    job, code = run_job(["-s", "1", "-n", "2", "--", sys.executable, script], cwd=tmp_path)
    assert code == 5, job.output()
    assert "[worker 1] rank 1 fails\n" in job.stderr
    assert "[worker 0] rank 0 got SIGTERM\n" in job.stdout
    assert any("worker 1 exited with code 5; stopping the job" in line for line in job.stderr)
    assert_all_gone(job.pids().values())


def test_worker_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    script = write(
        tmp_path,
        "killed.py",
        """
        import os, signal
        import kvsparse
        kv = kvsparse.create("dist_sparse")
        if kv.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    job, code = run_job(["-n", "2", "--", sys.executable, script], cwd=tmp_path)
    assert code == 128 + signal.SIGKILL, job.output()
    assert_all_gone(job.pids().values())


HANG = """
import os, signal, subprocess, sys, time
import kvsparse

kv = kvsparse.create("dist_sparse")
if kv.rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # must be killed after the grace period
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(f"child pid {child.pid}", flush=True)
kv.barrier()
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_stops_everything(tmp_path, sig):
    script = write(tmp_path, "hang.py", HANG)
    job = Job(["-s", "2", "-n", "2", "--grace-period", "1", "--", sys.executable, script], tmp_path)
    try:
        children = [int(CHILD_PID.search(line).group(1)) for line in job.wait_for("child pid", 2)]
        job.wait_for(r"\] ready$", 2)
        pids = job.pids()
        assert len(pids) == 4, job.output()
        launcher = psutil.Process(job.process.pid)
        started = {p.pid for p in launcher.children(recursive=True)}
        assert set(pids.values()) | set(children) <= started
        job.process.send_signal(sig)
        code = job.wait()
    finally:
        job.stop()
    assert code == 128 + sig, job.output()
    assert any(f"got {signal.Signals(sig).name}; stopping the job" in line for line in job.stderr)
    assert any(
        "worker 1 (pid" in line and "ignored SIGTERM; killing it" in line for line in job.stderr
    )
    assert_all_gone(started)


SLEEPER = """
import time
import kvsparse

kv = kvsparse.create("dist_sparse")
kv.barrier()
print("ready", flush=True)
time.sleep(300)
"""


def test_a_launcher_killed_with_sigkill_takes_its_servers_and_workers_along(tmp_path):
    # SIGKILL leaves the launcher no time to stop anyone: before, its servers (and
    # workers) served on as orphans, the ipc directory stayed, and nothing said so.
    script = write(tmp_path, "sleeper.py", SLEEPER)
    job = Job(["-s", "2", "-n", "1", "--transport", "ipc", "--", sys.executable, script], tmp_path)
    try:
        job.wait_for(r"\] ready$")
        pids = job.pids()
        assert len(pids) == 3, job.output()
        servers = [psutil.Process(pid) for name, pid in pids.items() if name.startswith("server")]
        socket_dir = os.path.dirname(servers[0].cmdline()[-1][len("ipc://") :])
        assert os.path.isdir(socket_dir)
        job.process.kill()
        job.process.wait(30)
        assert_all_gone(pids.values())
    finally:
        job.stop()
    # The next launch on this host removes the directory the killed one left.
    code = run_job(["-s", "1", "-n", "1", "--transport", "ipc", "--", "true"], tmp_path)[1]
    assert code == 0
    assert not os.path.exists(socket_dir)


def test_socket_directories_removed_are_only_those_of_makers_gone(monkeypatch):
    parent = tempfile.mkdtemp(prefix="kvs", dir="/tmp")  # short: socket paths fit
    monkeypatch.setattr(tempfile, "tempdir", parent)
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        namespace = os.readlink("/proc/self/ns/pid")
        made = {}
        for name, owner in [
            ("dead", f"{gone.pid} {namespace}"),
            ("alive", f"{os.getpid()} {namespace}"),
            ("other-namespace", f"{gone.pid} pid:[1]"),
            ("unnamed", None),  # an older kvsparse's, or one being made
        ]:
            made[name] = os.path.join(parent, f"kvsparse-{name}")
            os.mkdir(made[name])
            if owner is not None:
                with open(os.path.join(made[name], "owner"), "w") as file:
                    file.write(owner)
        other = os.path.join(parent, "kvsparse-online-run")  # another kvsparse-* directory
        os.mkdir(other)
        mine = server_process.socket_directory()
        assert os.path.dirname(mine) == parent
        assert sorted(os.listdir(mine)) == ["owner"]
        assert not os.path.exists(made["dead"])
        for name in ("alive", "other-namespace", "unnamed"):
            assert os.path.isdir(made[name]), name
        assert os.path.isdir(other)
        # What kvsparse.ray makes (an actor restarted after its process died takes it over):
        # no maker named, so no sweep removes it.
        taken_over = server_process.socket_directory(removed_with_maker=False)
        assert os.listdir(taken_over) == []
        server_process.socket_directory()
        assert os.path.isdir(taken_over)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_dead_server_stops_the_job(tmp_path):
    script = write(tmp_path, "hang.py", HANG)
    job = Job(["-s", "2", "-n", "2", "--grace-period", "1", "--", sys.executable, script], tmp_path)
    try:
        job.wait_for(r"\] ready$", 2)
        pids = job.pids()
        started = {p.pid for p in psutil.Process(job.process.pid).children(recursive=True)}
        os.kill(pids["server 1"], signal.SIGKILL)
        code = job.wait()
    finally:
        job.stop()
    assert code == 1, job.output()
    assert any("server 1 exited with code 137; stopping the job" in line for line in job.stderr)
    assert_all_gone(started)


# -- launcher errors and the CLI ------------------------------------------------------------


def cli(*args, cwd=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "kvsparse", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(),
        timeout=timeout,
    )


def test_missing_worker_program_is_an_error_and_stops_the_servers(tmp_path):
    job, code = run_job(["-s", "2", "--", str(tmp_path / "no-such-program")], cwd=tmp_path)
    assert code == 1
    assert any("error: cannot start worker 0" in line for line in job.stderr), job.output()
    pids = job.pids()
    assert sorted(pids) == ["server 0", "server 1"]
    assert_all_gone(pids.values())


def test_server_that_cannot_bind_is_reported(tmp_path):
    # 192.0.2.1 (TEST-NET-1) is not an address of this host, so the bind fails.
    job, code = run_job(["--host", "192.0.2.1", "--", sys.executable, "-c", "pass"], cwd=tmp_path)
    assert code == 1
    assert any("[server 0] kvsparse server: cannot bind" in line for line in job.stderr), (
        job.output()
    )
    assert any("error: server 0 exited with code 1 before listening" in line for line in job.stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0", "--", "python"], "expected an integer >= 1"),
        (["-s", "two", "--", "python"], "expected an integer, got 'two'"),
        (["--env", "NOVALUE", "--", "python"], "expected KEY=VALUE"),
        (["-n", "2"], "no worker command"),
        (["--timeout", "0", "--", "python"], "--timeout='0' is not a number of seconds > 0"),
        (["--save-every", "soon", "--", "python"], "--save-every='soon' is not a number of"),
    ],
)
def test_launch_usage_errors(args, message):
    result = cli("launch", *args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env", "KVSPARSE_RANK=3"], "KVSPARSE_RANK is set by the launcher"),
        (["--env", "DMLC_ROLE=server"], "DMLC_ROLE would make MXNet's ps-lite take over"),
        (["--staleness", "-1"], "staleness must be >= 0"),
    ],
)
def test_launch_option_errors_start_nothing(args, message):
    result = cli("launch", *args, "--", sys.executable, "-c", "pass")
    assert result.returncode == 1
    assert f"kvsparse launch: error: {message}" in result.stderr
    assert "pid" not in result.stderr  # failed before any process started


def test_command_without_separator(tmp_path):
    job, code = run_job(
        [
            "-n",
            "1",
            sys.executable,
            "-c",
            "import sys, kvsparse; sys.exit(kvsparse.create('dist').num_servers + 40)",
        ],
        cwd=tmp_path,
    )
    assert code == 41, job.output()


def test_keys_without_a_directory_is_a_usage_error():
    # `kvsparse keys DIR` itself: tests/test_security.py; stats: tests/test_stats_cli.py
    result = cli("keys")
    assert result.returncode == 2
    assert "DIR" in result.stderr


def test_cli_help_and_version():
    assert "launch" in cli("--help").stdout
    assert cli("--version").stdout.strip() == f"kvsparse {kvsparse.__version__}"
    bare = cli()
    assert bare.returncode == 2 and "COMMAND" in bare.stderr
    unknown = cli("train")
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_server_command_delegates_to_the_server(tmp_path):
    # `kvsparse server` with no --bind takes its address from the environment.
    process = subprocess.Popen(
        [sys.executable, "-m", "kvsparse", "server"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env({"KVSPARSE_BIND": "tcp://127.0.0.1:0"}),
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("kvsparse server listening on tcp://127.0.0.1:"), line
        from kvsparse.client.remote import ping

        assert ping(line.split()[-1], 10.0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_importing_the_launcher_loads_neither_zmq_nor_the_server_nor_the_shard():
    # The launcher only starts processes and reads their listening line: ZeroMQ (and the
    # client's ping, which needs it), the server and the shard load lazily or not at all.
    script = "import json, sys, kvsparse.cluster.launch; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert "kvsparse.cluster.process" in loaded
    heavy = [
        name
        for name in loaded
        if name.split(".")[0] == "zmq"
        or name.startswith("kvsparse.shard")
        or name.startswith("kvsparse.server.")
        and name != "kvsparse.server.listening"
    ]
    assert not heavy, f"importing kvsparse.cluster.launch loads {heavy}"


# -- the process helper shared with kvsparse.ray ----------------------------------------------


def test_children_inherit_no_foreign_role_nor_placement_variables():
    parent = {
        "DMLC_ROLE": "server",  # + `import mxnet`: an MXNet ps-lite server
        "PORT": "9000",
        "TF_CONFIG": "{}",
        "KVSPARSE_SERVERS": "tcp://10.0.0.1:1",
        "KVSPARSE_RANK": "3",
        "KVSPARSE_BIND": "tcp://*:1",
        "KVSPARSE_KEYS": "/keys",
        "KVSPARSE_NUM_THREADS": "2",
        "PYTHONPATH": "/elsewhere",
        "HOME": "/home/me",
    }
    kept = {"KVSPARSE_KEYS": "/keys", "KVSPARSE_NUM_THREADS": "2", "HOME": "/home/me"}
    worker = server_process.worker_environment(parent)
    assert worker == {**kept, "PYTHONPATH": "/elsewhere", "PYTHONUNBUFFERED": "1"}
    server = server_process.server_environment(parent)
    assert server == {
        **kept,
        "PYTHONPATH": str(REPO_ROOT) + os.pathsep + "/elsewhere",  # this kvsparse first
        "PYTHONUNBUFFERED": "1",
    }
    assert server_process.worker_environment({"PYTHONUNBUFFERED": "0"}) == {"PYTHONUNBUFFERED": "0"}


def test_server_command_and_restore_arguments(tmp_path):
    argv = server_process.server_command(
        "tcp://h:1", keys="/k", restarted=True, extra_args=["--x", 2]
    )
    assert argv == [
        sys.executable,
        "-m",
        "kvsparse.server",
        "--bind",
        "tcp://h:1",
        "--restarted",
        "--keys",
        "/k",
        "--x",
        "2",
    ]
    assert server_process.restore_arguments(None, 0, 2) == []
    assert server_process.restore_arguments(str(tmp_path), 0, 2) == []  # no committed checkpoint


def _held_port():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


def test_start_server_binds_again_until_the_port_is_free():
    holder, port = _held_port()
    argv = server_process.server_command(f"tcp://127.0.0.1:{port}")
    attempts = []

    def start():
        attempts.append(
            server_process.ServerProcess(
                argv,
                server_process.server_environment(),
                label="server 0",
                on_stdout=lambda line: None,
                on_stderr=lambda line: None,
            )
        )
        if len(attempts) == 2:
            holder.close()  # the dead server's port comes free during the retries
        return attempts[-1]

    server = server_process.start_server(
        start, listen_timeout=30, retry_until=time.monotonic() + 30
    )
    try:
        assert server.address == f"tcp://127.0.0.1:{port}"
        assert len(attempts) >= 2
        assert [a.process.returncode for a in attempts[:-1]] == [server_process.CANNOT_BIND] * (
            len(attempts) - 1
        )
    finally:
        server.stop(5.0)
    assert_all_gone([a.pid for a in attempts])


def test_start_server_gives_up_at_retry_until_and_says_why():
    holder, port = _held_port()
    argv = server_process.server_command(f"tcp://127.0.0.1:{port}")

    def start():
        return server_process.ServerProcess(
            argv,
            server_process.server_environment(),
            label="server 0",
            on_stdout=lambda line: None,
            on_stderr=lambda line: None,
        )

    try:
        server = server_process.start_server(start, listen_timeout=30, retry_until=0.0)
    finally:
        holder.close()
    assert server.address is None
    assert server.process.returncode == server_process.CANNOT_BIND
    assert "cannot bind" in server.recent_text()


# -- the Python API ----------------------------------------------------------------------------


def test_local_cluster_serves_and_always_stops(tmp_path):
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    err = io.StringIO()
    with pytest.raises(RuntimeError, match="leaving the block"):
        with local_cluster(2, stderr=err) as servers:
            started = {p.pid for p in me.children()} - before
            assert len(servers) == 2 and len(started) == 2
            kv = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1)
            kv.init(7, kvsparse.SparseTable(dim=3, initializer=kvsparse.initializers.Zeros()))
            values = np.arange(12, dtype=np.float32).reshape(4, 3)
            kv.push(7, (np.array([1, 2, 3, 4]), values))  # no optimizer: assigns
            pulled = kv.row_sparse_pull(7, row_ids=np.array([[4, 1], [3, 4]]))
            assert np.array_equal(pulled, values[[[3, 0], [2, 3]]])
            kv.close()
            raise RuntimeError("leaving the block")
    assert_all_gone(started)
    assert "listening on tcp://127.0.0.1:" in err.getvalue()


def test_launch_api_returns_the_code_and_relays_output(tmp_path, monkeypatch):
    for name, value in subprocess_env().items():
        monkeypatch.setenv(name, value)
    script = write(
        tmp_path,
        "api.py",
        """
        import sys
        import kvsparse
        kv = kvsparse.create("dist_sparse")
        print("hello from", kv.rank)
        kv.barrier()  # both printed before rank 1 fails and the launcher stops rank 0
        print("partial line without newline", end="", file=sys.stderr)
        sys.exit(0 if kv.rank == 0 else 9)
        """,
    )
    out, err = io.StringIO(), io.StringIO()
    code = launch(
        [sys.executable, script],
        num_servers=1,
        num_workers=2,
        stdout=out,
        stderr=err,
        cwd=str(tmp_path),
    )
    assert code == 9, out.getvalue() + err.getvalue()
    assert "[worker 0] hello from 0\n" in out.getvalue()
    assert "[worker 1] partial line without newline\n" in err.getvalue()
    pids = [int(m.group(3)) for m in PID_LINE.finditer(err.getvalue())]
    assert len(pids) == 3
    assert_all_gone(pids)


def test_launch_api_rejects_bad_arguments():
    with pytest.raises(errors.InvalidArgument, match="num_workers must be an integer >= 1"):
        launch(["python"], num_workers=0)
    with pytest.raises(errors.InvalidArgument, match="needs a worker command"):
        launch([], num_servers=1)
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_SERVERS is set by the launcher"):
        launch("python train.py", env={"KVSPARSE_SERVERS": "x"})


def test_servers_reachable_from_other_hosts_get_the_checkpoint_dir_as_their_root():
    """Such a server without keys refuses every CHECKPOINT path outside a root (anyone who
    reaches its port could otherwise make it read and write anywhere it may): the launcher
    makes the workers' checkpoint directory that root, so that kv.save() works; loopback,
    ipc and keyed servers keep accepting any path."""
    root = server_process.checkpoint_root_arguments
    assert root("tcp://10.0.0.5:0", None, "/ckpt") == ["--checkpoint-root", "/ckpt"]
    assert root("tcp://*:7000", None, "/ckpt") == ["--checkpoint-root", "/ckpt"]
    assert root("tcp://127.0.0.1:0", None, "/ckpt") == []
    assert root("ipc:///tmp/kvs/server-0", None, "/ckpt") == []
    assert root("tcp://10.0.0.5:0", "/keys", "/ckpt") == []
    assert root("tcp://10.0.0.5:0", None, None) == []


def test_launch_creates_the_checkpoint_dir(tmp_path):
    checkpoint_dir = tmp_path / "not" / "yet"
    from kvsparse.cluster.launch import launch

    code = launch(
        [sys.executable, "-c", "pass"],
        num_servers=1,
        num_workers=1,
        checkpoint_dir=str(checkpoint_dir),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    assert code == 0 and checkpoint_dir.is_dir()


CLEAN_END = """
import os, signal, sys
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse")
kv.init("t", kvsparse.SparseTable(dim=2))
kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
kv.push("t", (np.array([kv.rank]), np.ones((1, 2), np.float32)))
kv.barrier()
print("rank", kv.rank, "done", flush=True)
if kv.rank == 1 and sys.argv[1] == "close":
    kv.close()  # rank 0 ends without close(): its store says goodbye at exit
if kv.rank == 1 and sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # a real departure
"""

_WARNINGS = ("left", "killed", "WorkerLeft", "still run", "Traceback", "warning", "error")


def test_a_clean_end_is_quiet_and_a_killed_worker_still_warns(tmp_path):
    # Before: every server logged "worker rank R left (... was killed ...)" and the launcher
    # "worker 1 exited with code 0 while worker 0 still run ..." after a clean run.
    script = write(tmp_path, "clean.py", CLEAN_END)
    job, code = run_job(["-s", "1", "-n", "2", "--", sys.executable, script, "close"], tmp_path)
    output = job.output()
    assert code == 0, output
    assert "rank 0 done" in output and "rank 1 done" in output
    lowered = output.lower()
    assert not [w for w in _WARNINGS if w.lower() in lowered], output
    # A worker killed still warns, on the server (the launcher stops the job for it).
    job, code = run_job(["-s", "1", "-n", "2", "--", sys.executable, script, "kill"], tmp_path)
    output = job.output()
    assert code == 128 + 9, output
    assert "worker 1 exited with code 137" in output, output
