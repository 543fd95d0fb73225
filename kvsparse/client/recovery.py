"""Bringing a restarted or silent server back into a client session.

Every reply carries the server's random incarnation. When it changes (the
server was restarted, e.g. from a checkpoint by the launcher), or when a
server stops answering, `Recovery.recover` greets it again (the HELLO given to
`kvsparse.client.session.Session.open`, retrying until the session's
``retry_window`` has passed, then ServerUnavailable), replays what
`Recovery.remember` was given (the tables and dense keys this client
created, rank 0's last set_optimizer), and resends the request in flight:
under its own request id if the server has it (a server applies a request id
at most once), else under a new one. What a restarted server holds is what it
restored (its last checkpoint): pushes acknowledged after that checkpoint are
not replayed.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

from kvsparse import errors
from kvsparse.client.exchange import WaitLimits, await_reply, refusal
from kvsparse.client.sockets import ServerSockets
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Header

_RECOVERY_PROBE_SECONDS = 1.0  # wait per PING or HELLO to a restarting server


class Answer(NamedTuple):
    """A successful reply: its header and payload frames (immutable)."""

    header: Header
    payload: list


class Recovery:
    """What a session needs to bring a server back: incarnations, greetings, replays.

    Args:
        servers: the session's server addresses.
        links: the session's sockets (a failed probe replaces a socket).
        send: ``send(server, request, request_id=None) -> request id``, the
            session's way to send (it writes the header).
        limits: the session's `WaitLimits` (its retry_window: seconds to keep
            trying before ServerUnavailable), shared, not copied.

    Threads: not thread-safe; its session calls it under the session's lock.
    """

    def __init__(self, servers: list, links: ServerSockets, send: Callable, limits: WaitLimits):
        self.servers = servers
        self._limits = limits
        self.restarts = 0  # server restarts this session recovered from
        self._links = links
        self._send = send
        self._incarnations = [0] * len(servers)
        self._greetings: dict[int, ops.Request] = {}
        self._replays: dict = {}

    def greeted(self, greetings: dict, answers: dict) -> None:
        """Keeps the HELLO requests to send again, and each server's first incarnation."""
        self._greetings = dict(greetings)
        for server, answer in answers.items():
            self._incarnations[server] = answer.header.incarnation

    @property
    def retry_window(self) -> float:
        """The session's retry window now (`WaitLimits`)."""
        return self._limits.retry_window

    @property
    def greetings(self) -> dict:
        """{server: the HELLO request kept by `greeted`} (a copy)."""
        return dict(self._greetings)

    def remember(
        self, key, request: ops.Request, server: Optional[int] = None, last: bool = False
    ) -> None:
        """Replays request (after the greeting) to every server that restarts (or to server).

        key: a later request under the same key replaces this one (e.g. a
        table id: the table's INIT_SPARSE). server: only that server gets
        it (a dense key's INIT_DENSE carries its slice). last: replayed after
        every request remembered so far (else in the place of the one replaced).
        """
        if last:
            self._replays.pop(key, None)
        self._replays[key] = (server, request)

    def restarted(self, server: int, incarnation: int) -> bool:
        """Whether a reply's incarnation shows server restarted (only with retries on)."""
        known = self._incarnations[server]
        return self.retry_window > 0 and bool(known) and bool(incarnation) and incarnation != known

    def adopt(self, server: int, incarnation: int) -> None:
        """Takes incarnation as server's from now on, counting one recovered restart."""
        self._incarnations[server] = incarnation
        self.restarts += 1

    def recover(self, server: int, request: ops.Request, request_id: int, evidence) -> int:
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
            self.adopt(server, incarnation)
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
        self.adopt(server, incarnation)
        # Tables and dense keys created after the server's last checkpoint are declared
        # again, so that the resent request finds them.
        for replay_server, replay in self._replays.values():
            if replay_server is not None and replay_server != server:
                continue
            replay_id = self._send(server, replay)
            if self._await_reply(server, replay_id, deadline) is None:
                self._unavailable(server)
        return self._send(server, request)

    def greet_again(self, server: int, request: ops.Request, deadline: float) -> int:
        """Sends server its greeting (HELLO) again, then request under a new id.

        For a server that lost what its greeting set up (a restarted one, adopted
        from a reply, that holds no shared segment of ours). Returns the request
        id the reply will carry.

        Raises:
            ServerUnavailable: no answer to the greeting by deadline.
            the error of an error reply to the greeting.
        """
        greeting = self._greetings.get(server)
        if greeting is not None:
            hello_id = self._send(server, greeting)
            answer = self._await_reply(server, hello_id, deadline)
            if answer is None:
                self._unavailable(server)
        return self._send(server, request)

    @staticmethod
    def _probe_deadline(deadline: float) -> float:
        return min(deadline, time.monotonic() + _RECOVERY_PROBE_SECONDS)

    def _unavailable(self, server: int):
        failure = refusal(self._links, server, unreachable=True)
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
        accepted = (request_id,) if in_flight is None else (request_id, in_flight)
        # A restarting server may refuse connections for a while: not an error here.
        answer = await_reply(self._links, server, accepted, until, unreachable=False)
        if answer is None:
            return None
        header, payload = answer
        if header.request_id == request_id and header.request_id != in_flight and header.status:
            protocol.raise_remote_error(header, payload, self.servers[server])
        return Answer(header, payload)


__all__ = ["Answer", "Recovery"]
