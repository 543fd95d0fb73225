"""Settings: each declared once, read once at an entry point, passed down as objects.

`SETTINGS` declares every duration and size a user sets (its variable, its
flag, its kind and bounds), so that they all parse alike
(`kvsparse.config.values`). The entry points resolve what they need once:

- `WorkerSettings.from_environment()`: ``kvsparse.create`` (a worker's store);
- `ServerSettings.from_environment()`: ``kvsparse server`` and the shard a
  colocated worker or a Ray actor hosts;

and hand the objects down; nothing below them reads the environment
(``tests/test_layout.py`` checks where the readers are called).

Example:
    >>> settings = WorkerSettings.from_environment({"KVSPARSE_RETRY_WINDOW": "2m"})
    >>> settings.retry_window, settings.cluster is None
    (120.0, True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from kvsparse.config.cluster import ClusterConfig, colocated_peers, from_environment
from kvsparse.config.limits import ServerLimits, server_limits
from kvsparse.config.names import (
    CHECKPOINT_DIR,
    DEFAULT_HEARTBEAT_TIMEOUT,
    FAST_PATH,
    KEYS,
    MEMORY_BUDGET,
    RESTARTED,
    SAVE_KEEP,
    SHARD_FD,
    SPILL_DIR,
)
from kvsparse.config.values import (
    SETTINGS,
    _count,
    _get,
    parse_count,
    parse_switch,
)
from kvsparse.errors import InvalidArgument


def restarted(environ: Optional[Mapping] = None) -> int:
    """How many times this worker was started again after dying (``KVSPARSE_RESTARTED``).

    0 when unset (a first start). Set by ``kvsparse launch --colocated
    --restart-workers`` for a worker it starts again. Raises InvalidArgument
    for a value that is not an integer >= 0. Thread-safe.

    Example:
        >>> restarted({"KVSPARSE_RESTARTED": "2"})
        2
        >>> restarted({})
        0
    """
    value = _count(os.environ if environ is None else environ, RESTARTED, "an integer")
    return 0 if value is None else value


def shard_fd(environ: Optional[Mapping] = None) -> Optional[int]:
    """The inherited listening socket of this worker's shard (``KVSPARSE_SHARD_FD``), or None.

    Set by ``kvsparse launch --colocated`` over tcp. Raises InvalidArgument
    for a value that is not an integer >= 0. Thread-safe.

    Example:
        >>> shard_fd({"KVSPARSE_SHARD_FD": "5"})
        5
        >>> shard_fd({}) is None
        True
    """
    return _count(os.environ if environ is None else environ, SHARD_FD, "a file descriptor number")


def rejoin_window(environ: Optional[Mapping] = None) -> float:
    """Seconds a colocated shard waits for a worker that left (``KVSPARSE_REJOIN_WINDOW``).

    0 when unset: requests waiting for a worker that left fail at once
    (`kvsparse.server.liveness`). ``kvsparse launch --colocated
    --restart-workers`` sets it to the workers' retry window (``inf``: no
    bound, as the retry window allows). Raises InvalidArgument for a value
    that is not a duration >= 0. Thread-safe.

    Example:
        >>> rejoin_window({"KVSPARSE_REJOIN_WINDOW": "60"})
        60.0
    """
    return SETTINGS["rejoin_window"].read(environ)


def checkpoint_dir(environ: Optional[Mapping] = None) -> Optional[str]:
    """The checkpoint directory set by ``kvsparse launch --checkpoint-dir`` (or None).

    Read from ``KVSPARSE_CHECKPOINT_DIR``; ``kv.save()`` and ``kv.load()``
    use it when called without a path. Thread-safe.

    Example:
        >>> checkpoint_dir({"KVSPARSE_CHECKPOINT_DIR": "/ckpt"})
        '/ckpt'
    """
    environ = os.environ if environ is None else environ
    return _get(environ, CHECKPOINT_DIR)


def periodic_save(environ: Optional[Mapping] = None) -> Optional[tuple]:
    """(seconds, keep or None) of ``kvsparse launch --save-every S [--keep N]``, or None.

    Read from ``KVSPARSE_SAVE_EVERY`` (a duration > 0) and ``KVSPARSE_SAVE_KEEP``
    (deltas at most on a full checkpoint, >= 0). Thread-safe.

    Raises:
        InvalidArgument: a value that is not a number in range.

    Example:
        >>> periodic_save({"KVSPARSE_SAVE_EVERY": "5", "KVSPARSE_SAVE_KEEP": "10"})
        (5.0, 10)
    """
    environ = os.environ if environ is None else environ
    seconds = SETTINGS["save_every"].read(environ)
    if seconds is None:
        return None
    keep = _get(environ, SAVE_KEEP)
    return seconds, None if keep is None else parse_count(keep, SAVE_KEEP, minimum=0)


def curve_keys(environ: Optional[Mapping] = None) -> Optional[str]:
    """The CurveZMQ key directory (``KVSPARSE_KEYS``, set by ``kvsparse launch --keys``), or None.

    Thread-safe.

    Example:
        >>> curve_keys({"KVSPARSE_KEYS": "/keys"})
        '/keys'
    """
    environ = os.environ if environ is None else environ
    return _get(environ, KEYS)


def retry_window(environ: Optional[Mapping] = None) -> float:
    """Seconds a worker keeps retrying a restarted or silent server (``KVSPARSE_RETRY_WINDOW``).

    0 (no retry) when unset; ``inf``: no bound. Raises InvalidArgument for a
    value that is not a duration >= 0. Thread-safe.

    Example:
        >>> retry_window({"KVSPARSE_RETRY_WINDOW": "120"})
        120.0
    """
    return SETTINGS["retry_window"].read(environ)


def heartbeat_timeout(environ: Optional[Mapping] = None) -> float:
    """Seconds a server lets a silent peer live (``KVSPARSE_HEARTBEAT_TIMEOUT``, default 30).

    A server sends ZeroMQ heartbeats to its peers and closes the connection
    of one that answers nothing for this long; a worker whose connections
    all closed has left the job. 0: no heartbeats (a worker then counts as
    gone only when its connection closes). Raises InvalidArgument for a
    value that is not a duration >= 0. Thread-safe.

    Example:
        >>> heartbeat_timeout({"KVSPARSE_HEARTBEAT_TIMEOUT": "5"})
        5.0
    """
    return SETTINGS["heartbeat_timeout"].read(environ)


def fast_path(environ: Optional[Mapping] = None) -> bool:
    """Whether servers answer pulls and pushes on their C++ thread (``KVSPARSE_FAST_PATH``).

    On by default (unset, or ``1``); ``0`` serves every request in Python, as
    before the fast path (`kvsparse.server.fastpath`): for benchmarks that compare
    the two, or to fall back. Raises InvalidArgument for anything but a
    switch (``0``/``1``, ``true``/``false``, ``on``/``off``). Thread-safe.

    Example:
        >>> fast_path({"KVSPARSE_FAST_PATH": "0"})
        False
    """
    environ = os.environ if environ is None else environ
    text = _get(environ, FAST_PATH)
    return True if text is None else parse_switch(text, FAST_PATH)


def check_memory_tier(memory_budget: int, spill_dir: Optional[str]) -> None:
    """Raises InvalidArgument for a spill directory without a memory budget.

    The disk tier takes rows out of memory only when a budget says how much
    memory they may use: a spill directory alone would never be written.
    Thread-safe.

    Example:
        >>> check_memory_tier(0, "/spill")
        Traceback (most recent call last):
        ...
        kvsparse.errors.InvalidArgument: --spill-dir (KVSPARSE_SPILL_DIR) needs --memory-budget ...
    """
    if spill_dir is not None and not memory_budget:
        raise InvalidArgument(
            f"--spill-dir ({SPILL_DIR}) needs --memory-budget ({MEMORY_BUDGET}): rows move "
            f"to {spill_dir!r} only once the shard reaches its memory budget; give "
            "both, or neither"
        )


def memory_tier(
    environ: Optional[Mapping] = None,
    memory_budget: Optional[int] = None,
    spill_dir: Optional[str] = None,
) -> tuple:
    """(memory budget in bytes, spill directory or None) of a shard.

    From ``KVSPARSE_MEMORY_BUDGET`` (a size: ``512MiB``, ``1GiB``, bytes; unset
    or 0: no budget) and ``KVSPARSE_SPILL_DIR``; memory_budget and spill_dir,
    when not None, override them (the command line's ``--memory-budget`` and
    ``--spill-dir``). The spill directory is made absolute, so that a server
    started from another directory finds the same one. Thread-safe.

    Raises:
        InvalidArgument: a malformed size (naming its variable), or a spill
            directory without a budget (naming both flags).

    Example:
        >>> memory_tier({"KVSPARSE_MEMORY_BUDGET": "1GiB", "KVSPARSE_SPILL_DIR": "/spill"})
        (1073741824, '/spill')
    """
    environ = os.environ if environ is None else environ
    if memory_budget is None:
        memory_budget = SETTINGS["memory_budget"].read(environ)
    else:
        memory_budget = SETTINGS["memory_budget"].parse(memory_budget, "memory_budget")
    if spill_dir is None:
        spill_dir = _get(environ, SPILL_DIR)
    if spill_dir is not None:
        spill_dir = os.path.abspath(os.fspath(spill_dir))
    check_memory_tier(memory_budget, spill_dir)
    return memory_budget, spill_dir


@dataclass(frozen=True)
class ServerSettings:
    """What a shard's server takes from its environment, resolved once by its entry point.

    Attributes:
        keys: the CurveZMQ key directory, or None (no encryption).
        limits: what one peer may make the server do.
        heartbeat_timeout: seconds a silent peer lives (0: no heartbeats).
        fast_path: whether pulls and pushes are answered on the C++ thread.
        memory_budget: bytes the shard's tables and dense keys may hold in
            memory (0: no budget).
        spill_dir: where the shard's disk tier puts rows beyond the budget
            (None: no disk tier; an insert past the budget is refused).

    Immutable: safe to share between threads.

    Example:
        >>> ServerSettings.from_environment({"KVSPARSE_FAST_PATH": "0"}).fast_path
        False
        >>> ServerSettings.from_environment({}, memory_budget="8MiB").memory_budget
        8388608
    """

    keys: Optional[str] = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    fast_path: bool = True
    memory_budget: int = 0
    spill_dir: Optional[str] = None

    def __post_init__(self):
        check_memory_tier(self.memory_budget, self.spill_dir)

    @classmethod
    def from_environment(cls, environ: Optional[Mapping] = None, **given) -> ServerSettings:
        """The settings from the environment; `given` (not None) overrides a field.

        `given` may also hold `ServerLimits` fields (the command line's
        ``--max-*``), which override the environment's limits. A given
        memory_budget may be a size's text (``"8MiB"``) or bytes.

        Raises:
            InvalidArgument: a malformed value, naming its variable; a spill
                directory without a memory budget.
        """
        environ = os.environ if environ is None else environ
        limit_fields = set(ServerLimits.__dataclass_fields__)
        limits = server_limits(
            environ, **{k: v for k, v in given.items() if k in limit_fields and v is not None}
        )
        own = {k: v for k, v in given.items() if k not in limit_fields and v is not None}
        unknown = set(own) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"ServerSettings got unknown fields {sorted(unknown)}")
        budget, spill_dir = memory_tier(
            environ, own.pop("memory_budget", None), own.pop("spill_dir", None)
        )
        values = {
            "keys": curve_keys(environ),
            "limits": limits,
            "heartbeat_timeout": heartbeat_timeout(environ),
            "fast_path": fast_path(environ),
            "memory_budget": budget,
            "spill_dir": spill_dir,
        }
        values.update(own)
        return cls(**values)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker's store takes from its environment, resolved once by ``kvsparse.create``.

    Attributes:
        cluster: the servers, this worker's rank and the job's size, or None
            when not asked for (a local store, or servers given explicitly).
        peers: the colocated workers' shard addresses (``kvsparse launch
            --colocated``), or None.
        retry_window: seconds to keep retrying a restarted or silent server.
        keys: the CurveZMQ key directory, or None.
        checkpoint_dir: where ``kv.save()`` without a path writes, or None.
        periodic_save: (seconds, keep) of ``--save-every``/``--keep``, or None.
        restarted: how many times this worker was started again (colocated).
        rejoin_window: seconds a colocated shard waits for a worker that left.
        shard_fd: the inherited listening socket of a colocated shard, or None.
        server: the settings of the shard a colocated worker hosts.

    Immutable: safe to share between threads.

    Example:
        >>> WorkerSettings.from_environment({"KVSPARSE_CHECKPOINT_DIR": "/ckpt"}).checkpoint_dir
        '/ckpt'
    """

    cluster: Optional[ClusterConfig] = None
    peers: Optional[list] = None
    retry_window: float = 0.0
    keys: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    periodic_save: Optional[tuple] = None
    restarted: int = 0
    rejoin_window: float = 0.0
    shard_fd: Optional[int] = None
    server: ServerSettings = field(default_factory=ServerSettings)

    @classmethod
    def from_environment(
        cls, environ: Optional[Mapping] = None, *, cluster: bool = False
    ) -> WorkerSettings:
        """The settings from the environment; with cluster=True also where the servers are.

        Raises:
            InvalidArgument: a malformed value (named), or cluster=True and no
                server list in any convention (`from_environment`).
        """
        environ = os.environ if environ is None else environ
        peers = colocated_peers(environ)
        return cls(
            cluster=from_environment(environ) if cluster else None,
            peers=peers,
            retry_window=retry_window(environ),
            keys=curve_keys(environ),
            checkpoint_dir=checkpoint_dir(environ),
            periodic_save=periodic_save(environ),
            restarted=restarted(environ),
            rejoin_window=rejoin_window(environ),
            shard_fd=shard_fd(environ),
            server=ServerSettings.from_environment(environ),
        )


__all__ = [
    "ServerSettings",
    "WorkerSettings",
    "checkpoint_dir",
    "curve_keys",
    "fast_path",
    "check_memory_tier",
    "heartbeat_timeout",
    "memory_tier",
    "periodic_save",
    "rejoin_window",
    "restarted",
    "retry_window",
    "shard_fd",
]
