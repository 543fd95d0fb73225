"""The distributed store's client: `RemoteBackend` speaks the wire protocol to the servers.

``kvsparse.create('dist_sparse', ...)`` (and the other dist kinds) end up in
`create_dist_store`, which returns a `kvsparse.kvstore.KVStore` over a
`RemoteBackend`. The backend has one ZeroMQ DEALER socket per server. A call
sends its requests to every server involved first and then collects the
replies, so servers work in parallel; all tables touched by one call go to a
server in one request. Pulls go to the servers that hold some of the keys;
pushes go to every server (with no keys where a server holds none), so that
BSP rounds, SSP clocks and per-table step counts agree on all shards. Keys
and rows are sent and received without copies (see `kvsparse.protocol`).

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

from kvsparse import errors, protocol
from kvsparse.kvstore import KVStore, dense_ranges
from kvsparse.protocol import Op

DEFAULT_TIMEOUT = 60.0

_KIND_MODES = {
    "dist_sparse": "bsp",
    "dist_sync": "bsp",
    "dist": "bsp",
    "dist_async": "asp",
    "dist_sparse_async": "asp",
}


def _context() -> zmq.Context:
    return zmq.Context.instance()


def _new_socket(address: str) -> zmq.Socket:
    sock = _context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


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

    Raises:
        ServerUnavailable: a server did not answer the HELLO in time.
        InvalidArgument: a server was started by clients with another
            configuration (number of workers, mode, server list).
    """

    def __init__(self, servers, rank, num_workers, mode="bsp", staleness=None, timeout=None):
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
        self._client_id = secrets.randbits(64)
        self._request_ids = itertools.count(1)
        self._clock = 0
        self._optimizer_calls = 0
        self._lock = threading.RLock()  # ZeroMQ sockets are not thread-safe
        self._sockets = [_new_socket(a) for a in self.servers]
        self._closed = False
        try:
            hello = {
                "num_workers": self.num_workers,
                "mode": mode,
                "staleness": staleness,
                "rank": self.rank,
                "num_servers": self.num_shards,
            }
            self._exchange(
                {
                    s: (Op.HELLO, 0, 0, [protocol.encode_json({**hello, "server_index": s})])
                    for s in range(self.num_shards)
                }
            )
        except BaseException:
            self.close()
            raise

    # -- transport ------------------------------------------------------------------------

    def _reset_socket(self, server: int) -> None:
        """A fresh socket, so that a late reply to an abandoned request cannot arrive on it."""
        self._sockets[server].close(0)
        self._sockets[server] = _new_socket(self.servers[server])

    def _send(self, server: int, op, flags: int, num_items: int, frames: list, clock: int) -> int:
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
        poller = zmq.Poller()
        socket_server = {}
        for server in waiting:
            poller.register(self._sockets[server], zmq.POLLIN)
            socket_server[self._sockets[server]] = server
        heard = dict.fromkeys(waiting, time.monotonic())
        pings: dict[int, int | None] = dict.fromkeys(waiting)
        half = self.timeout / 2
        while waiting:
            now = time.monotonic()
            due = min(heard[s] + (self.timeout if pings[s] is not None else half) for s in waiting)
            # zmq_poll waits without the GIL; no busy loop.
            events = poller.poll(max(0.0, due - now) * 1000 + 1)
            for sock, _ in events:
                server = socket_server[sock]
                while server in waiting:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    header, payload = protocol.parse_message(frames, reply=True)
                    heard[server] = time.monotonic()
                    if header.request_id == pings[server]:
                        pings[server] = None
                        continue
                    if header.request_id != waiting[server]:
                        continue  # the reply to an abandoned request
                    if header.status:
                        protocol.raise_remote_error(header, payload, self.servers[server])
                    replies[server] = (header, payload)
                    del waiting[server]
                    poller.unregister(sock)
            now = time.monotonic()
            for server in list(waiting):
                if pings[server] is None and now >= heard[server] + half:
                    # Silence: ask whether the server is alive or just deferring the reply
                    # (a BSP round, an SSP wait, a barrier).
                    pings[server] = self._send(server, Op.PING, 0, 0, [], clock)
                elif pings[server] is not None and now >= heard[server] + self.timeout:
                    self._reset_socket(server)
                    raise errors.ServerUnavailable(
                        f"server {self.servers[server]} did not answer within {self.timeout:g} s",
                        address=self.servers[server],
                    )
        return replies

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
        self._control(Op.INIT_SPARSE, {"table_id": int(table_id), "name": name, "spec": spec})

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

    def stats(self):
        """[per-server stats]: tables (rows, bytes), requests, keys, keys/s, address."""
        replies = self._control(Op.STATS, None)
        return [replies[s] for s in range(self.num_shards)]

    def ping(self, server: int = 0) -> bool:
        """True if server answers a PING within the timeout."""
        return ping(self.servers[server], self.timeout)

    def close(self):
        """Closes the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._sockets:
                sock.close(0)
            self._sockets = []


def ping(address: str, timeout: float = 1.0) -> bool:
    """True if a kvsparse server answers at address within timeout seconds.

    Args:
        address: ``tcp://host:port``.
        timeout: seconds to wait.

    Example:
        >>> ping('tcp://127.0.0.1:1', timeout=0.1)
        False
    """
    sock = _new_socket(address)
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


def create_dist_store(
    kind: str = "dist_sparse",
    servers=None,
    rank=None,
    num_workers=None,
    timeout=None,
    staleness=None,
) -> KVStore:
    """A KVStore whose tables live on `kvsparse server` processes.

    Args:
        kind: 'dist_sparse', 'dist_sync' or 'dist' (BSP), 'dist_async' or
            'dist_sparse_async' (ASP).
        servers: server addresses; None reads the configuration
            (`kvsparse.config.from_environment`: KVSPARSE_*, TF_CONFIG,
            DMLC_*, torchrun), and the other None arguments come from it too.
            Given explicitly, rank defaults to 0 and num_workers to 1.
        rank: this worker's rank.
        num_workers: how many workers share the store.
        timeout: seconds without an answer from a server before
            ServerUnavailable (default 60).
        staleness: k for SSP (a worker runs at most k pushes ahead); None
            keeps the kind's mode.

    Raises:
        InvalidArgument: an unknown kind or a bad configuration.
        ServerUnavailable: a server did not answer.

    Example:
        >>> kv = create_dist_store('dist_sync', servers=['tcp://127.0.0.1:5701'],
        ...                        rank=0, num_workers=1)      # doctest: +SKIP
    """
    from kvsparse import config as cluster_config

    kind = kind.lower()
    if kind not in _KIND_MODES:
        raise errors.InvalidArgument(
            f"unknown dist store kind {kind!r}; use one of {sorted(_KIND_MODES)}"
        )
    if servers is None:
        found = cluster_config.from_environment()
        settings = {
            "servers": found.servers,
            "rank": found.rank if rank is None else rank,
            "num_workers": found.num_workers if num_workers is None else num_workers,
            "timeout": found.timeout if timeout is None else timeout,
            "staleness": found.staleness if staleness is None else staleness,
        }
    else:
        settings = {
            "servers": list(servers) if isinstance(servers, (list, tuple)) else servers,
            "rank": 0 if rank is None else rank,
            "num_workers": 1 if num_workers is None else num_workers,
            "timeout": timeout,
            "staleness": staleness,
        }
    config = cluster_config.ClusterConfig(**settings)
    mode = "ssp" if config.staleness is not None else _KIND_MODES[kind]
    backend = RemoteBackend(
        config.servers,
        config.rank,
        config.num_workers,
        mode=mode,
        staleness=config.staleness,
        timeout=config.timeout,
    )
    return KVStore(backend, kind)


__all__ = ["DEFAULT_TIMEOUT", "RemoteBackend", "create_dist_store", "ping"]
