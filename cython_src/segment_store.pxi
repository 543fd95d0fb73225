# The disk tier's storage engines, RunStore (csrc/run_store.h: the tier's) and
# SegmentStore (csrc/segment_store.h), exposed for tests and benchmarks.
# Included at the end of _core.pyx.
from libcpp.string cimport string as cpp_string
from libc.stdint cimport uint8_t

import os

from segment_store cimport (Crc32cHardware, OpenRunStore, OpenSegmentStore, RestoreRunStore,
                            RestoreSegmentStore, RowStore, RowStoreStats, RunStoreOptions,
                            SegmentStoreOptions)

CRC32C_HARDWARE = bool(Crc32cHardware())


cdef int _check_storage(const Status& c_status) except -1:
    """Raises the kvsparse.errors class of a failed storage-engine Status (`_check` maps
    the storage codes: CorruptRecord, DiskFull, StorageError)."""
    return _check(c_status)


cdef SegmentStoreOptions _segment_options(directory, int64_t record_bytes, int64_t segment_bytes,
                                          double gc_stale_fraction, int64_t read_threads):
    cdef SegmentStoreOptions c_options
    c_options.directory = os.fsencode(directory)
    c_options.record_bytes = record_bytes
    c_options.segment_bytes = segment_bytes
    c_options.gc_stale_fraction = gc_stale_fraction
    c_options.read_threads = read_threads
    return c_options


cdef class _RowStore:
    """What SegmentStore and RunStore share: the RowStore interface (csrc/row_store.h)."""

    cdef unique_ptr[RowStore] c_store
    cdef readonly int64_t record_bytes

    cdef RowStore* _store(self) except NULL:
        if not self.c_store:
            raise errors.InvalidArgument(f"the {type(self).__name__} is closed")
        return self.c_store.get()

    def write(self, keys_arg, records_arg):
        """Writes records (uint8, shape (len(keys), record_bytes)) all or nothing.

        A key given twice keeps its last record.

        Raises:
            DTypeError, ShapeError: keys or records of the wrong dtype or shape.
            DiskFull: the disk or file size limit ran out; nothing was applied.
            StorageError: another write error; nothing was applied.

        Example:
            >>> store.write(np.array([1, 2]), np.zeros((2, store.record_bytes), np.uint8))
        """
        cdef RowStore* c_store = self._store()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const uint8_t[:, ::1] records = _arg(records_arg, np.uint8, 2, "records")
        cdef int64_t c_n = keys.shape[0]
        if records.shape[0] != c_n or records.shape[1] != self.record_bytes:
            raise errors.ShapeError(
                f"records must have shape ({c_n}, {self.record_bytes}), got "
                f"{(records.shape[0], records.shape[1])}")
        if c_n == 0:
            return
        cdef Status c_status
        with nogil:
            c_status = c_store.WriteBatch(&keys[0], c_n, &records[0, 0])
        _check_storage(c_status)

    def read(self, keys_arg, out=None):
        """Reads the records of keys: returns (records, found).

        records is uint8 (len(keys), record_bytes), zeros where found is False.
        The reads of the batch are issued together over read_threads threads.

        Raises:
            CorruptRecord: a record failed its checksum or holds another key
                (the message names file, offset and key); nothing is served.
            StorageError: a read error.

        Example:
            >>> records, found = store.read(np.array([1, 99]))
        """
        cdef RowStore* c_store = self._store()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        if out is None:
            out = np.empty((c_n, self.record_bytes), dtype=np.uint8)
        out = _arg(out, np.uint8, 2, "out", output=True)
        if out.shape[0] != c_n or out.shape[1] != self.record_bytes:
            raise errors.ShapeError(f"out must have shape ({c_n}, {self.record_bytes})")
        found = np.zeros(c_n, dtype=np.bool_)
        if c_n == 0:
            return out, found
        cdef uint8_t[:, ::1] c_out = out
        cdef uint8_t[::1] c_found = found.view(np.uint8)
        cdef Status c_status
        with nogil:
            c_status = c_store.ReadBatch(&keys[0], c_n, &c_out[0, 0], &c_found[0])
        _check_storage(c_status)
        return out, found

    def erase(self, keys_arg):
        """Removes keys (absent ones are ignored), all or nothing.

        Raises:
            DiskFull, StorageError: the tombstones could not be written;
                nothing was removed.

        Example:
            >>> store.erase(np.array([1]))
        """
        cdef RowStore* c_store = self._store()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        if c_n == 0:
            return
        cdef Status c_status
        with nogil:
            c_status = c_store.Erase(&keys[0], c_n)
        _check_storage(c_status)

    def contains(self, keys_arg):
        """A bool array: which keys the store holds (SegmentStore: no disk I/O;
        RunStore reads the pages its filters cannot rule out).

        Example:
            >>> store.contains(np.array([1, 2])).tolist()
            [False, True]
        """
        cdef RowStore* c_store = self._store()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        found = np.zeros(c_n, dtype=np.bool_)
        if c_n == 0:
            return found
        cdef uint8_t[::1] c_found = found.view(np.uint8)
        cdef Status c_status
        with nogil:
            c_status = c_store.Contains(&keys[0], c_n, &c_found[0])
        _check_storage(c_status)
        return found

    def take(self, keys_arg, out=None):
        """Reads the records of keys and removes the found ones: (records, found).

        All or nothing: on an error nothing is removed.

        Raises:
            CorruptRecord: a page or record failed its checksum (the message
                names the file and the offset); nothing is removed.
            StorageError: a read error.

        Example:
            >>> records, found = store.take(np.array([1, 99]))
        """
        cdef RowStore* c_store = self._store()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        if out is None:
            out = np.empty((c_n, self.record_bytes), dtype=np.uint8)
        out = _arg(out, np.uint8, 2, "out", output=True)
        if out.shape[0] != c_n or out.shape[1] != self.record_bytes:
            raise errors.ShapeError(f"out must have shape ({c_n}, {self.record_bytes})")
        found = np.zeros(c_n, dtype=np.bool_)
        if c_n == 0:
            return out, found
        cdef uint8_t[:, ::1] c_out = out
        cdef uint8_t[::1] c_found = found.view(np.uint8)
        cdef Status c_status
        with nogil:
            c_status = c_store.Take(&keys[0], c_n, &c_out[0, 0], &c_found[0])
        _check_storage(c_status)
        return out, found

    def may_contain(self, keys_arg):
        """A bool array: False where the store surely lacks a key (no disk I/O).

        Example:
            >>> store.may_contain(np.array([1, 2])).tolist()
            [False, True]
        """
        cdef RowStore* c_store = self._store()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        maybe = np.zeros(c_n, dtype=np.bool_)
        if c_n == 0:
            return maybe
        cdef uint8_t[::1] c_maybe = maybe.view(np.uint8)
        cdef Status c_status
        with nogil:
            c_status = c_store.MayContain(&keys[0], c_n, &c_maybe[0])
        _check_storage(c_status)
        return maybe

    def flush(self):
        """Hands buffered writes to the operating system (a no-op today: writes
        go straight to the files).

        Example:
            >>> store.flush()
        """
        cdef RowStore* c_store = self._store()
        cdef Status c_status
        with nogil:
            c_status = c_store.Flush()
        _check_storage(c_status)

    def sync(self):
        """Makes every write so far durable (fdatasync of the open file).

        Example:
            >>> store.sync()
        """
        cdef RowStore* c_store = self._store()
        cdef Status c_status
        with nogil:
            c_status = c_store.Sync()
        _check_storage(c_status)

    def maintenance(self, int64_t max_bytes):
        """Garbage collection: rewrites mostly stale files, about max_bytes at most.

        Returns the bytes read and written. Call it between training steps;
        a file that needs more than one call's budget is continued next call.

        Raises:
            CorruptRecord: a live record being moved failed its checksum.
            DiskFull, StorageError: the copies could not be written; the
                records stay where they were.

        Example:
            >>> moved = store.maintenance(64 << 20)
        """
        cdef RowStore* c_store = self._store()
        cdef int64_t c_moved = 0
        cdef Status c_status
        with nogil:
            c_status = c_store.Maintenance(max_bytes, &c_moved)
        _check_storage(c_status)
        return c_moved

    def checkpoint(self, directory):
        """Makes directory (missing or empty) a consistent copy of the store.

        Sealed segment files enter it by hard link (no bytes copied), plus a
        MANIFEST; SegmentStore.restore() opens a store from it.

        Raises:
            InvalidArgument: directory is not empty.
            StorageError: a link or the manifest could not be written
                (e.g. another file system: hard links need the same one).

        Example:
            >>> store.checkpoint(tmp / "ckpt")
        """
        cdef RowStore* c_store = self._store()
        cdef cpp_string c_directory = os.fsencode(directory)
        cdef Status c_status
        with nogil:
            c_status = c_store.Checkpoint(c_directory)
        _check_storage(c_status)

    def stats(self):
        """A dict of counters: live_records, segments, disk_bytes, index_bytes,
        bytes_written, bytes_updated, bytes_read, records_read, gc_* ...

        Example:
            >>> store.stats()["live_records"]
            2
        """
        cdef RowStore* c_store = self._store()
        cdef RowStoreStats c_stats
        with nogil:
            c_stats = c_store.Stats()
        return {
            "record_bytes": c_stats.record_bytes,
            "live_records": c_stats.live_records,
            "segments": c_stats.segments,
            "disk_bytes": c_stats.disk_bytes,
            "index_bytes": c_stats.index_bytes,
            "bytes_written": c_stats.bytes_written,
            "bytes_updated": c_stats.bytes_updated,
            "bytes_read": c_stats.bytes_read,
            "records_read": c_stats.records_read,
            "gc_segments_freed": c_stats.gc_segments_freed,
            "gc_records_moved": c_stats.gc_records_moved,
            "gc_bytes_moved": c_stats.gc_bytes_moved,
            "reads": c_stats.reads,
            "index_bytes_per_record": c_stats.index_bytes_per_record,
            "working_bytes": c_stats.working_bytes,
            "maintenance_bytes": c_stats.maintenance_bytes,
        }

    def close(self):
        """Syncs and closes the files; later calls raise InvalidArgument.

        Example:
            >>> store.close()
        """
        cdef Status c_status
        if not self.c_store:
            return
        with nogil:
            c_status = self.c_store.get().Close()
            self.c_store.reset()
        _check_storage(c_status)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


cdef class SegmentStore(_RowStore):
    """A log-structured store of fixed-size records keyed by int64 id, on disk.

    Records are bytes: one row's value, its optimizer slots and metadata,
    record_bytes long. Segment files in directory are appended to in whole
    batches and checksummed (CRC32C); an in-RAM index maps each key to its
    record. Opening an existing directory recovers it (latest write wins,
    a torn tail of the newest file is cut off).

    Args:
        directory: where the segment files live (created if missing).
        record_bytes: bytes of every record (>= 1).
        segment_bytes: size at which a file is sealed (default 64 MiB).
        gc_stale_fraction: stale share at which maintenance() rewrites a file.
        read_threads: preads in flight for one read() (queue depth).

    Raises:
        InvalidArgument: bad options, or files of another record size.
        CorruptRecord: a damaged record in a file other than the newest tail.
        StorageError: the directory or a file cannot be opened.

    Thread-safe: calls from several threads serialize inside; the GIL is
    released for the whole batch.

    Example:
        >>> store = SegmentStore(tmp, record_bytes=4)
        >>> store.write(np.array([7]), np.frombuffer(b"abcd", np.uint8).reshape(1, 4))
        >>> store.read(np.array([7, 8]))[1].tolist()
        [True, False]
    """

    def __init__(self, directory, int64_t record_bytes, int64_t segment_bytes=64 << 20,
                 double gc_stale_fraction=1.0 / 3.0, int64_t read_threads=16, *,
                 _restore_from=None):
        cdef SegmentStoreOptions c_options = _segment_options(
            directory, record_bytes, segment_bytes, gc_stale_fraction, read_threads)
        cdef cpp_string c_checkpoint
        cdef Status c_status
        cdef bint c_restore = _restore_from is not None
        if c_restore:
            c_checkpoint = os.fsencode(_restore_from)
        with nogil:
            if c_restore:
                c_status = RestoreSegmentStore(c_checkpoint, c_options, &self.c_store)
            else:
                c_status = OpenSegmentStore(c_options, &self.c_store)
        _check_storage(c_status)
        self.record_bytes = record_bytes

    @classmethod
    def restore(cls, checkpoint_directory, directory, int64_t record_bytes, **options):
        """Opens a store in directory (missing or empty) from a checkpoint().

        The checkpoint's segment files enter directory by hard link; the
        checkpoint itself is left as it is and may be restored again.

        Raises:
            InvalidArgument: directory is not empty, or another record size.
            CorruptRecord: a malformed manifest or a damaged record.
            StorageError: a file cannot be linked or opened.

        Example:
            >>> store = SegmentStore.restore(tmp / "ckpt", tmp / "new", record_bytes=4)
        """
        return cls(directory, record_bytes, _restore_from=checkpoint_directory, **options)



cdef class RunStore(_RowStore):
    """The disk tier's store: immutable hash-ordered runs, ~1.5-2 B of RAM per record.

    Records (record_bytes each, keyed by int64) are written in runs sorted by
    a hash of the key, in checksummed pages; RAM holds per run fragment a
    page index, a Bloom filter and a live bit per record (csrc/run_store.h).
    A lookup reads about one page; merges, paced by maintenance(), keep the
    runs few. checkpoint() hard-links the run files; RunStore.restore()
    brings them back without reading a row.

    Args:
        directory: missing or empty (a new store), or holding a MANIFEST.
        record_bytes: bytes of every record (>= 1).
        read_threads: preads in flight per batch (queue depth).
        bloom_bits_per_key: filter bits per record (10: ~1% false positives).
        merge_fan_in: runs of about one size (any age) merged together.
        check_writes: write() refuses a key the store holds (InvalidArgument).
        buffer_bytes: what one read round holds (pages read at once) and the page-size cap
            for wide records (csrc/run_store.h).

    Raises:
        InvalidArgument: bad options, a non-empty directory without MANIFEST.
        CorruptRecord: a damaged MANIFEST.
        StorageError: the directory or a file cannot be opened.

    Thread-safe: calls serialize inside; the GIL is released per batch.

    Example:
        >>> store = RunStore(tmp, record_bytes=4)
        >>> store.write(np.array([7]), np.frombuffer(b"abcd", np.uint8).reshape(1, 4))
        >>> store.take(np.array([7, 8]))[1].tolist()
        [True, False]
    """

    def __init__(self, directory, int64_t record_bytes, int64_t read_threads=16,
                 int64_t bloom_bits_per_key=10, int64_t merge_fan_in=4, bint check_writes=True,
                 *, int64_t buffer_bytes=4 << 20, _restore_from=None):
        cdef RunStoreOptions c_options
        c_options.directory = os.fsencode(directory)
        c_options.record_bytes = record_bytes
        c_options.read_threads = read_threads
        c_options.buffer_bytes = buffer_bytes
        c_options.bloom_bits_per_key = bloom_bits_per_key
        c_options.merge_fan_in = merge_fan_in
        c_options.check_writes = check_writes
        c_options.durable = True
        cdef cpp_string c_checkpoint
        cdef Status c_status
        cdef bint c_restore = _restore_from is not None
        if c_restore:
            c_checkpoint = os.fsencode(_restore_from)
        with nogil:
            if c_restore:
                c_status = RestoreRunStore(c_checkpoint, c_options, &self.c_store)
            else:
                c_status = OpenRunStore(c_options, &self.c_store)
        _check_storage(c_status)
        self.record_bytes = record_bytes

    @classmethod
    def restore(cls, checkpoint_directory, directory, int64_t record_bytes, **options):
        """Opens a store in directory (missing or empty) from a checkpoint().

        The run files enter directory by hard link and the index comes from
        the checkpoint's MANIFEST (no row is read); the checkpoint stays.

        Raises:
            InvalidArgument: directory is not empty, or another record size.
            CorruptRecord: no MANIFEST (an incomplete checkpoint), or a damaged one.
            StorageError: a file cannot be linked or opened.

        Example:
            >>> store = RunStore.restore(tmp / "ckpt", tmp / "new", record_bytes=4)
        """
        return cls(directory, record_bytes, _restore_from=checkpoint_directory, **options)
