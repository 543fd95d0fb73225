"""A client's connection to the servers: sockets, request ids, and the one exchange loop.

`Session` holds one ZeroMQ DEALER socket per server and runs the
send-then-collect loop that every client of the servers uses: the remote
backend (`kvsparse.client.remote.RemoteBackend`), `kvsparse.client.remote.ping`
and ``kvsparse stats`` (`kvsparse.cli.stats.fetch_stats`). An exchange sends
its request (a `kvsparse.wire.ops.Request`) to every server involved first,
then collects the replies, so the servers work in parallel. The session
writes the headers: a random client id, increasing request ids, the rank, and
the clock (the worker's push count, for bounded staleness).

Timeouts: a server that answers nothing, not even a liveness ping, for
``timeout`` seconds raises `NoAnswer` (a `kvsparse.errors.ServerUnavailable`)
naming it. A worker's session pings a server that stays silent for half the
timeout: waiting for other workers (a BSP push, an SSP pull, a barrier) is
not a timeout, the server keeps answering pings meanwhile, and a ping reply
that shows the request never arrived (dropped for its size, or lost with a
broken connection) gets it resent. What a server holds for a worker that
left the job fails there with `kvsparse.errors.WorkerLeft`
(`kvsparse.server.liveness`), so such a wait ends too. A monitor's session
(``monitor=True``) does not ping: the server keeps no record of a monitor,
and its requests are answered at once, so the timeout is a plain deadline.

Server restarts (``retry_window`` > 0): every reply carries the server's
random incarnation in its header. When it changes (the server was restarted,
e.g. from a checkpoint by the launcher), or when a server stops answering,
the session greets it again (the HELLO given to `Session.open`, retrying until
``retry_window`` seconds have passed, then ServerUnavailable), replays what
`Session.remember` was given (the tables and dense keys this client created), and
resends the request in flight: under its own request id if the server has
it (a server applies a request id at most once), else under a new one.
What a restarted server holds is what it restored (its last checkpoint):
pushes acknowledged after that checkpoint are not replayed.

Security: with ``keys`` (a ``kvsparse keys`` directory) the sockets use
CurveZMQ (`kvsparse.wire.security`). A server that refuses the handshake (no
keys, or keys it does not know) raises ServerUnavailable at once, naming it.

Connection failures (issue 11, defect 11): a server whose address refuses
the connection (nothing listens there) or whose host name does not resolve
raises ServerUnavailable at once, naming the address and the reason, instead
of waiting out the timeout; with ``retry_window`` > 0 (servers expected to
come and go, or to start after the workers) the session keeps trying until
the window ends, and the error then gives the reason.

Routing ids: each socket names itself to the servers (its client id and a
counter), and ZeroMQ keeps that name when it reconnects a broken
connection, so a server can tell a worker that left from one whose
connection was re-made (`kvsparse.server.liveness`).

Example:
    >>> from kvsparse.wire import ops
    >>> session = Session(['tcp://127.0.0.1:1'], timeout=0.1, monitor=True)
    >>> outcome = session.exchange({0: ops.Ping.encode_request()}, gather=True)[0]
    >>> type(outcome).__name__
    'NoAnswer'
    >>> session.close()
"""

from __future__ import annotations

import itertools
import secrets
import socket
import threading
import time
from typing import NamedTuple, Optional, Union

import zmq

from kvsparse import errors
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Header

DEFAULT_TIMEOUT = 60.0
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
# What the socket monitor reports: refused handshakes, and each connection attempt:
# CONNECT_DELAYED or CLOSED when a connect was tried (none when the host name did not
# resolve), CONNECTED when it got through (a refused handshake comes after), and
# CONNECT_RETRIED when it is over; HANDSHAKE_SUCCEEDED when a connection works.
_MONITORED = (
    _HANDSHAKE_FAILED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
_RECOVERY_PROBE_SECONDS = 1.0  # wait per PING or HELLO to a restarting server
_MAX_RESENDS = 3  # of a request a live server says it never got


class NoAnswer(errors.ServerUnavailable):
    """A server answered nothing (not even a liveness ping) within the timeout.

    A ServerUnavailable, so callers that catch that catch this too.
    """


class Answer(NamedTuple):
    """A successful reply: its header and payload frames (immutable)."""

    header: Header
    payload: list


Outcome = Union[Answer, errors.KVSparseError]


class _Call:
    """What one exchange still waits for (the session's private bookkeeping, one per call)."""

    __slots__ = ("requests", "gather", "waiting", "heard", "pings", "drops", "outcomes", "poller")

    def __init__(self, requests: dict, gather: bool):
        self.requests = requests
        self.gather = gather
        self.waiting: dict[int, int] = {}  # server -> request id the reply will carry
        self.heard: dict[int, float] = {}  # server -> when it last said anything
        self.pings: dict[int, Optional[int]] = {}  # server -> request id of a liveness ping
        self.drops: dict[int, int] = {}  # server -> resends of a request it never got
        self.outcomes: dict[int, Outcome] = {}
        self.poller: Optional[tuple] = None  # (zmq.Poller, {socket: server})

    def settle(self, server: int, outcome: Outcome, sockets: Optional[tuple] = None) -> None:
        """Records server's outcome; sockets: its (still registered) sockets to stop polling."""
        self.outcomes[server] = outcome
        del self.waiting[server]
        if sockets is None or self.poller is None:
            self.poller = None  # rebuilt by the next wait
        else:
            for sock in sockets:
                self.poller[0].unregister(sock)


class ServerSockets:
    """One ZeroMQ DEALER socket per server, each watched for a refused security handshake.

    Args:
        servers: server addresses.
        keys: a ``kvsparse keys`` directory for CurveZMQ; None: no encryption.
        client_id: the session's client id, in each socket's routing id (a
            reconnected socket keeps its name; a replaced one gets a new one).

    Threads: not thread-safe (ZeroMQ sockets are not); its `Session` holds a
    lock around every use.

    Raises:
        InvalidArgument: keys is not a usable key directory.
        zmq.ZMQError: an address ZeroMQ cannot connect to.
    """

    def __init__(self, servers: list, keys: Optional[str], client_id: int = 0):
        self.servers = servers
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
        try:
            for server in range(len(servers)):
                self._open(server)
        except BaseException:
            self.close()
            raise

    def socket(self, server: int) -> zmq.Socket:
        """The socket to server (replaced by `reset`)."""
        return self._sockets[server]

    def monitor(self, server: int) -> zmq.Socket:
        """The socket on which server's handshake failures are reported (replaced by `reset`)."""
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

        monitor, address = self._monitors[server], self.servers[server]
        while monitor.poll(0):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return None
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failures[server] = None
            elif kind in (zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CLOSED):
                self._attempted[server] = True
            elif kind == zmq.EVENT_CONNECTED:
                self._reached[server] = True
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                if not self._reached[server]:  # else a connection closed: not a refusal
                    self._failures[server] = _connect_failure(address, self._attempted[server])
                self._attempted[server] = self._reached[server] = False
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return errors.ServerUnavailable(
                    f"server {address} refused this client's CurveZMQ key (authentication "
                    f"failed, ZAP status {event['value']}): use a key the server accepts "
                    f"(KVSPARSE_KEYS={self.keys})",
                    address=address,
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                need = (
                    "the server requires CurveZMQ keys: set KVSPARSE_KEYS (kvsparse launch --keys)"
                    if self.keys is None
                    else f"the server does not use these CurveZMQ keys ({self.keys})"
                )
                return errors.ServerUnavailable(
                    f"server {address} refused the connection: security handshake failed; {need}",
                    address=address,
                )
        return None

    def _open(self, server: int) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # Not starting with a zero byte (ZeroMQ's own ids do); kept across reconnections.
        generation = next(self._generations).to_bytes(4, "little")
        sock.setsockopt(zmq.ROUTING_ID, b"kv" + self._client_id + generation)
        self._sockets[server] = sock
        self._failures[server] = None
        self._attempted[server] = self._reached[server] = False
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


class Session:
    """Sockets to a list of servers and the exchange loop over them.

    Args:
        servers: server addresses ``tcp://host:port``, in shard order.
        rank: the worker's rank, sent in every header (0 for a monitor).
        timeout: seconds without any answer from a server before NoAnswer
            (None: 60).
        retry_window: seconds to keep trying to reach a restarted or silent
            server before ServerUnavailable; 0: no retry.
        keys: a ``kvsparse keys`` directory for CurveZMQ; None: no encryption.
        monitor: a monitor's session: no liveness pings (see the module
            docstring).

    Thread safety: exchanges are serialized by a lock (ZeroMQ sockets are
    not thread-safe), so a session may be shared by threads; a forked child
    must open its own.

    Raises:
        InvalidArgument: keys is not a usable key directory.
        zmq.ZMQError: an address ZeroMQ cannot connect to.
    """

    def __init__(
        self,
        servers,
        *,
        rank: int = 0,
        timeout: Optional[float] = None,
        retry_window: float = 0.0,
        keys: Optional[str] = None,
        monitor: bool = False,
    ):
        self.servers = list(servers)
        self.rank = int(rank)
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        self.retry_window = float(retry_window)
        self.keys = keys
        self.monitor = bool(monitor)
        self.restarts = 0  # server restarts this session recovered from
        self._client_id = secrets.randbits(64)
        self._request_ids = itertools.count(1)
        self._clock = 0
        self._incarnations = [0] * len(self.servers)
        self._greetings: dict[int, ops.Request] = {}
        self._replays: dict = {}
        self._lock = threading.RLock()
        self._closed = False
        self._links = ServerSockets(self.servers, keys, self._client_id)

    # -- the public surface -------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """Pushes this client made (`exchange` with push=True), sent in every header."""
        return self._clock

    def open(self, greetings: dict) -> dict:
        """Greets each server: {server: HELLO request} -> {server: Answer}.

        The greetings are sent again to a server that restarted; the
        incarnation in each reply is the one a restart changes.

        Raises:
            what `exchange` raises.
        """
        with self._lock:
            self._greetings = dict(greetings)
            answers = self.exchange(greetings)
            for server, answer in answers.items():
                self._incarnations[server] = answer.header.incarnation
            return answers

    def remember(self, key, request: ops.Request, server: Optional[int] = None) -> None:
        """Replays request (after the greeting) to every server that restarts (or to server).

        key: a later request under the same key replaces this one (e.g. a
        table id: the table's INIT_SPARSE). server: only that server gets
        it (a dense key's INIT_DENSE carries its slice).
        """
        with self._lock:
            self._replays[key] = (server, request)

    def exchange(self, requests: dict, *, push: bool = False, gather: bool = False) -> dict:
        """Sends {server: `ops.Request`} to every server, then collects every reply.

        Args:
            requests: what to send where.
            push: the requests are a push: the clock advances first.
            gather: collect failures instead of raising the first one.

        Returns:
            {server: Answer}; with gather, a server's value is the error
            instead where it failed (NoAnswer, ServerUnavailable, the error
            class of an error reply, ProtocolError for a malformed reply).

        Raises:
            InvalidArgument: the session is closed.
            the first failure (without gather): the kvsparse.errors class of
            an error reply, ProtocolError, NoAnswer or ServerUnavailable.
        """
        with self._lock:
            if self._closed:
                raise errors.InvalidArgument("this store is closed")
            if push:
                self._clock += 1
            call = _Call(requests, gather)
            for server, request in requests.items():
                self._attempt(call, server, self._start, call, server, request)
            while call.waiting:
                self._wait(call)
            return call.outcomes

    def security_mechanism(self, server: int) -> int:
        """The ZeroMQ security mechanism of the socket to server (zmq.CURVE with keys)."""
        with self._lock:
            return self._links.socket(server).mechanism

    def close(self) -> None:
        """Closes the sockets (idempotent); a later exchange raises InvalidArgument."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._links.close()

    # -- sending --------------------------------------------------------------------------------

    def _send(self, server: int, request: ops.Request, request_id: Optional[int] = None) -> int:
        if request_id is None:
            request_id = next(self._request_ids)
        header = Header(
            op=int(request.op),
            flags=request.flags,
            request_id=request_id,
            client_id=self._client_id,
            rank=self.rank,
            num_items=request.num_items,
            clock=self._clock,
            num_frames=len(request.frames),
        )
        try:
            self._links.socket(server).send_multipart(
                [header.pack(), *request.frames], copy=False, flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self._links.reset(server)
            raise errors.ServerUnavailable(
                f"server {self.servers[server]} does not take requests (send queue full)",
                address=self.servers[server],
            ) from None
        return request_id

    # -- the exchange loop ------------------------------------------------------------------------

    def _attempt(self, call: _Call, server: int, step, *args) -> None:
        """Runs step(*args) for server; with gather, a failure settles server instead of raising."""
        try:
            step(*args)
        except errors.KVSparseError as exc:
            if not call.gather:
                raise
            if server in call.waiting:
                call.settle(server, exc)
            else:
                call.outcomes[server] = exc

    def _start(self, call: _Call, server: int, request: ops.Request) -> None:
        request_id = self._send(server, request)
        call.waiting[server] = request_id
        call.heard[server] = time.monotonic()
        call.pings[server] = None
        call.drops[server] = 0

    def _deadline(self, call: _Call, server: int) -> float:
        """When server's silence next needs action: a liveness ping, or giving up on it."""
        pinged = call.pings[server] is not None or self.monitor
        return call.heard[server] + (self.timeout if pinged else self.timeout / 2)

    def _wait(self, call: _Call) -> None:
        """One poll: handles what arrived, then what stayed silent too long."""
        if call.poller is None:  # again after a server settled or its socket was replaced
            poller, owners = zmq.Poller(), {}
            for server in call.waiting:
                for sock in (self._links.socket(server), self._links.monitor(server)):
                    poller.register(sock, zmq.POLLIN)
                    owners[sock] = server
            call.poller = (poller, owners)
        poller, owners = call.poller
        due = min(self._deadline(call, server) for server in call.waiting)
        # zmq_poll waits without the GIL; no busy loop.
        events = poller.poll(max(0.0, due - time.monotonic()) * 1000 + 1)
        for sock, _ in events:
            server = owners[sock]
            if server not in call.waiting or (
                sock is not self._links.socket(server) and sock is not self._links.monitor(server)
            ):
                continue  # settled, or a socket a recovery above replaced
            if sock is self._links.monitor(server):
                self._attempt(call, server, self._check_handshake, server)
            else:
                self._attempt(call, server, self._receive, call, server)
        now = time.monotonic()
        for server in list(call.waiting):
            if now >= self._deadline(call, server):
                self._attempt(call, server, self._on_silence, call, server)

    def _check_handshake(self, server: int) -> None:
        refused = self._links.handshake_error(server)
        if refused is None and self.retry_window <= 0:
            # Nothing will come from an address that refuses connections: say so now, not
            # after the timeout (issue 11, defect 11). With a retry window, servers may be
            # (re)starting: the recovery keeps trying, and names the failure at its end.
            refused = self._links.connection_failure(server)
        if refused is not None:
            self._links.reset(server)
            raise refused

    def _receive(self, call: _Call, server: int) -> None:
        """Reads every reply queued on server's socket."""
        sock = self._links.socket(server)
        while server in call.waiting:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            header, payload = protocol.parse_message(frames, reply=True)
            call.heard[server] = time.monotonic()
            if self._restarted(server, header.incarnation):
                # A restarted server. Our request may have reached it anyway (a DEALER
                # delivers what it queued while disconnected on reconnect).
                if header.request_id == call.waiting[server] and not header.status:
                    self._adopt(server, header.incarnation)  # done there: accept the reply
                elif header.request_id in (call.waiting[server], call.pings[server]):
                    seen = 0
                    if header.request_id == call.pings[server]:
                        seen = ops.Ping.decode_reply(header, payload)
                    self._resume(call, server, (header.incarnation, seen))
                    return
                else:
                    continue  # a stray reply; a ping will tell what the server has
            if header.request_id == call.pings[server]:
                call.pings[server] = None
                if self._lost(call, server, ops.Ping.decode_reply(header, payload)):
                    self._send(server, call.requests[server], call.waiting[server])
                continue
            if header.request_id != call.waiting[server]:
                continue  # the reply to an abandoned request
            if header.status:
                protocol.raise_remote_error(header, payload, self.servers[server])
            call.settle(server, Answer(header, payload), (sock, self._links.monitor(server)))

    def _on_silence(self, call: _Call, server: int) -> None:
        if not self.monitor and call.pings[server] is None:
            # Silence: ask whether the server is alive or just deferring the reply (a BSP
            # round, an SSP wait, a barrier).
            call.pings[server] = self._send(server, ops.Ping.encode_request())
            return
        if self.retry_window <= 0:
            self._links.reset(server)
            raise NoAnswer(
                f"server {self.servers[server]} did not answer within {self.timeout:g} s",
                address=self.servers[server],
            )
        self._resume(call, server, None)

    def _resume(self, call: _Call, server: int, evidence) -> None:
        """Recovers server (`_recover`) and waits for the reply to the request sent again."""
        call.waiting[server] = self._recover(
            server, call.requests[server], call.waiting[server], evidence
        )
        call.pings[server] = None
        call.heard[server] = time.monotonic()
        call.poller = None

    def _lost(self, call: _Call, server: int, seen: Optional[int]) -> bool:
        """True if a ping reply shows the server never got the request awaited (resend it).

        Raises:
            ServerUnavailable: without retries, or after `_MAX_RESENDS` resends of it.
        """
        request_id = call.waiting[server]
        if seen is None or seen >= request_id:
            return False
        call.drops[server] += 1
        if self.retry_window <= 0 or call.drops[server] > _MAX_RESENDS:
            raise errors.ServerUnavailable(
                f"server {self.servers[server]} never received request {request_id} (it "
                "answers pings): the message was dropped, most likely for exceeding the "
                "server's --max-message-size, or lost with its connection",
                address=self.servers[server],
            )
        return True

    # -- restarts -------------------------------------------------------------------------------

    def _restarted(self, server: int, incarnation: int) -> bool:
        known = self._incarnations[server]
        return self.retry_window > 0 and bool(known) and bool(incarnation) and incarnation != known

    def _adopt(self, server: int, incarnation: int) -> None:
        self._incarnations[server] = incarnation
        self.restarts += 1

    def _recover(self, server: int, request: ops.Request, request_id: int, evidence) -> int:
        """Reaches a restarted (or silent) server again and resends the request in flight.

        evidence: (incarnation, last request id of ours it saw) from a reply, or
        None to ask with PINGs (on a fresh socket after each unanswered one).

        - The same incarnation (the server was only slow), or a restarted one
          that already has the request (it arrived after the restart): the
          request goes again with its request id, which the server answers
          from its resend record (or, still pending, when done): never applied
          twice.
        - A restarted server that never saw it: the greeting (HELLO), the
          remembered requests (an identical existing table is kept), then the
          request under a new id.

        Returns:
            The request id the reply will carry.

        Raises:
            ServerUnavailable: no answer within retry_window seconds.
            the error of an error reply, if the server refuses this client.
        """
        deadline = time.monotonic() + self.retry_window
        reset = False
        while evidence is None:
            if reset:
                self._links.reset(server)
            ping_id = self._send(server, ops.Ping.encode_request())
            answer = self._await_reply(
                server, ping_id, self._probe_deadline(deadline), in_flight=request_id
            )
            if answer is None:
                if time.monotonic() >= deadline:
                    self._unavailable(server)
                reset = True
                continue
            if answer.header.request_id == request_id:
                # The request in flight was answered meanwhile, as the main loop would have
                # seen it: an error from a restarted server (e.g. "before HELLO") means it
                # was not applied, so it goes again after the greeting, under a new id.
                seen = 0 if answer.header.status else request_id
                evidence = (answer.header.incarnation, seen)
            else:
                evidence = (answer.header.incarnation, ops.Ping.decode_reply(*answer))
        incarnation, seen = evidence
        if not incarnation or incarnation == self._incarnations[server]:
            return self._send(server, request, request_id=request_id)
        if seen is not None and seen >= request_id:
            self._adopt(server, incarnation)
            return self._send(server, request, request_id=request_id)
        greeting = self._greetings.get(server)
        if greeting is not None:
            while True:
                hello_id = self._send(server, greeting)
                answer = self._await_reply(server, hello_id, self._probe_deadline(deadline))
                if answer is not None:
                    break
                if time.monotonic() >= deadline:
                    self._unavailable(server)
                self._links.reset(server)
            incarnation = answer.header.incarnation
        self._adopt(server, incarnation)
        # Tables and dense keys created after the server's last checkpoint are declared
        # again, so that the resent request finds them.
        for replay_server, replay in self._replays.values():
            if replay_server is not None and replay_server != server:
                continue
            replay_id = self._send(server, replay)
            if self._await_reply(server, replay_id, deadline) is None:
                self._unavailable(server)
        return self._send(server, request)

    @staticmethod
    def _probe_deadline(deadline: float) -> float:
        return min(deadline, time.monotonic() + _RECOVERY_PROBE_SECONDS)

    def _unavailable(self, server: int):
        self._links.handshake_error(server)  # reads the monitor's news of failed connects
        failure = self._links.connection_failure(server)
        self._links.reset(server)
        raise errors.ServerUnavailable(
            f"server {self.servers[server]} did not come back within the retry window of "
            f"{self.retry_window:g} s" + (f": {failure}" if failure is not None else ""),
            address=self.servers[server],
        )

    def _await_reply(
        self, server: int, request_id: int, until: float, *, in_flight: Optional[int] = None
    ) -> Optional[Answer]:
        """The reply to request_id on server's socket, or None at `until`.

        in_flight: the id of a request whose reply, error or not, is returned
        too if it comes first (the caller tells them apart by request id).

        Raises:
            the error of an error reply to request_id; ServerUnavailable for a
            refused handshake.
        """
        sock, monitor = self._links.socket(server), self._links.monitor(server)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return None
            events = dict(poller.poll(remaining * 1000 + 1))
            if monitor in events:
                refused = self._links.handshake_error(server)
                if refused is not None:
                    raise refused
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                header, payload = protocol.parse_message(frames, reply=True)
                if in_flight is not None and header.request_id == in_flight:
                    return Answer(header, payload)
                if header.request_id != request_id:
                    continue
                if header.status:
                    protocol.raise_remote_error(header, payload, self.servers[server])
                return Answer(header, payload)


__all__ = ["DEFAULT_TIMEOUT", "Answer", "NoAnswer", "Outcome", "ServerSockets", "Session"]
