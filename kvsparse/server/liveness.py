"""Which workers are still connected to this server, and what happens when one leaves.

Under BSP a worker that exited (cleanly or killed) once left the others
blocked for ever, answering their liveness pings all along. Now:

1. The event loop reports every closed connection (`kvsparse.server.loop`):
   a worker process that exits or is killed has its socket closed by the
   kernel, and ZeroMQ's heartbeats close the connection of a peer that
   stopped answering (a stopped process, a host that died).
2. A closure does not say whose connection it was, so `REJOIN_SECONDS`
   later `Liveness` asks the socket, for every worker it knows, whether its
   routing id is still connected (`EventLoop.routable`; a probe is a PING
   reply with request id 0, which a client drops). A client names its
   sockets itself (`kvsparse.client.session`), so a worker whose connection
   broke and was re-made by ZeroMQ meanwhile is still there.
3. A rank with no client left is gone: `Coordination.rank_left` fails every
   held request that waits for it with `kvsparse.errors.WorkerLeft`, naming
   the rank, and so does every later request that would wait for it, until
   the rank says anything again (a new store with that rank, or the same
   client after a stop). The server logs both on stderr. Once no worker is
   connected at all the job is over: the next job's workers, which may
   connect one by one, wait for each other again.

4. With a rejoin window (``rejoin_window`` > 0: colocated workers that
   ``kvsparse launch --restart-workers`` starts again), a rank found gone is
   given that many seconds to come back before step 3 happens to it: the
   requests that wait for it stay held meanwhile, and a restarted worker's
   HELLO brings it back.

Only workers are tracked (clients that said HELLO): a monitor (``kvsparse
stats``) or a bare ping never holds anyone up.

This follows ps-lite's split (a heartbeat per node, and the scheduler
marking nodes dead after a timeout) without a scheduler: each server learns
it from its own sockets, and answers only the requests it holds.

Threads: not thread-safe; the server's event loop thread only.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import Op

# How long a worker whose connection closed has to be connected again (ZeroMQ reconnects
# every 0.1 s) before it counts as gone.
REJOIN_SECONDS = 1.0
_GONE_KEPT = 4096  # clients remembered after they left, so that one that comes back is known


class Liveness:
    """The workers connected to one server; ranks that left are reported to coordination.

    Args:
        coordination: the server's `kvsparse.server.coordination.Coordination`.
        routable: ``routable(routing, frames) -> bool`` (`EventLoop.routable`).
        call_later: ``call_later(seconds, callback)`` (`EventLoop.call_later`).
        incarnation: stamped on the probes.
        log: where a rank's leaving and coming back are told (default: stderr).
        rejoin_window: seconds a rank found gone has to come back before it
            counts as left (0: at once).
        on_client: ``on_client(client_id, routing)`` when a worker is tracked from
            now on or speaks on a new routing id, ``on_client(client_id, None)``
            when it is found gone (`kvsparse.server.fastpath`); None: nobody.

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(
        self,
        coordination,
        routable: Callable[[bytes, list], bool],
        call_later: Callable[[float, Callable[[], None]], None],
        incarnation: int,
        log: Callable[[str], None] | None = None,
        rejoin_window: float = 0.0,
        on_client: Callable[[int, bytes | None], None] | None = None,
    ):
        self._coordination = coordination
        self._routable = routable
        self._call_later = call_later
        self._incarnation = incarnation
        self._log = log or _log_to_stderr
        self._clients: dict[int, list] = {}  # client id -> [rank, routing id]
        self._gone: dict[int, int] = {}  # client id -> rank, of clients found gone
        self._probing = False
        self._rejoin_window = float(rejoin_window)
        # Ranks found gone and given the rejoin window to come back -> that window's token.
        self._awaited: dict[int, object] = {}
        self._on_client = on_client or (lambda client_id, routing: None)

    def joined(self, client_id: int, rank: int, routing: bytes) -> None:
        """A worker's HELLO was accepted: it is tracked from now on."""
        self._gone.pop(client_id, None)
        self._clients[client_id] = [rank, routing]
        self._on_client(client_id, routing)
        self._back(rank)

    def goodbye(self, client_id: int) -> None:
        """A worker closed its store (GOODBYE): a normal end, logged only if it hurts.

        The client is no longer tracked, so its closed connection is no
        departure. If no other client of its rank remains, the rank has left
        the job: what waits for it fails with WorkerLeft now (and later
        requests that would wait for it), and that is logged, since the other
        workers could not finish without it. Nothing is logged otherwise. With
        a rejoin window, the rank is waited for as after a closed connection.
        """
        entry = self._clients.pop(client_id, None)
        if entry is None:
            return
        self._on_client(client_id, None)
        rank = entry[0]
        if self._rejoin_window > 0:
            # Workers the launcher restarts (colocated): a store closed by a failing worker
            # may come back, so its rank gets the rejoin window, as a closed connection does.
            self._gone[client_id] = rank
            self.disconnected()
            return
        present = self._present()
        if rank not in present:
            self._awaited.pop(rank, None)
            failed = self._coordination.rank_left(rank, "it closed its store")
            if failed:
                self._log(
                    f"worker rank {rank} closed its store; failed {failed} request(s) "
                    "waiting for it"
                )
        if not present:
            # Every worker is done: the next job's workers may connect one by one.
            for left in list(self._coordination.left):
                self._coordination.rank_back(left)

    def heard(self, client_id: int, routing: bytes) -> None:
        """Any message from client_id (cheap: called for every message)."""
        entry = self._clients.get(client_id)
        if entry is not None:
            if entry[1] != routing:
                entry[1] = routing  # a replaced socket's new routing id
                self._on_client(client_id, routing)
            return
        rank = self._gone.pop(client_id, None)
        if rank is not None:  # a client found gone speaks again (e.g. it was stopped)
            self._clients[client_id] = [rank, routing]
            self._on_client(client_id, routing)
            self._back(rank)

    def disconnected(self) -> None:
        """A connection closed: the workers are probed `REJOIN_SECONDS` from now."""
        if self._clients and not self._probing:
            self._probing = True
            self._call_later(REJOIN_SECONDS, self._probe)

    def check(self) -> None:
        """After a request was held: fails it at once if it waits for a rank that left."""
        self._coordination.fail_stuck()

    def _probe(self) -> None:
        self._probing = False
        probe = ops.Ping.encode_reply(0).frames
        for client_id, (rank, routing) in list(self._clients.items()):
            header = protocol.Header(
                op=int(Op.PING),
                client_id=client_id,
                rank=rank,
                num_frames=len(probe),
                incarnation=self._incarnation,
            )
            if not self._routable(routing, [header.pack(), *probe]):
                del self._clients[client_id]
                self._gone[client_id] = rank
                self._on_client(client_id, None)
        while len(self._gone) > _GONE_KEPT:
            del self._gone[next(iter(self._gone))]
        present = self._present()
        left = self._coordination.left
        for rank in sorted(set(self._gone.values()) - present - set(left) - set(self._awaited)):
            when = time.strftime("%H:%M:%S")
            why = f"its connection closed at {when}: it exited, was killed or stopped answering"
            if self._rejoin_window > 0:
                token = self._awaited[rank] = object()
                self._log(
                    f"worker rank {rank} is gone ({why}); waiting up to "
                    f"{self._rejoin_window:g} s for it to come back"
                )
                self._call_later(
                    self._rejoin_window, lambda r=rank, w=why, t=token: self._expire(r, w, t)
                )
                continue
            self._leave(rank, why)
        if not present:
            # Every worker left: the job is over (what they left held was failed above).
            # The next job's workers may connect one by one; none of them is gone.
            for rank in list(left):
                self._coordination.rank_back(rank)

    def _present(self) -> set:
        return {rank for rank, _ in self._clients.values()}

    def _leave(self, rank: int, why: str) -> None:
        failed = self._coordination.rank_left(rank, why)
        self._log(
            f"worker rank {rank} left ({why})"
            + (f"; failed {failed} request(s) waiting for it" if failed else "")
        )

    def _expire(self, rank: int, why: str, token: object) -> None:
        """The rejoin window of rank ended: it left, unless it came back meanwhile."""
        if self._awaited.get(rank) is not token:
            return  # it came back (and maybe went again: a later window counts)
        del self._awaited[rank]
        if rank not in self._present() and rank not in self._coordination.left:
            self._leave(rank, f"{why}; not back within {self._rejoin_window:g} s")

    def _back(self, rank: int) -> None:
        if rank in self._awaited:
            del self._awaited[rank]
            self._log(f"worker rank {rank} is connected again")
            return
        if rank in self._coordination.left:
            self._coordination.rank_back(rank)
            self._log(f"worker rank {rank} is connected again")


def _log_to_stderr(message: str) -> None:
    print(f"kvsparse server: {message}", file=sys.stderr, flush=True)


__all__ = ["REJOIN_SECONDS", "Liveness"]
