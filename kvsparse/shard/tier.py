"""ShardTier: one shard's memory budget and the directory its disk tier spills to.

A shard (a ``kvsparse server``, a local store, a colocated worker's shard)
with ``--memory-budget`` keeps one `_core.MemoryBudget` that every sparse
table of the shard registers with, and that also counts the dense keys'
arrays (`set_other_bytes`). With ``--spill-dir DIR`` too, the shard owns
``DIR/shard-<pid>-<n>`` (n counts the shards of one process) and gives each
table instance its own subdirectory there; the C++ table creates, empties
and removes it (`_core.Table`'s spill_dir).

A server killed with SIGKILL cannot remove its directory: a shard that
starts removes every ``DIR/shard-<pid>-*`` whose process no longer runs.

A load builds a new ShardState beside the serving one and hands it over
when complete (`ShardState.replace_tables`); both use the same ShardTier,
so the loaded tables count against the same budget and spill under the same
root, in directories of their own.

Threads: not thread-safe (ShardState's rule: one thread uses a shard at a
time); `close` may run from a finalizer.

Example:
    >>> tier = ShardTier(64 << 20, "/tmp/spill")            # doctest: +SKIP
    >>> tier.table_options("user")["spill_dir"]              # doctest: +SKIP
    '/tmp/spill/shard-4242-0/0-user'
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import weakref
from typing import Optional

from kvsparse import _core, errors

_ROOT_PATTERN = re.compile(r"shard-(\d+)-(\d+)")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
# Shards of this process (local stores, a colocated worker's, servers in tests): each gets
# its own root under a shared spill directory.
_shard_numbers = itertools.count()


def _process_runs(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def remove_dead_roots(spill_dir: str) -> list:
    """Removes the ``shard-<pid>-*`` directories in spill_dir whose process is gone.

    A server that was killed (SIGKILL, the OOM killer) leaves its rows on disk; nothing
    can read them again (a restarted server restores from a checkpoint), so they only
    take space. Directories of running processes, and anything not named like a shard's
    root, are left alone. Returns the paths removed. Thread-safe.
    """
    removed = []
    try:
        names = os.listdir(spill_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _ROOT_PATTERN.fullmatch(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _process_runs(pid):
            continue
        path = os.path.join(spill_dir, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _remove_root(path: str, owner_pid: int) -> None:
    # A forked child (a checkpoint writer) shares the parent's tables: only the process
    # that made the root removes it.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class ShardTier:
    """A shard's `_core.MemoryBudget` and, with a spill directory, its spill root.

    Args:
        memory_budget: bytes the shard may hold in memory (> 0).
        spill_dir: the directory for the disk tier (None: no disk tier; an insert
            past the budget is refused with LimitExceeded).

    Raises:
        InvalidArgument: a budget <= 0, or a spill directory without a budget.
        StorageError: the spill root cannot be made (naming it).

    Not thread-safe (ShardState's rule).
    """

    def __init__(self, memory_budget: int, spill_dir: Optional[str] = None):
        if int(memory_budget) <= 0:
            raise errors.InvalidArgument(
                f"memory budget must be > 0 bytes, got {memory_budget!r}"
                + (" (a spill directory needs a memory budget)" if spill_dir else "")
            )
        self.memory_budget = int(memory_budget)
        self.budget = _core.MemoryBudget(self.memory_budget)
        self.spill_dir = None if spill_dir is None else os.path.abspath(os.fspath(spill_dir))
        self.root: Optional[str] = None
        self._tables = itertools.count()
        self._finalizer = None
        if self.spill_dir is not None:
            try:
                os.makedirs(self.spill_dir, exist_ok=True)
                remove_dead_roots(self.spill_dir)
                self.root = os.path.join(
                    self.spill_dir, f"shard-{os.getpid()}-{next(_shard_numbers)}"
                )
                os.makedirs(self.root)
            except OSError as exc:
                raise errors.StorageError(
                    f"cannot make the spill directory {self.spill_dir!r} (--spill-dir): {exc}"
                ) from exc
            self._finalizer = weakref.finalize(self, _remove_root, self.root, os.getpid())

    def table_options(self, name: str) -> dict:
        """The keyword arguments of `_core.Table` for a new table instance named name.

        Each call gives a new spill subdirectory (``<n>-<name>``): a table being loaded
        and the one it will replace live side by side.
        """
        options = {"budget": self.budget, "name": name}
        if self.root is not None:
            safe = _UNSAFE.sub("_", name)[:64] or "table"
            options["spill_dir"] = os.path.join(self.root, f"{next(self._tables)}-{safe}")
        return options

    def set_other_bytes(self, nbytes: int) -> None:
        """Counts nbytes the shard holds outside its sparse tables (dense keys)."""
        self.budget.set_other_bytes(int(nbytes))

    def used(self) -> int:
        """Bytes the shard holds now, as the budget counts them."""
        return int(self.budget.used())

    def close(self) -> None:
        """Removes the spill root (in the process that made it); idempotent."""
        if self._finalizer is not None:
            self._finalizer()


__all__ = ["ShardTier", "remove_dead_roots"]
