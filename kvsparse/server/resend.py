"""Duplicate-request detection: each client's last request id and, for a change, its reply.

A worker that times out (or loses its connection) sends the same request
again, with the same client id and request id. `ResendCache.admit` tells the
server what to do with each request: run it, let the first copy's reply go
to the new sender, send the kept reply again, or refuse a request older
than the last one. Ops that change a shard keep their reply, so a resent push
is never applied twice (the idea of ps-lite's ``src/resender.h``).

Example:
    >>> cache = ResendCache(max_clients=2)
    >>> cache.admit(client_id=7, request_id=1, is_push=True)
    (<Verdict.NEW: 'new'>, None)
    >>> cache.track(7, 1, "the request")
    >>> cache.admit(7, 1, is_push=True)
    (<Verdict.WAITING: 'waiting'>, 'the request')
    >>> cache.complete(7, 1, ["reply frame"])
    >>> cache.admit(7, 1, is_push=True)
    (<Verdict.REPLAY: 'replay'>, ['reply frame'])
    >>> cache.admit(7, 0, is_push=False)
    (<Verdict.STALE: 'stale'>, 1)
"""

from __future__ import annotations

import collections
import enum

# How many clients' resend records a server keeps: a flood of headers with
# made-up client ids cannot grow the server past this (the least recently
# seen idle record goes first).
DEFAULT_MAX_CLIENTS = 4096


class Verdict(enum.Enum):
    """What `ResendCache.admit` says to do with a request."""

    NEW = "new"  # run it
    WAITING = "waiting"  # the first copy is still waiting: its reply goes to the new sender
    REPLAY = "replay"  # answered already: send the kept reply again
    STALE = "stale"  # older than the client's last request: refuse it


class _ClientRecord:
    __slots__ = ("request_id", "pending", "reply", "last_push")

    def __init__(self):
        self.request_id = -1
        self.pending = None
        self.reply = None
        self.last_push = -1  # request id of the last push run: counts duplicates in stats


class ResendCache:
    """Per-client resend records, at most max_clients of them (least recently seen idle first out).

    A record whose request is still waiting is never evicted: its reply must
    still reach the client.

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(self, max_clients: int = DEFAULT_MAX_CLIENTS):
        self.max_clients = int(max_clients)
        self._records: collections.OrderedDict[int, _ClientRecord] = collections.OrderedDict()
        # Push requests run, and those a client had sent before (never expected: admit stops them).
        self.pushes = 0
        self.duplicate_pushes = 0

    def __len__(self) -> int:
        """The number of clients with a record."""
        return len(self._records)

    def last_request_id(self, client_id: int) -> int:
        """The last request id recorded for client_id (0: none); a PING's answer.

        A client waiting for a later one learns that its request never
        arrived (dropped for its size, or lost with a broken connection)
        instead of waiting forever. Does not count as seeing the client.
        """
        record = self._records.get(client_id)
        return max(record.request_id, 0) if record is not None else 0

    def admit(self, client_id: int, request_id: int, *, is_push: bool) -> tuple[Verdict, object]:
        """What to do with a request, and what goes with the verdict.

        Returns (NEW, None), (WAITING, the request given to track()),
        (REPLAY, the kept reply frames) or (STALE, the client's last request
        id). A NEW request becomes the client's last one; track() it next.
        A read-only request resent after its answer is NEW again: running it
        twice is harmless.
        """
        record = self._records.get(client_id)
        if record is None:
            record = self._new_record(client_id)
        else:
            self._records.move_to_end(client_id)
        if request_id == record.request_id:
            if record.pending is not None:
                return Verdict.WAITING, record.pending
            if record.reply is not None:
                return Verdict.REPLAY, record.reply
        elif request_id < record.request_id:
            return Verdict.STALE, record.request_id
        record.request_id = request_id
        record.reply = None
        if is_push:
            self.pushes += 1
            if request_id <= record.last_push:
                self.duplicate_pushes += 1
            record.last_push = request_id
        return Verdict.NEW, None

    def track(self, client_id: int, request_id: int, pending) -> None:
        """Notes that the client's request (just admitted as NEW) waits for its reply."""
        record = self._records.get(client_id)
        if record is not None and record.request_id == request_id:
            record.pending = pending

    def complete(self, client_id: int, request_id: int, reply: list | None) -> None:
        """Notes that the request was answered; reply: the frames to resend (None: run again)."""
        record = self._records.get(client_id)
        if record is not None and record.request_id == request_id:
            record.pending = None
            if reply is not None:
                record.reply = reply

    def record_answered(
        self, client_id: int, request_id: int, reply: list | None, last_push: int, pushes: int
    ) -> None:
        """Notes requests answered elsewhere (the C++ fast path, `kvsparse.server.fastpath`).

        request_id: the client's latest one, newer than any this cache holds for
        it (admitted NEW and completed with reply, as `admit` and `complete`
        would have); last_push: the request id of its latest push among them
        (-1: none); pushes: how many pushes they were.
        """
        record = self._records.get(client_id)
        if record is None:
            record = self._new_record(client_id)
        else:
            self._records.move_to_end(client_id)
        record.request_id = int(request_id)
        record.pending = None
        record.reply = reply
        if last_push >= 0:
            record.last_push = int(last_push)
        self.pushes += pushes

    def answered(self) -> list[tuple[int, int, int, list]]:
        """(client_id, request_id, last_push, reply frames) of every record with a kept reply.

        What a checkpoint keeps (`kvsparse.server.restart`): a request answered
        before the snapshot is not run again by a server restored from it.
        Requests still waiting have no reply yet and are left out.
        """
        return [
            (client_id, record.request_id, record.last_push, record.reply)
            for client_id, record in self._records.items()
            if record.pending is None and record.reply is not None
        ]

    def restore(self, records) -> None:
        """Takes records of `answered`'s form (a restored checkpoint's) as answered requests.

        A record this cache holds for a later request of the client is kept.
        """
        for client_id, request_id, last_push, reply in records:
            record = self._records.get(client_id)
            if record is not None and record.request_id >= request_id:
                continue
            record = record if record is not None else self._new_record(client_id)
            record.request_id = int(request_id)
            record.last_push = int(last_push)
            record.pending = None
            record.reply = list(reply)

    def _new_record(self, client_id: int) -> _ClientRecord:
        if len(self._records) >= self.max_clients:
            for old_id, old in self._records.items():
                if old.pending is None:  # a request still waiting keeps its record
                    del self._records[old_id]
                    break
        record = self._records[client_id] = _ClientRecord()
        return record
