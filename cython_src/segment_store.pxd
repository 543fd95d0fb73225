# Mirrors csrc/row_store.h, csrc/segment_store.h and csrc/run_store.h.
from libc.stdint cimport int64_t, uint8_t
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string

from status cimport Status


cdef extern from "row_store.h" namespace "kvsparse" nogil:
    cdef cppclass RowStoreStats:
        int64_t record_bytes
        int64_t live_records
        int64_t segments
        int64_t disk_bytes
        int64_t index_bytes
        int64_t bytes_written
        int64_t bytes_updated
        int64_t bytes_read
        int64_t records_read
        int64_t gc_segments_freed
        int64_t gc_records_moved
        int64_t gc_bytes_moved
        int64_t reads
        int64_t index_bytes_per_record
        int64_t working_bytes
        int64_t maintenance_bytes

    cdef cppclass RowStore:
        Status WriteBatch(const int64_t* keys, int64_t n, const uint8_t* records)
        Status ReadBatch(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found)
        Status Take(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found)
        Status Erase(const int64_t* keys, int64_t n)
        Status Contains(const int64_t* keys, int64_t n, uint8_t* found)
        Status MayContain(const int64_t* keys, int64_t n, uint8_t* maybe)
        Status Flush()
        Status Sync()
        Status Maintenance(int64_t max_bytes, int64_t* bytes_moved)
        Status Checkpoint(const string& directory)
        RowStoreStats Stats()
        Status Close()


cdef extern from "segment_store.h" namespace "kvsparse" nogil:
    cdef cppclass SegmentStoreOptions:
        string directory
        int64_t record_bytes
        int64_t segment_bytes
        double gc_stale_fraction
        int64_t read_threads

    Status OpenSegmentStore(const SegmentStoreOptions& options, unique_ptr[RowStore]* out)
    Status RestoreSegmentStore(const string& checkpoint_directory,
                               const SegmentStoreOptions& options, unique_ptr[RowStore]* out)


cdef extern from "run_store.h" namespace "kvsparse" nogil:
    cdef cppclass RunStoreOptions:
        string directory
        int64_t record_bytes
        int64_t read_threads
        int64_t bloom_bits_per_key
        int64_t merge_fan_in
        bint check_writes
        bint durable
        int64_t buffer_bytes

    Status OpenRunStore(const RunStoreOptions& options, unique_ptr[RowStore]* out)
    Status RestoreRunStore(const string& checkpoint_directory,
                           const RunStoreOptions& options, unique_ptr[RowStore]* out)


cdef extern from "crc32c.h" namespace "kvsparse" nogil:
    bint Crc32cHardware()
