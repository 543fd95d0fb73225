// EmbeddingTable::Tier, the state of a table's memory budget and disk tier
// (table_tier.cc). Not a public header: the table's own files include it.
#ifndef KVSPARSE_TABLE_TIER_H_
#define KVSPARSE_TABLE_TIER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "disk_tier.h"
#include "row_store.h"
#include "run_store.h"
#include "status.h"
#include "table.h"

namespace kvsparse {

struct EmbeddingTable::Tier {
  TierConfig config;
  std::unique_ptr<RowStore> store;  // null: a budget without a disk tier
  pid_t owner = 0;
  int64_t record_bytes = 0;
  int64_t disk_rows = 0;
  int generation = 0;  // rows-<generation>: the store's directory under spill_dir
  uint64_t random = 0x243F6A8885A308D3ull;
  TierStats stats;
  // Bytes of merging the writes so far have earned (RunMaintenance).
  int64_t maintenance_credit = 0;
  // Counted by Lookup, which is const and may run on several threads at once.
  mutable std::atomic<int64_t> lookup_rows{0};
  mutable std::atomic<int64_t> lookup_hits{0};
  // The error that ended the last scan of the disk tier (NextKeys and kin
  // return counts only); Ok when it ran to the end.
  Status scan_error;

  std::string StoreDirectory() const {
    return config.spill_dir + "/rows-" + std::to_string(generation);
  }
  // The store's options: StoreDirectory, and buffers sized from the budget
  // (OpenTierStore, AdoptDiskCheckpoint).
  RunStoreOptions StoreOptions(int64_t record_bytes) const;
};

}  // namespace kvsparse

#endif  // KVSPARSE_TABLE_TIER_H_
