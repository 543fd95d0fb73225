"""A session's link to a shard served in this very process (colocated mode).

A colocated worker hosts one shard (`kvsparse.server.embedded.EmbeddedServer`)
and reaches it without a network socket: `LocalSocket.send_multipart` runs
the request through the shard's dispatcher on the caller's thread (under
the shard's lock), and the reply, sent now or later by the serving thread
(when a BSP round completes), comes back through an ``inproc://`` ZeroMQ
pair: no copy, no kernel, and a socket that `kvsparse.client.session`
polls together with its DEALERs to remote servers, so that the exchange
loop (timeouts, liveness pings, gather) is the one every server gets.

The endpoint is duck-typed (this package does not import the server):
``handle(routing, frames)``, ``attach(routing, deliver)`` and
``detach(routing)``, as `EmbeddedServer` has them.

Threads: a `LocalSocket` belongs to its session, which serializes its use;
the hidden sending end is used only by the endpoint under its lock.
"""

from __future__ import annotations

import itertools

import zmq

_LINKS = itertools.count(1)


class LocalSocket(zmq.Socket):
    """The receiving end of a local link; its send_multipart calls the endpoint directly.

    Made by `open_local_socket`; closed with `close_local_socket`.
    """

    # Declared here: pyzmq takes any other attribute set on a socket for a socket option.
    _kvsparse_endpoint = None
    _kvsparse_routing = b""
    _kvsparse_sender = None

    def send_multipart(self, msg_parts, flags=0, copy=True, track=False, **kwargs):
        """Runs the request (header, payload frames) in the shard, on this thread."""
        del flags, copy, track, kwargs
        self._kvsparse_endpoint.handle(self._kvsparse_routing, list(msg_parts))


def open_local_socket(endpoint, routing: bytes) -> LocalSocket:
    """A `LocalSocket` through which a session talks to endpoint as client routing.

    Raises:
        zmq.ZMQError: ZeroMQ could not make the inproc pair.
    """
    context = zmq.Context.instance()
    address = f"inproc://kvsparse-local-{next(_LINKS)}-{routing.hex()}"
    receiver = context.socket(zmq.PAIR, socket_class=LocalSocket)
    sender = context.socket(zmq.PAIR)
    for sock in (receiver, sender):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    receiver.bind(address)
    sender.connect(address)
    receiver._kvsparse_endpoint = endpoint
    receiver._kvsparse_routing = routing
    receiver._kvsparse_sender = sender

    def deliver(frames: list) -> None:
        sender.send_multipart(frames, copy=False)

    endpoint.attach(routing, deliver)
    return receiver


def close_local_socket(sock: LocalSocket) -> None:
    """Detaches sock from its endpoint (late replies are dropped) and closes both ends."""
    sock._kvsparse_endpoint.detach(sock._kvsparse_routing)
    sock._kvsparse_sender.close(0)
    sock.close(0)


__all__ = ["LocalSocket", "close_local_socket", "open_local_socket"]
