// EmbeddingTable::Tier, the state of a table's memory budget and disk tier, and
// EmbeddingTable::TierScope, an operation's hold on them (table_tier.cc). Not a
// public header: the table's own files include it.
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
  // Operations settled since a server last called IdleMaintenance: while it is
  // small, merges are left to the server's idle time.
  int64_t settles_since_idle = INT64_MAX / 2;
  // The ids (sorted, distinct) of the table's last two reads (pulls, prefetches):
  // rows moved out only when nothing else can go (EvictRows), so that another
  // table's room or this table's push does not send back to disk the rows a
  // prefetch just brought in, or a pull just returned, before the request that
  // follows names them (the push of a pulled batch, the pull of a prefetched one).
  std::vector<int64_t> recent_reads[2];
  // Counted by Lookup, which is const and may run on several threads at once.
  mutable std::atomic<int64_t> lookup_rows{0};
  mutable std::atomic<int64_t> lookup_hits{0};
  // The error that ended the last scan of the disk tier (NextKeys and kin
  // return counts only); Ok when it ran to the end.
  Status scan_error;
  // TierScopes open now (they nest: only the outermost settles).
  int open_scopes = 0;

  std::string StoreDirectory() const {
    return config.spill_dir + "/rows-" + std::to_string(generation);
  }
  // The store's options: StoreDirectory, and buffers sized from the budget
  // (OpenTierStore, AdoptDiskCheckpoint).
  RunStoreOptions StoreOptions(int64_t record_bytes) const;
};

// One operation's hold on the memory budget and the disk tier. Every public
// operation that moves or changes rows opens one where it starts on them;
// Prepare brings the operation's disk rows into memory, after making room
// for them and for the ids it inserts; when the scope closes, on every exit
// path (errors included), the budget is settled: the table's bytes reported,
// the shard shrunk back within its budget where the operation's bookkeeping
// took it past, the disk tier's merges run in the room left.
//
//   Status EmbeddingTable::LookupOrInsert(const int64_t* keys, int64_t n, float* out) {
//     TierScope scope(this);
//     Status s = scope.Prepare(keys, n, /*insert=*/true);
//     if (!s.ok()) return s;  // settled all the same: rows may have moved out
//     return LookupOrInsertInMemory(keys, n, out);
//   }
//
// Scopes nest: one opened inside another (Remove of a push's victims or of
// expired rows) prepares but settles nothing; the outermost settles once. A
// scope that closes on a push begun (BeginPush's, when it succeeded) settles
// nothing: the push's saved rows and scratch stay as they are until
// FinishPush or CancelPush, whose scope settles. A lookup's scope moves rows
// only on a table whose lookups run one at a time; it settles in full when
// its rows came into memory, and otherwise only reports the table's bytes
// (a promotion refused may have moved rows out before it gave up). Without
// a tier a scope does nothing.
//
// Thread-safety: not thread-safe, as the table: opened and closed on the
// operation's thread. A lookup's scope on a table without a tier or with
// concurrent_lookups touches nothing, so those lookups may hold theirs on
// several threads at once.
class EmbeddingTable::TierScope {
 public:
  explicit TierScope(EmbeddingTable* table);
  struct ForLookup {};
  // Lookup's. Lookup is const to its callers, and moving rows between tiers
  // changes no result; its callers serialize on the shard lock, as for every
  // table call, unless the table has concurrent_lookups (then nothing moves).
  TierScope(const EmbeddingTable* table, ForLookup);
  ~TierScope();
  TierScope(const TierScope&) = delete;
  TierScope& operator=(const TierScope&) = delete;

  // Whether this scope moves rows and settles (a tier, and not a lookup of
  // a table with concurrent_lookups).
  bool moves_rows() const { return moves_rows_; }
  // Brings keys' disk rows into memory after making room for them and, with
  // insert, for the keys stored nowhere (EmbeddingTable::PrepareRows).
  // Changes no row's state. Ok at once when the scope moves no rows.
  Status Prepare(const int64_t* keys, int64_t n, bool insert);

 private:
  EmbeddingTable* const table_;
  const bool moves_rows_;
  const bool lookup_;
  bool outermost_ = false;
  bool prepared_ = false;  // a Prepare succeeded
};

}  // namespace kvsparse

#endif  // KVSPARSE_TABLE_TIER_H_
