"""A shard served from a thread of a worker process (colocated mode).

`EmbeddedServer` runs an ordinary `kvsparse.server.server.Server` (the same
dispatch, handlers, coordination, resend cache, checkpoints, metrics) on a
thread of its own, so that the other workers reach this process's shard over
ZeroMQ exactly as they reach a ``kvsparse server``. The process's own worker
reaches it without any socket: `EmbeddedServer.handle` runs its request
through the server's dispatcher on the caller's thread, and the reply (now,
or later from the serving thread when a BSP round completes) is handed to
the ``deliver`` callable the caller attached for its routing id
(`kvsparse.client.local`).

One lock, the shard mutex (`kvsparse._core.ShardLock`, a C++ mutex whose
acquire waits without the GIL), serializes everything that touches the
server's state: the fast path's C++ thread holds it while it serves a batch,
the Python serving thread while it handles what a poll returned (never while
it waits), and `handle` for the whole request. A reply that the caller's
thread produces for a remote peer (the last push of a BSP round) is queued for
the serving thread (`kvsparse.server.loop.EventLoop`).

GIL-free serving: the other workers' PULL_SPARSE and PUSH_SPARSE are read and
answered by the server's C++ thread without the GIL
(`kvsparse.server.fastpath`), so a worker busy in Python does not stall its
peers; only what the fast path leaves to Python (HELLO, errors, BSP and SSP
coordination, checkpoints, stats...) waits for this process's GIL. With the
fast path off (``KVSPARSE_FAST_PATH=0``, or no libzmq reachable) every request
is served by the Python serving thread, which needs the GIL.

Example:
    >>> shard = EmbeddedServer("tcp://127.0.0.1:0")  # doctest: +SKIP
    >>> shard.address                                # doctest: +SKIP
    'tcp://127.0.0.1:40123'
    >>> shard.close()                                # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Optional

import zmq

from kvsparse._core import ShardLock
from kvsparse.config import ServerLimits
from kvsparse.server.server import Server

# Seconds a closing shard keeps sending the replies it already gave ZeroMQ (the last
# barrier's, to peers that are about to close too).
CLOSE_LINGER_SECONDS = 2.0


class EmbeddedServer:
    """One shard's `Server`, served on a daemon thread of this process.

    Args:
        bind: the address to bind (``tcp://host:port``, port 0: a free one,
            or ``ipc:///path``).
        keys: a CurveZMQ key directory (see `Server`), or None.
        limits: the `kvsparse.config.ServerLimits` (default: the defaults).
        restarted: the shard replaces one that died (see `Server`).
        heartbeat_timeout: see `Server` (None: 30 s).
        rejoin_window: see `Server`.
        restore: (checkpoint path, shard index, number of shards): loaded
            (`Server.restore`) before the shard serves anything.
        use_fd: a listening tcp socket's file descriptor to serve instead of
            binding bind (see `Server`); the shard takes it over.
        fast_path: see `Server` (None: on).
        memory_budget, spill_dir: see `Server` (0, None: no budget).

    Raises:
        zmq.ZMQError: the address cannot be bound.
        InvalidArgument: see `Server`.
        CheckpointError: restore names no complete checkpoint, or a corrupt one.

    Thread safety: handle(), attach(), detach(), locked() and close() may be
    called from any thread; they serialize on `lock` with the serving thread.
    """

    def __init__(
        self,
        bind: str,
        *,
        keys: Optional[str] = None,
        limits: Optional[ServerLimits] = None,
        restarted: bool = False,
        heartbeat_timeout: Optional[float] = None,
        rejoin_window: float = 0.0,
        restore: Optional[tuple] = None,
        use_fd: Optional[int] = None,
        fast_path: Optional[bool] = None,
        memory_budget: int = 0,
        spill_dir: Optional[str] = None,
    ):
        self.lock = ShardLock()
        self.server = Server(
            bind,
            keys=keys,
            limits=limits,
            restarted=restarted,
            heartbeat_timeout=heartbeat_timeout,
            guard=self.lock,
            rejoin_window=rejoin_window,
            use_fd=use_fd,
            fast_path=fast_path,
            memory_budget=memory_budget,
            spill_dir=spill_dir,
        )
        if restore is not None:
            try:
                self.server.restore(*restore)
            except BaseException:
                self.server.close()
                raise
        self.address = self.server.address
        self._closed = False
        self._thread = threading.Thread(
            target=self._serve, name=f"kvsparse-shard {self.address}", daemon=True
        )
        self._thread.start()

    @property
    def state(self):
        """The shard's `kvsparse.shard.state.ShardState` (use it only inside `locked()`)."""
        return self.server.state

    @contextlib.contextmanager
    def locked(self):
        """Holds the lock (a context manager) to read or change `state` directly; what the
        fast path did is in `state` by then."""
        with self.lock:
            self.server.sync_fast_path()
            yield

    def _serve(self) -> None:
        try:
            self.server.serve()
        except Exception:  # noqa: BLE001 - a serving thread never throws; say why it stopped
            import traceback

            print("kvsparse: the colocated shard stopped serving:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)

    def handle(self, routing: bytes, frames: list) -> None:
        """Runs one request (header frame, payload frames) from the in-process client routing.

        Its reply goes to what `attach` gave for routing; never raises.
        """
        with self.lock:
            self.server.handle([zmq.Frame(routing), *frames])

    def attach(self, routing: bytes, deliver: Callable[[list], None]) -> None:
        """Replies for routing go to deliver(frames), called with the lock held."""
        with self.lock:
            self.server.attach(routing, deliver)

    def detach(self, routing: bytes) -> None:
        """Undoes `attach`: later replies for routing are dropped."""
        with self.lock:
            self.server.detach(routing)

    def leave(self, rank: int, why: str) -> int:
        """Fails the requests this shard holds that wait for rank (a worker that stopped).

        Returns how many failed (see `kvsparse.server.coordination`).
        """
        with self.lock:
            return self.server.coordination.rank_left(rank, why)

    def close(self, linger: float = CLOSE_LINGER_SECONDS) -> None:
        """Stops serving and closes the socket, sending what ZeroMQ holds for up to linger s.

        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self.server.stop()
        self._thread.join()
        self.server.close(linger)


__all__ = ["CLOSE_LINGER_SECONDS", "EmbeddedServer"]
