# Mirrors csrc/batch.h.
from libc.stdint cimport int64_t
from libcpp.vector cimport vector

from status cimport Status


cdef extern from "batch.h" namespace "kvsparse" nogil:
    void UniqueWithInverse(const int64_t* keys, int64_t n, vector[int64_t]* unique,
                           int64_t* inverse) except +
    bint SumRowsByIndex(const float* rows, const int64_t* index, int64_t n, int64_t dim,
                        int64_t num_unique, float* out) except +
    int64_t FirstNonFiniteRow(const float* rows, int64_t n, int64_t dim)

    cdef cppclass Partitioner:
        int64_t num_shards
        vector[int64_t] boundaries
        int64_t ShardOf(int64_t key)

    Status ValidatePartitioner(const Partitioner& partitioner)

    cdef cppclass BatchPlan:
        vector[int64_t] keys
        vector[int64_t] offsets

    void PlanBatch(const int64_t* ids, int64_t n, const Partitioner& partitioner,
                   BatchPlan* plan, int64_t* slot) except +
    void GatherFromShards(const float* const* shard_rows, const int64_t* offsets,
                          int64_t num_shards, const int64_t* slot, int64_t n, int64_t dim,
                          float* out) except +
