# Mirrors csrc/initializer.h.
from libc.stdint cimport int64_t, uint64_t

from status cimport Status


cdef extern from "initializer.h" namespace "kvsparse" nogil:
    const int kInitializerVersion

    cdef enum class InitializerKind(int):
        kZeros
        kConstant
        kUniform
        kNormal
        kTruncatedNormal

    cdef cppclass InitializerConfig:
        InitializerKind kind
        double a
        double b
        uint64_t seed
        int version

    Status ValidateInitializer(const InitializerConfig& config)
    void FillInitialRow(const InitializerConfig& config, int64_t key, int64_t dim, float* out)
    void FillInitialRows(const InitializerConfig& config, const int64_t* keys, int64_t n,
                         int64_t dim, float* out) except +
