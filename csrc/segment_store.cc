// SegmentStore (segment_store.h): opening, writes, reads and scans.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "crc32c.h"
#include "file_io.h"
#include "segment_store_internal.h"

namespace kvsparse {
namespace segment_store {

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

Status SegmentStore::Scan(uint64_t* cursor, int64_t max_records, int64_t* keys, uint8_t* records,
                          int64_t* count) {
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
          std::max<int64_t>(
              1, std::min<int64_t>(kScanChunkBytes / slot_bytes_, max_records - *count)));
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

Status ValidateOptions(const SegmentStoreOptions& options) {
  if (options.directory.empty()) {
    return Status(StatusCode::kInvalidArgument, "the segment store needs a directory");
  }
  if (options.record_bytes < 1 || options.record_bytes > (64 << 20)) {
    return Status(StatusCode::kInvalidArgument, "record_bytes must be between 1 and 64 MiB, got " +
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

}  // namespace segment_store

Status OpenSegmentStore(const SegmentStoreOptions& options, std::unique_ptr<RowStore>* out) {
  if (Status s = segment_store::ValidateOptions(options); !s.ok()) return s;
  try {
    auto store = std::make_unique<segment_store::SegmentStore>(options);
    if (Status s = store->Recover(); !s.ok()) return s;
    *out = std::move(store);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory opening the segment store");
  }
  return Status::Ok();
}

}  // namespace kvsparse
