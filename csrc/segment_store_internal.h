// SegmentStore's internals (segment_store.h): the on-disk constants, the
// in-RAM location index, and the class itself, shared by its files:
// segment_store.cc (writes, reads, scans, opening), segment_gc.cc (garbage
// collection), segment_recovery.cc (checkpoints, recovery, restore).
// file_io.h and read_pool.h hold what it shares with RunStore.
//
// Thread-safety: LocationIndex and Segment are plain data, guarded by the
// SegmentStore's mutex_; SegmentStore is safe from several threads (every
// public call takes mutex_; ReadBatch's reads run on pool_'s threads, which
// only read files and write their own buffers).
#ifndef KVSPARSE_SEGMENT_STORE_INTERNAL_H_
#define KVSPARSE_SEGMENT_STORE_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "crc32c.h"
#include "file_io.h"
#include "hash.h"
#include "read_pool.h"
#include "segment_store.h"

namespace kvsparse {
namespace segment_store {

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

inline uint64_t Location(uint64_t segment, uint64_t slot) { return (segment << kSlotBits) | slot; }
inline uint32_t SegmentOf(uint64_t location) {
  return static_cast<uint32_t>(location >> kSlotBits);
}
inline uint64_t SlotOf(uint64_t location) { return location & kSlotMask; }

inline std::string SegmentName(uint32_t id) {
  char name[32];
  std::snprintf(name, sizeof(name), "segment-%08u.kvs", id);
  return name;
}

inline bool ParseSegmentName(const std::string& name, uint32_t* id) {
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
      pending.push_back(
          Pending{keys[i], next_sequence_ + pending.size(), kTombstone, nullptr, kNoLocation});
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

// The options' checks (OpenSegmentStore, RestoreSegmentStore).
Status ValidateOptions(const SegmentStoreOptions& options);

}  // namespace segment_store
}  // namespace kvsparse

#endif  // KVSPARSE_SEGMENT_STORE_INTERNAL_H_
