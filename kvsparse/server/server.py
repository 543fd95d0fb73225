"""kvsparse server: one process per shard, serving its slice of every table over ZeroMQ.

Start one per shard (`kvsparse.server.main`)::

    kvsparse server --bind tcp://127.0.0.1:5701
    python -m kvsparse.server --bind tcp://127.0.0.1:0   # port 0: a free port

The server holds a `kvsparse.shard.state.ShardState` (the same code the `local`
store runs) and applies optimizers there. It learns the number of workers and
the consistency mode from the first client's HELLO; a later HELLO that
disagrees gets an error reply. PULL_SPARSE and PUSH_SPARSE are answered by a
C++ thread without the GIL when they can be (`kvsparse.server.fastpath`); the
Python event loop serves the rest, one message at a time: table operations
release the GIL inside the C++ core, and waiting blocks in zmq_poll without it.

`Server` composes one object per concern, each in its own module:

- `kvsparse.server.loop.EventLoop`: the ROUTER socket, the poll loop, the wake-up socket.
- `kvsparse.server.dispatch.Dispatcher`: a request's way from parsing to its reply.
- `kvsparse.server.resend.ResendCache`: a resent request (same client id and
  request id) is not applied twice: the server keeps each client's last
  request id and, for requests that change state, the reply, which it sends again.
- `kvsparse.server.handlers.Handlers`: one handler per op.
- `kvsparse.server.coordination`: consistency between workers (see
  `kvsparse.client.remote` for the client side):

  - BSP: a push of table T is held until every worker pushed T in this round;
    the pushes are then summed (in rank order), applied once, and every pusher
    gets its reply. The client sends a push, empty if need be, to every server
    for every table it pushes.
  - ASP: applied on arrival.
  - SSP(k): applied on arrival; a pull from a worker whose clock (its number of
    pushes, carried in every header) is c waits until every worker's clock is
    at least c - k.
  - BARRIER (sent to server 0) is answered once all workers have sent one.
  - INIT_DENSE: rank 0 sends the values; the others send FLAG_DECLARE and get
    their reply once rank 0's values are in place.
  - SET_OPTIMIZER: rank 0's call sets it; the n-th call of another rank is
    answered once rank 0's n-th call arrived (and fails if the specs differ).

- `kvsparse.server.limits`: what one peer may make the server do (reply sizes, unread
  replies per connection, tables, dim, ids per request: `kvsparse.config.ServerLimits`),
  and `kvsparse.server.paths`: where CHECKPOINT requests may read and write.
- `kvsparse.server.liveness.Liveness`: which workers are still connected; a rank that
  left (connection closed, or silent past the heartbeats) fails what waits for it.
- `kvsparse.server.snapshots.ForkedWriter`: checkpoint saves and exports in a forked child.
- `kvsparse.server.restart`: what a save keeps besides the tables (resend records, rank 0's
  set_optimizer calls, the job's configuration), and `Server.restore` takes back.
- `kvsparse.server.metrics`: counters, and the Prometheus endpoint.
"""

from __future__ import annotations

import contextlib
import secrets

import zmq

from kvsparse import _core, config, errors
from kvsparse.config import ServerLimits
from kvsparse.server import restart
from kvsparse.server.coordination import Coordination
from kvsparse.server.dispatch import Dispatcher
from kvsparse.server.fastpath import FastPath
from kvsparse.server.handlers import Handlers
from kvsparse.server.limits import ReplyBudget, RequestLimits
from kvsparse.server.liveness import Liveness
from kvsparse.server.loop import DEFAULT_MAX_MESSAGE_SIZE, EventLoop
from kvsparse.server.metrics import ServerMetrics, SnapshotChannel, table_names
from kvsparse.server.paths import CheckpointPaths
from kvsparse.server.resend import DEFAULT_MAX_CLIENTS, ResendCache
from kvsparse.server.shared import SharedSegments
from kvsparse.server.snapshots import ForkedWriter
from kvsparse.shard.state import ShardState

__all__ = ["DEFAULT_MAX_CLIENTS", "DEFAULT_MAX_MESSAGE_SIZE", "Server"]


class Server:
    """One shard's server: a ROUTER socket in front of a ShardState.

    Args:
        bind: ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:0`` (port 0: any free port);
            ``host:port`` is taken as ``tcp://host:port``, as clients take it.
        context: a zmq.Context (default: a new one, terminated by close()).
        keys: a directory made by ``kvsparse keys`` (`kvsparse.wire.security`): the
            server then speaks CurveZMQ only (encrypted), with its secret key
            from there, and accepts only clients whose public key is there.
            None: no authentication (bind to 127.0.0.1 then).
        max_message_size: bytes; a bigger frame makes ZeroMQ drop the
            sender's connection (ZMQ_MAXMSGSIZE). -1: no limit.
        max_clients: resend records kept (see DEFAULT_MAX_CLIENTS).
        restarted: this server replaces one that died (``--restarted``): pushes
            of a BSP step the dead server completed are applied alone.
        limits: what one peer may make the server do, and the checkpoint root
            (`kvsparse.config.ServerLimits`; default: its defaults).
        heartbeat_timeout: seconds a peer may stay silent after a ZeroMQ
            heartbeat before its connection is closed (and, for a worker,
            before it counts as gone: `kvsparse.server.liveness`); None: 30 s
            (``kvsparse server`` passes ``KVSPARSE_HEARTBEAT_TIMEOUT``); 0: no
            heartbeats.
        guard: a lock serve() holds while it handles messages (not while it
            waits), so that other threads holding it may call handle() and
            `attach` too (`kvsparse.server.embedded`). None: none.
        fast_path: answer PULL_SPARSE and PUSH_SPARSE on a C++ thread without the
            GIL (`kvsparse.server.fastpath`); None: on (``kvsparse server``
            passes ``KVSPARSE_FAST_PATH``). Needs guard None or a
            `kvsparse._core.ShardLock`; another guard turns it off.
        rejoin_window: seconds the requests that wait for a worker that left
            are held for it to come back (a colocated worker restarted by
            ``launch --restart-workers``) before they fail with WorkerLeft;
            0: they fail as soon as it is found gone (`kvsparse.server.liveness`).
        use_fd: a listening tcp socket's file descriptor to serve instead of
            binding (`kvsparse.server.loop.EventLoop`); None: bind.
        memory_budget, spill_dir: the shard's memory budget in bytes (0: none)
            and its disk tier's directory (`kvsparse.shard.tier`); an insert
            past the budget without a spill directory gets LimitExceeded.

    Raises:
        zmq.ZMQError: the address cannot be bound.
        InvalidArgument: a malformed bind address, keys is not a usable key
            directory, the checkpoint root is not a directory, or a spill
            directory without a memory budget.
        StorageError: the spill directory cannot be made.

    Threads: serve(), handle(), metrics_snapshot() and close() on one thread
    (with a guard: handle(), attach() and detach() from any thread holding
    it); stop() from any thread or a signal handler; metrics_channel.request()
    from any thread.

    Example:
        >>> server = Server("tcp://127.0.0.1:0")  # doctest: +SKIP
        >>> server.address                         # doctest: +SKIP
        'tcp://127.0.0.1:40123'
        >>> server.serve()  # until server.stop() or a signal  # doctest: +SKIP
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        context: zmq.Context | None = None,
        *,
        keys: str | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        restarted: bool = False,
        limits: ServerLimits | None = None,
        heartbeat_timeout: float | None = None,
        guard=None,
        rejoin_window: float = 0.0,
        use_fd: int | None = None,
        fast_path: bool | None = None,
        memory_budget: int = 0,
        spill_dir: str | None = None,
    ):
        limits = limits if limits is not None else ServerLimits()
        # First: a spill directory that cannot be made fails before the socket is bound.
        state = ShardState(memory_budget, spill_dir)
        if fast_path is None:
            fast_path = True
        if fast_path and guard is None:
            guard = _core.ShardLock()
        self._guard = guard if guard is not None else contextlib.nullcontext()
        self._fast: FastPath | None = None
        if "://" not in bind:  # 'host:port', as clients accept it (inproc:// etc. pass as is)
            bind = config.parse_bind_address(bind, "bind")
        if heartbeat_timeout is None:
            heartbeat_timeout = config.DEFAULT_HEARTBEAT_TIMEOUT
        self._loop = EventLoop(
            bind,
            context,
            keys=keys,
            max_message_size=max_message_size,
            heartbeat_timeout=heartbeat_timeout,
            guard=guard,
            use_fd=use_fd,
        )
        self.address = self._loop.address
        try:
            paths = CheckpointPaths(
                limits.checkpoint_root, address=self.address, authenticated=keys is not None
            )
        except errors.KVSparseError:
            self._loop.close()
            raise
        self.limits = limits
        budget = ReplyBudget(
            self._loop.send, limits, on_held=self._budget_held, also_unread=self._fast_unread
        )
        # Random per start: a client that sees it change knows this shard restarted.
        self.incarnation = secrets.randbits(32) or 1
        self.state = state
        # Workers on this host read and write their rows here (the same-host path).
        self._segments = SharedSegments()
        # Counted on the serving thread; read by a metrics thread only through snapshots.
        self.metrics = ServerMetrics()
        self.metrics_channel = SnapshotChannel(self._loop.wake)
        resend = self._resend = ResendCache(max_clients)
        coordination = self._coordination = Coordination(self.state, restarted=restarted)
        self._liveness = Liveness(
            coordination,
            self._loop.routable,
            self._loop.call_later,
            self.incarnation,
            rejoin_window=rejoin_window,
            on_client=self._client_changed,
        )
        handlers = Handlers(
            self.state,
            coordination,
            ForkedWriter(self._loop.watch),
            resend,
            self.metrics,
            address=self.address,
            incarnation=self.incarnation,
            limits=RequestLimits(limits, budget),
            checkpoint_paths=paths,
            segments=self._segments,
            max_message_size=max_message_size,
        )
        self._dispatcher = Dispatcher(
            budget.send,
            handlers,
            resend,
            self.metrics,
            self.state.counters,
            self.incarnation,
            liveness=self._liveness,
        )
        if fast_path and isinstance(guard, _core.ShardLock):
            self._fast = FastPath.create(
                self._loop.socket,
                self._loop.context,
                guard,
                self.incarnation,
                self.state,
                resend,
                coordination,
                self.metrics,
                limits,
            )
        if self._fast is not None:
            self._loop.forward_from(self._fast.inbox, self._fast.wake)

    @property
    def fast_path(self) -> bool:
        """Whether a C++ thread answers pulls and pushes (`kvsparse.server.fastpath`)."""
        return self._fast is not None

    @property
    def fast_path_requests(self) -> int:
        """Requests the fast path's thread answered so far (0 without it; guard held)."""
        if self._fast is None:
            return 0
        self._fast.drain()
        return self._fast.answered

    def _budget_held(self, routing: bytes, held: bool) -> None:
        if self._fast is not None:
            self._fast.budget_held(routing, held)

    def _fast_unread(self, routing: bytes) -> int:
        return 0 if self._fast is None else self._fast.unread(routing)

    def _client_changed(self, client_id: int, routing) -> None:
        if self._fast is not None:
            self._fast.client_changed(client_id, routing, self._segments.address(client_id))
        if routing is None:  # gone: the C++ thread forgot its segment first
            self._segments.detach(client_id)

    def restore(self, path: str, shard_index: int, num_shards: int) -> None:
        """Loads shard shard_index of num_shards of the latest checkpoint in path, before serving.

        The tables, and what this server's save kept beside them
        (`kvsparse.server.restart`): resend records, rank 0's set_optimizer
        calls, the job's configuration. Serving thread only, before serve().

        Raises:
            CheckpointError: no complete checkpoint, or a corrupt file.
        """
        from kvsparse.shard import checkpoint

        section = checkpoint.restore_shard(self.state, path, shard_index, num_shards)
        restart.restore(section, self._resend, self._coordination)

    @property
    def socket(self) -> zmq.Socket:
        """The bound ROUTER socket."""
        return self._loop.socket

    @property
    def wakeup_fd(self) -> int:
        """A non-blocking fd whose writes wake serve() (for signal.set_wakeup_fd)."""
        return self._loop.wakeup_fd

    def serve(self) -> None:
        """Serves requests until stop() (or a signal handler calling it)."""
        fast = self._fast
        if fast is None:
            self._loop.serve(
                self._dispatcher.handle, self._answer_metrics, self._liveness.disconnected
            )
            return
        with self._guard:
            fast.sync()
        fast.start()
        try:
            self._loop.serve(self._forwarded, self._answer_metrics, self._liveness.disconnected)
        finally:
            fast.stop()

    def _forwarded(self, frames: list) -> None:
        """A message the fast path's thread left to Python (guard held)."""
        fast = self._fast
        fast.drain()
        self._dispatcher.handle(frames)
        fast.after_python(forwarded=True)

    def handle(self, frames: list) -> None:
        """Handles one received message (routing id frame first); never raises.

        With the fast path on, the caller holds the guard (`kvsparse.server.embedded`).
        """
        fast = self._fast
        if fast is None:
            self._dispatcher.handle(frames)
            return
        fast.drain()
        self._dispatcher.handle(frames)
        fast.after_python(forwarded=False)

    def sync_fast_path(self) -> None:
        """Brings the state up to date with what the fast path's thread did (guard held)."""
        if self._fast is not None:
            self._fast.drain()

    def attach(self, routing: bytes, deliver) -> None:
        """Replies for routing go to deliver(frames), not the socket (a client in this process)."""
        self._loop.attach(routing, deliver)

    def detach(self, routing: bytes) -> None:
        """Undoes `attach`."""
        self._loop.detach(routing)

    @property
    def coordination(self) -> Coordination:
        """The BSP rounds, SSP gate, barrier (`kvsparse.server.coordination`)."""
        return self._coordination

    def stop(self) -> None:
        """Makes serve() return after the message it is handling (safe in a signal handler)."""
        self._loop.stop()

    def metrics_snapshot(self) -> dict:
        """Counters and table sizes, copied (serving thread only; see server.metrics)."""
        if self._fast is not None:
            with self._guard:
                self._fast.drain()
        return self.metrics.snapshot(table_names(self.state), self.state.stats())

    def _answer_metrics(self) -> None:
        self.metrics_channel.answer(self.metrics_snapshot)

    def close(self, linger: float = 0.0) -> None:
        """Closes the socket; pending requests get no reply.

        linger: seconds to go on sending the replies already given to ZeroMQ.
        """
        if self._fast is not None:
            self._fast.stop()
            self._fast.close()
        self._loop.close(linger)
