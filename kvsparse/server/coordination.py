"""What a server coordinates between workers, one small class per concern.

- `JobConfig`: the job's configuration, set by the first HELLO; later ones must agree.
- `SspGate`: the workers' clocks; holds a pull that is too far ahead (SSP).
- `BspRounds`: holds each table's pushes until every worker pushed, then applies their sum.
- `Barrier`: answers BARRIER once every worker sent one.
- A rank waiting at the barrier has no more pushes for the rounds open then:
  `Coordination.arrive_at_barrier` excuses it from them (see "Barrier as join").
- `OptimizerEpochs`: another rank's n-th SET_OPTIMIZER waits for rank 0's n-th.
- `DenseInitWaiters`: a FLAG_DECLARE INIT_DENSE waits for rank 0's values.

Workers that left: `Coordination.rank_left` records a rank whose connections
all closed (`kvsparse.server.liveness`); each class then fails, with
`kvsparse.errors.WorkerLeft` naming the rank, every held request that waits for
it (``fail_waiting_for``), and `Coordination.fail_stuck` does the same for a
request held later, so nothing waits for a worker that is gone. A rank that
says anything again is back (`Coordination.rank_back`).

Barrier as join: a worker at a barrier sends nothing else until every
worker got there, so a BSP round or an SSP pull that waits for it could
only wait for ever, and the barrier with it (a worker that made one push
more than the others, say: a loop that runs for a fixed time). While ranks
wait at the barrier, `BspRounds` applies a round that misses only them with
the pushes it has (as if they pushed zeros: Horovod's ``hvd.join()``,
PyTorch's ``Join`` for uneven inputs), and `SspGate` does not count their
clocks. Every server gets every worker's BARRIER (`kvsparse.client.remote`),
so each one knows who waits there. Nothing else changes: without a barrier
the rounds wait for every worker as before.

A held request is any object with ``finish(frames)`` and ``fail(exc)``
(`kvsparse.server.dispatch.InFlightRequest`); these classes call one of them exactly
once, when the request's turn comes. None of them touches a socket.

Threads: none of these classes is thread-safe; the server's event loop
thread only.
"""

from __future__ import annotations

import enum

import numpy as np

from kvsparse import errors


def worker_left(left: dict, ranks: list, what: str) -> errors.WorkerLeft:
    """The error for a request that waits for ranks (which left: left[rank] says why)."""
    gone = "; ".join(f"rank {rank} ({left[rank]})" for rank in ranks)
    return errors.WorkerLeft(
        f"worker {gone} left the job: {what}, so it can never complete",
        ranks=list(ranks),
    )


def _owned_by(request, client_id: int) -> bool:
    header = getattr(request, "header", None)
    return header is not None and header.client_id == client_id


class Round:
    """One contribution per rank; complete when every rank has contributed.

    A second contribution from a rank already in the round (a worker that
    retried after an error, or two clients with one rank) waits for the next
    round instead of completing this one early.

    Example:
        >>> r = Round()
        >>> r.add(1, "b", num_workers=2)
        []
        >>> r.add(0, "a", num_workers=2)
        [['a', 'b']]
    """

    __slots__ = ("current", "backlog")

    def __init__(self):
        # rank -> contribution of the round being filled; read by BspRounds' orphan check.
        self.current: dict[int, object] = {}
        self.backlog: list[tuple[int, object]] = []

    def add(self, rank: int, value, num_workers: int, excused=frozenset()) -> list[list]:
        """Adds value; returns the rounds it completed, each a list of values in rank order.

        excused: ranks whose contribution is not awaited (they wait at a barrier).
        """
        self.backlog.append((rank, value))
        return self.complete(num_workers, excused)

    def complete(self, num_workers: int, excused=frozenset()) -> list[list]:
        """The rounds complete now that excused ranks are not awaited (see `add`)."""
        completed = []
        while True:
            waiting, self.backlog = self.backlog, []
            for entry_rank, entry in waiting:
                if entry_rank in self.current:
                    self.backlog.append((entry_rank, entry))
                else:
                    self.current[entry_rank] = entry
            if not self.current or self._missing_count(num_workers, excused):
                return completed
            completed.append([self.current[r] for r in sorted(self.current)])
            self.current = {}

    def _missing_count(self, num_workers: int, excused) -> int:
        if not excused:
            return max(0, num_workers - len(self.current))
        return sum(
            1 for rank in range(num_workers) if rank not in self.current and rank not in excused
        )

    def missing(self, ranks) -> list:
        """The ranks among ranks that this (non-empty) round still waits for."""
        if not self:
            return []
        return sorted(rank for rank in ranks if rank not in self.current)

    def values(self) -> list:
        """Every value not in a completed round yet."""
        return list(self.current.values()) + [value for _, value in self.backlog]

    def __bool__(self) -> bool:
        return bool(self.current or self.backlog)


class JobConfig:
    """The job's configuration: the first HELLO's, which every later HELLO must repeat."""

    FIELDS = ("num_workers", "mode", "staleness", "num_servers", "server_index")

    def __init__(self):
        self._config: dict | None = None
        self._restored = False  # from a checkpoint, and no HELLO since

    @property
    def configured(self) -> bool:
        """True once a HELLO was accepted."""
        return self._config is not None

    def adopt(self, config: dict) -> bool:
        """Takes a HELLO's configuration (a dict of FIELDS); True if it is the first.

        Raises:
            InvalidArgument: it differs from the first one.
        """
        if self._config is None or (self._restored and config != self._config):
            self._restored = False
            self._config = dict(config)
            return True
        self._restored = False
        if config != self._config:
            differences = ", ".join(
                f"{name}={config[name]!r} (server has {self._config[name]!r})"
                for name in self.FIELDS
                if config[name] != self._config[name]
            )
            raise errors.InvalidArgument(
                f"this client's configuration differs from the one the server was started "
                f"with by the first client: {differences}"
            )
        return False

    def saved(self) -> dict | None:
        """The configuration as a checkpoint keeps it (None before the first HELLO)."""
        return None if self._config is None else dict(self._config)

    def restore(self, config: dict | None) -> bool:
        """Takes a checkpoint's configuration (a server restored from it); True if taken.

        A server that was never greeted takes it, so a client whose request
        it answers from a restored resend record can go on without a new
        HELLO. The first HELLO after that may still set another
        configuration (a new job started from the checkpoint).
        """
        if self._config is not None or not config:
            return False
        self._config = {name: config[name] for name in self.FIELDS}
        self._restored = True
        return True

    def _field(self, name: str):
        if self._config is None:
            raise errors.ProtocolError("no HELLO yet: send HELLO first")
        return self._config[name]

    @property
    def num_workers(self) -> int:
        return self._field("num_workers")

    @property
    def mode(self) -> str:
        """'bsp', 'asp' or 'ssp'."""
        return self._field("mode")

    @property
    def num_servers(self) -> int:
        return self._field("num_servers")

    @property
    def server_index(self) -> int:
        return self._field("server_index")


class SspGate:
    """Stale synchronous parallel: a pull at clock c waits until every clock is >= c - staleness.

    A worker's clock is its number of pushes, carried in every request header.
    """

    def __init__(self):
        self._clocks: list[int] = []
        self._staleness: int | None = None  # None: not SSP, never blocks
        self._held: list[tuple[int, object]] = []
        self._changed = False
        self._excused: frozenset = frozenset()  # ranks at a barrier: their clocks not awaited

    def start(self, num_workers: int, staleness: int | None) -> None:
        """Sets the number of workers (clocks at 0) and the staleness bound (None: no gate)."""
        self._clocks = [0] * num_workers
        self._staleness = staleness

    def advance(self, rank: int, clock: int) -> None:
        """Notes a request from rank at clock (clocks only move forward)."""
        if clock > self._clocks[rank]:
            self._clocks[rank] = clock
            self._changed = True

    @property
    def staleness(self) -> int | None:
        """The staleness bound in force (None: not SSP, the gate never holds a pull)."""
        return self._staleness

    def clocks(self) -> list:
        """Each rank's clock as seen here: the highest clock of any request of it.

        A worker sends a request carrying clock c only once its c-th push was
        sent to every shard, so a clock of c here means this shard got that
        push (a restarted colocated worker resumes from it: `kvsparse.store.colocated`).
        """
        return list(self._clocks)

    def blocked(self, clock: int) -> bool:
        """True if a pull at clock must wait for a slower worker (one not at a barrier)."""
        if self._staleness is None:
            return False
        awaited = [c for r, c in enumerate(self._clocks) if r not in self._excused]
        return bool(awaited) and min(awaited) < clock - self._staleness

    def excuse(self, ranks) -> None:
        """Ranks waiting at a barrier: pulls no longer wait for their clocks (until cleared)."""
        ranks = frozenset(ranks)
        if ranks != self._excused:
            self._excused = ranks
            self._changed = True

    def hold(self, clock: int, request) -> None:
        """Holds a blocked pull until release() lets it go."""
        self._held.append((clock, request))

    def release(self) -> list:
        """The held pulls no longer blocked (removed from the gate), once after a clock moved."""
        changed, self._changed = self._changed, False
        if not changed or not self._held:
            return []
        held, self._held = self._held, []
        released = []
        for clock, request in held:
            if self.blocked(clock):
                self._held.append((clock, request))
            else:
                released.append(request)
        return released

    def describe(self, client_id: int) -> list:
        """What the pulls of client_id held here wait for, in words."""
        return [
            f"an SSP pull at clock {clock} (staleness {self._staleness}) waits for the "
            f"clocks {self._clocks} to reach {clock - self._staleness}"
            for clock, request in self._held
            if _owned_by(request, client_id)
        ]

    def fail_waiting_for(self, left: dict) -> int:
        """Fails the held pulls that wait for a rank in left (rank -> why); returns how many."""
        if self._staleness is None or not self._held:
            return 0
        held, self._held = self._held, []
        for clock, request in held:
            behind = [r for r in sorted(left) if self._clocks[r] < clock - self._staleness]
            if behind:
                request.fail(worker_left(left, behind, "this SSP pull waits for its clock"))
            else:
                self._held.append((clock, request))
        return len(held) - len(self._held)

    def __len__(self) -> int:
        """The number of pulls held."""
        return len(self._held)


class PushKind(str, enum.Enum):
    """What a push changes: sparse rows or a dense slice."""

    SPARSE = "sparse"
    DENSE = "dense"


def apply_pushes(state, kind: PushKind, table_id: int, parts: list) -> None:
    """Applies the sum of one table's pushes to state (a ShardState).

    parts: sparse (keys, rows, step) or dense (grad,) tuples, in the order
    they are summed (rank order in BSP: the same sum on every run).
    """
    apply_tables(state, kind, [(table_id, parts)])


def apply_tables(state, kind: PushKind, tables: list) -> None:
    """Applies each table's summed pushes: all the tables or none.

    tables: (table_id, parts) pairs, parts as in `apply_pushes`. One
    request's tables on this shard: if one table's update fails (an overflow,
    say), no table changes (`ShardState.push_sparse_tables`,
    `ShardState.push_dense_keys`).
    """
    if kind is PushKind.SPARSE:
        pushes = []
        for table_id, parts in tables:
            # The core sums duplicate keys before it applies the optimizer.
            keys = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
            rows = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
            # A push with keys on other shards only counts here (Adam's per-table step).
            pushes.append((table_id, keys, rows, any(p[2] for p in parts)))
        state.push_sparse_tables(pushes)
        return
    pushes = []
    for table_id, parts in tables:
        total = parts[0][0]
        if len(parts) > 1:
            total = total.copy()
            for part in parts[1:]:
                total += part[0]
        pushes.append((table_id, total))
    state.push_dense_keys(pushes)


class _Push:
    """One BSP push request: answered once each of its tables' rounds is applied."""

    __slots__ = ("request", "clock", "remaining", "error")

    def __init__(self, request, clock: int, remaining: int):
        self.request = request
        self.clock = clock
        self.remaining = remaining
        self.error = None

    def table_done(self, error) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.remaining -= 1
        if self.remaining == 0:
            if self.error is not None:
                self.request.fail(self.error)
            else:
                self.request.finish([])


class BspRounds:
    """Bulk synchronous pushes: each table's round is applied once every worker pushed it.

    Args:
        state: the ShardState the rounds are applied to.
        restarted: this server replaces one that died: until a table's first full
            round, a push of a step the dead server completed is applied alone.
    """

    def __init__(self, state, *, restarted: bool = False):
        self._state = state
        self._restarted = restarted
        self._rounds: dict[tuple, Round] = {}
        self._settled: set = set()  # (kind, table_id) that had a full round since the restart
        self._excused: frozenset = frozenset()  # ranks at a barrier (module docstring)

    def contribute(
        self, request, rank: int, clock: int, kind: PushKind, parsed: list, num_workers: int
    ) -> bool:
        """Adds a validated push to each of its tables' rounds; False if it has no table.

        parsed: (table_id, *part) tuples (see apply_pushes). The request is
        answered when all its tables' rounds are applied (an error in any of
        them fails it); with no table, the caller answers it.
        """
        groups: dict[int, list] = {}
        for table_id, *data in parsed:
            groups.setdefault(table_id, []).append(data)
        if not groups:
            return False
        push = _Push(request, clock, len(groups))
        # The rounds this push completes, applied together (all or nothing on this shard):
        # waves[i] holds each table's i-th completed round.
        waves: list[list] = []
        for table_id, parts in groups.items():
            key = (kind, table_id)
            round_ = self._rounds.setdefault(key, Round())
            recovering = self._restarted and key not in self._settled
            if recovering and self._orphaned(kind, table_id, round_, push, parts):
                completed = []
            else:
                completed = round_.add(rank, (push, parts), num_workers, self._excused)
            if not round_:
                del self._rounds[key]
            if completed and recovering:
                self._settled.add(key)
            self._add_waves(waves, table_id, completed)
        for wave in waves:
            self._apply_wave(kind, wave)
        return True

    @staticmethod
    def _add_waves(waves: list, table_id: int, completed: list) -> None:
        """waves[i] gets table_id's i-th completed round (rounds of one push go together)."""
        for i, contributions in enumerate(completed):
            if i == len(waves):
                waves.append([])
            waves[i].append((table_id, contributions))

    def excuse(self, ranks, num_workers: int) -> None:
        """Ranks waiting at a barrier: the rounds that miss only them are applied now.

        Until the next call (the barrier completes: ranks empty), later
        rounds do not wait for them either. A push of several tables has its
        rounds applied together, as in `contribute`.
        """
        self._excused = frozenset(ranks)
        if not self._excused:
            return
        waves = {kind: [] for kind in PushKind}
        for key, round_ in list(self._rounds.items()):
            kind, table_id = key
            completed = round_.complete(num_workers, self._excused)
            if not round_:
                del self._rounds[key]
            if completed and self._restarted:
                self._settled.add(key)
            self._add_waves(waves[kind], table_id, completed)
        for kind, kind_waves in waves.items():
            for wave in kind_waves:
                self._apply_wave(kind, wave)

    def _orphaned(self, kind, table_id, round_: Round, push: _Push, parts) -> bool:
        """After a restart: applies alone the pushes whose round the dead server completed.

        A crash can lose some replies of a round it had applied: the workers
        that got theirs move on, the others resend the same step (same clock)
        to the restarted server, where it would otherwise wait for, and then
        be summed with, the next step of the others. Until a table's first
        full round here, a push with a lower clock than another rank's is
        such an orphan: applied alone (on the restored state) and answered.
        Returns True if the new push was one.
        """
        late = sorted(r for r, (p, _) in round_.current.items() if p.clock < push.clock)
        for rank in late:
            self._apply(kind, table_id, [round_.current.pop(rank)])
        if any(p.clock > push.clock for p, _ in round_.current.values()):
            self._apply(kind, table_id, [(push, parts)])
            return True
        return False

    def _apply(self, kind: PushKind, table_id: int, contributions: list) -> None:
        self._apply_wave(kind, [(table_id, contributions)])

    def _apply_wave(self, kind: PushKind, rounds: list) -> None:
        """Applies complete rounds [(table_id, contributions)] together: all or none."""
        # Contributions come in rank order: the same sum on every run.
        tables = [
            (table_id, [part for _, group in contributions for part in group])
            for table_id, contributions in rounds
        ]
        error = None
        try:
            apply_tables(self._state, kind, tables)
        except Exception as exc:  # noqa: BLE001 - reported to every worker of the rounds
            error = exc
        for _, contributions in rounds:
            for push, _ in contributions:
                push.table_done(error)

    def fail_waiting_for(self, left: dict) -> int:
        """Fails every round that waits for a rank in left (rank -> why); returns pushes failed.

        The pushes of such a round (and of its backlog) get WorkerLeft: a round
        completes only with every worker's push, and that worker is gone.
        """
        failed = 0
        for key, round_ in list(self._rounds.items()):
            missing = round_.missing(left)
            if not missing:
                continue
            del self._rounds[key]
            error = worker_left(left, missing, "this BSP push waits for every worker's push")
            for push, _ in round_.values():
                push.table_done(error)
                failed += 1
        return failed

    def describe(self, client_id: int, num_workers: int) -> list:
        """What the pushes of client_id held here wait for, in words."""
        said = []
        for (kind, table_id), round_ in self._rounds.items():
            if not any(_owned_by(push.request, client_id) for push, _ in round_.values()):
                continue
            missing = [
                r for r in range(num_workers) if r not in round_.current and r not in self._excused
            ]
            said.append(
                f"a BSP round of {kind.value} table {table_id} waits for the pushes of "
                f"ranks {missing} (it has ranks {sorted(round_.current)})"
            )
        return said

    def waiting(self) -> int:
        """The number of push requests held."""
        return len({id(v[0]) for r in self._rounds.values() for v in r.values()})


class Barrier:
    """BARRIER: every worker's request is answered once all num_workers sent one."""

    def __init__(self):
        self._round = Round()

    def arrive(self, rank: int, request, num_workers: int) -> None:
        """Holds request until the barrier completes (answering the others if this completes it)."""
        for completed in self._round.add(rank, request, num_workers):
            for other in completed:
                other.finish([])

    def ranks(self) -> set:
        """The ranks waiting at the barrier now."""
        return set(self._round.current)

    def describe(self, client_id: int, num_workers: int) -> list:
        """What the barrier requests of client_id wait for, in words."""
        if not any(_owned_by(request, client_id) for request in self._round.values()):
            return []
        missing = [r for r in range(num_workers) if r not in self._round.current]
        return [f"a barrier waits for ranks {missing}"]

    def fail_waiting_for(self, left: dict) -> int:
        """Fails the barrier if it waits for a rank in left (rank -> why); returns how many."""
        missing = self._round.missing(left)
        if not missing:
            return 0
        held, self._round = self._round.values(), Round()
        error = worker_left(left, missing, "this barrier waits for every worker")
        for request in held:
            request.fail(error)
        return len(held)

    def __len__(self) -> int:
        """The number of requests held."""
        return len(self._round.values())


class OptimizerEpochs:
    """SET_OPTIMIZER: rank 0's n-th call sets it; another rank's n-th call waits for that one.

    A follower whose spec differs from rank 0's n-th fails with InvalidArgument.
    A restarted server learns rank 0's last call from its replay; the calls
    before it are unknown there, and a follower's call of one of them is not
    checked.
    """

    _UNKNOWN = object()  # a call of rank 0 made before this server started

    def __init__(self):
        self._history: list = []  # rank 0's specs, one per call
        self._waiting: list[tuple] = []

    def saved(self) -> list:
        """Rank 0's calls as a checkpoint keeps them: [{"spec": ...} or None (unknown)]."""
        return [None if spec is self._UNKNOWN else {"spec": spec} for spec in self._history]

    def restore(self, calls: list) -> None:
        """Takes rank 0's calls from a checkpoint (`saved`'s form), before any call here.

        The calls restored are what the restored tables run: rank 0's replay
        of one keeps them (their slots), and a follower's call of one is
        answered at once, checked against it.
        """
        if self._history:
            return
        self._history = [self._UNKNOWN if call is None else call["spec"] for call in calls]

    def recorded(self, epoch: int) -> bool:
        """True if rank 0's call epoch is known here."""
        return epoch <= len(self._history) and self._history[epoch - 1] is not self._UNKNOWN

    def lead(self, spec, epoch: int | None = None, *, replay: bool = False) -> None:
        """Records rank 0's call (already applied) and answers the followers it was for.

        epoch: the call's number (None: the next one); replay: rank 0's call
        sent again after a restart, which does not replace a known one.
        """
        epoch = len(self._history) + 1 if epoch is None else epoch
        if epoch > len(self._history):
            self._history.extend([self._UNKNOWN] * (epoch - 1 - len(self._history)))
            self._history.append(spec)
        elif not (replay and self.recorded(epoch)):
            self._history[epoch - 1] = spec
        waiting, self._waiting = self._waiting, []
        for request, epoch, follower_spec in waiting:
            if epoch > len(self._history):
                self._waiting.append((request, epoch, follower_spec))
                continue
            try:
                self._check(epoch, follower_spec)
            except errors.InvalidArgument as exc:
                request.fail(exc)
            else:
                request.finish([])

    def describe(self, client_id: int) -> list:
        """What the follower calls of client_id held here wait for, in words."""
        return [
            f"set_optimizer call {epoch} waits for rank 0's call {epoch}"
            for request, epoch, _ in self._waiting
            if _owned_by(request, client_id)
        ]

    def follow(self, request, epoch: int, spec) -> bool:
        """A follower's call: True if rank 0's call epoch is in (checked), False if held.

        Raises:
            InvalidArgument: rank 0 set a different spec in its call epoch.
        """
        if epoch <= len(self._history):
            self._check(epoch, spec)
            return True
        self._waiting.append((request, epoch, spec))
        return False

    def _check(self, epoch: int, spec) -> None:
        leader = self._history[epoch - 1]
        if leader is not self._UNKNOWN and leader != spec:
            raise errors.InvalidArgument(
                f"set_optimizer call {epoch}: rank 0 set {leader!r}, this worker {spec!r}; "
                "every worker must set the same optimizer"
            )

    def fail_waiting_for(self, left: dict) -> int:
        """Fails the held follower calls if rank 0 is in left (rank -> why); returns how many."""
        if 0 not in left or not self._waiting:
            return 0
        waiting, self._waiting = self._waiting, []
        error = worker_left(left, [0], "set_optimizer waits for rank 0's call")
        for request, _, _ in waiting:
            request.fail(error)
        return len(waiting)

    def __len__(self) -> int:
        """The number of follower calls held."""
        return len(self._waiting)


class DenseInitWaiters:
    """INIT_DENSE with FLAG_DECLARE: held until rank 0's values for the table are in place."""

    def __init__(self):
        self._waiting: dict[int, list] = {}

    @staticmethod
    def check_size(name: str, held: int, declared: int) -> None:
        """Raises DuplicateKey if the shard holds another number of values than declared."""
        if held != declared:
            raise errors.DuplicateKey(
                f"key {name!r}: rank 0 initialized {held} values on this shard, "
                f"this worker {declared}"
            )

    def wait(self, table_id: int, request, name: str, size: int) -> None:
        """Holds a declaring request until release(table_id)."""
        self._waiting.setdefault(table_id, []).append((request, name, size))

    def describe(self, client_id: int) -> list:
        """What the declarations of client_id held here wait for, in words."""
        return [
            f"the init of dense key {name!r} waits for rank 0's values"
            for requests in self._waiting.values()
            for request, name, _ in requests
            if _owned_by(request, client_id)
        ]

    def release(self, table_id: int, held: int) -> None:
        """Answers the requests waiting for table_id, which now holds held values."""
        for request, name, size in self._waiting.pop(table_id, []):
            try:
                self.check_size(name, held, size)
            except errors.DuplicateKey as exc:
                request.fail(exc)
            else:
                request.finish([])

    def fail_waiting_for(self, left: dict) -> int:
        """Fails every held declaration if rank 0 is in left (rank -> why); returns how many."""
        if 0 not in left or not self._waiting:
            return 0
        waiting, self._waiting = self._waiting, {}
        error = worker_left(left, [0], "this init waits for rank 0's values")
        held = [request for requests in waiting.values() for request, _, _ in requests]
        for request in held:
            request.fail(error)
        return len(held)

    def __len__(self) -> int:
        """The number of requests held."""
        return sum(len(w) for w in self._waiting.values())


class Coordination:
    """One server's coordination objects (public attributes), made for one ShardState.

    Attributes: job (JobConfig), ssp (SspGate), bsp (BspRounds), barrier
    (Barrier), optimizer (OptimizerEpochs), dense_init (DenseInitWaiters).
    """

    def __init__(self, state, *, restarted: bool = False):
        self.job = JobConfig()
        self.ssp = SspGate()
        self.bsp = BspRounds(state, restarted=restarted)
        self.barrier = Barrier()
        self.optimizer = OptimizerEpochs()
        self.dense_init = DenseInitWaiters()
        self.left: dict[int, str] = {}  # rank -> why it is gone

    def arrive_at_barrier(self, rank: int, request, num_workers: int) -> None:
        """BARRIER from rank: held until every worker sent one; excuses the ranks waiting.

        The ranks at the barrier have no more pushes for the BSP rounds open
        now, and their clocks hold no SSP pull (module docstring, "Barrier as
        join"). A round completed so is applied, and a pull let go is returned
        by the next `SspGate.release`.
        """
        self.barrier.arrive(rank, request, num_workers)
        waiting = self.barrier.ranks()
        self.bsp.excuse(waiting, num_workers)
        self.ssp.excuse(waiting)

    def rank_left(self, rank: int, why: str) -> int:
        """Records that rank left (why: how it was noticed); fails what waits for it.

        Returns:
            The number of held requests failed with WorkerLeft.
        """
        self.left[rank] = why
        return self.fail_stuck()

    def rank_back(self, rank: int) -> None:
        """A rank that left is connected again: later requests may wait for it."""
        self.left.pop(rank, None)

    def fail_stuck(self) -> int:
        """Fails every held request that waits for a rank that left; returns how many.

        Cheap when no rank left (the usual case): the server calls it after
        every request it holds.
        """
        if not self.left:
            return 0
        return (
            self.bsp.fail_waiting_for(self.left)
            + self.barrier.fail_waiting_for(self.left)
            + self.ssp.fail_waiting_for(self.left)
            + self.optimizer.fail_waiting_for(self.left)
            + self.dense_init.fail_waiting_for(self.left)
        )

    def describe(self, client_id: int) -> str:
        """What this server holds of client_id's requests, and for whom, in words ("": none).

        Sent back in a PING reply, so that a client's WaitTimeout can say what
        the server waited for (`kvsparse.client.session`).
        """
        if not self.job.configured:
            return ""
        num_workers = self.job.num_workers
        said = [
            *self.bsp.describe(client_id, num_workers),
            *self.barrier.describe(client_id, num_workers),
            *self.ssp.describe(client_id),
            *self.optimizer.describe(client_id),
            *self.dense_init.describe(client_id),
        ]
        return "; ".join(said)

    def waiting(self) -> dict:
        """The number of requests each object holds (STATS ``waiting``)."""
        return {
            "bsp_pushes": self.bsp.waiting(),
            "ssp_pulls": len(self.ssp),
            "barrier": len(self.barrier),
            "dense_inits": len(self.dense_init),
            "set_optimizer": len(self.optimizer),
        }
