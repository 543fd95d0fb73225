# Mirrors csrc/serving_apply.h.
from libc.stdint cimport int64_t

from status cimport Status
from table cimport EmbeddingTable


cdef extern from "serving_apply.h" namespace "kvsparse" nogil:
    Status AssignMarkedRows(EmbeddingTable* table, const int64_t* keys, int64_t n,
                            const float* values, int64_t dim, float marker)
