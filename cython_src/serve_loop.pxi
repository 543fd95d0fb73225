# The GIL-free serving fast path (csrc/serve_loop.h), and the shard
# mutex it shares with the Python serving thread. Included by _core.pyx.
from libcpp.memory cimport unique_ptr as _unique_ptr
from libcpp.string cimport string

from serve_loop cimport FastDrain, FastServeLoop as CFastServeLoop, LoadZmqApi, ShardMutex, ZmqApi


cdef class ShardLock:
    """The shard mutex (a C++ std::recursive_mutex), usable as a Python lock.

    A server's Python serving thread and its C++ fast-path thread hold it while
    they touch the shard (`kvsparse.server.fastpath`); so do threads of a
    colocated worker (`kvsparse.server.embedded`). acquire() waits without the
    GIL, so a thread holding the lock may itself wait for the GIL.

    Thread-safe. Reentrant: the thread that holds it may acquire it again, and
    must release it as many times. release() from a thread that does not hold
    it is a programming error (undefined, as for std::recursive_mutex).

    Example:
        >>> lock = ShardLock()
        >>> with lock:
        ...     pass
    """

    cdef ShardMutex* c_mutex

    def __cinit__(self):
        self.c_mutex = new ShardMutex()

    def __dealloc__(self):
        del self.c_mutex

    def acquire(self, bint blocking=True):
        """Takes the lock (waiting without the GIL); False if not blocking and it is held."""
        if self.c_mutex.try_lock():
            return True
        if not blocking:
            return False
        with nogil:
            self.c_mutex.lock()
        return True

    def release(self):
        """Lets the lock go once."""
        self.c_mutex.unlock()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info):
        self.c_mutex.unlock()
        return False


cdef class FastServeLoop:
    """A C++ thread that reads a server's ROUTER socket and answers PULL_SPARSE and
    PUSH_SPARSE itself, forwarding every other message to a PAIR socket.

    See csrc/serve_loop.h for what it answers and `kvsparse.server.fastpath` for
    the Python side.

    Args:
        libzmq_path: the libzmq pyzmq loaded (a path from /proc/self/maps).
        router: the ROUTER socket's ``underlying`` pointer; forward: the PAIR's.
        lock: the `ShardLock` the server's Python thread holds while it serves.
        incarnation: stamped on every reply.
        buckets: the latency histogram's upper bounds, seconds.

    Raises:
        InvalidArgument: libzmq is not loaded at libzmq_path (or lacks a function).

    Threads: start() and stop() from the thread that owns the loop, not holding the
    lock; wake() from any thread; every other method only while holding the lock.
    """

    cdef _unique_ptr[CFastServeLoop] c_loop
    cdef ShardLock _lock
    cdef dict _tables  # table id -> Table: kept alive while the C++ loop points at them

    def __cinit__(self, str libzmq_path, size_t router, size_t forward, ShardLock lock,
                  uint32_t incarnation, buckets):
        cdef ZmqApi c_api
        cdef string c_error
        cdef vector[double] c_buckets = [float(bound) for bound in buckets]
        if not LoadZmqApi(libzmq_path.encode(), &c_api, &c_error):
            raise errors.InvalidArgument(c_error.decode("utf-8", "replace"))
        self._lock = lock
        self._tables = {}
        self.c_loop.reset(new CFastServeLoop(c_api, <void*>router, <void*>forward,
                                             lock.c_mutex, incarnation, c_buckets))

    def start(self):
        """Starts the thread."""
        _check(self.c_loop.get().Start())

    def stop(self):
        """Stops and joins the thread (without the GIL); idempotent."""
        with nogil:
            self.c_loop.get().Stop()

    def wake(self):
        """Makes the thread look at the socket again (after Python used it)."""
        self.c_loop.get().Wake()

    def set_job(self, bint configured, int64_t num_workers, bint pulls, bint pushes):
        """The job's configuration: which ops the thread may answer."""
        self.c_loop.get().SetJob(configured, num_workers, pulls, pushes)

    def set_limits(self, int64_t max_rows, int64_t max_reply_bytes, int64_t max_unread,
                   int64_t track_bytes):
        """max_rows_per_request, max_reply_bytes, max_unread_reply_bytes, and the reply
        budget's TRACK_BYTES."""
        self.c_loop.get().SetLimits(max_rows, max_reply_bytes, max_unread, track_bytes)

    def unread(self, bytes routing):
        """Bytes of the thread's replies to routing that ZeroMQ still holds."""
        return self.c_loop.get().Unread(routing)

    def set_tables(self, tables):
        """tables: [(table_id, Table, skip_nonfinite)], every table the thread may serve."""
        cdef Table table
        kept = {}
        self.c_loop.get().ClearTables()
        for table_id, table, skip in tables:
            kept[int(table_id)] = table
            self.c_loop.get().AddTable(<uint64_t>table_id, table._table(), bool(skip))
        self._tables = kept

    def set_client(self, uint64_t client_id, bytes routing, uint64_t last_request_id,
                   uintptr_t shared_address=0, int64_t shared_bytes=0):
        """A client whose HELLO was accepted; False if the thread keeps too many.

        shared_address, shared_bytes: its shared segment as mapped here (0: none); the
        caller keeps the mapping until the next set_client or remove_client of it.
        """
        return self.c_loop.get().SetClient(client_id, routing, last_request_id,
                                           shared_address, shared_bytes)

    def remove_client(self, uint64_t client_id):
        self.c_loop.get().RemoveClient(client_id)

    def set_budget_held(self, bytes routing, bint held):
        self.c_loop.get().SetBudgetHeld(routing, held)

    def mark_handled(self):
        """Python handled the oldest forwarded message it had not handled."""
        self.c_loop.get().MarkHandled()

    def drain(self):
        """What the thread did since the last drain, or None.

        Returns (clients, clocks, tables, requests, latency, latency_sum, keys,
        newest_push, errors): clients [(client_id, request_id, is_push, last_push,
        pushes, reply header bytes, error message)], clocks [(rank, clock)], tables
        [(op index, table_id, requests, keys)], then per op index (0 pull_sparse, 1
        push_sparse) requests, latency bucket counts and seconds.
        """
        cdef FastDrain c_drain
        if not self.c_loop.get().Drain(&c_drain):
            return None
        clients = [
            (r.client_id, r.request_id, r.is_push, r.last_push, r.pushes,
             (<char*>r.reply)[:56], r.error.decode("utf-8", "replace"))
            for r in c_drain.clients
        ]
        tables = [(t.op, t.table_id, t.requests, t.keys) for t in c_drain.tables]
        return (
            clients,
            list(c_drain.clocks),
            tables,
            (c_drain.requests[0], c_drain.requests[1]),
            (list(c_drain.latency[0]), list(c_drain.latency[1])),
            (c_drain.latency_sum[0], c_drain.latency_sum[1]),
            c_drain.keys,
            c_drain.newest_push,
            c_drain.errors,
        )

    @property
    def clients(self):
        """The number of clients registered."""
        return self.c_loop.get().clients()


from wire_constants cimport kWireConstantCount, kWireConstants, kWireMagic, kWireMagicSize


def wire_constants():
    """The wire constants compiled into the C++ fast path, by their Python names.

    Returns a dict: ``"MAGIC"`` (bytes) and every integer of csrc/wire_constants.h
    (``"HEADER_SIZE"``, ``"Op.PULL_SPARSE"``, ``"FLAG_SHARED"``, ``"HEADER.op.offset"``...),
    as `kvsparse.wire.generate_cpp.constants` names them. tests/test_wire_constants.py
    compares it with `kvsparse.wire.protocol`. Thread-safe (reads constants).

    Example:
        >>> wire_constants()["HEADER_SIZE"]
        56
    """
    cdef int c_index
    values = {"MAGIC": kWireMagic[:kWireMagicSize]}
    for c_index in range(kWireConstantCount):
        values[kWireConstants[c_index].name.decode("ascii")] = kWireConstants[c_index].value
    return values
