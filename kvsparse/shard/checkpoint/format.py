"""The shard file format: framing, checksummed blocks, the index, and its version.

A shard file (docs/checkpoint-format.md) is::

    HEADER (magic, version, flags) | block | block | ... | index JSON | TRAILER

Each block is arrays written back to back; the index (JSON) names every
block's offset, length and CRC-32, and the trailer holds the index's length,
its CRC-32 and an end magic, so a truncated file is recognised. This module
owns the bytes: `BlockWriter` writes them, `read_shard_file` / `ShardFile`
read and check them. What the index's sections mean (tables, rows) belongs to
`kvsparse.shard.checkpoint.shard_io`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field

import numpy as np

from kvsparse import errors
from kvsparse.shard.checkpoint.files import AtomicFile

FORMAT = "kvsparse-checkpoint"
# 2: tables record their initializer's stream version (kvsparse.initializers: the v2
# streams give unseen ids other rows than v1). Version 1 files are read as stream v1.
# 3: sparse tables carry their admission candidates; files of
# versions 1 and 2 have none, and load with none.
# 4: sparse blocks of tables with an eviction policy carry each row's touch count and last
# step ("meta"); sections record the spec the table was created with ("init_spec") when a
# set_optimizer(key=...) gave it its own optimizer since; a server's file holds its resend
# records, rank 0's set_optimizer calls and the job's configuration ("server").
# 5: a full save's section of a tiered table may name its rows on disk ("disk": a
# directory of hard-linked run files and their MANIFEST, kvsparse.shard.checkpoint.disk)
# instead of holding them; files without such a section are still written as version 4.
VERSION = 5
BY_VALUE_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MAGIC = b"KVSPCKPT"
END_MAGIC = b"KVSPEND1"
# magic (8) + version (u32) + flags (u32)
HEADER = struct.Struct("<8sII")
# index length (u64) + index crc32 (u32) + end magic (8)
TRAILER = struct.Struct("<QI8s")
BLOCK_ROWS = 65536
PROGRESS_ROWS = 1_000_000  # a tqdm bar for files with at least this many rows


# Defined with the other error classes so that it crosses the wire (and a forked
# writer's pipe) as itself, not as ServerError or InvalidArgument.
CheckpointError = errors.CheckpointError


def progress_bar(total_rows: int, desc: str):
    """A tqdm bar on stderr for at least PROGRESS_ROWS rows, else None. Thread-safe."""
    if total_rows < PROGRESS_ROWS:
        return None
    from tqdm import tqdm  # only for large files: keeps tqdm off the import path

    return tqdm(total=total_rows, unit="rows", desc=desc, file=sys.stderr, mininterval=2.0)


# -- writing ------------------------------------------------------------------------------


class BlockWriter:
    """Writes one shard file: the header, checksummed blocks, then the index (finish).

    The file lives under a temporary name until finish() renames it, so an
    aborted or crashed writer never leaves a file a reader would take.
    Not thread-safe: one thread (a server's forked writer, or the local
    store's caller) writes one file.

    Args:
        final_path: the shard file to create.
        total_rows: rows the file will hold (for the progress bar).
        desc: the progress bar's label.
        version: the format version in the header (the index must say the same).
    """

    def __init__(self, final_path: str, total_rows: int, desc: str, version: int = VERSION):
        self._out = AtomicFile(final_path)
        self._out.file.write(HEADER.pack(MAGIC, version, 0))
        self._offset = HEADER.size
        self.blocks = 0  # blocks written so far
        self._progress = progress_bar(total_rows, desc)

    def block(self, arrays: list[np.ndarray], rows: int = 0) -> dict:
        """Writes arrays back to back; returns their entry {"offset", "length", "crc32"}.

        rows: how far to advance the progress bar.
        """
        start, crc = self._offset, 0
        for array in arrays:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            if not data.nbytes:
                continue
            crc = zlib.crc32(data, crc)
            self._out.file.write(data)
            self._offset += data.nbytes
        self.blocks += 1
        if self._progress is not None and rows:
            self._progress.update(rows)
        return {"offset": start, "length": self._offset - start, "crc32": crc}

    def sparse_block(self, keys, values, slots, steps, meta=None) -> dict:
        """Writes rows of a sparse table; the entry `ShardFile.sparse_blocks` reads.

        meta: None, or the rows' (touches, last_steps) (`_core.Table.read_row_meta`),
        written as a section of its own (`ShardFile.row_meta` reads it).
        """
        entry = {"rows": int(keys.size), **self.block([keys, values, slots, steps], rows=keys.size)}
        if meta is not None:
            entry["meta"] = self.block([m.astype(np.uint32) for m in meta])
        return entry

    def removed_block(self, ids: np.ndarray) -> dict:
        """Writes the ids removed from a table; the entry `ShardFile.removed` reads."""
        return {"rows": int(ids.size), **self.block([ids])}

    def candidates_block(self, keys, counts, last_steps) -> dict | None:
        """Writes a table's admission candidates; the entry `ShardFile.candidates` reads.

        None when there are none. Counts and steps are stored as uint32, as the table holds them.
        """
        if not keys.size:
            return None
        arrays = [keys, counts.astype(np.uint32), last_steps.astype(np.uint32)]
        return {"rows": int(keys.size), **self.block(arrays)}

    def finish(self, index: dict) -> int:
        """Writes the index and trailer, then renames the file into place; returns its size."""
        body = json.dumps(index, separators=(",", ":")).encode()
        self._out.file.write(body)
        self._out.file.write(TRAILER.pack(len(body), zlib.crc32(body), END_MAGIC))
        size = self._out.commit()
        self._close_progress()
        return size

    def abort(self) -> None:
        """Removes the unfinished file."""
        self._close_progress()
        self._out.abort()

    def _close_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()


# -- reading ------------------------------------------------------------------------------


@dataclass
class ShardFile:
    """An opened, validated shard file: its index and raw bytes (a read-only map).

    Each section is checked against its CRC-32 when read. Arrays returned are
    read-only views of the file. Safe to read from several threads at once.
    """

    path: str
    index: dict
    data: memoryview = field(repr=False)
    version: int = VERSION  # the file's format version (READABLE_VERSIONS)

    def section(self, entry: dict) -> memoryview:
        """The bytes of a block entry, after checking its bounds and CRC-32."""
        start, length = int(entry["offset"]), int(entry["length"])
        if start < HEADER.size or start + length > len(self.data):
            raise CheckpointError(f"{self.path}: a section lies outside the file (corrupt index)")
        view = self.data[start : start + length]
        if zlib.crc32(view) != int(entry["crc32"]):
            raise CheckpointError(
                f"{self.path}: checksum mismatch in the section at byte {start} (corrupt file)"
            )
        return view

    def sparse_blocks(self, section: dict):
        """Yields (keys, values, slots, steps) of each block of a sparse table section."""
        dim, num_slots = int(section["dim"]), int(section["num_slots"])
        for block in section["blocks"]:
            n = int(block["rows"])
            expected = n * (8 + 4 * dim + 4 * num_slots * dim + 8)
            if int(block["length"]) != expected:
                raise CheckpointError(f"{self.path}: block length does not match its row count")
            raw = self.section(block)
            a = 8 * n
            b = a + 4 * n * dim
            c = b + 4 * n * num_slots * dim
            keys = np.frombuffer(raw[:a], np.int64)
            values = np.frombuffer(raw[a:b], np.float32).reshape(n, dim)
            slots = np.frombuffer(raw[b:c], np.float32).reshape(n, num_slots, dim)
            steps = np.frombuffer(raw[c:], np.int64)
            yield keys, values, slots, steps

    def row_meta(self, block: dict) -> tuple[np.ndarray, np.ndarray] | None:
        """(touches, last_steps), int64, of a sparse block's rows; None if it has none.

        Version 4 files hold them for tables whose eviction policy keeps them.
        """
        entry = block.get("meta")
        if not entry:
            return None
        n = int(block["rows"])
        if int(entry["length"]) != 8 * n:
            raise CheckpointError(f"{self.path}: row metadata section has the wrong length")
        raw = self.section(entry)
        touches = np.frombuffer(raw[: 4 * n], np.uint32).astype(np.int64)
        last_steps = np.frombuffer(raw[4 * n :], np.uint32).astype(np.int64)
        return touches, last_steps

    def disk_rows(self, section: dict, chunk_rows: int = BLOCK_ROWS):
        """Yields (keys, values, slots, steps, (touches, last_steps)) of a section's rows
        on disk (a checkpoint by reference; none for other sections), read in place.

        Raises CheckpointError for a missing or damaged directory or page, naming it.
        """
        entry = section.get("disk")
        if not entry:
            return
        from kvsparse import _core  # the format's bytes need no core; these rows do

        directory = os.path.join(os.path.dirname(self.path), str(entry["dir"]))
        try:
            rows = _core.DiskCheckpointRows(
                directory, int(section["dim"]), int(section["num_slots"])
            )
            if rows.rows != int(entry["rows"]):
                raise CheckpointError(
                    f"{directory}: holds {rows.rows} rows, the shard file says {entry['rows']}"
                )
            for keys, values, slots, steps, touches, last_steps in rows.chunks(chunk_rows):
                yield keys, values, slots, steps, (touches, last_steps)
        except (errors.StorageError, errors.InvalidArgument) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{self.path}: its rows on disk: {exc}") from None

    def removed(self, section: dict) -> np.ndarray:
        """The ids a delta's sparse table section removed (empty for a full checkpoint)."""
        entry = section.get("removed")
        if not entry:
            return np.empty(0, np.int64)
        raw = self.section(entry)
        if len(raw) != 8 * int(entry["rows"]):
            raise CheckpointError(f"{self.path}: removed-ids section has the wrong length")
        return np.frombuffer(raw, np.int64)

    def candidates(self, section: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, counts, last_steps), int64, of a sparse table section (empty before version 3)."""
        entry = section.get("candidates")
        if not entry:
            empty = np.empty(0, np.int64)
            return empty, empty, empty
        n = int(entry["rows"])
        if int(entry["length"]) != 16 * n:
            raise CheckpointError(f"{self.path}: candidates section has the wrong length")
        raw = self.section(entry)
        keys = np.frombuffer(raw[: 8 * n], np.int64)
        counts = np.frombuffer(raw[8 * n : 12 * n], np.uint32).astype(np.int64)
        last_steps = np.frombuffer(raw[12 * n :], np.uint32).astype(np.int64)
        return keys, counts, last_steps

    def dense(self, section: dict) -> tuple[np.ndarray, np.ndarray]:
        """(values, slots) of a dense key's section: (size,) and (num_slots, size) float32."""
        size, num_slots = int(section["size"]), int(section["num_slots"])
        if int(section["length"]) != 4 * size * (1 + num_slots):
            raise CheckpointError(f"{self.path}: dense section has the wrong length")
        raw = self.section(section)
        values = np.frombuffer(raw[: 4 * size], np.float32)
        slots = np.frombuffer(raw[4 * size :], np.float32).reshape(num_slots, size)
        return values, slots


def read_shard_file(path: str) -> ShardFile:
    """Opens and validates a shard file's framing and index (sections are checked when read).

    Thread-safe.

    Raises:
        CheckpointError: missing, truncated, corrupt, or another format version.

    Example:
        >>> f = read_shard_file("ckpt/ckpt-000001.shard-00000-of-00002.kvs")  # doctest: +SKIP
        >>> [t["name"] for t in f.index["sparse"]]                             # doctest: +SKIP
        ['user']
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # Mapped, not read: sections become arrays without a copy of the file.
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint file ({exc})") from None
    if len(data) < HEADER.size + TRAILER.size:
        raise CheckpointError(f"{path}: truncated checkpoint file ({len(data)} bytes)")
    magic, version, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a kvsparse checkpoint file (bad magic)")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: checkpoint format version {version}; this kvsparse reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    index_len, index_crc, end = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    if end != END_MAGIC or index_len > len(data) - HEADER.size - TRAILER.size:
        raise CheckpointError(f"{path}: truncated checkpoint file (no valid index at the end)")
    body = data[len(data) - TRAILER.size - index_len : len(data) - TRAILER.size]
    if zlib.crc32(body) != index_crc:
        raise CheckpointError(f"{path}: checksum mismatch in the index (corrupt file)")
    index = json.loads(body)
    if index.get("format") != FORMAT or index.get("version") != version:
        raise CheckpointError(f"{path}: unknown checkpoint index format")
    return ShardFile(path, index, memoryview(data), version)
