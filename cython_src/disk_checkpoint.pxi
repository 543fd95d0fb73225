# Reading a tiered table's checkpoint by reference (csrc/disk_checkpoint.h) in
# place. Included at the end of _core.pyx.


cdef class DiskCheckpointRows:
    """The rows of a disk tier's checkpoint by reference (`Table.finish_disk_checkpoint`),
    read in place: nothing in the directory is written.

    Args:
        directory: the checkpoint's directory (its MANIFEST and run files).
        dim: the table's row width.
        num_slots: the table's slot rows per row (`Table.num_slots`).

    Raises:
        InvalidArgument: records of another width than dim and num_slots give.
        CorruptRecord: no MANIFEST, or a damaged one.

    Not thread-safe: one cursor.

    Example:
        >>> rows = DiskCheckpointRows(d, dim=16, num_slots=1)         # doctest: +SKIP
        >>> for keys, values, slots, steps, touches, last_steps in rows.chunks(65536):
        ...     pass
    """

    cdef unique_ptr[DiskCheckpointReader] c_reader
    cdef readonly int64_t dim
    cdef readonly int64_t num_slots

    def __cinit__(self, directory, int64_t dim, int64_t num_slots):
        cdef string c_dir = os.fsencode(directory)
        cdef Status c_status
        with nogil:
            c_status = DiskCheckpointReader.Open(c_dir, dim, num_slots, &self.c_reader)
        _check(c_status)
        self.dim = dim
        self.num_slots = num_slots

    @property
    def rows(self):
        """The rows the checkpoint holds."""
        return self.c_reader.get().rows()

    def chunks(self, int64_t chunk_rows=65536):
        """Yields (keys, values, slots, steps, touches, last_steps) in chunks of up to
        chunk_rows rows, new arrays each (int64 but values (n, dim) and slots
        (n, num_slots, dim), float32). A page that fails its checksum raises
        CorruptRecord naming the file and page."""
        cdef int64_t c_rows = max(chunk_rows, 1)
        cdef int64_t c_count = 0
        cdef int64_t[::1] c_keys, c_steps, c_touches, c_last
        cdef float[:, ::1] c_values
        cdef float[:, :, ::1] c_slots
        cdef float* c_slot_ptr
        cdef Status c_status
        cdef DiskCheckpointReader* c_reader = self.c_reader.get()
        while True:
            keys = np.empty(c_rows, np.int64)
            values = np.empty((c_rows, self.dim), np.float32)
            slots = np.empty((c_rows, self.num_slots, self.dim), np.float32)
            steps = np.empty(c_rows, np.int64)
            touches = np.empty(c_rows, np.int64)
            last_steps = np.empty(c_rows, np.int64)
            c_keys, c_values, c_slots, c_steps = keys, values, slots, steps
            c_touches, c_last = touches, last_steps
            c_slot_ptr = &c_slots[0, 0, 0] if self.num_slots else NULL
            with nogil:
                c_status = c_reader.Next(c_rows, &c_keys[0], &c_values[0, 0], c_slot_ptr,
                                         &c_steps[0], &c_touches[0], &c_last[0], &c_count)
            _check(c_status)
            if c_count == 0:
                return
            yield (keys[:c_count], values[:c_count], slots[:c_count], steps[:c_count],
                   touches[:c_count], last_steps[:c_count])
