# Mirrors csrc/status.h.
from libcpp.string cimport string


cdef extern from "status.h" namespace "kvsparse" nogil:
    cdef enum class StatusCode(int):
        kOk
        kInvalidArgument
        kNonFinite
        kOutOfMemory
        kCapacity
        kInternal
        kOverflow
        kCorruption
        kDiskFull
        kIoError
        kLimitExceeded

    cdef cppclass Status:
        Status()
        bint ok()
        StatusCode code()
        const string& message()
