"""The server's event loop: a ROUTER socket, a wake-up socket and watched pipes, polled together.

The loop knows nothing of ops: it hands every received multipart message to
the callback `EventLoop.serve` was given, sends what it is told to send, and
wakes up when another thread (a metrics scrape, a signal handler) writes to
its wake-up socket. Waiting blocks in zmq_poll, which releases the GIL.

The loop itself runs Python and needs the GIL while it handles a message. With
the fast path (`kvsparse.server.fastpath`, `EventLoop.forward_from`) a C++
thread reads the ROUTER instead and answers pulls and pushes without the GIL;
the loop then receives only what that thread forwards, over a PAIR socket,
and still sends its replies on the ROUTER (holding the guard, the shard mutex
both threads share).

Peers that leave: a socket monitor reports each closed connection (a worker
that exited or was killed: its kernel closes the socket), and ZeroMQ's own
heartbeats (ZMTP PING/PONG, answered by the peer's I/O thread without Python)
close a connection whose peer stopped answering (a stopped process, a host
that died). The loop only tells ``on_disconnect``; it cannot say which peer
closed (the monitor names a file descriptor), so the server asks with
`EventLoop.routable` which peers are still there. Clients choose their
routing ids (`kvsparse.client.session`), so a client that reconnects is
routable again under the same id.

Example:
    >>> loop = EventLoop("tcp://127.0.0.1:0")              # doctest: +SKIP
    >>> loop.serve(on_message=print, on_wakeup=lambda: None)  # until loop.stop()  # doctest: +SKIP
    >>> loop.close()                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections import deque
from typing import Callable

import zmq

from kvsparse import errors
from kvsparse.config import DEFAULT_HEARTBEAT_TIMEOUT

# The largest message frame a server accepts (ZMQ_MAXMSGSIZE): a bigger one
# makes ZeroMQ drop the connection before anything is allocated for it.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30
# Messages handled per poll wake-up: a flood from one client cannot starve the stop check.
_BATCH = 1024


class EventLoop:
    """A bound ROUTER socket and the poll loop around it.

    Args:
        bind: ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:0`` (port 0: any free port).
        context: a zmq.Context (default: a new one, terminated by close()).
        keys: a CurveZMQ key directory (`kvsparse.wire.security`), or None.
        max_message_size: bytes (ZMQ_MAXMSGSIZE); -1: no limit.
        heartbeat_timeout: seconds without any traffic from a peer (after a
            ZMTP PING, sent every sixth of it) before its connection is
            closed; 0: no heartbeats.
        guard: a lock serve() holds while it handles what a poll returned
            (never while it waits), for a server whose state other threads
            use too (a colocated worker runs requests to its own shard on
            its own thread, holding the same lock). None: no lock.
        use_fd: a tcp socket already bound and listening, whose file
            descriptor the ROUTER takes over (ZeroMQ closes it) instead of
            binding ``bind`` itself (ZMQ_USE_FD: `kvsparse launch --colocated`
            holds each worker's port from the start). None: bind.

    Raises:
        zmq.ZMQError: the address cannot be bound.
        InvalidArgument: keys is not a usable key directory.

    Threads: serve() and close() belong to the one thread that serves;
    send(), routable(), call_later() and watch() to whoever holds the guard
    (the serving thread when there is none): called off the serving thread
    while it serves, a send is queued for it and the poll is woken. stop()
    and wake() may be called from any thread or a signal handler.
    """

    def __init__(
        self,
        bind: str,
        context: zmq.Context | None = None,
        *,
        keys: str | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        guard=None,
        use_fd: int | None = None,
    ):
        self._guard = guard if guard is not None else contextlib.nullcontext()
        self._serving_thread: int | None = None  # threading.get_ident() of serve(), while it runs
        self._outbox: deque = deque()  # (routing, frames) sent off the serving thread
        self._unregistered: list[int] = []  # fds watched off the serving thread
        # routing id -> deliver(frames): peers in this process, answered without the socket.
        self._local: dict[bytes, Callable[[list], None]] = {}
        self._own_context = context is None
        self.context = context if context is not None else zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A dropped reply would leave a worker waiting: never drop at the high-water mark.
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_size))
        # A send to a peer that is gone raises EHOSTUNREACH instead of vanishing: how
        # `routable` tells a worker that left from one that is still connected.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A client that reconnects under its routing id takes it over at once, even before
        # the server has noticed that the old connection closed.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if heartbeat_timeout > 0:
            self.socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_timeout * 1000 / 6)))
            self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat_timeout * 1000)))
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._authenticator = None
        try:
            if keys is not None:
                from kvsparse.wire import security

                self._authenticator = security.secure_server_socket(self.socket, self.context, keys)
            if use_fd is not None:
                self.socket.setsockopt(zmq.USE_FD, int(use_fd))
            self.socket.bind(bind)
        except (zmq.ZMQError, errors.KVSparseError):
            self.socket.disable_monitor()
            self._monitor.close(0)
            self.socket.close(0)
            if self._authenticator is not None:
                self._authenticator.stop()
            if self._own_context:
                self.context.term()
            raise
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopping = False
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        # fd -> callback run by serve() once fd is readable (a forked checkpoint writer's pipe).
        self._watched: dict[int, Callable[[], None]] = {}
        self._poller: zmq.Poller | None = None
        # The fast path (`forward_from`): messages come from this PAIR, not the ROUTER.
        self._inbox: zmq.Socket | None = None
        self._socket_used: Callable[[], None] | None = None
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  # a heap
        self._timer_ids = itertools.count()

    def forward_from(self, inbox: zmq.Socket, socket_used: Callable[[], None]) -> None:
        """Receives messages from inbox instead of the ROUTER (`kvsparse.server.fastpath`).

        Another thread then reads the ROUTER (holding the guard) and forwards here
        what it does not answer; the loop still sends on the ROUTER (holding the
        guard) and calls socket_used() after each send. Before serve() only.
        """
        self._inbox = inbox
        self._socket_used = socket_used

    def serve(
        self,
        on_message: Callable[[list], None],
        on_wakeup: Callable[[], None],
        on_disconnect: Callable[[], None] | None = None,
    ) -> None:
        """Polls until stop(): on_message(frames) per message, on_wakeup() after a wake().

        frames is the received multipart message, routing id frame first
        (zmq.Frame objects). on_disconnect() after a peer's connection closed
        (once per batch of closures). Callbacks given to `call_later` run
        when due. No callback may raise.
        """
        poller = zmq.Poller()
        poller.register(self.socket if self._inbox is None else self._inbox, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        # Registered by fd: zmq.Poller reports a non-zmq socket by its fd, not the object.
        wake_fd = self._wake_read.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        with self._guard:
            self._poller = poller
            self._serving_thread = threading.get_ident()
            for fd in self._watched:
                poller.register(fd, zmq.POLLIN)
        try:
            while not self._stopping:
                with self._guard:
                    self._register_watched()
                    timeout = self._poll_timeout()
                # zmq_poll waits without the GIL (nor the guard), until a message, a
                # wake-up or the next timer.
                events = dict(poller.poll(timeout))
                with self._guard:
                    self._handle_events(events, wake_fd, on_message, on_wakeup, on_disconnect)
        finally:
            with self._guard:
                self._flush_outbox()
                self._serving_thread = None

    def _handle_events(self, events, wake_fd, on_message, on_wakeup, on_disconnect) -> None:
        poller = self._poller
        self._run_due_timers()
        if self._monitor in events and self._drain_monitor() and on_disconnect is not None:
            on_disconnect()
        for fd in [fd for fd in self._watched if fd in events]:
            poller.unregister(fd)
            self._watched.pop(fd)()
        socket = self.socket if self._inbox is None else self._inbox
        if socket in events:
            for _ in range(_BATCH):
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                on_message(frames)
                # Asked rather than found by a failing recv: raising zmq.Again cost more
                # than the question, once per wake-up.
                if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
        if wake_fd in events:
            try:
                while self._wake_read.recv(4096):
                    pass
            except BlockingIOError:
                pass
            self._flush_outbox()
            on_wakeup()
        self._flush_outbox()

    def _off_serving_thread(self) -> bool:
        serving = self._serving_thread
        return serving is not None and serving != threading.get_ident()

    def _flush_outbox(self) -> None:
        while self._outbox:
            routing, frames = self._outbox.popleft()
            self._send_now(routing, frames)

    def _register_watched(self) -> None:
        for fd in self._unregistered:
            if fd in self._watched:
                self._poller.register(fd, zmq.POLLIN)
        self._unregistered.clear()

    def send(self, routing: bytes, frames: list) -> None:
        """Sends frames (uncopied: do not change them afterwards) to the peer routing names.

        A peer that is gone gets nothing (its reply is dropped, as a ROUTER does).
        """
        self.routable(routing, frames)

    def attach(self, routing: bytes, deliver: Callable[[list], None]) -> None:
        """Frames for routing go to deliver(frames) instead of the socket (a peer in this
        process; `kvsparse.server.embedded`). deliver is called with the guard held."""
        self._local[routing] = deliver

    def detach(self, routing: bytes) -> None:
        """Undoes `attach`: later frames for routing are dropped (no such peer)."""
        self._local.pop(routing, None)

    def routable(self, routing: bytes, frames: list) -> bool:
        """Sends frames to the peer routing names; False (nothing sent) if it is not connected.

        Off the serving thread (while it serves) the frames are queued for it, and
        the answer is True.
        """
        deliver = self._local.get(routing)
        if deliver is not None:
            deliver(frames)
            return True
        if self._off_serving_thread():
            self._outbox.append((routing, frames))
            self.wake()
            return True
        return self._send_now(routing, frames)

    def _send_now(self, routing: bytes, frames: list) -> bool:
        if routing in self._local:
            self._local[routing](frames)
            return True
        try:
            self.socket.send_multipart([routing, *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False
        finally:
            if self._socket_used is not None:
                # The send may have taken the ROUTER's ZMQ_FD signal of a message that
                # arrived meanwhile: the fast path's thread asks the socket again.
                self._socket_used()
        return True

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        """Runs callback() from serve() once delay seconds have passed (serving thread only)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._timer_ids), callback))
        if self._off_serving_thread():
            self.wake()  # the poll's timeout was computed without it

    def _poll_timeout(self) -> int | None:
        if not self._timers:
            return None
        return max(0, int((self._timers[0][0] - time.monotonic()) * 1000) + 1)

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            heapq.heappop(self._timers)[2]()

    def _drain_monitor(self) -> bool:
        """Reads every queued monitor event (only closures are monitored); True if any."""
        closed = False
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return closed
            closed = True

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Runs callback() once fd is readable, from serve(); at once if serve() never ran.

        The fd is unregistered before the callback runs; the callback closes it.
        """
        if self._poller is None:  # not serving (a direct handle() call): run it here
            callback()
            return
        self._watched[fd] = callback
        if self._off_serving_thread():  # the serving thread registers it before its next poll
            self._unregistered.append(fd)
            self.wake()
            return
        self._poller.register(fd, zmq.POLLIN)

    def stop(self) -> None:
        """Makes serve() return after the message it is handling (safe in a signal handler)."""
        self._stopping = True
        self._write_wakeup(b"x")

    def wake(self) -> None:
        """Makes serve() call on_wakeup() soon (any thread)."""
        self._write_wakeup(b"m")

    def _write_wakeup(self, byte: bytes) -> None:
        try:
            self._wake_write.send(byte)
        except OSError:  # full (the loop wakes anyway) or closed (the waiter times out)
            pass

    @property
    def wakeup_fd(self) -> int:
        """A non-blocking fd whose writes wake serve() (for signal.set_wakeup_fd)."""
        return self._wake_write.fileno()

    def close(self, linger: float = 0.0) -> None:
        """Closes the sockets (and the context, if the loop made it).

        linger: seconds ZeroMQ may still take to send the replies it holds
        (0: they are dropped).
        """
        self.socket.disable_monitor()
        self._monitor.close(0)
        self.socket.close(int(linger * 1000))
        self._wake_read.close()
        self._wake_write.close()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._own_context:
            self.context.term()
