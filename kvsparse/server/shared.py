"""The shared-memory segments of the workers on this server's host.

A worker on the server's host offers a segment in its HELLO (a memfd, named
by its pid and descriptor, `kvsparse.client.shared`); the server maps it and
then reads pushed rows from it and writes pulled rows into it, in place of
the socket's copies (`kvsparse.wire.protocol`, "Shared memory").

The server opens ``/proc/<pid>/fd/<fd>``: the kernel lets only a process of
the same user (or root) do that, and only a memfd whose first 16 bytes hold
the token the HELLO names is taken, so a HELLO cannot make the server map
some other file. The memfd must be sealed against shrinking: a mapped file
that shrinks makes the server's next access to the lost pages a SIGBUS.

    segments = SharedSegments()
    ok, why = segments.attach(client_id, {"pid": ..., "fd": ..., "bytes": ..., "token": ...})
    segment = segments.get(client_id)   # a uint8 array over the mapping, or None
    segments.detach(client_id)

Threads: the server's serving thread, holding the shard lock (the C++ fast
path reads a segment's address only under it, `kvsparse.server.fastpath`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Optional

import numpy as np

TOKEN_BYTES = 16  # at the start of a segment: the HELLO's token, as bytes
# Seals a segment must carry: it can neither shrink nor lose them.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class SharedSegments:
    """{client id: the mapping of its shared segment}."""

    def __init__(self) -> None:
        self._segments: dict[int, tuple] = {}  # client id -> (key, mmap, uint8 array)

    def attach(self, client_id: int, offer: dict) -> tuple:
        """Maps a client's offered segment -> (True, "") or (False, why not).

        The same offer again keeps the mapping; another one replaces it.
        """
        key = (offer["pid"], offer["fd"], offer["bytes"], offer["token"])
        held = self._segments.get(client_id)
        if held is not None and held[0] == key:
            return True, ""
        try:
            mapping = _open(offer)
        except (OSError, ValueError) as exc:
            self.detach(client_id)
            return False, f"{type(exc).__name__}: {exc}"
        self._segments[client_id] = (key, mapping, np.frombuffer(mapping, np.uint8))
        return True, ""

    def get(self, client_id: int) -> Optional[np.ndarray]:
        """The client's segment as a uint8 array, or None."""
        held = self._segments.get(client_id)
        return None if held is None else held[2]

    def address(self, client_id: int) -> tuple:
        """(address, bytes) of the client's segment, (0, 0) if none (for the C++ fast path)."""
        segment = self.get(client_id)
        if segment is None:
            return 0, 0
        return segment.ctypes.data, segment.size

    def detach(self, client_id: int) -> None:
        """Forgets the client's segment (unmapped once no array views it)."""
        self._segments.pop(client_id, None)

    def __len__(self) -> int:
        return len(self._segments)


def _open(offer: dict) -> mmap.mmap:
    """The mapping of an offered segment, once it checks out.

    Raises:
        OSError: it cannot be opened (another host's pid, another user's process).
        ValueError: not a memfd, not sealed against shrinking, another size, or not
            the token the HELLO names.
    """
    path = f"/proc/{offer['pid']}/fd/{offer['fd']}"
    if not os.readlink(path).startswith("/memfd:"):
        raise ValueError(f"{path} is not a memfd")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS != REQUIRED_SEALS:
            raise ValueError(f"{path} is not sealed against shrinking (F_SEAL_SHRINK)")
        size = os.fstat(fd).st_size
        if size != offer["bytes"]:
            raise ValueError(f"the segment has {size} bytes, the HELLO says {offer['bytes']}")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mapping[:TOKEN_BYTES] != bytes.fromhex(offer["token"]):
        mapping.close()
        raise ValueError("the segment does not hold the HELLO's token")
    return mapping


__all__ = ["SharedSegments", "TOKEN_BYTES"]
