// The memory budget of a shard and the disk tier of a table (EmbeddingTable's
// EnableTier, table_tier.cc).
//
// MemoryBudget: the bytes one shard (a server process, or a local store) may
// hold in its tables: index, rows, optimizer slots, push scratch and the disk
// tier's in-memory index. Every table of the shard reports what it holds
// after each operation; a table that is about to grow checks the budget first.
// Without a disk tier a growth that would pass the budget is refused
// (kLimitExceeded, nothing applied); with one, the table moves its coldest
// rows to disk first (Tier below).
//
//   auto budget = std::make_shared<kvsparse::MemoryBudget>(int64_t{1} << 30);
//   kvsparse::TierConfig tier;
//   tier.budget = budget;
//   tier.spill_dir = "/ssd/spill/shard-0/user";  // the table's own directory
//   tier.name = "user";
//   s = table->EnableTier(tier);                  // before the first row
//
// Thread-safety: MemoryBudget is safe from any thread (one mutex).
#ifndef KVSPARSE_DISK_TIER_H_
#define KVSPARSE_DISK_TIER_H_

#include <malloc.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvsparse {

class MemoryBudget {
 public:
  // Also fixes the C library's mmap threshold at 1 MiB for the process: a
  // request's large temporaries (the records moving between tiers, arrays
  // of tens of MiB) then go back to the system when freed, instead of
  // staying in the heap beside the budget (glibc raises the threshold to
  // 32 MiB as it sees large blocks freed).
  explicit MemoryBudget(int64_t limit) : limit_(limit) { ::mallopt(M_MMAP_THRESHOLD, 1 << 20); }
  int64_t limit() const { return limit_; }
  // Sets what owner holds now.
  void Report(const void* owner, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t& held = held_[owner];
    used_ += bytes - held;
    held = bytes;
  }
  void Forget(const void* owner) {
    std::lock_guard<std::mutex> lock(mutex_);
    releasers_.erase(owner);
    auto it = held_.find(owner);
    if (it == held_.end()) return;
    used_ -= it->second;
    held_.erase(it);
  }
  // A member that can give memory back: release(bytes) frees what it can (its
  // cold rows to disk) and returns the bytes freed. Called with the shard's
  // lock held, by another member that needs room.
  void Join(const void* owner, std::function<int64_t(int64_t)> release) {
    std::lock_guard<std::mutex> lock(mutex_);
    releasers_[owner] = std::move(release);
  }
  // Asks every member but owner, in turn, to free bytes; returns what they freed.
  int64_t ReleaseFromOthers(const void* owner, int64_t bytes) {
    std::vector<std::function<int64_t(int64_t)>> others;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& entry : releasers_) {
        if (entry.first != owner) others.push_back(entry.second);
      }
    }
    int64_t freed = 0;
    for (auto& release : others) {
      if (freed >= bytes) break;
      freed += release(bytes - freed);
    }
    return freed;
  }
  int64_t Used() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return used_;
  }
  // What everyone but owner holds.
  int64_t UsedByOthers(const void* owner) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = held_.find(owner);
    return used_ - (it == held_.end() ? 0 : it->second);
  }

 private:
  const int64_t limit_;
  mutable std::mutex mutex_;
  std::unordered_map<const void*, int64_t> held_;
  std::unordered_map<const void*, std::function<int64_t(int64_t)>> releasers_;
  int64_t used_ = 0;
};

struct TierConfig {
  std::shared_ptr<MemoryBudget> budget;  // required
  // The table's own directory for rows moved to disk (created; emptied when
  // the tier opens; removed when the table is freed by the process that
  // created it). Empty: no disk tier, the budget only refuses.
  std::string spill_dir;
  std::string name;  // the table's name, for messages
  // A table read from several threads at once (a serving replica's): lookups
  // read disk rows through instead of bringing them back (a lookup then
  // changes nothing), and the table gives no memory to the shard's other
  // tables (they may run beside its lookups).
  bool concurrent_lookups = false;
  int64_t read_threads = 16;
  int64_t segment_bytes = 64 << 20;
};

// What a table's tiers hold and did (EmbeddingTable::tier_stats).
struct TierStats {
  int64_t memory_budget = 0;   // the shard's budget (0: none)
  int64_t rows_in_memory = 0;
  int64_t rows_on_disk = 0;
  int64_t memory_bytes = 0;    // this table, the disk index included
  int64_t disk_bytes = 0;
  int64_t disk_index_bytes = 0;
  int64_t row_lookups = 0;     // ids looked up, pushed or assigned that the table stores
  int64_t disk_hits = 0;       // of those, found on disk
  int64_t rows_read = 0;       // rows brought back from disk into memory
  int64_t evictions = 0;       // rows moved to disk
  int64_t disk_reads = 0;      // read calls (a page each for lookups)
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t bytes_updated = 0;
  int64_t gc_segments_freed = 0;
  int64_t gc_bytes_moved = 0;
  int64_t compactions = 0;     // times the row arrays were shrunk to give memory back
};

}  // namespace kvsparse

#endif  // KVSPARSE_DISK_TIER_H_
