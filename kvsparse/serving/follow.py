"""Follow mode: poll a checkpoint directory and apply each new checkpoint to a ServingState.

A checkpoint exists once its manifest does (the manifest is written last,
by rename: `kvsparse.shard.checkpoint`), so the follower only ever looks at
manifests, never at shard files still being written. Each poll lists the
manifests; when a newer one appears:

- if its delta chain runs through the checkpoint served now, the deltas
  after it are applied one by one, each atomically (`ServingState.apply`);
- otherwise (a new full checkpoint: a `--keep` compaction, a fresh full
  save, another job) its whole chain is read and replaces the tables, also
  atomically.

A missing, truncated or corrupt file (or manifest) is refused while the
update is read, before anything is applied: the state served stays the
previous one, the error is kept (`last_error`, shown by ``/healthz``) and
logged once per checkpoint. A later checkpoint is tried again: a delta
chain through a corrupt delta keeps failing until a new full checkpoint
arrives.

Threads: `Follower` runs its own polling thread (`start` / `stop`);
`poll_once` may be called instead from one thread at a time. Its
properties may be read from any thread.

Priority: on Linux the polling thread lowers its own CPU priority by
``niceness`` (as ``nice -n``; `kvsparse serve --apply-niceness`, 10 by
default). Applying a delta keeps a core busy for tens of milliseconds; where
the cores are all taken, a lookup thread then waits for a scheduler tick
(4 ms) at a time. Measured in process on 2 cores other work shared, lookups
of 64 ids while 1e5-row deltas were applied: p99 0.14-4.2 ms (idle
0.06-0.16 ms) and p99.9 12-16 ms; with the applier at nice 10, p99 0.10-0.13
ms and p99.9 4.3-5.6 ms, as idle, the updates taking longer. The apply
holds the GIL for under a millisecond at a time, so a descheduled
applier seldom holds up a lookup.

Example:
    >>> follower = Follower("/ckpt", state, Selection(), interval=0.2)  # doctest: +SKIP
    >>> follower.start()                                                  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from kvsparse import errors
from kvsparse.serving.state import (
    Selection,
    ServingState,
    Update,
    read_checkpoint,
    read_checkpoints,
)
from kvsparse.shard.checkpoint import manifest as manifests

log = logging.getLogger("kvsparse.serving")


class Follower:
    """Keeps a ServingState at the newest complete checkpoint of a directory.

    Args:
        path: the checkpoint directory (``kvsparse launch --checkpoint-dir``).
        state: what to update.
        selection: the tables and shard served.
        interval: seconds between polls.
        on_update: called after each applied update with (update, seconds
            it took), and after each refused one with (None, error).
        niceness: how much the polling thread lowers its CPU priority (0:
            not at all; Linux only, elsewhere ignored).
    """

    def __init__(
        self,
        path: str,
        state: ServingState,
        selection: Selection,
        interval: float = 0.2,
        on_update: Optional[Callable] = None,
        niceness: int = 0,
    ):
        if isinstance(niceness, bool) or not isinstance(niceness, int) or niceness < 0:
            raise errors.InvalidArgument(f"niceness must be an integer >= 0, got {niceness!r}")
        self.path = path
        self.niceness = niceness
        self.state = state
        self.selection = selection
        self.interval = float(interval)
        self._on_update = on_update
        self._lock = threading.Lock()
        self._last_error: Optional[dict] = None
        self._failed_seq: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def last_error(self) -> Optional[dict]:
        """{"seq", "message", "time"} of the last refused checkpoint, None once one applied."""
        with self._lock:
            return self._last_error

    def _served_seq(self) -> Optional[int]:
        version = self.state.version()
        return None if version is None else version.get("seq")

    def poll_once(self) -> bool:
        """Applies what is new in the directory; True if the state changed.

        Errors are kept and logged, not raised (the state stays as it was).
        """
        seqs = manifests.list_manifests(self.path)
        served = self._served_seq()
        if not seqs or (served is not None and seqs[-1] <= served):
            return False
        newest = seqs[-1]
        if newest == self._failed_seq:
            return False
        try:
            return self._catch_up(newest, served)
        except (errors.KVSparseError, OSError, KeyError, ValueError, TypeError) as exc:
            self._refused(newest, exc)
            return False

    def _catch_up(self, newest: int, served: Optional[int]) -> bool:
        latest = manifests.read_manifest(self.path, newest)
        steps = manifests.chain(self.path, latest)
        seqs = [int(m["seq"]) for m in steps]
        if served is not None and served in seqs:
            changed = False
            for manifest in steps[seqs.index(served) + 1 :]:
                with self.state.reading() as side:
                    known = dict(side.infos)
                update = read_checkpoints(self.path, [manifest], False, self.selection, known)
                self._apply(update)
                changed = True
            return changed
        update, _ = read_checkpoint(self.path, self.selection, newest)
        self._apply(update)
        return True

    def _apply(self, update: Update) -> None:
        started = time.perf_counter()
        self.state.apply(update)
        seconds = time.perf_counter() - started
        with self._lock:
            self._last_error = None
            self._failed_seq = None
        log.info(
            "serving checkpoint %s (%s, %d rows applied in %.3f s)",
            update.version["seq"],
            update.version["kind"],
            update.rows,
            seconds,
        )
        if self._on_update is not None:
            self._on_update(update, seconds)

    def _refused(self, seq: int, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._last_error = {"seq": seq, "message": message, "time": time.time()}
            self._failed_seq = seq
        served = self._served_seq()
        log.error("checkpoint %s refused, still serving %s: %s", seq, served, message)
        if self._on_update is not None:
            self._on_update(None, exc)

    def start(self) -> None:
        """Starts the polling thread (a daemon)."""
        self._thread = threading.Thread(target=self._run, name="kvsparse-follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _lower_thread_priority(self.niceness)
        while not self._stop.wait(self.interval):
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - a background thread never throws
                self._refused(-1, exc)

    def stop(self) -> None:
        """Stops the polling thread (waits for a poll in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _lower_thread_priority(niceness: int) -> None:
    """Lowers the calling thread's CPU priority by niceness (Linux; a failure is logged)."""
    if not niceness or not sys.platform.startswith("linux"):
        return  # elsewhere setpriority(PRIO_PROCESS, id) is process-wide, or not a thread's
    # Linux keeps a nice value per thread: PRIO_PROCESS with a thread id sets that
    # thread's only (setpriority(2), NOTES).
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + niceness)
    except OSError as exc:
        log.warning("could not lower the follower's CPU priority by %d: %s", niceness, exc)


__all__ = ["Follower"]
