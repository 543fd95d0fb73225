"""Errors raised by kvsparse.

Every class inherits from ``KVSparseError`` and from the builtin a user would
catch for the same mistake, so ``except KeyError`` and ``except
kvsparse.errors.KVSparseError`` both work (pyarrow's pattern).

Example:
    >>> import kvsparse
    >>> kv = kvsparse.create('local')
    >>> try:
    ...     kv.pull('missing')
    ... except KeyError as e:
    ...     print(type(e).__name__)
    UnknownKey
"""


class KVSparseError(Exception):
    """Base class of every kvsparse error."""


class InvalidArgument(KVSparseError, ValueError):
    """A value that kvsparse cannot accept (bad dim, bad optimizer setting...)."""


class ShapeError(InvalidArgument):
    """An array whose shape does not match the key it is used with."""


class DTypeError(KVSparseError, TypeError):
    """An array of a dtype kvsparse does not accept here (e.g. float ids)."""


class KeyTypeError(KVSparseError, TypeError):
    """A key of the wrong type, or int and str keys mixed in one store."""


class UnknownKey(KVSparseError, KeyError):
    """A key that was never initialized."""

    def __str__(self):  # KeyError quotes its message; show it plainly.
        return str(self.args[0]) if self.args else ""


class DuplicateKey(KVSparseError, ValueError):
    """A key initialized twice."""


class NonFiniteGradient(InvalidArgument):
    """A pushed gradient holding NaN or inf (rejected unless skipping is asked for)."""


class CheckpointError(InvalidArgument):
    """A checkpoint that cannot be read or written: missing, truncated, corrupt, of an
    unknown version, or a path the server may not use (outside its --checkpoint-root)."""


class LimitExceeded(InvalidArgument):
    """A request beyond a server's limits (`kvsparse.config.ServerLimits`); the message
    names the limit and the ``kvsparse server`` flag that sets it."""


class UpdateOverflow(InvalidArgument, FloatingPointError):
    """A push of finite gradients whose optimizer update would make a row inf or NaN.

    Nothing of the push is applied (with ``nonfinite='skip'`` only the rows
    that would overflow are left untouched). Also a ``FloatingPointError``.
    """


class CapacityError(KVSparseError, MemoryError):
    """A shard reached the most rows it can hold, or a server ran out of memory.

    Also a ``MemoryError``: a request that ran out of memory on a server
    reaches the worker as this class, and changes nothing there.
    """


class ProtocolError(KVSparseError, ValueError):
    """A malformed wire message."""


class SharedMemoryMissing(ProtocolError):
    """Rows named in a worker's shared memory, at a server that does not hold it.

    A server restarted since the worker's HELLO: the worker greets it again
    (which maps the segment) and resends the request, nothing of it applied;
    raised only if the server still does not take the segment then.
    """


class MissingDependency(KVSparseError, ImportError):
    """A feature needs an optional package that is not installed.

    The message names the feature and says in one line what to install
    (``pip install 'kvsparse[serve]'``; `kvsparse.extras`).
    """


class ServerError(KVSparseError, RuntimeError):
    """A server answered a request with an error it could not classify."""


class ServerUnavailable(KVSparseError, ConnectionError):
    """A server did not answer within the configured time."""

    def __init__(self, message, address=None):
        super().__init__(message)
        self.address = address


class ForkedStore(KVSparseError, RuntimeError):
    """A call a dist store cannot make in a process forked from the one that opened it.

    After ``fork`` (a data-loader worker, ``os.fork()``) a dist store opens
    its own connections in the child and serves lookups there (pulls,
    ``stats``); what would change the job (pushes, ``barrier``, ``init``,
    ``set_optimizer``, checkpoints) raises this at once: the parent is that
    worker. Create a store in the child to train from it. Also a
    ``RuntimeError``.
    """


class WaitTimeout(KVSparseError, TimeoutError):
    """A request a live server held too long: a BSP push waiting for its round, a
    barrier, an SSP pull or a follower's set_optimizer waiting for other workers.

    The server answered liveness pings all along; what it waited for is
    named in the message. Held requests wait at most
    `kvsparse.client.session.HOLD_FACTOR` x the store's timeout (600 s by
    default). Also a ``TimeoutError``.
    """


class WorkerLeft(ServerUnavailable):
    """A worker that this call waits for left the job.

    Raised by a BSP push, a barrier, an SSP pull, a follower's set_optimizer
    or dense init that waits for a worker whose connection to a server
    closed (it exited, was killed, or stopped answering heartbeats) without
    coming back. The message names the rank. A ServerUnavailable (and so a
    ConnectionError): the job can no longer go on as configured.

    Attributes:
        ranks: the ranks that left, where known (None in a worker, which
            gets the error from a server's reply: the message names them).
    """

    def __init__(self, message, address=None, ranks=None):
        super().__init__(message, address)
        self.ranks = ranks


class NodeUnavailable(KVSparseError, ConnectionError):
    """A host of a multi-host job is missing: its launcher never joined, or left.

    Raised by ``kvsparse launch --nnodes N`` (`kvsparse.cluster.rendezvous`)
    when a launcher did not reach the rendezvous within the wait, or when
    the rendezvous itself cannot be reached. The message names the node ranks.

    Attributes:
        node_ranks: the node ranks that are missing, where known (else None).
    """

    def __init__(self, message, node_ranks=None):
        super().__init__(message)
        self.node_ranks = node_ranks


class StorageError(KVSparseError, OSError):
    """A disk tier's file could not be read or written (an I/O error of the engine)."""


class DiskFull(StorageError):
    """The disk (or the file size limit) ran out while writing rows to the disk tier.

    Nothing of the batch being written is applied: the store serves what it
    served before and the caller still holds the rows.
    """


class CorruptRecord(StorageError):
    """A record on disk whose checksum or key does not match; the message names the
    file, the offset and the key. The record is never served."""
