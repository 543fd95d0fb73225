#include "serve_loop.h"

#include <dlfcn.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <new>
#include <chrono>
#include <cstring>
#include <system_error>
#include <type_traits>
#include <utility>

#include "batch.h"
#include "half.h"
#include "wire_constants.h"

namespace kvsparse {

// ---- ZmqApi -------------------------------------------------------------------------

bool ZmqApi::Load(const char* path, ZmqApi* api, std::string* error) {
  // RTLD_NOLOAD: only the copy pyzmq loaded; never a second libzmq in the process.
  void* handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    const char* why = dlerror();
    *error = std::string("libzmq is not loaded from ") + path + (why ? std::string(": ") + why : "");
    return false;
  }
  bool complete = true;
  auto find = [&](auto* slot, const char* name) {
    *slot = reinterpret_cast<std::remove_pointer_t<decltype(slot)>>(dlsym(handle, name));
    if (*slot == nullptr) {
      complete = false;
      *error = std::string("libzmq at ") + path + " has no " + name;
    }
  };
  find(&api->msg_init, "zmq_msg_init");
  find(&api->msg_init_size, "zmq_msg_init_size");
  find(&api->msg_init_data, "zmq_msg_init_data");
  find(&api->msg_recv, "zmq_msg_recv");
  find(&api->msg_send, "zmq_msg_send");
  find(&api->msg_close, "zmq_msg_close");
  find(&api->msg_data, "zmq_msg_data");
  find(&api->msg_size, "zmq_msg_size");
  find(&api->msg_more, "zmq_msg_more");
  find(&api->getsockopt, "zmq_getsockopt");
  find(&api->errno_, "zmq_errno");
  // The handle is kept (one reference more on a library pyzmq keeps loaded anyway).
  return complete;
}

// ---- wire layout: csrc/wire_constants.h, generated from kvsparse/wire/protocol.py ------

namespace {

using namespace wire;  // NOLINT: the generated constants, read as if declared here

// The C++ type each field is read as must have the field's width in protocol.HEADER /
// ITEM_DTYPE: a changed format then fails the build here instead of misreading the wire.
static_assert(kHeaderMagicBytes == kWireMagicSize && kHeaderVersionBytes == sizeof(uint16_t) &&
                  kHeaderOpBytes == sizeof(uint16_t) && kHeaderFlagsBytes == sizeof(uint32_t) &&
                  kHeaderStatusBytes == sizeof(uint32_t) &&
                  kHeaderRequestIdBytes == sizeof(uint64_t) &&
                  kHeaderClientIdBytes == sizeof(uint64_t) &&
                  kHeaderRankBytes == sizeof(int32_t) && kHeaderNumItemsBytes == sizeof(uint32_t) &&
                  kHeaderClockBytes == sizeof(int64_t) &&
                  kHeaderNumFramesBytes == sizeof(uint32_t) &&
                  kHeaderIncarnationBytes == sizeof(uint32_t),
              "the header fields serve_loop.cc reads have the widths of protocol.HEADER");
static_assert(kItemTableIdBytes == sizeof(uint64_t) && kItemCountBytes == sizeof(int64_t) &&
                  kItemDimBytes == sizeof(int32_t) && kItemFlagsBytes == sizeof(uint32_t),
              "the item fields serve_loop.cc reads have the widths of protocol.ITEM_DTYPE");

constexpr size_t kBatch = 1024;  // messages per hold of the mutex
// Rows written by the lookup straight into a message's buffer only from this size up:
// smaller messages live inside zmq_msg_t, whose alignment zmq.h does not promise.
constexpr size_t kDirectRowBytes = 64;

template <typename T>
T Read(const unsigned char* data, size_t offset) {
  T value;
  std::memcpy(&value, data + offset, sizeof(T));
  return value;
}

template <typename T>
void Write(unsigned char* data, size_t offset, T value) {
  std::memcpy(data + offset, &value, sizeof(T));
}

int64_t ElementBytes(uint32_t flags) { return (flags >> kItemDtypeShift) == 0 ? 4 : 2; }

HalfKind KindOf(uint32_t flags) { return static_cast<HalfKind>(flags >> kItemDtypeShift); }

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---- FastServeLoop --------------------------------------------------------------------

FastServeLoop::FastServeLoop(const ZmqApi& zmq, void* router, void* forward, ShardMutex* mutex,
                             uint32_t incarnation, std::vector<double> buckets)
    : zmq_(zmq),
      router_(router),
      forward_(forward),
      mutex_(mutex),
      incarnation_(incarnation),
      buckets_(std::move(buckets)) {
  for (auto& counts : pending_.latency) counts.assign(buckets_.size() + 1, 0);
}

FastServeLoop::~FastServeLoop() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status FastServeLoop::Start() {
  if (thread_.joinable()) return Status(StatusCode::kInvalidArgument, "already started");
  size_t size = sizeof(router_fd_);
  if (zmq_.getsockopt(router_, kZmqFd, &router_fd_, &size) != 0) {
    return Status(StatusCode::kInternal, "zmq_getsockopt(ZMQ_FD) failed");
  }
  if (wake_fd_ < 0) {
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Status(StatusCode::kInternal, "eventfd failed");
  }
  stop_.store(false);
  try {
    thread_ = std::thread(&FastServeLoop::Run, this);
  } catch (const std::system_error& error) {
    return Status(StatusCode::kInternal, std::string("cannot start a thread: ") + error.what());
  }
  return Status::Ok();
}

void FastServeLoop::Stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  Wake();
  thread_.join();
}

void FastServeLoop::Wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  // EAGAIN (the counter is full) still leaves the fd readable: the loop wakes anyway.
  ssize_t written = write(wake_fd_, &one, sizeof(one));
  (void)written;
}

void FastServeLoop::Run() {
  pollfd fds[2] = {{router_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  while (!stop_.load()) {
    bool more;
    {
      std::lock_guard<ShardMutex> hold(*mutex_);
      if (stop_.load()) break;
      more = ServeBatch();
    }
    if (more) continue;  // the mutex was let go between batches: Python gets its turn
    {
      std::lock_guard<ShardMutex> hold(*mutex_);
      if (stop_.load()) break;
      if (IdleWork()) continue;  // a slice done: look for requests before the next
    }
    // Asked again after the wait, under the mutex: the ZMQ_FD edge may have been
    // consumed by Python's last send, which wakes us through wake_fd_ then.
    if (poll(fds, 2, -1) < 0 && errno != EINTR) break;
    if (fds[1].revents & POLLIN) {
      uint64_t count;
      ssize_t got = read(wake_fd_, &count, sizeof(count));
      (void)got;
    }
  }
}

bool FastServeLoop::IdleWork() {
  // A slice small enough that a request arriving meanwhile waits little for it
  // (1 MiB of fresh memory: ~0.1-1 ms of the kernel's zeroing here).
  constexpr int64_t kSliceBytes = int64_t{1} << 20;
  for (auto& entry : tables_) {
    if (entry.second.table->PrefaultAhead(kSliceBytes)) return true;
  }
  // The disk tiers' merges (a merge fragment or more: ~10-30 ms at 16 MiB), off the
  // requests that earned them: one table's step per slice, and every table told that
  // the server is idle (max_bytes 0), so that none runs its merges in requests.
  bool merged = false;
  for (auto& entry : tables_) {
    merged = entry.second.table->IdleMaintenance(merged ? 0 : kSliceBytes) || merged;
  }
  return merged;
}

bool FastServeLoop::ServeBatch() {
  for (size_t served = 0; served < kBatch; ++served) {
    int events = 0;
    size_t size = sizeof(events);
    if (zmq_.getsockopt(router_, kZmqEvents, &events, &size) != 0) return false;
    if (!(events & kZmqPollIn)) return false;
    if (!ReceiveMessage()) return false;
    Header header{};
    bool has_header = ParseHeader(&header);
    Client* client = nullptr;
    bool served_here = false;
    if (has_header && Admissible(header, &client)) {
      served_here = header.op == kOpPullSparse ? ServePull(header, client)
                                               : ServePush(header, client);
    }
    if (!served_here) Forward(has_header, header);
    CloseFrames();
  }
  return true;
}

bool FastServeLoop::ReceiveMessage() {
  while (true) {
    frames_.emplace_back();
    ZmqMsg* msg = &frames_.back();
    zmq_.msg_init(msg);
    if (zmq_.msg_recv(msg, router_, kZmqDontWait) < 0) {
      zmq_.msg_close(msg);
      frames_.pop_back();
      // Only possible before the first frame (a multipart message arrives whole).
      CloseFrames();
      return false;
    }
    if (!zmq_.msg_more(msg)) return true;
  }
}

void FastServeLoop::CloseFrames() {
  for (ZmqMsg& msg : frames_) zmq_.msg_close(&msg);
  frames_.clear();
}

void FastServeLoop::Forward(bool has_header, const Header& header) {
  const size_t n = frames_.size();
  for (size_t i = 0; i < n; ++i) {
    // Uncopied: the received message moves to the PAIR (which has no high-water mark).
    if (zmq_.msg_send(&frames_[i], forward_, (i + 1 < n ? kZmqSndMore : 0) | kZmqDontWait) < 0) {
      return;  // the PAIR is closing (the server stops): the rest is closed by CloseFrames
    }
  }
  ++forward_total_;
  forwarded_.push_back({header.client_id, header.request_id, has_header});
  if (has_header) {
    auto found = clients_.find(header.client_id);
    if (found != clients_.end()) {
      Client& client = found->second;
      client.last_seen = std::max(client.last_seen, header.request_id);
      client.forward_seq = forward_total_;
    }
  }
}

void FastServeLoop::MarkHandled() {
  if (forwarded_.empty()) return;
  const Forwarded done = forwarded_.front();
  forwarded_.pop_front();
  ++handled_total_;
  if (done.has_header) {
    auto found = clients_.find(done.client_id);
    if (found != clients_.end()) {
      found->second.last_seen = std::max(found->second.last_seen, done.request_id);
    }
  }
}

bool FastServeLoop::ParseHeader(Header* header) {
  // Only what the fast path may take; anything else Python checks (and answers).
  if (frames_.size() < 2) return false;
  ZmqMsg* head = &frames_[1];
  if (zmq_.msg_size(head) != kHeaderSize) return false;
  const auto* data = static_cast<const unsigned char*>(zmq_.msg_data(head));
  if (std::memcmp(data, kWireMagic, kWireMagicSize) != 0) return false;
  header->request_id = Read<uint64_t>(data, kHeaderRequestIdOffset);
  header->client_id = Read<uint64_t>(data, kHeaderClientIdOffset);
  header->op = Read<uint16_t>(data, kHeaderOpOffset);
  header->flags = Read<uint32_t>(data, kHeaderFlagsOffset);
  header->rank = Read<int32_t>(data, kHeaderRankOffset);
  header->num_items = Read<uint32_t>(data, kHeaderNumItemsOffset);
  header->clock = Read<int64_t>(data, kHeaderClockOffset);
  header->num_frames = Read<uint32_t>(data, kHeaderNumFramesOffset);
  return Read<uint16_t>(data, kHeaderVersionOffset) == kWireVersion &&
         (header->flags & ~kKnownFlags) == 0 &&
         Read<uint32_t>(data, kHeaderStatusOffset) == 0 &&
         Read<uint32_t>(data, kHeaderIncarnationOffset) == 0 &&
         header->num_items <= kMaxItems && header->num_frames <= kMaxFrames &&
         header->rank >= 0 && header->clock >= 0 &&
         header->num_frames == frames_.size() - 2;
}

bool FastServeLoop::Admissible(const Header& header, Client** client) {
  if (header.op == kOpPullSparse) {
    if (!pulls_) return false;
  } else if (header.op == kOpPushSparse) {
    if (!pushes_) return false;
  } else {
    return false;
  }
  if (!configured_ || header.rank >= num_workers_) return false;
  auto found = clients_.find(header.client_id);
  if (found == clients_.end()) return false;
  Client& known = found->second;
  // Resends, stale ids, and requests behind ones Python still has to handle: Python's.
  if (header.request_id <= known.last_seen || known.forward_seq > handled_total_) return false;
  ZmqMsg* routing = &frames_[0];
  const size_t size = zmq_.msg_size(routing);
  if (size != known.routing.size() ||
      std::memcmp(zmq_.msg_data(routing), known.routing.data(), size) != 0) {
    return false;  // a new socket of the client: Python notes its routing id first
  }
  *client = &known;
  return true;
}

bool FastServeLoop::ParseItems(const Header& header, size_t frames_per_item,
                               std::vector<Item>* items) {
  const size_t num_items = header.num_items;
  const size_t extra = (header.flags & kFlagShared) ? 1 : 0;  // the offsets frame
  if (frames_.size() != 3 + frames_per_item * num_items + extra) return false;
  ZmqMsg* frame = &frames_[2];
  if (zmq_.msg_size(frame) != num_items * kItemSize) return false;
  const auto* data = static_cast<const unsigned char*>(zmq_.msg_data(frame));
  items->resize(num_items);
  for (size_t i = 0; i < num_items; ++i) {
    Item& item = (*items)[i];
    const unsigned char* at = data + i * kItemSize;
    item.table_id = Read<uint64_t>(at, kItemTableIdOffset);
    item.count = Read<int64_t>(at, kItemCountOffset);
    item.dim = Read<int32_t>(at, kItemDimOffset);
    item.flags = Read<uint32_t>(at, kItemFlagsOffset);
    if (item.count < 0 || item.dim < 0 || item.dim > kWireMaxDim ||
        (item.flags & ~kKnownItemFlags) != 0 ||
        (item.flags >> kItemDtypeShift) > kMaxWireDtypeCode) {
      return false;
    }
    if (tables_.find(item.table_id) == tables_.end()) return false;
  }
  return true;
}

bool FastServeLoop::SharedOffsets(const Header& header, const Client& client) {
  // ops.PullSparse / PushSparse with FLAG_SHARED: u64 offsets, one per item, in the last
  // frame; each item's rows (in its wire dtype) must lie within the client's segment.
  if (client.shared == nullptr) return false;  // Python answers: no segment of the client's
  ZmqMsg* frame = &frames_.back();
  const size_t num_items = header.num_items;
  if (zmq_.msg_size(frame) != num_items * sizeof(uint64_t)) return false;
  const auto* data = static_cast<const unsigned char*>(zmq_.msg_data(frame));
  offsets_.resize(num_items);
  for (size_t i = 0; i < num_items; ++i) {
    const uint64_t offset = Read<uint64_t>(data, i * sizeof(uint64_t));
    const Item& item = items_[i];
    const int64_t dim = tables_.at(item.table_id).dim;
    // The width the client made room for (a pull's item dim), or pushed: the table's.
    if (item.dim != dim) return false;
    const uint64_t element = static_cast<uint64_t>(ElementBytes(item.flags));
    const uint64_t bytes =
        static_cast<uint64_t>(item.count) * static_cast<uint64_t>(dim) * element;
    const uint64_t size = static_cast<uint64_t>(client.shared_bytes);
    if (offset % element != 0 || offset > size || bytes > size - offset) return false;
    offsets_[i] = offset;
  }
  return true;
}

const int64_t* FastServeLoop::AlignedKeys(const ZmqMsg* frame, int64_t count,
                                          std::vector<int64_t>* scratch) {
  const void* data = zmq_.msg_data(const_cast<ZmqMsg*>(frame));
  if (count == 0) return nullptr;
  if (reinterpret_cast<uintptr_t>(data) % alignof(int64_t) == 0) {
    return static_cast<const int64_t*>(data);
  }
  scratch->resize(static_cast<size_t>(count));
  std::memcpy(scratch->data(), data, static_cast<size_t>(count) * sizeof(int64_t));
  return scratch->data();
}

const float* FastServeLoop::AlignedRows(const ZmqMsg* frame, int64_t count, int64_t dim,
                                        uint32_t flags, std::vector<float>* scratch) {
  const void* data = zmq_.msg_data(const_cast<ZmqMsg*>(frame));
  const int64_t n = count * dim;
  if (n == 0) return nullptr;
  if ((flags >> kItemDtypeShift) == 0 && reinterpret_cast<uintptr_t>(data) % alignof(float) == 0) {
    return static_cast<const float*>(data);
  }
  scratch->resize(static_cast<size_t>(n));
  if ((flags >> kItemDtypeShift) == 0) {
    std::memcpy(scratch->data(), data, static_cast<size_t>(n) * sizeof(float));
  } else if (reinterpret_cast<uintptr_t>(data) % alignof(uint16_t) == 0) {
    WidenHalves(KindOf(flags), static_cast<const uint16_t*>(data), n, scratch->data());
  } else {
    std::vector<uint16_t> halves(static_cast<size_t>(n));
    std::memcpy(halves.data(), data, static_cast<size_t>(n) * sizeof(uint16_t));
    WidenHalves(KindOf(flags), halves.data(), n, scratch->data());
  }
  return scratch->data();
}

void FastServeLoop::PackReply(const Header& header, uint32_t num_frames, uint32_t num_items,
                              unsigned char* out) const {
  // protocol.pack_reply: the request's fields, flags and status 0, the incarnation stamped.
  std::memcpy(out, kWireMagic, kWireMagicSize);
  Write<uint16_t>(out, kHeaderVersionOffset, kWireVersion);
  Write<uint16_t>(out, kHeaderOpOffset, header.op);
  Write<uint32_t>(out, kHeaderFlagsOffset, 0);
  Write<uint32_t>(out, kHeaderStatusOffset, 0);
  Write<uint64_t>(out, kHeaderRequestIdOffset, header.request_id);
  Write<uint64_t>(out, kHeaderClientIdOffset, header.client_id);
  Write<int32_t>(out, kHeaderRankOffset, header.rank);
  Write<uint32_t>(out, kHeaderNumItemsOffset, num_items);
  Write<int64_t>(out, kHeaderClockOffset, header.clock);
  Write<uint32_t>(out, kHeaderNumFramesOffset, num_frames);
  Write<uint32_t>(out, kHeaderIncarnationOffset, incarnation_);
}

bool FastServeLoop::SendReply(std::vector<ZmqMsg>* frames) {
  // frames[0] is the routing id. A peer that is gone (ROUTER_MANDATORY: EHOSTUNREACH on
  // the first frame) gets nothing, as Python's send drops it.
  const size_t n = frames->size();
  size_t i = 0;
  for (; i < n; ++i) {
    if (zmq_.msg_send(&(*frames)[i], router_, (i + 1 < n ? kZmqSndMore : 0) | kZmqDontWait) < 0) {
      break;
    }
  }
  for (ZmqMsg& msg : *frames) zmq_.msg_close(&msg);  // sent ones are empty now
  frames->clear();
  return i == n;
}

bool FastServeLoop::ServePull(const Header& header, Client* client) {
  const auto started = std::chrono::steady_clock::now();
  if (!ParseItems(header, 1, &items_)) return false;
  if (header.flags & kFlagShared) return ServeSharedPull(header, client, started);
  const size_t num_items = items_.size();
  int64_t rows = 0;
  int64_t reply_bytes = 0;
  for (size_t i = 0; i < num_items; ++i) {
    const Item& item = items_[i];
    if (zmq_.msg_size(&frames_[3 + i]) != static_cast<size_t>(item.count) * 8) return false;
    const TableEntry& entry = tables_.at(item.table_id);
    rows += item.count;
    reply_bytes += item.count * entry.dim * ElementBytes(item.flags);
  }
  if (rows > max_rows_ || reply_bytes > max_reply_bytes_) return false;
  // The reply budget (kvsparse/server/limits.py): a connection whose large replies Python
  // tracks is Python's until they are read; else the loop's own unread bytes are checked
  // as Python checks them (Python adds them to its count when it decides).
  if (!budget_held_.empty() && budget_held_.count(client->routing)) return false;
  if (static_cast<int64_t>(num_items * kItemSize) >= track_bytes_) return false;
  std::shared_ptr<UnreadBytes>& unread = unread_[client->routing];
  if (!unread) unread = std::make_shared<UnreadBytes>();
  const int64_t held = unread->bytes.load();
  if (held && held + reply_bytes > max_unread_) return false;

  std::vector<ZmqMsg> reply(3 + num_items);
  unsigned char* reply_items = StartPullReply(&reply);
  bool ok = true;
  for (size_t i = 0; i < num_items && ok; ++i) {
    const Item& item = items_[i];
    const TableEntry& entry = tables_.at(item.table_id);
    Write<int32_t>(reply_items + i * kItemSize, kItemDimOffset, static_cast<int32_t>(entry.dim));
    const int64_t n = item.count * entry.dim;
    const size_t bytes = static_cast<size_t>(n * ElementBytes(item.flags));
    if (static_cast<int64_t>(bytes) >= track_bytes_) {
      // Counted as unread until ZeroMQ lets go of it, as Python's budget tracks its frames.
      void* buffer = std::malloc(bytes);
      auto* hint = buffer ? new (std::nothrow) TrackedFrame{unread, static_cast<int64_t>(bytes)}
                          : nullptr;
      if (hint == nullptr) {
        std::free(buffer);
        zmq_.msg_init(&reply[3 + i]);
        ok = false;
        break;
      }
      unread->bytes += hint->bytes;
      if (zmq_.msg_init_data(&reply[3 + i], buffer, bytes, &FreeTrackedFrame, hint) != 0) {
        FreeTrackedFrame(buffer, hint);
        zmq_.msg_init(&reply[3 + i]);
        ok = false;
        break;
      }
    } else if (zmq_.msg_init_size(&reply[3 + i], bytes) != 0) {
      zmq_.msg_init(&reply[3 + i]);
      ok = false;
      break;
    }
    if (n == 0) continue;
    const int64_t* keys = AlignedKeys(&frames_[3 + i], item.count, &key_scratch_);
    void* out = zmq_.msg_data(&reply[3 + i]);
    const bool f32 = (item.flags >> kItemDtypeShift) == 0;
    if (f32 && bytes >= kDirectRowBytes && reinterpret_cast<uintptr_t>(out) % alignof(float) == 0) {
      ok = entry.table->Lookup(keys, item.count, static_cast<float*>(out)).ok();
      continue;
    }
    row_scratch_.resize(static_cast<size_t>(n));
    ok = entry.table->Lookup(keys, item.count, row_scratch_.data()).ok();
    if (!ok) break;
    if (f32) {
      std::memcpy(out, row_scratch_.data(), bytes);
    } else if (reinterpret_cast<uintptr_t>(out) % alignof(uint16_t) == 0) {
      NarrowFloats(KindOf(item.flags), row_scratch_.data(), n, static_cast<uint16_t*>(out));
    } else {
      std::vector<uint16_t> halves(static_cast<size_t>(n));
      NarrowFloats(KindOf(item.flags), row_scratch_.data(), n, halves.data());
      std::memcpy(out, halves.data(), bytes);
    }
  }
  if (!ok) {  // a lookup that failed changed nothing: Python answers with the error
    for (ZmqMsg& msg : reply) zmq_.msg_close(&msg);
    return false;
  }
  SendPullReply(header, client, &reply, started);
  return true;
}

unsigned char* FastServeLoop::StartPullReply(std::vector<ZmqMsg>* reply) {
  // Every frame empty, then the routing id and a copy of the request's items (their
  // dims are the caller's to write).
  const size_t num_items = items_.size();
  for (ZmqMsg& msg : *reply) zmq_.msg_init(&msg);
  const size_t routing_size = zmq_.msg_size(&frames_[0]);
  zmq_.msg_init_size(&(*reply)[0], routing_size);
  std::memcpy(zmq_.msg_data(&(*reply)[0]), zmq_.msg_data(&frames_[0]), routing_size);
  zmq_.msg_init_size(&(*reply)[2], num_items * kItemSize);
  auto* reply_items = static_cast<unsigned char*>(zmq_.msg_data(&(*reply)[2]));
  if (num_items) std::memcpy(reply_items, zmq_.msg_data(&frames_[2]), num_items * kItemSize);
  return reply_items;
}

void FastServeLoop::SendPullReply(const Header& header, Client* client,
                                  std::vector<ZmqMsg>* reply,
                                  std::chrono::steady_clock::time_point started) {
  // (*reply)[2] holds the items, the rows frames follow; the header goes in [1].
  const size_t num_items = items_.size();
  zmq_.msg_init_size(&(*reply)[1], kHeaderSize);
  auto* head = static_cast<unsigned char*>(zmq_.msg_data(&(*reply)[1]));
  PackReply(header, static_cast<uint32_t>(1 + num_items), static_cast<uint32_t>(num_items),
            head);
  unsigned char kept[kHeaderSize];
  std::memcpy(kept, head, kHeaderSize);
  for (const Item& item : items_) {
    CountTable(kFastPull, item.table_id, item.count);
    pending_.keys += item.count;
  }
  SendReply(reply);
  Record(header, client, kept,
         std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
}

bool FastServeLoop::ServeSharedPull(const Header& header, Client* client,
                                    std::chrono::steady_clock::time_point started) {
  // The rows go straight into the client's segment (handlers.Handlers._pull_sparse's
  // shared branch): no reply bytes to budget, empty rows frames.
  const size_t num_items = items_.size();
  int64_t rows = 0;
  for (size_t i = 0; i < num_items; ++i) {
    if (zmq_.msg_size(&frames_[3 + i]) != static_cast<size_t>(items_[i].count) * 8) return false;
    rows += items_[i].count;
  }
  if (rows > max_rows_ || !SharedOffsets(header, *client)) return false;
  for (size_t i = 0; i < num_items; ++i) {
    const Item& item = items_[i];
    const TableEntry& entry = tables_.at(item.table_id);
    const int64_t n = item.count * entry.dim;
    if (n == 0) continue;
    const int64_t* keys = AlignedKeys(&frames_[3 + i], item.count, &key_scratch_);
    unsigned char* out = client->shared + offsets_[i];
    if ((item.flags >> kItemDtypeShift) == 0) {  // offset checked: float-aligned
      if (!entry.table->Lookup(keys, item.count, reinterpret_cast<float*>(out)).ok()) {
        return false;  // a lookup that failed changed nothing: Python answers the error
      }
      continue;
    }
    row_scratch_.resize(static_cast<size_t>(n));
    if (!entry.table->Lookup(keys, item.count, row_scratch_.data()).ok()) return false;
    NarrowFloats(KindOf(item.flags), row_scratch_.data(), n, reinterpret_cast<uint16_t*>(out));
  }
  std::vector<ZmqMsg> reply(3 + num_items);
  unsigned char* reply_items = StartPullReply(&reply);  // the rows frames stay empty
  for (size_t i = 0; i < num_items; ++i) {
    Write<int32_t>(reply_items + i * kItemSize, kItemDimOffset,
                   static_cast<int32_t>(tables_.at(items_[i].table_id).dim));
  }
  SendPullReply(header, client, &reply, started);
  return true;
}

bool FastServeLoop::ServePush(const Header& header, Client* client) {
  const auto started = std::chrono::steady_clock::now();
  if (!ParseItems(header, 2, &items_)) return false;
  const size_t num_items = items_.size();
  struct Part {
    const int64_t* keys;
    const float* rows;
    int64_t count;
  };
  struct Group {
    uint64_t table_id;
    const TableEntry* entry;
    std::vector<Part> parts;
    bool step = false;
    int64_t count = 0;
    const int64_t* keys = nullptr;
    const float* rows = nullptr;
    std::vector<int64_t> key_buffer;
    std::vector<float> row_buffer;
  };
  // Scratch per item (rows widened or realigned): kept alive until the push is applied.
  std::vector<std::vector<int64_t>> key_copies(num_items);
  std::vector<std::vector<float>> row_copies(num_items);
  std::vector<Group> groups;
  int64_t rows_total = 0;
  const bool shared = header.flags & kFlagShared;
  for (size_t i = 0; i < num_items; ++i) {
    const Item& item = items_[i];
    const TableEntry& entry = tables_.at(item.table_id);
    // ops.PushSparse.decode_request, then ShardState.check_sparse_push: else Python's error.
    if (item.dim < 1 || item.dim != entry.dim) return false;
  }
  if (shared && !SharedOffsets(header, *client)) return false;
  for (size_t i = 0; i < num_items; ++i) {
    const Item& item = items_[i];
    const TableEntry& entry = tables_.at(item.table_id);
    const ZmqMsg* keys_frame = &frames_[3 + 2 * i];
    const ZmqMsg* rows_frame = &frames_[4 + 2 * i];
    const size_t row_bytes = static_cast<size_t>(item.count * item.dim * ElementBytes(item.flags));
    if (zmq_.msg_size(keys_frame) != static_cast<size_t>(item.count) * 8 ||
        zmq_.msg_size(rows_frame) != (shared ? 0 : row_bytes)) {
      return false;
    }
    rows_total += item.count;
    const float* rows = nullptr;
    if (!shared) {
      rows = AlignedRows(rows_frame, item.count, item.dim, item.flags, &row_copies[i]);
    } else if (item.count > 0) {
      const unsigned char* at = client->shared + offsets_[i];
      if ((item.flags >> kItemDtypeShift) == 0) {
        rows = reinterpret_cast<const float*>(at);  // offset checked: float-aligned
      } else {
        const int64_t n = item.count * item.dim;
        row_copies[i].resize(static_cast<size_t>(n));
        WidenHalves(KindOf(item.flags), reinterpret_cast<const uint16_t*>(at), n,
                    row_copies[i].data());
        rows = row_copies[i].data();
      }
    }
    Part part{AlignedKeys(keys_frame, item.count, &key_copies[i]), rows, item.count};
    // NaN or inf: the table's push checks and refuses, changing nothing (kNonFinite),
    // and Python answers with the error (one pass over the rows, not two).
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const Group& g) { return g.table_id == item.table_id; });
    if (group == groups.end()) {
      groups.emplace_back();
      group = groups.end() - 1;
      group->table_id = item.table_id;
      group->entry = &entry;
    }
    group->parts.push_back(part);
    group->step = group->step || (item.flags & kItemFlagStep);
    group->count += item.count;
  }
  if (rows_total > max_rows_) return false;
  // One table's keys and rows contiguous (ShardState concatenates a table's items).
  int updates = 0;
  for (Group& group : groups) {
    if (group.count == 0) continue;
    ++updates;
    if (group.parts.size() == 1) {
      group.keys = group.parts[0].keys;
      group.rows = group.parts[0].rows;
      continue;
    }
    const int64_t dim = group.entry->dim;
    group.key_buffer.reserve(static_cast<size_t>(group.count));
    group.row_buffer.reserve(static_cast<size_t>(group.count * dim));
    for (const Part& part : group.parts) {
      if (part.count == 0) continue;
      group.key_buffer.insert(group.key_buffer.end(), part.keys, part.keys + part.count);
      group.row_buffer.insert(group.row_buffer.end(), part.rows, part.rows + part.count * dim);
    }
    group.keys = group.key_buffer.data();
    group.rows = group.row_buffer.data();
  }
  auto policy = [](const Group& group) {
    return group.entry->skip_nonfinite ? NonFinitePolicy::kSkip : NonFinitePolicy::kReject;
  };
  bool memory_error = false;
  std::string memory_message;
  if (updates <= 1) {
    // ShardState.push_sparse: one call, which fails changing nothing.
    for (Group& group : groups) {
      if (group.count == 0) continue;
      int64_t applied = 0;
      Status status = group.entry->table->ApplyGradients(group.keys, group.count, group.rows,
                                                         policy(group), &applied);
      if (!status.ok()) return false;
    }
  } else {
    // ShardState.push_sparse_tables: every table begun, then all finished, or none changed.
    std::vector<Group*> begun;
    for (Group& group : groups) {
      if (group.count == 0) continue;
      Status status =
          group.entry->table->BeginPush(group.keys, group.count, group.rows, policy(group));
      if (!status.ok()) {
        for (auto it = begun.rbegin(); it != begun.rend(); ++it) (*it)->entry->table->CancelPush();
        return false;
      }
      begun.push_back(&group);
    }
    for (size_t i = 0; i < begun.size(); ++i) {
      int64_t applied = 0;
      pending_.keys += begun[i]->count;
      Status status = begun[i]->entry->table->FinishPush(&applied);
      if (!status.ok()) {  // out of memory midway: what Python's path does, and its reply
        for (size_t j = i; j < begun.size(); ++j) begun[j]->entry->table->CancelPush();
        memory_error = true;
        memory_message = status.message();
        break;
      }
    }
  }
  for (const Item& item : items_) CountTable(kFastPush, item.table_id, item.count);
  if (!memory_error) {
    if (updates <= 1) {
      for (const Group& group : groups) pending_.keys += group.count;
    }
    if (updates > 0) pending_.newest_push = WallSeconds();
    for (const Group& group : groups) {
      if (group.count == 0 && group.step) group.entry->table->AdvanceStep();
    }
  }
  std::vector<ZmqMsg> reply(memory_error ? 3 : 2);
  const size_t routing_size = zmq_.msg_size(&frames_[0]);
  zmq_.msg_init_size(&reply[0], routing_size);
  std::memcpy(zmq_.msg_data(&reply[0]), zmq_.msg_data(&frames_[0]), routing_size);
  zmq_.msg_init_size(&reply[1], kHeaderSize);
  auto* head = static_cast<unsigned char*>(zmq_.msg_data(&reply[1]));
  PackReply(header, memory_error ? 1 : 0, 0, head);
  if (memory_error) {
    // protocol.error_reply of a MemoryError: CapacityError (a MemoryError in the worker, as
    // docs/api.md promises), "MemoryError: <message>".
    Write<uint32_t>(head, kHeaderStatusOffset, kErrorCapacityError);
    const std::string text = "MemoryError: " + memory_message;
    zmq_.msg_init_size(&reply[2], text.size());
    std::memcpy(zmq_.msg_data(&reply[2]), text.data(), text.size());
    ++pending_.errors;
  }
  unsigned char kept[kHeaderSize];
  std::memcpy(kept, head, kHeaderSize);
  SendReply(&reply);
  Record(header, client, kept,
         std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  // A push's reply is kept for a resend (Python's ResendCache), its error message too.
  client->record.error = memory_error ? "MemoryError: " + memory_message : std::string();
  return true;
}

void FastServeLoop::FreeTrackedFrame(void* data, void* hint) {
  auto* tracked = static_cast<TrackedFrame*>(hint);
  tracked->unread->bytes -= tracked->bytes;
  delete tracked;
  std::free(data);
}

int64_t FastServeLoop::Unread(const std::string& routing) const {
  auto found = unread_.find(routing);
  return found == unread_.end() ? 0 : found->second->bytes.load();
}

void FastServeLoop::CountTable(int op, uint64_t table_id, int64_t keys) {
  FastTableCount& count = table_counts_[op][table_id];
  count.op = op;
  count.table_id = table_id;
  count.requests += 1;
  count.keys += keys;
}

void FastServeLoop::Record(const Header& header, Client* client, const unsigned char* reply,
                           double seconds) {
  const int op = header.op == kOpPullSparse ? kFastPull : kFastPush;
  client->last_seen = header.request_id;
  FastClientRecord& record = client->record;
  record.client_id = header.client_id;
  record.request_id = header.request_id;
  record.is_push = op == kFastPush;
  if (record.is_push) {
    record.last_push = static_cast<int64_t>(header.request_id);
    record.pushes += 1;
  }
  std::memcpy(record.reply, reply, kHeaderSize);
  record.error.clear();
  if (!client->dirty) {
    client->dirty = true;
    dirty_clients_.push_back(header.client_id);
  }
  const auto rank = static_cast<size_t>(header.rank);
  if (rank < clocks_.size() && header.clock > clocks_[rank]) {
    clocks_[rank] = header.clock;
    clock_changed_[rank] = 1;
  }
  pending_.requests[op] += 1;
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(buckets_.begin(), buckets_.end(), seconds) - buckets_.begin());
  pending_.latency[op][bucket] += 1;
  pending_.latency_sum[op] += seconds;
  dirty_ = true;
}

bool FastServeLoop::Drain(FastDrain* out) {
  if (!dirty_) return false;
  dirty_ = false;
  out->clients.clear();
  for (uint64_t client_id : dirty_clients_) {
    auto found = clients_.find(client_id);
    if (found == clients_.end() || !found->second.dirty) continue;
    out->clients.push_back(found->second.record);
    found->second.dirty = false;
    found->second.record.pushes = 0;
    found->second.record.last_push = -1;
  }
  dirty_clients_.clear();
  out->clocks.clear();
  for (size_t rank = 0; rank < clocks_.size(); ++rank) {
    if (clock_changed_[rank]) {
      out->clocks.emplace_back(static_cast<int64_t>(rank), clocks_[rank]);
      clock_changed_[rank] = 0;
    }
    // The highest clock since the last drain: Python's gate may have restarted its clocks
    // (a new job's HELLO) meanwhile, and only moves them forward.
    clocks_[rank] = 0;
  }
  out->tables.clear();
  for (auto& counts : table_counts_) {
    for (auto& entry : counts) out->tables.push_back(entry.second);
    counts.clear();
  }
  for (int op = 0; op < kFastOps; ++op) {
    out->requests[op] = pending_.requests[op];
    out->latency[op] = pending_.latency[op];
    out->latency_sum[op] = pending_.latency_sum[op];
    pending_.requests[op] = 0;
    std::fill(pending_.latency[op].begin(), pending_.latency[op].end(), 0);
    pending_.latency_sum[op] = 0.0;
  }
  out->keys = pending_.keys;
  out->newest_push = pending_.newest_push;
  out->errors = pending_.errors;
  pending_.keys = 0;
  pending_.newest_push = 0.0;
  pending_.errors = 0;
  return true;
}

void FastServeLoop::SetJob(bool configured, int64_t num_workers, bool pulls, bool pushes) {
  configured_ = configured;
  pulls_ = pulls;
  pushes_ = pushes;
  if (num_workers != num_workers_) {
    num_workers_ = num_workers;
    // Clocks not drained yet are kept for the ranks that remain.
    clocks_.resize(static_cast<size_t>(std::max<int64_t>(num_workers, 0)), 0);
    clock_changed_.resize(clocks_.size(), 0);
  }
}

void FastServeLoop::SetLimits(int64_t max_rows, int64_t max_reply_bytes, int64_t max_unread,
                              int64_t track_bytes) {
  max_rows_ = max_rows;
  max_reply_bytes_ = max_reply_bytes;
  max_unread_ = max_unread;
  track_bytes_ = track_bytes;
}

void FastServeLoop::ClearTables() { tables_.clear(); }

void FastServeLoop::AddTable(uint64_t table_id, EmbeddingTable* table, bool skip_nonfinite) {
  tables_[table_id] = TableEntry{table, table->dim(), skip_nonfinite};
}

bool FastServeLoop::SetClient(uint64_t client_id, const std::string& routing,
                              uint64_t last_request_id, uintptr_t shared_address,
                              int64_t shared_bytes) {
  auto found = clients_.find(client_id);
  if (found == clients_.end()) {
    constexpr size_t kMaxClients = 1 << 16;
    if (clients_.size() >= kMaxClients) return false;
    found = clients_.emplace(client_id, Client()).first;
  }
  Client& client = found->second;
  client.routing = routing;
  client.last_seen = std::max(client.last_seen, last_request_id);
  client.shared = reinterpret_cast<unsigned char*>(shared_address);
  client.shared_bytes = shared_address ? shared_bytes : 0;
  // Messages of it forwarded before now (not tracked while it was unknown) go first.
  client.forward_seq = forward_total_;
  return true;
}

void FastServeLoop::RemoveClient(uint64_t client_id) {
  auto found = clients_.find(client_id);
  if (found == clients_.end()) return;
  auto unread = unread_.find(found->second.routing);
  if (unread != unread_.end() && unread->second->bytes.load() == 0 &&
      unread->second.use_count() == 1) {
    unread_.erase(unread);  // else its frames' free functions still need it
  }
  clients_.erase(found);  // Python drains before it unregisters anyone
}

void FastServeLoop::SetBudgetHeld(const std::string& routing, bool held) {
  if (held) {
    budget_held_.insert(routing);
  } else {
    budget_held_.erase(routing);
  }
}

}  // namespace kvsparse
