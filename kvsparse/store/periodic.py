"""Saves on a timer while training runs, with bounded delta chains.

``kvsparse launch --checkpoint-dir DIR --save-every S [--keep N]`` gives the
workers ``KVSPARSE_SAVE_EVERY`` / ``KVSPARSE_SAVE_KEEP``; rank 0's store
then runs a `PeriodicSaver` (`KVStore.save_every` does the same from a
training script). Its first save is full, the next ones are deltas
(``kv.save(incremental=True)``), each taken after a push once S seconds have
passed since the last one, in the training thread: between two steps of
rank 0, with the guarantees of a ``kv.save`` the script would make there
(with BSP, a whole step). Serving replicas (`kvsparse serve --follow`)
apply each one.

Why after a push rather than from the launcher or a thread: a checkpoint's
manifest records the workers' key registry (what each key is: a dense key's
shape, a table's partitioner and wire dtype), which only the workers have;
and a save sent from another thread in the middle of a BSP step could catch
the servers on either side of it.

``keep`` (``--keep N``): at most N deltas on a full checkpoint; the save
after the N-th delta is a full one (a compaction: the servers write their
whole state), so a follower or a restarting server reads at most 1 + N
checkpoints. Once a full checkpoint is committed, the checkpoints before the
previous full one are deleted (manifests first, so none of them is ever seen
without its files): the previous chain stays for a follower that is reading it.

Not thread-safe: the store's training thread (the one that pushes) calls it.

Example:
    >>> kv.save_every(5.0, keep=10)        # doctest: +SKIP
    >>> for batch in stream:               # doctest: +SKIP
    ...     kv.push("user", (ids, grads))  # saves when due
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Optional

from kvsparse import errors

log = logging.getLogger("kvsparse.store")
_CHECKPOINT_FILE = re.compile(r"^ckpt-(\d{6})\.")


class PeriodicSaver:
    """Saves a store every `every` seconds (after a push), full then deltas, at most keep deltas.

    Args:
        store: the KVStore.
        every: seconds between saves (> 0).
        keep: deltas at most on a full checkpoint (None: no limit, no deletion).
        path: the checkpoint directory (None: the launcher's --checkpoint-dir).
        clock: time.monotonic (tests pass another).
    """

    def __init__(self, store, every: float, keep: Optional[int] = None, path=None, clock=None):
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0:
            raise errors.InvalidArgument(f"save interval must be seconds > 0, got {every!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise errors.InvalidArgument(f"keep must be an integer >= 0 or None, got {keep!r}")
        self.store = store
        self.every = float(every)
        self.keep = keep
        self.path = path
        self._clock = clock or time.monotonic
        self._next = self._clock() + self.every
        self._deltas: Optional[int] = None  # deltas on the last full save; None: none yet
        self._fulls: list[int] = []  # this saver's full checkpoints, oldest first
        self.saves = 0

    def due(self) -> bool:
        """True once every seconds passed since the last save (or the start)."""
        return self._clock() >= self._next

    def maybe_save(self) -> Optional[int]:
        """Saves if due; returns the checkpoint's number, or None."""
        return self.save() if self.due() else None

    def save(self) -> int:
        """Saves now: a delta, or a full checkpoint (the first, and after keep deltas)."""
        full = self._deltas is None or (self.keep is not None and self._deltas >= self.keep)
        seq = self.store.save(self.path, incremental=not full)
        self._next = self._clock() + self.every
        self.saves += 1
        if full:
            self._deltas = 0
            self._fulls.append(seq)
            if self.keep is not None and len(self._fulls) >= 3:
                self._delete_before(self._fulls[-2])
                self._fulls = self._fulls[-2:]
        else:
            self._deltas += 1
        return seq

    def _delete_before(self, seq: int) -> None:
        """Deletes every checkpoint numbered below seq (manifests first)."""
        path = self.store._checkpoints.resolve(self.path)
        names = sorted(os.listdir(path))
        old = [n for n in names if (m := _CHECKPOINT_FILE.match(n)) and int(m.group(1)) < seq]
        manifests = [n for n in old if n.endswith(".manifest.json")]
        for name in manifests + [n for n in old if n not in manifests]:
            target = os.path.join(path, name)
            if os.path.isdir(target):  # a shard's rows on disk (hard links): a directory
                shutil.rmtree(target, ignore_errors=True)
                continue
            try:
                os.unlink(target)
            except FileNotFoundError:
                pass
        if old:
            log.info("removed %d files of checkpoints before %d in %s", len(old), seq, path)


__all__ = ["PeriodicSaver"]
