"""Checkpoint saves and exports written by a forked child, while the server goes on serving.

Redis BGSAVE style: `os.fork` gives the child a copy-on-write snapshot of
the shard at that moment; the child writes, sends its JSON result through a
pipe and leaves with ``os._exit``, never touching ZeroMQ. The server's event
loop watches the pipe with its sockets (`kvsparse.server.loop.EventLoop.watch`)
and answers the request when the child is done.

The child closes every file descriptor it inherited: the server's
listening socket and client connections, whose copies kept a replacement
server from binding the port ("Address already in use") and clients from
seeing the dead server's connections close until the writer exited.
"""

from __future__ import annotations

import gc
import json
import os
import re
from typing import Callable

from kvsparse import errors

# Files of a disk tier (csrc/run_store.h, and csrc/segment_store.h's): the writer reads a
# tiered table's rows on disk through the descriptors it inherited.
_SEGMENT_FILE = re.compile(r"/(run-\d+\.kvr|segment-\d+\.kvs)$")


def _segment_fds() -> list:
    """The open descriptors of disk-tier run (or segment) files, ascending ([] without
    /proc)."""
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if _SEGMENT_FILE.search(target):
            found.append(int(name))
    return sorted(found)


def _close_inherited_fds(keep: int) -> None:
    """Closes every fd above stderr but keep (the forked child's own pipe end) and the
    segment files of disk tiers (the child reads the rows on disk through them)."""
    try:
        limit = os.sysconf("SC_OPEN_MAX")
    except (OSError, ValueError):
        limit = 65536
    # One close_range(2) call per gap where the kernel has it (CPython uses it).
    low = 3
    for fd in sorted({keep, *_segment_fds()}):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, max(limit, low))


class ForkedWriter:
    """Runs writer jobs in forked children and reports each one's outcome.

    Args:
        watch: ``watch(fd, callback)``: runs callback once fd is readable
            (`EventLoop.watch`).

    Threads: not thread-safe; the server's event loop thread only (fork from
    one thread, with no other thread holding a lock the child needs).
    """

    def __init__(self, watch: Callable[[int, Callable[[], None]], None]):
        self._watch = watch
        self._running = False

    @property
    def running(self) -> bool:
        """True while a child writes (the server runs one at a time)."""
        return self._running

    def start(
        self,
        job: Callable[[], object],
        on_done: Callable[[object, BaseException | None], None],
        cleanup: Callable[[int], None] | None = None,
    ) -> None:
        """Runs job() in a forked child; on_done(reply, error) once the child exited.

        Args:
            job: runs in the child; returns a JSON-able reply.
            on_done: run in the parent: ``on_done(job's reply, None)``, or
                ``on_done(None, error)``: the job's own KVSparseError class (else
                ServerError) carrying its message, or ServerError if the child died.
            cleanup: ``cleanup(pid)``, run in the parent after the child exited,
                before on_done, whatever happened (e.g. to remove a dead writer's
                temporary files).
        """
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no zmq, no return into the event loop
            status = 1
            try:
                # Objects that own the closed fds must never be finalized here: a collected
                # zmq socket or file would close an fd number the job has reused meanwhile.
                gc.freeze()
                _close_inherited_fds(keep=write_fd)
                # Let go of stdout: whoever reads the server's stdout sees its end when the
                # server exits, not when a writer it left behind does.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                try:
                    result = {"ok": True, "reply": job()}
                except OSError as exc:  # a path or disk problem: the request's, not the server's
                    result = {"ok": False, "error": "CheckpointError", "message": str(exc)}
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    result = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
                data = json.dumps(result).encode()
                while data:
                    data = data[os.write(write_fd, data) :]
                status = 0
            finally:
                os._exit(status)
        os.close(write_fd)
        self._running = True
        self._watch(read_fd, lambda: self._finished(read_fd, pid, on_done, cleanup))

    def _finished(self, read_fd: int, pid: int, on_done, cleanup) -> None:
        chunks = []
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read_fd)
        os.waitpid(pid, 0)
        self._running = False
        if cleanup is not None:
            cleanup(pid)
        try:
            result = json.loads(b"".join(chunks)) if chunks else None
        except ValueError:
            result = None
        if result is None:
            on_done(None, errors.ServerError("the checkpoint writer died"))
        elif not result["ok"]:
            cls = getattr(errors, result["error"], None)
            if not (isinstance(cls, type) and issubclass(cls, errors.KVSparseError)):
                cls = errors.ServerError
            on_done(None, cls(f"checkpoint writer: {result['message']}"))
        else:
            on_done(result["reply"], None)
