"""A request's way through the server: parsed, checked for resends, run, answered once.

`Dispatcher.handle` takes each message the event loop receives. It validates
the header (a malformed message gets an error reply), answers the requests
that belong to no client session (PING, a monitor's STATS), asks the
`ResendCache` whether the request is new, and runs a new one through the
op handlers (`kvsparse.server.handlers`). A handler answers at once or
returns `DEFERRED` and keeps the `InFlightRequest` request, which it (or a
coordination object holding it) answers later with `InFlightRequest.finish` or
`InFlightRequest.fail`. Every reply goes out stamped with the server's incarnation,
and its time from receipt is observed in the metrics.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Callable

from kvsparse import errors
from kvsparse.server.resend import Verdict
from kvsparse.wire import protocol
from kvsparse.wire.protocol import MUTATING_OPS, Op

# A handler's answer when it replies later (through the InFlightRequest it was given).
DEFERRED = object()
_PUSH_OPS = (Op.PUSH_SPARSE, Op.PUSH_DENSE)
_OP_NAMES = {int(op): op.name.lower() for op in Op}  # metric labels, looked up per request


class InFlightRequest:
    """A request whose reply is not sent yet; answered once, by finish() or fail().

    The routing id may change before then: a resent copy's sender gets the reply.

    Threads: not thread-safe; the server's event loop thread only.
    """

    __slots__ = ("routing", "header", "payload", "started", "_dispatcher")

    def __init__(self, dispatcher: Dispatcher, routing: bytes, header: protocol.Header, payload):
        self.started = time.perf_counter()
        self.routing = routing
        self.header = header
        self.payload = payload
        self._dispatcher = dispatcher

    def finish(self, result) -> None:
        """Sends the reply: a list of payload frames, or (frames, num_items)."""
        self._dispatcher.finish(self, result)

    def fail(self, exc: BaseException) -> None:
        """Sends the error reply for exc (and counts it)."""
        self._dispatcher.fail(self, exc)


class Dispatcher:
    """Takes received messages to the op handlers and their replies back to the socket.

    Args:
        send: ``send(routing, frames)`` (`EventLoop.send`).
        handlers: `kvsparse.server.handlers.Handlers`.
        resend: the `ResendCache`.
        metrics: the `ServerMetrics`.
        counters: the ShardState's counters (``requests`` counts new requests).
        incarnation: stamped on every reply header.
        liveness: the `kvsparse.server.liveness.Liveness` told of every
            sender, every accepted HELLO and every held request; None: none.

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(
        self, send: Callable, handlers, resend, metrics, counters, incarnation: int, liveness=None
    ):
        self._send_frames = send
        self._liveness = liveness
        self._handlers = handlers
        self._resend = resend
        self._metrics = metrics
        self._counters = counters
        self._incarnation = incarnation

    def handle(self, frames: list) -> None:
        """Handles one received message (routing id frame first); never raises."""
        try:
            self._handle(frames)
        except Exception:  # noqa: BLE001 - the loop must survive anything a message causes
            traceback.print_exc(file=sys.stderr)

    def _handle(self, frames: list) -> None:
        routing = frames[0].bytes
        message = frames[1:]
        try:
            header, payload = protocol.parse_message(message)
        except errors.ProtocolError as exc:
            self._metrics.count_error(type(exc).__name__)
            peeked = protocol.peek_header(message[0]) if message else None
            self._send(routing, protocol.error_reply(peeked, exc))
            return
        self._metrics.count_request(_OP_NAMES[header.op])
        if self._liveness is not None:
            self._liveness.heard(header.client_id, routing)
        direct = self._handlers.answer_outside_session(header)
        if direct is not None:
            self._send(routing, [header.reply(num_frames=len(direct)).pack(), *direct])
            return
        verdict, held = self._resend.admit(
            header.client_id, header.request_id, is_push=header.op in _PUSH_OPS
        )
        if verdict is Verdict.WAITING:  # still waiting: answer the resent copy when done
            held.routing = routing
            return
        if verdict is Verdict.REPLAY:
            self._send(routing, held)
            return
        if verdict is Verdict.STALE:
            self._metrics.count_error("ProtocolError")
            stale = errors.ProtocolError(
                f"stale request id {header.request_id}: this client already sent {held}"
            )
            self._send(routing, protocol.error_reply(header, stale))
            return
        pending = InFlightRequest(self, routing, header, payload)
        self._resend.track(header.client_id, header.request_id, pending)
        self._counters.requests += 1
        self.run(pending)
        # A request that moved a worker's clock may let held SSP pulls go.
        for released in self._handlers.released():
            self.run(released)

    def run(self, pending: InFlightRequest) -> None:
        """Runs pending's op handler; its reply (or error reply) is sent now or later."""
        try:
            result = self._handlers.run(pending.header, pending.payload, pending)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error reply
            self.fail(pending, exc)
            return
        header = pending.header
        if self._liveness is not None and header.op == Op.HELLO:
            self._liveness.joined(header.client_id, header.rank, pending.routing)
        elif self._liveness is not None and header.op == Op.GOODBYE:
            self._liveness.goodbye(header.client_id)
        if result is not DEFERRED:
            self.finish(pending, result)
        elif self._liveness is not None:
            self._liveness.check()  # held: but not for a worker that left

    def finish(self, pending: InFlightRequest, result) -> None:
        """Sends pending's reply: a list of payload frames, or (frames, num_items)."""
        frames, num_items = result if isinstance(result, tuple) else (result, 0)
        head = protocol.pack_reply(pending.header, len(frames), num_items, self._incarnation)
        self._complete(pending, [head, *frames], stamped=True)

    def fail(self, pending: InFlightRequest, exc: BaseException) -> None:
        """Sends pending's error reply; an unexpected exception's traceback goes to stderr.

        Out of memory is expected on a loaded server: one line on stderr, no
        traceback; the worker gets CapacityError (a MemoryError).
        """
        self._metrics.count_error(type(exc).__name__)
        if isinstance(exc, MemoryError) and not isinstance(exc, errors.KVSparseError):
            header = pending.header
            print(
                f"kvsparse server: out of memory in a {_OP_NAMES[header.op]} request of "
                f"rank {header.rank} ({exc or 'an allocation failed'}); refused, serving on",
                file=sys.stderr,
                flush=True,
            )
        elif not isinstance(exc, errors.KVSparseError):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        self._complete(pending, protocol.error_reply(pending.header, exc))

    def _complete(self, pending: InFlightRequest, frames: list, stamped: bool = False) -> None:
        """Sends frames (stamped: their header carries the incarnation already), records them."""
        if stamped:
            self._send_frames(pending.routing, frames)
        else:
            self._send(pending.routing, frames)
        header = pending.header
        self._metrics.observe(_OP_NAMES[header.op], time.perf_counter() - pending.started)
        kept = frames if header.op in MUTATING_OPS else None
        self._resend.complete(header.client_id, header.request_id, kept)
        pending.payload = None

    def _send(self, routing: bytes, frames: list) -> None:
        head = protocol.stamp_incarnation(frames[0], self._incarnation)
        self._send_frames(routing, [head, *frames[1:]])
