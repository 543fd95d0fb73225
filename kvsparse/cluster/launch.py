"""Start servers and workers on this host (or over several): ``kvsparse launch`` and its API.

``kvsparse launch -s 2 -n 2 -- python train.py`` starts two servers
(``python -m kvsparse.server`` on free ports), waits until both answer, then
starts two workers running ``python train.py`` with ``KVSPARSE_SERVERS``,
``KVSPARSE_RANK`` and ``KVSPARSE_NUM_WORKERS`` set, so that
``kvsparse.create('dist_sparse')`` needs no arguments in the script.

- Every child runs in its own session (process group), so that stopping a
  child also stops whatever it started, and a Ctrl-C in the terminal reaches
  only the launcher, which then stops the children in order.
- Output is relayed line by line with a prefix: ``[worker 0] `` for a
  worker's stdout (to stdout) and stderr (to stderr), ``[server 1] `` for a
  server's. The launcher's own messages start with ``kvsparse launch: `` and go
  to stderr; they give each child's pid.
- Children inherit the launcher's environment by the rule of
  `kvsparse.cluster.process`: without ``DMLC_ROLE``, ``PORT`` and
  ``TF_CONFIG`` (with them, ``import mxnet`` would turn a worker into an
  MXNet ps-lite node), without the ``KVSPARSE_*`` variables that place a
  process in a cluster (the workers' come from the launcher's options), and
  with ``PYTHONUNBUFFERED=1`` (unless set) so that their lines arrive as
  they are printed. Their stdin is /dev/null.
- The job ends when every worker has exited, when a worker fails, when a
  server dies, or on SIGINT/SIGTERM. Then the workers' process groups, then
  the servers', get SIGTERM, and SIGKILL after a grace period (a second
  Ctrl-C skips the grace period). A launcher killed by SIGKILL cannot do
  this and leaves its children running.
- With ``restart_servers`` (``--restart-servers``), a server that dies is
  started again on the same address (at most ``max_restarts`` times each),
  with ``--restore CHECKPOINT_DIR --shard-index I --num-shards N`` when
  ``checkpoint_dir`` holds a complete checkpoint; the workers get
  ``KVSPARSE_RETRY_WINDOW`` so that they say HELLO again and resend what
  was in flight (`kvsparse.client.remote`). Without it a dead server ends the job.
- ``transport`` (``--transport``): ``'ipc'`` puts the servers on Unix sockets
  (``ipc:///tmp/kvsparse-XXXXXXXX/server-I``) in a private temporary
  directory (mode 0700: only this user can connect), removed when the job
  ends, and the workers then pass rows through shared memory
  (`kvsparse.client.shared`); ``'tcp'`` on free ports of ``host``. A
  restarted server binds the same socket path. The default is ipc, the
  workers being on this host too (a W1 step took 0.82-0.86x the time of the
  same over the sockets, docs/operations.md), and tcp when ``host`` is given
  or the job is colocated (the workers' own shards listen on tcp ports).
- ``save_every`` (``--save-every S``, with ``--checkpoint-dir``): rank 0
  saves on that interval while training runs, full then deltas
  (`kvsparse.store.periodic`), for serving replicas that follow the
  directory; ``keep`` (``--keep N``) bounds the delta chain.
- ``colocated`` (``--colocated``): no server processes; worker
  ``r`` hosts shard ``r`` itself (`kvsparse.store.colocated`). The launcher
  gives each worker a shard address (tcp: a port of ``host`` the launcher
  binds and listens on for the whole job, whose socket the worker inherits
  and serves, ``KVSPARSE_SHARD_FD``, so no other process can take it;
  ipc: ``ipc:///tmp/kvsparse-XXXXXXXX/worker-R``) and
  sets ``KVSPARSE_PEERS`` (every worker's, in rank order; also as
  ``KVSPARSE_SERVERS``, so that ``kvsparse stats`` finds the shards), with
  which ``kvsparse.create('dist_sparse')`` (or any dist kind) is colocated.
  ``num_servers`` must stay 1 (its default); ``restart_servers`` is refused.
- ``restart_workers`` (``--restart-workers``, colocated only): a worker that
  exits with a non-zero code is started again (at most ``max_restarts``
  times each) with the same rank, shard address and variables, plus
  ``KVSPARSE_RESTARTED=K`` (its K-th restart). Its store restores shard
  ``r`` from the last complete checkpoint in ``checkpoint_dir`` and resumes
  its rank's push count (``kv.clock``); the others wait for it
  (``KVSPARSE_RETRY_WINDOW`` and ``KVSPARSE_REJOIN_WINDOW``, both the retry
  window). See `kvsparse.store.colocated` for what a restarted worker sees.
- ``checkpoint_dir`` (``--checkpoint-dir``) reaches the workers as
  ``KVSPARSE_CHECKPOINT_DIR``; ``keys`` (``--keys``, a ``kvsparse keys``
  directory) makes the servers CurveZMQ-only and reaches the workers as
  ``KVSPARSE_KEYS``.
- ``nnodes``, ``node_rank``, ``rendezvous`` (``--nnodes N --node-rank R
  --rendezvous tcp://HOST:PORT``): this host's part of a job over N hosts,
  one launcher on each (`kvsparse.cluster.rendezvous`). Node 0's launcher
  serves the rendezvous; every launcher starts its servers (or binds its
  colocated shards) on ``host`` over tcp, offers their addresses, and starts
  its workers with the whole job's server list, ranks node-major, once all
  N have joined. A launcher that has not joined within ``rendezvous_wait``
  is named to the others; one whose job fails, or that goes away, ends the
  job on every host. ipc and shared memory are not used: they reach only
  this host's processes.
- Exit code: 0 if every worker succeeded; else the code of the first worker
  to fail, in time order (a worker killed by signal N counts as 128 + N);
  1 if a server died first, or (several hosts) another host's job failed or
  its launcher went away; 128 + N if the launcher got signal N.
- A worker that exits with code 0 while others still run is a normal end
  and is not logged (workers finish one after the other). If the others
  needed it (in a BSP job, their next round or barrier fails with
  `kvsparse.errors.WorkerLeft` naming its rank), the launcher's message for
  the first of them to fail says which ranks had left (``worker 0 exited with
  code 1; stopping the job (after worker 1 left early, with code 0)``).

Example:
    >>> import sys
    >>> from kvsparse.cluster.launch import launch
    >>> script = 'import kvsparse; print(kvsparse.create("dist_sparse").rank)'
    >>> launch([sys.executable, '-c', script], num_servers=2, num_workers=2)  # doctest: +SKIP
    [worker 0] 0
    [worker 1] 1
    0
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Optional, TextIO

from kvsparse import config, errors
from kvsparse.cluster import process
from kvsparse.cluster import rendezvous as rendezvous_module

# Variables the launcher sets itself; --env may not override them.
_RESERVED = (
    config.SERVERS,
    config.RANK,
    config.NUM_WORKERS,
    config.TIMEOUT,
    config.STALENESS,
    config.PEERS,
    config.RESTARTED,
)
DEFAULT_RETRY_WINDOW = config.DEFAULT_RETRY_WINDOW
_POLL_SECONDS = 0.1
# How long a failing worker's message waits for others' clean exits to name them (`_clean_exits`).
_LEFT_GRACE_SECONDS = 1.0
_LOG = "kvsparse launch: "
DEFAULT_HOST = "127.0.0.1"
DEFAULT_TRANSPORT = "tcp"  # local_cluster's (its callers may be anywhere)
LAUNCH_TRANSPORT = "ipc"  # launch's: its workers run on this host


class _Stopped(Exception):
    """The launcher got SIGINT or SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def check_worker_variables(extra: Optional[Mapping[str, str]]) -> dict:
    """A copy of extra (variables for the workers), checked; None gives {}.

    Raises:
        InvalidArgument: a bad name, a value that is not a str, a variable
            the launcher sets itself (server list, rank, ...), or DMLC_ROLE.

    Thread-safe.

    Example:
        >>> check_worker_variables({'OMP_NUM_THREADS': '4'})
        {'OMP_NUM_THREADS': '4'}
    """
    extra = dict(extra or {})
    for key, value in extra.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise errors.InvalidArgument(f"environment variable name {key!r} is not valid")
        if not isinstance(value, str):
            raise errors.InvalidArgument(f"environment variable {key} must be a str, got {value!r}")
        if key in _RESERVED:
            raise errors.InvalidArgument(
                f"{key} is set by the launcher; use its options (-s, -n, --timeout, --staleness)"
            )
        if key == "DMLC_ROLE":
            raise errors.InvalidArgument(
                "DMLC_ROLE would make MXNet's ps-lite take over the workers; kvsparse needs none"
            )
    return extra


class _Cluster:
    """The processes of one job, and how to stop them all.

    Not thread-safe: one launcher thread drives it (the signal handler only
    sets `signum` and `hurry`).
    """

    def __init__(self, out: process.LineWriter, err: process.LineWriter, grace_period: float):
        self.out = out
        self.err = err
        self.grace_period = grace_period
        self.keys: Optional[str] = None  # CurveZMQ key directory of the servers
        self.restart_servers = False
        self.max_restarts = 0
        self.checkpoint_dir: Optional[str] = None
        # Every shard's memory budget (0: none) and the disk tiers' directory, in which
        # each server (worker, colocated) of this host gets a subdirectory of its own.
        self.memory_budget = 0
        self.spill_dir: Optional[str] = None
        self.colocated = False
        self.server_env = process.server_environment()
        self.socket_directory: Optional[str] = None  # the ipc sockets' (transport 'ipc')
        # Colocated over tcp: rank -> the listening socket its shard inherits and serves.
        self.shard_listeners: dict[int, socket.socket] = {}
        self.restarts: dict[int, int] = {}
        # Over several hosts, this host's servers are shards shard_offset.. of num_shards
        # (what a restarted one restores); on one host, 0.. of len(servers).
        self.shard_offset = 0
        self.num_shards: Optional[int] = None
        self.restart_workers = False
        self.worker_restarts: dict[int, int] = {}
        self._worker_starts: dict[int, tuple] = {}  # rank -> (command, environment, cwd)
        self.startup_timeout = 60.0
        self.servers: list[process.ServerProcess] = []
        self.workers: list[process.ChildProcess] = []  # this host's, by local index
        self.first_rank = 0  # the rank of workers[0] (a job over several hosts: see rendezvous)
        self.events: queue.Queue = queue.Queue()  # (role, index, child, returncode), exit order
        self.signum: Optional[int] = None  # set by the signal handler; checked by the loops
        self.stopping = False
        self.failure = ""  # why the job stopped, for the other hosts (see rendezvous)
        self.hurry = False  # a signal while stopping: skip the grace period

    def log(self, message: str) -> None:
        self.err.line(_LOG, message.encode())

    def check_signal(self) -> None:
        if self.signum is not None:
            raise _Stopped(self.signum)

    def _relayed(self, role: str, index: int) -> dict:
        """A child's label and its output relays: ``[worker 0] `` lines to out and err."""
        prefix = f"[{role} {index}] "
        return {
            "label": f"{role} {index}",
            "on_stdout": functools.partial(self.out.line, prefix),
            "on_stderr": functools.partial(self.err.line, prefix),
            # A launcher killed with SIGKILL cannot stop its children: they get the
            # SIGTERM it would have sent them (else its servers served on, orphaned).
            "preexec_fn": process.die_with_parent(signal.SIGTERM),
        }

    def _watch(self, role: str, index: int, child: process.ChildProcess) -> None:
        def wait():
            self.events.put((role, index, child, child.process.wait()))

        threading.Thread(target=wait, daemon=True, name=f"kvsparse-wait-{child.pid}").start()

    # -- servers ----------------------------------------------------------------------------

    def tier_arguments(self, index: int) -> list:
        """``--memory-budget`` and ``--spill-dir`` of server index (empty without a budget)."""
        return process.tier_arguments(self.memory_budget, self.spill_dir, f"server-{index}")

    def tier_environment(self, rank: int) -> dict:
        """What a colocated worker's shard takes as its budget and spill directory."""
        if not (self.colocated and self.memory_budget):
            return {}
        found = {config.MEMORY_BUDGET: str(self.memory_budget)}
        if self.spill_dir is not None:
            found[config.SPILL_DIR] = os.path.join(self.spill_dir, f"worker-{rank}")
        return found

    def _server(self, index: int, argv: list) -> process.ServerProcess:
        return process.ServerProcess(argv, self.server_env, **self._relayed("server", index))

    def _bind_addresses(self, count: int, transport: str, host: str) -> list[str]:
        if transport == "ipc":
            return self._ipc_addresses("server", count)
        # Port 0: each server picks a free port and says which in its listening line.
        return [config.format_address(host, 0)] * count

    def colocated_addresses(self, count: int, transport: str, host: str) -> list[str]:
        """The shard address of each colocated worker (see `launch`'s ``colocated``).

        tcp: each port is bound and listened on here, and held until the job
        ends; worker r inherits its socket (`config.SHARD_FD`) and serves it,
        so no other process can take the port first, nor while r restarts.
        """
        if transport == "ipc":
            return self._ipc_addresses("worker", count)
        # Where a worker binds for host (loopback or an IP as is, a name on all interfaces).
        bind_host = config.peer_bind_address(config.format_address(host, 1))[len("tcp://") :]
        bind_host = bind_host.rsplit(":", 1)[0].strip("[]")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        addresses = []
        for rank in range(count):
            try:
                listener = socket.create_server(
                    ("" if bind_host == "*" else bind_host, 0), family=family, backlog=128
                )
            except OSError as exc:
                raise errors.InvalidArgument(
                    f"cannot listen on {host} for colocated worker {rank}'s shard: {exc}"
                ) from None
            self.shard_listeners[rank] = listener
            addresses.append(config.format_address(host, listener.getsockname()[1]))
        return addresses

    def _ipc_addresses(self, role: str, count: int) -> list[str]:
        """``ipc://`` addresses role-0 .. role-(count-1) in a new private socket directory."""
        try:
            self.socket_directory = process.socket_directory()
        except OSError as exc:
            raise errors.InvalidArgument(
                f"cannot make a directory for the ipc sockets: {exc}"
            ) from None
        return [
            process.ipc_bind_address(self.socket_directory, f"{role}-{index}")
            for index in range(count)
        ]

    def start_servers(
        self, count: int, host: str, startup_timeout: float, transport: str = "tcp"
    ) -> list[str]:
        binds = self._bind_addresses(count, transport, host)
        self.startup_timeout = startup_timeout
        for index in range(count):
            self.check_signal()
            argv = process.server_command(
                binds[index],
                keys=self.keys,
                extra_args=process.checkpoint_root_arguments(
                    binds[index], self.keys, self.checkpoint_dir
                )
                + self.tier_arguments(index),
            )
            self.servers.append(self._server(index, argv))
        deadline = time.monotonic() + startup_timeout
        for index, child in enumerate(self.servers):
            if child.wait_listening(deadline - time.monotonic(), self.check_signal) is not None:
                self.log(f"server {index} (pid {child.pid}) listening on {child.address}")
            elif child.process.returncode is None:
                raise errors.ServerUnavailable(
                    f"server {index} (pid {child.pid}) printed no address within "
                    f"{startup_timeout:g} s"
                )
            else:
                raise errors.ServerUnavailable(
                    f"server {index} exited with code {_exit_code(child.process.returncode)} "
                    "before listening (see its [server] lines above)"
                )
        for index, child in enumerate(self.servers):
            check = functools.partial(self._check_server_alive, index, child)
            if not process.wait_answering(child.address, deadline, self.keys, check):
                raise errors.ServerUnavailable(
                    f"server {index} at {child.address} did not answer within "
                    f"{startup_timeout:g} s",
                    address=child.address,
                )
        for index, child in enumerate(self.servers):
            self._watch("server", index, child)
        return [child.address for child in self.servers]

    def _check_server_alive(self, index: int, child: process.ServerProcess) -> None:
        self.check_signal()
        if child.process.poll() is not None:
            raise errors.ServerUnavailable(
                f"server {index} exited with code {_exit_code(child.process.returncode)} "
                "before answering",
                address=child.address,
            )

    def restart_server(self, index: int, dead: process.ServerProcess) -> None:
        """Starts server index again on dead's address, restoring the last checkpoint if any.

        An ipc server binds its socket path again: a server killed without
        stopping leaves the socket file, which the new one replaces.

        Raises:
            ServerUnavailable: it did not listen on that address in time.
        """
        self.restarts[index] = self.restarts.get(index, 0) + 1
        restore = process.restore_arguments(
            self.checkpoint_dir,
            self.shard_offset + index,
            self.num_shards or len(self.servers),
        )
        root = process.checkpoint_root_arguments(dead.address, self.keys, self.checkpoint_dir)
        argv = process.server_command(
            dead.address,
            keys=self.keys,
            restarted=True,
            extra_args=restore + root + self.tier_arguments(index),
        )

        def start() -> process.ServerProcess:
            self.check_signal()
            # In the list at once: a signal while it starts must stop it too.
            self.servers[index] = self._server(index, argv)
            return self.servers[index]

        child = process.start_server(
            start,
            listen_timeout=self.startup_timeout,
            retry_until=time.monotonic() + self.startup_timeout,
            check=self.check_signal,
        )
        if child.address is None:
            raise errors.ServerUnavailable(
                f"server {index} could not be restarted on {dead.address} (last exit code "
                f"{_exit_code(child.process.returncode)})",
                address=dead.address,
            )
        self.log(
            f"server {index} (pid {child.pid}) restarted on {child.address}"
            + (" from " + self.checkpoint_dir if restore else " with no checkpoint")
        )
        self._watch("server", index, child)

    # -- workers ----------------------------------------------------------------------------

    def start_workers(
        self,
        command: Sequence[str],
        count: int,
        cluster_config: dict,
        extra: Mapping[str, str],
        cwd: Optional[str],
        first_rank: int = 0,
        num_workers: Optional[int] = None,
    ) -> None:
        """Starts count workers, ranks first_rank.. of num_workers (default count) in all.

        Worker i of this host is ``workers[i]`` and has rank ``first_rank + i``;
        its colocated shard listener, if any, is ``shard_listeners[i]``.
        """
        env = process.worker_environment()
        self.first_rank = first_rank
        total = count if num_workers is None else num_workers
        for local in range(count):
            self.check_signal()
            rank = first_rank + local
            worker_config = config.ClusterConfig(rank=rank, num_workers=total, **cluster_config)
            worker_env = dict(env)
            worker_env.update(worker_config.to_environment())
            worker_env.update(extra)
            worker_env.update(self.tier_environment(rank))
            listener = self.shard_listeners.get(local)
            if listener is not None:
                worker_env[config.SHARD_FD] = str(listener.fileno())
            self._worker_starts[local] = (list(command), worker_env, cwd)
            try:
                child = process.ChildProcess(
                    command,
                    worker_env,
                    cwd=cwd,
                    pass_fds=self._passed_fds(local),
                    **self._relayed("worker", rank),
                )
            except OSError as exc:
                raise errors.InvalidArgument(
                    f"cannot start worker {rank}: {shlex.join(command)}: {exc}"
                ) from None
            self.workers.append(child)
            self._watch("worker", local, child)
            self.log(f"worker {rank} (pid {child.pid}) started: {shlex.join(command)}")

    def _passed_fds(self, rank: int) -> tuple:
        """The file descriptors worker rank inherits: its shard's listening socket, if any."""
        listener = self.shard_listeners.get(rank)
        return (listener.fileno(),) if listener is not None else ()

    def restart_worker(self, rank: int) -> bool:
        """Starts this host's colocated worker ``workers[rank]`` again (``KVSPARSE_RESTARTED``).

        ``KVSPARSE_RESTARTED`` is its restart count.

        Its store binds the same shard address and restores the checkpoint
        (`kvsparse.store.colocated`). Returns False if it cannot be started.
        """
        local, rank = rank, self.first_rank + rank
        self.worker_restarts[local] = count = self.worker_restarts.get(local, 0) + 1
        command, env, cwd = self._worker_starts[local]
        env = dict(env)
        env[config.RESTARTED] = str(count)
        try:
            child = process.ChildProcess(
                command,
                env,
                cwd=cwd,
                pass_fds=self._passed_fds(local),
                **self._relayed("worker", rank),
            )
        except OSError as exc:
            self.log(f"cannot start worker {rank} again: {exc}")
            return False
        self.workers[local] = child
        self._watch("worker", local, child)
        # "(pid N) started": the same words as a first start (benchmarks/faults.py reads them).
        self.log(
            f"worker {rank} (pid {child.pid}) started again (restart {count} of at most "
            f"{self.max_restarts}): {shlex.join(command)}"
        )
        return True

    def wait_workers(self) -> int:
        """Waits for every worker; returns at the first failure (exit code as documented).

        A worker that exits 0 while others still run is a normal end, not
        logged; the message of a worker failing later names the ranks that
        had left (in a BSP job the others can complete no round or barrier
        without them: the servers fail those with WorkerLeft).
        """
        running = set(range(len(self.workers)))
        left: list[int] = []  # ranks that exited 0 while others still ran
        while running:
            self.check_signal()
            try:
                role, index, child, returncode = self.events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            if role == "rendezvous":
                return self._rendezvous_stop(returncode)
            code = _exit_code(returncode)
            if role == "server":
                if self._server_exit(index, child, code):
                    return 1
                continue
            rank = self.first_rank + index
            if child is not self.workers[index]:
                continue  # a replaced worker's exit, already handled
            if (
                code != 0
                and self.restart_workers
                and self.worker_restarts.get(index, 0) < self.max_restarts
            ):
                self.log(f"worker {rank} exited with code {code}; restarting it")
                if self.restart_worker(index):
                    continue
            running.discard(index)
            if code != 0:
                left.extend(self.first_rank + r for r in self._clean_exits(running))
                earlier = ""
                if left:
                    ranks = ", ".join(map(str, left))
                    earlier = f" (after worker {ranks} left early, with code 0)"
                self.log(f"worker {rank} exited with code {code}; stopping the job{earlier}")
                self.failure = f"worker {rank} exited with code {code}"
                return code
            if running:
                # A normal end (workers finish one after the other): said only if a later
                # worker fails, in its message. What waited for this one in a BSP job fails
                # there with WorkerLeft naming its rank.
                left.append(rank)
        return 0

    def _clean_exits(self, running: set) -> list:
        """Workers of running that exit with code 0 within _LEFT_GRACE_SECONDS (sorted).

        A worker that closed its store says goodbye before its process ends: the
        workers that waited for it may fail before its exit is seen. Other events
        read meanwhile are put back.
        """
        found, kept = [], []
        deadline = time.monotonic() + _LEFT_GRACE_SECONDS
        while running and time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            role, index, child, returncode = event
            if (
                role == "worker"
                and child is self.workers[index]
                and index in running
                and _exit_code(returncode) == 0
            ):
                running.discard(index)
                found.append(index)
            else:
                kept.append(event)
        for event in kept:
            self.events.put(event)
        return sorted(found)

    def _server_exit(self, index: int, child: process.ServerProcess, code: int) -> bool:
        """Handles a server's exit: restarts it if allowed; True if the job must stop."""
        if child is not self.servers[index]:
            return False  # a replaced server's exit, already handled
        if self.restart_servers and self.restarts.get(index, 0) < self.max_restarts:
            self.log(f"server {index} exited with code {code}; restarting it")
            self.restart_server(index, child)
            return False
        self.log(f"server {index} exited with code {code}; stopping the job")
        self.failure = f"server {index} exited with code {code}"
        return True

    def _rendezvous_stop(self, message: dict) -> int:
        """The rendezvous ended the job (message: ``end``, ``stop`` or ``gone``): the exit code."""
        if "end" in message:
            return 0
        reason = message.get("stop") or message.get("gone") or str(message)
        self.log(f"{reason}; stopping the job")
        return 1

    def on_rendezvous(self, message: dict) -> None:
        """Called by the rendezvous connection's thread: queued for the launcher's loop."""
        self.events.put(("rendezvous", 0, None, message))

    def wait_job(self) -> int:
        """After this host's workers succeeded: serves on until the rendezvous ends the job.

        The other hosts' workers still use this host's servers. Returns 0 at
        ``end``, 1 at ``stop`` or when the rendezvous is gone, or when a
        server dies (and may not be restarted).
        """
        while True:
            self.check_signal()
            try:
                role, index, child, returncode = self.events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            if role == "rendezvous":
                return self._rendezvous_stop(returncode)
            if role == "server" and self._server_exit(index, child, _exit_code(returncode)):
                return 1

    # -- stopping ---------------------------------------------------------------------------

    def _stop_group(self, children: list, deadline_seconds: float) -> None:
        for child in children:
            # Also to the groups of children that exited: what they started gets SIGTERM too.
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + deadline_seconds
        for child in children:
            while child.process.poll() is None and time.monotonic() < deadline:
                if self.hurry:
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(_POLL_SECONDS)
        for child in children:
            if child.process.poll() is None:
                self.log(f"{child.label} (pid {child.pid}) ignored SIGTERM; killing it")
            child.signal_group(signal.SIGKILL)
        for child in children:
            child.process.wait()

    def stop(self) -> None:
        """Stops the workers, then the servers; never leaves a child running.

        Then removes the ipc sockets' directory, with the socket files of
        servers that were killed.
        """
        self.stopping = True
        try:
            self._stop_group(self.workers, self.grace_period)
            self._stop_group(self.servers, self.grace_period)
            for child in self.workers + self.servers:
                child.finish_output(1.0)
        finally:
            for listener in self.shard_listeners.values():
                listener.close()
            self.shard_listeners.clear()
            if self.socket_directory is not None:
                shutil.rmtree(self.socket_directory, ignore_errors=True)


@contextlib.contextmanager
def _signals_stop(cluster: _Cluster) -> Iterator[None]:
    """While running: SIGINT/SIGTERM ask the cluster to stop (checked by its loops)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread; the caller handles signals
        return

    def handler(signum, frame):
        del frame
        if cluster.signum is None and not cluster.stopping:
            cluster.signum = signum
        else:
            cluster.hurry = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def free_port(host: str) -> int:
    """A tcp port of host that is free now (bound to port 0, then released). Thread-safe.

    Another process may take it before the caller binds it (tests and
    benchmarks use it; ``kvsparse launch --colocated`` holds its ports instead).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _transport_and_host(
    transport: Optional[str], host: Optional[str], default: str = DEFAULT_TRANSPORT
) -> tuple:
    """(transport, host) checked; no transport: tcp where a host is given, else default."""
    if transport is None:
        transport = "tcp" if host is not None else default
    transport = process.check_transport(transport)
    if transport == "ipc" and host is not None:
        raise errors.InvalidArgument(
            "host is the interface of tcp servers; with transport 'ipc' the servers listen "
            "on Unix sockets (give one of the two)"
        )
    return transport, DEFAULT_HOST if host is None else host


def _check_periodic_save(save_every, keep, checkpoint_dir, extra: dict) -> None:
    """Checks --save-every / --keep and puts them in the workers' variables (extra)."""
    if save_every is None:
        if keep is not None:
            raise errors.InvalidArgument("keep goes with save_every (--keep with --save-every)")
        return
    if isinstance(save_every, bool) or not isinstance(save_every, (int, float)):
        raise errors.InvalidArgument(f"save_every must be seconds > 0, got {save_every!r}")
    if not 0 < save_every < float("inf"):
        raise errors.InvalidArgument(f"save_every must be seconds > 0, got {save_every!r}")
    if checkpoint_dir is None:
        raise errors.InvalidArgument("save_every needs checkpoint_dir (--checkpoint-dir DIR)")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        raise errors.InvalidArgument(f"keep must be an integer >= 0, got {keep!r}")
    extra.setdefault(config.SAVE_EVERY, repr(float(save_every)))
    if keep is not None:
        extra.setdefault(config.SAVE_KEEP, str(keep))


def _check_counts(num_servers, num_workers) -> None:
    for name, value in (("num_servers", num_servers), ("num_workers", num_workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise errors.InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")


def launch(
    command,
    num_servers: int = 1,
    num_workers: int = 1,
    *,
    host: Optional[str] = None,
    transport: Optional[str] = None,
    timeout: Optional[float] = None,
    staleness: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
    startup_timeout: float = 60.0,
    grace_period: float = 5.0,
    restart_servers: bool = False,
    max_restarts: int = 3,
    retry_window: Optional[float] = None,
    checkpoint_dir: Optional[str] = None,
    keys: Optional[str] = None,
    save_every: Optional[float] = None,
    keep: Optional[int] = None,
    colocated: bool = False,
    restart_workers: bool = False,
    nnodes: Optional[int] = None,
    node_rank: Optional[int] = None,
    rendezvous: Optional[str] = None,
    rendezvous_wait: Optional[float] = None,
    memory_budget: int = 0,
    spill_dir: Optional[str] = None,
) -> int:
    """Runs a job on this host (or this host's part of one over several): servers, then workers.

    Args:
        command: the worker command, a list of arguments (or a str, split
            like a shell would).
        num_servers: servers (shards) to start.
        num_workers: workers to start; worker r gets ``KVSPARSE_RANK=r``.
        host: interface tcp servers listen on (workers connect to the
            addresses the servers print); default 127.0.0.1.
        transport: 'ipc' (the default without host, and not colocated): Unix
            sockets in a private temporary directory, removed at the end,
            rows through shared memory; or 'tcp' (the default with host or
            colocated).
        timeout: ``KVSPARSE_TIMEOUT`` for the workers (seconds), or None.
        staleness: ``KVSPARSE_STALENESS`` for the workers, or None.
        env: extra variables for the workers (not the ``KVSPARSE_*`` ones the
            launcher sets, nor ``DMLC_ROLE``).
        cwd: the workers' working directory (default: the current one).
        stdout, stderr: where the prefixed output goes (default: sys.stdout,
            sys.stderr).
        startup_timeout: seconds to wait for the servers to answer.
        grace_period: seconds between SIGTERM and SIGKILL when stopping.
        restart_servers: start a server that dies again on its address
            (restoring ``checkpoint_dir`` if it holds a checkpoint), at most
            max_restarts times per server; the workers retry meanwhile.
        max_restarts: restarts allowed per server.
        retry_window: ``KVSPARSE_RETRY_WINDOW`` for the workers: seconds they
            keep retrying a restarted server (default with restart_servers:
            DEFAULT_RETRY_WINDOW; without: not set, no retry).
        checkpoint_dir: ``KVSPARSE_CHECKPOINT_DIR`` for the workers (where
            ``kv.save()`` writes by default) and what restarted servers restore.
        keys: a ``kvsparse keys`` directory: CurveZMQ for the servers, and
            ``KVSPARSE_KEYS`` for the workers.
        save_every: seconds: rank 0's store saves into checkpoint_dir on
            this interval while training runs (full first, then deltas:
            `kvsparse.store.periodic`), for serving replicas that follow it
            (``kvsparse serve --follow``). The workers get ``KVSPARSE_SAVE_EVERY``.
        keep: with save_every, at most this many deltas on a full checkpoint
            (then a full one; older chains are deleted). ``KVSPARSE_SAVE_KEEP``.
        colocated: start no servers: each worker hosts its own shard
            (``KVSPARSE_PEERS``; see the module docstring). num_servers must
            be 1 and restart_servers False.
        restart_workers: with colocated only: start a worker that exits with
            a non-zero code (killed, say) again, with the same rank and shard
            address and ``KVSPARSE_RESTARTED`` set, at most max_restarts times
            per worker; it restores its shard from checkpoint_dir and resumes
            (`kvsparse.store.colocated`). The workers get ``KVSPARSE_RETRY_WINDOW``
            (as with restart_servers) and ``KVSPARSE_REJOIN_WINDOW`` (the same
            seconds: how long their shards wait for a dead worker to come back).
        nnodes, node_rank, rendezvous: a job over nnodes hosts, one launcher on
            each (`kvsparse.cluster.rendezvous`): this is node node_rank; the
            launchers meet at rendezvous (``tcp://HOST:PORT``, served by node
            0's launcher). Each starts num_servers servers and num_workers
            workers on its host: the job has nnodes * num_servers shards
            (node-major) and nnodes * num_workers workers (node 0's are ranks
            0..num_workers-1). Over tcp only; host is the address this host is
            reached at (default: the source address of its route to the
            rendezvous host), which its servers listen on.
        rendezvous_wait: seconds for every launcher to join (default
            `config.DEFAULT_RENDEZVOUS_WAIT`); one that has not is named to
            the others (`kvsparse.errors.NodeUnavailable`) and the job ends.
        memory_budget: bytes each shard may hold in memory (``--memory-budget``
            of every server; with colocated, ``KVSPARSE_MEMORY_BUDGET`` of every
            worker); 0: none.
        spill_dir: the disk tier's directory (needs memory_budget): server i
            of this host spills under ``spill_dir/server-i`` (colocated worker
            r: ``spill_dir/worker-r``).

    Returns:
        The exit code: 0 if all workers succeeded (on every host), else the
        first failing worker's (in time order; 128 + N for a worker killed by
        signal N), 1 if a server died or (several hosts) another host's job
        failed or its launcher went away, 128 + N if the launcher got signal N
        (SIGINT: 130).

    Raises:
        InvalidArgument: a bad count, command or option.
        ServerUnavailable: a server did not start or answer in time (the
            servers already started are stopped).
        NodeUnavailable: (several hosts) a launcher did not join in time, the
            rendezvous could not be reached, or it refused this launcher.

    Thread safety: several jobs may run at once from different threads.
    Only a call from the main thread installs the SIGINT/SIGTERM handlers
    that stop the job; from another thread, stopping it is the caller's task.

    Example:
        >>> launch(['python', 'train.py'], num_servers=2, num_workers=2)  # doctest: +SKIP
        0
    """
    _check_counts(num_servers, num_workers)
    placement = config.node_placement(nnodes, node_rank, rendezvous, environ={})
    if placement is not None:
        if transport == "ipc":
            raise errors.InvalidArgument(
                "transport 'ipc' reaches only this host's processes; a job over several hosts "
                "(nnodes) uses tcp"
            )
        transport = "tcp"
        if host is None:
            host = rendezvous_module.route_source_address(
                *config.split_tcp_address(placement.rendezvous, "--rendezvous")
            )
    if rendezvous_wait is None:
        rendezvous_wait = config.DEFAULT_RENDEZVOUS_WAIT
    if isinstance(rendezvous_wait, bool) or not isinstance(rendezvous_wait, (int, float)):
        raise errors.InvalidArgument(
            f"rendezvous_wait must be seconds > 0, got {rendezvous_wait!r}"
        )
    if not 0 < rendezvous_wait < float("inf"):
        raise errors.InvalidArgument(
            f"rendezvous_wait must be seconds > 0, got {rendezvous_wait!r}"
        )
    transport, host = _transport_and_host(
        transport, host, DEFAULT_TRANSPORT if colocated else LAUNCH_TRANSPORT
    )
    if colocated and num_servers != 1:
        raise errors.InvalidArgument(
            "colocated: the workers are the servers (one shard each); give no server count"
        )
    if colocated and restart_servers:
        raise errors.InvalidArgument(
            "colocated: there are no server processes to restart (restart_servers); "
            "restart_workers restarts a worker with its shard"
        )
    if restart_workers and not colocated:
        raise errors.InvalidArgument(
            "restart_workers goes with colocated: a restarted worker restores its own shard; "
            "with separate servers, use restart_servers"
        )
    memory_budget, spill_dir = config.memory_tier({}, memory_budget, spill_dir)
    if isinstance(command, str):
        command = shlex.split(command)
    command = [os.fspath(part) for part in command] if command is not None else []
    if not command:
        raise errors.InvalidArgument("launch needs a worker command, e.g. ['python', 'train.py']")
    extra = check_worker_variables(env)
    for name, value in (("startup_timeout", startup_timeout), ("grace_period", grace_period)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise errors.InvalidArgument(f"{name} must be a number of seconds >= 0, got {value!r}")
    # Checked now, with a placeholder address, so a bad value fails before anything starts.
    config.ClusterConfig(["tcp://127.0.0.1:1"], 0, num_workers, timeout, staleness)
    cluster = _Cluster(
        process.LineWriter(stdout or sys.stdout),
        process.LineWriter(stderr or sys.stderr),
        grace_period,
    )
    if keys is not None:
        from kvsparse.wire import security

        keys = os.path.abspath(os.fspath(keys))
        # Fails now, before anything starts, if the directory has no usable keys.
        security.check_keys(keys)
        cluster.keys = keys
        extra.setdefault(config.KEYS, keys)
    _check_periodic_save(save_every, keep, checkpoint_dir, extra)
    if checkpoint_dir is not None:
        checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
        # It may be a server's checkpoint root, which must exist (and saves go there anyway).
        os.makedirs(checkpoint_dir, exist_ok=True)
        cluster.checkpoint_dir = checkpoint_dir
        extra.setdefault(config.CHECKPOINT_DIR, checkpoint_dir)
    cluster.memory_budget, cluster.spill_dir = memory_budget, spill_dir
    cluster.colocated = bool(colocated)
    if restart_servers or restart_workers:
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise errors.InvalidArgument(
                f"max_restarts must be an integer >= 0, got {max_restarts!r}"
            )
        cluster.restart_servers = bool(restart_servers)
        cluster.restart_workers = bool(restart_workers)
        cluster.max_restarts = int(max_restarts)
        window = repr(float(DEFAULT_RETRY_WINDOW if retry_window is None else retry_window))
        extra.setdefault(config.RETRY_WINDOW, window)
        if restart_workers:
            extra.setdefault(config.REJOIN_WINDOW, extra[config.RETRY_WINDOW])
    elif retry_window is not None:
        extra.setdefault(config.RETRY_WINDOW, repr(float(retry_window)))
    if placement is not None:
        return _launch_on_hosts(
            cluster,
            placement,
            rendezvous_wait,
            command,
            num_servers,
            num_workers,
            host,
            colocated,
            {"timeout": timeout, "staleness": staleness},
            extra,
            cwd,
            startup_timeout,
        )
    with _signals_stop(cluster):
        try:
            if colocated:
                addresses = cluster.colocated_addresses(num_workers, transport, host)
                extra[config.PEERS] = ",".join(addresses)
                cluster.log("colocated: worker r hosts shard r at " + ", ".join(addresses))
            else:
                addresses = cluster.start_servers(num_servers, host, startup_timeout, transport)
            cluster.start_workers(
                command,
                num_workers,
                {"servers": addresses, "timeout": timeout, "staleness": staleness},
                extra,
                cwd,
            )
            return cluster.wait_workers()
        except _Stopped as stopped:
            name = signal.Signals(stopped.signum).name
            cluster.log(f"got {name}; stopping the job")
            return 128 + stopped.signum
        finally:
            cluster.stop()


def _launch_on_hosts(
    cluster: _Cluster,
    placement: config.NodePlacement,
    wait: float,
    command: list,
    num_servers: int,
    num_workers: int,
    host: str,
    colocated: bool,
    settings: dict,
    extra: dict,
    cwd: Optional[str],
    startup_timeout: float,
) -> int:
    """This host's part of a job over several: `launch` with nnodes (see its docstring).

    Node 0 serves the rendezvous before starting anything, so that the
    others can join as soon as their servers listen. The servers (or the
    colocated shard listeners) are up before this node offers their
    addresses; the workers start once the plan is known.
    """
    rank, nnodes = placement.node_rank, placement.nnodes
    server = None
    membership = None
    code = 1
    with _signals_stop(cluster):
        try:
            if rank == 0:
                server = rendezvous_module.RendezvousServer(
                    placement.rendezvous,
                    nnodes,
                    wait,
                    cluster.log,
                    expect={
                        "colocated": colocated,
                        "keys": rendezvous_module.keys_fingerprint(cluster.keys),
                    },
                )
                cluster.log(
                    f"node 0 of {nnodes}: serving the rendezvous on {placement.rendezvous} "
                    f"(waiting up to {wait:g} s for every node)"
                )
            if colocated:
                local = cluster.colocated_addresses(num_workers, "tcp", host)
                offer = rendezvous_module.NodeOffer(
                    rank,
                    nnodes,
                    host,
                    peers=local,
                    num_workers=num_workers,
                    colocated=True,
                    keys=rendezvous_module.keys_fingerprint(cluster.keys),
                )
            else:
                local = cluster.start_servers(num_servers, host, startup_timeout, "tcp")
                offer = rendezvous_module.NodeOffer(
                    rank,
                    nnodes,
                    host,
                    servers=local,
                    num_workers=num_workers,
                    keys=rendezvous_module.keys_fingerprint(cluster.keys),
                )
            cluster.log(
                f"node {rank} of {nnodes}: joining the rendezvous at {placement.rendezvous}"
            )
            membership = rendezvous_module.join(
                placement.rendezvous, offer, wait, cluster.check_signal
            )
            plan = membership.plan
            membership.watch(cluster.on_rendezvous)
            servers = plan.peers if colocated else plan.servers
            if not colocated:
                cluster.shard_offset = plan.servers.index(local[0])
                cluster.num_shards = len(plan.servers)
            if colocated:
                extra[config.PEERS] = ",".join(plan.peers)
            last = plan.first_rank + num_workers - 1
            cluster.log(
                f"node {rank}: workers {plan.first_rank}..{last} of {plan.num_workers}; "
                f"{len(servers)} shards: " + ", ".join(servers)
            )
            cluster.start_workers(
                command,
                num_workers,
                dict(settings, servers=servers),
                extra,
                cwd,
                first_rank=plan.first_rank,
                num_workers=plan.num_workers,
            )
            code = cluster.wait_workers()
            if code == 0:
                membership.finished(0)
                cluster.log(f"node {rank}: its workers finished; serving until every node's have")
                code = cluster.wait_job()
            return code
        except _Stopped as stopped:
            name = signal.Signals(stopped.signum).name
            cluster.log(f"got {name}; stopping the job")
            cluster.failure = f"its launcher got {name}"
            code = 128 + stopped.signum
            return code
        except errors.KVSparseError as exc:
            cluster.failure = str(exc)
            raise
        finally:
            if membership is not None:
                if code != 0:
                    membership.finished(code, cluster.failure or f"code {code}")
            try:
                cluster.stop()
            finally:
                if membership is not None:
                    membership.close()
                if server is not None:
                    server.close()


@contextlib.contextmanager
def local_cluster(
    num_servers: int = 1,
    *,
    host: Optional[str] = None,
    transport: Optional[str] = None,
    stderr: Optional[TextIO] = None,
    startup_timeout: float = 60.0,
    grace_period: float = 5.0,
) -> Iterator[list]:
    """Runs servers on this host for the duration of a ``with`` block.

    Args:
        num_servers: servers to start.
        host: interface tcp servers listen on (default 127.0.0.1).
        transport: 'tcp' (default) or 'ipc' (Unix sockets in a private
            temporary directory, removed at the end; not with host).
        stderr: where their prefixed output and the launcher's messages go
            (default: sys.stderr).
        startup_timeout: seconds to wait for them to answer.
        grace_period: seconds between SIGTERM and SIGKILL at the end.

    Yields:
        The servers' addresses (``tcp://host:port`` or ``ipc:///path``), in
        shard order. They are stopped when the block exits, whatever the reason.

    Raises:
        InvalidArgument: a bad count, transport, or host with 'ipc'.
        ServerUnavailable: a server did not start or answer in time.

    Thread-safe: each call starts its own servers. On Linux they get SIGTERM
    when the thread that called this ends (`process.die_with_parent`), so
    leave the block in that thread.

    Example:
        >>> import kvsparse
        >>> with local_cluster(2) as servers:  # doctest: +SKIP
        ...     kv = kvsparse.create('dist_sparse', servers=servers, rank=0, num_workers=1)
    """
    _check_counts(num_servers, 1)
    transport, host = _transport_and_host(transport, host)
    err = process.LineWriter(stderr or sys.stderr)
    cluster = _Cluster(err, err, grace_period)
    try:
        yield cluster.start_servers(num_servers, host, startup_timeout, transport)
    finally:
        cluster.stop()


__all__ = ["check_worker_variables", "free_port", "launch", "local_cluster"]
