"""Shared test infrastructure: real `kvsparse server` processes and worker processes.

Fixtures:
    server_factory: ``server_factory(n)`` starts n ``python -m kvsparse.server
        --bind tcp://127.0.0.1:0`` processes and returns their addresses
        (``tcp://127.0.0.1:PORT``); every process is stopped at teardown.
        ``server_factory.processes`` lists the `ServerProcess` objects started.
    module_server_factory: the same, shared by the tests of one module.

Parallel runs: pyproject.toml's pytest options run the suite on 2 xdist processes, a file
at a time per process (``--dist loadfile``, longest files first), so a module's shared
fixtures start once and its tests never overlap one another; files run beside other files.
Everything a test starts is its own: free ports, tmp_path or `socket_dir`, environments
passed to children. ``-n 0`` runs in one process (`.ci/sanitize` does).

Helpers:
    run_workers(script, servers, num_workers, ...): runs a Python script as
        num_workers processes with KVSPARSE_SERVERS / KVSPARSE_RANK /
        KVSPARSE_NUM_WORKERS set, under a timeout, and returns their stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings

import kvsparse
from kvsparse.server.listening import LISTENING_PREFIX, read_first_line

REPO_ROOT = Path(kvsparse.__file__).resolve().parent.parent
SERVER_START_TIMEOUT = 30.0
LISTENING = LISTENING_PREFIX

# The files that took longest in a full run (2 xdist processes, 2 cores: test_ray 134 s,
# test_faults 97 s, test_shared_memory 82 s, ...), started first: xdist's default order (most
# tests first) left test_ray's 9 tests to run alone at the end.
LONGEST_FILES_FIRST = (
    "test_ray.py",
    "test_faults.py",
    "test_shared_memory.py",
    "test_mxnet_semantics.py",
    "test_colocated.py",
    "test_launch.py",
    "test_example_online.py",
    "test_example_mxnet.py",
)


def pytest_collection_modifyitems(config, items):
    """Puts the tests of LONGEST_FILES_FIRST first, in that order; the rest keep theirs."""
    rank = {name: position for position, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# A test that failed because a server did not answer (or could not be reached) gets a
# report section with the machine's state at that moment: the load, and every process that
# is stopped (state T) or in uninterruptible sleep (D), with its command line. A CI run once
# failed that way in one xdist process only, and the log could not say why.
_SILENCE = ("did not answer", "cannot be reached", "was held")


def _machine_state() -> str:
    lines = [f"load average {os.getloadavg()}; this process {os.getpid()}"]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            if state not in ("T", "t", "D"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        lines.append(f"pid {entry} state {state}: {argv}")
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        text = str(call.excinfo.value)
        if any(phrase in text for phrase in _SILENCE):
            report.sections.append(("machine state at the failure", _machine_state()))


# No per-example deadline: two test processes share 2 cores with their servers, so the time
# one example takes measures the machine's load, not the code. The example counts stay
# whatever each test sets.
settings.register_profile("kvsparse", deadline=None)
settings.load_profile("kvsparse")


def subprocess_env(extra: dict | None = None) -> dict:
    """os.environ with this checkout first on PYTHONPATH, no inherited cluster settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVSPARSE_", "DMLC_")) and k not in ("TF_CONFIG", "RANK", "WORLD_SIZE")
    }
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


class ServerProcess:
    """One ``python -m kvsparse.server`` subprocess on a free 127.0.0.1 port."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0", extra_args=(), env: dict | None = None):
        self.stderr = tempfile.TemporaryFile()
        self.later_output = b""  # stdout after the first line, read at stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvsparse.server", "--bind", bind, *extra_args],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=subprocess_env(env),
            cwd=str(REPO_ROOT),
        )
        line = read_first_line(self.process.stdout, time.monotonic() + SERVER_START_TIMEOUT)
        self.first_line = line.decode(errors="replace")
        if not self.first_line.startswith(LISTENING):
            self.stop()
            raise RuntimeError(
                f"kvsparse server did not start: stdout {self.first_line!r}, "
                f"stderr {self.error_output()!r}"
            )
        self.address = self.first_line[len(LISTENING) :].strip()

    def error_output(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 10.0) -> int:
        """Stops the process (SIGTERM, then SIGKILL after timeout); returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None and not self.process.stdout.closed:
            self.later_output = self.process.stdout.read()  # the process is gone: no block
            self.process.stdout.close()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the server dies without closing anything (a crashed server)."""
        self.process.kill()
        self.process.wait()


class ServerFactory:
    """Calling it with n starts n servers and returns their addresses."""

    def __init__(self):
        self.processes: list[ServerProcess] = []

    def __call__(self, n: int = 1) -> list[str]:
        started = []
        for _ in range(n):
            server = ServerProcess()
            self.processes.append(server)
            started.append(server.address)
        return started

    def stop_all(self) -> list[int]:
        codes = [server.stop() for server in self.processes]
        for server in self.processes:
            server.stderr.close()
        self.processes = []
        return codes


@pytest.fixture
def socket_dir():
    """A private directory under /tmp, short enough for socket paths; removed afterwards
    (pytest's tmp_path can be longer than the 107 bytes of a Unix socket path)."""
    directory = tempfile.mkdtemp(prefix="kvs", dir="/tmp")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def server_factory():
    factory = ServerFactory()
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def module_server_factory():
    factory = ServerFactory()
    try:
        yield factory
    finally:
        factory.stop_all()


class WorkerFailure(AssertionError):
    pass


def run_workers(
    script: str,
    servers: list[str],
    num_workers: int,
    workdir: Path,
    *,
    timeout: float = 120.0,
    env: dict | None = None,
    args=(),
) -> list[str]:
    """Runs script as num_workers processes (ranks 0..n-1) and returns their stdout.

    The environment carries KVSPARSE_SERVERS, KVSPARSE_RANK and
    KVSPARSE_NUM_WORKERS (plus env). All processes are killed if they run
    past timeout; a nonzero exit or a timeout raises WorkerFailure with every
    worker's stderr.
    """
    path = Path(workdir) / "worker_script.py"
    path.write_text(script)
    processes = []
    try:
        for rank in range(num_workers):
            worker_env = subprocess_env(
                {
                    "KVSPARSE_SERVERS": ",".join(servers),
                    "KVSPARSE_RANK": rank,
                    "KVSPARSE_NUM_WORKERS": num_workers,
                    **(env or {}),
                }
            )
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            process = subprocess.Popen(
                [sys.executable, str(path), *map(str, args)],
                stdout=out,
                stderr=err,
                env=worker_env,
                cwd=str(workdir),
            )
            processes.append((process, out, err))
        deadline = time.monotonic() + timeout
        timed_out = False
        for process, _, _ in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        outputs, failures = [], []
        for rank, (process, out, err) in enumerate(processes):
            if process.poll() is None:
                process.kill()
                process.wait()
            out.seek(0)
            err.seek(0)
            stdout, stderr = (
                out.read().decode(errors="replace"),
                err.read().decode(errors="replace"),
            )
            outputs.append(stdout)
            if timed_out or process.returncode != 0:
                failures.append(f"--- worker {rank} (exit {process.returncode}) ---\n{stderr}")
        if failures:
            what = f"timed out after {timeout} s" if timed_out else "failed"
            raise WorkerFailure(f"workers {what}:\n" + "\n".join(failures))
        return outputs
    finally:
        for process, out, err in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()


def launch_workers(
    script: str,
    num_servers: int,
    num_workers: int,
    workdir: Path,
    *,
    timeout: float = 300.0,
    launch_args=(),
) -> list[str]:
    """Runs script under ``kvsparse launch -s num_servers -n num_workers`` and returns each
    worker's stdout, by rank.

    The launcher starts the servers and the workers itself (its environment, its ports);
    every worker's stdout goes to ``worker-<rank>.out`` in workdir (the script is run through
    a shell redirect, since the launcher relays the workers' output interleaved). A nonzero
    exit of the launch, or a timeout, raises WorkerFailure with the launch's output and
    every worker's output.
    """
    path = Path(workdir) / "launched_script.py"
    path.write_text(script)
    command = f'exec "{sys.executable}" "{path}" > "{workdir}/worker-$KVSPARSE_RANK.out"'
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsparse",
            "launch",
            "-s",
            str(num_servers),
            "-n",
            str(num_workers),
            *launch_args,
            "--",
            "sh",
            "-c",
            command,
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=str(workdir),
        timeout=timeout,
    )
    outputs = []
    for rank in range(num_workers):
        out = Path(workdir) / f"worker-{rank}.out"
        outputs.append(out.read_text(errors="replace") if out.exists() else "")
    if launch.returncode != 0:
        raise WorkerFailure(
            f"kvsparse launch exited {launch.returncode}:\n{launch.stdout}\n{launch.stderr}\n"
            + "\n".join(f"--- worker {r} stdout ---\n{o}" for r, o in enumerate(outputs))
        )
    return outputs


def last_json(stdout: str):
    """The JSON value on the last non-empty line of a worker's stdout."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the worker printed nothing"
    return json.loads(lines[-1])
