"""Server and worker processes, started the same way by ``kvsparse launch`` and `kvsparse.ray`.

What a process that starts kvsparse servers needs, written once. It imports
neither ZeroMQ nor the server: a server's address comes from the line it
prints (`kvsparse.server.listening`), and `wait_answering` imports the
client's ``ping`` only when it is called.

- `server_command`: the ``python -m kvsparse.server`` command line, with
  `restore_arguments` (``--restore DIR --shard-index I --num-shards N`` when
  `has_checkpoint` finds a complete checkpoint in DIR).
- `worker_environment` / `server_environment`: what a child inherits of its
  parent's environment (the rule below).
- `ChildProcess`: a child in its own process group, its stdout and stderr
  relayed line by line; `ServerProcess` also reads the server's listening
  line to learn the address it bound.
- `start_server`: starts a server again while the port it must bind is still
  held by one that just died (bind retries); `wait_answering`: pings a server
  until it answers.
- `socket_directory` / `ipc_bind_address`: where servers of the same host
  put their ``ipc://`` sockets (a private temporary directory, mode 0700;
  those of makers killed with SIGKILL are removed by the next one).
- `die_with_parent`: a child started with it gets a signal when its parent
  dies, even by SIGKILL (Linux), so that no server outlives its launcher.

The environment rule. A child gets its parent's environment, without

- ``DMLC_ROLE``, ``PORT`` and ``TF_CONFIG``
  (`kvsparse.config.FOREIGN_ROLE_VARIABLES`): with ``DMLC_ROLE=server`` set,
  ``import mxnet`` turns a process into an MXNet ps-lite server, and
  ``TF_CONFIG`` makes TensorFlow build a cluster of its own;
- `PLACEMENT_VARIABLES`, the ``KVSPARSE_*`` variables that place one process
  in one cluster (server list, rank, worker count, timeout, staleness, bind
  address, server id): whoever starts a child sets those for it from its own
  options, so the parent's own values must not leak in.

and with ``PYTHONUNBUFFERED=1`` unless set, so that lines arrive as they are
printed. The job-wide settings (``KVSPARSE_KEYS``, ``KVSPARSE_CHECKPOINT_DIR``,
``KVSPARSE_RETRY_WINDOW``, ``KVSPARSE_NUM_THREADS``) pass, so that servers,
workers and the launcher's own ``ping`` (which reads ``KVSPARSE_KEYS``) agree. A
server also finds this kvsparse first on ``PYTHONPATH``, so that it runs the
same code as its parent, even from a source tree that is not installed.

Example:
    >>> server_command('tcp://127.0.0.1:0', keys='/keys')[1:]
    ['-m', 'kvsparse.server', '--bind', 'tcp://127.0.0.1:0', '--keys', '/keys']
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Callable, Optional, TextIO

import kvsparse
from kvsparse import config, errors
from kvsparse.server.listening import parse_listening_line

# Set for each child by whoever starts it; never inherited (see the module docstring).
PLACEMENT_VARIABLES = (
    config.SERVERS,
    config.RANK,
    config.NUM_WORKERS,
    config.TIMEOUT,
    config.STALENESS,
    config.BIND,
    config.SERVER_ID,
    config.PEERS,  # colocated mode: only `kvsparse launch --colocated` sets it
    config.RESTARTED,  # a worker started again by `kvsparse launch --restart-workers`
)
# The exit status of `python -m kvsparse.server` when it cannot bind its address.
CANNOT_BIND = 1
# A port that a killed server held may stay taken for a moment: wait, then bind again.
BIND_RETRY_PAUSE = 0.2
_POLL_SECONDS = 0.1
_FAILED_SERVER_GRACE_PERIOD = 5.0
_RECENT_LINES = 20
# The transports a launcher can give its servers: tcp (any host) or ipc (Unix sockets,
# for workers on the servers' host).
TRANSPORTS = ("tcp", "ipc")
_SOCKET_DIRECTORY_PREFIX = "kvsparse-"
# In each socket directory: "PID PID-NAMESPACE" of the process that made it.
_SOCKET_DIRECTORY_OWNER = "owner"
_PR_SET_PDEATHSIG = 1
# The longest socket name ipc_bind_address is given ("server-NNNN"), with a margin.
_SOCKET_NAME_ROOM = len(_SOCKET_DIRECTORY_PREFIX) + 8 + len("/server-00000") + 2


def check_transport(transport) -> str:
    """Returns transport if it is 'tcp' or 'ipc'; raises InvalidArgument otherwise."""
    if transport not in TRANSPORTS:
        raise errors.InvalidArgument(
            f"transport must be 'tcp' or 'ipc' (Unix sockets, for workers on the servers' "
            f"host), got {transport!r}"
        )
    return transport


def socket_directory(removed_with_maker: bool = True) -> str:
    """Makes a private directory (mode 0700) for the ``ipc://`` sockets of this host's servers.

    It is made in the temporary directory (``tempfile.gettempdir()``), or in
    /tmp when that path is too long to leave room for a socket name (a Unix
    socket path has at most `kvsparse.config.IPC_PATH_MAX_BYTES` bytes). Only
    this user can reach sockets in it. The caller removes it (with what is in
    it) when its servers have stopped.

    removed_with_maker: True: it names this process as its maker, and a later
    call (of any process of this user) removes it once this process is gone
    (killed with SIGKILL, say, so that it could not). False: only the caller
    removes it (`kvsparse.ray`: a restarted actor takes over its shard's
    directory, whose maker died).

    Raises:
        OSError: the directory cannot be made.

    Thread-safe.

    Example:
        >>> directory = socket_directory()  # doctest: +SKIP
        >>> ipc_bind_address(directory, 'server-0')  # doctest: +SKIP
        'ipc:///tmp/kvsparse-k2j4x8ab/server-0'
    """
    parent = tempfile.gettempdir()
    if len(os.fsencode(parent)) + _SOCKET_NAME_ROOM > config.IPC_PATH_MAX_BYTES:
        parent = "/tmp"
    _remove_orphaned_socket_directories(parent)
    directory = tempfile.mkdtemp(prefix=_SOCKET_DIRECTORY_PREFIX, dir=parent)
    if removed_with_maker:
        with open(os.path.join(directory, _SOCKET_DIRECTORY_OWNER), "w") as owner:
            owner.write(f"{os.getpid()} {_pid_namespace()}")
    return directory


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "-"


def _remove_orphaned_socket_directories(parent: str) -> None:
    """Removes the socket directories in parent of this user's makers that are gone.

    A maker removes its own at its end; one killed with SIGKILL cannot, and its
    servers went with it (`die_with_parent`). Only directories that name their
    maker are looked at, and only makers in this PID namespace (a pid of
    another, a container's say, means nothing here).
    """
    uid, namespace = os.getuid(), _pid_namespace()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(_SOCKET_DIRECTORY_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            with open(os.path.join(entry.path, _SOCKET_DIRECTORY_OWNER)) as owner:
                pid_text, owner_namespace = owner.read().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not one of these, still being made, or made by an older kvsparse
        if owner_namespace != namespace or namespace == "-" or pid_alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts). Thread-safe."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(signum: int) -> Callable[[], None]:
    """A `ChildProcess` preexec_fn: the child gets signum when this process dies (Linux).

    Also when it is killed with SIGKILL, which leaves it no time to stop its
    children. Linux sends it when the thread that started the child ends:
    start children from a thread that outlives them (the main thread). The
    child's own children are not covered. Elsewhere it does nothing.
    """
    parent = os.getpid()
    try:  # looked up here: the child, forked from a process with threads, only calls it
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        prctl = None

    def preexec() -> None:
        if prctl is None or prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # it died before the line above: no signal will come
            os.kill(os.getpid(), signum)

    return preexec


def ipc_bind_address(directory: str, name: str) -> str:
    """``ipc://DIRECTORY/NAME``, checked (`kvsparse.config.parse_bind_address`).

    Raises:
        InvalidArgument: the path is too long for a Unix socket, or malformed.

    Thread-safe.

    Example:
        >>> ipc_bind_address('/tmp/kvsparse-x', 'server-1')
        'ipc:///tmp/kvsparse-x/server-1'
    """
    return config.parse_bind_address(
        config.IPC_PREFIX + os.path.join(os.path.abspath(directory), name), "socket path"
    )


def has_checkpoint(path: str) -> bool:
    """True if path holds a complete checkpoint (a committed manifest).

    Thread-safe: reads files only.

    Example:
        >>> has_checkpoint('/no/such/directory')
        False
    """
    from kvsparse.shard import checkpoint  # the shard code: only for a restart

    try:
        return checkpoint.latest_manifest(path) is not None
    except (OSError, errors.KVSparseError):
        return False


def restore_arguments(checkpoint_dir: Optional[str], shard_index: int, num_shards: int) -> list:
    """``--restore DIR --shard-index I --num-shards N`` if DIR holds a checkpoint, else [].

    Thread-safe.

    Example:
        >>> restore_arguments(None, 0, 2)
        []
    """
    if checkpoint_dir is None or not has_checkpoint(checkpoint_dir):
        return []
    return [
        "--restore",
        checkpoint_dir,
        "--shard-index",
        str(shard_index),
        "--num-shards",
        str(num_shards),
    ]


def tier_arguments(memory_budget: int, spill_dir: Optional[str], name: str) -> list:
    """``--memory-budget B [--spill-dir SPILL_DIR/NAME]`` of a server; [] without a budget.

    Each server a launcher starts gets its own subdirectory, name, of the job's
    spill directory. Thread-safe.

    Example:
        >>> tier_arguments(1 << 30, "/spill", "server-1")
        ['--memory-budget', '1073741824', '--spill-dir', '/spill/server-1']
    """
    if not memory_budget:
        return []
    arguments = ["--memory-budget", str(int(memory_budget))]
    if spill_dir is not None:
        arguments += ["--spill-dir", os.path.join(spill_dir, name)]
    return arguments


def checkpoint_root_arguments(
    bind: str, keys: Optional[str], checkpoint_dir: Optional[str]
) -> list:
    """``--checkpoint-root DIR`` for a server that would refuse every checkpoint path, else [].

    A server reachable from other hosts without CurveZMQ keys takes CHECKPOINT
    requests only inside a checkpoint root (`kvsparse.server.paths`); a
    launcher that gives its workers a checkpoint directory makes it that
    root, so that ``kv.save()`` works there. Other servers accept any path,
    as before. Thread-safe.

    Example:
        >>> checkpoint_root_arguments('tcp://10.0.0.5:0', None, '/ckpt')
        ['--checkpoint-root', '/ckpt']
        >>> checkpoint_root_arguments('tcp://127.0.0.1:0', None, '/ckpt')
        []
    """
    if checkpoint_dir is None or keys is not None or config.reachable_only_locally(bind):
        return []
    return ["--checkpoint-root", checkpoint_dir]


def server_command(
    bind: str,
    *,
    keys: Optional[str] = None,
    restarted: bool = False,
    extra_args: Sequence = (),
) -> list:
    """The command line of a server: ``python -m kvsparse.server --bind BIND ...``.

    Args:
        bind: the ``tcp://host:port`` to bind (port 0: a free port), or an
            ``ipc:///path`` (`ipc_bind_address`).
        keys: a ``kvsparse keys`` directory (``--keys``): CurveZMQ only.
        restarted: ``--restarted``: it replaces a server that died.
        extra_args: more arguments (`restore_arguments`, user options).

    Thread-safe.

    Example:
        >>> server_command('tcp://h:7', restarted=True)[3:]
        ['--bind', 'tcp://h:7', '--restarted']
    """
    argv = [sys.executable, "-m", "kvsparse.server", "--bind", bind]
    if restarted:
        argv.append("--restarted")
    if keys is not None:
        argv += ["--keys", keys]
    return argv + [str(argument) for argument in extra_args]


def worker_environment(base: Optional[Mapping[str, str]] = None) -> dict:
    """The environment a worker started by kvsparse inherits (rule: module docstring).

    Args:
        base: the parent's environment (default: ``os.environ``), copied,
            not read for settings.

    Thread-safe.

    Example:
        >>> worker_environment({'DMLC_ROLE': 'server', 'KVSPARSE_RANK': '3', 'A': 'b'})
        {'A': 'b', 'PYTHONUNBUFFERED': '1'}
    """
    base = os.environ if base is None else base
    removed = config.FOREIGN_ROLE_VARIABLES + PLACEMENT_VARIABLES
    env = {name: value for name, value in base.items() if name not in removed}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def server_environment(base: Optional[Mapping[str, str]] = None) -> dict:
    """The environment a server started by kvsparse inherits: a worker's, this kvsparse first.

    Args:
        base: the parent's environment (default: ``os.environ``).

    Thread-safe.

    Example:
        >>> 'DMLC_ROLE' in server_environment({'DMLC_ROLE': 'server'})
        False
    """
    env = worker_environment(base)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(kvsparse.__file__)))
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = package_root + (os.pathsep + path if path else "")
    return env


def enter_worker_environment(variables: Mapping[str, str]) -> None:
    """Makes this process's own environment a worker's: the rule above, then variables.

    For a process that kvsparse did not start but that runs a worker's code
    (a Ray actor of `kvsparse.ray.start_colocated`): the variables it
    inherited that place a process (a previous job's rank, say) go, and
    variables (the ``KVSPARSE_*`` of this job) are set, so that
    ``kvsparse.create('dist_sparse')`` there sees what it would see in a
    worker that ``kvsparse launch`` started.

    Not thread-safe: call it while no other thread of the process reads the
    environment.

    Example:
        >>> enter_worker_environment({'KVSPARSE_RANK': '1'})  # doctest: +SKIP
    """
    for name in config.FOREIGN_ROLE_VARIABLES + PLACEMENT_VARIABLES:
        os.environ.pop(name, None)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.update(variables)


class LineWriter:
    """Writes whole lines from several threads to one text stream, each with a prefix.

    Thread-safe: a lock keeps lines whole. A line that the stream's encoding
    cannot hold is written with replacement characters; a closed or broken
    stream drops it.

    Example:
        >>> LineWriter(sys.stdout).line('[server 0] ', b'hello')
        [server 0] hello
    """

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, prefix: str, data: bytes) -> None:
        """Writes prefix + data (decoded as UTF-8, a newline added if it has none)."""
        text = data.decode("utf-8", errors="replace")
        if not text.endswith("\n"):
            text += "\n"
        with self._lock:
            try:
                try:
                    self._stream.write(prefix + text)
                except UnicodeEncodeError:  # e.g. an ASCII-only terminal
                    encoding = getattr(self._stream, "encoding", None) or "ascii"
                    self._stream.write((prefix + text).encode(encoding, "replace").decode(encoding))
                self._stream.flush()
            except (OSError, ValueError):
                pass  # the stream is gone (closed at exit, broken pipe): drop the line


class ChildProcess:
    """A child process in its own process group, its output relayed line by line.

    Two daemon threads read the child's stdout and stderr to their end and
    hand each line (bytes, newline included) to on_stdout / on_stderr, so the
    child never blocks on a full pipe. Its stdin is /dev/null.

    Args:
        argv: the command.
        env: its whole environment (`worker_environment`, `server_environment`).
        label: its name in messages and thread names, e.g. ``'worker 0'``.
        on_stdout, on_stderr: called with each line, from the relay threads.
        cwd: its working directory (default: this process's).
        new_session: True: a session of its own (no controlling terminal, so
            a Ctrl-C in the terminal reaches only the parent); False: only a
            process group of its own, in the parent's session.
        preexec_fn: run in the child before the command (see `subprocess`).
        pass_fds: file descriptors the child inherits (see `subprocess`).

    Raises:
        OSError: the command cannot be started.

    Thread safety: `signal_group`, `stop` and `finish_output` may be called
    from any thread; `stop` from one thread at a time.

    Example:
        >>> out = LineWriter(sys.stdout)
        >>> child = ChildProcess(['echo', 'hi'], worker_environment(), label='echo',
        ...                      on_stdout=lambda line: out.line('[echo] ', line),
        ...                      on_stderr=lambda line: None)  # doctest: +SKIP
        >>> child.process.wait(); child.finish_output(5.0)  # doctest: +SKIP
        [echo] hi
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        label: str,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
        cwd: Optional[str] = None,
        new_session: bool = True,
        preexec_fn: Optional[Callable[[], None]] = None,
        pass_fds: Sequence[int] = (),
    ):
        self.label = label
        self._on_stdout = on_stdout
        self._on_stderr = on_stderr
        if not new_session:
            preexec_fn = _in_own_process_group(preexec_fn)
        self.process = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=new_session,
            preexec_fn=preexec_fn,
            pass_fds=tuple(pass_fds),
        )
        self.pid = self.process.pid
        self._threads = [
            threading.Thread(
                target=self._relay,
                args=(self.process.stdout, self._stdout_line, True),
                daemon=True,
                name=f"kvsparse-{label}-stdout",
            ),
            threading.Thread(
                target=self._relay,
                args=(self.process.stderr, self._stderr_line, False),
                daemon=True,
                name=f"kvsparse-{label}-stderr",
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _stdout_line(self, data: bytes) -> None:
        self._on_stdout(data)

    def _stderr_line(self, data: bytes) -> None:
        self._on_stderr(data)

    def _stdout_closed(self) -> None:
        """Called once, from the stdout thread, when the child's stdout ends."""

    def _relay(self, pipe, handle: Callable[[bytes], None], is_stdout: bool) -> None:
        try:
            for data in iter(pipe.readline, b""):
                handle(data)
        except (OSError, ValueError):
            pass  # the pipe was closed under us during shutdown
        finally:
            if is_stdout:
                self._stdout_closed()
            with contextlib.suppress(OSError):
                pipe.close()

    def signal_group(self, signum: int) -> None:
        """Sends signum to the child's whole process group (it and what it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def stop(self, grace_period: float) -> Optional[int]:
        """SIGTERM to its group, SIGKILL after grace_period seconds; returns its exit status."""
        if self.process.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.process.wait(grace_period)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def finish_output(self, timeout: float) -> None:
        """Waits up to timeout seconds (per stream) for its last lines to be relayed."""
        for thread in self._threads:
            thread.join(timeout)


def _in_own_process_group(then: Optional[Callable[[], None]]) -> Callable[[], None]:
    def preexec() -> None:
        os.setpgrp()
        if then is not None:
            then()

    return preexec


class ServerProcess(ChildProcess):
    """A ``python -m kvsparse.server`` child (`server_command`) that reads its listening line.

    The listening line sets `address` and is not relayed (whoever started
    the server reports the address itself); the server's other lines are.

    Attributes:
        address: the ``tcp://host:port`` (or ``ipc:///path``) it bound, None
            until it says so.
        recent_output: its last 20 relayed lines (bytes), for error messages.

    Thread safety: as `ChildProcess`; `wait_listening` from one thread at a time.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], **options):
        self.address: Optional[str] = None
        self.recent_output: collections.deque = collections.deque(maxlen=_RECENT_LINES)
        self._listening_or_closed = threading.Event()  # set before the stdout thread ends
        super().__init__(argv, env, **options)

    def _stdout_line(self, data: bytes) -> None:
        if self.address is None:
            address = parse_listening_line(data)
            if address is not None:
                self.address = address
                self._listening_or_closed.set()
                return
        self.recent_output.append(data)
        super()._stdout_line(data)

    def _stderr_line(self, data: bytes) -> None:
        self.recent_output.append(data)
        super()._stderr_line(data)

    def _stdout_closed(self) -> None:
        self._listening_or_closed.set()

    def wait_listening(
        self, timeout: float, check: Optional[Callable[[], None]] = None
    ) -> Optional[str]:
        """Waits for the listening line; returns the address, or None.

        None when the server closed its stdout first (it is exiting: it is
        waited for, so that ``process.returncode`` is set) or printed nothing
        within timeout seconds (it still runs). check() is called every 0.1 s
        while waiting; what it raises goes to the caller.
        """
        deadline = time.monotonic() + timeout
        while not self._listening_or_closed.wait(_POLL_SECONDS):
            if check is not None:
                check()
            if time.monotonic() > deadline:
                return None
        if self.address is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(max(_FAILED_SERVER_GRACE_PERIOD, deadline - time.monotonic()))
        return self.address

    def recent_text(self) -> str:
        """Its last relayed lines, as one string (for an error message)."""
        return b"".join(self.recent_output).decode(errors="replace").strip()


def start_server(
    start: Callable[[], ServerProcess],
    *,
    listen_timeout: float,
    retry_until: float,
    check: Optional[Callable[[], None]] = None,
) -> ServerProcess:
    """Starts a server with start() and waits for it to listen, binding again while needed.

    A server that exits with `CANNOT_BIND` before listening is started again
    `BIND_RETRY_PAUSE` seconds later, until retry_until: the port that a
    server which just died held may stay taken for a moment (for an ipc
    socket, the server refuses to bind while another one still answers there).

    Args:
        start: makes one `ServerProcess` (called once per attempt).
        listen_timeout: seconds each attempt may take to print its address.
        retry_until: no new attempt after this `time.monotonic()` time.
        check: called while waiting (see `ServerProcess.wait_listening`).

    Returns:
        The server that listens, or the last one that did not (stopped, its
        ``address`` None; ``process.returncode`` and `ServerProcess.recent_text`
        say why): the caller words the error.

    Thread safety: may be called from several threads, each with its own start.
    """
    while True:
        server = start()
        if server.wait_listening(listen_timeout, check) is not None:
            return server
        code = server.stop(_FAILED_SERVER_GRACE_PERIOD)
        server.finish_output(_FAILED_SERVER_GRACE_PERIOD)
        if code != CANNOT_BIND or time.monotonic() >= retry_until:
            return server
        time.sleep(BIND_RETRY_PAUSE)


def wait_answering(
    address: str,
    deadline: float,
    keys: Optional[str] = None,
    check: Optional[Callable[[], None]] = None,
) -> bool:
    """Pings address until the server answers (True) or `time.monotonic()` passes deadline.

    Args:
        address: ``tcp://host:port`` or ``ipc:///path``.
        deadline: a `time.monotonic()` time.
        keys: its ``kvsparse keys`` directory, if it is a CurveZMQ server
            (default: ``KVSPARSE_KEYS``, else none).
        check: called between pings; what it raises goes to the caller.

    Thread-safe.

    Example:
        >>> wait_answering('tcp://127.0.0.1:1', time.monotonic() + 0.1)  # doctest: +SKIP
        False
    """
    # Imported here: the client loads ZeroMQ and the wire code, which a launcher
    # that only starts processes does not need until its servers are up.
    from kvsparse.client.remote import ping

    while not ping(address, min(1.0, max(0.05, deadline - time.monotonic())), keys):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            return False
    return True


__all__ = [
    "BIND_RETRY_PAUSE",
    "CANNOT_BIND",
    "ChildProcess",
    "LineWriter",
    "PLACEMENT_VARIABLES",
    "ServerProcess",
    "TRANSPORTS",
    "check_transport",
    "has_checkpoint",
    "ipc_bind_address",
    "checkpoint_root_arguments",
    "restore_arguments",
    "server_command",
    "enter_worker_environment",
    "server_environment",
    "socket_directory",
    "die_with_parent",
    "pid_alive",
    "start_server",
    "wait_answering",
    "worker_environment",
]
