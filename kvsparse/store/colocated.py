"""Colocated mode: a shard inside every worker, no separate server processes.

Worker ``r`` of ``N`` hosts shard ``r`` of every table and dense key in an
`kvsparse.server.embedded.EmbeddedServer` (the ``kvsparse server`` code, on a
thread of the worker, bound to ``peers[r]``) and is a client of all ``N``
shards through a `ColocatedBackend`: the `RemoteBackend` of ``dist_sparse``
with ``peers`` as its server list, whose link to shard ``r`` runs requests in
process (`kvsparse.client.local`) instead of over a socket. Placement is the
one of ``dist_sparse`` with ``N`` servers (key hash modulo N, dense arrays
in N contiguous ranges), and so are the consistency modes, checkpoints
(each shard writes its own file), export, admission and eviction, metrics
and ``kvsparse stats``: a colocated job's checkpoint loads into a
``dist_sparse`` job with ``N`` servers and back.

Lifetime: a worker's shard lives as long as its store. `ColocatedBackend.close`
(also run at exit) first waits at a barrier for every worker, so that no
worker stops serving while another still needs its shard, then stops
serving. A process that dies of an uncaught exception skips the barrier: its
shard goes with it, and the other workers' requests to it fail
(`kvsparse.errors.WorkerLeft` or ServerUnavailable) as with a dead server.

A restarted worker (``kvsparse launch --colocated --restart-workers
--checkpoint-dir D``; ``KVSPARSE_RESTARTED`` >= 1): the launcher starts a
worker that died again, with the same rank and shard address. Its store

1. binds the same address (retrying while the dead process's port is still
   held) and, when D holds a complete checkpoint, restores shard ``rank`` of
   it before serving (as ``kvsparse server --restore``), as a restarted
   shard (``--restarted``: a BSP push of a step the dead shard completed is
   applied alone);
2. greets every shard, then reads from each the highest clock (push count)
   of its rank there (STATS ``clocks``; the restored shard's comes from the
   checkpoint) and takes the highest, C, as how far this rank had come. Its
   clock resumes at C - 1 (`kvsparse.KVStore.clock`): the training code
   skips the steps already done and redoes the C-th push, which the dead
   process may not have delivered everywhere. That push goes only to the
   shards whose clock for this rank is below C, so no shard applies it
   twice;
3. sends its ``set_optimizer`` calls as replays: the optimizer slots of the
   running tables stay. ``kv.init`` of an existing table or dense key keeps
   its rows and values (as for any worker but the first), so the dense
   parameters a restarted worker pulls are the job's current ones.

The other workers' sessions retry the dead shard for their retry window
(``KVSPARSE_RETRY_WINDOW``) and bring it back as they do a restarted server
(`kvsparse.client.recovery`); their shards hold the requests that wait for
the dead rank for ``KVSPARSE_REJOIN_WINDOW`` seconds instead of failing them
(`kvsparse.server.liveness`). The guarantees are those of ``--restart-servers``:
the restarted shard holds its last checkpoint, so updates it acknowledged
after that checkpoint are lost, and every push acknowledged before it stays
applied exactly once.

Example (``kvsparse launch --colocated -n 2 -- python train.py`` sets the
peers; then ``kvsparse.create('dist_sparse')`` is colocated)::

    kv = kvsparse.create('colocated', peers=['tcp://127.0.0.1:7001',
                                             'tcp://127.0.0.1:7002'],
                         rank=0, num_workers=2)
"""

from __future__ import annotations

import atexit
import socket
import sys
import threading
import time
from typing import Optional

from kvsparse import config, errors
from kvsparse.client.remote import RemoteBackend, ping

DEFAULT_STARTUP_TIMEOUT = 60.0  # seconds to wait for every peer's shard to answer
_BIND_RETRY_PAUSE = 0.2


class ColocatedBackend(RemoteBackend):
    """The backend of a colocated worker: its own shard served here, the others over ZeroMQ.

    Args:
        shard: this worker's `kvsparse.server.embedded.EmbeddedServer`
            (owned: closed by `close`).
        peers: every worker's shard address, in rank order (peers[rank] is shard's).
        rank, num_workers, mode, staleness, timeout, retry_window, keys: as
            for `RemoteBackend` (num_workers == len(peers)).

    Attributes:
        rows_in_process: sparse rows this worker pulled or pushed from its own shard.
        rows_total: sparse rows it pulled or pushed from all shards.

    Thread safety: as `RemoteBackend` (the session serializes calls).
    """

    def __init__(self, shard, peers, rank, num_workers, *, restarted=False, **options):
        self.shard = shard
        self.rows_in_process = 0
        self.rows_total = 0
        self.restarted = bool(restarted)
        self._closed = False
        self._redo: Optional[tuple] = None  # (clock, shards that hold it): see _resume
        super().__init__(peers, rank, num_workers, local={int(rank): shard}, **options)
        if self.restarted:
            self._resume()

    def _resume(self) -> None:
        """Takes up this rank's clock where the shards say it was (module docstring, 2)."""
        seen = []
        for server_stats in self.stats():
            clocks = server_stats.get("clocks") or []
            seen.append(int(clocks[self.rank]) if self.rank < len(clocks) else 0)
        last = max(seen, default=0)
        if last > 0:
            self.session.resume(last - 1)
            self._redo = (last, {server for server, clock in enumerate(seen) if clock >= last})

    def _exchange(
        self, codec, requests: dict, *, push: bool = False, wait: bool = True, keep=None
    ) -> dict:
        if push and self._redo is not None:
            (clock, holding), self._redo = self._redo, None
            if self.session.clock + 1 == clock:  # the redone push: not where it arrived
                requests = {s: r for s, r in requests.items() if s not in holding}
        return super()._exchange(codec, requests, push=push, wait=wait, keep=keep)

    def set_optimizer(self, spec, table_ids=None):
        """As `RemoteBackend.set_optimizer`; a restarted worker's calls are replays.

        A replay of a call the shard knows keeps the slots it holds (the job's
        running optimizer state); another one is applied as a first call.
        """
        self._send_set_optimizer(spec, table_ids, replay=self.restarted)

    def set_learning_rate(self, learning_rate, table_ids=None):
        """As `RemoteBackend.set_learning_rate`; a restarted worker's calls are replays
        (a rate set again changes nothing)."""
        self._send_set_optimizer(
            None, table_ids, replay=self.restarted, learning_rate=learning_rate
        )

    def _count(self, items) -> None:
        for item in items:
            offsets = item[2]
            self.rows_total += int(offsets[-1])
            self.rows_in_process += int(offsets[self.rank + 1] - offsets[self.rank])

    def pull_sparse(self, items, wait=True):
        """As `RemoteBackend.pull_sparse`; the own shard's rows come without a socket."""
        self._count(items)
        return super().pull_sparse(items, wait)

    def push_sparse(self, items, wait=True):
        """As `RemoteBackend.push_sparse`; the own shard's rows go without a socket."""
        self._count(items)
        return super().push_sparse(items, wait)

    def close(self):
        """Waits for every worker (a barrier), then stops serving this worker's shard.

        Skips the barrier when the process is dying of an uncaught exception.
        Idempotent; a failed barrier (a worker that left) is reported on stderr.
        """
        self._close(barrier=not _crash.happened)

    def _close(self, barrier: bool) -> None:
        if self._closed:
            return
        self._closed = True
        with _open_lock:
            _open_backends.discard(self)
        atexit.unregister(self.close)
        try:
            if barrier:
                self.barrier()
        except errors.KVSparseError as exc:
            print(
                f"kvsparse: colocated worker {self.rank}: closing without the other workers: {exc}",
                file=sys.stderr,
                flush=True,
            )
        finally:
            self.session.close()
            # Requests of other workers that wait for this one fail now, not at their timeout.
            self.shard.leave(self.rank, "it closed its colocated store")
            self.shard.close()


class _CrashWatch:
    """Notes an uncaught exception in the main thread (the excepthook runs before atexit)."""

    def __init__(self):
        self.happened = False
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            self._installed = True
            previous = sys.excepthook

            def hook(kind, value, traceback):
                self.happened = True
                previous(kind, value, traceback)

            sys.excepthook = hook


_crash = _CrashWatch()
# The stores of this process not closed yet (what its exit would close): see close_open_stores.
_open_backends: set = set()
_open_lock = threading.Lock()


def close_open_stores(crashed: bool = False) -> int:
    """Closes this process's colocated stores that are still open, as its exit would.

    For a worker that runs the training code in a process that goes on
    living after it (a Ray actor, `kvsparse.ray.start_colocated`): when the
    code returns, each open store closes as at exit (a barrier with the other
    workers, then its shard stops serving); with crashed (the code raised),
    without the barrier, and the requests of other workers that wait for
    this rank fail at once, as when a worker process dies of an exception.

    Returns how many stores it closed. Thread-safe (each store closes once).

    Example:
        >>> close_open_stores()  # doctest: +SKIP
        1
    """
    with _open_lock:
        backends = list(_open_backends)
        _open_backends.clear()
    for backend in backends:
        backend._close(barrier=not crashed)
    return len(backends)


def _has_checkpoint(path: str) -> bool:
    from kvsparse.shard.checkpoint import latest_manifest

    try:
        return latest_manifest(path) is not None
    except (OSError, errors.KVSparseError):
        return False


def _wait_answering(address: str, deadline: float, keys: Optional[str]) -> bool:
    """Pings address until its shard answers (True) or time.monotonic() passes deadline."""
    while not ping(address, min(1.0, max(0.05, deadline - time.monotonic())), keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # a refused connection fails at once: do not spin
    return True


def _listener_for(bind: str, fd: Optional[int]) -> Optional[int]:
    """A duplicate of fd (for the shard to own) if fd is a tcp socket listening at bind."""
    if fd is None or not bind.startswith("tcp://"):
        return None
    try:
        family = socket.AF_INET6 if bind.startswith("tcp://[") else socket.AF_INET
        listener = socket.fromfd(fd, family, socket.SOCK_STREAM)  # a duplicate
    except OSError:
        return None
    with listener:
        try:
            listening = listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            host, port = listener.getsockname()[:2]
        except OSError:
            return None
        everywhere = host in ("0.0.0.0", "::") and bind == f"tcp://*:{port}"
        if not listening or not (everywhere or config.format_address(host, port) == bind):
            return None
        return listener.detach()


def create_colocated_backend(
    peers,
    rank: int,
    num_workers: int,
    *,
    mode: str = "bsp",
    staleness: Optional[int] = None,
    timeout: Optional[float] = None,
    retry_window: Optional[float] = None,
    keys: Optional[str] = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    restarted: bool = False,
    checkpoint_dir: Optional[str] = None,
    rejoin_window: float = 0.0,
    listener_fd: Optional[int] = None,
    server: Optional[config.ServerSettings] = None,
) -> ColocatedBackend:
    """Binds this worker's shard at peers[rank], waits for the other shards, greets all.

    restarted: this worker replaces one of this rank that died (module
    docstring): its shard restores the latest complete checkpoint in
    checkpoint_dir (if any) and it resumes this rank's clock. rejoin_window:
    seconds its shard holds the requests waiting for a worker that left,
    for it to come back restarted (`kvsparse.server.liveness`).
    listener_fd: an inherited tcp socket listening at peers[rank]
    (``KVSPARSE_SHARD_FD``, from ``kvsparse launch --colocated``): the shard
    serves a duplicate of it instead of binding, so the port the launcher
    reserved cannot have been taken meanwhile. One listening elsewhere (the
    caller named other peers) is not used. server: the settings of the shard
    this worker hosts (limits, heartbeats, fast path, memory budget and spill
    directory; default: the defaults);
    keys, when given, replace its keys.

    Raises:
        InvalidArgument: num_workers is not len(peers), a malformed address.
        ServerUnavailable: peers[rank] cannot be bound (a restarted worker:
            within startup_timeout seconds), or a peer's shard did not answer
            within startup_timeout seconds.
        CheckpointError: the checkpoint to restore is corrupt.
    """
    import zmq

    from kvsparse.server.embedded import EmbeddedServer

    cluster = config.ClusterConfig(list(peers), rank, num_workers, timeout, staleness)
    peers = cluster.servers
    if len(peers) != cluster.num_workers:
        raise errors.InvalidArgument(
            f"colocated mode has one shard per worker: {cluster.num_workers} workers but "
            f"{len(peers)} peer addresses {peers}"
        )
    server = server if server is not None else config.ServerSettings()
    keys = server.keys if keys is None else keys
    bind = config.peer_bind_address(peers[cluster.rank])
    restore = None
    if restarted and checkpoint_dir is not None and _has_checkpoint(checkpoint_dir):
        restore = (checkpoint_dir, cluster.rank, cluster.num_workers)
    deadline = time.monotonic() + startup_timeout
    while True:
        try:
            shard = EmbeddedServer(
                bind,
                use_fd=_listener_for(bind, listener_fd),
                keys=keys,
                limits=server.limits,
                heartbeat_timeout=server.heartbeat_timeout,
                fast_path=server.fast_path,
                memory_budget=server.memory_budget,
                spill_dir=server.spill_dir,
                restarted=restarted,
                rejoin_window=rejoin_window,
                restore=restore,
            )
            break
        except zmq.ZMQError as exc:
            # The port of the process this one replaces may stay taken for a moment.
            if restarted and exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                time.sleep(_BIND_RETRY_PAUSE)
                continue
            raise errors.ServerUnavailable(
                f"colocated worker {cluster.rank} cannot bind its shard at {bind}: {exc}",
                address=peers[cluster.rank],
            ) from None
    try:
        for index, address in enumerate(peers):
            if index != cluster.rank and not _wait_answering(address, deadline, keys):
                raise errors.ServerUnavailable(
                    f"colocated worker {index}'s shard at {address} did not answer within "
                    f"{startup_timeout:g} s",
                    address=address,
                )
        backend = ColocatedBackend(
            shard,
            peers,
            cluster.rank,
            cluster.num_workers,
            mode=mode,
            staleness=cluster.staleness,
            timeout=cluster.timeout,
            retry_window=retry_window,
            keys=keys,
            restarted=restarted,
        )
    except BaseException:
        shard.close(linger=0)
        raise
    _crash.install()
    # A strong reference: the shard must outlive this worker's use of it (others need it).
    atexit.register(backend.close)
    with _open_lock:
        _open_backends.add(backend)
    return backend


__all__ = [
    "DEFAULT_STARTUP_TIMEOUT",
    "ColocatedBackend",
    "close_open_stores",
    "create_colocated_backend",
]
