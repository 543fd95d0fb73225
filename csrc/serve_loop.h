// FastServeLoop: a server's PULL_SPARSE and PUSH_SPARSE answered on a C++ thread,
// without the GIL.
//
// The thread owns the reading of the server's ROUTER socket (which pyzmq created,
// configured and bound). It waits with ::poll on the socket's ZMQ_FD and on a
// wake-up eventfd, then, holding the shard mutex, receives every waiting message:
// a request it may answer (below) it answers itself; any other message goes on,
// unchanged and uncopied (routing id first), over an inproc PAIR socket to the
// Python serving thread (kvsparse/server/loop.py), which polls that instead of the
// ROUTER. Python still sends its own replies on the ROUTER, holding the same mutex,
// and calls Wake() after each send: ZMQ_FD is edge-triggered and any use of the
// socket may consume its signal, so the thread asks ZMQ_EVENTS again after every
// wake-up and before it sleeps.
//
// It answers only the success path of a request Python registered everything for: a
// PULL_SPARSE or PUSH_SPARSE with a valid header, from a client Python registered (its
// HELLO accepted, on the routing id it registered), with a request id above every one
// seen from that client, once Python has handled every message forwarded before (so
// replies keep the order requests came in), when the job allows it (pulls: no SSP gate;
// pushes: ASP, or BSP with one worker), on registered tables, within the request limits
// and the connection's unread-reply budget (large reply frames are counted until libzmq
// frees them, as Python's ReplyBudget counts its own, and Python adds this count to its
// own). Anything else, and any request that would fail (unknown table, bad frame sizes,
// shape, a NaN gradient on a table that does not skip them, an overflow of the update,
// a limit), is forwarded before anything changed, so that Python sends the one error
// reply. A push is applied to all its tables or none, as ShardState.push_sparse_tables
// does, and every reply byte is the one the Python path would send.
//
// What the thread did is recorded (per client: the last request and, for a push,
// its reply header; per rank: the highest clock; counts per op and table,
// latencies, keys, the time of the newest push) and handed to Python by Drain(),
// which brings the resend cache, SSP clocks, counters and metrics up to date
// before Python reads them (kvsparse/server/fastpath.py).
//
//   kvsparse::FastServeLoop loop(zmq, router, forward_pair, &mutex, incarnation, buckets);
//   { std::lock_guard<ShardMutex> hold(mutex); loop.SetJob(true, 2, true, true); ... }
//   loop.Start();
//   ...
//   loop.Stop();  // not holding the mutex
//
// Threads: Start(), Stop() from one controlling thread that does not hold the
// mutex. Wake() from any thread. Every other method only while holding the
// shard mutex (the thread holds it while it serves).
#ifndef KVSPARSE_SERVE_LOOP_H_
#define KVSPARSE_SERVE_LOOP_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "status.h"
#include "table.h"
#include "zmq_api.h"

namespace kvsparse {

// The shard mutex. Recursive: a Python thread holding it may reach code that takes
// it again (EmbeddedServer's lock was an RLock).
using ShardMutex = std::recursive_mutex;

// Op indices of the counters below.
enum FastOp : int { kFastPull = 0, kFastPush = 1, kFastOps = 2 };

// What the loop did since the last Drain(), for Python's bookkeeping.
struct FastClientRecord {
  uint64_t client_id = 0;
  uint64_t request_id = 0;   // the latest fast request of the client
  bool is_push = false;      // whether that one was a push
  int64_t last_push = -1;    // request id of the latest fast push, -1: none
  int64_t pushes = 0;        // fast pushes
  unsigned char reply[56];   // the latest request's reply header (a push's: its whole reply)
  std::string error;         // the message frame of an error reply ("": none; see ServePush)
};

struct FastTableCount {
  int op = 0;
  uint64_t table_id = 0;
  int64_t requests = 0;
  int64_t keys = 0;
};

struct FastDrain {
  std::vector<FastClientRecord> clients;
  std::vector<std::pair<int64_t, int64_t>> clocks;  // (rank, highest clock)
  std::vector<FastTableCount> tables;
  int64_t requests[kFastOps] = {0, 0};
  std::vector<int64_t> latency[kFastOps];  // a count per bucket, the last above them all
  double latency_sum[kFastOps] = {0.0, 0.0};
  int64_t keys = 0;
  double newest_push = 0.0;  // wall seconds since the epoch of the newest fast push; 0: none
  int64_t errors = 0;        // MemoryError replies (a push that ran out of memory midway)
};

class FastServeLoop {
 public:
  // router, forward: libzmq socket pointers (pyzmq's Socket.underlying); mutex
  // outlives the loop. buckets: the latency histogram's upper bounds (seconds).
  FastServeLoop(const ZmqApi& zmq, void* router, void* forward, ShardMutex* mutex,
                uint32_t incarnation, std::vector<double> buckets);
  ~FastServeLoop();
  FastServeLoop(const FastServeLoop&) = delete;
  FastServeLoop& operator=(const FastServeLoop&) = delete;

  Status Start();
  void Stop();
  void Wake();

  // The job: whether HELLO configured it, its number of workers, and which ops the
  // loop may answer (pulls: no staleness bound; pushes: ASP, or BSP with one worker).
  void SetJob(bool configured, int64_t num_workers, bool pulls, bool pushes);
  // max_rows_per_request, max_reply_bytes, max_unread_reply_bytes, and the size from which
  // a reply frame counts as unread until ZeroMQ lets go of it (Python's TRACK_BYTES).
  void SetLimits(int64_t max_rows, int64_t max_reply_bytes, int64_t max_unread,
                 int64_t track_bytes);
  // Bytes of the loop's replies to routing that ZeroMQ still holds (what Python's reply
  // budget adds to its own count).
  int64_t Unread(const std::string& routing) const;
  void ClearTables();
  void AddTable(uint64_t table_id, EmbeddingTable* table, bool skip_nonfinite);
  // A client whose HELLO was accepted, on routing; last_request_id: the last one Python
  // recorded for it; shared_address, shared_bytes: its shared segment as this process maps
  // it (kvsparse/server/shared.py; 0: none), valid until the next SetClient or
  // RemoveClient of it. False when the loop keeps too many clients already.
  bool SetClient(uint64_t client_id, const std::string& routing, uint64_t last_request_id,
                 uintptr_t shared_address = 0, int64_t shared_bytes = 0);
  void RemoveClient(uint64_t client_id);
  // Python's reply budget tracks replies to routing that ZeroMQ still holds.
  void SetBudgetHeld(const std::string& routing, bool held);
  // Python handled the oldest forwarded message it had not handled yet.
  void MarkHandled();
  // Moves what the loop did since the last call into *out; false when nothing.
  bool Drain(FastDrain* out);

  int64_t clients() const { return static_cast<int64_t>(clients_.size()); }

 private:
  struct Client {
    std::string routing;
    uint64_t last_seen = 0;     // highest request id of the client seen (fast or forwarded)
    uint64_t forward_seq = 0;   // forwards before which Python must have handled
    unsigned char* shared = nullptr;  // its shared segment (FLAG_SHARED requests), or none
    int64_t shared_bytes = 0;
    bool dirty = false;
    FastClientRecord record;
  };
  struct Forwarded {
    uint64_t client_id;
    uint64_t request_id;
    bool has_header;
  };
  struct Header {
    uint16_t op;
    uint32_t flags;
    uint64_t request_id;
    uint64_t client_id;
    int32_t rank;
    uint32_t num_items;
    int64_t clock;
    uint32_t num_frames;
  };
  struct Item {
    uint64_t table_id;
    int64_t count;
    int32_t dim;
    uint32_t flags;
  };
  // Bytes of tracked replies to one connection that ZeroMQ holds; the free function of
  // each tracked frame takes its bytes off (from libzmq's I/O thread).
  struct UnreadBytes {
    std::atomic<int64_t> bytes{0};
  };
  struct TrackedFrame {
    std::shared_ptr<UnreadBytes> unread;
    int64_t bytes;
  };
  static void FreeTrackedFrame(void* data, void* hint);
  struct TableEntry {
    EmbeddingTable* table;
    int64_t dim;
    bool skip_nonfinite;
  };

  void Run();
  // Serves waiting messages (mutex held); true if more wait (a full batch was served).
  bool ServeBatch();
  // One slice of work for when no request waits (mutex held): the tables'
  // PrefaultAhead, then their IdleMaintenance (disk tier merges). True if it did any.
  bool IdleWork();
  bool ReceiveMessage();
  void CloseFrames();
  void Forward(bool has_header, const Header& header);
  // Each returns false (having changed nothing) to decline the request.
  bool ParseHeader(Header* header);
  bool Admissible(const Header& header, Client** client);
  bool ParseItems(const Header& header, size_t frames_per_item, std::vector<Item>* items);
  bool ServePull(const Header& header, Client* client);
  bool ServeSharedPull(const Header& header, Client* client,
                       std::chrono::steady_clock::time_point started);
  // A pull's reply (3 + items frames): routing id and items copied; returns the items.
  unsigned char* StartPullReply(std::vector<ZmqMsg>* reply);
  // A served pull's header frame, counts, send and record (reply[1] is filled here).
  void SendPullReply(const Header& header, Client* client, std::vector<ZmqMsg>* reply,
                     std::chrono::steady_clock::time_point started);
  // offsets_ from a FLAG_SHARED request's last frame, each item's rows checked to lie in
  // the client's segment (items_ parsed first).
  bool SharedOffsets(const Header& header, const Client& client);
  bool ServePush(const Header& header, Client* client);
  // A push item's rows as float32 (16-bit rows widened, misaligned ones copied).
  const float* AlignedRows(const ZmqMsg* frame, int64_t count, int64_t dim, uint32_t flags,
                           std::vector<float>* scratch);
  const int64_t* AlignedKeys(const ZmqMsg* frame, int64_t count, std::vector<int64_t>* scratch);
  void PackReply(const Header& header, uint32_t num_frames, uint32_t num_items,
                 unsigned char* out) const;
  bool SendReply(std::vector<ZmqMsg>* frames);
  void Record(const Header& header, Client* client, const unsigned char* reply, double seconds);
  void CountTable(int op, uint64_t table_id, int64_t keys);

  const ZmqApi zmq_;
  void* const router_;
  void* const forward_;
  ShardMutex* const mutex_;
  const uint32_t incarnation_;
  const std::vector<double> buckets_;
  int router_fd_ = -1;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  // Everything below: under the mutex.
  bool configured_ = false;
  int64_t num_workers_ = 0;
  bool pulls_ = false;
  bool pushes_ = false;
  int64_t max_rows_ = 0;
  int64_t max_reply_bytes_ = 0;
  int64_t max_unread_ = 0;
  int64_t track_bytes_ = 0;
  std::unordered_map<std::string, std::shared_ptr<UnreadBytes>> unread_;
  std::unordered_map<uint64_t, TableEntry> tables_;
  std::unordered_map<uint64_t, Client> clients_;
  std::unordered_set<std::string> budget_held_;
  std::deque<Forwarded> forwarded_;
  uint64_t forward_total_ = 0;
  uint64_t handled_total_ = 0;

  std::deque<ZmqMsg> frames_;  // the message being served (a deque: its msgs never move)
  bool dirty_ = false;
  std::vector<uint64_t> dirty_clients_;
  std::vector<int64_t> clocks_;  // per rank, the highest clock since the last Drain()
  std::vector<char> clock_changed_;
  std::unordered_map<uint64_t, FastTableCount> table_counts_[kFastOps];
  FastDrain pending_;
  // Scratch reused by every request.
  std::vector<Item> items_;
  std::vector<int64_t> key_scratch_;
  std::vector<uint64_t> offsets_;
  std::vector<float> row_scratch_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_SERVE_LOOP_H_
