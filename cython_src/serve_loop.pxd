# Mirrors csrc/serve_loop.h and csrc/zmq_api.h.
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from status cimport Status
from table cimport EmbeddingTable


cdef extern from "zmq_api.h" namespace "kvsparse" nogil:
    cdef cppclass ZmqApi:
        ZmqApi()

    cbool LoadZmqApi "kvsparse::ZmqApi::Load"(const char* path, ZmqApi* api, string* error)


cdef extern from "serve_loop.h" namespace "kvsparse" nogil:
    cdef cppclass ShardMutex:
        ShardMutex()
        void lock()
        cbool try_lock()
        void unlock()

    cdef cppclass FastClientRecord:
        uint64_t client_id
        uint64_t request_id
        cbool is_push
        int64_t last_push
        int64_t pushes
        unsigned char reply[56]
        string error

    cdef cppclass FastTableCount:
        int op
        uint64_t table_id
        int64_t requests
        int64_t keys

    cdef cppclass FastDrain:
        vector[FastClientRecord] clients
        vector[pair[int64_t, int64_t]] clocks
        vector[FastTableCount] tables
        int64_t requests[2]
        vector[int64_t] latency[2]
        double latency_sum[2]
        int64_t keys
        double newest_push
        int64_t errors

    cdef cppclass FastServeLoop:
        FastServeLoop(const ZmqApi& zmq, void* router, void* forward, ShardMutex* mutex,
                      uint32_t incarnation, vector[double] buckets)
        Status Start()
        void Stop()
        void Wake()
        void SetJob(cbool configured, int64_t num_workers, cbool pulls, cbool pushes)
        void SetLimits(int64_t max_rows, int64_t max_reply_bytes, int64_t max_unread,
                       int64_t track_bytes)
        int64_t Unread(const string& routing)
        void ClearTables()
        void AddTable(uint64_t table_id, EmbeddingTable* table, cbool skip_nonfinite)
        cbool SetClient(uint64_t client_id, const string& routing, uint64_t last_request_id,
                        uintptr_t shared_address, int64_t shared_bytes)
        void RemoveClient(uint64_t client_id)
        void SetBudgetHeld(const string& routing, cbool held)
        void MarkHandled()
        cbool Drain(FastDrain* out)
        int64_t clients()
