"""`Client`: lookups from serving replicas (`kvsparse serve`) over ZeroMQ.

A client is given every replica's address. It asks each one what it
serves (SERVING_STATUS: its tables and its ``--shard I/N``), then sends
each lookup to replicas that hold the table: to one that holds every id of
it when there is one (taking turns among them), else split by
`kvsparse._core.shard_of` to one replica per shard, in parallel, and
gathered back into the ids' order.

Threads: a Client may be shared; its calls are serialized by a lock (one
request in flight per client). For parallel lookups, give each thread its
own Client.

Example:
    >>> client = Client(["tcp://127.0.0.1:7100"])           # doctest: +SKIP
    >>> client.lookup("user", [[1, 2], [3, 4]]).shape        # doctest: +SKIP
    (2, 2, 16)
    >>> client.close()                                       # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from typing import Optional

import numpy as np
import zmq

from kvsparse import _core, errors
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Header

DEFAULT_TIMEOUT = 10.0


class Client:
    """Lookups from one or more serving replicas.

    Args:
        addresses: the replicas' ZeroMQ addresses (a list, or one comma-separated str).
        timeout: seconds to wait for an answer.

    Raises (lookup):
        UnknownKey: no replica serves the table. ServerUnavailable: a replica
        did not answer in time. Errors a replica answers (KeyTypeError,
        LimitExceeded, ...) are raised as their kvsparse.errors class.
    """

    def __init__(self, addresses, timeout: float = DEFAULT_TIMEOUT):
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        self.addresses = [os.fspath(a) for a in addresses]
        if not self.addresses:
            raise errors.InvalidArgument("Client needs at least one replica address")
        self.timeout = float(timeout)
        self._context = zmq.Context()
        self._sockets: list = [None] * len(self.addresses)
        self._client_id = secrets.randbits(63)
        self._request_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._statuses: Optional[list] = None
        self._turn = itertools.count()
        self.last_versions: dict = {}  # {address: checkpoint seq of the last answer}

    # -- sockets and exchange ---------------------------------------------------------------

    def _socket(self, index: int):
        if self._sockets[index] is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.addresses[index])
            self._sockets[index] = socket
        return self._sockets[index]

    def _exchange(self, requests: dict) -> dict:
        """{replica index: ops.Request} -> {replica index: (header, payload)}; raises errors."""
        sent = {}
        for index, request in requests.items():
            request_id = next(self._request_ids)
            header = Header(
                op=request.op,
                flags=request.flags,
                request_id=request_id,
                client_id=self._client_id,
                num_items=request.num_items,
                num_frames=len(request.frames),
            )
            self._socket(index).send_multipart([header.pack(), *request.frames], copy=False)
            sent[index] = request_id
        poller = zmq.Poller()
        for index in sent:
            poller.register(self._socket(index), zmq.POLLIN)
        answers: dict = {}
        deadline = time.monotonic() + self.timeout
        while len(answers) < len(sent):
            remaining = deadline - time.monotonic()
            events = dict(poller.poll(max(0, remaining) * 1000)) if remaining > 0 else {}
            if not events:
                missing = [i for i in sent if i not in answers]
                for index in missing:  # a late answer must not be taken for the next one's
                    self._sockets[index].close(0)
                    self._sockets[index] = None
                shown = ", ".join(self.addresses[i] for i in missing)
                raise errors.ServerUnavailable(
                    f"serving replica {shown} did not answer within {self.timeout:g} s"
                )
            for index in sent:
                socket = self._sockets[index]
                if index in answers or socket not in events:
                    continue
                frames = socket.recv_multipart(copy=False)
                header, payload = protocol.parse_message(frames, reply=True)
                if header.request_id != sent[index]:
                    continue  # an answer to a request that timed out earlier
                answers[index] = (header, payload)
        for index, (header, payload) in answers.items():
            if header.status:
                protocol.raise_remote_error(header, payload, self.addresses[index])
        return answers

    # -- what the replicas serve ------------------------------------------------------------

    def status(self) -> list:
        """Every replica's status (`ServingServer.status`), in the order of addresses."""
        with self._lock:
            return self._fetch_statuses()

    def _fetch_statuses(self) -> list:
        request = ops.ServingStatus.encode_request()
        answers = self._exchange(dict.fromkeys(range(len(self.addresses)), request))
        statuses = [ops.ServingStatus.decode_reply(*answers[i]) for i in range(len(self.addresses))]
        self._statuses = statuses
        return statuses

    def refresh(self) -> None:
        """Asks the replicas again what they serve (after one changed its tables)."""
        with self._lock:
            self._fetch_statuses()

    def _route(self, table: str) -> tuple:
        """(replicas holding every id, {shard index: replicas}, shard count) for table."""
        if self._statuses is None:
            self._fetch_statuses()
        whole, by_shard, count = [], {}, None
        for index, status in enumerate(self._statuses):
            if table not in status.get("tables", {}):
                continue
            shard = (status.get("selection") or {}).get("shard")
            if shard is None:
                whole.append(index)
            else:
                if count is not None and shard[1] != count:
                    raise errors.InvalidArgument(
                        f"replicas of table {table!r} split it into {count} and {shard[1]} shards"
                    )
                count = shard[1]
                by_shard.setdefault(shard[0], []).append(index)
        if not whole and not by_shard:
            raise errors.UnknownKey(f"no serving replica among {self.addresses} serves {table!r}")
        if not whole and len(by_shard) != count:
            missing = sorted(set(range(count)) - set(by_shard))
            raise errors.ServerUnavailable(
                f"no replica serves shard(s) {missing} of {count} of table {table!r}"
            )
        return whole, by_shard, count

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, table, ids, default: str = "zeros") -> np.ndarray:
        """Rows of ids (any shape) in table: an array of shape ids.shape + (dim,), float32.

        Args:
            table: the table's name (str(key) of the training store's key).
            ids: integers, any shape.
            default: what an id the replicas do not hold gets: 'zeros' or
                'initializer' (the row training would give a new id).

        Raises:
            KeyTypeError: ids are not integers. InvalidArgument: a bad default.
            UnknownKey, ServerUnavailable, and what a replica answers.

        Example:
            >>> client.lookup("user", np.array([3, 7]), default="initializer")  # doctest: +SKIP
        """
        if default not in ops.LOOKUP_DEFAULTS:
            raise errors.InvalidArgument(
                f"default must be one of {ops.LOOKUP_DEFAULTS}, got {default!r}"
            )
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            if ids.size:
                raise errors.KeyTypeError(f"ids must be integers, got dtype {ids.dtype}")
            ids = ids.astype(np.int64)
        keys = np.ascontiguousarray(ids.reshape(-1), np.int64)
        table = str(table)
        with self._lock:
            whole, by_shard, count = self._route(table)
            turn = next(self._turn)
            if whole:
                index = whole[turn % len(whole)]
                request = ops.Lookup.encode_request(table, keys, ids.shape, default)
                header, payload = self._exchange({index: request})[index]
                rows, seq = ops.Lookup.decode_reply(header, payload, keys.size)
                self.last_versions[self.addresses[index]] = seq
                return rows.reshape(ids.shape + (rows.shape[1],))
            plan_keys, offsets, slot = _core.plan_batch(keys, count)
            requests, spans = {}, {}
            for shard in range(count):
                a, b = int(offsets[shard]), int(offsets[shard + 1])
                if a == b:
                    continue
                replicas = by_shard[shard]
                index = replicas[turn % len(replicas)]
                part = plan_keys[a:b]
                requests[index] = ops.Lookup.encode_request(table, part, part.shape, default)
                spans[index] = (a, b)
            answers = self._exchange(requests) if requests else {}
            dim = None
            parts = []
            for index, (a, b) in spans.items():
                rows, seq = ops.Lookup.decode_reply(*answers[index], b - a)
                self.last_versions[self.addresses[index]] = seq
                dim = rows.shape[1]
                parts.append((a, rows))
            if dim is None:  # no ids: ask one replica for the width
                index = by_shard[min(by_shard)][0]
                dim = int(self._statuses[index]["tables"][table]["dim"])
            unique_rows = np.empty((plan_keys.size, dim), np.float32)
            for a, rows in parts:
                unique_rows[a : a + rows.shape[0]] = rows
            return unique_rows[slot].reshape(ids.shape + (dim,))

    def close(self) -> None:
        """Closes the sockets."""
        with self._lock:
            for socket in self._sockets:
                if socket is not None:
                    socket.close(0)
            self._sockets = [None] * len(self.addresses)
            self._context.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


__all__ = ["Client"]
