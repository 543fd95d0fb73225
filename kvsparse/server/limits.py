"""A server's limits on what one peer may make it do (`kvsparse.config.ServerLimits`).

A peer that created a 4096-wide table and sent two pulls of 200,000 ids
(1.6 MB each) without reading the replies grew a server from 44 MiB to
6.3 GiB; ``--max-message-size`` bounds what a peer sends, not what its
requests make the server build. Two objects close that:

- `RequestLimits` checks a request before any work: a pull whose reply
  (ids x row bytes, known from the table's dim) exceeds ``max_reply_bytes``,
  more ids than ``max_rows_per_request``, a new table past ``max_tables`` or
  wider than ``max_dim``, each refused with `kvsparse.errors.LimitExceeded`
  naming the limit and its flag.
- `ReplyBudget` counts, per connection, the bytes of replies that ZeroMQ
  still holds (sent by the server, not yet taken by the peer's socket), by
  tracking each large reply frame until ZeroMQ lets go of it; a pull that
  would take a connection past ``max_unread_reply_bytes`` is refused until the
  peer reads. Replies under `TRACK_BYTES` are not tracked (each costs little
  next to the request that asked for it).

Example:
    >>> budget = ReplyBudget(loop.send, ServerLimits())      # doctest: +SKIP
    >>> limits = RequestLimits(ServerLimits(), budget)        # doctest: +SKIP
    >>> limits.check_pull(routing, [(200_000, 4096 * 4)])     # doctest: +SKIP
    Traceback (most recent call last):
    LimitExceeded: ... --max-reply-bytes ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import zmq

from kvsparse import errors
from kvsparse.config import ServerLimits

# Frames at least this big are tracked. pyzmq sends them without a copy anyway (its
# copy threshold is 64 KiB), so tracking adds one event per frame, not a copy.
TRACK_BYTES = 1 << 16
# Every this many tracked sends, connections whose replies were all read are forgotten.
_SWEEP_EVERY = 256


def human_bytes(count: int) -> str:
    """A byte count for messages: 3435973836 -> '3.2 GiB'. Thread-safe."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _nbytes(frame) -> int:
    size = getattr(frame, "nbytes", None)
    return size if isinstance(size, int) else memoryview(frame).nbytes


class ReplyBudget:
    """Bytes of replies each connection has not taken yet, and the send that counts them.

    Args:
        send: ``send(routing, frames)`` of the event loop
            (`kvsparse.server.loop.EventLoop.send`).
        limits: the server's `ServerLimits` (``max_unread_reply_bytes``).
        on_held: see below (`kvsparse.server.fastpath`); None: nobody is told.
        also_unread: ``also_unread(routing)``, bytes of replies to routing that another
            sender (the fast path's thread) tracks; None: none.

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(
        self,
        send: Callable[[bytes, list], None],
        limits: ServerLimits,
        on_held: Callable[[bytes, bool], None] | None = None,
        also_unread: Callable[[bytes], int] | None = None,
    ):
        self._send = send
        # on_held(routing, True) once replies to routing are tracked, (routing, False) once
        # none is (the C++ fast path leaves that connection's pulls to this budget).
        self._on_held = on_held
        # also_unread(routing): unread bytes of replies sent by someone else (the fast path).
        self._also_unread = also_unread
        self._limit = limits.max_unread_reply_bytes
        # routing id -> [(tracker, bytes)] of its replies ZeroMQ still holds.
        self._held: dict[bytes, list] = {}
        self._tracked_sends = 0

    def send(self, routing: bytes, frames: list) -> None:
        """Sends frames to routing (as the loop's send), tracking the large ones."""
        frames = list(frames)
        tracked = []
        for index, frame in enumerate(frames):
            size = _nbytes(frame)
            if size >= TRACK_BYTES:
                frame = zmq.Frame(frame, track=True, copy=False)
                frames[index] = frame
                tracked.append((frame.tracker, size))
        if not tracked:
            self._send(routing, frames)
            return
        try:
            self._send(routing, frames)
        finally:
            # The Frame objects hold a reference to their message: dropped here, so that
            # the tracker is done once ZeroMQ has written the message (or dropped it).
            frames.clear()
        held = self._held.get(routing)
        if held is None:
            held = self._held[routing] = []
            if self._on_held is not None:
                self._on_held(routing, True)
        held.extend(tracked)
        self._tracked_sends += 1
        if self._tracked_sends % _SWEEP_EVERY == 0:
            for peer in list(self._held):
                self._own_unread(peer)

    def unread(self, routing: bytes) -> int:
        """Bytes of replies to routing that ZeroMQ still holds."""
        own = self._own_unread(routing)
        return own if self._also_unread is None else own + self._also_unread(routing)

    def _own_unread(self, routing: bytes) -> int:
        held = self._held.get(routing)
        if not held:
            return 0
        held[:] = [(tracker, size) for tracker, size in held if not tracker.done]
        if not held:
            del self._held[routing]
            if self._on_held is not None:
                self._on_held(routing, False)
            return 0
        return sum(size for _, size in held)

    def check(self, routing: bytes, reply_bytes: int) -> None:
        """Raises LimitExceeded if a reply of reply_bytes would take routing past its budget."""
        unread = self.unread(routing)
        if unread and unread + reply_bytes > self._limit:
            raise errors.LimitExceeded(
                f"this connection has {human_bytes(unread)} of replies it has not read yet; "
                f"with this reply ({human_bytes(reply_bytes)}) that would pass the server's "
                f"limit of {human_bytes(self._limit)} per connection (kvsparse server "
                "--max-unread-reply-bytes): read the replies before sending more requests"
            )


class RequestLimits:
    """Checks a request against the server's `ServerLimits` before any work is done.

    Args:
        limits: the server's `ServerLimits`.
        budget: its `ReplyBudget` (None: unread replies are not counted).

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(self, limits: ServerLimits | None = None, budget: ReplyBudget | None = None):
        self.limits = limits if limits is not None else ServerLimits()
        self._budget = budget

    def check_rows(self, rows: int, what: str) -> None:
        """Raises LimitExceeded for a request of more ids than max_rows_per_request."""
        limit = self.limits.max_rows_per_request
        if rows > limit:
            raise errors.LimitExceeded(
                f"{what} of {rows:,} ids exceeds the server's limit of {limit:,} ids per "
                "request (kvsparse server --max-rows-per-request); split it into smaller batches"
            )

    def check_reply(
        self, routing: bytes, reply_bytes: int, what: str, hint: str = "pull fewer ids per call"
    ) -> None:
        """Raises LimitExceeded for a reply over max_reply_bytes or over routing's budget."""
        limit = self.limits.max_reply_bytes
        if reply_bytes > limit:
            raise errors.LimitExceeded(
                f"{what} needs a reply of {human_bytes(reply_bytes)}, more than the server's "
                f"limit of {human_bytes(limit)} per reply (kvsparse server --max-reply-bytes); "
                f"{hint}"
            )
        if self._budget is not None:
            self._budget.check(routing, reply_bytes)

    def check_pull(self, routing: bytes, parts: Iterable[tuple[int, int]]) -> None:
        """Checks a sparse pull given (number of ids, bytes of one reply row) per table.

        The row bytes come from the table's dim and the reply's element size, so a
        narrower wire dtype is counted as it is sent.
        """
        parts = list(parts)
        rows = sum(count for count, _ in parts)
        self.check_rows(rows, "a pull")
        reply_bytes = sum(count * row_bytes for count, row_bytes in parts)
        self.check_reply(routing, reply_bytes, f"a pull of {rows:,} ids")

    def check_new_table(self, existing: int, name: str, dim: int | None = None) -> None:
        """Raises LimitExceeded if a table named name may not be added to `existing` ones."""
        limit = self.limits.max_tables
        if existing >= limit:
            raise errors.LimitExceeded(
                f"key {name!r}: the server already holds {existing} tables and dense keys, its "
                f"limit (kvsparse server --max-tables {limit})"
            )
        if dim is not None and dim > self.limits.max_dim:
            raise errors.LimitExceeded(
                f"key {name!r}: dim {dim} is wider than the server's limit of "
                f"{self.limits.max_dim} (kvsparse server --max-dim)"
            )


__all__ = ["TRACK_BYTES", "ReplyBudget", "RequestLimits", "human_bytes"]
