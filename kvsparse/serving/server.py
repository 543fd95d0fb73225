"""The serving replica: `ServingServer` answers lookups over ZeroMQ (and HTTP) from a ServingState.

ZeroMQ side: a ROUTER socket on the bind address and a few worker threads
behind it (a ROUTER-DEALER proxy over ``inproc://``); each worker decodes a
request (`kvsparse.wire.ops.Lookup`, `ServingStatus`, `Ping`), runs the lookup
(the C++ batch runs without the GIL, so the workers look up in parallel) and
replies. Requests need no HELLO: a replica keeps no client state. A malformed
or refused request gets an error reply in the wire's format (its kvsparse
error class crosses over) and the replica goes on serving.

`ServingServer` composes the pieces: the state (`kvsparse.serving.state`),
the follower (`kvsparse.serving.follow`, with ``follow``), the metrics, the
ZeroMQ workers and the HTTP app (`kvsparse.serving.http`, with ``http_port``).

Threads: `start` and `stop` from one thread; `lookup` and `status` from any.

Example:
    >>> server = ServingServer(ServingConfig("/ckpt", "tcp://127.0.0.1:0", follow=True))
    >>> server.start()                     # doctest: +SKIP
    >>> server.address                     # doctest: +SKIP
    'tcp://127.0.0.1:40123'
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import zmq

from kvsparse import errors, extras
from kvsparse.serving.follow import Follower
from kvsparse.serving.metrics import NoMetrics, ServingMetrics, freshness
from kvsparse.serving.state import (
    Selection,
    ServingState,
    is_export,
    read_checkpoint,
    read_export,
)
from kvsparse.shard.tier import ShardTier
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Op

log = logging.getLogger("kvsparse.serving")

DEFAULT_MAX_BATCH = 1 << 20  # ids in one lookup request
DEFAULT_WORKERS = 2
DEFAULT_APPLY_NICENESS = 10  # the follower's: lookups first
LISTENING_PREFIX = "kvsparse serve listening on "
HTTP_PREFIX = "kvsparse serve http on "


@dataclass(frozen=True)
class ServingConfig:
    """What `kvsparse serve` was asked to do. Immutable.

    path: a checkpoint directory, or an export directory (part-*.npz).
    bind: the ZeroMQ address (``tcp://host:0`` picks a free port).
    http_port: the HTTP port (0: a free one), or None for no HTTP.
    http_host: the HTTP interface (default: the bind address's host).
    follow: poll path and apply each new checkpoint.
    selection: the tables and shard served.
    poll_interval: seconds between polls.
    max_batch: ids allowed in one lookup.
    workers: ZeroMQ worker threads.
    apply_niceness: how much the follower's thread lowers its CPU priority
        (`kvsparse.serving.follow`; 0: not at all).
    keys: a ``kvsparse keys`` directory: ZeroMQ lookups then need CurveZMQ
        and a client key the directory holds, as the training servers do.
    memory_budget: bytes the served tables (both copies) may hold in memory
        (0: none); spill_dir: where rows beyond it go (the disk tier).
    """

    path: str
    bind: str
    http_port: Optional[int] = None
    http_host: Optional[str] = None
    follow: bool = False
    selection: Selection = Selection()
    poll_interval: float = 0.2
    max_batch: int = DEFAULT_MAX_BATCH
    workers: int = DEFAULT_WORKERS
    apply_niceness: int = DEFAULT_APPLY_NICENESS
    keys: Optional[str] = None
    memory_budget: int = 0
    spill_dir: Optional[str] = None


class ServingServer:
    """A read-only lookup server over a checkpoint (or export) directory.

    Raises (from `start`):
        CheckpointError / InvalidArgument: nothing to serve in path (without
            follow), or a corrupt checkpoint.
        zmq.ZMQError / OSError: an address cannot be bound.
    """

    def __init__(self, config: ServingConfig):
        self.config = config
        tier = None
        if config.memory_budget or config.spill_dir is not None:
            tier = ShardTier(config.memory_budget, config.spill_dir)
        self.state = ServingState(tier)
        if config.http_port is not None:
            # Both before anything loads or binds: the error is one line naming the extra.
            extras.require("aiohttp.web", "kvsparse serve --http-port")
            self.metrics = ServingMetrics(self.state)
        elif extras.available("prometheus_client"):
            self.metrics = ServingMetrics(self.state)
        else:
            self.metrics = NoMetrics()  # ZeroMQ lookups need no optional package
        self.follower: Optional[Follower] = None
        self.address: Optional[str] = None
        self.http_url: Optional[str] = None
        self._context = zmq.Context()
        self._threads: list[threading.Thread] = []
        self._control: Optional[zmq.Socket] = None
        self._http = None
        self._backend_address = f"inproc://kvsparse-serve-{id(self):x}"
        self._authenticator = None  # CurveZMQ's, with config.keys

    # -- starting and stopping --------------------------------------------------------------

    def start(self) -> None:
        """Loads what path holds, binds, and starts the workers (and the follower, HTTP)."""
        config = self.config
        export = is_export(config.path)
        if export and config.follow:
            raise errors.InvalidArgument(
                f"{config.path} is an export; --follow needs a checkpoint directory"
            )
        if export:
            self.state.apply(read_export(config.path, config.selection))
        elif config.follow:
            self.follower = Follower(
                config.path,
                self.state,
                config.selection,
                config.poll_interval,
                on_update=self.metrics.on_update,
                niceness=config.apply_niceness,
            )
            self.follower.poll_once()  # an empty directory is fine: served once one arrives
        else:
            update, _ = read_checkpoint(config.path, config.selection)
            self.state.apply(update)
        self._start_zmq()
        if config.http_port is not None:
            from kvsparse.serving.http import HttpServer

            host = config.http_host or _host_of(self.address)
            self._http = HttpServer(self, host, config.http_port)
            self.http_url = self._http.start()
        if self.follower is not None:
            self.follower.start()

    def _start_zmq(self) -> None:
        frontend = self._context.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.LINGER, 0)
        if self.config.keys is not None:
            from kvsparse.wire import security

            self._authenticator = security.secure_server_socket(
                frontend, self._context, self.config.keys
            )
        frontend.bind(self.config.bind)
        self.address = _resolved(frontend.getsockopt_string(zmq.LAST_ENDPOINT))
        backend = self._context.socket(zmq.DEALER)
        backend.setsockopt(zmq.LINGER, 0)
        backend.bind(self._backend_address)
        control = self._context.socket(zmq.PAIR)
        control.bind(self._backend_address + "-control")
        self._control = self._context.socket(zmq.PAIR)
        self._control.connect(self._backend_address + "-control")

        def proxy():
            try:
                zmq.proxy_steerable(frontend, backend, None, control)
            except zmq.ZMQError:
                pass
            finally:
                for socket in (frontend, backend, control):
                    socket.close(0)

        self._threads.append(threading.Thread(target=proxy, name="kvsparse-serve-proxy"))
        for index in range(max(1, self.config.workers)):
            worker = threading.Thread(target=self._worker, name=f"kvsparse-serve-{index}")
            self._threads.append(worker)
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def stop(self) -> None:
        """Stops the follower, HTTP, the workers and the proxy."""
        if self.follower is not None:
            self.follower.stop()
        if self._http is not None:
            self._http.stop()
        if self._control is not None:
            self._control.send(b"TERMINATE")
            self._control.close(0)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._context.term()  # the workers' recv raise ETERM and they leave
        for thread in self._threads:
            thread.join(5.0)

    # -- requests ---------------------------------------------------------------------------

    def lookup(self, table, ids, default: str, transport: str) -> tuple:
        """(rows, version) of a lookup request, counted in the metrics.

        Raises:
            LimitExceeded: more ids than max_batch. What ServingState.lookup raises.
        """
        started = time.perf_counter()
        size = int(np.size(ids))
        if size > self.config.max_batch:
            raise errors.LimitExceeded(
                f"a lookup of {size} ids exceeds this replica's limit of "
                f"{self.config.max_batch} (kvsparse serve --max-batch)"
            )
        rows, version = self.state.lookup(table, ids, default)
        self.metrics.looked_up(transport, size, time.perf_counter() - started)
        return rows, version

    def status(self) -> dict:
        """The replica's tables, version, freshness, selection and last error."""
        error = None if self.follower is None else self.follower.last_error
        described = self.state.describe()
        version = described["version"]
        if error is not None and version is not None and version.get("seq", -1) >= error["seq"]:
            # Refused, then served by a later checkpoint: the follower clears the error
            # just after the new state shows; read in between, it is already stale.
            error = None
        fresh = freshness(version)
        return {
            "status": "empty" if version is None else ("degraded" if error else "ok"),
            "path": os.path.abspath(self.config.path),
            "follow": self.config.follow,
            "version": version,
            "freshness_seconds": None if fresh != fresh else fresh,
            "tables": described["tables"],
            "selection": self.config.selection.describe(),
            "last_error": error,
            "address": self.address,
            "http": self.http_url,
        }

    def _worker(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self._backend_address)
            while True:
                frames = socket.recv_multipart(copy=False)
                socket.send_multipart([frames[0], *self._answer(frames[1:])], copy=False)
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(0)

    def _answer(self, frames: list) -> list:
        """The reply frames to one request (an error reply for anything refused)."""
        header = None
        try:
            header, payload = protocol.parse_message(frames)
            return self._handle(header, payload)
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            if header is None:
                header = protocol.peek_header(frames[0]) if frames else None
            if header is not None and header.op == Op.LOOKUP:
                self.metrics.refused("zmq", exc)
            if not isinstance(exc, errors.KVSparseError):
                log.exception("lookup request failed")
            return protocol.error_reply(header, exc)

    def _handle(self, header: protocol.Header, payload) -> list:
        if header.op == Op.LOOKUP:
            request = ops.Lookup.decode_request(header, payload)
            rows, version = self.lookup(request.table, request.keys, request.default, "zmq")
            seq = None if version is None else version.get("seq")
            reply = ops.Lookup.encode_reply(rows.reshape(-1, rows.shape[-1]), seq)
        elif header.op == Op.SERVING_STATUS:
            ops.ServingStatus.decode_request(header, payload)
            reply = ops.ServingStatus.encode_reply(self.status())
        elif header.op == Op.PING:
            reply = ops.Ping.encode_reply(0)
        else:
            raise errors.ProtocolError(
                f"op {Op(header.op).name} is a training server's; a serving replica answers "
                "LOOKUP, SERVING_STATUS and PING"
            )
        head = header.reply(num_frames=len(reply.frames), num_items=reply.num_items)
        return [head.pack(), *reply.frames]


def _resolved(endpoint: str) -> str:
    """tcp://0.0.0.0:P as bound -> tcp://127.0.0.1:P, a connectable address."""
    return endpoint.replace("://0.0.0.0:", "://127.0.0.1:")


def _host_of(address: str) -> str:
    if address.startswith("tcp://"):
        return address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


__all__ = ["HTTP_PREFIX", "LISTENING_PREFIX", "ServingConfig", "ServingServer"]
