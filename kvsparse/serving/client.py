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
from typing import Optional

import numpy as np

from kvsparse import _core, errors
from kvsparse.client.exchange import collect_replies, send_request
from kvsparse.client.sockets import ServerSockets
from kvsparse.wire import ops
from kvsparse.wire.protocol import Header

DEFAULT_TIMEOUT = 10.0


class Client:
    """Lookups from one or more serving replicas.

    Args:
        addresses: the replicas' ZeroMQ addresses (a list, or one comma-separated str).
        timeout: seconds to wait for an answer.
        keys: a ``kvsparse keys`` directory, for replicas started with
            ``kvsparse serve --keys`` (CurveZMQ); None: no encryption.

    Raises (lookup):
        UnknownKey: no replica serves the table. ServerUnavailable: a replica
        did not answer in time, or refused the security handshake (keys missing
        or not accepted), named at once. Errors a replica answers (KeyTypeError,
        LimitExceeded, ...) are raised as their kvsparse.errors class.
    """

    def __init__(self, addresses, timeout: float = DEFAULT_TIMEOUT, keys=None):
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        self.addresses = [os.fspath(a) for a in addresses]
        if not self.addresses:
            raise errors.InvalidArgument("Client needs at least one replica address")
        self.timeout = float(timeout)
        self.keys = None if keys is None else os.fspath(keys)
        if self.keys is not None:
            from kvsparse.wire import security

            security.check_keys(self.keys)
        self._client_id = secrets.randbits(63)
        # The training client's sockets: CurveZMQ, and refused handshakes named at once.
        self._links = ServerSockets(self.addresses, self.keys, self._client_id)
        self._request_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._statuses: Optional[list] = None
        self._turn = itertools.count()
        self.last_versions: dict = {}  # {address: checkpoint seq of the last answer}

    # -- exchange ---------------------------------------------------------------------------

    def _exchange(self, requests: dict) -> dict:
        """{replica index: ops.Request} -> {replica index: (header, payload)}; raises errors."""
        sent = {}
        for index, request in requests.items():
            header = Header(
                op=request.op,
                flags=request.flags,
                request_id=next(self._request_ids),
                client_id=self._client_id,
                num_items=request.num_items,
                num_frames=len(request.frames),
            )
            sent[index] = send_request(self._links, index, header, request.frames)
        return collect_replies(self._links, sent, self.timeout, "serving replica")

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
        """Closes the sockets (idempotent)."""
        with self._lock:
            self._links.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


__all__ = ["Client"]
