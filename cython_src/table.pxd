# Mirrors csrc/table.h.
from libc.stdint cimport int64_t, uint32_t
from libcpp.memory cimport shared_ptr, unique_ptr
from libcpp.string cimport string

from initializer cimport InitializerConfig
from optimizer cimport OptimizerConfig
from status cimport Status


cdef extern from "table.h" namespace "kvsparse" nogil:
    const int64_t kMaxDim

    # Admission and eviction.
    cdef enum class EvictionKind(int):
        kLfu
        kLru

    cdef cppclass PolicyConfig:
        int64_t min_count
        int64_t ttl_steps
        int64_t max_rows
        EvictionKind eviction
        int64_t evict_every

    cdef cppclass PolicyStats:
        int64_t admissions
        int64_t evicted_ttl
        int64_t evicted_capacity
        int64_t rejected
        int64_t candidates

    Status ValidatePolicy(const PolicyConfig& policy)

    # Storage of values / slots.
    cdef enum class StorageType(int):
        kFloat32
        kFloat16
        kBFloat16

    cdef cppclass TableConfig:
        int64_t dim
        InitializerConfig initializer
        OptimizerConfig optimizer
        PolicyConfig policy
        StorageType value_type
        StorageType slot_type

    cdef cppclass MemoryBudget:
        MemoryBudget(int64_t limit)
        int64_t limit()
        void Report(const void* owner, int64_t bytes)
        int64_t Used()

    cdef cppclass TierConfig:
        shared_ptr[MemoryBudget] budget
        string spill_dir
        string name
        bint concurrent_lookups

    cdef cppclass TierStats:
        int64_t memory_budget
        int64_t rows_in_memory
        int64_t rows_on_disk
        int64_t memory_bytes
        int64_t disk_bytes
        int64_t disk_index_bytes
        int64_t row_lookups
        int64_t disk_hits
        int64_t rows_read
        int64_t evictions
        int64_t disk_reads
        int64_t bytes_read
        int64_t bytes_written
        int64_t bytes_updated
        int64_t gc_segments_freed
        int64_t gc_bytes_moved
        int64_t idle_bytes_moved
        int64_t compactions

    cdef enum class NonFinitePolicy(int):
        kReject
        kSkip

    cdef cppclass EmbeddingTable:
        @staticmethod
        Status Create(const TableConfig& config, unique_ptr[EmbeddingTable]* out) except +
        Status EnableTier(const TierConfig& tier) except +
        bint tiered()
        TierStats tier_stats() except +
        Status scan_status()
        int64_t dim()
        int num_slots()
        const TableConfig& config()
        int64_t Size()
        int64_t MemoryBytes()
        bint PrefaultAhead(int64_t max_bytes)
        bint IdleMaintenance(int64_t max_bytes)
        int64_t ScratchBytes()
        int64_t table_step()
        void set_table_step(int64_t step)
        Status SetOptimizer(const OptimizerConfig& optimizer) except +
        Status SetLearningRate(double learning_rate)
        Status Lookup(const int64_t* keys, int64_t n, float* out) except +
        Status PrefetchRows(const int64_t* keys, int64_t n, int64_t* read) except +
        Status LookupOrInsert(const int64_t* keys, int64_t n, float* out) except +
        void InitialValues(const int64_t* keys, int64_t n, float* out) except +
        Status ApplyGradients(const int64_t* keys, int64_t n, const float* grads,
                              NonFinitePolicy policy, int64_t* applied) except +
        Status BeginPush(const int64_t* keys, int64_t n, const float* grads,
                         NonFinitePolicy policy) except +
        Status FinishPush(int64_t* applied) except +
        void CancelPush()
        bint push_pending()
        Status Assign(const int64_t* keys, int64_t n, const float* values) except +
        int64_t Remove(const int64_t* keys, int64_t n) except +
        Status ReadState(const int64_t* keys, int64_t n, float* values, float* slots,
                         int64_t* steps) except +
        Status WriteState(const int64_t* keys, int64_t n, const float* values,
                          const float* slots, const int64_t* steps) except +
        int64_t NextKeys(int64_t* cursor, int64_t max_rows, int64_t* keys_out) except +
        uint32_t change_epoch()
        void set_change_epoch(uint32_t epoch)
        int64_t NextChangedKeys(int64_t* cursor, int64_t max_rows, uint32_t since,
                                int64_t* keys_out) except +
        int64_t RemovedSince(uint32_t since, int64_t* keys_out, int64_t capacity) except +
        void PruneRemoved(uint32_t through)
        Status ReserveRows(int64_t rows) except +
        int64_t NextChangedRows(int64_t* cursor, int64_t max_rows, uint32_t since,
                                int64_t* keys_out, float* values, float* slots, int64_t* steps,
                                bint memory_only) except +
        # Checkpoints by reference of the disk tier (csrc/table_disk_checkpoint.cc).
        bint HasDiskStore()
        Status LinkDiskCheckpoint(const string& directory) except +
        Status FinishDiskCheckpoint(const string& directory, int64_t* rows) except +
        Status AdoptDiskCheckpoint(const string& directory) except +
        # Admission and eviction.
        int64_t EvictExpired() except +
        void AdvanceStep()
        PolicyStats policy_stats()
        # Admission candidates for checkpoints (a restarted server that lost them would drop
        # the push that admits an id).
        int64_t CandidateCount()
        int64_t ReadCandidates(int64_t* keys, int64_t* counts, int64_t* last_steps,
                               int64_t capacity)
        Status WriteCandidates(const int64_t* keys, const int64_t* counts,
                               const int64_t* last_steps, int64_t n) except +
        void ClearCandidates()
        # Per-row policy metadata for checkpoints (so that a restarted server evicts the rows
        # it would have evicted).
        bint TracksRowMeta()
        Status ReadRowMeta(const int64_t* keys, int64_t n, int64_t* touches,
                           int64_t* last_steps) except +
        Status WriteRowMeta(const int64_t* keys, int64_t n, const int64_t* touches,
                            const int64_t* last_steps) except +


cdef extern from "disk_checkpoint.h" namespace "kvsparse" nogil:
    cdef cppclass DiskCheckpointReader:
        @staticmethod
        Status Open(const string& directory, int64_t dim, int64_t num_slots,
                    unique_ptr[DiskCheckpointReader]* out) except +
        int64_t rows()
        Status Next(int64_t max_rows, int64_t* keys, float* values, float* slots,
                    int64_t* steps, int64_t* touches, int64_t* last_steps,
                    int64_t* count) except +
