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

#include <algorithm>
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
    releasers_.erase(std::remove_if(releasers_.begin(), releasers_.end(),
                                    [owner](const auto& entry) { return entry.first == owner; }),
                     releasers_.end());
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
    releasers_.emplace_back(owner, std::move(release));
  }
  // Asks the members but owner to free bytes; returns what they freed. The
  // member holding the most is asked, again while it frees some, and so on
  // (ties: the one that joined first). (Each in turn, in the hash order of
  // their addresses, a different order in every process: a shard of
  // benchmarks/tiered_dlrm.py now and then ended with its largest table
  // holding 40 of its 45 MiB, the tables asked before it emptied down to
  // 256-860 rows where they read ~1,000 a step: 5,500 rows read a step, not
  // 800. A small table's rows are each read every step; a large one's coldest
  // are colder.)
  int64_t ReleaseFromOthers(const void* owner, int64_t bytes) {
    std::vector<const void*> spent{owner};  // asked and freed nothing, or the owner
    int64_t freed = 0;
    while (freed < bytes) {
      std::function<int64_t(int64_t)> release;
      const void* largest = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        int64_t most = -1;
        for (const auto& entry : releasers_) {
          if (std::find(spent.begin(), spent.end(), entry.first) != spent.end()) continue;
          auto held = held_.find(entry.first);
          const int64_t bytes_held = held == held_.end() ? 0 : held->second;
          if (bytes_held > most) {
            most = bytes_held;
            largest = entry.first;
            release = entry.second;
          }
        }
      }
      if (largest == nullptr) break;
      const int64_t got = release(bytes - freed);
      if (got <= 0) spent.push_back(largest);
      freed += std::max<int64_t>(0, got);
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
  // In the order they joined.
  std::vector<std::pair<const void*, std::function<int64_t(int64_t)>>> releasers_;
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
  int64_t idle_bytes_moved = 0;  // of gc_bytes_moved, what merges in a server's idle time moved
  int64_t compactions = 0;     // times the row arrays were shrunk to give memory back
};

}  // namespace kvsparse

#endif  // KVSPARSE_DISK_TIER_H_
