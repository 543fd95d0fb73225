"""What one peer may make a server do: `ServerLimits`, and reading them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from kvsparse.config.names import (
    CHECKPOINT_ROOT,
    MAX_DIM,
    MAX_REPLY_BYTES,
    MAX_ROWS_PER_REQUEST,
    MAX_TABLES,
    MAX_UNREAD_REPLY_BYTES,
)
from kvsparse.config.values import _check_int, _get, _parse_int, parse_bytes
from kvsparse.errors import InvalidArgument


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may make a server do: bounds on memory per request and per connection.

    A server checks each request against them before doing any work, and
    refuses one that exceeds a limit with `kvsparse.errors.LimitExceeded`
    naming the limit and the ``kvsparse server`` flag that raises it; the
    server goes on serving. The defaults fit training jobs (a step's pull is
    far below them) while keeping a careless or hostile peer from making a
    server allocate gigabytes (two pulls of 200,000 ids of a
    4096-wide table once grew a server from 44 MiB to 6.3 GiB).

    Attributes:
        max_reply_bytes: the largest reply one request may ask for (a pull of
            n ids of a table of dim d is n * d * 4 bytes; known, and refused,
            before any row is made). Default 1 GiB, the default
            ``--max-message-size``: a bigger reply could not be received anyway.
        max_unread_reply_bytes: replies one connection may leave unread in the
            server (sent but not yet taken by the peer's socket); a pull that
            would go past it is refused until the peer reads. At least
            max_reply_bytes. Default 2 GiB: a worker that reads each reply
            before its next request never comes near it.
        max_tables: sparse tables and dense keys one server holds (each costs
            memory even when empty). Default 1024.
        max_dim: the widest sparse table a peer may create, <= 4096. Default 4096.
        max_rows_per_request: ids in one pull or push, summed over its tables.
            Default 16,777,216.
        checkpoint_root: the directory every CHECKPOINT path (save, load,
            export) must lie in, after following symlinks; a relative path is
            taken inside it. None: no root (see `kvsparse.server.paths`).

    Raises:
        InvalidArgument: a limit that is not an int >= 1, max_dim above 4096,
            max_unread_reply_bytes below max_reply_bytes, or a relative or
            empty checkpoint_root.

    Immutable (frozen): safe to share between threads.

    Example:
        >>> ServerLimits(max_reply_bytes=1 << 20, max_unread_reply_bytes=4 << 20).max_tables
        1024
    """

    max_reply_bytes: int = 1 << 30
    max_unread_reply_bytes: int = 2 << 30
    max_tables: int = 1024
    max_dim: int = 4096  # kvsparse.table.MAX_DIM (tests/test_limits.py checks they agree)
    max_rows_per_request: int = 1 << 24
    checkpoint_root: Optional[str] = None

    def __post_init__(self):
        for name in (
            "max_reply_bytes",
            "max_unread_reply_bytes",
            "max_tables",
            "max_dim",
            "max_rows_per_request",
        ):
            value = _check_int(getattr(self, name), name)
            if value < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {value}")
            object.__setattr__(self, name, value)
        if self.max_dim > 4096:
            raise InvalidArgument(f"max_dim must be <= 4096 (the widest table), got {self.max_dim}")
        if self.max_unread_reply_bytes < self.max_reply_bytes:
            raise InvalidArgument(
                f"max_unread_reply_bytes ({self.max_unread_reply_bytes}) must be >= "
                f"max_reply_bytes ({self.max_reply_bytes}): a reply allowed alone must fit"
            )
        root = self.checkpoint_root
        if root is not None:
            if not isinstance(root, str) or not root.strip() or not os.path.isabs(root):
                raise InvalidArgument(f"checkpoint_root must be an absolute path, got {root!r}")
            object.__setattr__(self, "checkpoint_root", os.path.normpath(root))


def server_limits(environ: Optional[Mapping] = None, **given) -> ServerLimits:
    """A server's `ServerLimits`: each from `given` (the command line), else the environment.

    Variables: ``KVSPARSE_MAX_REPLY_BYTES``, ``KVSPARSE_MAX_UNREAD_REPLY_BYTES``
    (byte counts such as ``512MiB``), ``KVSPARSE_MAX_TABLES``, ``KVSPARSE_MAX_DIM``,
    ``KVSPARSE_MAX_ROWS_PER_REQUEST``, ``KVSPARSE_CHECKPOINT_ROOT``; unset ones
    keep the defaults. A relative root is taken from the current directory.

    Args:
        environ: the variables to read (default: ``os.environ``).
        given: `ServerLimits` fields; None counts as not given.

    Raises:
        InvalidArgument: a malformed value (the message names the variable).

    Thread-safe: it only reads the variables.

    Example:
        >>> server_limits({"KVSPARSE_MAX_REPLY_BYTES": "256MiB"}).max_reply_bytes
        268435456
    """
    env = os.environ if environ is None else environ

    def count(text: str, variable: str) -> int:
        return _parse_int(text, variable, 1)

    values = {}
    for name, variable, parse in (
        ("max_reply_bytes", MAX_REPLY_BYTES, parse_bytes),
        ("max_unread_reply_bytes", MAX_UNREAD_REPLY_BYTES, parse_bytes),
        ("max_tables", MAX_TABLES, count),
        ("max_dim", MAX_DIM, count),
        ("max_rows_per_request", MAX_ROWS_PER_REQUEST, count),
        ("checkpoint_root", CHECKPOINT_ROOT, lambda text, variable: text.strip()),
    ):
        if given.get(name) is not None:
            values[name] = given[name]
        elif _get(env, variable) is not None:
            values[name] = parse(env[variable], variable)
    unknown = set(given) - set(ServerLimits.__dataclass_fields__)
    if unknown:
        raise TypeError(f"server_limits() got unknown fields {sorted(unknown)}")
    if values.get("checkpoint_root") is not None:
        values["checkpoint_root"] = os.path.abspath(values["checkpoint_root"])
    return ServerLimits(**values)
