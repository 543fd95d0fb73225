// EmbeddingTable: the memory budget and the disk tier (disk_tier.h, table.h).
//
// A row lives in exactly one tier. In memory it is an ordinary row; on disk it
// is one record of the table's RowStore (segment_store.h) holding everything
// the row needs to come back unchanged:
//
//   values (dim float32) | slots (num_slots() * dim float32, the master last)
//   | step | change stamp | touches | last step (uint32 each)
//
// Every operation that names ids first opens a TierScope (table_tier.h) and
// prepares its ids (PrepareRows): it finds which of them are on disk (the
// store's in-memory index: no I/O), makes room for them and for the ids it
// will insert (MakeRoom: the coldest rows not in the request move to disk,
// in one batch write), then reads the request's disk rows back in one batch
// of reads and puts them in memory with their exact state (stamp included:
// moving a row is not a change for checkpoints). The operation then runs on
// memory rows as it always did, and its scope settles the budget when it
// returns. Lookups (pulls) bring disk rows back too (the push that follows
// finds them in memory), or read them through when the pull is larger than
// the budget; ids stored nowhere cost no I/O.
//
// Cold: the lowest last step when the policy keeps one (LRU), else the fewest
// touches when it keeps them (LFU), else the fewest updates (the row's own
// step counter, LFU). Victims are sampled from the index (Redis-style: 8 per
// victim, the coldest win) or, when a large part of the rows must go, taken
// from all of them.
//
// Memory: rows leave the row arrays as free slots, which new rows reuse; when
// the shard is over its budget without growing (the disk index grew), whole
// chunks are given back by moving the last rows into free slots (Compact).
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <system_error>
#include <vector>

#include "disk_checkpoint.h"
#include "disk_tier.h"
#include "hash.h"
#include "run_store.h"
#include "table.h"
#include "table_internal.h"
#include "table_tier.h"

namespace kvsparse {

using table_internal::KeyText;
using table_internal::RowsPerChunkLog2;

namespace {

constexpr int64_t kScanBatch = 4096;  // records per scan call of the checkpoint scans
constexpr int64_t kSamplesPerVictim = 8;
constexpr int64_t kEvictPieceBytes = 16 << 20;
// Runs on disk past which merges run whatever their pace (RunMaintenance).
constexpr int64_t kBehindRuns = 20;
// The same with a server's idle time for merges: past the store's own limit
// (kMaxRuns in run_merge.cc, 24), where its merges take the 4 smallest runs.
constexpr int64_t kIdleBehindRuns = 32;
// Operations settled without a server's IdleMaintenance call in between past
// which merges run in the operations again (a server with no idle time).
constexpr int64_t kIdleSettles = 256;

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  if (unit == 0) {
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(text, sizeof(text), "%.1f %s", value, units[unit]);
  }
  return text;
}

uint64_t NextRandom(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Status RemoveDirectoryContents(const std::string& directory) {
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (error) {
    return Status(StatusCode::kIoError,
                  "cannot create the spill directory " + directory + ": " + error.message());
  }
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    std::filesystem::remove_all(entry.path(), error);
    if (error) {
      return Status(StatusCode::kIoError, "cannot empty the spill directory " + directory +
                                              ": " + error.message());
    }
  }
  if (error) {
    return Status(StatusCode::kIoError,
                  "cannot read the spill directory " + directory + ": " + error.message());
  }
  return Status::Ok();
}

}  // namespace


EmbeddingTable::~EmbeddingTable() {
  if (tier_ == nullptr) return;
  tier_->config.budget->Forget(this);
  // A forked child (a server's checkpoint writer) never touches the parent's files.
  if (tier_->store != nullptr && ::getpid() == tier_->owner) {
    tier_->store->Close();
    tier_->store.reset();
    std::error_code error;
    std::filesystem::remove_all(tier_->config.spill_dir, error);
  }
}

int64_t EmbeddingTable::RecordBytes() const {
  return RowRecordBytes(config_.dim, num_slots());
}

RunStoreOptions EmbeddingTable::Tier::StoreOptions(int64_t record_bytes) const {
  RunStoreOptions options;
  options.directory = StoreDirectory();
  options.record_bytes = record_bytes;
  options.read_threads = config.read_threads;
  options.durable = false;  // spill files: a restarted server restores from a checkpoint
  // A row moves out only from memory, where it is not on disk: nothing to check.
  options.check_writes = false;
  // Its read and merge buffers: a small share of the budget they count against.
  const int64_t limit = config.budget->limit();
  options.buffer_bytes = std::min<int64_t>(8 << 20, std::max<int64_t>(16 << 10, limit / 64));
  // Merges run after an operation, in room made for them (RunMaintenance).
  options.merge_buffer_bytes = std::min<int64_t>(16 << 20, std::max<int64_t>(64 << 10, limit / 8));
  return options;
}

Status EmbeddingTable::OpenTierStore() {
  const RunStoreOptions options = tier_->StoreOptions(RecordBytes());
  std::unique_ptr<RowStore> store;
  Status s = OpenRunStore(options, &store);
  if (!s.ok()) return s;
  tier_->store = std::move(store);
  tier_->record_bytes = options.record_bytes;
  return Status::Ok();
}

Status EmbeddingTable::EnableTier(const TierConfig& config) {
  if (config.budget == nullptr || config.budget->limit() <= 0) {
    return Status(StatusCode::kInvalidArgument, "a memory budget must be a positive byte count");
  }
  if (tier_ != nullptr || index_.size() > 0) {
    return Status(StatusCode::kInvalidArgument, "a table's tier is set before its first row");
  }
  std::unique_ptr<Tier> tier;
  try {
    tier.reset(new Tier());
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory setting up the disk tier");
  }
  tier->config = config;
  tier->owner = ::getpid();
  tier->stats.memory_budget = config.budget->limit();
  tier_ = std::move(tier);
  if (!config.concurrent_lookups) {
    tier_->config.budget->Join(this, [this](int64_t bytes) { return ReleaseMemory(bytes); });
  }
  // A table whose policy bounds it (max_rows, ttl_steps) keeps its rows in
  // memory: its policy is its limit, and it counts against the budget.
  const bool bounded = config_.policy.max_rows > 0 || config_.policy.ttl_steps > 0;
  if (!config.spill_dir.empty() && !bounded) {
    Status s = RemoveDirectoryContents(config.spill_dir);
    if (s.ok()) s = OpenTierStore();
    if (!s.ok()) {
      tier_.reset();
      return s;
    }
  }
  ReportMemory();
  return Status::Ok();
}

int64_t EmbeddingTable::TierBytes() const {
  int64_t bytes = MemoryBytes();
  if (tier_ != nullptr && tier_->store != nullptr) {
    bytes += tier_->store->Stats().index_bytes;
    for (const auto& reads : tier_->recent_reads) {
      bytes += static_cast<int64_t>(reads.capacity() * sizeof(int64_t));
    }
  }
  return bytes;
}

void EmbeddingTable::ReportMemory() {
  if (tier_ != nullptr) tier_->config.budget->Report(this, TierBytes());
}

TierStats EmbeddingTable::tier_stats() const {
  TierStats stats;
  if (tier_ == nullptr) {
    stats.rows_in_memory = index_.size();
    stats.memory_bytes = MemoryBytes();
    return stats;
  }
  stats = tier_->stats;
  stats.row_lookups += tier_->lookup_rows.load();
  stats.disk_hits += tier_->lookup_hits.load();
  stats.rows_in_memory = index_.size();
  stats.rows_on_disk = tier_->disk_rows;
  stats.memory_bytes = TierBytes();
  if (tier_->store != nullptr) {
    const RowStoreStats disk = tier_->store->Stats();
    stats.disk_bytes = disk.disk_bytes;
    stats.disk_index_bytes = disk.index_bytes;
    stats.bytes_read = disk.bytes_read;
    stats.bytes_written = disk.bytes_written;
    stats.bytes_updated = disk.bytes_updated;
    stats.gc_segments_freed = disk.gc_segments_freed;
    stats.gc_bytes_moved = disk.gc_bytes_moved;
    stats.disk_reads = disk.reads;
  }
  return stats;
}

int64_t EmbeddingTable::BackedRows() const {
  int64_t rows = std::min(values_.CapacityRows(), slots_.CapacityRows());
  rows = std::min(rows, master_.CapacityRows());
  return std::min(rows, row_meta_.CapacityRows());
}

int64_t EmbeddingTable::RowGrowthBytes(int64_t last_row) const {
  return values_.GrowthBytes(last_row) + slots_.GrowthBytes(last_row) +
         master_.GrowthBytes(last_row) + row_meta_.GrowthBytes(last_row) +
         policy_.GrowthBytes(last_row);
}

int64_t EmbeddingTable::BytesPerRow() const {
  return values_.row_bytes() + slots_.row_bytes() + master_.width() * 4 + 8 +
         policy_.RowBytes() + 18;  // the key index: 64-byte lines of 5 at a load of ~0.7
}

void EmbeddingTable::EncodeRow(int64_t row, uint8_t* record) const {
  const int64_t dim = config_.dim;
  float* values = reinterpret_cast<float*>(record);
  int64_t step;
  ReadRowState(row, values, values + dim, &step);
  uint32_t meta[4];
  uint32_t saved_policy[2];
  policy_.SaveRow(row, saved_policy);
  meta[0] = *StepOf(row);
  meta[1] = *StampOf(row);
  meta[2] = saved_policy[0];
  meta[3] = saved_policy[1];
  std::memcpy(record + 4 * dim * (1 + num_slots()), meta, sizeof(meta));
}

void EmbeddingTable::DecodeRow(const uint8_t* record, int64_t row) {
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  const float* values = reinterpret_cast<const float*>(record);
  values_.Write(row, values);
  if (slot_floats > 0) slots_.Write(row, values + dim);
  if (has_master()) std::memcpy(master_.Row(row), values + dim + slot_floats, sizeof(float) * dim);
  uint32_t meta[4];
  std::memcpy(meta, record + 4 * dim * (1 + num_slots()), sizeof(meta));
  *StepOf(row) = meta[0];
  *StampOf(row) = meta[1];
  policy_.RestoreRow(row, meta + 2);
}

void EmbeddingTable::PrefetchColdScore(int64_t row) const {
  if (policy_.TracksLastStep() || policy_.TracksTouches()) {
    policy_.PrefetchRow(row);
  } else {
    PrefetchLine(StepOf(row));
  }
}

uint64_t EmbeddingTable::ColdScore(int64_t row) const {
  uint32_t saved[2];
  policy_.SaveRow(row, saved);
  if (policy_.TracksLastStep()) return saved[1];
  if (policy_.TracksTouches()) return saved[0];
  return *StepOf(row);
}

Status EmbeddingTable::LimitStatus(int64_t incoming, int64_t needed) const {
  const std::string table = tier_->config.name.empty() ? "a table" : "table '" + tier_->config.name + "'";
  const int64_t limit = tier_->config.budget->limit();
  if (tier_->store == nullptr) {
    return Status(StatusCode::kLimitExceeded,
                  table + ": adding " + std::to_string(incoming) +
                      " rows would take the shard past its memory budget of " + HumanBytes(limit) +
                      " (it needs " + HumanBytes(needed) +
                      "); nothing was applied. Raise --memory-budget (KVSPARSE_MEMORY_BUDGET), "
                      "or give the server a --spill-dir so that cold rows move to disk");
  }
  return Status(StatusCode::kLimitExceeded,
                table + ": one request needs " + std::to_string(incoming) +
                    " more rows in memory at once (" + HumanBytes(needed) +
                    " in all with its scratch), more than the memory budget of " +
                    HumanBytes(limit) + " holds; nothing was applied. Send smaller "
                    "requests or raise --memory-budget (KVSPARSE_MEMORY_BUDGET)");
}

Status EmbeddingTable::EvictRows(int64_t count, const std::vector<int64_t>& keep) {
  if (count <= 0) return Status::Ok();
  const int64_t slots = index_.SlotCount();
  struct Candidate {
    uint64_t score;
    int64_t key;
  };
  std::vector<Candidate> candidates;
  // Ties (most rows have equal counts) are broken at random: taken in slot
  // order, the victims would empty one region of the key index while new keys
  // land everywhere, and the probes of the rest ran through long full runs
  // (a fill of 65,536 new ids a push went from 0.2 s to 6 s).
  const uint64_t salt = NextRandom(&tier_->random);
  auto score = [&](int64_t s) {
    return static_cast<uint64_t>(ColdScore(index_.SlotRow(s))) << 32 |
           (Mix64(static_cast<uint64_t>(index_.SlotKey(s)) ^ salt) & 0xFFFFFFFFu);
  };
  const auto& recent = tier_->recent_reads;
  bool spare_recent = true;
  // Whether a stored row may move: not the operation's own, nor (while
  // spare_recent) one the last reads brought in.
  auto eligible = [&](int64_t key) {
    if (std::binary_search(keep.begin(), keep.end(), key)) return false;
    return !spare_recent || !(std::binary_search(recent[0].begin(), recent[0].end(), key) ||
                              std::binary_search(recent[1].begin(), recent[1].end(), key));
  };
  auto add_all = [&]() {
    candidates.clear();
    for (int64_t s = 0; s < slots; ++s) {
      if (index_.SlotRow(s) != KeyIndex::kEmpty) {
        candidates.push_back({score(s), index_.SlotKey(s)});
      }
    }
  };
  // Moves the `count` coldest eligible candidates to the front; returns how
  // many it found (fewer than count: all there are). Only the coldest are
  // checked, a round at a time: the checks (three binary searches each)
  // were most of this function's time when every draw had them.
  auto pick = [&]() -> int64_t {
    auto colder = [](const Candidate& a, const Candidate& b) { return a.score < b.score; };
    const int64_t size = static_cast<int64_t>(candidates.size());
    int64_t chosen = 0, examined = 0;
    while (chosen < count && examined < size) {
      const int64_t short_by = count - chosen;
      const int64_t round = std::min(size - examined, short_by + short_by / 4 + 16);
      std::nth_element(candidates.begin() + examined, candidates.begin() + examined + round - 1,
                       candidates.end(), colder);
      for (int64_t i = examined; i < examined + round; ++i) {
        if (eligible(candidates[i].key)) candidates[chosen++] = candidates[i];
      }
      examined += round;
    }
    if (chosen > count) {
      std::nth_element(candidates.begin(), candidates.begin() + (count - 1),
                       candidates.begin() + chosen, colder);
      chosen = count;
    }
    return chosen;
  };
  try {
    int64_t found = 0;
    if (count * kSamplesPerVictim * 2 >= index_.size()) {
      candidates.reserve(static_cast<size_t>(index_.size()));
      add_all();
      found = pick();
    } else {
      // Sampled: one slot drawn at random in each of `draws` equal strata of
      // the slots, so each slot once and in order without a sort of the draws
      // (the sort was 8% of a fill's CPU). The slots and then their rows' cold
      // scores are prefetched kAhead draws ahead: the score's load, a cache
      // miss per draw, was three quarters of the time this took.
      const int64_t draws = std::min(slots, count * kSamplesPerVictim * 10 / 7 + 16);
      // Stratum d: slots [d * slots / draws, (d + 1) * slots / draws).
      auto bound = [&](int64_t d) {
        return static_cast<int64_t>(static_cast<unsigned __int128>(d) *
                                    static_cast<uint64_t>(slots) / static_cast<uint64_t>(draws));
      };
      auto position = [&](int64_t d) {
        const int64_t begin = bound(d), width = std::max<int64_t>(1, bound(d + 1) - begin);
        return begin +
               static_cast<int64_t>(NextRandom(&tier_->random) % static_cast<uint64_t>(width));
      };
      constexpr int64_t kAhead = 8;
      std::vector<int64_t> ring(2 * kAhead);
      for (int64_t d = 0; d < std::min(draws, 2 * kAhead); ++d) {
        ring[d % (2 * kAhead)] = position(d);
        index_.PrefetchSlot(ring[d % (2 * kAhead)]);
      }
      candidates.reserve(static_cast<size_t>(draws));
      for (int64_t d = 0; d < draws; ++d) {
        if (d + kAhead < draws) {
          const uint32_t row = index_.SlotRow(ring[(d + kAhead) % (2 * kAhead)]);
          if (row != KeyIndex::kEmpty) PrefetchColdScore(row);
        }
        const int64_t s = ring[d % (2 * kAhead)];
        if (d + 2 * kAhead < draws) {
          ring[d % (2 * kAhead)] = position(d + 2 * kAhead);
          index_.PrefetchSlot(ring[d % (2 * kAhead)]);
        }
        if (index_.SlotRow(s) != KeyIndex::kEmpty) {
          candidates.push_back({score(s), index_.SlotKey(s)});
        }
      }
      found = pick();
      if (found < count) {
        add_all();
        found = pick();
      }
    }
    if (found < count) {
      // The recent reads too, the coldest first, rather than fail.
      spare_recent = false;
      add_all();
      found = pick();
    }
    if (found < count) {
      return Status(StatusCode::kInternal, "the disk tier found too few rows to move");
    }
    candidates.resize(static_cast<size_t>(count));
    std::vector<int64_t> keys(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) keys[i] = candidates[i].key;
    free_rows_.reserve(free_rows_.size() + static_cast<size_t>(count));
    // In pieces of at most kEvictPieceBytes of records: one write of a
    // million rows (a shard shrinking for its disk index) held two copies
    // of them, 2 GB, outside the budget. A buffer of this call only.
    const int64_t piece = std::max<int64_t>(1, kEvictPieceBytes / tier_->record_bytes);
    std::vector<uint8_t> records(static_cast<size_t>(std::min(count, piece) * tier_->record_bytes));
    for (int64_t begin = 0; begin < count; begin += piece) {
      const int64_t m = std::min(piece, count - begin);
      for (int64_t i = 0; i < m; ++i) {
        // Found again per piece: CompactRows between pieces moves rows.
        EncodeRow(index_.Find(keys[begin + i]), records.data() + i * tier_->record_bytes);
      }
      // A piece's rows stay in memory until the disk took them all (kDiskFull:
      // the pieces before it moved, which changes no result).
      Status s = tier_->store->WriteBatch(keys.data() + begin, m, records.data());
      if (!s.ok()) return s;
      for (int64_t i = begin; i < begin + m; ++i) {
        uint32_t row;
        if (index_.Erase(keys[i], &row)) free_rows_.push_back(row);
      }
      tier_->disk_rows += m;
      tier_->stats.evictions += m;
      // A large move gives memory back as it goes, not only at its end.
      if (count > 4 * piece) CompactRows();
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory moving rows to disk (nothing moved)");
  }
  // Garbage collection at the pace of the writes: at most twice what this
  // eviction wrote is read and rewritten.
  // Merges at the pace of the writes (each record is merged about
  // log4(table / batch) times, and a merge step reads and writes it), once
  // the operation is done: RunMaintenance.
  tier_->maintenance_credit += 8 * count * tier_->record_bytes;
  return Status::Ok();
}

void EmbeddingTable::CompactRows() {
  const int64_t chunk = int64_t{1} << RowsPerChunkLog2(config_.dim);
  const int64_t live = index_.size();
  // Whole chunks, or within chunk 0 the power of two that holds the rows.
  int64_t target = (live + chunk - 1) / chunk * chunk;
  if (live < chunk) {
    target = ChunkedRows<float>::kFirstChunkRows;
    while (target < live) target *= 2;
  }
  if (BackedRows() <= target) return;
  if (next_row_ > target) {
    std::vector<uint32_t> low;
    for (uint32_t row : free_rows_) {
      if (row < target) low.push_back(row);
    }
    std::sort(low.begin(), low.end(), std::greater<uint32_t>());
    const int64_t slots = index_.SlotCount();
    float state[table_internal::kMaxRowStateFloats * 2];
    for (int64_t s = 0; s < slots; ++s) {
      const uint32_t row = index_.SlotRow(s);
      if (row == KeyIndex::kEmpty || row < target) continue;
      const uint32_t to = low.back();
      low.pop_back();
      int64_t step;
      ReadRowState(row, state, state + config_.dim, &step);
      const int64_t slot_floats = config_.dim * optimizer_.num_slots();
      values_.Write(to, state);
      if (slot_floats > 0) slots_.Write(to, state + config_.dim);
      if (has_master()) {
        std::memcpy(master_.Row(to), master_.Row(row), sizeof(float) * config_.dim);
      }
      *StepOf(to) = *StepOf(row);
      *StampOf(to) = *StampOf(row);
      uint32_t saved[2];
      policy_.SaveRow(row, saved);
      policy_.RestoreRow(to, saved);
      index_.SetSlotRow(s, to);
    }
    free_rows_.assign(low.begin(), low.end());
    next_row_ = target;
  }
  values_.TruncateRows(next_row_);
  slots_.TruncateRows(next_row_);
  master_.TruncateRows(next_row_);
  row_meta_.TruncateRows(next_row_);
  policy_.TruncateRows(next_row_);
  free_rows_.shrink_to_fit();
  ::malloc_trim(0);
  ++tier_->stats.compactions;
}

Status EmbeddingTable::MakeRoom(int64_t incoming, const std::vector<int64_t>& keep,
                                int64_t resident_kept, int64_t fresh) {
  const int64_t limit = tier_->config.budget->limit();
  const int64_t per_row = BytesPerRow();
  for (int round = 0; round < 5; ++round) {
    const int64_t free_now = static_cast<int64_t>(free_rows_.size()) +
                             std::max<int64_t>(0, BackedRows() - next_row_);
    const int64_t new_rows = std::max<int64_t>(0, incoming - static_cast<int64_t>(free_rows_.size()));
    // A push keeps the state of each row it names in scratch (saved, or new),
    // and its arrays grow by half at least (ScratchArray::Get).
    auto grown = [](int64_t capacity, int64_t need) -> int64_t {
      return need <= capacity ? 0 : std::max(need, capacity + capacity / 2) - capacity;
    };
    const int64_t existing = static_cast<int64_t>(keep.size()) - fresh;
    const int64_t scratch =
        4 * (grown(static_cast<int64_t>(push_fresh_state_.bytes() / 4), fresh * RowStateFloats()) +
             grown(static_cast<int64_t>(push_saved_state_.bytes() / 4),
                   existing * RowStateFloats()) +
             grown(static_cast<int64_t>(push_saved_meta_.bytes() / 4), existing * 4));
    // The disk index grows by a few bytes per row moved out (no doubling:
    // csrc/run_store.h), and a batch's reads or a merge step hold a bounded
    // buffer while they run.
    int64_t disk_index = 0;
    int64_t index_per_row = 0;
    if (tier_->store != nullptr) {
      const RowStoreStats disk = tier_->store->Stats();
      index_per_row = disk.index_bytes_per_record;
      // The reads' buffer holds at most a page per row of the request.
      disk_index = std::min(disk.working_bytes, incoming * disk.read_unit_bytes + 4096) +
                   incoming * index_per_row;
    }
    // The records of the rows moving between tiers pass through a buffer of
    // the request (those moving out, then those it brings back). Freed at
    // once; the slots the engine encodes beside it for a moment are left to
    // the RSS's slack.
    const int64_t transit = tier_->store != nullptr ? incoming * tier_->record_bytes : 0;
    const int64_t growth =
        (new_rows > 0 ? RowGrowthBytes(next_row_ + new_rows - 1) : 0) +
        index_.GrowthBytes(index_.size() + incoming) + scratch + disk_index + transit;
    const int64_t held = tier_->config.budget->UsedByOthers(this) + TierBytes();
    if (held + growth <= limit) return Status::Ok();
    if (round == 0 && ReleaseScratch()) continue;
    // The shard's other tables give back what they can first (a serving
    // replica's two copies, several tables of one server).
    if (round == 0 && tier_->config.budget->ReleaseFromOthers(this, held + growth - limit) > 0) {
      continue;
    }
    if (tier_->store == nullptr) return LimitStatus(incoming, held + growth);
    const int64_t movable = index_.size() - resident_kept;
    int64_t evict;
    bool compact = false;
    if (incoming > free_now) {
      // Enough rows out that the incoming ones need no new memory (rows
      // moved out cost the disk index a little).
      evict = incoming - free_now + incoming * index_per_row / per_row + 1;
    } else {
      // Over without growing (the disk index or the scratch grew): rows out,
      // and their chunks back to the system.
      evict = std::max<int64_t>(0, (held + growth - limit) / std::max<int64_t>(1, per_row - index_per_row) + 1);
      compact = true;
    }
    evict = std::min(evict, movable);
    if (evict <= 0) {
      if (incoming > free_now) return LimitStatus(incoming, held + growth);
      return Status::Ok();  // nothing left to move: the slack stays
    }
    Status s = EvictRows(evict, keep);
    if (!s.ok()) return s;
    if (compact) CompactRows();
  }
  return Status::Ok();
}

void EmbeddingTable::ShrinkToBudget() {
  if (tier_ == nullptr || tier_->store == nullptr || pending_push_ != nullptr) return;
  const int64_t limit = tier_->config.budget->limit();
  const int64_t excess = tier_->config.budget->UsedByOthers(this) + TierBytes() - limit;
  if (excess > 0) ReleaseMemory(excess);
}

int64_t EmbeddingTable::ReleaseMemory(int64_t bytes) {
  if (tier_ == nullptr || pending_push_ != nullptr || bytes <= 0) return 0;
  const int64_t before = TierBytes();
  ReleaseScratch();
  int64_t wanted = bytes - (before - TierBytes());
  if (wanted > 0 && tier_->store != nullptr && index_.size() > 0) {
    // Memory comes back only when the row arrays shrink (CompactRows): to the
    // largest capacity they can shrink to that frees what is wanted.
    const int64_t chunk = int64_t{1} << RowsPerChunkLog2(config_.dim);
    const int64_t backed = std::min(BackedRows(), std::max<int64_t>(next_row_, 1));
    const int64_t per_row = std::max<int64_t>(1, BytesPerRow() - 18);
    const int64_t want = backed - (wanted + per_row - 1) / per_row;
    int64_t capacity;
    if (want >= chunk) {
      capacity = want / chunk * chunk;
    } else {
      capacity = ChunkedRows<float>::kFirstChunkRows;
      while (capacity * 2 <= want) capacity *= 2;
    }
    const int64_t evict = index_.size() - capacity;
    const std::vector<int64_t> keep;
    if (evict <= 0 || EvictRows(evict, keep).ok()) CompactRows();
  }
  ReportMemory();
  return std::max<int64_t>(0, before - TierBytes());
}

bool EmbeddingTable::ReleaseScratch() {
  if (pending_push_ != nullptr) return false;
  const bool held = push_fresh_state_.bytes() + push_saved_state_.bytes() +
                        push_saved_meta_.bytes() > 0;
  push_fresh_state_.Release();
  push_saved_state_.Release();
  push_saved_meta_.Release();
  return held;
}

EmbeddingTable::TierScope::TierScope(EmbeddingTable* table)
    : table_(table), moves_rows_(table->tier_ != nullptr), lookup_(false) {
  if (moves_rows_) outermost_ = table_->tier_->open_scopes++ == 0;
}

EmbeddingTable::TierScope::TierScope(const EmbeddingTable* table, ForLookup)
    : table_(const_cast<EmbeddingTable*>(table)),
      moves_rows_(table->tier_ != nullptr && !table->tier_->config.concurrent_lookups),
      lookup_(true) {
  if (moves_rows_) outermost_ = table_->tier_->open_scopes++ == 0;
}

Status EmbeddingTable::TierScope::Prepare(const int64_t* keys, int64_t n, bool insert) {
  if (!moves_rows_) return Status::Ok();
  Status s = table_->PrepareRows(keys, n, insert);
  prepared_ = prepared_ || s.ok();
  return s;
}

EmbeddingTable::TierScope::~TierScope() {
  if (!moves_rows_) return;
  --table_->tier_->open_scopes;
  if (!outermost_ || table_->pending_push_ != nullptr) return;
  try {
    table_->ReportMemory();
    // A lookup that brought no rows in (none on disk, or it read them
    // through) grew nothing: the count is all it changes. Merges wait for an
    // operation that moves rows.
    if (lookup_ && !prepared_) return;
    table_->ShrinkToBudget();
    table_->RunMaintenance();
  } catch (const std::bad_alloc&) {
    // Out of memory while giving memory back (CompactRows): the count stays
    // exact, and the next operation settles again.
    table_->ReportMemory();
  }
}

void EmbeddingTable::RunMaintenance() {
  if (tier_ == nullptr || tier_->store == nullptr || pending_push_ != nullptr) return;
  ++tier_->settles_since_idle;
  if (tier_->maintenance_credit <= 0) return;
  const RowStoreStats disk = tier_->store->Stats();
  // Runs piling up cost reads (each newer run's filter lets ~0.5% of lookups
  // through: 1.85 reads per missed row at ~35+ runs): past kBehindRuns the
  // merges catch up whatever the pace.
  // A server that calls IdleMaintenance runs the merges between its requests,
  // these too up to kIdleBehindRuns (the store's natural count of runs, sizes
  // that line up only now and then, is ~20-24: at kBehindRuns every operation
  // of a DLRM's tables ran merges, 10 MB a step, and none ran while idle).
  const bool idle_caller = tier_->settles_since_idle <= kIdleSettles;
  if (disk.segments > (idle_caller ? kIdleBehindRuns : kBehindRuns)) {
    tier_->maintenance_credit = std::max<int64_t>(tier_->maintenance_credit, 64 << 20);
  } else if (idle_caller) {
    return;
  }
  MaintenanceStep(tier_->maintenance_credit);
}

bool EmbeddingTable::IdleMaintenance(int64_t max_bytes) {
  if (tier_ == nullptr || tier_->store == nullptr || pending_push_ != nullptr) return false;
  tier_->settles_since_idle = 0;
  if (max_bytes <= 0) return false;
  if (tier_->maintenance_credit <= 0) {
    // Idle time costs the requests nothing: past kBehindRuns the merges catch up
    // here whatever the writes have earned.
    if (tier_->store->Stats().segments <= kBehindRuns) return false;
    tier_->maintenance_credit = max_bytes;
  }
  const int64_t moved = MaintenanceStep(std::min(max_bytes, tier_->maintenance_credit));
  tier_->stats.idle_bytes_moved += moved;
  return moved > 0;
}

int64_t EmbeddingTable::MaintenanceStep(int64_t max_bytes) {
  // A merge step stages a fragment of records: it runs in room the budget
  // has, made by moving rows out if need be, so that the budget holds while
  // it runs too.
  const int64_t needed = tier_->store->Stats().maintenance_bytes;
  const int64_t room =
      tier_->config.budget->limit() - tier_->config.budget->UsedByOthers(this) - TierBytes();
  if (room < needed && ReleaseMemory(needed - room) < needed - room) return 0;
  int64_t moved = 0;
  Status s = tier_->store->Maintenance(max_bytes, &moved);
  // Nothing to merge (moved 0) or a failed step (a full disk: tried again
  // after the next write) ends the credit.
  tier_->maintenance_credit = s.ok() && moved > 0 ? tier_->maintenance_credit - moved : 0;
  ReportMemory();
  return s.ok() ? moved : 0;
}

int64_t EmbeddingTable::TierBatchRows() const {
  if (tier_ == nullptr) return INT64_MAX;
  const int64_t per_row = BytesPerRow() + 2 * RowStateFloats() * 4;
  return std::max<int64_t>(1, tier_->config.budget->limit() / 4 / per_row);
}

Status EmbeddingTable::PrepareRows(const int64_t* keys, int64_t n, bool insert) {
  if (tier_ == nullptr || n <= 0) return Status::Ok();
  try {
    std::vector<int64_t> unique(keys, keys + n);
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    const int64_t u = static_cast<int64_t>(unique.size());
    std::vector<int64_t> rows(static_cast<size_t>(u));
    index_.FindRows(unique.data(), u, rows.data());
    std::vector<int64_t> absent;
    for (int64_t i = 0; i < u; ++i) {
      if (rows[i] < 0) absent.push_back(unique[i]);
    }
    const int64_t resident = u - static_cast<int64_t>(absent.size());
    // The ids the disk may hold (its filters, no I/O); the others are new.
    std::vector<int64_t> maybe_on_disk;
    if (tier_->store != nullptr && tier_->disk_rows > 0 && !absent.empty()) {
      std::vector<uint8_t> maybe(absent.size());
      Status s = tier_->store->MayContain(absent.data(), static_cast<int64_t>(absent.size()),
                                          maybe.data());
      if (!s.ok()) return s;
      for (size_t i = 0; i < absent.size(); ++i) {
        if (maybe[i]) maybe_on_disk.push_back(absent[i]);
      }
    }
    const int64_t m = static_cast<int64_t>(maybe_on_disk.size());
    const int64_t fresh = static_cast<int64_t>(absent.size()) - m;
    const int64_t incoming = m + (insert ? fresh : 0);
    if (incoming > 0) {
      Status s = MakeRoom(incoming, unique, resident, insert ? fresh : 0);
      if (!s.ok()) return s;
    }
    int64_t d = 0;
    if (m > 0) {
      // Room in the index and the row arrays first: once the store gave the
      // rows up, nothing may fail before they are in memory.
      Status s = index_.Reserve(index_.size() + m);
      if (!s.ok()) return s;
      const int64_t new_rows = m - static_cast<int64_t>(free_rows_.size());
      if (new_rows > 0) EnsureRowsUpTo(next_row_ + new_rows - 1);
      // One batch of reads, then the rows in memory with their exact state.
      std::vector<uint8_t> records(static_cast<size_t>(m * tier_->record_bytes));
      std::vector<uint8_t> found(static_cast<size_t>(m));
      s = tier_->store->Take(maybe_on_disk.data(), m, records.data(), found.data());
      if (!s.ok()) return s;
      for (int64_t i = 0; i < m; ++i) {
        if (!found[i]) continue;
        const int64_t row = InsertReservedRow(maybe_on_disk[i], /*init_slots=*/false);
        DecodeRow(records.data() + i * tier_->record_bytes, row);
        ++d;
      }
      tier_->disk_rows -= d;
      tier_->stats.rows_read += d;
    }
    tier_->stats.row_lookups += resident + d;
    tier_->stats.disk_hits += d;
    if (!insert && tier_->store != nullptr) {
      // Spared while a read's rows take at most a quarter of the budget (a
      // larger one would leave eviction too little to choose from).
      tier_->recent_reads[1].swap(tier_->recent_reads[0]);
      if (u * BytesPerRow() <= tier_->config.budget->limit() / 4) {
        tier_->recent_reads[0].swap(unique);
      } else {
        tier_->recent_reads[0].clear();
      }
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory bringing rows back from disk");
  }
  return Status::Ok();
}

Status EmbeddingTable::ReadDiskRows(const int64_t* keys, int64_t n, std::vector<int64_t>* which,
                                    std::vector<uint8_t>* records) const {
  which->clear();
  if (tier_ == nullptr || tier_->store == nullptr || tier_->disk_rows == 0) return Status::Ok();
  std::vector<int64_t> rows(static_cast<size_t>(n));
  index_.FindRows(keys, n, rows.data());
  std::vector<int64_t> absent_keys;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) {
      which->push_back(i);
      absent_keys.push_back(keys[i]);
    }
  }
  if (which->empty()) return Status::Ok();
  const int64_t m = static_cast<int64_t>(which->size());
  std::vector<uint8_t> found(static_cast<size_t>(m));
  records->resize(static_cast<size_t>(m * tier_->record_bytes));
  Status s = tier_->store->ReadBatch(absent_keys.data(), m, records->data(), found.data());
  if (!s.ok()) return s;
  // Keep only those found: which[j] and record j.
  int64_t kept = 0;
  for (int64_t j = 0; j < m; ++j) {
    if (!found[j]) continue;
    if (kept != j) {
      (*which)[kept] = (*which)[j];
      std::memcpy(records->data() + kept * tier_->record_bytes,
                  records->data() + j * tier_->record_bytes,
                  static_cast<size_t>(tier_->record_bytes));
    }
    ++kept;
  }
  which->resize(static_cast<size_t>(kept));
  return Status::Ok();
}

Status EmbeddingTable::LookupDisk(const int64_t* keys, int64_t n, float* out) const {
  if (tier_ == nullptr) return Status::Ok();
  std::vector<int64_t> which;
  std::vector<uint8_t> records;
  int64_t stored_in_memory = 0;
  if (tier_->store != nullptr && tier_->disk_rows > 0) {
    Status s = ReadDiskRows(keys, n, &which, &records);
    if (!s.ok()) return s;
    const int64_t dim = config_.dim;
    for (size_t j = 0; j < which.size(); ++j) {
      std::memcpy(out + which[j] * dim, records.data() + j * tier_->record_bytes,
                  sizeof(float) * static_cast<size_t>(dim));
    }
  }
  std::vector<int64_t> rows(static_cast<size_t>(n));
  index_.FindRows(keys, n, rows.data());
  for (int64_t i = 0; i < n; ++i) stored_in_memory += rows[i] >= 0;
  tier_->lookup_rows += stored_in_memory + static_cast<int64_t>(which.size());
  tier_->lookup_hits += static_cast<int64_t>(which.size());
  return Status::Ok();
}

Status EmbeddingTable::ReadStateFromDisk(const int64_t* keys, int64_t n, float* values,
                                         float* slots, int64_t* steps, int64_t* touches,
                                         int64_t* last_steps) const {
  std::vector<int64_t> which;
  std::vector<uint8_t> records;
  Status s = ReadDiskRows(keys, n, &which, &records);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * num_slots();
  for (size_t j = 0; j < which.size(); ++j) {
    const int64_t i = which[j];
    const uint8_t* record = records.data() + j * tier_->record_bytes;
    if (values != nullptr) {
      std::memcpy(values + i * dim, record, sizeof(float) * dim);
      if (slot_floats > 0) {
        std::memcpy(slots + i * slot_floats, record + 4 * dim, sizeof(float) * slot_floats);
      }
    }
    uint32_t meta[4];
    std::memcpy(meta, record + 4 * dim * (1 + num_slots()), sizeof(meta));
    if (steps != nullptr) steps[i] = meta[0];
    if (touches != nullptr) {
      touches[i] = policy_.TracksTouches() ? meta[2] : 0;
      last_steps[i] = policy_.TracksLastStep() ? meta[3] : 0;
    }
  }
  return Status::Ok();
}

Status EmbeddingTable::scan_status() const {
  return tier_ == nullptr ? Status::Ok() : tier_->scan_error;
}

int64_t EmbeddingTable::DiskRowCount() const { return tier_ == nullptr ? 0 : tier_->disk_rows; }

int64_t EmbeddingTable::RemoveFromDisk(const int64_t* keys, int64_t n) {
  if (tier_ == nullptr || tier_->store == nullptr || tier_->disk_rows == 0) return 0;
  std::vector<int64_t> unique(keys, keys + n);
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  const int64_t u = static_cast<int64_t>(unique.size());
  std::vector<uint8_t> found(static_cast<size_t>(u));
  // Read to find them (the store's index has no exact membership); in
  // pieces, so that the records read stay a small buffer.
  const int64_t piece = std::max<int64_t>(1, (4 << 20) / tier_->record_bytes);
  std::vector<uint8_t> records(static_cast<size_t>(std::min(u, piece) * tier_->record_bytes));
  if (change_epoch_ > 1) removed_.reserve(removed_.size() + unique.size());
  int64_t gone = 0;
  for (int64_t begin = 0; begin < u; begin += piece) {
    const int64_t m = std::min(piece, u - begin);
    if (!tier_->store->Take(unique.data() + begin, m, records.data(), found.data() + begin).ok()) {
      break;
    }
    for (int64_t i = begin; i < begin + m; ++i) {
      if (!found[i]) continue;
      if (change_epoch_ > 1) removed_.emplace_back(unique[i], change_epoch_);
      ++gone;
    }
  }
  tier_->disk_rows -= gone;
  return gone;
}

int64_t EmbeddingTable::NextDiskRows(int64_t* cursor, int64_t max_rows, bool changed_only,
                                     uint32_t since, int64_t* keys_out, float* values,
                                     float* slots, int64_t* steps) const {
  // Memory slots come first (cursor >= 0); the disk scan's cursor is stored
  // as -(its position) - 2, and -1 is the end.
  if (tier_ == nullptr || tier_->store == nullptr || *cursor == -1) {
    *cursor = -1;
    return 0;
  }
  if (*cursor >= 0) tier_->scan_error = Status::Ok();  // a scan's disk part starts
  uint64_t position = *cursor >= 0 ? 0 : static_cast<uint64_t>(-(*cursor + 2));
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * num_slots();
  const int64_t record_bytes = tier_->record_bytes;
  std::vector<int64_t> keys(static_cast<size_t>(std::min(max_rows, kScanBatch)));
  std::vector<uint8_t> records(keys.size() * static_cast<size_t>(record_bytes));
  int64_t count = 0;
  while (count < max_rows) {
    const int64_t want = std::min<int64_t>(max_rows - count, static_cast<int64_t>(keys.size()));
    uint64_t next = position;
    int64_t got = 0;
    Status s = tier_->store->Scan(&next, want, keys.data(), records.data(), &got);
    if (!s.ok() || got == 0) {
      if (!s.ok()) tier_->scan_error = s;
      *cursor = -1;
      return count;
    }
    position = next;
    for (int64_t j = 0; j < got; ++j) {
      const uint8_t* record = records.data() + j * record_bytes;
      uint32_t meta[4];
      std::memcpy(meta, record + 4 * dim * (1 + num_slots()), sizeof(meta));
      if (changed_only && meta[1] <= since) continue;
      keys_out[count] = keys[j];
      if (values != nullptr) {
        std::memcpy(values + count * dim, record, sizeof(float) * dim);
        if (slot_floats > 0) {
          std::memcpy(slots + count * slot_floats, record + 4 * dim, sizeof(float) * slot_floats);
        }
        steps[count] = meta[0];
      }
      ++count;
    }
  }
  *cursor = -static_cast<int64_t>(position) - 2;
  return count;
}

Status EmbeddingTable::MigrateDiskRows(int old_slots, bool old_master) {
  // SetOptimizer on a table with rows on disk: every disk row gets the new
  // optimizer's initial slots and step 0 in a new store (the record size
  // follows the slots), as memory rows do.
  if (tier_ == nullptr || tier_->store == nullptr) return Status::Ok();
  std::unique_ptr<RowStore> old = std::move(tier_->store);
  const std::string old_directory = tier_->StoreDirectory();
  const int64_t old_record = tier_->record_bytes;
  ++tier_->generation;
  Status s = OpenTierStore();
  if (!s.ok()) {
    tier_->store = std::move(old);
    tier_->record_bytes = old_record;
    --tier_->generation;
    return s;
  }
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  std::vector<int64_t> keys(kScanBatch);
  std::vector<uint8_t> in(static_cast<size_t>(kScanBatch * old_record));
  std::vector<uint8_t> out(static_cast<size_t>(kScanBatch * tier_->record_bytes));
  uint64_t cursor = 0;
  int64_t moved = 0;
  while (true) {
    int64_t got = 0;
    s = old->Scan(&cursor, kScanBatch, keys.data(), in.data(), &got);
    if (!s.ok() || got == 0) break;
    for (int64_t j = 0; j < got; ++j) {
      const uint8_t* from = in.data() + j * old_record;
      uint8_t* to = out.data() + j * tier_->record_bytes;
      float* values = reinterpret_cast<float*>(to);
      std::memcpy(values, from, sizeof(float) * dim);
      if (slot_floats > 0) optimizer_.InitSlots(values + dim, dim);
      if (has_master()) {
        const float* master = old_master ? reinterpret_cast<const float*>(from) + dim * (1 + old_slots)
                                         : reinterpret_cast<const float*>(from);
        std::memcpy(values + dim + slot_floats, master, sizeof(float) * dim);
      }
      uint32_t meta[4];
      std::memcpy(meta, from + 4 * dim * (1 + old_slots + (old_master ? 1 : 0)), sizeof(meta));
      meta[0] = 0;              // step
      meta[1] = change_epoch_;  // a changed row
      meta[3] = 0;              // ages restart with the table step
      std::memcpy(to + 4 * dim * (1 + num_slots()), meta, sizeof(meta));
    }
    s = tier_->store->WriteBatch(keys.data(), got, out.data());
    if (!s.ok()) break;
    moved += got;
  }
  old->Close();
  old.reset();
  std::error_code error;
  std::filesystem::remove_all(old_directory, error);
  if (!s.ok()) {
    // The rows not moved are lost with the old store: say so loudly.
    tier_->disk_rows = moved;
    return Status(s.code(), "changing the optimizer of a table with rows on disk failed after " +
                                std::to_string(moved) + " rows: " + s.message());
  }
  return Status::Ok();
}

}  // namespace kvsparse
