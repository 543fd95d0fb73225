# Mirrors csrc/half.h.
from libc.stdint cimport int64_t, uint16_t


cdef extern from "half.h" namespace "kvsparse" nogil:
    cdef enum class HalfKind(int):
        kFloat16
        kBFloat16

    void NarrowFloats(HalfKind kind, const float* values, int64_t n, uint16_t* out) except +
    void WidenHalves(HalfKind kind, const uint16_t* halves, int64_t n, float* out) except +
    bint UseHalfHardware(bint enable)
    int64_t FirstNonFiniteHalfRow(HalfKind kind, const uint16_t* rows, int64_t n, int64_t dim)
    void GatherWidenFromShards(HalfKind kind, const uint16_t* const* shard_rows,
                               const int64_t* offsets, int64_t num_shards, const int64_t* slot,
                               int64_t n, int64_t dim, float* out) except +
