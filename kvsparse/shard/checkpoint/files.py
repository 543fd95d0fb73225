"""Crash-safe file writing: a temporary name, fsync, rename, and cleanup after a dead writer.

Every checkpoint file (shard files, manifests, export parts) is written under
``{final}.tmp-{pid}-{random}`` and renamed once complete and fsynced, so a
reader sees either the whole file or none. The pid in the name lets the
process that started a writer remove what a writer that died left behind.
"""

from __future__ import annotations

import os
import secrets


def fsync_dir(path: str) -> None:
    """Makes a rename in directory path durable. Thread-safe."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_marker(pid: int) -> str:
    return f".tmp-{pid}-"


def remove_temporary_files(path: str, pid: int) -> None:
    """Removes the temporary files a (dead) writer process pid left in path.

    Thread-safe (it only lists and unlinks); a missing directory is no error.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if _temporary_marker(pid) in name:
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass


class AtomicFile:
    """A new file written under a temporary name; commit() makes it durable and visible.

    Not thread-safe: one thread writes one AtomicFile.

    Args:
        final_path: the name the file gets once committed.
        suffix: appended to the temporary name (``.npz`` for export parts).

    Example:
        >>> with AtomicFile("/ckpt/ckpt-000001.manifest.json") as f:  # doctest: +SKIP
        ...     f.write(body)
    """

    def __init__(self, final_path: str, suffix: str = ""):
        self.final_path = final_path
        marker = _temporary_marker(os.getpid())
        self.tmp_path = f"{final_path}{marker}{secrets.token_hex(4)}{suffix}"
        self.file = open(self.tmp_path, "wb")  # noqa: SIM115 - closed in commit/abort

    def commit(self) -> int:
        """Flushes, fsyncs and renames the file to its final name; returns its size in bytes."""
        self.file.flush()
        os.fsync(self.file.fileno())
        size = self.file.tell()
        self.file.close()
        os.replace(self.tmp_path, self.final_path)
        fsync_dir(os.path.dirname(self.final_path) or ".")
        return size

    def abort(self) -> None:
        """Closes and removes the temporary file."""
        self.file.close()
        try:
            os.unlink(self.tmp_path)
        except OSError:
            pass

    def __enter__(self):
        return self.file

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
