// SegmentStore (segment_store.h): garbage collection (Maintenance), which
// copies the live records of mostly stale segments forward and removes them.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "crc32c.h"
#include "file_io.h"
#include "segment_store_internal.h"

namespace kvsparse {
namespace segment_store {

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
    const int64_t count =
        std::min<int64_t>(segment.slots - gc_next_slot_,
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

}  // namespace segment_store
}  // namespace kvsparse
