"""kvsparse server: one process per shard, serving its slice of every table over ZeroMQ.

Start one per shard::

    kvsparse server --bind tcp://127.0.0.1:5701
    python -m kvsparse.server --bind tcp://127.0.0.1:0   # port 0: a free port

It prints exactly one line, ``kvsparse server listening on tcp://HOST:PORT``,
once it is bound, then serves until SIGTERM or SIGINT. Without ``--bind`` it
binds what the environment says (`kvsparse.config.server_bind_address`), else
``tcp://127.0.0.1:0``.

The server holds a `kvsparse.shard.state.ShardState` (the same code the `local`
store runs) and applies optimizers there. It learns the number of workers and
the consistency mode from the first client's HELLO; a later HELLO that
disagrees gets an error reply. The event loop is single-threaded: table
operations release the GIL inside the C++ core, and waiting on the socket
blocks in zmq_poll without the GIL.

Consistency (see `kvsparse.client.remote` for the client side):

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

A resent request (same client id and request id) is not applied twice: the
server keeps each client's last request id and, for requests that change
state, the reply, which it sends again.
"""

from __future__ import annotations

import argparse
import collections
import secrets
import signal
import socket
import struct
import sys
import time
import traceback

import numpy as np
import zmq

from kvsparse import errors
from kvsparse.server.listening import LISTENING_PREFIX
from kvsparse.server.metrics import ServerMetrics, SnapshotChannel
from kvsparse.shard.state import ShardState
from kvsparse.wire import protocol
from kvsparse.wire.protocol import FLAG_DECLARE, FLAG_MONITOR, MUTATING_OPS, Op

MODES = ("bsp", "asp", "ssp")
_U64 = struct.Struct("<Q")
# The largest message frame a server accepts (ZMQ_MAXMSGSIZE): a bigger one
# makes ZeroMQ drop the connection before anything is allocated for it.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30
# How many clients' resend records a server keeps: a flood of headers with
# made-up client ids cannot grow the server past this (the least recently
# seen idle record goes first).
DEFAULT_MAX_CLIENTS = 4096
_DEFERRED = object()  # a handler's answer when the reply is sent later
_CONFIG_FIELDS = ("num_workers", "mode", "staleness", "num_servers", "server_index")
_OP_NAMES = {int(op): op.name.lower() for op in Op}  # metric labels, looked up per request


class _Pending:
    """A request whose reply is not sent yet."""

    __slots__ = ("routing", "header", "payload", "remaining", "error", "started")

    def __init__(self, routing: bytes, header: protocol.Header, payload):
        self.started = time.perf_counter()
        self.routing = routing
        self.header = header
        self.payload = payload
        self.remaining = 0
        self.error = None


class _ClientRecord:
    __slots__ = ("request_id", "pending", "reply", "last_push")

    def __init__(self):
        self.request_id = -1
        self.pending = None
        self.reply = None
        self.last_push = -1  # request id of the last push run: counts duplicates in stats


class _Round:
    """One contribution per rank; complete when every rank has contributed.

    A second contribution from a rank already in the round (a worker that
    retried after an error, or two clients with one rank) waits for the next
    round instead of completing this one early.
    """

    __slots__ = ("current", "backlog")

    def __init__(self):
        self.current: dict[int, object] = {}
        self.backlog: list[tuple[int, object]] = []

    def add(self, rank: int, value, num_workers: int) -> list[list]:
        """Adds value; returns the rounds it completed, each a list of values in rank order."""
        self.backlog.append((rank, value))
        completed = []
        while True:
            waiting, self.backlog = self.backlog, []
            for entry_rank, entry in waiting:
                if entry_rank in self.current:
                    self.backlog.append((entry_rank, entry))
                else:
                    self.current[entry_rank] = entry
            if len(self.current) < num_workers:
                return completed
            completed.append([self.current[r] for r in sorted(self.current)])
            self.current = {}

    def values(self) -> list:
        return list(self.current.values()) + [value for _, value in self.backlog]

    def __bool__(self) -> bool:
        return bool(self.current or self.backlog)


def _check_int(value, what, low, high=None):
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise errors.ProtocolError(f"{what} must be an integer {bound}, got {value!r}")
    return value


def _json_payload(payload, what, *, frames=1):
    if len(payload) != frames:
        raise errors.ProtocolError(f"{what} takes {frames} payload frame(s), got {len(payload)}")
    body = protocol.decode_json(payload[0], what=what)
    if not isinstance(body, dict):
        raise errors.ProtocolError(f"{what}: the JSON payload must be an object")
    return body


class Server:
    """One shard's server: a ROUTER socket in front of a ShardState.

    Args:
        bind: ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:0`` (port 0: any free port).
        context: a zmq.Context (default: a new one, terminated by close()).
        keys: a directory made by ``kvsparse keys`` (`kvsparse.wire.security`): the
            server then speaks CurveZMQ only (encrypted), with its secret key
            from there, and accepts only clients whose public key is there.
            None: no authentication (bind to 127.0.0.1 then).
        max_message_size: bytes; a bigger frame makes ZeroMQ drop the
            sender's connection (ZMQ_MAXMSGSIZE). -1: no limit.
        max_clients: resend records kept (see DEFAULT_MAX_CLIENTS).

    Raises:
        zmq.ZMQError: the address cannot be bound.
        InvalidArgument: keys is not a usable key directory.

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
    ):
        self._own_context = context is None
        self.context = context if context is not None else zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A dropped reply would leave a worker waiting: never drop at the high-water mark.
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_size))
        self.max_clients = int(max_clients)
        self._authenticator = None
        try:
            if keys is not None:
                from kvsparse.wire import security

                self._authenticator = security.secure_server_socket(self.socket, self.context, keys)
            self.socket.bind(bind)
        except (zmq.ZMQError, errors.KVSparseError):
            self.socket.close(0)
            if self._authenticator is not None:
                self._authenticator.stop()
            if self._own_context:
                self.context.term()
            raise
        # Random per start: a client that sees it change knows this shard restarted.
        self.incarnation = secrets.randbits(32) or 1
        # Started again after a crash (--restarted): see _orphaned.
        self.restarted = False
        self._settled: set = set()
        self.pushes = 0
        self.duplicate_pushes = 0
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.state = ShardState()
        self.config: dict | None = None
        self.clients: collections.OrderedDict[int, _ClientRecord] = collections.OrderedDict()
        self.clocks: list[int] = []
        self._clock_changed = False
        self.sync_rounds: dict[tuple, _Round] = {}
        self.ssp_waiting: list[_Pending] = []
        self.barrier = _Round()
        self.dense_waiting: dict[int, list] = {}
        self.optimizer_history: list = []  # rank 0's specs, one per SET_OPTIMIZER
        self.optimizer_waiting: list[tuple] = []
        self._stopping = False
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        # Counted on this thread; read by a metrics thread only through snapshots (metrics.py).
        self.metrics = ServerMetrics()
        self.metrics_channel = SnapshotChannel(self._wake_for_metrics)
        self._handlers = {
            Op.HELLO: self._hello,
            Op.INIT_SPARSE: self._init_sparse,
            Op.INIT_DENSE: self._init_dense,
            Op.SET_OPTIMIZER: self._set_optimizer,
            Op.PULL_SPARSE: self._pull_sparse,
            Op.PUSH_SPARSE: self._push_sparse,
            Op.PULL_DENSE: self._pull_dense,
            Op.PUSH_DENSE: self._push_dense,
            Op.BARRIER: self._barrier,
            Op.GET_OPTIMIZER_STATES: self._get_optimizer_states,
            Op.LOAD_OPTIMIZER_STATES: self._load_optimizer_states,
            Op.STATS: self._stats,
            Op.EVICT: self._evict,
            Op.CHECKPOINT: self._checkpoint,
        }
        # fd -> callback run by serve() when fd is readable (a forked checkpoint writer).
        self._fd_callbacks: dict = {}
        self._poller: zmq.Poller | None = None
        self._save_running = False

    # -- loop ---------------------------------------------------------------------------------

    def serve(self) -> None:
        """Serves requests until stop() (or a signal handler calling it)."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        # Registered by fd: zmq.Poller reports a non-zmq socket by its fd, not the object.
        wake_fd = self._wake_read.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        self._poller = poller
        for fd in self._fd_callbacks:
            poller.register(fd, zmq.POLLIN)
        while not self._stopping:
            events = dict(poller.poll())
            for fd in [fd for fd in self._fd_callbacks if fd in events]:
                poller.unregister(fd)
                self._fd_callbacks.pop(fd)()
            if self.socket in events:
                # Bounded so that a flood from one client cannot starve the stop check.
                for _ in range(1024):
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(frames)
            if wake_fd in events:
                try:
                    while self._wake_read.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                self.metrics_channel.answer(self.metrics_snapshot)

    def stop(self) -> None:
        """Makes serve() return after the message it is handling (safe in a signal handler)."""
        self._stopping = True
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass

    def _wake_for_metrics(self) -> None:
        try:
            self._wake_write.send(b"m")
        except OSError:  # full (the loop wakes anyway) or closed (the scrape times out)
            pass

    def metrics_snapshot(self) -> dict:
        """Counters and table sizes, copied (serving thread only; see server.metrics)."""
        return self.metrics.snapshot(self._table_names(), self.state.stats())

    def _table_names(self) -> dict:
        names = {table_id: entry.name for table_id, entry in self.state.sparse.items()}
        names.update((table_id, entry.name) for table_id, entry in self.state.dense.items())
        return names

    @property
    def wakeup_fd(self) -> int:
        """A non-blocking fd whose writes wake serve() (for signal.set_wakeup_fd)."""
        return self._wake_write.fileno()

    def close(self) -> None:
        """Closes the socket; pending requests get no reply."""
        self.socket.close(0)
        self._wake_read.close()
        self._wake_write.close()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._own_context:
            self.context.term()

    # -- dispatch ------------------------------------------------------------------------------

    def _send(self, routing: bytes, frames: list) -> None:
        head = protocol.stamp_incarnation(frames[0], self.incarnation)
        self.socket.send_multipart([routing, head, *frames[1:]], copy=False)

    def handle(self, frames: list) -> None:
        """Handles one received message (routing id frame first); never raises."""
        try:
            self._handle(frames)
        except Exception:  # noqa: BLE001 - the loop must survive anything a message causes
            traceback.print_exc(file=sys.stderr)

    def _handle(self, frames: list) -> None:
        routing = frames[0].bytes
        message = frames[1:]
        try:
            header, payload = protocol.parse_message(message)
        except errors.ProtocolError as exc:
            self.metrics.count_error(type(exc).__name__)
            peeked = protocol.peek_header(message[0]) if message else None
            self._send(routing, protocol.error_reply(peeked, exc))
            return
        self.metrics.count_request(_OP_NAMES[header.op])
        if header.op == Op.PING:
            # The reply says the last request id this client's record holds: a client
            # waiting for a later one learns that its request never arrived (dropped for
            # its size, or lost with a broken connection) instead of waiting forever.
            record = self.clients.get(header.client_id)
            seen = max(record.request_id, 0) if record is not None else 0
            self._send(routing, [header.reply(num_frames=1).pack(), _U64.pack(seen)])
            return
        if header.op == Op.STATS and header.flags & FLAG_MONITOR:
            # A monitor is no worker: no HELLO, no client record, not in the request count.
            frames = self._stats(header, [], None)
            self._send(routing, [header.reply(num_frames=len(frames)).pack(), *frames])
            return
        record = self.clients.get(header.client_id)
        if record is None:
            record = self._new_client(header.client_id)
        else:
            self.clients.move_to_end(header.client_id)
        if header.request_id == record.request_id:
            if record.pending is not None:  # still waiting: answer the resent copy when done
                record.pending.routing = routing
                return
            if record.reply is not None:
                self._send(routing, record.reply)
                return
            # A read-only request resent: running it again is harmless.
        elif header.request_id < record.request_id:
            self.metrics.count_error("ProtocolError")
            self._send(
                routing,
                protocol.error_reply(
                    header,
                    errors.ProtocolError(
                        f"stale request id {header.request_id}: this client already sent "
                        f"{record.request_id}"
                    ),
                ),
            )
            return
        record.request_id = header.request_id
        record.reply = None
        if header.op in (Op.PUSH_SPARSE, Op.PUSH_DENSE):
            self.pushes += 1
            if header.request_id <= record.last_push:
                self.duplicate_pushes += 1  # never expected: the resend check above stops it
            record.last_push = header.request_id
        pending = _Pending(routing, header, payload)
        record.pending = pending
        self.state.counters.requests += 1
        self._run(pending)
        if self._clock_changed:
            self._clock_changed = False
            self._release_ssp()

    def _new_client(self, client_id: int) -> _ClientRecord:
        if len(self.clients) >= self.max_clients:
            for old_id, old in self.clients.items():
                if old.pending is None:  # a request still waiting keeps its record
                    del self.clients[old_id]
                    break
        record = self.clients[client_id] = _ClientRecord()
        return record

    def _run(self, pending: _Pending) -> None:
        header = pending.header
        try:
            if header.op != Op.HELLO:
                self._check_configured(header)
            result = self._handlers[header.op](header, pending.payload, pending)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error reply
            self._fail(pending, exc)
            return
        if result is not _DEFERRED:
            self._finish(pending, result)

    def _finish(self, pending: _Pending, result) -> None:
        frames, num_items = result if isinstance(result, tuple) else (result, 0)
        header = pending.header.reply(num_frames=len(frames), num_items=num_items)
        self._complete(pending, [header.pack(), *frames])

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        self.metrics.count_error(type(exc).__name__)
        if not isinstance(exc, errors.KVSparseError):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        self._complete(pending, protocol.error_reply(pending.header, exc))

    def _complete(self, pending: _Pending, frames: list) -> None:
        self._send(pending.routing, frames)
        header = pending.header
        self.metrics.observe(_OP_NAMES[header.op], time.perf_counter() - pending.started)
        record = self.clients.get(header.client_id)
        if record is not None and record.request_id == header.request_id:
            record.pending = None
            if header.op in MUTATING_OPS:
                record.reply = frames
        pending.payload = None

    def _check_configured(self, header: protocol.Header) -> None:
        if self.config is None:
            raise errors.ProtocolError(f"op {Op(header.op).name} before HELLO: send HELLO first")
        if header.rank >= self.config["num_workers"]:
            raise errors.ProtocolError(
                f"rank {header.rank} out of range for {self.config['num_workers']} workers"
            )
        if header.clock > self.clocks[header.rank]:
            self.clocks[header.rank] = header.clock
            self._clock_changed = True

    # -- configuration ----------------------------------------------------------------------

    def _hello(self, header, payload, pending):
        hello = _json_payload(payload, "HELLO")
        num_workers = _check_int(hello.get("num_workers"), "num_workers", 1, 1 << 20)
        mode = hello.get("mode")
        if mode not in MODES:
            raise errors.ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
        staleness = hello.get("staleness")
        if mode == "ssp":
            _check_int(staleness, "staleness", 0)
        elif staleness is not None:
            raise errors.ProtocolError(f"staleness is only for mode 'ssp', got {staleness!r}")
        num_servers = _check_int(hello.get("num_servers"), "num_servers", 1, 1 << 16)
        _check_int(hello.get("server_index"), "server_index", 0, num_servers - 1)
        rank = _check_int(hello.get("rank"), "rank", 0, num_workers - 1)
        if rank != header.rank:
            raise errors.ProtocolError(f"HELLO says rank {rank}, its header {header.rank}")
        config = {name: hello.get(name) for name in _CONFIG_FIELDS}
        if self.config is None:
            self.config = config
            self.clocks = [0] * num_workers
        elif config != self.config:
            differences = ", ".join(
                f"{name}={config[name]!r} (server has {self.config[name]!r})"
                for name in _CONFIG_FIELDS
                if config[name] != self.config[name]
            )
            raise errors.InvalidArgument(
                f"this client's configuration differs from the one the server was started "
                f"with by the first client: {differences}"
            )
        self._check_configured(header)
        return [
            protocol.encode_json(
                {
                    "address": self.address,
                    "version": protocol.VERSION,
                    "incarnation": self.incarnation,
                }
            )
        ]

    def _init_sparse(self, header, payload, pending):
        from kvsparse.table import SparseTable

        body = _json_payload(payload, "INIT_SPARSE")
        table_id = _check_int(body.get("table_id"), "table_id", 0, (1 << 64) - 1)
        name, spec = body.get("name"), body.get("spec")
        if not isinstance(name, str) or not isinstance(spec, dict):
            raise errors.ProtocolError("INIT_SPARSE needs a str name and a dict spec")
        try:
            spec = SparseTable.from_dict(spec).to_dict()
        except errors.KVSparseError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"key {name!r}: bad table spec ({exc!r})") from None
        created = self.state.create_sparse(table_id, name, spec)
        return [protocol.encode_json({"created": created})]

    def _init_dense(self, header, payload, pending):
        declare = bool(header.flags & FLAG_DECLARE)
        if not payload:
            raise errors.ProtocolError("INIT_DENSE needs a JSON frame")
        body = _json_payload(payload[:1], "INIT_DENSE")
        if len(payload) != (1 if declare else 2):
            raise errors.ProtocolError(
                f"INIT_DENSE {'with FLAG_DECLARE ' if declare else ''}takes "
                f"{1 if declare else 2} payload frames, got {len(payload)}"
            )
        table_id = _check_int(body.get("table_id"), "table_id", 0, (1 << 64) - 1)
        size = _check_int(body.get("size"), "size", 0, 1 << 40)
        name = body.get("name")
        if not isinstance(name, str):
            raise errors.ProtocolError("INIT_DENSE needs a str name")
        if not declare:
            values = protocol.frame_array(payload[1], np.float32, size, what="INIT_DENSE values")
            self.state.create_dense(table_id, name, values)
            self._release_dense(table_id)
            return []
        entry = self.state.dense.get(table_id)
        if entry is not None:
            self._check_declared_size(name, entry.values.size, size)
            return []
        if table_id in self.state.sparse:
            raise errors.DuplicateKey(f"key {name!r} is already initialized as a sparse table")
        self.dense_waiting.setdefault(table_id, []).append((pending, name, size))
        return _DEFERRED

    @staticmethod
    def _check_declared_size(name, held, declared):
        if held != declared:
            raise errors.DuplicateKey(
                f"key {name!r}: rank 0 initialized {held} values on this shard, "
                f"this worker {declared}"
            )

    def _release_dense(self, table_id: int) -> None:
        held = self.state.dense[table_id].values.size
        for pending, name, size in self.dense_waiting.pop(table_id, []):
            try:
                self._check_declared_size(name, held, size)
            except errors.DuplicateKey as exc:
                self._fail(pending, exc)
            else:
                self._finish(pending, [])

    def _set_optimizer(self, header, payload, pending):
        body = _json_payload(payload, "SET_OPTIMIZER")
        spec = body.get("spec")
        epoch = _check_int(body.get("epoch"), "epoch", 1)
        if spec is not None and not isinstance(spec, dict):
            raise errors.ProtocolError("SET_OPTIMIZER spec must be an object or null")
        if header.rank == 0:
            try:
                self.state.set_optimizer(spec)
            except errors.KVSparseError:
                raise
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.InvalidArgument(f"bad optimizer spec ({exc!r})") from None
            self.optimizer_history.append(spec)
            waiting, self.optimizer_waiting = self.optimizer_waiting, []
            for item in waiting:
                self._answer_optimizer_follower(*item)
            return []
        if epoch <= len(self.optimizer_history):
            self._check_follower_spec(epoch, spec)
            return []
        self.optimizer_waiting.append((pending, epoch, spec))
        return _DEFERRED

    def _check_follower_spec(self, epoch, spec):
        leader = self.optimizer_history[epoch - 1]
        if leader != spec:
            raise errors.InvalidArgument(
                f"set_optimizer call {epoch}: rank 0 set {leader!r}, this worker {spec!r}; "
                "every worker must set the same optimizer"
            )

    def _answer_optimizer_follower(self, pending, epoch, spec):
        if epoch > len(self.optimizer_history):
            self.optimizer_waiting.append((pending, epoch, spec))
            return
        try:
            self._check_follower_spec(epoch, spec)
        except errors.InvalidArgument as exc:
            self._fail(pending, exc)
        else:
            self._finish(pending, [])

    # -- table operations ---------------------------------------------------------------------

    def _items(self, header, payload, frames_per_item, what):
        if not payload:
            raise errors.ProtocolError(f"{what} needs an items frame")
        items = protocol.parse_items(payload[0], header.num_items)
        expected = 1 + frames_per_item * header.num_items
        if len(payload) != expected:
            raise errors.ProtocolError(
                f"{what} with {header.num_items} items takes {expected} payload frames, "
                f"got {len(payload)}"
            )
        return items

    def _count_items(self, op: str, items, dense: bool = False) -> None:
        count_table = self.metrics.count_table
        for table_id, count, _, _ in items.tolist():
            count_table(op, table_id, 1 if dense else count)

    def _ssp_blocked(self, header) -> bool:
        config = self.config
        return config["mode"] == "ssp" and min(self.clocks) < header.clock - config["staleness"]

    def _pull_sparse(self, header, payload, pending):
        items = self._items(header, payload, 1, "PULL_SPARSE")
        if self._ssp_blocked(header):
            self.ssp_waiting.append(pending)
            return _DEFERRED
        keys = [
            protocol.frame_array(payload[1 + i], np.int64, count, what=f"PULL_SPARSE keys {i}")
            for i, (_, count, _, _) in enumerate(items.tolist())
        ]
        self._count_items("pull_sparse", items)
        for table_id, _, _, _ in items.tolist():
            self.state.sparse_entry(table_id)  # every table exists before any work
        reply_items = items.copy()
        rows_frames = []
        for i, (table_id, _, _, _) in enumerate(items.tolist()):
            rows = self.state.pull_sparse(table_id, keys[i])
            reply_items["dim"][i] = rows.shape[1]
            rows_frames.append(rows)  # a fresh array: safe to hand to ZeroMQ uncopied
        return [reply_items, *rows_frames], header.num_items

    def _push_sparse(self, header, payload, pending):
        items = self._items(header, payload, 2, "PUSH_SPARSE")
        parsed = []
        for i, (table_id, count, dim, item_flags) in enumerate(items.tolist()):
            if dim < 1:
                raise errors.ProtocolError(f"PUSH_SPARSE item {i}: dim must be >= 1")
            keys = protocol.frame_array(
                payload[1 + 2 * i], np.int64, count, what=f"PUSH_SPARSE keys {i}"
            )
            rows = protocol.frame_array(
                payload[2 + 2 * i], np.float32, count * dim, what=f"PUSH_SPARSE rows {i}"
            ).reshape(count, dim)
            self.state.check_sparse_push(table_id, keys, rows)
            parsed.append((table_id, keys, rows, bool(item_flags & protocol.ITEM_FLAG_STEP)))
        self._count_items("push_sparse", items)
        if self.config["mode"] == "bsp":
            return self._contribute(pending, "sparse", parsed)
        for table_id, keys, rows, step in parsed:
            self._apply_sparse(table_id, keys, rows, step)
        return []

    def _apply_sparse(self, table_id, keys, rows, step: bool) -> None:
        if keys.size:
            self.state.push_sparse(table_id, keys, rows)
        elif step:
            # The push had keys on other shards: count it here too (Adam's per-table step).
            self.state.advance_sparse_step(table_id)

    def _pull_dense(self, header, payload, pending):
        items = self._items(header, payload, 0, "PULL_DENSE")
        if self._ssp_blocked(header):
            self.ssp_waiting.append(pending)
            return _DEFERRED
        self._count_items("pull_dense", items, dense=True)
        frames = []
        for table_id, count, _, _ in items.tolist():
            entry = self.state.dense_entry(table_id)
            if entry.values.size != count:
                raise errors.ShapeError(
                    f"key {entry.name!r}: this shard holds {entry.values.size} values, "
                    f"the pull asks for {count}"
                )
        for table_id, _, _, _ in items.tolist():
            # Copied: ZeroMQ sends asynchronously and a later push changes the live slice.
            frames.append(self.state.pull_dense(table_id).copy())
        return [items.copy(), *frames], header.num_items

    def _push_dense(self, header, payload, pending):
        items = self._items(header, payload, 1, "PUSH_DENSE")
        parsed = []
        for i, (table_id, count, _, _) in enumerate(items.tolist()):
            grad = protocol.frame_array(payload[1 + i], np.float32, count, what=f"PUSH_DENSE {i}")
            self.state.check_dense_push(table_id, grad)
            parsed.append((table_id, grad))
        self._count_items("push_dense", items, dense=True)
        if self.config["mode"] == "bsp":
            return self._contribute(pending, "dense", parsed)
        for table_id, grad in parsed:
            self.state.push_dense(table_id, grad)
        return []

    # -- bulk synchronous rounds ----------------------------------------------------------------

    def _contribute(self, pending: _Pending, kind: str, parsed: list):
        """Adds a validated BSP push to each of its tables' rounds; replies when all are applied."""
        groups: dict[int, list] = {}
        for table_id, *data in parsed:
            groups.setdefault(table_id, []).append(data)
        if not groups:
            return []
        pending.remaining = len(groups)
        num_workers = self.config["num_workers"]
        for table_id, parts in groups.items():
            round_ = self.sync_rounds.setdefault((kind, table_id), _Round())
            recovering = self.restarted and (kind, table_id) not in self._settled
            if recovering and self._orphaned(kind, table_id, round_, pending, parts):
                completed = []
            else:
                completed = round_.add(pending.header.rank, (pending, parts), num_workers)
            if not round_:
                del self.sync_rounds[(kind, table_id)]
            for contributions in completed:
                if recovering:
                    self._settled.add((kind, table_id))
                self._apply_round(kind, table_id, contributions)
        return _DEFERRED

    def _orphaned(self, kind, table_id, round_: _Round, pending: _Pending, parts) -> bool:
        """After a restart: applies alone the pushes whose round the dead server completed.

        A crash can lose some replies of a round it had applied: the workers
        that got theirs move on, the others resend the same step (same clock)
        to the restarted server, where it would otherwise wait for, and then
        be summed with, the next step of the others. Until a table's first
        full round here, a push with a lower clock than another rank's is
        such an orphan: applied alone (on the restored state) and answered.
        Returns True if the new push was one.
        """
        clock = pending.header.clock
        late = sorted(r for r, (p, _) in round_.current.items() if p.header.clock < clock)
        for rank in late:
            self._apply_round(kind, table_id, [round_.current.pop(rank)])
        if any(p.header.clock > clock for p, _ in round_.current.values()):
            self._apply_round(kind, table_id, [(pending, parts)])
            return True
        return False

    def _apply_round(self, kind: str, table_id: int, contributions: list) -> None:
        # Contributions come in rank order: the same sum on every run.
        parts = [part for _, group in contributions for part in group]
        error = None
        try:
            if kind == "sparse":
                # The core sums duplicate keys before it applies the optimizer.
                keys = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
                rows = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
                self._apply_sparse(table_id, keys, rows, any(p[2] for p in parts))
            else:
                total = parts[0][0]
                if len(parts) > 1:
                    total = total.copy()
                    for part in parts[1:]:
                        total += part[0]
                self.state.push_dense(table_id, total)
        except Exception as exc:  # noqa: BLE001 - reported to every worker of the round
            error = exc
        for pending, _ in contributions:
            if error is not None and pending.error is None:
                pending.error = error
            pending.remaining -= 1
            if pending.remaining == 0:
                if pending.error is not None:
                    self._fail(pending, pending.error)
                else:
                    self._finish(pending, [])

    # -- coordination ----------------------------------------------------------------------------

    def _release_ssp(self) -> None:
        if not self.ssp_waiting:
            return
        waiting, self.ssp_waiting = self.ssp_waiting, []
        for pending in waiting:
            if self._ssp_blocked(pending.header):
                self.ssp_waiting.append(pending)
            else:
                self._run(pending)

    def _barrier(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("BARRIER takes no payload")
        for completed in self.barrier.add(header.rank, pending, self.config["num_workers"]):
            for other in completed:
                self._finish(other, [])
        return _DEFERRED

    # -- optimizer state and stats -------------------------------------------------------------

    def _get_optimizer_states(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("GET_OPTIMIZER_STATES takes no payload")
        tree = [[table_id, state] for table_id, state in self.state.optimizer_state().items()]
        meta, arrays = protocol.encode_tree(tree)
        return [meta, *arrays]

    def _load_optimizer_states(self, header, payload, pending):
        tree = protocol.decode_tree(payload, what="LOAD_OPTIMIZER_STATES")
        if not isinstance(tree, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[1], dict) for e in tree
        ):
            raise errors.ProtocolError("LOAD_OPTIMIZER_STATES: expected [[table_id, state], ...]")
        for table_id, state in tree:
            _check_int(table_id, "table_id", 0, (1 << 64) - 1)
            self._check_state(table_id, state)
        for table_id, state in tree:
            self.state.load_optimizer_state(table_id, state)
        return []

    def _check_state(self, table_id: int, state: dict) -> None:
        """Raises what load_optimizer_state would, before anything is loaded."""
        entry = self.state.sparse.get(table_id)
        if entry is not None:
            keys, slots, steps = state.get("keys"), state.get("slots"), state.get("steps")
            if not all(isinstance(a, np.ndarray) for a in (keys, slots, steps)):
                raise errors.ProtocolError("sparse optimizer state needs keys, slots and steps")
            n = keys.shape[0] if keys.ndim == 1 else -1
            table = entry.table
            if (
                keys.dtype != np.int64
                or steps.dtype != np.int64
                or n < 0
                or steps.shape != (n,)
                or slots.shape != (n, table.num_slots, table.dim)
            ):
                raise errors.ShapeError(
                    f"key {entry.name!r}: saved state shapes keys {keys.shape}, slots "
                    f"{slots.shape}, steps {steps.shape} do not fit {table.num_slots} slots "
                    f"of dim {table.dim}"
                )
            _check_int(state.get("table_step", 0), "table_step", 0)
            return
        dense = self.state.dense_entry(table_id)
        slots = state.get("slots")
        if not isinstance(slots, np.ndarray):
            raise errors.ProtocolError("dense optimizer state needs slots")
        if dense.slots is None or slots.shape != dense.slots.shape:
            raise errors.ShapeError(f"key {dense.name!r}: saved slots do not match the optimizer")
        _check_int(state.get("step"), "step", 0)

    def _evict(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("EVICT takes no payload")
        return [protocol.encode_json(self.state.evict())]

    # -- checkpoints (kvsparse.shard.checkpoint) -------------------------------------------

    def _checkpoint(self, header, payload, pending):
        from kvsparse.shard import checkpoint

        body = _json_payload(payload, "CHECKPOINT")
        shard_index, num_shards = self.config["server_index"], self.config["num_servers"]
        action = body.get("action")
        if action not in ("save", "export"):
            # prepare / commit / describe are small; a load replaces the tables, so it runs
            # inline: no request can see a half-loaded shard.
            reply = checkpoint.handle(self.state, body, shard_index, num_shards)
            return [protocol.encode_json(reply)]
        if self._save_running:
            raise errors.InvalidArgument("a checkpoint save or export is already running")
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise errors.InvalidArgument("checkpoint path must be a non-empty str")
        if action == "export":
            done = None
            job = lambda: checkpoint.export_shard(  # noqa: E731
                self.state, path, shard_index, num_shards, body["table_ids"], body["export_id"]
            )
        else:
            seq, parent = int(body["seq"]), body.get("parent")
            since, epoch = checkpoint.begin_save(
                self.state, bool(body.get("incremental")), path, parent
            )
            job = lambda: checkpoint.save_shard(  # noqa: E731
                self.state, path, seq, shard_index, num_shards, since, parent
            )
            done = lambda: checkpoint.end_save(self.state, path, seq, epoch)  # noqa: E731
        # A writer that died leaves its temporary file: removed (it never got a manifest).
        cleanup = lambda pid: checkpoint.remove_temporary_files(path, pid)  # noqa: E731
        self._fork_job(pending, job, done, cleanup)
        return _DEFERRED

    def _fork_job(self, pending, job, done, cleanup=None) -> None:
        """Runs job() in a forked child (a copy-on-write snapshot of this moment).

        Redis BGSAVE style: the child writes and leaves with os._exit, never
        touching ZeroMQ; it sends its JSON result through a pipe, which serve()
        polls with the sockets, so the loop goes on serving meanwhile.
        """
        import json
        import os

        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no zmq, no return into the event loop
            status = 1
            try:
                os.close(read_fd)
                # Let go of stdout: whoever reads the server's stdout sees its end when the
                # server exits, not when a writer it left behind does.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                try:
                    result = {"ok": True, "reply": job()}
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    result = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
                data = json.dumps(result).encode()
                while data:
                    data = data[os.write(write_fd, data) :]
                status = 0
            finally:
                os._exit(status)
        os.close(write_fd)
        self._save_running = True
        chunks = []

        def finished():
            while True:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(read_fd)
            os.waitpid(pid, 0)
            self._save_running = False
            if cleanup is not None:
                cleanup(pid)
            try:
                result = json.loads(b"".join(chunks)) if chunks else None
            except ValueError:
                result = None
            if result is None:
                self._fail(pending, errors.ServerError("the checkpoint writer died"))
            elif not result["ok"]:
                cls = getattr(errors, result["error"], None)
                if not (isinstance(cls, type) and issubclass(cls, errors.KVSparseError)):
                    cls = errors.ServerError
                self._fail(pending, cls(f"checkpoint writer: {result['message']}"))
            else:
                if done is not None:
                    done()
                self._finish(pending, [protocol.encode_json(result["reply"])])

        if self._poller is None:  # not serving (a direct handle() call): wait here
            finished()
            return
        self._fd_callbacks[read_fd] = finished
        self._poller.register(read_fd, zmq.POLLIN)

    def _stats(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("STATS takes no payload")
        waiting = {
            "bsp_pushes": len({id(v[0]) for r in self.sync_rounds.values() for v in r.values()}),
            "ssp_pulls": len(self.ssp_waiting),
            "barrier": len(self.barrier.values()),
            "dense_inits": sum(len(w) for w in self.dense_waiting.values()),
            "set_optimizer": len(self.optimizer_waiting),
        }
        stats = {
            **self.state.stats(),
            "address": self.address,
            "waiting": waiting,
            "incarnation": self.incarnation,
            "pushes": self.pushes,
            "duplicate_pushes": self.duplicate_pushes,
            "clients": len(self.clients),
        }
        stats["table_ops"] = self.metrics.per_table(self._table_names())
        return [protocol.encode_json(stats)]


def main(argv=None) -> int:
    """``kvsparse server``: serve one shard until SIGTERM/SIGINT.

    Args:
        argv: command-line arguments (default: sys.argv[1:]); ``--bind ADDRESS``.

    Returns:
        The exit status (0 after a clean stop, 1 if the address cannot be bound).

    Example:
        $ kvsparse server --bind tcp://127.0.0.1:0
        kvsparse server listening on tcp://127.0.0.1:40123
    """
    parser = argparse.ArgumentParser(
        prog="kvsparse server",
        description="Serve one shard of kvsparse tables over ZeroMQ.",
    )
    parser.add_argument(
        "--bind",
        default=None,
        help="ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5701 (port 0: a free port). "
        "Default: KVSPARSE_BIND or this process's entry of the cluster configuration, "
        "else tcp://127.0.0.1:0.",
    )
    parser.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CurveZMQ key directory made by `kvsparse keys DIR`: encrypt all traffic and "
        "accept only clients whose public key is in DIR (default: KVSPARSE_KEYS, else none)",
    )
    parser.add_argument(
        "--restarted",
        action="store_true",
        help="this server replaces one that died (kvsparse launch --restart-servers sets it): "
        "pushes of a BSP step the dead server completed are applied alone",
    )
    parser.add_argument(
        "--max-message-size",
        type=int,
        default=DEFAULT_MAX_MESSAGE_SIZE,
        metavar="BYTES",
        help="largest message frame accepted; a bigger one drops the sender's connection "
        f"(default: {DEFAULT_MAX_MESSAGE_SIZE}; -1: no limit)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port, printed; "
        "default: no metrics endpoint; needs prometheus-client)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="interface of the metrics endpoint (default: 127.0.0.1; 0.0.0.0 in a container)",
    )
    parser.add_argument(
        "--restore",
        default=None,
        metavar="PATH",
        help="before serving, load the latest complete checkpoint in PATH (base + deltas) "
        "for this shard (needs --shard-index and --num-shards)",
    )
    parser.add_argument("--shard-index", type=int, default=None, metavar="I")
    parser.add_argument("--num-shards", type=int, default=None, metavar="N")
    args = parser.parse_args(argv)
    if args.restore is not None and (
        args.shard_index is None
        or args.num_shards is None
        or not 0 <= args.shard_index < args.num_shards
    ):
        print("kvsparse server: --restore needs --shard-index I --num-shards N", file=sys.stderr)
        return 2
    bind = args.bind
    keys = args.keys
    if keys is None:
        import os

        keys = os.environ.get("KVSPARSE_KEYS") or None
    if bind is None:
        from kvsparse import config

        try:
            bind = config.server_bind_address() or "tcp://127.0.0.1:0"
        except errors.InvalidArgument as exc:
            print(f"kvsparse server: {exc}", file=sys.stderr)
            return 2
    try:
        server = Server(bind, keys=keys, max_message_size=args.max_message_size)
        server.restarted = args.restarted
    except zmq.ZMQError as exc:
        print(f"kvsparse server: cannot bind {bind}: {exc}", file=sys.stderr)
        return 1
    except errors.KVSparseError as exc:
        print(f"kvsparse server: {exc}", file=sys.stderr)
        return 2
    if args.restore is not None:
        from kvsparse.shard import checkpoint

        try:
            checkpoint.restore_shard(server.state, args.restore, args.shard_index, args.num_shards)
        except errors.KVSparseError as exc:
            server.close()
            print(f"kvsparse server: cannot restore: {exc}", file=sys.stderr)
            return 2

    httpd = None
    if args.metrics_port is not None:
        from kvsparse.server.server import metrics

        try:
            httpd, _, metrics_port = metrics.start_http_server(
                server.metrics_channel, args.metrics_port, args.metrics_host
            )
        except (ImportError, OSError) as exc:
            server.close()
            print(f"kvsparse server: cannot serve metrics: {exc}", file=sys.stderr)
            return 1

    def stop(signum, frame):
        server.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    # The C-level handler may run on a thread other than the one blocked in zmq_poll
    # (OpenBLAS, ZeroMQ's own); the wakeup fd wakes the poll wherever it lands.
    previous_wakeup = signal.set_wakeup_fd(server.wakeup_fd)
    try:
        print(f"{LISTENING_PREFIX}{server.address}", flush=True)
        if httpd is not None:
            host = args.metrics_host if ":" not in args.metrics_host else f"[{args.metrics_host}]"
            print(f"kvsparse metrics on http://{host}:{metrics_port}/metrics", flush=True)
        server.serve()
    finally:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        signal.set_wakeup_fd(previous_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
