"""The line a server prints on stdout once it is bound, and its reader.

A process that starts servers (``kvsparse launch``, `kvsparse.ray`, the
test fixtures) reads that line to learn the address the server bound (a
``tcp://host:0`` bind picks a free port; an ``ipc:///path`` server prints its
path). This module imports neither ZeroMQ nor the server, so a launcher can
read the line without loading either.

Example:
    >>> line = (LISTENING_PREFIX + "tcp://127.0.0.1:5701\\n").encode()
    >>> parse_listening_line(line)
    'tcp://127.0.0.1:5701'
    >>> parse_listening_line(b"kvsparse server listening on ipc:///tmp/kvsparse-x/server-0\\n")
    'ipc:///tmp/kvsparse-x/server-0'
"""

from __future__ import annotations

import os
import selectors
import time

# The one stdout line a server prints once it is bound (its address follows);
# kvsparse.cluster, kvsparse.ray and the test fixtures read it with read_first_line.
LISTENING_PREFIX = "kvsparse server listening on "


def read_first_line(stream, deadline: float) -> bytes:
    """One line from a binary pipe (a server's stdout), or what arrived before EOF/deadline.

    Reads without blocking past the deadline (time.monotonic() based), so a
    server that never starts cannot hang its launcher.
    """
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    line = b""
    try:
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                break
            chunk = os.read(stream.fileno(), 1)
            if not chunk:
                break
            line += chunk
    finally:
        selector.close()
    return line


def parse_listening_line(line: bytes):
    """The address in a server's listening line, or None if the line is not one.

    The address is the rest of the line, whatever its scheme (``tcp://host:port``,
    ``ipc:///path``): a reader that matched only ``tcp://`` would miss ipc servers.
    """
    text = line.decode(errors="replace").strip()
    if not text.startswith(LISTENING_PREFIX):
        return None
    return text[len(LISTENING_PREFIX) :].strip()
