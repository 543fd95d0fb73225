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
naming it. A request that a live server holds for other workers fails with
`kvsparse.errors.WaitTimeout` after `HOLD_FACTOR` x ``timeout``, naming the
server and what the request waited for (a BSP round, a barrier, an SSP pull).
A worker's session pings a server that stays silent for half the timeout:
waiting for other workers (a BSP push, an SSP pull, a barrier) is not that
timeout, the server keeps answering pings meanwhile, and a ping reply
that shows the request never arrived (dropped for its size, or lost with a
broken connection) gets it resent. What a server holds for a worker that
left the job fails there with `kvsparse.errors.WorkerLeft`
(`kvsparse.server.liveness`), so such a wait ends too. A monitor's session
(``monitor=True``) does not ping: the server keeps no record of a monitor,
and its requests are answered at once, so the timeout is a plain deadline.

A push may be sent without waiting (``exchange(..., wait=False)``): the
exchange returns once the requests are sent, and the next exchange of the
session (or close) collects the replies first, raising
that push's failure then, before it sends anything. A pull may be sent
before those replies are collected (``exchange(..., pipelined=True)``),
behind the push on each server's connection: a server serves a client's
requests in order (the fast path hands a client's requests to Python while
Python holds one of them), so the pull still reads what the push wrote. The
caller allows it only where a server answers a push once it is applied, not
when it holds it for a BSP round of several workers (the torch adapter's
training thread no longer waits for the acknowledgements, and its next
prefetch does not wait for them before it sends its pull).

A pull may also be sent without waiting (``exchange(..., pipelined=True,
wait=False)``): the exchange returns a `Pending` at once, and its replies are
read later, by `Pending.result` or by the session's next exchange (which
reads every pending exchange's replies, in send order, before it sends
anything that may not go out behind them). A pull's failure is kept for
`Pending.result`; a push's is raised by whatever collects it (the torch
adapter sends the next batch's pull from the training thread and reads it in
the next forward, with no prefetch thread holding the GIL meanwhile).

Threads: one session may be shared by threads (a store used by several
training threads); its lock serializes them, and a thread waiting for
replies hands the session to the others between polls. A pending exchange
stays on the pending list until the thread reading its replies is done with
them: another thread that needs it (its ``result``, or an exchange that must
go out behind it) waits for that, rather than taking its replies as read.

Server restarts (``retry_window`` > 0): a restarted or silent server is
greeted again, sent what `Session.remember` was given, and sent the request
in flight again, at most once applied (`kvsparse.client.recovery.Recovery`).

Security, connection failures and routing ids are the sockets'
(`kvsparse.client.sockets.ServerSockets`): a server that refuses the CurveZMQ
handshake, an address that refuses the connection or a host name that does
not resolve raises ServerUnavailable at once, naming the address and the
reason (with ``retry_window`` > 0 the session keeps trying until the window
ends, then gives the reason).

Example:
    >>> from kvsparse.wire import ops
    >>> session = Session(['tcp://127.0.0.1:1'], timeout=0.1, monitor=True)
    >>> outcome = session.exchange({0: ops.Ping.encode_request()}, gather=True)[0]
    >>> type(outcome).__name__
    'NoAnswer'
    >>> session.close()
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from typing import Callable, Optional, Union

import zmq

from kvsparse import errors
from kvsparse.client.exchange import (
    ReplyPoller,
    WaitLimits,
    await_reply,
    collect_replies,
    refusal,
    send_request,
)
from kvsparse.client.recovery import Answer, Recovery
from kvsparse.client.sockets import ServerSockets
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Header

DEFAULT_TIMEOUT = 60.0
# A request a live server holds for other workers (a BSP round, a barrier, an SSP pull)
# fails with WaitTimeout after HOLD_FACTOR x timeout: long enough for the slowest worker's
# step, but never a wait for ever on a worker that will not push (10 minutes by default).
HOLD_FACTOR = 10.0
# What a held request of each op waits for, named in its WaitTimeout.
_HELD_FOR = {
    protocol.Op.PUSH_SPARSE: "a BSP round: every worker's push of the same sparse tables",
    protocol.Op.PUSH_DENSE: "a BSP round: every worker's push of the same dense keys",
    protocol.Op.BARRIER: "a barrier: every worker's kv.barrier()",
    protocol.Op.PULL_SPARSE: "an SSP pull: the slowest worker's clock",
    protocol.Op.PULL_DENSE: "an SSP pull: the slowest worker's clock",
    protocol.Op.SET_OPTIMIZER: "worker 0's set_optimizer",
    protocol.Op.INIT_DENSE: "the dense key's init by another worker",
}
_MAX_RESENDS = 3  # of a request a live server says it never got
# The longest a thread waiting for replies keeps the session while other threads want it:
# they send their own requests meanwhile (a BSP push of one thread may wait for a round that
# only another thread's push completes), and read replies for each other.
_TURN_SECONDS = 0.02
# What a session in a forked child sends (class docstring, "Fork"); HELLO greets again.
_READ_ONLY_OPS = frozenset(
    {
        protocol.Op.HELLO,
        protocol.Op.PING,
        protocol.Op.PULL_SPARSE,
        protocol.Op.PULL_DENSE,
        protocol.Op.STATS,
    }
)
_SHARED_MEMORY_MISSING = protocol.ERROR_CODES[errors.SharedMemoryMissing]
_LOG = logging.getLogger(__name__)

# Sessions holding exchanges sent with wait=False whose replies are not read yet. Their
# sockets close with LINGER 0, which drops what is still queued: a push sent last, by a
# program that then ends without close(), never reached the servers. At exit their replies
# are read by `_settle_at_exit` (registered after zmq's own exit hook, so it runs before
# it), waiting at most _EXIT_SECONDS for a silent server (a program must not hang at exit on
# a dead one). Weak: a store dropped meanwhile reads them in its finalizer
# (`_goodbye_when_dropped`); held here, every store dropped after a push with wait=False
# (the torch adapter's) stayed alive with its sockets until the process ended (issue 32).
# Such a store is freed by the cyclic collector, not at once: its session and the `Pending`
# of each such exchange refer to each other until the replies are read.
_UNSETTLED: weakref.WeakSet = weakref.WeakSet()
_EXIT_SECONDS = 10.0
# Workers' sessions not closed yet: closed at exit too, so that their servers get a GOODBYE
# (a program that ends without kv.close() ends normally; see `Session.close`).
_GREETED: weakref.WeakSet = weakref.WeakSet()
# The longest a closing session waits for the servers' answers to its GOODBYE.
_GOODBYE_SECONDS = 2.0


@atexit.register
def _settle_at_exit() -> None:
    for session in [*_UNSETTLED, *(s for s in list(_GREETED) if s not in _UNSETTLED)]:
        if session._pid != os.getpid():
            continue  # a forked child's copy: its sockets are the parent's
        try:
            session.limit_waits(_EXIT_SECONDS)
            session.close()
        except Exception as exc:  # noqa: BLE001 - nothing is left to raise it to
            _LOG.error("at exit, a push sent with wait=False failed: %s", exc)


class NoAnswer(errors.ServerUnavailable):
    """A server answered nothing (not even a liveness ping) within the timeout.

    A ServerUnavailable, so callers that catch that catch this too.
    """


Outcome = Union[Answer, errors.KVSparseError]


def _goodbye_when_dropped(
    links, client_id: int, rank: int, request_ids, pid: int, greeted: list, calls: set
):
    """A session dropped without close() (``mx.kv.create`` again and again): says GOODBYE.

    Run by the session's weakref.finalize, so it holds no reference to the
    session: its sockets, ids, the servers it greeted (a list `Session.open`
    fills) and its exchanges still awaited (``calls``: those sent with
    wait=False). It first reads those exchanges' replies, so that what they
    sent reached the servers before the sockets close (LINGER 0 drops what is
    queued; a failure is logged, nobody is left to raise it to), then says
    GOODBYE: the servers count the closed connection as a normal end, not a
    worker that left. Waits at most `_GOODBYE_SECONDS` for each of the two,
    raises nothing (a finalizer runs on whatever thread collected the
    session), and does nothing in a forked child (the sockets are the
    parent's) or for shards served in this process (their store closes them).
    """
    if os.getpid() != pid:
        return
    try:
        _read_unsettled(links, calls, time.monotonic() + _GOODBYE_SECONDS)
        sent = {}
        for server in greeted:
            if server in links.local:
                continue
            header = Header(
                op=int(protocol.Op.GOODBYE),
                request_id=next(request_ids),
                client_id=client_id,
                rank=rank,
                num_frames=0,
            )
            sent[server] = send_request(links, server, header, [])
        if sent:
            collect_replies(links, sent, _GOODBYE_SECONDS)
    except Exception:  # noqa: BLE001 - the connection's end tells the rest
        pass
    finally:
        try:
            links.close()
        except Exception:  # noqa: BLE001 - nothing is left to tell
            pass


def _read_unsettled(links, calls: set, until: float) -> None:
    """Reads the replies of a dropped session's exchanges still awaited, until `until`.

    A failed one is logged (its store is gone); a server still silent at
    `until` is left to the GOODBYE (a push held for a BSP round).
    """
    for call in list(calls):
        for server, request_id in list(call.waiting.items()):
            if server in links.local:
                continue
            answer = await_reply(links, server, (request_id,), until)
            if answer is None or not answer[0].status:
                continue
            try:
                protocol.raise_remote_error(*answer, links.servers[server])
            except errors.KVSparseError as exc:
                op = protocol.Op(call.requests[server].op).name
                _LOG.error(
                    "a %s sent with wait=False by a store dropped unclosed failed: %s", op, exc
                )


def _sending_for(session: Session) -> Callable:
    """session._send, for the session's `Recovery`, without keeping the session alive.

    A bound method there closed a cycle (session -> recovery -> session):
    a dropped store then waited for the cyclic collector, maybe for ever in a
    program that seldom runs it, to say GOODBYE and close its sockets.
    """
    send = weakref.WeakMethod(session._send)

    def send_through_session(*args, **kwargs) -> int:
        return send()(*args, **kwargs)

    return send_through_session


class _Call:
    """What one exchange still waits for (the session's private bookkeeping, one per call)."""

    __slots__ = (
        "requests", "gather", "waiting", "heard", "pings", "drops", "regreeted", "outcomes",
        "poller", "failure", "sent", "held",
    )  # fmt: skip

    def __init__(self, requests: dict, gather: bool):
        self.requests = requests
        self.gather = gather
        self.waiting: dict[int, int] = {}  # server -> request id the reply will carry
        self.heard: dict[int, float] = {}  # server -> when it last said anything
        self.pings: dict[int, Optional[int]] = {}  # server -> request id of a liveness ping
        self.drops: dict[int, int] = {}  # server -> resends of a request it never got
        self.regreeted: set = set()  # servers greeted again for SharedMemoryMissing
        self.outcomes: dict[int, Outcome] = {}
        self.poller: Optional[ReplyPoller] = None  # the servers still awaited
        # The failure another thread read for this call (without gather), raised by its owner.
        self.failure: Optional[errors.KVSparseError] = None
        self.sent: dict[int, float] = {}  # server -> when the request was first sent
        self.held: dict[int, str] = {}  # server -> what its last ping reply said it waits for

    def missing(self) -> bool:
        """Whether some server's reply did not come (not sent, awaited, or failed silently)."""
        return any(not isinstance(self.outcomes.get(s), Answer) for s in self.requests)

    def settle(self, server: int, outcome: Outcome) -> None:
        """Records server's outcome; it is no longer polled."""
        self.outcomes[server] = outcome
        del self.waiting[server]
        if self.poller is not None:
            self.poller.drop(server)


class Pending:
    """An exchange sent with ``wait=False``: its replies, read later (`Session.exchange`).

    `result` returns {server: Answer} once every reply is in: it reads this
    exchange's replies, and first those of the exchanges sent before it.
    """

    __slots__ = ("_session", "_call", "_check", "_raises", "_done", "_error", "_keep", "_reading")

    def __init__(self, session: Session, call: _Call, check, raises: bool, keep=None):
        self._session = session
        self._call = call
        self._check = check
        self._raises = raises  # a push: its failure is raised by whatever collects it
        self._done = False
        self._error: Optional[BaseException] = None
        self._keep = keep  # referenced until the replies are read (`Session.exchange`)
        # A thread reads the replies (`_settle`); it may hand the session to others meanwhile.
        self._reading = False

    @property
    def done(self) -> bool:
        """Whether the replies were read (or the exchange failed)."""
        return self._done

    def result(self) -> dict:
        """{server: Answer} of this exchange.

        Raises:
            its failure (the kvsparse.errors class of an error reply,
            ProtocolError, NoAnswer, ServerUnavailable), or that of a push
            sent before it with wait=False (this exchange is then abandoned,
            and raises that failure again if asked again).
        """
        if not self._done:
            self._session._settle_through(self)
        if self._error is not None:
            raise self._error
        return self._call.outcomes

    def _settle(self) -> None:
        """Reads the replies (the session's lock held); a push's failure is raised."""
        call = self._call
        now = time.monotonic()
        for server in call.waiting:
            call.heard[server] = now  # silence counts from now: the replies may be queued
        self._reading = True
        try:
            self._session._await(call)
            if self._check is not None:
                self._check(call.outcomes)
        except errors.KVSparseError as exc:
            self._error = exc
            self._lose()
            if self._raises:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note("(the failure of an earlier push, sent with wait=False)")
                raise
        except BaseException as exc:  # an interrupt: this exchange's replies are lost
            self._error = exc
            self._lose()
            raise
        finally:
            self._done = True
            self._reading = False
            self._keep = None
            self._session._calls.discard(call)
            self._session._turns.notify_all()  # threads waiting for it (`_settle_through`)

    def _abandon(self, cause: BaseException) -> None:
        """A push sent before this exchange failed: its replies are never read."""
        self._error = cause
        self._done = True
        self._session._calls.discard(self._call)
        self._lose()

    def _left_to(self, parent: int) -> None:
        """In a forked child: the exchange is the parent's, whose sockets get its replies."""
        self._error = errors.ForkedStore(
            f"this exchange was sent by pid {parent} before the fork: its replies go there"
        )
        self._done = True
        self._keep = None

    def _lose(self) -> None:
        """Hands what the exchange keeps to the session's on_lost if a reply is missing."""
        if self._keep is not None and self._call.missing():
            self._session._lose_kept(self._keep)
        self._keep = None


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
        local: {server index: endpoint} of shards served in this process
            (colocated mode; see `kvsparse.client.local`).

    Thread safety: a session may be shared by threads. The sockets are used
    under a lock (ZeroMQ sockets are not thread-safe), but a thread waiting
    for replies hands the session over to other threads every
    `_TURN_SECONDS` while they want it: they send their requests meanwhile,
    and each thread reads the replies that arrive for any of them. So a push
    held for a BSP round does not keep another thread's push (which may be
    what completes a round) from going out.

    Fork: a session used in a process forked from the one that made it
    opens fresh sockets there (a new ZeroMQ context: one must not be used
    across fork), with a new client id, and greets the servers again with
    the same rank (without the parent's shared memory), before its first
    request. There it only reads: PULL_SPARSE, PULL_DENSE and STATS go out;
    anything else raises `kvsparse.errors.ForkedStore` at once, since the
    parent is the worker that pushes, meets barriers and saves. A colocated
    session (``local``) raises ForkedStore for everything in a child.

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
        local: Optional[dict] = None,
    ):
        self.servers = list(servers)
        self.rank = int(rank)
        # Shared with the recovery: one place for how long this session waits.
        self._limits = WaitLimits(
            DEFAULT_TIMEOUT if timeout is None else float(timeout), retry_window
        )
        self.keys = keys
        self.monitor = bool(monitor)
        self._client_id = secrets.randbits(64)
        self._request_ids = itertools.count(1)
        self._clock = 0
        self._lock = threading.RLock()
        self._turns = threading.Condition(self._lock)
        self._wanting = 0  # threads waiting to take the lock, or for their turn
        self._wanting_lock = threading.Lock()
        self._calls: set[_Call] = set()  # exchanges whose replies are awaited
        self._forked_from: Optional[int] = None  # the pid that made this session, in a child
        self._parent_links: list = []  # sockets of the parent's context: never used here
        # server -> the largest frame it receives (its HELLO reply): a bigger one is refused
        # here, before anything is sent, rather than dropped there with the connection.
        self._frame_limits: dict[int, int] = {}
        self._closed = False
        self._pid = os.getpid()
        # Exchanges sent with wait=False whose replies are not read yet, in send order.
        self._deferred: list[Pending] = []
        self._links = ServerSockets(self.servers, keys, self._client_id, local)
        # Called with an exchange's `keep` when some reply of it never came (the server may
        # still read or write what it names: `kvsparse.client.shared`).
        self.on_lost: Optional[Callable[[list], None]] = None
        self._recovery = Recovery(self.servers, self._links, _sending_for(self), self._limits)
        self._greeted: list = []  # servers open() greeted: told GOODBYE if the session is dropped
        self._dropped = self._finalizer()

    def _finalizer(self) -> weakref.finalize:
        """Says GOODBYE if this session is dropped without close() (`_goodbye_when_dropped`)."""
        dropped = weakref.finalize(
            self,
            _goodbye_when_dropped,
            self._links,
            self._client_id,
            self.rank,
            self._request_ids,
            self._pid,
            self._greeted,
            self._calls,
        )
        dropped.atexit = False  # at exit, _settle_at_exit closes what is still open
        return dropped

    @contextlib.contextmanager
    def _locked(self):
        """Holds the session's lock, counted as wanting it while blocked (see `_await`)."""
        if self._pid != os.getpid():
            self._reopen_after_fork()
        with self._wanting_lock:
            self._wanting += 1
        try:
            self._lock.acquire()
        finally:
            with self._wanting_lock:
                self._wanting -= 1
        try:
            yield
        finally:
            if self._wanting:
                self._turns.notify_all()
            self._lock.release()

    def _reopen_after_fork(self) -> None:
        """In a forked child: fresh locks, sockets and client id, then HELLO again.

        The parent's locks may have been held by its other threads at the
        fork, and its sockets belong to its ZeroMQ context: neither is used
        here (the sockets are kept, never closed, from this process).
        """
        parent = self._forked_from if self._forked_from is not None else self._pid
        self._pid = os.getpid()
        self._forked_from = parent
        self._lock = threading.RLock()
        self._turns = threading.Condition(self._lock)
        self._wanting_lock = threading.Lock()
        self._wanting = 0
        self._calls = set()
        for pending in self._deferred:  # the parent's: the parent reads their replies
            pending._left_to(parent)
        self._deferred = []
        self._parent_links.append(self._links)
        self.on_lost = None
        if self._closed:
            return
        if self._links.local:
            self._closed = True
            raise errors.ForkedStore(
                f"a colocated store cannot be used in a process forked from pid {parent}; "
                "create a store in the child"
            )
        greetings = {
            server: ops.Hello.without_shared(request)
            for server, request in self._recovery.greetings.items()
        }
        self._client_id = secrets.randbits(64)
        self._links = ServerSockets(self.servers, self.keys, self._client_id)
        self._recovery = Recovery(self.servers, self._links, _sending_for(self), self._limits)
        self._dropped.detach()  # the parent's sockets: never used here
        self._greeted = []
        self._dropped = self._finalizer()
        if greetings:
            self.open(greetings)

    def _check_forked(self, requests: dict) -> None:
        """In a forked child only lookups go out (ForkedStore otherwise; class docstring)."""
        if self._forked_from is None:
            return
        for request in requests.values():
            if request.op not in _READ_ONLY_OPS:
                raise errors.ForkedStore(
                    f"{protocol.Op(request.op).name} from a process forked from pid "
                    f"{self._forked_from} (this store's process): a store in a forked child "
                    "(a data-loader worker) only looks rows up; push, barrier, init, "
                    "set_optimizer and checkpoints belong to the parent, or to a store "
                    "created in the child"
                )

    def _await(self, call: _Call) -> None:
        """Reads replies until call has all of them (the lock held), taking turns.

        Between polls, while other threads want the session, it is handed to
        them for at most `_TURN_SECONDS` (`threading.Condition.wait` releases
        the lock however deep it is held); a reply one thread reads for
        another's call is recorded there (`_deliver`).

        Raises:
            the call's failure, as `exchange` describes it.
        """
        while call.waiting and call.failure is None:
            self._wait(call)
            if call.waiting and call.failure is None and self._wanting:
                self._turns.notify_all()
                with self._wanting_lock:
                    self._wanting += 1
                try:
                    self._turns.wait(_TURN_SECONDS)
                finally:
                    with self._wanting_lock:
                        self._wanting -= 1
        if call.failure is not None:
            raise call.failure

    # -- the public surface -------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        """Seconds of silence from a server before NoAnswer (see the class docstring)."""
        return self._limits.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._limits.timeout = float(seconds)

    @property
    def retry_window(self) -> float:
        """Seconds to keep trying to reach a restarted or silent server (0: no retry)."""
        return self._limits.retry_window

    @property
    def restarts(self) -> int:
        """Server restarts this session recovered from."""
        return self._recovery.restarts

    @property
    def clock(self) -> int:
        """Pushes this client made (`exchange` with push=True), sent in every header."""
        return self._clock

    def resume(self, clock: int) -> None:
        """Sets the clock of a restarted worker that resumes after clock pushes (never back).

        `kvsparse.store.colocated`: a colocated worker restarted with its shard.
        """
        with self._locked():
            self._clock = max(self._clock, int(clock))

    def open(self, greetings: dict) -> dict:
        """Greets each server: {server: HELLO request} -> {server: Answer}.

        The greetings are sent again to a server that restarted; the
        incarnation in each reply is the one a restart changes.

        Raises:
            what `exchange` raises.
        """
        with self._locked():
            answers = self.exchange(greetings)
            self._recovery.greeted(greetings, answers)
            self._greeted[:] = sorted(greetings)
            _GREETED.add(self)
            for server, answer in answers.items():
                limit = ops.Hello.decode_reply(answer.header, answer.payload).max_message_size
                if limit >= 0:
                    self._frame_limits[server] = limit
            return answers

    def remember(
        self, key, request: ops.Request, server: Optional[int] = None, last: bool = False
    ) -> None:
        """Replays request (after the greeting) to every server that restarts (or to server).

        key: a later request under the same key replaces this one (e.g. a
        table id: the table's INIT_SPARSE). server: only that server gets
        it (a dense key's INIT_DENSE carries its slice). last: replayed after
        every request remembered so far (else in the place of the one replaced).
        """
        with self._locked():
            self._recovery.remember(key, request, server, last)

    def exchange(
        self,
        requests: dict,
        *,
        push: bool = False,
        gather: bool = False,
        wait: bool = True,
        check: Optional[Callable[[dict], object]] = None,
        pipelined: bool = False,
        keep: Optional[list] = None,
    ) -> dict:
        """Sends {server: `ops.Request`} to every server, then collects every reply.

        Args:
            requests: what to send where.
            push: the requests are a push: the clock advances first.
            gather: collect failures instead of raising the first one.
            wait: False (a push, or a pipelined pull; no gather): return a
                `Pending` once the requests are sent. The next exchange or
                `close` reads the replies of every pending exchange first; a
                push's check({server: Answer}) runs on them then and its
                failure is raised, before anything else is sent. A pull's
                replies, or its failure, wait for `Pending.result`.
            check: see wait (it raises what is wrong in a push's replies).
            pipelined: True (not a push, no gather): the requests may go out
                before the replies of pending exchanges are read (module
                docstring); if a pending push failed, its failure is raised and
                the requests are abandoned (a pull changes nothing).
            keep: objects referenced until every reply is read (the
                shared-memory rows the servers write or read); if the exchange
                fails with a reply missing, they go to `on_lost` instead.

        Returns:
            {server: Answer}; with gather, a server's value is the error
            instead where it failed (NoAnswer, ServerUnavailable, the error
            class of an error reply, ProtocolError for a malformed reply).
            With wait=False, a `Pending`.

        Raises:
            InvalidArgument: the session is closed, or wait=False with
                gather, or for a pull that is not pipelined.
            the first failure (without gather): the kvsparse.errors class of
            an error reply, ProtocolError, NoAnswer or ServerUnavailable; a
            failure of an earlier push sent with wait=False.
        """
        if not wait and (gather or not (push or pipelined)):
            raise errors.InvalidArgument(
                "exchange(wait=False) is for a push, or a pipelined pull, without gather"
            )
        if pipelined and (gather or push):
            raise errors.InvalidArgument("exchange(pipelined=True) is for a pull without gather")
        with self._locked():
            if self._closed:
                raise errors.InvalidArgument("this store is closed")
            behind = pipelined and bool(self._deferred)
            if not behind:
                self._settle_deferred()
            self._check_forked(requests)
            self._check_sizes(requests)
            if push:
                self._clock += 1
            call = _Call(requests, gather)
            self._calls.add(call)
            deferred = False
            try:
                for server, request in requests.items():
                    self._attempt(call, server, self._start, call, server, request)
                if not wait:
                    pending = Pending(self, call, check, raises=push, keep=keep)
                    self._deferred.append(pending)
                    _UNSETTLED.add(self)
                    deferred = True
                    return pending
                if behind:
                    # Each server answers the exchanges before first: their replies precede
                    # this call's.
                    self._settle_deferred()
                self._await(call)
            except BaseException:
                if keep is not None and call.missing():
                    self._lose_kept(keep)
                raise
            finally:
                if not deferred:
                    self._calls.discard(call)
            return call.outcomes

    def _check_sizes(self, requests: dict) -> None:
        """Refuses requests with a frame bigger than its server receives (nothing is sent).

        Raises:
            LimitExceeded: naming the size, the server's limit and the flag that raises it.
        """
        for server, request in requests.items():
            limit = self._frame_limits.get(server)
            if limit is None:
                continue
            size = max((memoryview(frame).nbytes for frame in request.frames), default=0)
            if size > limit:
                op = protocol.Op(request.op).name
                raise errors.LimitExceeded(
                    f"a {op} request of {size} bytes (one frame) exceeds the "
                    f"--max-message-size of server {self.servers[server]} ({limit} bytes), "
                    "which would drop it; send fewer rows per call, or start the servers "
                    "with a larger `kvsparse server --max-message-size` (-1: no limit)"
                )

    def _lose_kept(self, keep: list) -> None:
        if self.on_lost is not None:
            self.on_lost(keep)

    def security_mechanism(self, server: int) -> int:
        """The ZeroMQ security mechanism of the socket to server (zmq.CURVE with keys)."""
        with self._locked():
            return self._links.socket(server).mechanism

    def close(self) -> None:
        """Collects a pending push's replies, then closes the sockets (idempotent).

        A later exchange raises InvalidArgument.

        Raises:
            the failure of a push sent with wait=False (the sockets are closed
            all the same).
        """
        if self._pid != os.getpid():
            self._closed = True  # a forked child's copy: nothing of the parent's to close
        with self._locked():
            if self._closed:
                return
            self._dropped.detach()  # closed here: GOODBYE below
            try:
                self._settle_deferred()
            finally:
                try:
                    self._say_goodbye()
                finally:
                    self._closed = True
                    _UNSETTLED.discard(self)
                    _GREETED.discard(self)
                    self._links.close()

    def _say_goodbye(self) -> None:
        """Tells each greeted server that this worker closed its store (GOODBYE).

        Its connection closing is then a normal end, which the servers do not
        warn about. Waits at most `_GOODBYE_SECONDS`; a server that does not
        answer is left to notice the closed connection.
        """
        greeted = list(self._recovery.greetings)
        if not greeted or self.monitor:
            return
        limits = self._limits
        saved = limits.timeout, limits.retry_window
        limits.timeout, limits.retry_window = min(limits.timeout, _GOODBYE_SECONDS), 0.0
        try:
            self.exchange({s: ops.Goodbye.encode_request() for s in greeted}, gather=True)
        except errors.KVSparseError:
            pass  # closing anyway: the connection's end tells the rest
        finally:
            limits.timeout, limits.retry_window = saved

    def limit_waits(self, seconds: float) -> None:
        """Caps the timeout and the retry window at seconds (a retry window stays on)."""
        with self._locked():
            self._limits.cap(seconds)

    def _settle_deferred(self) -> None:
        """Reads the replies of every exchange sent with wait=False (the lock held)."""
        if self._deferred:
            self._settle_through(self._deferred[-1])

    def _settle_through(self, last: Pending) -> None:
        """Reads the replies of the pending exchanges up to last, in send order.

        A push's failure is raised; the exchanges sent after it are abandoned
        (a pull changes nothing; a later push went out only where pulls may
        follow pending pushes, so it is also one whose failure is raised).
        """
        with self._locked():
            try:
                while not last.done:
                    pending = self._deferred[0]
                    if pending._reading:
                        # Another thread reads its replies and handed this one a turn
                        # (`_await`): wait until it is done, or this thread would go on
                        # (or return last's result) without them.
                        self._turns.notify_all()
                        self._turns.wait(_TURN_SECONDS)
                        continue
                    try:
                        pending._settle()
                    except errors.KVSparseError as exc:
                        for later in self._deferred[1:]:
                            later._abandon(exc)
                        del self._deferred[1:]
                        raise
                    finally:
                        self._deferred.remove(pending)  # done: read, or failed
            finally:
                if not self._deferred:
                    _UNSETTLED.discard(self)

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
        send_request(self._links, server, header, request.frames)
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
        call.heard[server] = call.sent[server] = time.monotonic()
        call.pings[server] = None
        call.drops[server] = 0

    def _deadline(self, call: _Call, server: int) -> float:
        """When server's silence next needs action: a liveness ping, or giving up on it."""
        pinged = call.pings[server] is not None or self.monitor
        silence = call.heard[server] + (self.timeout if pinged else self.timeout / 2)
        if self.monitor:
            return silence
        return min(silence, call.sent[server] + HOLD_FACTOR * self.timeout)

    def _wait(self, call: _Call) -> None:
        """One poll (`kvsparse.client.exchange.ReplyPoller`): what arrived, then what stayed
        silent too long."""
        if call.poller is None or not call.poller.covers(call.waiting):
            # First, or after a server settled or another thread's exchange replaced a socket.
            call.poller = ReplyPoller(self._links, call.waiting)
        due = min(self._deadline(call, server) for server in call.waiting)
        # At most a turn: another thread may want the session meanwhile (`_await`).
        wait = min(max(0.0, due - time.monotonic()), _TURN_SECONDS)
        for server, from_monitor in call.poller.poll(wait):
            if server not in call.waiting:
                continue  # settled meanwhile
            if from_monitor:
                self._attempt(call, server, self._check_handshake, server)
            else:
                self._attempt(call, server, self._receive, call, server)
        now = time.monotonic()
        for server in list(call.waiting):
            if now >= self._deadline(call, server):
                self._attempt(call, server, self._on_silence, call, server)

    def _check_handshake(self, server: int) -> None:
        # Nothing will come from an address that refuses connections: say so now, not after
        # the timeout. With a retry window, servers may be (re)starting: the recovery keeps
        # trying, and names the failure at its end.
        refused = refusal(self._links, server, unreachable=self.retry_window <= 0)
        if refused is not None:
            self._links.reset(server)
            raise refused

    def _receive(self, call: _Call, server: int) -> None:
        """Reads every reply queued on server's socket (those of other calls go to them)."""
        sock = self._links.socket(server)
        while server in call.waiting and call.failure is None:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            header, payload = protocol.parse_message(frames, reply=True)
            owner = self._owner(call, server, header.request_id)
            if owner is not None and owner is not call:
                self._deliver(owner, server, header, payload)
            elif self._handle(call, server, header, payload):
                return

    def _owner(self, call: _Call, server: int, request_id: int) -> Optional[_Call]:
        """The awaited call (call first) whose request or ping to server has request_id."""
        for candidate in (call, *self._calls):
            if server in candidate.waiting and request_id in (
                candidate.waiting[server],
                candidate.pings.get(server),
            ):
                return candidate
        return None

    def _deliver(self, owner: _Call, server: int, header: Header, payload) -> None:
        """Handles a reply read for another thread's call; a failure is kept for its owner."""
        try:
            self._handle(owner, server, header, payload)
        except errors.KVSparseError as exc:
            if server in owner.waiting:
                owner.settle(server, exc)
            else:
                owner.outcomes[server] = exc
            if not owner.gather and owner.failure is None:
                owner.failure = exc

    def _handle(self, call: _Call, server: int, header: Header, payload) -> bool:
        """Handles one reply from server for call; True if the socket must not be read on."""
        call.heard[server] = time.monotonic()
        if self._recovery.restarted(server, header.incarnation):
            # A restarted server. Our request may have reached it anyway (a DEALER
            # delivers what it queued while disconnected on reconnect).
            if header.request_id == call.waiting[server] and not header.status:
                self._recovery.adopt(server, header.incarnation)  # done there: accept the reply
            elif header.request_id in (call.waiting[server], call.pings[server]):
                seen = 0
                if header.request_id == call.pings[server]:
                    seen = ops.Ping.decode_reply(header, payload)
                self._resume(call, server, (header.incarnation, seen))
                return True
            else:
                return False  # a stray reply; a ping will tell what the server has
        if header.request_id == call.pings[server]:
            call.pings[server] = None
            call.held[server] = ops.Ping.decode_held(payload)
            if self._lost(call, server, ops.Ping.decode_reply(header, payload)):
                self._send(server, call.requests[server], call.waiting[server])
            return False
        if header.request_id != call.waiting[server]:
            return False  # the reply to an abandoned request
        if header.status == _SHARED_MEMORY_MISSING and server not in call.regreeted:
            # A server that restarted since our HELLO, reached without a greeting (a
            # request of ours it answered made us adopt it): greet it again, which
            # maps the segment, and resend (it applied nothing). Once per call.
            call.regreeted.add(server)
            call.waiting[server] = self._recovery.greet_again(
                server, call.requests[server], time.monotonic() + self.timeout
            )
            call.heard[server] = time.monotonic()
            call.poller = None
            return False
        if header.status:
            protocol.raise_remote_error(header, payload, self.servers[server])
        call.settle(server, Answer(header, payload))
        return False

    def _on_silence(self, call: _Call, server: int) -> None:
        held = time.monotonic() - call.sent[server]
        if not self.monitor and held >= HOLD_FACTOR * self.timeout:
            op = protocol.Op(call.requests[server].op)
            what = _HELD_FOR.get(op, "other workers")
            said = call.held.get(server)
            if said:
                what += f" (the server said: {said})"
            raise errors.WaitTimeout(
                f"{op.name} request {call.waiting[server]} to server {self.servers[server]} "
                f"was held {held:.0f} s (the server is alive) waiting for {what}; held "
                "requests wait at most "
                f"{HOLD_FACTOR:g} x the store's timeout ({self.timeout:g} s, "
                "KVSPARSE_TIMEOUT or timeout=). Does every worker make the same calls?"
            )
        if not self.monitor and call.pings[server] is None:
            # Silence: ask whether the server is alive or just deferring the reply (a BSP
            # round, an SSP wait, a barrier).
            call.pings[server] = self._send(server, ops.Ping.encode_request())
            return
        if self.retry_window <= 0:
            # A refused handshake reported but not read yet is the better answer.
            refused = self._links.handshake_error(server)
            state = self._links.connection_state(server)
            self._links.reset(server)
            if refused is not None:
                raise refused
            raise NoAnswer(
                f"server {self.servers[server]} did not answer within {self.timeout:g} s ({state})",
                address=self.servers[server],
            )
        self._resume(call, server, None)

    def _resume(self, call: _Call, server: int, evidence) -> None:
        """Recovers server (`Recovery.recover`); waits for the reply to the request sent again."""
        call.waiting[server] = self._recovery.recover(
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


__all__ = ["DEFAULT_TIMEOUT", "HOLD_FACTOR", "Answer", "NoAnswer", "Outcome", "Pending", "Session"]
