"""One request out, one reply back: the send and the wait every ZeroMQ client of kvsparse shares.

`send_request` puts a request on a server's socket without blocking and
names why when it cannot (no connection to queue on: a server that closed
the connection during its CurveZMQ handshake, say).

Every wait for replies goes through one primitive, `ReplyPoller`: the
sockets of some servers and their monitors polled together (zmq_poll, no
GIL, no busy loop), each monitor event turned into the refusal it reports by
`refusal` (a refused handshake, or an address that cannot be reached), named
at once instead of waited out. On top of it:

- `await_reply`: one server, one deadline (`kvsparse.client.recovery.Recovery`'s
  probes of a restarting server);
- `collect_replies`: one request per server, one deadline, the silent ones
  named (`kvsparse.serving.client.Client`'s lookups, a dropped session's GOODBYE);
- `kvsparse.client.session.Session`'s exchange loop: pings, resends and
  recovery per server, under `WaitLimits` it shares with its `Recovery`.

Threads: not thread-safe; the caller serializes calls on one `ServerSockets`.

Example:
    >>> links = ServerSockets(["tcp://127.0.0.1:7100"], keys=None)     # doctest: +SKIP
    >>> request_id = send_request(links, 0, header, frames)             # doctest: +SKIP
    >>> answers = collect_replies(links, {0: request_id}, timeout=10)     # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Optional

import zmq

from kvsparse import errors
from kvsparse.client.sockets import ServerSockets
from kvsparse.wire import protocol
from kvsparse.wire.protocol import Header


def send_request(links: ServerSockets, server: int, header: Header, frames: list) -> int:
    """Sends header + frames to server without blocking; returns the header's request id.

    Raises:
        ServerUnavailable: nothing can be queued for server (its socket has no
            connection): the refused handshake that closed it when the monitor
            saw one, else "send queue full". The socket is replaced either way.
    """
    try:
        links.socket(server).send_multipart([header.pack(), *frames], copy=False, flags=zmq.NOBLOCK)
    except zmq.Again:
        # The send queue is unbounded: no connection to queue on. A peer that closed
        # one during its handshake says why (a server that wants CurveZMQ keys).
        why = links.handshake_error(server) or links.closed_in_handshake(server)
        links.reset(server)
        if why is not None:
            raise why from None
        raise errors.ServerUnavailable(
            f"server {links.servers[server]} does not take requests (send queue full)",
            address=links.servers[server],
        ) from None
    return header.request_id


class WaitLimits:
    """How long a client waits: one object, shared by a session and its recovery.

    Attributes:
        timeout: seconds of silence from a server before it counts as not answering.
        retry_window: seconds to keep trying to reach a restarted or silent
            server (0: no retry).

    Not thread-safe; its session changes it under the session's lock.
    """

    __slots__ = ("timeout", "retry_window")

    def __init__(self, timeout: float, retry_window: float = 0.0):
        self.timeout = float(timeout)
        self.retry_window = float(retry_window)

    def cap(self, seconds: float) -> None:
        """Caps both at seconds (a retry window stays on)."""
        self.timeout = min(self.timeout, seconds)
        self.retry_window = min(self.retry_window, seconds)


def refusal(links: ServerSockets, server: int, unreachable: bool):
    """The error server's monitor reports, else None: the one reader of the monitors.

    A refused security handshake always; with unreachable, also an address
    that refuses connections or does not resolve (False while a server may be
    restarting: a retry window names that at its end).
    """
    refused = links.handshake_error(server)
    if refused is None and unreachable:
        refused = links.connection_failure(server)
    return refused


class ReplyPoller:
    """The sockets and monitors of some servers, polled together: every client's one wait.

    Args:
        links: the sockets.
        servers: the servers to wait for.

    Not thread-safe: its owner polls it under the lock that guards links.

    Example:
        >>> poller = ReplyPoller(links, [0, 1])                     # doctest: +SKIP
        >>> for server, from_monitor in poller.poll(0.02): ...      # doctest: +SKIP
    """

    def __init__(self, links: ServerSockets, servers):
        self._links = links
        self._poller = zmq.Poller()
        self._owners: dict = {}  # socket -> (server, whether it is the monitor)
        for server in servers:
            self._owners[links.socket(server)] = (server, False)
            monitor = links.monitor(server)
            if monitor is not None:  # a shard in this process has none
                self._owners[monitor] = (server, True)
        for sock in self._owners:
            self._poller.register(sock, zmq.POLLIN)

    def covers(self, servers) -> bool:
        """Whether it polls the current sockets of servers (none replaced by a reset)."""
        return all(self._links.socket(server) in self._owners for server in servers)

    def drop(self, server: int) -> None:
        """Stops polling server (its reply came)."""
        for sock, (owner, _) in list(self._owners.items()):
            if owner == server:
                self._poller.unregister(sock)
                del self._owners[sock]

    def poll(self, seconds: float) -> list:
        """Waits at most seconds; [(server, from_monitor)] of the sockets that are readable.

        A socket a reset replaced since is skipped: its server is polled again
        once the caller builds a new poller (`covers`).
        """
        # One poll even when due: a reply already queued is taken.
        events = self._poller.poll(max(0.0, seconds) * 1000 + (1 if seconds > 0 else 0))
        ready = []
        for sock, _ in events:
            server, from_monitor = self._owners[sock]
            current = self._links.monitor(server) if from_monitor else self._links.socket(server)
            if sock is current:
                ready.append((server, from_monitor))
        return ready


def await_reply(
    links: ServerSockets, server: int, accepted, until: float, *, unreachable: bool = True
) -> Optional[tuple]:
    """The first reply on server's socket to a request id in `accepted`, or None at `until`.

    Replies to other ids (requests abandoned earlier) are dropped. An error
    reply is returned like any other: the caller knows which of its requests
    may fail.

    Args:
        unreachable: also raise when the monitor reports the address cannot be
            reached; False while a server may be restarting (the recovery's
            retry window names that at its end).

    Raises:
        ServerUnavailable: the server refused the security handshake (or,
            with unreachable, cannot be reached); its socket is replaced.
    """
    sock = links.socket(server)
    poller = ReplyPoller(links, [server])
    while True:
        remaining = until - time.monotonic()
        for _, from_monitor in poller.poll(remaining):
            if from_monitor:
                refused = refusal(links, server, unreachable)
                if refused is not None:
                    links.reset(server)
                    raise refused
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                header, payload = protocol.parse_message(frames, reply=True)
                if header.request_id in accepted:
                    return header, payload
        if remaining <= 0:
            return None


def collect_replies(links: ServerSockets, sent: dict, timeout: float, what: str = "server") -> dict:
    """Waits up to timeout seconds for one reply per request in sent ({server: request id}).

    Returns:
        {server: (header, payload)}, every server of sent; replies with an
        error status are raised as their kvsparse.errors class.

    Raises:
        ServerUnavailable: a server refused the security handshake or cannot
            be reached (named at once), or did not answer by the deadline
            (naming every silent one, as `what` ADDRESS); its socket is
            replaced, so that its late reply cannot be taken for the next one.
    """
    deadline = time.monotonic() + timeout
    answers: dict = {}
    missing = []
    for server, request_id in sent.items():
        # Every request is out already: waiting for them in turn takes no longer than
        # waiting for all at once, and a late server's reply queues meanwhile.
        answer = await_reply(links, server, (request_id,), deadline)
        if answer is None:
            missing.append(server)
        else:
            answers[server] = answer
    if missing:
        for server in missing:
            links.reset(server)
        shown = ", ".join(links.servers[server] for server in missing)
        raise errors.ServerUnavailable(
            f"{what} {shown} did not answer within {timeout:g} s",
            address=links.servers[missing[0]],
        )
    for server, (header, payload) in answers.items():
        if header.status:
            protocol.raise_remote_error(header, payload, links.servers[server])
    return answers


__all__ = [
    "ReplyPoller",
    "WaitLimits",
    "await_reply",
    "collect_replies",
    "refusal",
    "send_request",
]
