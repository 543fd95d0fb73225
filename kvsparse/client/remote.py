"""The distributed store's client: `RemoteBackend` turns store calls into wire operations.

``kvsparse.create('dist_sparse', ...)`` (and the other dist kinds) end up in
`kvsparse.store.factory.create_remote_store`, which returns a KVStore over a
`RemoteBackend`. The backend splits each call by server and encodes it with
the op codecs of `kvsparse.wire.ops`; its `kvsparse.client.session.Session`
sends the requests to every server involved first and then collects the
replies (timeouts, liveness pings, restarts and security are the session's;
see there). All tables touched by one call go to a server in one request.
Pulls go to the servers that hold some of the keys; pushes go to every server
(with no keys where a server holds none), so that BSP rounds, SSP clocks and
per-table step counts agree on all shards. Keys and rows are sent and
received without copies (see `kvsparse.wire.protocol`).

Servers on the worker's host (``ipc://`` addresses, or any with
``shared_memory=True``) get the worker's shared-memory segment in HELLO
(`kvsparse.client.shared`): pulled rows are written straight into it and
pushed rows read straight from it, so only keys and offsets cross the socket.
The push's summed rows are made there (`rows_buffer`). Only for calls with
`SHARED_MIN_BYTES` of rows or more (below that the socket is as fast), and not for
shards in this process. With a retry window, a request resent to a restarted
server finds its rows where they were (the session keeps them until the reply),
and a server that lost the segment (restarted, and reached without a greeting)
answers SharedMemoryMissing, on which the session greets it again and resends.

Consistency modes (chosen by the store kind, or ``staleness=``):

- ``'dist_sync'``, ``'dist_sparse'``, ``'dist'``: BSP. A push returns once every
  worker pushed that table in this step and the summed gradient was applied;
  every worker must push the same keys in each step (as with MXNet's
  dist_sync).
- ``'dist_async'``, ``'dist_sparse_async'``: ASP, applied on arrival.
- ``staleness=k`` with any kind: SSP, applied on arrival; a pull blocks while
  this worker is more than k pushes ahead of the slowest worker.

Example:
    >>> import kvsparse                                        # doctest: +SKIP
    >>> kv = kvsparse.create('dist_sparse', servers=['tcp://127.0.0.1:5701'],
    ...                      rank=0, num_workers=1)             # doctest: +SKIP
    >>> kv.init('user', kvsparse.SparseTable(dim=8))           # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
import zmq

from kvsparse import errors
from kvsparse.client.session import Session
from kvsparse.client.shared import DEFAULT_BYTES, SharedArena
from kvsparse.client.shared import MIN_BYTES as MIN_SHARED_BYTES
from kvsparse.placement import dense_ranges
from kvsparse.wire import ops
from kvsparse.wire.protocol import WIRE_FRAME_DTYPES

_LOG = logging.getLogger(__name__)
# Rows (a pull's, a push's) from which they go through shared memory: below, the socket's
# copies cost less than the segment's bookkeeping (measured on 2 cores: even at 125 KiB,
# 1.25x faster at 500 KiB, 2x at 7.5 MB, for a pull + push).
SHARED_MIN_BYTES = 256 << 10


class RemoteBackend:
    """The KVStore backend of the dist kinds: the `kvsparse.store.backend.Backend` over ZeroMQ.

    Args:
        servers: server addresses ``tcp://host:port``, in shard order.
        rank: this worker's rank.
        num_workers: how many workers share the servers.
        mode: 'bsp', 'asp' or 'ssp' (or a `kvsparse.wire.ops.Mode`).
        staleness: k of SSP (mode 'ssp' only).
        timeout: seconds without any answer from a server before
            ServerUnavailable (default 60).
        retry_window: seconds to keep trying to reach a restarted or silent
            server (HELLO again, then resend the request in flight) before
            ServerUnavailable; 0 or None: no retry (``kvsparse.create``
            passes ``KVSPARSE_RETRY_WINDOW``).
        keys: a ``kvsparse keys`` directory for CurveZMQ; None: no encryption
            (``kvsparse.create`` passes ``KVSPARSE_KEYS``).
        local: {server index: endpoint} of shards served in this process
            (colocated mode: `kvsparse.store.colocated`), reached without a socket.
        shared_memory: rows through a shared-memory segment (module docstring):
            None (default) with servers on ``ipc://`` addresses, True with every
            server that can map it (those that cannot use the socket), False
            never. An int: True, with a segment of that many bytes (default 64 MiB).

    Thread safety: the session serializes the calls (and the clock), so a
    backend may be shared by threads; in a forked child it reconnects and only looks rows
    up (`kvsparse.client.session.Session`, "Fork").

    Raises:
        ServerUnavailable: a server did not answer the HELLO in time, or
            refused the security handshake.
        InvalidArgument: a bad mode, or a server was started by clients with
            another configuration (number of workers, mode, server list).
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
        local=None,
        shared_memory=None,
    ):
        if mode not in ops.MODES:
            raise errors.InvalidArgument(f"mode must be 'bsp', 'asp' or 'ssp', got {mode!r}")
        check_shared_memory(shared_memory)
        if (mode == ops.Mode.SSP) != (staleness is not None):
            raise errors.InvalidArgument("staleness goes with mode 'ssp' (and only with it)")
        self.servers = list(servers)
        self.num_shards = len(self.servers)
        self.rank = int(rank)
        self.num_workers = int(num_workers)
        self.mode = ops.Mode(mode)
        self.staleness = staleness
        self._optimizer_calls = 0
        self.session = Session(
            self.servers,
            rank=self.rank,
            timeout=timeout,
            retry_window=0.0 if retry_window is None else retry_window,
            keys=keys,
            local=local,
        )
        self._pipelined_pulls = pulls_may_follow_pending_pushes(
            self.mode, self.num_workers, self.session.retry_window, bool(local)
        )
        self._dims: dict[int, int] = {}  # table id -> dim, for rows pulled into shared memory
        self._arena: Optional[SharedArena] = None
        self._shared: frozenset = frozenset()  # servers that mapped the arena
        self._pid = os.getpid()
        self._parent_arena: Optional[SharedArena] = None  # in a forked child (`_forked`)
        offered = self._shared_candidates(shared_memory, local)
        try:
            if offered:
                size = DEFAULT_BYTES if shared_memory in (None, True) else int(shared_memory)
                self._arena = SharedArena.create(size)
                self.session.on_lost = self._arena.keep_forever if self._arena else None
            offer = self._arena.offer() if self._arena is not None else None
            answers = self.session.open(
                {
                    server: ops.Hello.encode_request(
                        ops.HelloRequest(
                            self.num_workers,
                            self.mode,
                            staleness,
                            self.rank,
                            self.num_shards,
                            server,
                            offer if server in offered else None,
                        )
                    )
                    for server in range(self.num_shards)
                }
            )
            if self._arena is not None:
                self._shared = self._accepted(answers, offered)
                if not self._shared:
                    self._arena.close()
                    self._arena = None
        except BaseException:
            self.session.close()
            if self._arena is not None:
                self._arena.close()
            raise

    def _shared_candidates(self, shared_memory, local) -> frozenset:
        """The servers to offer the shared segment to (module docstring)."""
        if shared_memory is False:
            return frozenset()
        return frozenset(
            server
            for server, address in enumerate(self.servers)
            if not (local and server in local)
            and (shared_memory is not None or address.startswith("ipc://"))
        )

    def _accepted(self, answers: dict, offered: frozenset) -> frozenset:
        """The servers whose HELLO reply says they mapped the segment (the others are logged)."""
        accepted = set()
        for server in offered:
            reply = self._decode(server, ops.Hello, answers[server])
            if reply.shared:
                accepted.add(server)
            else:
                _LOG.info(
                    "server %s does not use this worker's shared memory (%s); rows go "
                    "through its socket",
                    self.servers[server],
                    reply.shared_error or "it did not say why",
                )
        return frozenset(accepted)

    @property
    def shared_servers(self) -> frozenset:
        """The servers that pull and push rows through this worker's shared memory."""
        return self._shared

    def _forked(self) -> None:
        """In a process forked from this backend's: stops using the parent's shared segment.

        The child's session greets the servers without it (`Session`, "Fork"): rows go
        through its sockets. The segment is kept referenced, never closed from the child.
        """
        if self._pid != os.getpid():
            self._pid = os.getpid()
            if self._arena is not None:
                self._parent_arena, self._arena = self._arena, None
            self._shared = frozenset()

    def rows_buffer(self, count: int, dim: int) -> Optional[np.ndarray]:
        """A fresh (count, dim) float32 array in the shared segment for a push's summed rows
        (sent to the servers that share it without a copy), or None: make one anywhere."""
        self._forked()
        if self._arena is None or count * dim * 4 < SHARED_MIN_BYTES:
            return None
        return self._arena.rows(count, dim)

    @property
    def timeout(self) -> float:
        """Seconds without any answer from a server before ServerUnavailable (settable)."""
        return self.session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.session.timeout = float(seconds)

    @property
    def restarts(self) -> int:
        """Server restarts this client recovered from."""
        return self.session.restarts

    # -- helpers ------------------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """Pushes this worker made (the session's clock: `kvsparse.KVStore.clock`)."""
        return self.session.clock

    def _exchange(
        self, codec, requests: dict, *, push: bool = False, wait: bool = True, keep=None
    ) -> dict:
        """{server: request of codec's op} -> {server: codec's decoded reply}.

        wait=False (a push): {} once sent; the replies are decoded when the
        session collects them (`Session.exchange`). keep: as `Session.exchange`.
        """

        def decode(answers: dict) -> dict:
            return {
                server: self._decode(server, codec, answer) for server, answer in answers.items()
            }

        if not wait:
            self.session.exchange(requests, push=push, wait=False, check=decode, keep=keep)
            return {}
        return decode(self.session.exchange(requests, push=push, keep=keep))

    def _everywhere(self, codec, request: Optional[ops.Request] = None) -> list:
        """The same request (default: codec's plain one) to every server -> replies in order."""
        request = codec.encode_request() if request is None else request
        replies = self._exchange(codec, dict.fromkeys(range(self.num_shards), request))
        return [replies[server] for server in range(self.num_shards)]

    def _decode(self, server: int, codec, answer, *args):
        """codec's decoded reply, a malformed one's ProtocolError naming the server."""
        try:
            return codec.decode_reply(answer.header, answer.payload, *args)
        except errors.ProtocolError as exc:
            raise errors.ProtocolError(f"server {self.servers[server]}: {exc}") from None

    # -- the backend interface ---------------------------------------------------------------

    def init_sparse(self, table_id, name, spec):
        """Creates the table on every server (an identical existing one is kept)."""
        request = ops.InitSparse.encode_request(table_id, name, spec)
        self._everywhere(ops.InitSparse, request)
        self._dims[int(table_id)] = int(spec["dim"])
        # A server that restarts from a checkpoint older than the table gets it again.
        self.session.remember(int(table_id), request)

    def init_dense(self, table_id, name, values, dtype="float32"):
        """Rank 0 sends the values; the others wait until rank 0's are in place.

        dtype: what the servers store; values travel as float32.
        """
        values = np.ascontiguousarray(values, np.float32).reshape(-1)
        requests = {
            server: ops.InitDense.encode_request(
                table_id, name, b - a, values[a:b] if self.rank == 0 else None, dtype
            )
            for server, (a, b) in enumerate(dense_ranges(values.size, self.num_shards))
        }
        self._exchange(ops.InitDense, requests)
        # Dense keys created after a server's last checkpoint are created again when it
        # restarts: rank 0's values; another rank's declaration
        # waits for them, as it did here.
        for server, request in requests.items():
            self.session.remember(("dense", int(table_id), server), request, server=server)

    def set_optimizer(self, spec, table_ids=None):
        """Rank 0 sets it (store-wide, or table_ids' own); other ranks wait for rank 0's
        call and check they agree."""
        self._send_set_optimizer(spec, table_ids, replay=False)

    def set_learning_rate(self, learning_rate, table_ids=None):
        """Rank 0 changes the optimizers' learning rate (every table's, or table_ids'),
        keeping their slots; other ranks wait for rank 0's call and check they agree."""
        self._send_set_optimizer(None, table_ids, replay=False, learning_rate=learning_rate)

    def _send_set_optimizer(self, spec, table_ids, replay: bool, learning_rate=None) -> None:
        """Sends the next SET_OPTIMIZER call everywhere; replay: as a replay of a call the
        servers may know (they keep the slots they hold for it: a restarted colocated
        worker's calls, `kvsparse.store.colocated`). learning_rate: a set_learning_rate
        call (spec None)."""
        self._optimizer_calls += 1
        calls = self._optimizer_calls
        self._everywhere(
            ops.SetOptimizer,
            ops.SetOptimizer.encode_request(spec, calls, replay, table_ids, learning_rate),
        )
        if self.rank == 0:
            # A restarted server gets rank 0's last call again, so that the other ranks'
            # calls, which wait for rank 0's, can complete there; the last
            # store-wide call, and the last one of each set of tables.
            replay = ops.SetOptimizer.encode_request(spec, calls, True, table_ids, learning_rate)
            what = "set_optimizer" if table_ids is None else ("set_optimizer", tuple(table_ids))
            if learning_rate is not None:
                what = ("set_learning_rate", what)
            # Replayed after the calls before it (a newer call under a known name moves to
            # the end): a rate then applies to the optimizer it was set on.
            self.session.remember(what, replay, last=True)

    def assign_sparse(self, items):
        """items: [(table_id, keys, offsets, float32 rows)]; each server gets its keys' rows."""
        per_server: dict[int, list] = {}
        for table_id, keys, offsets, rows in items:
            bounds = offsets.tolist()
            for server in range(self.num_shards):
                a, b = bounds[server], bounds[server + 1]
                if b > a:
                    per_server.setdefault(server, []).append((table_id, keys[a:b], rows[a:b]))
        requests = {
            server: ops.AssignSparse.encode_request(entries)
            for server, entries in per_server.items()
        }
        if requests:
            self._exchange(ops.AssignSparse, requests)

    @property
    def defers_pulls(self) -> bool:
        """Whether pull_sparse(wait=False) returns before the servers answer: where a pull
        may go out behind a push whose acknowledgements are pending
        (`pulls_may_follow_pending_pushes`)."""
        return self._pipelined_pulls

    def pull_sparse(self, items, wait=True):
        """items: [(table_id, keys, offsets[, wire_dtype])] -> [[rows of each shard] per item].

        Rows come as the servers sent them: float32, or uint16 bit patterns of
        a 16-bit wire dtype (the store widens them into the caller's output).
        wait=False: returns a callable giving that list, which reads the replies
        when called; the requests are sent before this returns where
        `defers_pulls` (else the pull is done at once).
        """
        per_server: dict[int, list] = {}
        wires = []
        for index, (table_id, keys, offsets, *wire) in enumerate(items):
            wires.append(wire[0] if wire else "float32")
            bounds = offsets.tolist()
            for server in range(self.num_shards):
                a, b = bounds[server], bounds[server + 1]
                if b > a:
                    entry = (index, table_id, keys[a:b], wires[index], a, b)
                    per_server.setdefault(server, []).append(entry)
        blocks = self._shared_blocks(items, wires, per_server)
        requests, shared = {}, {}
        for server, entries in per_server.items():
            plain = [(t, k, w) for _, t, k, w, _, _ in entries]
            if server in self._shared and all(e[0] in blocks for e in entries):
                shared[server] = [blocks[index][a:b] for index, _, _, _, a, b in entries]
                offsets = [self._arena.offset_of(view) for view in shared[server]]
                dims = [view.shape[1] for view in shared[server]]
                requests[server] = ops.PullSparse.encode_request(plain, offsets, dims)
            else:
                requests[server] = ops.PullSparse.encode_request(plain)
        keep = list(blocks.values()) or None

        def rows(answers: dict) -> list:
            results = [[None] * self.num_shards for _ in items]
            dims = [0] * len(items)
            for server, entries in per_server.items():
                requested = [(table_id, keys.size, w) for _, table_id, keys, w, _, _ in entries]
                replies = self._decode(
                    server, ops.PullSparse, answers[server], requested, shared.get(server)
                )
                for (index, _, _, _, _, _), item_rows in zip(entries, replies):
                    results[index][server] = item_rows
                    dims[index] = item_rows.shape[1]
            for index, shard_rows in enumerate(results):
                for server in range(self.num_shards):
                    if shard_rows[server] is None:
                        dtype = WIRE_FRAME_DTYPES[wires[index]]
                        shard_rows[server] = np.empty((0, dims[index]), dtype)
            return results

        if not requests:
            answers: dict = {}
        elif not wait and self._pipelined_pulls:
            pending = self.session.exchange(requests, pipelined=True, wait=False, keep=keep)
            return lambda: rows(pending.result())
        else:
            answers = self.session.exchange(requests, pipelined=self._pipelined_pulls, keep=keep)
        result = rows(answers)
        return result if wait else lambda: result

    def prefetch_sparse(self, items):
        """items: [(table_id, keys, offsets)]: ids a pull will name soon, sent now.

        Each server brings those of its keys' rows that are on disk into memory
        at once (PREFETCH_SPARSE), so that the pull finds them there. Sent
        without waiting, where `defers_pulls` (it may go out behind a pending
        push: it changes no row, so its place in the order changes no result);
        returns a callable giving the rows each item brought in from disk (a
        list, summed over the servers), which reads the replies (a later call
        of the backend may read them first and keep them). Elsewhere it sends
        nothing and returns None: the pull itself runs at once there.
        """
        if not self._pipelined_pulls:
            return None
        per_server: dict[int, list] = {}
        for index, (table_id, keys, offsets) in enumerate(items):
            bounds = offsets.tolist()
            for server in range(self.num_shards):
                a, b = bounds[server], bounds[server + 1]
                if b > a:
                    per_server.setdefault(server, []).append((index, table_id, keys[a:b]))
        if not per_server:
            return lambda: [0] * len(items)
        requests = {
            server: ops.PrefetchSparse.encode_request([(t, k) for _, t, k in entries])
            for server, entries in per_server.items()
        }
        pending = self.session.exchange(requests, pipelined=True, wait=False)

        def read() -> list:
            answers = pending.result()
            counts = [0] * len(items)
            for server, entries in per_server.items():
                replies = self._decode(server, ops.PrefetchSparse, answers[server], len(entries))
                for (index, _, _), count in zip(entries, replies.tolist()):
                    counts[index] += count
            return counts

        return read

    def _shared_blocks(self, items, wires: list, per_server: dict) -> dict:
        """{item index: a (keys, dim) float32 array in the shared segment} for the float32
        items of known dim that some sharing server holds keys of (all shards' rows of an
        item in one array, as the store gathers them); {} without shared memory."""
        self._forked()
        if self._arena is None:
            return {}
        wanted = {index for server in self._shared for index, *_ in per_server.get(server, ())}
        room = sum(items[i][1].size * self._dims.get(int(items[i][0]), 0) * 4 for i in wanted)
        if room < SHARED_MIN_BYTES:
            return {}
        blocks = {}
        for index in sorted(wanted):
            table_id, keys = items[index][0], items[index][1]
            dim = self._dims.get(int(table_id))
            if wires[index] != "float32" or dim is None:
                continue
            block = self._arena.rows(keys.size, dim)
            if block is not None:
                blocks[index] = block
        return blocks

    def push_sparse(self, items, wait=True):
        """items: [(table_id, keys, offsets, summed rows[, wire_dtype])], rows in the wire dtype.

        Every server gets every table, with no keys where it holds none: BSP
        rounds count one push per worker, SSP clocks advance everywhere, and
        a table's step counts the push on every shard. wait=False: returns
        once sent (`kvsparse.KVStore.push`).
        """
        per_server: list[list] = [[] for _ in range(self.num_shards)]
        for table_id, keys, offsets, rows, *wire in items:
            bounds = offsets.tolist()
            step = keys.size > 0
            wire_dtype = wire[0] if wire else "float32"
            for server in range(self.num_shards):
                a, b = bounds[server], bounds[server + 1]
                push = ops.SparsePush(table_id, keys[a:b], rows[a:b], step, wire_dtype)
                per_server[server].append(push)
        requests = {}
        keep = []
        for server, entries in enumerate(per_server):
            offsets = self._shared_offsets(server, entries)
            requests[server] = ops.PushSparse.encode_request(entries, offsets)
            if offsets is not None:
                keep.extend(entry.rows for entry in entries)
        self._exchange(ops.PushSparse, requests, push=True, wait=wait, keep=keep or None)

    def _shared_offsets(self, server: int, entries: list) -> Optional[list]:
        """The byte offset of each entry's rows in the shared segment, if server shares it
        and every entry's float32 rows lie there (or are empty); else None."""
        self._forked()
        if server not in self._shared or all(entry.keys.size == 0 for entry in entries):
            return None  # (rows through the segment or not: nothing to name)
        offsets = []
        for entry in entries:
            if entry.keys.size == 0:
                offsets.append(0)
                continue
            offset = self._arena.offset_of(entry.rows) if entry.wire_dtype == "float32" else None
            if offset is None:
                return None
            offsets.append(offset)
        return offsets

    def pull_dense(self, items):
        """items: [(table_id, flat out)]; fills each out."""
        per_server: dict[int, list] = {}
        for table_id, out in items:
            for server, (a, b) in enumerate(dense_ranges(out.size, self.num_shards)):
                if b > a:
                    per_server.setdefault(server, []).append((table_id, out, a, b))
        requests = {
            server: ops.PullDense.encode_request([(t, b - a) for t, _, a, b in entries])
            for server, entries in per_server.items()
        }
        answers = self.session.exchange(requests) if requests else {}
        for server, entries in per_server.items():
            requested = [(table_id, b - a) for table_id, _, a, b in entries]
            values = self._decode(server, ops.PullDense, answers[server], requested)
            for (_, out, a, b), slice_values in zip(entries, values):
                out[a:b] = slice_values

    def push_dense(self, items, wait=True):
        """items: [(table_id, flat gradient)]; wait=False: returns once sent."""
        per_server: list[list] = [[] for _ in range(self.num_shards)]
        for table_id, grad in items:
            for server, (a, b) in enumerate(dense_ranges(grad.size, self.num_shards)):
                per_server[server].append((table_id, grad[a:b]))
        requests = {
            server: ops.PushDense.encode_request(entries)
            for server, entries in enumerate(per_server)
        }
        self._exchange(ops.PushDense, requests, push=True, wait=wait)

    def optimizer_states(self):
        """[per-server {table_id: state}] (what ShardState.optimizer_state returns)."""
        return self._everywhere(ops.GetOptimizerStates)

    def load_optimizer_states(self, loads):
        """loads: [(server, table_id, state)]; one request per server."""
        per_server: dict[int, list] = {}
        for server, table_id, state in loads:
            per_server.setdefault(server, []).append((table_id, state))
        requests = {
            server: ops.LoadOptimizerStates.encode_request(states)
            for server, states in per_server.items()
        }
        if requests:
            self._exchange(ops.LoadOptimizerStates, requests)

    def barrier(self):
        """Blocks until every worker called barrier.

        Sent to every server: each counts the workers, and each must know who
        waits at the barrier, whose pushes its BSP rounds then stop waiting for
        (`kvsparse.server.coordination`, "Barrier as join").
        """
        self._everywhere(ops.Barrier)

    def evict(self):
        """TTL eviction now on every server: [{table name: rows evicted} per server]."""
        return self._everywhere(ops.Evict)

    def checkpoint(self, requests, gather=False):
        """{server: checkpoint request body} -> {server: decoded JSON reply}.

        The servers work in parallel (a save forks each one's writer); see
        kvsparse.shard.checkpoint for the actions. gather: every server's
        outcome, a failed one's error as its value (nothing raised).
        """
        encoded = {server: ops.Checkpoint.encode_request(body) for server, body in requests.items()}
        if not gather:
            return self._exchange(ops.Checkpoint, encoded)
        outcomes = self.session.exchange(encoded, gather=True)
        replies = {}
        for server, outcome in outcomes.items():
            if isinstance(outcome, errors.KVSparseError):
                replies[server] = outcome
                continue
            try:
                replies[server] = self._decode(server, ops.Checkpoint, outcome)
            except errors.ProtocolError as exc:
                replies[server] = exc
        return replies

    def stats(self):
        """[per-server stats]: tables (rows, bytes), requests, keys, keys/s, address."""
        return self._everywhere(ops.Stats)

    def ping(self, server: int = 0) -> bool:
        """True if server answers a PING within the timeout."""
        return ping(self.servers[server], self.session.timeout, self.session.keys)

    def close(self):
        """Collects a pending push's acknowledgements, then closes the sockets (idempotent)."""
        self._forked()
        try:
            self.session.close()
        finally:
            if self._arena is not None:
                self._arena.close()


def check_shared_memory(shared_memory) -> None:
    """Raises InvalidArgument unless shared_memory is None, a bool, or a size in bytes."""
    if shared_memory is None or isinstance(shared_memory, bool):
        return
    if not isinstance(shared_memory, int) or shared_memory < MIN_SHARED_BYTES:
        raise errors.InvalidArgument(
            "shared_memory must be None (ipc servers), True, False, or a segment size in "
            f"bytes of at least {MIN_SHARED_BYTES}, got {shared_memory!r}"
        )


def pulls_may_follow_pending_pushes(
    mode, num_workers: int, retry_window: float, local: bool
) -> bool:
    """Whether a pull may go out behind a push whose acknowledgements are not collected yet.

    (`Session.exchange`'s pipelined.) Only where every push is answered once applied:
    not in a BSP round of several workers, which a server holds until the round closes,
    serving the worker's next requests meanwhile. Not with retries either (a restarted
    server would get only the request in flight again), nor with shards served in this
    process (colocated workers).

    Example:
        >>> pulls_may_follow_pending_pushes(ops.Mode.BSP, 1, 0.0, False)
        True
        >>> pulls_may_follow_pending_pushes(ops.Mode.BSP, 2, 0.0, False)
        False
    """
    answered_at_once = ops.Mode(mode) != ops.Mode.BSP or num_workers == 1
    return answered_at_once and retry_window <= 0 and not local


def ping(address: str, timeout: float = 1.0, keys: Optional[str] = None) -> bool:
    """True if a kvsparse server answers a PING at address within timeout seconds.

    Safe to call from several threads at once (each call has its own session).

    Args:
        address: ``tcp://host:port``.
        timeout: seconds to wait.
        keys: a ``kvsparse keys`` directory for a CurveZMQ server (None: none).

    Raises:
        InvalidArgument: keys is not a usable key directory.

    Example:
        >>> ping('tcp://127.0.0.1:1', timeout=0.1)
        False
    """
    session = Session(
        [address],
        timeout=timeout,
        keys=keys,
        monitor=True,
    )
    try:
        session.exchange({0: ops.Ping.encode_request()})
        return True
    except (errors.KVSparseError, zmq.ZMQError):
        return False
    finally:
        session.close()


__all__ = ["RemoteBackend", "ping", "pulls_may_follow_pending_pushes"]
