"""The distributed store's client: `RemoteBackend` speaks the wire protocol to the servers.

``kvsparse.create('dist_sparse', ...)`` (and the other dist kinds) end up in
`kvsparse.store.factory.create_remote_store`, which returns a KVStore over a
`RemoteBackend`. The backend has one ZeroMQ DEALER socket per server. A call
sends its requests to every server involved first and then collects the
replies, so servers work in parallel; all tables touched by one call go to a
server in one request. Pulls go to the servers that hold some of the keys;
pushes go to every server (with no keys where a server holds none), so that
BSP rounds, SSP clocks and per-table step counts agree on all shards. Keys
and rows are sent and received without copies (see `kvsparse.wire.protocol`).

A store may be used from several threads (calls are serialized); a forked
child must create its own store.

Consistency modes (chosen by the store kind, or ``staleness=``):

- ``'dist_sync'``, ``'dist_sparse'``, ``'dist'``: BSP. A push returns once every
  worker pushed that table in this step and the summed gradient was applied;
  every worker must push the same keys in each step (as with MXNet's
  dist_sync).
- ``'dist_async'``, ``'dist_sparse_async'``: ASP, applied on arrival.
- ``staleness=k`` with any kind: SSP, applied on arrival; a pull blocks while
  this worker is more than k pushes ahead of the slowest worker.

Timeouts: a server that answers nothing, not even a liveness ping, for
``timeout`` seconds raises `kvsparse.errors.ServerUnavailable` naming it.
Waiting for other workers (a BSP push, an SSP pull, a barrier) is not a
timeout: the server keeps answering pings meanwhile.

Server restarts (``retry_window=``, ``KVSPARSE_RETRY_WINDOW``; ``kvsparse
launch --restart-servers`` sets it): every reply carries the server's
random incarnation. When it changes (the server was restarted, e.g. from a
checkpoint by the launcher), or when a server stops answering, the client
says HELLO again (retrying until ``retry_window`` seconds have passed,
then ServerUnavailable), declares again the sparse tables it created, and
resends the request in flight with the same request id; a server applies a
request id at most once. What a restarted server holds is what it restored
(its last checkpoint): pushes acknowledged after that checkpoint are not
replayed.

Security: with ``keys=`` or ``KVSPARSE_KEYS`` (a ``kvsparse keys``
directory) the sockets use CurveZMQ (`kvsparse.wire.security`). A server that
refuses the handshake (no keys, or keys it does not know) raises
ServerUnavailable at once, naming the server.

Example:
    >>> import kvsparse                                        # doctest: +SKIP
    >>> kv = kvsparse.create('dist_sparse', servers=['tcp://127.0.0.1:5701'],
    ...                      rank=0, num_workers=1)             # doctest: +SKIP
    >>> kv.init('user', kvsparse.SparseTable(dim=8))           # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time

import numpy as np
import zmq

from kvsparse import errors
from kvsparse.placement import dense_ranges
from kvsparse.wire import protocol
from kvsparse.wire.protocol import Op

DEFAULT_TIMEOUT = 60.0


def _context() -> zmq.Context:
    return zmq.Context.instance()


RETRY_WINDOW = "KVSPARSE_RETRY_WINDOW"
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def _new_socket(address: str, keys: str | None = None, connect: bool = True) -> zmq.Socket:
    sock = _context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if keys is not None:
        from kvsparse.wire import security

        try:
            security.secure_client_socket(sock, keys)
        except BaseException:
            sock.close(0)
            raise
    if connect:
        sock.connect(address)
    return sock


def _handshake_error(monitor: zmq.Socket, address: str, keys) -> errors.ServerUnavailable | None:
    """The error for a refused security handshake reported on monitor, or None."""
    from zmq.utils.monitor import recv_monitor_message

    while monitor.poll(0):
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return None
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return errors.ServerUnavailable(
                f"server {address} refused this client's CurveZMQ key (authentication failed, "
                f"ZAP status {event['value']}): use a key the server accepts "
                f"(KVSPARSE_KEYS={keys})",
                address=address,
            )
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            need = (
                "the server requires CurveZMQ keys: set KVSPARSE_KEYS (kvsparse launch --keys)"
                if keys is None
                else f"the server does not use these CurveZMQ keys ({keys})"
            )
            return errors.ServerUnavailable(
                f"server {address} refused the connection: security handshake failed; {need}",
                address=address,
            )
    return None


def _retry_window_from_environment() -> float:
    import os

    text = os.environ.get(RETRY_WINDOW)
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise errors.InvalidArgument(
            f"{RETRY_WINDOW} must be a number of seconds, got {text!r}"
        ) from None
    if not value >= 0:
        raise errors.InvalidArgument(f"{RETRY_WINDOW} must be >= 0, got {text!r}")
    return value


class RemoteBackend:
    """The KVStore backend of the dist kinds: the LocalBackend interface over ZeroMQ.

    Args:
        servers: server addresses ``tcp://host:port``, in shard order.
        rank: this worker's rank.
        num_workers: how many workers share the servers.
        mode: 'bsp', 'asp' or 'ssp'.
        staleness: k of SSP (mode 'ssp' only).
        timeout: seconds without any answer from a server before
            ServerUnavailable (default 60).
        retry_window: seconds to keep trying to reach a restarted or silent
            server (HELLO again, then resend the request in flight) before
            ServerUnavailable; 0: no retry. None: ``KVSPARSE_RETRY_WINDOW``
            or 0.
        keys: a ``kvsparse keys`` directory for CurveZMQ; None:
            ``KVSPARSE_KEYS`` or no encryption.

    Raises:
        ServerUnavailable: a server did not answer the HELLO in time, or
            refused the security handshake.
        InvalidArgument: a server was started by clients with another
            configuration (number of workers, mode, server list).
    """

    def __init__(
        self,
        servers,
        rank,
        num_workers,
        mode="bsp",
        staleness=None,
        timeout=None,
        retry_window=None,
        keys=None,
    ):
        if mode not in ("bsp", "asp", "ssp"):
            raise errors.InvalidArgument(f"mode must be 'bsp', 'asp' or 'ssp', got {mode!r}")
        if (mode == "ssp") != (staleness is not None):
            raise errors.InvalidArgument("staleness goes with mode 'ssp' (and only with it)")
        self.servers = list(servers)
        self.num_shards = len(self.servers)
        self.rank = int(rank)
        self.num_workers = int(num_workers)
        self.mode = mode
        self.staleness = staleness
        self.timeout = float(timeout) if timeout is not None else DEFAULT_TIMEOUT
        if retry_window is None:
            retry_window = _retry_window_from_environment()
        self.retry_window = float(retry_window)
        if keys is None:
            from kvsparse.wire import security

            keys = security.keys_from_environment()
        self.keys = keys
        self.restarts = 0  # server restarts this client recovered from
        self._incarnations = [0] * len(self.servers)
        self._hellos: list = []
        self._declared_tables: dict = {}  # table_id -> INIT_SPARSE body, declared again on restart
        self._monitors: list = []
        self._client_id = secrets.randbits(64)
        self._request_ids = itertools.count(1)
        self._clock = 0
        self._optimizer_calls = 0
        self._lock = threading.RLock()  # ZeroMQ sockets are not thread-safe
        self._sockets = []
        self._closed = False
        try:
            for server in range(self.num_shards):
                self._sockets.append(None)
                self._monitors.append(None)
                self._open_socket(server)
            hello = {
                "num_workers": self.num_workers,
                "mode": mode,
                "staleness": staleness,
                "rank": self.rank,
                "num_servers": self.num_shards,
            }
            self._hellos = [
                protocol.encode_json({**hello, "server_index": s}) for s in range(self.num_shards)
            ]
            replies = self._exchange(
                {s: (Op.HELLO, 0, 0, [self._hellos[s]]) for s in range(self.num_shards)}
            )
            for server, (_, payload) in replies.items():
                self._incarnations[server] = self._hello_incarnation(payload)
        except BaseException:
            self.close()
            raise

    # -- transport ------------------------------------------------------------------------

    def _open_socket(self, server: int) -> None:
        sock = _new_socket(self.servers[server], self.keys, connect=False)
        self._sockets[server] = sock
        # Handshake failures (a server that wants keys, or refuses ours) are reported only
        # here; without it a refused client would just time out. Attached before connect:
        # a refused handshake is not retried, so its one event must not be missed.
        self._monitors[server] = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        sock.connect(self.servers[server])

    def _close_socket(self, server: int) -> None:
        sock, monitor = self._sockets[server], self._monitors[server]
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
            self._monitors[server] = None
        if sock is not None:
            sock.close(0)
            self._sockets[server] = None

    def _reset_socket(self, server: int) -> None:
        """A fresh socket, so that a late reply to an abandoned request cannot arrive on it."""
        self._close_socket(server)
        self._open_socket(server)

    @staticmethod
    def _hello_incarnation(payload) -> int:
        try:
            body = protocol.decode_json(payload[0], what="HELLO reply") if payload else {}
        except errors.ProtocolError:
            return 0
        value = body.get("incarnation", 0) if isinstance(body, dict) else 0
        return value if isinstance(value, int) else 0

    def _send(
        self,
        server: int,
        op,
        flags: int,
        num_items: int,
        frames: list,
        clock: int,
        request_id: int | None = None,
    ) -> int:
        if request_id is None:
            request_id = next(self._request_ids)
        header = protocol.Header(
            op=int(op),
            flags=flags,
            request_id=request_id,
            client_id=self._client_id,
            rank=self.rank,
            num_items=num_items,
            clock=clock,
            num_frames=len(frames),
        )
        try:
            self._sockets[server].send_multipart(
                [header.pack(), *frames], copy=False, flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self._reset_socket(server)
            raise errors.ServerUnavailable(
                f"server {self.servers[server]} does not take requests (send queue full)",
                address=self.servers[server],
            ) from None
        return request_id

    def _exchange(self, requests: dict, clock: int | None = None) -> dict:
        """Sends {server: (op, flags, num_items, frames)} to all, then collects every reply.

        Returns {server: (reply header, payload frames)}. Raises the first
        error reply (as its kvsparse.errors class) or ServerUnavailable.
        """
        with self._lock:
            return self._exchange_locked(requests, clock)

    def _exchange_locked(self, requests: dict, clock: int | None) -> dict:
        if self._closed:
            raise errors.InvalidArgument("this store is closed")
        clock = self._clock if clock is None else clock
        waiting = {}
        for server, (op, flags, num_items, frames) in requests.items():
            waiting[server] = self._send(server, op, flags, num_items, frames, clock)
        replies = {}
        heard = dict.fromkeys(waiting, time.monotonic())
        pings: dict[int, int | None] = dict.fromkeys(waiting)
        drops = dict.fromkeys(waiting, 0)
        half = self.timeout / 2
        poller = None
        while waiting:
            if poller is None:  # again after a recovery, which replaces a server's socket
                poller = zmq.Poller()
                socket_server = {}
                for server in waiting:
                    for sock in (self._sockets[server], self._monitors[server]):
                        poller.register(sock, zmq.POLLIN)
                        socket_server[sock] = server
            now = time.monotonic()
            due = min(heard[s] + (self.timeout if pings[s] is not None else half) for s in waiting)
            # zmq_poll waits without the GIL; no busy loop.
            events = poller.poll(max(0.0, due - now) * 1000 + 1)
            for sock, _ in events:
                server = socket_server[sock]
                if server not in waiting or (
                    sock is not self._sockets[server] and sock is not self._monitors[server]
                ):
                    continue  # done, or a socket a recovery above replaced
                if sock is self._monitors[server]:
                    refused = _handshake_error(sock, self.servers[server], self.keys)
                    if refused is not None:
                        self._reset_socket(server)
                        raise refused
                    continue
                while server in waiting:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    header, payload = protocol.parse_message(frames, reply=True)
                    heard[server] = time.monotonic()
                    incarnation = protocol.reply_incarnation(frames[0])
                    if self._restarted(server, incarnation):
                        # A restarted server. Our request may have reached it anyway (a
                        # DEALER delivers what it queued while disconnected on reconnect).
                        evidence = None
                        if header.request_id == waiting[server] and not header.status:
                            self._adopt(server, incarnation)  # done there: accept the reply
                        elif header.request_id == waiting[server] or (
                            header.request_id == pings[server]
                        ):
                            seen = self._seen(payload) if header.request_id == pings[server] else 0
                            evidence = (incarnation, seen)
                        else:
                            continue  # a stray reply; a ping will tell what the server has
                        if evidence is not None:
                            waiting[server] = self._recover(
                                server, requests[server], waiting[server], clock, evidence
                            )
                            pings[server] = None
                            heard[server] = time.monotonic()
                            poller = None
                            break
                    if header.request_id == pings[server]:
                        pings[server] = None
                        if self._lost(server, payload, waiting[server], drops):
                            op, flags, num_items, frames = requests[server]
                            self._send(server, op, flags, num_items, frames, clock, waiting[server])
                        continue
                    if header.request_id != waiting[server]:
                        continue  # the reply to an abandoned request
                    if header.status:
                        protocol.raise_remote_error(header, payload, self.servers[server])
                    replies[server] = (header, payload)
                    del waiting[server]
                    if poller is not None:
                        poller.unregister(sock)
                        poller.unregister(self._monitors[server])
            now = time.monotonic()
            for server in list(waiting):
                if pings[server] is None and now >= heard[server] + half:
                    # Silence: ask whether the server is alive or just deferring the reply
                    # (a BSP round, an SSP wait, a barrier).
                    pings[server] = self._send(server, Op.PING, 0, 0, [], clock)
                elif pings[server] is not None and now >= heard[server] + self.timeout:
                    if self.retry_window <= 0:
                        self._reset_socket(server)
                        raise errors.ServerUnavailable(
                            f"server {self.servers[server]} did not answer within "
                            f"{self.timeout:g} s",
                            address=self.servers[server],
                        )
                    waiting[server] = self._recover(
                        server, requests[server], waiting[server], clock, None
                    )
                    pings[server] = None
                    heard[server] = time.monotonic()
                    poller = None
        return replies

    def _lost(self, server: int, payload, request_id: int, drops: dict) -> bool:
        """True if a ping reply shows the server never got request_id (resend it).

        Raises:
            ServerUnavailable: without retries, or after 3 resends of it.
        """
        seen = self._seen(payload)
        if seen is None or seen >= request_id:
            return False
        drops[server] += 1
        if self.retry_window <= 0 or drops[server] > 3:
            raise errors.ServerUnavailable(
                f"server {self.servers[server]} never received request {request_id} (it "
                "answers pings): the message was dropped, most likely for exceeding the "
                "server's --max-message-size, or lost with its connection",
                address=self.servers[server],
            )
        return True

    def _restarted(self, server: int, incarnation: int) -> bool:
        known = self._incarnations[server]
        return self.retry_window > 0 and bool(known) and bool(incarnation) and incarnation != known

    @staticmethod
    def _seen(payload):
        """The last request id of ours a server saw, from its PING reply (None: not said)."""
        if len(payload) != 1 or protocol.frame_nbytes(payload[0]) != 8:
            return None
        return int(protocol.frame_array(payload[0], np.uint64, 1, what="PING reply")[0])

    def _adopt(self, server: int, incarnation: int) -> None:
        self._incarnations[server] = incarnation
        self.restarts += 1

    def _recover(self, server: int, request: tuple, request_id: int, clock: int, evidence) -> int:
        """Reaches a restarted (or silent) server again and resends the request in flight.

        evidence: (incarnation, last request id of ours it saw) from a reply, or
        None to ask with PINGs (on a fresh socket after each unanswered one).

        - The same incarnation (the server was only slow), or a restarted one
          that already has the request (it arrived after the restart): the
          request goes again with its request id, which the server answers
          from its resend record (or, still pending, when done): never applied
          twice.
        - A restarted server that never saw it: HELLO, the sparse tables this
          client declared (an identical existing one is kept), then the
          request under a new id.

        Returns:
            The request id the reply will carry.

        Raises:
            ServerUnavailable: no answer within retry_window seconds.
            the error of the HELLO reply, if the server refuses this client.
        """
        deadline = time.monotonic() + self.retry_window
        op, flags, num_items, frames = request
        reset = False
        while True:
            if evidence is None:
                if reset:
                    self._reset_socket(server)
                ping_id = self._send(server, Op.PING, 0, 0, [], clock)
                answer = self._await_reply(server, ping_id, min(deadline, time.monotonic() + 1.0))
                if answer is None:
                    if time.monotonic() >= deadline:
                        self._unavailable(server)
                    reset = True
                    continue
                evidence = (answer[0], self._seen(answer[1]))
            incarnation, seen = evidence
            if not incarnation or incarnation == self._incarnations[server]:
                self._send(server, op, flags, num_items, frames, clock, request_id=request_id)
                return request_id
            if seen is not None and seen >= request_id:
                self._adopt(server, incarnation)
                self._send(server, op, flags, num_items, frames, clock, request_id=request_id)
                return request_id
            break
        while True:
            hello_id = self._send(server, Op.HELLO, 0, 0, [self._hellos[server]], clock)
            answer = self._await_reply(server, hello_id, min(deadline, time.monotonic() + 1.0))
            if answer is not None:
                break
            if time.monotonic() >= deadline:
                self._unavailable(server)
            self._reset_socket(server)
        self._adopt(server, self._hello_incarnation(answer[1]) or answer[0])
        # Tables created after the server's last checkpoint are declared again, so that
        # the resent request finds them.
        for body in self._declared_tables.values():
            init_id = self._send(server, Op.INIT_SPARSE, 0, 0, [body], clock)
            if self._await_reply(server, init_id, deadline) is None:
                self._unavailable(server)
        return self._send(server, op, flags, num_items, frames, clock)

    def _unavailable(self, server: int):
        self._reset_socket(server)
        raise errors.ServerUnavailable(
            f"server {self.servers[server]} did not come back within the retry window of "
            f"{self.retry_window:g} s",
            address=self.servers[server],
        )

    def _await_reply(self, server: int, request_id: int, until: float):
        """(incarnation, payload) of the reply to request_id, or None at `until`.

        Raises:
            the error of an error reply; ServerUnavailable for a refused handshake.
        """
        sock, monitor = self._sockets[server], self._monitors[server]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return None
            events = dict(poller.poll(remaining * 1000 + 1))
            if monitor in events:
                refused = _handshake_error(monitor, self.servers[server], self.keys)
                if refused is not None:
                    raise refused
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                header, payload = protocol.parse_message(frames, reply=True)
                if header.request_id != request_id:
                    continue
                if header.status:
                    protocol.raise_remote_error(header, payload, self.servers[server])
                return protocol.reply_incarnation(frames[0]), payload

    def _control(self, op, body, servers=None, flags=0) -> dict:
        """A JSON request to each of servers (default: all); {server: decoded JSON or None}."""
        servers = range(self.num_shards) if servers is None else servers
        frames = [] if body is None else [protocol.encode_json(body)]
        replies = self._exchange({s: (op, flags, 0, frames) for s in servers})
        out = {}
        for server, (_, payload) in replies.items():
            out[server] = (
                protocol.decode_json(payload[0], what=f"{Op(op).name} reply") if payload else None
            )
        return out

    # -- the backend interface ---------------------------------------------------------------

    def init_sparse(self, table_id, name, spec):
        """Creates the table on every server (an identical existing one is kept)."""
        body = {"table_id": int(table_id), "name": name, "spec": spec}
        self._control(Op.INIT_SPARSE, body)
        self._declared_tables[int(table_id)] = protocol.encode_json(body)

    def init_dense(self, table_id, name, values):
        """Rank 0 sends the values; the others wait until rank 0's are in place."""
        values = np.ascontiguousarray(values, np.float32).reshape(-1)
        requests = {}
        for server, (a, b) in enumerate(dense_ranges(values.size, self.num_shards)):
            body = protocol.encode_json({"table_id": int(table_id), "name": name, "size": b - a})
            if self.rank == 0:
                requests[server] = (Op.INIT_DENSE, 0, 0, [body, values[a:b]])
            else:
                requests[server] = (Op.INIT_DENSE, protocol.FLAG_DECLARE, 0, [body])
        self._exchange(requests)

    def set_optimizer(self, spec):
        """Rank 0 sets it; other ranks wait for rank 0's call and check they agree."""
        self._optimizer_calls += 1
        self._control(Op.SET_OPTIMIZER, {"spec": spec, "epoch": self._optimizer_calls})

    def pull_sparse(self, items):
        """items: [(table_id, keys, offsets)] -> [[rows of each shard] per item]."""
        per_server: dict[int, list] = {}
        for index, (table_id, keys, offsets) in enumerate(items):
            bounds = offsets.tolist()
            for server in range(self.num_shards):
                a, b = bounds[server], bounds[server + 1]
                if b > a:
                    per_server.setdefault(server, []).append((index, table_id, keys[a:b]))
        results = [[None] * self.num_shards for _ in items]
        requests = {}
        for server, entries in per_server.items():
            descriptors = protocol.make_items([(t, k.size, 0) for _, t, k in entries])
            frames = [descriptors, *(k for _, _, k in entries)]
            requests[server] = (Op.PULL_SPARSE, 0, len(entries), frames)
        replies = self._exchange(requests) if requests else {}
        dims = [0] * len(items)
        for server, entries in per_server.items():
            header, payload = replies[server]
            reply_items = self._reply_items(header, payload, len(entries), server, "PULL_SPARSE")
            for position, ((index, table_id, keys), item) in enumerate(
                zip(entries, reply_items.tolist())
            ):
                if item[0] != int(table_id) or item[1] != keys.size or not 1 <= item[2]:
                    raise errors.ProtocolError(
                        f"server {self.servers[server]} answered item {item} to a pull of "
                        f"{keys.size} keys of table {int(table_id):#x}"
                    )
                dim = item[2]
                rows = protocol.frame_array(
                    payload[1 + position], np.float32, keys.size * dim, what="PULL_SPARSE rows"
                ).reshape(keys.size, dim)
                results[index][server] = rows
                dims[index] = dim
        for index, shard_rows in enumerate(results):
            for server in range(self.num_shards):
                if shard_rows[server] is None:
                    shard_rows[server] = np.empty((0, dims[index]), np.float32)
        return results

    def _reply_items(self, header, payload, count, server, what):
        if header.num_items != count or len(payload) != 1 + count:
            raise errors.ProtocolError(
                f"server {self.servers[server]}: {what} reply has {header.num_items} items and "
                f"{len(payload)} frames for {count} items"
            )
        return protocol.parse_items(payload[0], count)

    def push_sparse(self, items):
        """items: [(table_id, keys, offsets, summed rows)].

        Every server gets every table, with no keys where it holds none: BSP
        rounds count one push per worker, SSP clocks advance everywhere, and
        a table's step counts the push on every shard.
        """
        self._clock += 1
        per_server: list[list] = [[] for _ in range(self.num_shards)]
        for table_id, keys, offsets, rows in items:
            bounds = offsets.tolist()
            dim = rows.shape[1]
            flags = protocol.ITEM_FLAG_STEP if keys.size else 0
            for server in range(self.num_shards):
                a, b = bounds[server], bounds[server + 1]
                per_server[server].append((table_id, keys[a:b], rows[a:b], dim, flags))
        requests = {}
        for server, entries in enumerate(per_server):
            descriptors = protocol.make_items([(t, k.size, d, f) for t, k, _, d, f in entries])
            frames = [descriptors]
            for _, keys, rows, _, _ in entries:
                frames += [keys, rows]
            requests[server] = (Op.PUSH_SPARSE, 0, len(entries), frames)
        self._exchange(requests)

    def pull_dense(self, items):
        """items: [(table_id, flat out)]; fills each out."""
        per_server: dict[int, list] = {}
        for table_id, out in items:
            for server, (a, b) in enumerate(dense_ranges(out.size, self.num_shards)):
                if b > a:
                    per_server.setdefault(server, []).append((table_id, out, a, b))
        requests = {}
        for server, entries in per_server.items():
            descriptors = protocol.make_items([(t, b - a, 0) for t, _, a, b in entries])
            requests[server] = (Op.PULL_DENSE, 0, len(entries), [descriptors])
        replies = self._exchange(requests) if requests else {}
        for server, entries in per_server.items():
            header, payload = replies[server]
            reply_items = self._reply_items(header, payload, len(entries), server, "PULL_DENSE")
            for position, ((table_id, out, a, b), item) in enumerate(
                zip(entries, reply_items.tolist())
            ):
                if item[0] != int(table_id) or item[1] != b - a:
                    raise errors.ProtocolError(
                        f"server {self.servers[server]} answered item {item} to a pull of "
                        f"{b - a} values of key {int(table_id):#x}"
                    )
                out[a:b] = protocol.frame_array(
                    payload[1 + position], np.float32, b - a, what="PULL_DENSE values"
                )

    def push_dense(self, items):
        """items: [(table_id, flat gradient)]."""
        self._clock += 1
        per_server: list[list] = [[] for _ in range(self.num_shards)]
        for table_id, grad in items:
            for server, (a, b) in enumerate(dense_ranges(grad.size, self.num_shards)):
                per_server[server].append((table_id, grad[a:b]))
        requests = {}
        for server, entries in enumerate(per_server):
            descriptors = protocol.make_items([(t, g.size, 0) for t, g in entries])
            requests[server] = (
                Op.PUSH_DENSE,
                0,
                len(entries),
                [descriptors, *(g for _, g in entries)],
            )
        self._exchange(requests)

    def optimizer_states(self):
        """[per-server {table_id: state}] (what ShardState.optimizer_state returns)."""
        replies = self._exchange(
            {s: (Op.GET_OPTIMIZER_STATES, 0, 0, []) for s in range(self.num_shards)}
        )
        states = []
        for server in range(self.num_shards):
            _, payload = replies[server]
            tree = protocol.decode_tree(payload, what="optimizer states")
            states.append({int(table_id): state for table_id, state in tree})
        return states

    def load_optimizer_states(self, loads):
        """loads: [(server, table_id, state)]; one request per server."""
        per_server: dict[int, list] = {}
        for server, table_id, state in loads:
            per_server.setdefault(server, []).append([int(table_id), state])
        requests = {}
        for server, tree in per_server.items():
            meta, arrays = protocol.encode_tree(tree)
            requests[server] = (Op.LOAD_OPTIMIZER_STATES, 0, 0, [meta, *arrays])
        if requests:
            self._exchange(requests)

    def barrier(self):
        """Blocks until every worker called barrier (server 0 counts)."""
        self._exchange({0: (Op.BARRIER, 0, 0, [])})

    def evict(self):
        """TTL eviction now on every server: [{table name: rows evicted} per server]."""
        replies = self._control(Op.EVICT, None)
        return [replies[s] for s in range(self.num_shards)]

    def checkpoint(self, requests):
        """{server: checkpoint request body} -> {server: decoded JSON reply}.

        The servers work in parallel (a save forks each one's writer); see
        kvsparse.shard.checkpoint for the actions.
        """
        frames = {s: (Op.CHECKPOINT, 0, 0, [protocol.encode_json(b)]) for s, b in requests.items()}
        replies = self._exchange(frames)
        return {
            s: protocol.decode_json(payload[0], what="CHECKPOINT reply")
            for s, (_, payload) in replies.items()
        }

    def stats(self):
        """[per-server stats]: tables (rows, bytes), requests, keys, keys/s, address."""
        replies = self._control(Op.STATS, None)
        return [replies[s] for s in range(self.num_shards)]

    def ping(self, server: int = 0) -> bool:
        """True if server answers a PING within the timeout."""
        return ping(self.servers[server], self.timeout, self.keys)

    def close(self):
        """Closes the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for server in range(len(self._sockets)):
                self._close_socket(server)
            self._sockets = []
            self._monitors = []


def ping(address: str, timeout: float = 1.0, keys: str | None = None) -> bool:
    """True if a kvsparse server answers at address within timeout seconds.

    Args:
        address: ``tcp://host:port``.
        timeout: seconds to wait.
        keys: a ``kvsparse keys`` directory for a CurveZMQ server (default:
            ``KVSPARSE_KEYS``, else none).

    Example:
        >>> ping('tcp://127.0.0.1:1', timeout=0.1)
        False
    """
    if keys is None:
        from kvsparse.wire import security

        keys = security.keys_from_environment()
    sock = _new_socket(address, keys)
    try:
        request_id = secrets.randbits(63) + 1
        header = protocol.Header(op=Op.PING, request_id=request_id)
        sock.send(header.pack(), flags=zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(remaining * 1000):
                return False
            frames = sock.recv_multipart()
            try:
                reply, _ = protocol.parse_message(frames, reply=True)
            except errors.ProtocolError:
                return False
            if reply.request_id == request_id:
                return reply.status == 0
    except zmq.ZMQError:
        return False
    finally:
        sock.close(0)


__all__ = ["DEFAULT_TIMEOUT", "RETRY_WINDOW", "RemoteBackend", "ping"]
