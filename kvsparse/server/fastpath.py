"""The serving fast path: PULL_SPARSE and PUSH_SPARSE answered by a C++ thread, GIL-free.

A server's Python dispatch costs ~0.6 ms of CPU per small request (the table
work ~0.1 ms), and it needs the GIL, so a colocated worker busy in Python
stalled the peers its shard serves. With the fast path a C++ thread
(`kvsparse._core.FastServeLoop`, csrc/serve_loop.h) reads the ROUTER socket.
It answers, itself and without the GIL, the pulls and pushes it can answer
from start to end (registered client, new request id, a mode that holds
nothing: pulls without an SSP gate, pushes under ASP or under BSP with one
worker; registered tables, within the limits, no error). It forwards every
other message unchanged over an inproc PAIR socket to the Python serving
thread, whose `kvsparse.server.loop.EventLoop` polls that PAIR instead of the
ROUTER. Errors are always Python's: a request that would fail is forwarded
before anything changed, so the error replies are today's.

One lock, the shard mutex (`kvsparse._core.ShardLock`), serializes the two
threads: the C++ thread holds it while it serves a batch, Python while it
handles what a poll returned (and a colocated worker's thread for a request to
its own shard). Python sends its replies on the ROUTER holding it, and wakes the
C++ thread after each send (the socket's ZMQ_FD is edge-triggered: a send may
consume the signal of a message that arrived).

Python's state stays authoritative. `FastPath` keeps the C++ thread's view up to
date (the tables, the job's mode, the clients whose HELLO was accepted, the
connections whose large replies Python's reply budget tracks) and, before Python
handles anything, takes what the thread did (`FastPath.drain`) into the resend
cache (a resent push is replayed, never applied twice), the SSP clocks, the
shard's counters and the metrics.

The fast path is on unless ``KVSPARSE_FAST_PATH=0`` (`kvsparse.config.fast_path`)
or ``Server(fast_path=False)``. It is off, and the server serves everything in
Python exactly as before, when the libzmq pyzmq uses cannot be found mapped in
this process (a pyzmq built differently, or not on Linux): `find_libzmq`.

Threads: every method of `FastPath` on the server's serving thread or a thread
holding the shard lock, except `wake` (any thread) and `start` / `stop` (the
serving thread, not holding the lock).
"""

from __future__ import annotations

import os
import secrets
import sys

import zmq

from kvsparse import _core, errors
from kvsparse.server.limits import TRACK_BYTES
from kvsparse.server.metrics import LATENCY_BUCKETS
from kvsparse.wire.ops import Mode

_OPS = ("pull_sparse", "push_sparse")  # the C++ loop's op indices


def find_libzmq(maps: str = "/proc/self/maps") -> str | None:
    """The path of the libzmq that pyzmq loaded into this process, or None.

    Read from /proc/self/maps (Linux): the C++ loop opens that same copy with
    RTLD_NOLOAD and never loads one of its own. The copy a pyzmq wheel bundles
    (``pyzmq.libs``, beside the ``zmq`` package) is taken when it is mapped;
    otherwise the only libzmq mapped. None when several others are mapped (which
    one pyzmq's sockets belong to is not known: the fast path stays off).
    maps: the memory map to read (tests give another file).
    """
    bundled = os.path.realpath(
        os.path.join(os.path.dirname(os.path.dirname(zmq.__file__)), "pyzmq.libs")
    )
    found = []
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    path = fields[5].strip()
                    name = os.path.basename(path)
                    if name.startswith("libzmq") and ".so" in name and path not in found:
                        found.append(path)
    except OSError:
        return None
    for path in found:
        if os.path.dirname(os.path.realpath(path)) == bundled:
            return path
    return found[0] if len(found) == 1 else None


class FastPath:
    """The C++ fast path of one server, and the bookkeeping that keeps Python authoritative.

    Args:
        router: the server's bound ROUTER socket.
        context: its zmq.Context (the PAIR pair is made in it).
        lock: the shard lock (`kvsparse._core.ShardLock`) of the server.
        incarnation: the server's, stamped on every reply.
        state, resend, coordination, metrics: the server's ShardState,
            ResendCache, Coordination and ServerMetrics.
        limits: its `kvsparse.config.ServerLimits`.

    Raises:
        InvalidArgument: libzmq is not loaded here (use `create`, which returns None then).
    """

    def __init__(
        self, router, context, lock, incarnation, state, resend, coordination, metrics, limits
    ):
        libzmq = find_libzmq()
        if libzmq is None:
            raise errors.InvalidArgument("the libzmq pyzmq uses is not mapped in this process")
        self._state = state
        self._resend = resend
        self._coordination = coordination
        self._metrics = metrics
        address = f"inproc://kvsparse-fastpath-{secrets.token_hex(8)}"
        self._forward = context.socket(zmq.PAIR)
        self.inbox = context.socket(zmq.PAIR)
        for pair in (self._forward, self.inbox):
            pair.setsockopt(zmq.LINGER, 0)
            pair.setsockopt(zmq.SNDHWM, 0)
            pair.setsockopt(zmq.RCVHWM, 0)
        self._forward.bind(address)
        self.inbox.connect(address)
        try:
            self._loop = _core.FastServeLoop(
                libzmq,
                router.underlying,
                self._forward.underlying,
                lock,
                incarnation,
                LATENCY_BUCKETS,
            )
        except errors.KVSparseError:
            self.close()
            raise
        self._loop.set_limits(
            limits.max_rows_per_request,
            limits.max_reply_bytes,
            limits.max_unread_reply_bytes,
            TRACK_BYTES,
        )
        self._tables_version = -1
        self._job = None
        self._running = False
        self.answered = 0  # requests the C++ thread answered (drained so far)

    @classmethod
    def create(cls, *args) -> FastPath | None:
        """A FastPath, or None when libzmq cannot be reached (the server serves in Python)."""
        try:
            return cls(*args)
        except errors.InvalidArgument:
            return None

    # -- lifetime (serving thread, lock not held) ------------------------------------------

    def start(self) -> None:
        """Starts the C++ thread (call `sync` first, holding the lock)."""
        self._loop.start()
        self._running = True

    def stop(self) -> None:
        """Stops and joins the C++ thread (the GIL released while it finishes its batch)."""
        self._loop.stop()
        self._running = False

    def close(self) -> None:
        """Closes the PAIR sockets (after stop)."""
        self._forward.close(0)
        self.inbox.close(0)

    def wake(self) -> None:
        """Makes the C++ thread ask the ROUTER again: call after any use of it (any thread)."""
        self._loop.wake()

    # -- around each message Python handles (lock held) ------------------------------------

    def before_python(self) -> None:
        """Brings Python's state up to date with what the C++ thread did."""
        self.drain()

    def after_python(self, forwarded: bool) -> None:
        """Tells the C++ thread what Python changed; forwarded: the message came from it."""
        self.sync()
        if forwarded:
            self._loop.mark_handled()

    def sync(self) -> None:
        """Registers the tables and the job's mode again if they changed (cheap if not)."""
        sparse = self._state.sparse
        if sparse.version != self._tables_version:
            self._tables_version = sparse.version
            self._loop.set_tables(
                [
                    (table_id, entry.table, entry.spec.get("nonfinite") == "skip")
                    for table_id, entry in sparse.items()
                ]
            )
        job = self._coordination.job
        if job.configured:
            staleness = self._coordination.ssp.staleness
            # BSP with one worker: every push completes its round at once, applied as
            # ASP applies it (BspRounds: no round is ever held, no orphan after a restart).
            pushes = job.mode == Mode.ASP or (job.mode == Mode.BSP and job.num_workers == 1)
            current = (True, job.num_workers, staleness is None, pushes)
        else:
            current = (False, 0, False, False)
        if current != self._job:
            self._job = current
            self._loop.set_job(*current)

    def client_changed(self, client_id: int, routing: bytes | None, shared: tuple = (0, 0)) -> None:
        """A worker's HELLO was accepted, or it spoke on a new routing id (routing), or it
        was found gone (None) (`kvsparse.server.liveness`). shared: (address, bytes) of
        its shared segment as mapped here (`kvsparse.server.shared`), (0, 0): none."""
        self.drain()  # what the thread did for it reaches the resend cache first
        if routing is None:
            self._loop.remove_client(client_id)
            return
        last = self._resend.last_request_id(client_id)
        self._loop.set_client(client_id, routing, last, shared[0], shared[1])

    def budget_held(self, routing: bytes, held: bool) -> None:
        """Python's reply budget tracks (held) or no longer tracks replies to routing: the
        C++ thread leaves that connection's pulls to Python meanwhile."""
        self._loop.set_budget_held(routing, held)

    def unread(self, routing: bytes) -> int:
        """Bytes of the C++ thread's replies to routing that ZeroMQ still holds (counted by
        the reply budget with its own: one budget per connection, whoever answered)."""
        return self._loop.unread(routing)

    def drain(self) -> None:
        """Takes what the C++ thread did since the last drain into Python's state."""
        done = self._loop.drain()
        if done is None:
            return
        clients, clocks, tables, requests, latency, latency_sum, keys, newest, failed = done
        resend = self._resend
        for client_id, request_id, is_push, last_push, pushes, reply, error in clients:
            kept = None
            if is_push:
                kept = [reply, error.encode()] if error else [reply]
            resend.record_answered(client_id, request_id, kept, last_push, pushes)
        ssp = self._coordination.ssp
        for rank, clock in clocks:
            ssp.advance(rank, clock)
        metrics = self._metrics
        table_ops = metrics.table_ops
        for op, table_id, count, table_keys in tables:
            entry = table_ops.get((_OPS[op], table_id))
            if entry is None:
                table_ops[(_OPS[op], table_id)] = [count, table_keys]
            else:
                entry[0] += count
                entry[1] += table_keys
        counters = self._state.counters
        for op, count in enumerate(requests):
            if not count:
                continue
            name = _OPS[op]
            metrics.requests[name] = metrics.requests.get(name, 0) + count
            counters.requests += count
            self.answered += count
            histogram = metrics.latency.get(name)
            if histogram is None:
                histogram = metrics.latency[name] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
            for bucket, bucket_count in enumerate(latency[op]):
                histogram[bucket] += bucket_count
            histogram[-1] += latency_sum[op]
        counters.keys += keys
        if newest and (self._state.newest_push is None or newest > self._state.newest_push):
            self._state.newest_push = newest
        for _ in range(failed):
            metrics.count_error("MemoryError")
        if failed:
            # As the Python path logs it (`kvsparse.server.dispatch`): one line, no traceback;
            # the workers got CapacityError (a MemoryError) and nothing of those pushes.
            print(
                f"kvsparse server: out of memory in {failed} push_sparse request(s) of the "
                "fast path; refused, serving on",
                file=sys.stderr,
                flush=True,
            )


def shard_lock():
    """A new shard lock (`kvsparse._core.ShardLock`)."""
    return _core.ShardLock()


__all__ = ["FastPath", "find_libzmq", "shard_lock"]
