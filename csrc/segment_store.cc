#include "segment_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#include "crc32c.h"
#include "file_io.h"
#include "hash.h"
#include "read_pool.h"

namespace kvsparse {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'S', 'S', 'E', 'G', '1', '\0'};
constexpr uint32_t kFormatVersion = 1;
constexpr int64_t kFileHeaderBytes = 64;
constexpr int64_t kSlotHeaderBytes = 24;
constexpr uint32_t kTombstone = 1;
constexpr int kSlotBits = 40;  // location = segment id << 40 | slot
constexpr uint64_t kSlotMask = (uint64_t{1} << kSlotBits) - 1;
constexpr uint64_t kMaxSegmentId = (uint64_t{1} << 23) - 1;
constexpr uint64_t kNoLocation = ~uint64_t{0};
// Recovery and garbage collection read segments in chunks of this size.
constexpr int64_t kScanChunkBytes = 4 << 20;
constexpr const char* kManifestName = "MANIFEST";

uint64_t Location(uint64_t segment, uint64_t slot) { return (segment << kSlotBits) | slot; }
uint32_t SegmentOf(uint64_t location) { return static_cast<uint32_t>(location >> kSlotBits); }
uint64_t SlotOf(uint64_t location) { return location & kSlotMask; }

std::string SegmentName(uint32_t id) {
  char name[32];
  std::snprintf(name, sizeof(name), "segment-%08u.kvs", id);
  return name;
}

bool ParseSegmentName(const std::string& name, uint32_t* id) {
  unsigned value = 0;
  char tail[8] = {0};
  if (name.size() != 20 || std::sscanf(name.c_str(), "segment-%8u.%3s", &value, tail) != 2 ||
      std::string(tail) != "kvs" || value == 0) {
    return false;
  }
  *id = value;
  return true;
}

// The in-RAM index: open addressing with linear probing over 16-byte
// entries, at most 80% full, erase by backward shift (no tombstones, so
// probe lengths stay short under churn).
class LocationIndex {
 public:
  LocationIndex() { Reset(16); }

  uint64_t Find(int64_t key) const {
    for (uint64_t i = Home(key);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.location == kNoLocation) return kNoLocation;
      if (e.key == key) return e.location;
    }
  }

  // Sets key's location; returns the previous one (kNoLocation if none).
  uint64_t Assign(int64_t key, uint64_t location) {
    if ((size_ + 1) * 5 > entries_.size() * 4) Grow();
    for (uint64_t i = Home(key);; i = (i + 1) & mask_) {
      Entry& e = entries_[i];
      if (e.location == kNoLocation) {
        e.key = key;
        e.location = location;
        ++size_;
        return kNoLocation;
      }
      if (e.key == key) {
        const uint64_t previous = e.location;
        e.location = location;
        return previous;
      }
    }
  }

  // Removes key; returns its location (kNoLocation if it was absent).
  uint64_t Erase(int64_t key) {
    uint64_t i = Home(key);
    for (;; i = (i + 1) & mask_) {
      if (entries_[i].location == kNoLocation) return kNoLocation;
      if (entries_[i].key == key) break;
    }
    const uint64_t previous = entries_[i].location;
    // Backward-shift: move each later entry of the run into the hole when
    // its home slot does not lie cyclically in (hole, entry].
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & mask_; entries_[j].location != kNoLocation; j = (j + 1) & mask_) {
      const uint64_t home = Home(entries_[j].key);
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        entries_[hole] = entries_[j];
        hole = j;
      }
    }
    entries_[hole].location = kNoLocation;
    --size_;
    return previous;
  }

  // Grows ahead of inserting `more` keys, so that Assign cannot fail
  // halfway through a batch (std::bad_alloc is caught by the caller here).
  void Reserve(int64_t more) {
    while ((size_ + static_cast<uint64_t>(more)) * 5 > entries_.size() * 4) Grow();
  }

  int64_t size() const { return static_cast<int64_t>(size_); }
  int64_t bytes() const { return static_cast<int64_t>(entries_.size() * sizeof(Entry)); }

 private:
  struct Entry {
    int64_t key;
    uint64_t location;
  };

  uint64_t Home(int64_t key) const { return Mix64(static_cast<uint64_t>(key)) & mask_; }

  void Reset(uint64_t capacity) {
    entries_.assign(capacity, Entry{0, kNoLocation});
    mask_ = capacity - 1;
    size_ = 0;
  }

  void Grow() {
    std::vector<Entry> old;
    old.swap(entries_);
    Reset(old.size() * 2);
    for (const Entry& e : old) {
      if (e.location == kNoLocation) continue;
      uint64_t i = Home(e.key);
      while (entries_[i].location != kNoLocation) i = (i + 1) & mask_;
      entries_[i] = e;
      ++size_;
    }
  }

  std::vector<Entry> entries_;
  uint64_t mask_ = 0;
  uint64_t size_ = 0;
};

struct Segment {
  int fd = -1;
  std::string path;
  int64_t slots = 0;  // slots written (live, stale and tombstones)
  int64_t live = 0;   // slots the index points at
  int64_t tombstones = 0;
  // Sequence numbers say which record of a key is newest. A tombstone must
  // be kept while a segment that may hold an older record of its key exists.
  uint64_t min_data_sequence = ~uint64_t{0};
  uint64_t max_tombstone_sequence = 0;
  bool sealed = false;
};

class SegmentStore final : public RowStore {
 public:
  explicit SegmentStore(const SegmentStoreOptions& options)
      : options_(options),
        slot_bytes_(kSlotHeaderBytes + options.record_bytes),
        slots_per_segment_(
            std::max<int64_t>(1, (options.segment_bytes - kFileHeaderBytes) / slot_bytes_)),
        pool_(std::max<int64_t>(1, std::min<int64_t>(options.read_threads, 256))) {}

  ~SegmentStore() override { Close(); }

  Status Recover();

  Status WriteBatch(const int64_t* keys, int64_t n, const uint8_t* records) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Status s = CheckOpen(); !s.ok()) return s;
    std::vector<Pending> pending(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      pending[i] = Pending{keys[i], next_sequence_ + static_cast<uint64_t>(i), 0,
                           records + i * options_.record_bytes, kNoLocation};
    }
    Status s = Append(&pending);
    if (s.ok()) {
      next_sequence_ += static_cast<uint64_t>(n);
      stats_.bytes_updated += n * options_.record_bytes;
    }
    return s;
  }

  Status ReadBatch(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) override;

  Status Erase(const int64_t* keys, int64_t n) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Status s = CheckOpen(); !s.ok()) return s;
    std::vector<Pending> pending;
    for (int64_t i = 0; i < n; ++i) {
      if (index_.Find(keys[i]) == kNoLocation) continue;
      pending.push_back(Pending{keys[i], next_sequence_ + pending.size(), kTombstone, nullptr,
                                kNoLocation});
    }
    Status s = Append(&pending);
    if (s.ok()) next_sequence_ += pending.size();
    return s;
  }

  Status Discard(const int64_t* keys, int64_t n) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Status s = CheckOpen(); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t previous = index_.Erase(keys[i]);
      if (previous != kNoLocation) --segments_[SegmentOf(previous)].live;
    }
    return Status::Ok();
  }

  Status Scan(uint64_t* cursor, int64_t max_records, int64_t* keys, uint8_t* records,
              int64_t* count) override;

  Status Contains(const int64_t* keys, int64_t n, uint8_t* found) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Status s = CheckOpen(); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) found[i] = index_.Find(keys[i]) != kNoLocation;
    return Status::Ok();
  }

  // Writes go straight to the files (one pwrite per batch and segment), so
  // there is nothing buffered in the process to hand over.
  Status Flush() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return CheckOpen();
  }

  Status Sync() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Status s = CheckOpen(); !s.ok()) return s;
    return SyncActive();
  }

  Status Maintenance(int64_t max_bytes, int64_t* bytes_moved) override;
  Status Checkpoint(const std::string& directory) override;

  RowStoreStats Stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    RowStoreStats stats = stats_;
    stats.record_bytes = options_.record_bytes;
    stats.live_records = index_.size();
    stats.index_bytes = index_.bytes();
    stats.segments = static_cast<int64_t>(segments_.size());
    stats.disk_bytes = 0;
    for (const auto& entry : segments_) {
      stats.disk_bytes += kFileHeaderBytes + entry.second.slots * slot_bytes_;
    }
    return stats;
  }

  Status Close() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return Status::Ok();
    Status s = SyncActive();
    for (auto& entry : segments_) {
      if (entry.second.fd >= 0) ::close(entry.second.fd);
      entry.second.fd = -1;
    }
    closed_ = true;
    return s;
  }

 private:
  // One record on its way to disk. location is where it is now (garbage
  // collection copies) or kNoLocation (a new write).
  struct Pending {
    int64_t key;
    uint64_t sequence;
    uint32_t flags;
    const uint8_t* payload;  // record_bytes bytes; nullptr for a tombstone
    uint64_t location;
  };

  Status CheckOpen() const {
    if (closed_) return Status(StatusCode::kInvalidArgument, "the segment store is closed");
    return Status::Ok();
  }

  void EncodeSlot(const Pending& p, uint8_t* slot) const {
    std::memcpy(slot, &p.key, 8);
    std::memcpy(slot + 8, &p.sequence, 8);
    std::memcpy(slot + 16, &p.flags, 4);
    if (p.payload != nullptr) {
      std::memcpy(slot + kSlotHeaderBytes, p.payload, options_.record_bytes);
    } else {
      std::memset(slot + kSlotHeaderBytes, 0, options_.record_bytes);
    }
    uint32_t crc = Crc32c(slot, 20);
    crc = Crc32cExtend(crc, slot + kSlotHeaderBytes, options_.record_bytes);
    std::memcpy(slot + 20, &crc, 4);
  }

  bool SlotChecksumOk(const uint8_t* slot) const {
    uint32_t stored;
    std::memcpy(&stored, slot + 20, 4);
    uint32_t crc = Crc32c(slot, 20);
    crc = Crc32cExtend(crc, slot + kSlotHeaderBytes, options_.record_bytes);
    return crc == stored;
  }

  Status Corruption(const Segment& segment, int64_t slot, int64_t key,
                    const std::string& why) const {
    return Status(StatusCode::kCorruption,
                  "corrupt record in " + segment.path + " at offset " +
                      std::to_string(kFileHeaderBytes + slot * slot_bytes_) + " (key " +
                      std::to_string(key) + "): " + why + "; the record is not served");
  }

  Status OpenSegmentFile(uint32_t id, bool create, Segment* segment);

  // The oldest data record's sequence in any segment but id: a tombstone
  // older than that shadows nothing any more.
  uint64_t OldestDataElsewhere(uint32_t id) const {
    uint64_t oldest = ~uint64_t{0};
    for (const auto& entry : segments_) {
      if (entry.first != id) oldest = std::min(oldest, entry.second.min_data_sequence);
    }
    return oldest;
  }
  Status Append(std::vector<Pending>* pending);
  Status SyncActive();
  Status SealActive();
  Status RecoverSegment(uint32_t id, Segment* segment, bool newest,
                        std::unordered_map<int64_t, uint64_t>* sequences, bool* torn_file);

  const SegmentStoreOptions options_;
  const int64_t slot_bytes_;
  const int64_t slots_per_segment_;
  mutable std::mutex mutex_;
  LocationIndex index_;
  std::map<uint32_t, Segment> segments_;
  uint32_t active_ = 0;  // 0: none yet, the next write creates one
  uint32_t next_segment_id_ = 1;
  uint64_t next_sequence_ = 1;
  uint32_t gc_segment_ = 0;  // segment being collected (0: none)
  int64_t gc_next_slot_ = 0;
  bool closed_ = false;
  RowStoreStats stats_;
  ReadPool pool_;
};

Status SegmentStore::OpenSegmentFile(uint32_t id, bool create, Segment* segment) {
  segment->path = options_.directory + "/" + SegmentName(id);
  const int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
  segment->fd = ::open(segment->path.c_str(), flags, 0644);
  if (segment->fd < 0) return IoError("opening", segment->path, errno);
  // Point reads: the kernel's readahead (128 KiB a read) would spend the
  // disk's bandwidth on neighbours nobody asked for. Scans read 4 MiB chunks.
  ::posix_fadvise(segment->fd, 0, 0, POSIX_FADV_RANDOM);
  if (!create) return Status::Ok();
  uint8_t header[kFileHeaderBytes] = {0};
  std::memcpy(header, kMagic, 8);
  const uint64_t record_bytes = static_cast<uint64_t>(options_.record_bytes);
  const uint64_t id64 = id;
  std::memcpy(header + 8, &kFormatVersion, 4);
  std::memcpy(header + 16, &record_bytes, 8);
  std::memcpy(header + 24, &id64, 8);
  const uint32_t crc = Crc32c(header, 60);
  std::memcpy(header + 60, &crc, 4);
  const int error = WriteAll(segment->fd, header, kFileHeaderBytes, 0);
  if (error != 0) {
    ::close(segment->fd);
    ::unlink(segment->path.c_str());
    segment->fd = -1;
    return IoError("creating segment", segment->path, error);
  }
  return Status::Ok();
}

Status SegmentStore::SyncActive() {
  if (active_ == 0 || !options_.durable) return Status::Ok();
  const Segment& segment = segments_[active_];
  if (::fdatasync(segment.fd) != 0) return IoError("syncing", segment.path, errno);
  return Status::Ok();
}

// A sealed segment is never written again; an empty one is removed.
Status SegmentStore::SealActive() {
  if (active_ == 0) return Status::Ok();
  if (Status s = SyncActive(); !s.ok()) return s;
  Segment& segment = segments_[active_];
  segment.sealed = true;
  if (segment.slots == 0) {
    ::close(segment.fd);
    ::unlink(segment.path.c_str());
    segments_.erase(active_);
  }
  active_ = 0;
  return Status::Ok();
}

// Writes pending to the end of the log, then points the index at it. Any
// failure before the index is touched undoes the file changes (truncates
// the active segment back, removes segments this call created), so the
// store serves exactly what it served before.
Status SegmentStore::Append(std::vector<Pending>* pending) {
  const int64_t n = static_cast<int64_t>(pending->size());
  if (n == 0) return Status::Ok();
  try {
    index_.Reserve(n);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory growing the segment store index");
  }
  const uint32_t first_active = active_;
  const int64_t first_slots = active_ != 0 ? segments_[active_].slots : 0;
  std::vector<uint32_t> created;
  std::vector<uint64_t> locations(static_cast<size_t>(n));
  std::map<uint32_t, int64_t> written;  // segment -> slots this call wrote

  auto undo = [&] {
    if (first_active != 0) {
      Segment& segment = segments_[first_active];
      // Best effort: ftruncate needs no free space; a leftover tail would
      // only be stale slots past the end the store counts.
      if (::ftruncate(segment.fd, kFileHeaderBytes + first_slots * slot_bytes_) != 0) {
      }
      segment.sealed = false;
    }
    for (uint32_t id : created) {
      ::close(segments_[id].fd);
      ::unlink(segments_[id].path.c_str());
      segments_.erase(id);
    }
    active_ = first_active;
  };

  int64_t i = 0;
  int64_t active_slots = first_slots;
  // A buffer of this call only (one batch's slots: kept, it would hold the
  // largest batch's bytes for good).
  std::vector<uint8_t> scratch;
  while (i < n) {
    if (active_ == 0 || active_slots == slots_per_segment_) {
      if (active_ != 0) {
        Segment& full = segments_[active_];
        if (options_.durable && ::fdatasync(full.fd) != 0) {
          const int error = errno;
          const std::string path = full.path;  // undo() may erase the segment
          undo();
          return IoError("syncing", path, error);
        }
        full.sealed = true;
      }
      if (next_segment_id_ > kMaxSegmentId) {
        undo();
        return Status(StatusCode::kCapacity, "the segment store ran out of segment ids");
      }
      Segment segment;
      const uint32_t id = next_segment_id_;
      if (Status s = OpenSegmentFile(id, true, &segment); !s.ok()) {
        undo();
        return s;
      }
      ++next_segment_id_;
      segments_[id] = segment;
      created.push_back(id);
      active_ = id;
      active_slots = 0;
    }
    const int64_t m = std::min(n - i, slots_per_segment_ - active_slots);
    try {
      scratch.resize(static_cast<size_t>(m * slot_bytes_));
    } catch (const std::bad_alloc&) {
      undo();
      return Status(StatusCode::kOutOfMemory, "out of memory for the segment write buffer");
    }
    for (int64_t j = 0; j < m; ++j) {
      EncodeSlot((*pending)[i + j], scratch.data() + j * slot_bytes_);
      locations[i + j] = Location(active_, static_cast<uint64_t>(active_slots + j));
    }
    Segment& segment = segments_[active_];
    const int error = WriteAll(segment.fd, scratch.data(), m * slot_bytes_,
                               kFileHeaderBytes + active_slots * slot_bytes_);
    if (error != 0) {
      const std::string path = segment.path;  // undo() may erase the segment
      undo();
      return IoError("writing", path, error);
    }
    written[active_] += m;
    active_slots += m;
    i += m;
  }

  // Everything is on disk: from here on nothing can fail.
  for (const auto& entry : written) segments_[entry.first].slots += entry.second;
  for (int64_t j = 0; j < n; ++j) {
    const Pending& p = (*pending)[j];
    Segment& target = segments_[SegmentOf(locations[j])];
    if (p.flags & kTombstone) {
      ++target.tombstones;
      target.max_tombstone_sequence = std::max(target.max_tombstone_sequence, p.sequence);
      // A tombstone copied forward by garbage collection is older than
      // anything the index points at now: it only guards recovery.
      if (p.location != kNoLocation) continue;
      const uint64_t previous = index_.Erase(p.key);
      if (previous != kNoLocation) --segments_[SegmentOf(previous)].live;
      continue;
    }
    target.min_data_sequence = std::min(target.min_data_sequence, p.sequence);
    if (p.location != kNoLocation && index_.Find(p.key) != p.location) continue;
    const uint64_t previous = index_.Assign(p.key, locations[j]);
    if (previous != kNoLocation) --segments_[SegmentOf(previous)].live;
    ++target.live;
  }
  stats_.bytes_written += n * slot_bytes_;
  return Status::Ok();
}

Status SegmentStore::ReadBatch(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  const int64_t record_bytes = options_.record_bytes;
  struct Request {
    uint64_t location;
    int64_t row;
  };
  std::vector<Request> requests;
  requests.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t location = index_.Find(keys[i]);
    found[i] = location != kNoLocation;
    if (location == kNoLocation) {
      std::memset(out + i * record_bytes, 0, static_cast<size_t>(record_bytes));
    } else {
      requests.push_back(Request{location, i});
    }
  }
  // File order: neighbours in one file are read one after the other.
  std::sort(requests.begin(), requests.end(),
            [](const Request& a, const Request& b) { return a.location < b.location; });

  // A key asked for several times in one batch (hot ids) is read once.
  std::vector<Request> unique;
  unique.reserve(requests.size());
  for (const Request& request : requests) {
    if (unique.empty() || unique.back().location != request.location) unique.push_back(request);
  }

  std::mutex error_mutex;
  Status first_error;
  std::atomic<int64_t> bytes_read{0};
  pool_.Run(static_cast<int64_t>(unique.size()), [&](int64_t r) {
    thread_local std::vector<uint8_t> slot;
    if (slot.size() < static_cast<size_t>(slot_bytes_)) slot.resize(slot_bytes_);
    const Request& request = unique[r];
    const auto held = segments_.find(SegmentOf(request.location));
    const Segment& segment = held->second;  // the index only names held segments
    const int64_t slot_index = static_cast<int64_t>(SlotOf(request.location));
    const int64_t key = keys[request.row];
    int64_t got = 0;
    const int error = ReadAll(segment.fd, slot.data(), slot_bytes_,
                              kFileHeaderBytes + slot_index * slot_bytes_, &got);
    bytes_read.fetch_add(got, std::memory_order_relaxed);
    Status s;
    if (error != 0) {
      s = IoError("reading", segment.path, error);
    } else if (got != slot_bytes_) {
      s = Corruption(segment, slot_index, key, "the file ends inside the record");
    } else if (!SlotChecksumOk(slot.data())) {
      s = Corruption(segment, slot_index, key, "checksum mismatch");
    } else {
      int64_t stored_key;
      std::memcpy(&stored_key, slot.data(), 8);
      if (stored_key != key) {
        s = Corruption(segment, slot_index, key,
                       "the slot holds key " + std::to_string(stored_key));
      } else {
        std::memcpy(out + request.row * record_bytes, slot.data() + kSlotHeaderBytes,
                    static_cast<size_t>(record_bytes));
        return;
      }
    }
    std::lock_guard<std::mutex> error_lock(error_mutex);
    if (first_error.ok()) first_error = s;
  });
  stats_.bytes_read += bytes_read.load();
  if (!first_error.ok()) return first_error;
  for (size_t r = 1; r < requests.size(); ++r) {
    if (requests[r].location == requests[r - 1].location) {
      std::memcpy(out + requests[r].row * record_bytes, out + requests[r - 1].row * record_bytes,
                  static_cast<size_t>(record_bytes));
    }
  }
  stats_.records_read += static_cast<int64_t>(unique.size());
  return Status::Ok();
}

Status SegmentStore::Scan(uint64_t* cursor, int64_t max_records, int64_t* keys,
                          uint8_t* records, int64_t* count) {
  std::lock_guard<std::mutex> lock(mutex_);
  *count = 0;
  if (Status s = CheckOpen(); !s.ok()) return s;
  std::vector<uint8_t> chunk;
  auto it = segments_.lower_bound(SegmentOf(*cursor));
  uint64_t slot = it != segments_.end() && it->first == SegmentOf(*cursor) ? SlotOf(*cursor) : 0;
  for (; it != segments_.end() && *count < max_records; ++it, slot = 0) {
    const Segment& segment = it->second;
    while (static_cast<int64_t>(slot) < segment.slots && *count < max_records) {
      // Whole chunks, but no more slots than could still be returned live.
      const int64_t want = std::min<int64_t>(
          segment.slots - static_cast<int64_t>(slot),
          std::max<int64_t>(1, std::min<int64_t>(kScanChunkBytes / slot_bytes_,
                                                 max_records - *count)));
      try {
        chunk.resize(static_cast<size_t>(want * slot_bytes_));
      } catch (const std::bad_alloc&) {
        return Status(StatusCode::kOutOfMemory, "out of memory scanning the disk tier");
      }
      int64_t got = 0;
      const int error = ReadAll(segment.fd, chunk.data(), want * slot_bytes_,
                                kFileHeaderBytes + static_cast<int64_t>(slot) * slot_bytes_, &got);
      if (error != 0) return IoError("reading", segment.path, error);
      stats_.bytes_read += got;
      if (got != want * slot_bytes_) {
        return Corruption(segment, static_cast<int64_t>(slot) + got / slot_bytes_, -1,
                          "the file ends before its last record");
      }
      for (int64_t j = 0; j < want; ++j) {
        const uint8_t* data = chunk.data() + j * slot_bytes_;
        int64_t key;
        std::memcpy(&key, data, 8);
        // Every slot is checked, stale ones too: a live record whose key bytes
        // were damaged would otherwise look stale and drop out of the scan.
        if (!SlotChecksumOk(data)) {
          return Corruption(segment, static_cast<int64_t>(slot) + j, key, "checksum mismatch");
        }
        if (index_.Find(key) != Location(it->first, slot + static_cast<uint64_t>(j))) continue;
        keys[*count] = key;
        std::memcpy(records + *count * options_.record_bytes, data + kSlotHeaderBytes,
                    static_cast<size_t>(options_.record_bytes));
        ++*count;
      }
      slot += static_cast<uint64_t>(want);
    }
    if (*count >= max_records) {
      *cursor = Location(it->first, slot);
      return Status::Ok();
    }
  }
  *cursor = ~uint64_t{0} - 1;  // past every segment id that can exist
  return Status::Ok();
}

Status SegmentStore::Maintenance(int64_t max_bytes, int64_t* bytes_moved) {
  std::lock_guard<std::mutex> lock(mutex_);
  *bytes_moved = 0;
  if (Status s = CheckOpen(); !s.ok()) return s;
  int64_t budget = max_bytes;
  std::vector<uint8_t> chunk;
  while (budget > 0) {
    if (gc_segment_ == 0) {
      double worst = -1.0;
      for (const auto& entry : segments_) {
        const Segment& segment = entry.second;
        if (!segment.sealed || entry.first == active_ || segment.slots == 0) continue;
        // Tombstones that must be kept count as live: a segment of them
        // would otherwise be rewritten into another one, round after round.
        const int64_t kept = segment.max_tombstone_sequence < OldestDataElsewhere(entry.first)
                                 ? 0
                                 : segment.tombstones;
        const double stale =
            1.0 - static_cast<double>(segment.live + kept) / static_cast<double>(segment.slots);
        if (stale >= options_.gc_stale_fraction && stale > worst) {
          worst = stale;
          gc_segment_ = entry.first;
        }
      }
      if (gc_segment_ == 0) break;
      gc_next_slot_ = 0;
    }
    const uint32_t id = gc_segment_;
    const Segment& segment = segments_[id];
    const int64_t count = std::min<int64_t>(
        segment.slots - gc_next_slot_,
        std::max<int64_t>(1, std::min(budget, kScanChunkBytes) / slot_bytes_));
    if (count > 0) {
      try {
        chunk.resize(static_cast<size_t>(count * slot_bytes_));
      } catch (const std::bad_alloc&) {
        return Status(StatusCode::kOutOfMemory, "out of memory for garbage collection");
      }
      int64_t got = 0;
      const int error = ReadAll(segment.fd, chunk.data(), count * slot_bytes_,
                                kFileHeaderBytes + gc_next_slot_ * slot_bytes_, &got);
      if (error != 0) return IoError("reading", segment.path, error);
      stats_.bytes_read += got;
      if (got != count * slot_bytes_) {
        return Corruption(segment, gc_next_slot_ + got / slot_bytes_, -1,
                          "the file ends before its last record");
      }
      const uint64_t oldest_elsewhere = OldestDataElsewhere(id);
      std::vector<Pending> moving;
      for (int64_t j = 0; j < count; ++j) {
        const uint8_t* slot = chunk.data() + j * slot_bytes_;
        const uint64_t location = Location(id, static_cast<uint64_t>(gc_next_slot_ + j));
        Pending p;
        std::memcpy(&p.key, slot, 8);
        std::memcpy(&p.sequence, slot + 8, 8);
        std::memcpy(&p.flags, slot + 16, 4);
        p.payload = slot + kSlotHeaderBytes;
        p.location = location;
        const bool live = index_.Find(p.key) == location;
        if (!live && !(p.flags & kTombstone)) continue;
        if (!SlotChecksumOk(slot)) {
          if (!live) continue;  // a damaged tombstone was checked at open
          return Corruption(segment, gc_next_slot_ + j, p.key, "checksum mismatch");
        }
        if (!live) {
          if (p.sequence < oldest_elsewhere) continue;
          p.payload = nullptr;
        } else {
          // A fresh sequence number: a segment's min_data_sequence then
          // says how old its data is, so old tombstones can be dropped.
          p.sequence = next_sequence_++;
        }
        moving.push_back(p);
      }
      if (Status s = Append(&moving); !s.ok()) return s;
      const int64_t moved = count * slot_bytes_ + static_cast<int64_t>(moving.size()) * slot_bytes_;
      stats_.gc_records_moved += static_cast<int64_t>(moving.size());
      stats_.gc_bytes_moved += moved;
      *bytes_moved += moved;
      budget -= moved;
      gc_next_slot_ += count;
    }
    Segment& done = segments_[id];
    if (gc_next_slot_ >= done.slots) {
      // The copies must be durable before the only other copy goes.
      if (Status s = SyncActive(); !s.ok()) return s;
      ::close(done.fd);
      ::unlink(done.path.c_str());
      segments_.erase(id);
      ++stats_.gc_segments_freed;
      gc_segment_ = 0;
    }
  }
  return Status::Ok();
}

Status SegmentStore::Checkpoint(const std::string& directory) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  if (Status s = EmptyDirectory(directory); !s.ok()) return s;
  // The active segment would go on growing under its link: seal it, so
  // every linked file is immutable from now on.
  if (Status s = SealActive(); !s.ok()) return s;
  std::string manifest = "kvsparse-segment-store 1\nrecord_bytes " +
                         std::to_string(options_.record_bytes) + "\nlive_records " +
                         std::to_string(index_.size()) + "\nsegments";
  for (const auto& entry : segments_) {
    const std::string name = SegmentName(entry.first);
    const std::string target = directory + "/" + name;
    if (::link(entry.second.path.c_str(), target.c_str()) != 0) {
      return IoError("linking " + entry.second.path + " to", target, errno);
    }
    manifest += " " + name;
  }
  manifest += "\n";
  const std::string path = directory + "/" + kManifestName;
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("creating", temporary, errno);
  int error = WriteAll(fd, reinterpret_cast<const uint8_t*>(manifest.data()),
                       static_cast<int64_t>(manifest.size()), 0);
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  ::close(fd);
  if (error == 0 && ::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error == 0) error = SyncDirectory(directory);
  if (error != 0) return IoError("writing", path, error);
  return Status::Ok();
}

Status SegmentStore::RecoverSegment(uint32_t id, Segment* segment, bool newest,
                                    std::unordered_map<int64_t, uint64_t>* sequences,
                                    bool* torn_file) {
  *torn_file = false;
  if (Status s = OpenSegmentFile(id, false, segment); !s.ok()) return s;
  segment->sealed = true;
  uint8_t header[kFileHeaderBytes];
  int64_t got = 0;
  int error = ReadAll(segment->fd, header, kFileHeaderBytes, 0, &got);
  if (error != 0) return IoError("reading", segment->path, error);
  uint32_t version = 0, crc = 0;
  uint64_t record_bytes = 0;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&record_bytes, header + 16, 8);
  std::memcpy(&crc, header + 60, 4);
  if (got != kFileHeaderBytes && newest) {
    // A crash between creating the newest segment and writing its header.
    *torn_file = true;
    return Status::Ok();
  }
  if (got != kFileHeaderBytes || std::memcmp(header, kMagic, 8) != 0 ||
      crc != Crc32c(header, 60)) {
    return Status(StatusCode::kCorruption,
                  "corrupt segment header in " + segment->path + " at offset 0");
  }
  if (version != kFormatVersion) {
    return Status(StatusCode::kInvalidArgument, segment->path + " has format version " +
                                                    std::to_string(version) + ", expected " +
                                                    std::to_string(kFormatVersion));
  }
  if (record_bytes != static_cast<uint64_t>(options_.record_bytes)) {
    return Status(StatusCode::kInvalidArgument,
                  segment->path + " holds records of " + std::to_string(record_bytes) +
                      " bytes, the store was opened with record_bytes=" +
                      std::to_string(options_.record_bytes));
  }
  struct stat st;
  if (::fstat(segment->fd, &st) != 0) return IoError("reading", segment->path, errno);
  const int64_t slots = (st.st_size - kFileHeaderBytes) / slot_bytes_;
  int64_t first_bad = -1;
  std::vector<uint8_t> chunk;
  for (int64_t begin = 0; begin < slots;) {
    const int64_t count = std::min(slots - begin, std::max<int64_t>(1, kScanChunkBytes / slot_bytes_));
    chunk.resize(static_cast<size_t>(count * slot_bytes_));
    error = ReadAll(segment->fd, chunk.data(), count * slot_bytes_,
                    kFileHeaderBytes + begin * slot_bytes_, &got);
    if (error != 0) return IoError("reading", segment->path, error);
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* slot = chunk.data() + j * slot_bytes_;
      int64_t key;
      std::memcpy(&key, slot, 8);
      if (!SlotChecksumOk(slot)) {
        // Only a crash in the middle of the newest segment's last write
        // leaves bad slots, and then nothing good follows them.
        if (!newest) return Corruption(*segment, begin + j, key, "checksum mismatch");
        if (first_bad < 0) first_bad = begin + j;
        continue;
      }
      if (first_bad >= 0) {
        return Corruption(*segment, first_bad, -1,
                          "checksum mismatch before good records (not a torn tail)");
      }
      uint64_t sequence;
      uint32_t flags;
      std::memcpy(&sequence, slot + 8, 8);
      std::memcpy(&flags, slot + 16, 4);
      if (flags & kTombstone) {
        ++segment->tombstones;
        segment->max_tombstone_sequence = std::max(segment->max_tombstone_sequence, sequence);
      } else {
        segment->min_data_sequence = std::min(segment->min_data_sequence, sequence);
      }
      next_sequence_ = std::max(next_sequence_, sequence + 1);
      auto seen = sequences->find(key);
      if (seen != sequences->end() && seen->second > sequence) continue;
      (*sequences)[key] = sequence;
      const uint64_t previous = (flags & kTombstone)
                                    ? index_.Erase(key)
                                    : index_.Assign(key, Location(id, begin + j));
      if (previous != kNoLocation) --segments_[SegmentOf(previous)].live;
      if (!(flags & kTombstone)) ++segment->live;
    }
    begin += count;
  }
  segment->slots = first_bad >= 0 ? first_bad : slots;
  if (segment->slots * slot_bytes_ + kFileHeaderBytes != st.st_size) {
    // Cut the torn tail so the segment ends on whole, good records.
    if (::ftruncate(segment->fd, kFileHeaderBytes + segment->slots * slot_bytes_) != 0) {
      return IoError("truncating the torn tail of", segment->path, errno);
    }
  }
  return Status::Ok();
}

Status SegmentStore::Recover() {
  if (::mkdir(options_.directory.c_str(), 0755) != 0 && errno != EEXIST) {
    return IoError("creating directory", options_.directory, errno);
  }
  DIR* dir = ::opendir(options_.directory.c_str());
  if (dir == nullptr) return IoError("opening directory", options_.directory, errno);
  std::vector<uint32_t> ids;
  while (dirent* entry = ::readdir(dir)) {
    uint32_t id;
    if (ParseSegmentName(entry->d_name, &id)) ids.push_back(id);
  }
  ::closedir(dir);
  std::sort(ids.begin(), ids.end());
  std::unordered_map<int64_t, uint64_t> sequences;
  for (size_t k = 0; k < ids.size(); ++k) {
    // Insert first: RecoverSegment decrements the live count of whichever
    // segment held a key's older record, this one included.
    Segment& segment = segments_[ids[k]];
    bool torn_file = false;
    Status s = RecoverSegment(ids[k], &segment, k + 1 == ids.size(), &sequences, &torn_file);
    if (!s.ok()) return s;
    next_segment_id_ = ids[k] + 1;
    if (torn_file) {
      ::close(segment.fd);
      ::unlink(segment.path.c_str());
      segments_.erase(ids[k]);
    }
  }
  return Status::Ok();
}

Status ValidateOptions(const SegmentStoreOptions& options) {
  if (options.directory.empty()) {
    return Status(StatusCode::kInvalidArgument, "the segment store needs a directory");
  }
  if (options.record_bytes < 1 || options.record_bytes > (64 << 20)) {
    return Status(StatusCode::kInvalidArgument,
                  "record_bytes must be between 1 and 64 MiB, got " +
                      std::to_string(options.record_bytes));
  }
  if (options.segment_bytes < kFileHeaderBytes + kSlotHeaderBytes + options.record_bytes) {
    return Status(StatusCode::kInvalidArgument,
                  "segment_bytes " + std::to_string(options.segment_bytes) +
                      " cannot hold one record of " + std::to_string(options.record_bytes) +
                      " bytes");
  }
  if (!(options.gc_stale_fraction > 0.0 && options.gc_stale_fraction <= 1.0)) {
    return Status(StatusCode::kInvalidArgument, "gc_stale_fraction must be in (0, 1]");
  }
  if (options.read_threads < 1) {
    return Status(StatusCode::kInvalidArgument, "read_threads must be at least 1");
  }
  return Status::Ok();
}

}  // namespace

Status OpenSegmentStore(const SegmentStoreOptions& options, std::unique_ptr<RowStore>* out) {
  if (Status s = ValidateOptions(options); !s.ok()) return s;
  try {
    auto store = std::make_unique<SegmentStore>(options);
    if (Status s = store->Recover(); !s.ok()) return s;
    *out = std::move(store);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory opening the segment store");
  }
  return Status::Ok();
}

Status RestoreSegmentStore(const std::string& checkpoint_directory,
                           const SegmentStoreOptions& options, std::unique_ptr<RowStore>* out) {
  if (Status s = ValidateOptions(options); !s.ok()) return s;
  const std::string path = checkpoint_directory + "/" + kManifestName;
  FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return IoError("opening the checkpoint manifest", path, errno);
  std::string text;
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  std::fclose(file);
  const std::string record_line = "record_bytes " + std::to_string(options.record_bytes) + "\n";
  const size_t segments_at = text.find("\nsegments");
  if (text.rfind("kvsparse-segment-store 1\n", 0) != 0 || segments_at == std::string::npos ||
      text.back() != '\n') {
    return Status(StatusCode::kCorruption, "checkpoint manifest " + path + " is malformed");
  }
  if (text.find(record_line) == std::string::npos) {
    return Status(StatusCode::kInvalidArgument,
                  "checkpoint " + checkpoint_directory + " holds records of another size than " +
                      std::to_string(options.record_bytes) + " bytes");
  }
  if (Status s = EmptyDirectory(options.directory); !s.ok()) return s;
  std::string names = text.substr(segments_at + 9);
  size_t at = 0;
  while (at < names.size()) {
    const size_t end = names.find_first_of(" \n", at);
    const std::string name = names.substr(at, end - at);
    at = end + 1;
    if (name.empty()) continue;
    uint32_t id;
    if (!ParseSegmentName(name, &id)) {
      return Status(StatusCode::kCorruption, "checkpoint manifest " + path +
                                                 " names a file that is no segment: " + name);
    }
    const std::string source = checkpoint_directory + "/" + name;
    const std::string target = options.directory + "/" + name;
    if (::link(source.c_str(), target.c_str()) != 0) {
      return IoError("linking " + source + " to", target, errno);
    }
  }
  return OpenSegmentStore(options, out);
}

}  // namespace kvsparse
