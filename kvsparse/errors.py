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


class UpdateOverflow(InvalidArgument, FloatingPointError):
    """A push of finite gradients whose optimizer update would make a row inf or NaN.

    Nothing of the push is applied (with ``nonfinite='skip'`` only the rows
    that would overflow are left untouched). Also a ``FloatingPointError``.
    """


class CapacityError(KVSparseError, MemoryError):
    """A shard reached the most rows it can hold."""


class ProtocolError(KVSparseError, ValueError):
    """A malformed wire message."""


class ServerError(KVSparseError, RuntimeError):
    """A server answered a request with an error it could not classify."""


class ServerUnavailable(KVSparseError, ConnectionError):
    """A server did not answer within the configured time."""

    def __init__(self, message, address=None):
        super().__init__(message)
        self.address = address
