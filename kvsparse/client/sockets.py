"""The sockets of a client session: one ZeroMQ DEALER per server, and what they report.

`ServerSockets` opens, replaces and closes them, names each socket to its
server (so that a server can tell a worker that left from one whose
connection was re-made, `kvsparse.server.liveness`), and reads the socket
monitors: a refused security handshake (CurveZMQ) and a refused or
unresolvable address become `ServerUnavailable` errors naming the address.
`kvsparse.client.session.Session` holds one and is the only user.
"""

from __future__ import annotations

import itertools
import socket
from typing import Optional

import zmq

from kvsparse import errors

# Frames below this size are copied into the message, larger ones are sent from their own
# memory. pyzmq's zero-copy send hands the buffer's release to its garbage-collector
# thread: measured here (send + receive on loopback, process CPU per message), copying
# is cheaper up to ~256 KiB (64 KiB: 115 vs 143 us; 128 KiB: 134 vs 168 us), zero-copy
# from ~512 KiB (1 MiB: 412 vs 340 us). pyzmq's default threshold is 64 KiB. (A
# MovieLens step pushes ~100 KB per server.)
COPY_THRESHOLD = 256 * 1024

_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
# Connections in a row that the peer closed during the handshake before that is the
# failure of the address: a server shutting down closes at most the one in progress
# (then it refuses connections); ZeroMQ reconnects every ~0.1-0.2 s.
EARLY_CLOSES = 3
# What the socket monitor reports: refused handshakes, and each connection attempt:
# CONNECT_DELAYED or CLOSED when a connect was tried (none when the host name did not
# resolve), CONNECTED when it got through (a refused handshake comes after), and
# CONNECT_RETRIED when it is over; HANDSHAKE_SUCCEEDED when a connection works.
# A connection closed between CONNECTED and HANDSHAKE_SUCCEEDED was dropped by the peer
# during the handshake: a CurveZMQ server closes a client without keys (or a plain
# server one with keys) as soon as it reads the client's greeting, and then the client
# sees only the close, no HANDSHAKE_FAILED event (it reports one only when it read the
# server's greeting first: a race, lost about one time in four here).
_MONITORED = (
    _HANDSHAKE_FAILED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


class ServerSockets:
    """One ZeroMQ DEALER socket per server, each watched for a refused security handshake.

    Args:
        servers: server addresses.
        keys: a ``kvsparse keys`` directory for CurveZMQ; None: no encryption.
        client_id: the session's client id, in each socket's routing id (a
            reconnected socket keeps its name; a replaced one gets a new one).
        local: {server index: endpoint} for shards served in this process
            (colocated mode): that server's socket is a
            `kvsparse.client.local.LocalSocket` (no network, no monitor).

    Threads: not thread-safe (ZeroMQ sockets are not); its `Session` holds a
    lock around every use.

    Raises:
        InvalidArgument: keys is not a usable key directory.
        zmq.ZMQError: an address ZeroMQ cannot connect to.
    """

    def __init__(
        self, servers: list, keys: Optional[str], client_id: int = 0, local: Optional[dict] = None
    ):
        self.servers = servers
        self.local = dict(local or {})
        self.keys = keys
        self._client_id = client_id.to_bytes(8, "little")
        self._generations = itertools.count(1)
        self._sockets: list = [None] * len(servers)
        self._monitors: list = [None] * len(servers)
        # server -> why the last connection attempt failed (None: connected, or trying)
        self._failures: list = [None] * len(servers)
        # Since the last CONNECT_RETRIED: a connect was tried / got through.
        self._attempted: list = [False] * len(servers)
        self._reached: list = [False] * len(servers)
        # Since the last HANDSHAKE_SUCCEEDED: a handshake worked on the connection (False:
        # not yet), and how many connections in a row closed during their handshake.
        self._handshaken: list = [False] * len(servers)
        self._early_closes: list = [0] * len(servers)
        try:
            for server in range(len(servers)):
                self._open(server)
        except BaseException:
            self.close()
            raise

    def socket(self, server: int) -> zmq.Socket:
        """The socket to server (replaced by `reset`)."""
        return self._sockets[server]

    def monitor(self, server: int) -> Optional[zmq.Socket]:
        """The socket on which server's handshake failures are reported (replaced by `reset`).

        None for a server in this process (`local`): there is no handshake.
        """
        return self._monitors[server]

    def reset(self, server: int) -> None:
        """A fresh socket, so that a late reply to an abandoned request cannot arrive on it."""
        self._close(server)
        self._open(server)

    def close(self) -> None:
        """Closes every socket (idempotent)."""
        for server in range(len(self._sockets)):
            self._close(server)

    def connection_failure(self, server: int) -> Optional[errors.ServerUnavailable]:
        """The error for server's address refusing connections or not resolving, else None.

        As of the events read by `handshake_error`: None once a connection
        succeeded again.
        """
        return self._failures[server]

    def handshake_error(self, server: int) -> Optional[errors.ServerUnavailable]:
        """The error for a refused security handshake reported on server's monitor, or None.

        Reads every queued event; connection failures are kept for
        `connection_failure`.
        """
        from zmq.utils.monitor import recv_monitor_message

        if server in self.local:
            return None
        monitor, address = self._monitors[server], self.servers[server]
        while monitor.poll(0):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return None
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failures[server] = None
                self._handshaken[server] = True
                self._early_closes[server] = 0
            elif kind in (zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CLOSED):
                self._attempted[server] = True
            elif kind == zmq.EVENT_CONNECTED:
                self._reached[server] = True
                self._handshaken[server] = False
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                if not self._reached[server]:
                    self._failures[server] = _connect_failure(address, self._attempted[server])
                elif not self._handshaken[server]:  # closed by the peer during the handshake
                    self._early_closes[server] += 1
                    if self._early_closes[server] >= EARLY_CLOSES:
                        self._failures[server] = self._closed_in_handshake(server)
                # else a working connection closed: not a refusal
                self._attempted[server] = self._reached[server] = False
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return errors.ServerUnavailable(
                    f"server {address} refused this client's CurveZMQ key (authentication "
                    f"failed, ZAP status {event['value']}): use a key the server accepts "
                    f"(KVSPARSE_KEYS={self.keys})",
                    address=address,
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return errors.ServerUnavailable(
                    f"server {address} refused the connection: security handshake failed; "
                    f"{self._keys_hint()}",
                    address=address,
                )
        return None

    def connection_state(self, server: int) -> str:
        """How far the connection to server got, as of the events read (for a timeout's
        message: a server that never answered, or a connection that never came up)."""
        if server in self.local:
            return "a shard in this process"
        if self._handshaken[server]:
            return "connected and handshake done: the server did not reply"
        if self._reached[server]:
            return "connected, but the handshake never finished"
        if self._attempted[server]:
            return "a connection was tried and not made"
        return "no connection was made"

    def closed_in_handshake(self, server: int) -> Optional[errors.ServerUnavailable]:
        """The error for server closing a connection during its handshake, else None.

        As of the events read by `handshake_error`; for a send that found no
        connection to queue on (`Session`), so one such close is enough.
        """
        if server in self.local or self._early_closes[server] == 0:
            return None
        return self._closed_in_handshake(server)

    def _closed_in_handshake(self, server: int) -> errors.ServerUnavailable:
        address, closes = self.servers[server], self._early_closes[server]
        times = "once" if closes == 1 else f"{closes} times in a row"
        return errors.ServerUnavailable(
            f"server {address} closed the connection during the security handshake ({times}): "
            f"{self._keys_hint()}; or the address is not a kvsparse server",
            address=address,
        )

    def _keys_hint(self) -> str:
        if self.keys is None:
            return "the server requires CurveZMQ keys: set KVSPARSE_KEYS (kvsparse launch --keys)"
        return f"the server does not use these CurveZMQ keys ({self.keys})"

    def _open(self, server: int) -> None:
        if server in self.local:
            from kvsparse.client.local import open_local_socket

            generation = next(self._generations).to_bytes(4, "little")
            routing = b"kv" + self._client_id + generation
            self._sockets[server] = open_local_socket(self.local[server], routing)
            self._failures[server] = None
            return
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.copy_threshold = COPY_THRESHOLD
        # Not starting with a zero byte (ZeroMQ's own ids do); kept across reconnections.
        generation = next(self._generations).to_bytes(4, "little")
        sock.setsockopt(zmq.ROUTING_ID, b"kv" + self._client_id + generation)
        self._sockets[server] = sock
        self._failures[server] = None
        self._attempted[server] = self._reached[server] = self._handshaken[server] = False
        self._early_closes[server] = 0
        if self.keys is not None:
            from kvsparse.wire import security

            security.secure_client_socket(sock, self.keys)
        # Handshake failures (a server that wants keys, or refuses ours) are reported only
        # here; without it a refused client would just time out. Attached before connect:
        # a refused handshake is not retried, so its one event must not be missed.
        self._monitors[server] = sock.get_monitor_socket(_MONITORED)
        sock.connect(self.servers[server])

    def _close(self, server: int) -> None:
        sock, monitor = self._sockets[server], self._monitors[server]
        if server in self.local:
            if sock is not None:
                from kvsparse.client.local import close_local_socket

                close_local_socket(sock)
                self._sockets[server] = None
            return
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
            self._monitors[server] = None
        if sock is not None:
            sock.close(0)
            self._sockets[server] = None


def _connect_failure(address: str, attempted: bool) -> errors.ServerUnavailable:
    """The error for a failed connection attempt to address (attempted: a connect was tried).

    ZeroMQ tries a tcp connect only once the host name resolved; without one,
    the name did not resolve, and the resolver says why.
    """
    if not attempted and address.startswith("tcp://"):
        host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
        try:
            socket.getaddrinfo(host, None)
        except (OSError, UnicodeError) as exc:
            return errors.ServerUnavailable(
                f"server {address}: cannot resolve host {host!r} ({exc}); check the address "
                "(KVSPARSE_SERVERS)",
                address=address,
            )
    what = (
        "no server listens on that socket path"
        if address.startswith("ipc://")
        else ("connection refused or host unreachable: is the server running on that port?")
    )
    return errors.ServerUnavailable(f"server {address} cannot be reached ({what})", address=address)


__all__ = ["ServerSockets"]
