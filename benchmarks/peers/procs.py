"""Subprocesses of the benchmark: started in their own session, always stopped.

Every process is started with start_new_session=True, so it leads its own process group;
`Processes.stop_all` signals each group it started (SIGTERM, then SIGKILL after a grace
period), which also reaches any child a peer forked (ps-lite, TensorPipe). Nothing is ever
killed by name.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict | None = None, drop: tuple = ()) -> dict:
    """This process's environment plus `extra`, minus `drop`, with the repo importable."""
    env = dict(os.environ)
    for name in drop:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Processes:
    """The subprocesses of one peer; a context manager that stops them all on exit.

    Example:
        >>> with Processes(log_dir) as procs:  # doctest: +SKIP
        ...     server = procs.start("srv", [sys.executable, "raw_zmq.py", "serve"])
        ...     address = procs.wait_for_line(server, r"listening on (\\S+)", timeout=30)
    """

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(self, name: str, argv: list, env: dict | None = None) -> subprocess.Popen:
        """Starts argv with stdout and stderr in <log_dir>/<name>.log."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env if env is not None else child_env(),
                cwd=REPO,
                start_new_session=True,
            )
        self.procs.append((name, proc, log_path))
        return proc

    def name_of(self, proc: subprocess.Popen) -> str:
        return next((name for name, p, _ in self.procs if p is proc), str(proc.args))

    def log_of(self, proc: subprocess.Popen) -> str:
        for _, p, path in self.procs:
            if p is proc:
                with open(path, errors="replace") as f:
                    return f.read()
        return ""

    def wait_for_line(self, proc: subprocess.Popen, pattern: str, timeout: float) -> str:
        """First group of the first log line matching pattern; raises if the process dies."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_of(proc).splitlines():
                match = regex.search(line)
                if match:
                    return match.group(1)
            if _has_exited(proc):
                raise RuntimeError(
                    f"{self.name_of(proc)} exited before printing {pattern!r}:\n"
                    + self.log_of(proc)[-3000:]
                )
            time.sleep(0.05)
        raise TimeoutError(
            f"no line matching {pattern!r} within {timeout:.0f} s:\n" + self.log_of(proc)[-3000:]
        )

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        """Waits for proc to exit and returns its exit status (the process is not reaped).

        Raises TimeoutError (with the end of its log) if it is still running after timeout.
        """
        deadline = time.monotonic() + timeout
        while not _has_exited(proc):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name_of(proc)} still running after {timeout:.0f} s:\n"
                    + self.log_of(proc)[-3000:]
                )
            time.sleep(0.05)
        return _exit_status(proc)

    def stop_all(self, grace: float = 5.0) -> None:
        """SIGTERM to every process group started here, SIGKILL to what remains after grace.

        A leader is reaped only after its group was signalled: an unreaped leader keeps its
        pid (the group id) from being reused (pid_max is 32768 here), so the signal can
        only reach processes started by this benchmark.
        """
        live = [proc for _, proc, _ in self.procs if proc.returncode is None]
        for proc in live:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not all(_has_exited(p) for p in live):
            time.sleep(0.05)
        for proc in live:
            _signal_group(proc, signal.SIGKILL)  # children a peer forked, if any
            proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()


def _has_exited(proc: subprocess.Popen) -> bool:
    """True once proc exited; leaves it unreaped (a zombie) so its pid stays taken."""
    if proc.returncode is not None:
        return True
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _exit_status(proc: subprocess.Popen) -> int:
    if proc.returncode is not None:
        return proc.returncode
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        raise RuntimeError("process has not exited")
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # proc.pid leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
