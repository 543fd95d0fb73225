"""One request out, one reply back: the send and the wait every ZeroMQ client of kvsparse shares.

`send_request` puts a request on a server's socket without blocking and
names why when it cannot (no connection to queue on: a server that closed
the connection during its CurveZMQ handshake, say). `collect_replies` waits
for the replies to requests sent that way, matches each by its request id
(a late reply to an abandoned request is dropped), watches each socket's
monitor so that a refused handshake or an unreachable address is named at
once instead of waited out, and names the servers that stayed silent past
the deadline. `kvsparse.client.session.Session` (training) sends through
`send_request`, and waits with recovery of its own (resends, restarted
servers) on top of `await_reply`, as `kvsparse.client.recovery.Recovery`
does; `kvsparse.serving.client.Client` (lookups) uses `collect_replies`.

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
    sock, monitor = links.socket(server), links.monitor(server)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if monitor is not None:  # a shard in this process has none
        poller.register(monitor, zmq.POLLIN)
    while True:
        remaining = until - time.monotonic()
        # zmq_poll waits without the GIL; no busy loop. One poll even when due: a reply
        # already queued is taken.
        events = dict(poller.poll(max(0.0, remaining) * 1000 + (1 if remaining > 0 else 0)))
        if monitor is not None and monitor in events:
            refused = links.handshake_error(server)
            if refused is None and unreachable:
                refused = links.connection_failure(server)
            if refused is not None:
                links.reset(server)
                raise refused
        while sock in events:
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


__all__ = ["await_reply", "collect_replies", "send_request"]
