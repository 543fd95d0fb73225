"""A worker's shared-memory segment, for the servers on its host.

Over ``ipc://`` the server is on the worker's host, so rows need not cross a
socket: the worker offers every such server one segment of its memory in
HELLO, and then pulls rows into it and pushes summed gradients from it,
sending only the keys and a byte offset (`kvsparse.wire.protocol`, "Shared
memory"). That saves the two copies through the kernel each way and the
ZeroMQ I/O threads' work.

The segment is an anonymous memfd: nothing to clean up if the worker is
killed. It is sealed at its size (a mapping of a file that shrinks would
fault in the server). A server opens it as ``/proc/<pid>/fd/<fd>`` (same
user only) and checks the seals and the random token in its first bytes
(`kvsparse.server.shared`).

Regions are handed out as NumPy arrays (`SharedArena.rows`) and come back by
themselves: a region is free again once nothing refers to its array or to a
view of it. The sender keeps the array referenced until its reply came (the
server wrote or read it by then); one whose reply never came is kept for
good (`SharedArena.keep_forever`), so a late write cannot land in a reused
region. When no region fits, the caller sends its rows through the socket.

    arena = SharedArena.create(64 << 20)
    hello["shared"] = arena.offer()
    rows = arena.rows(1000, 64)          # a (1000, 64) float32 array in the segment, or None
    offset = arena.offset_of(rows[10:20])  # its byte offset, or None if not in the segment

Threads: any thread (a lock guards the allocation; a region may come back
from whichever thread drops its last view).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import threading
import weakref
from typing import Optional

import numpy as np

DEFAULT_BYTES = 64 << 20
MIN_BYTES = 1 << 16  # the token's page and some rows
ALIGN = 64  # regions start on cache lines
TOKEN_BYTES = 16
_START = 4096  # the first page holds the token
# Its size can never change (nor its seals): what a server checks before it maps it.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedArena:
    """One memfd segment, regions handed out in a ring (created by `create`).

    Args:
        fd: the memfd (owned: closed by `close`).
        size: its bytes.
    """

    def __init__(self, fd: int, size: int):
        self._fd = fd
        self.size = int(size)
        self._map = mmap.mmap(fd, self.size)
        self._view = memoryview(self._map)
        self._base = np.frombuffer(self._map, np.uint8).ctypes.data
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = self._token
        # Reentrant: a region may come back (its array collected) while one is handed out.
        self._lock = threading.RLock()
        # Live regions in the order they were handed out: start -> [end, still in use].
        self._live: dict[int, list] = {}
        self._kept: list = []  # regions kept for good (their replies never came)
        self._closed = False
        # The memfd closes with the arena if nobody calls close() (a store dropped unclosed:
        # each one left its segment's fd open for good).
        self._release = weakref.finalize(self, os.close, fd)

    @classmethod
    def create(cls, size: int = DEFAULT_BYTES) -> Optional[SharedArena]:
        """A new arena of size bytes, or None where memfds do not exist (not Linux)."""
        if not hasattr(os, "memfd_create"):
            return None
        fd = os.memfd_create("kvsparse-rows", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, int(size))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def offer(self) -> dict:
        """The HELLO's "shared" object: how a server on this host maps the segment."""
        return {"pid": os.getpid(), "fd": self._fd, "bytes": self.size, "token": self._token.hex()}

    # -- regions -------------------------------------------------------------------------

    def rows(self, count: int, dim: int, dtype=np.float32) -> Optional[np.ndarray]:
        """A fresh (count, dim) array of dtype in the segment, or None when none fits.

        Its region is free again once the array and every view of it are gone.
        """
        dtype = np.dtype(dtype)
        nbytes = int(count) * int(dim) * dtype.itemsize
        if nbytes == 0 or self._closed:
            return None
        start = self._allocate(nbytes)
        if start is None:
            return None
        # Every view of `flat` (the reshaped array too) has it as its base: NumPy stops
        # collapsing bases at the memoryview below it. So it lives while any view does.
        flat = np.frombuffer(self._view[start : start + nbytes], dtype)
        weakref.finalize(flat, self._free, start)
        return flat.reshape(count, dim)

    def offset_of(self, array: np.ndarray) -> Optional[int]:
        """The byte offset of a C-contiguous array that lies in the segment, else None."""
        if not array.flags.c_contiguous:
            return None
        offset = array.ctypes.data - self._base
        if offset < _START or offset + array.nbytes > self.size:
            return None
        return offset

    def keep_forever(self, arrays) -> None:
        """Never reuses these arrays' regions: a server may still write or read them."""
        with self._lock:
            self._kept.extend(a for a in arrays if a is not None)

    def close(self) -> None:
        """Closes the memfd; the mapping goes once no array views it."""
        if not self._closed:
            self._closed = True
            self._release()

    # -- the ring ------------------------------------------------------------------------

    def _allocate(self, nbytes: int) -> Optional[int]:
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            live = self._live
            if not live:
                start = _START if _START + size <= self.size else None
            else:
                first = next(iter(live))  # the oldest region in use: the ring's tail
                last = next(reversed(live))
                head = live[last][0]  # the end of the newest one
                if last >= first:  # free: [head, end) and [_START, first)
                    if head + size <= self.size:
                        start = head
                    elif _START + size <= first:
                        start = _START
                    else:
                        start = None
                else:  # wrapped: free is [head, first)
                    start = head if head + size <= first else None
            if start is not None:
                live[start] = [start + size, True]
            return start

    def _free(self, start: int) -> None:
        with self._lock:
            region = self._live.get(start)
            if region is None:
                return
            region[1] = False
            # The ring's tail moves past every region no longer in use.
            while self._live:
                first = next(iter(self._live))
                if self._live[first][1]:
                    break
                del self._live[first]


__all__ = ["DEFAULT_BYTES", "MIN_BYTES", "SEALS", "SharedArena"]
