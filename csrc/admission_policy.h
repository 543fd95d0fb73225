// Admission and eviction for EmbeddingTable: which new ids a push stores, which
// rows make room, which rows expire. AdmissionPolicy owns the policy's state:
// the candidates map (ids seen fewer than min_count times), the per-row touch
// counts (LFU) and last steps (TTL, LRU), the choice of victims, and the counts
// of what it did. It owns no row and no key: the table passes its KeyIndex in
// where the policy must see the stored keys, and removes the rows the policy
// names.
//
//   kvsparse::AdmissionPolicy policy;
//   policy.Configure(config.policy, rows_per_chunk_log2);
//   policy.Decide(unique, rows, skip, index, row_count, table_step, &decision);
//   // ... the table inserts decision.fresh, removes decision.victims ...
//   policy.CountCandidates(unique.data(), decision, push_step);
//
// Not thread-safe: const members may run on several threads at once, and
// TouchRow / SaveRow / RestoreRow on distinct rows too (a push updates its rows
// in parallel); anything else runs alone.
#ifndef KVSPARSE_ADMISSION_POLICY_H_
#define KVSPARSE_ADMISSION_POLICY_H_

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "chunked_rows.h"
#include "key_index.h"
#include "memory.h"
#include "status.h"

namespace kvsparse {

// Semantics (mirrored by tests/reference.py's ReferencePolicyTable):
// - "Seen": an id is seen once per push (ApplyGradients) that contains it,
//   after in-batch dedup; ids whose gradient is skipped as non-finite are not
//   seen. Lookups never insert and never count, nor touch a row.
// - min_count = k: an id not stored yet is a candidate; an exact side map
//   holds its sighting count (and last step). At its k-th sighting it is
//   admitted: inserted with its initial value and that push's gradient is
//   applied. Before that, pulls return its initial value and its gradients
//   are dropped. Candidate memory: about 40-60 bytes each (node + buckets of a
//   std::unordered_map; MemoryBytes counts that estimate); the map is bounded
//   only by TTL (candidates unseen for ttl_steps are dropped with the rows).
// - A "step" is the table's push counter table_step(): every push of the
//   table bumps it, on every shard (a shard that got none of the push's ids
//   bumps it through AdvanceStep), so steps agree across shards.
// - ttl_steps = t: a row last touched (updated by a push) at step L is
//   expired at step S when S - L >= t; EvictExpired() drops expired rows and
//   candidates. It runs on request (kv.evict()) and automatically at the end
//   of the push (or AdvanceStep) whose table_step is a multiple of
//   evict_every (0: never automatically).
// - max_rows = m is the capacity of ONE shard's table (a table over s servers
//   holds up to s * m rows). When the ids a push admits would make the table
//   exceed m, rows are evicted first, picked among rows that this push does
//   not touch: kLfu evicts the fewest touches (pushes that updated the row
//   since it was inserted), kLru the oldest last-touched step; ties go to the
//   lower key. If even evicting every untouched row leaves too little room,
//   the push admits its new ids in ascending key order up to the capacity and
//   drops the rest (counted as rejected; they keep no candidate count).
//   Rows written by Assign/LookupOrInsert/WriteState bypass admission and
//   capacity (they may exceed m until a later push evicts).
// - An evicted row loses its slot, optimizer slots and step: if its id comes
//   back it restarts from its initial value (and, with min_count > 1, must be
//   seen k times again). Eviction goes through Remove, so incremental
//   checkpoints record it.
// - Per-row metadata costs memory only when a policy needs it: 4 bytes/row of
//   touch count when max_rows with kLfu, 4 bytes/row of last step when
//   ttl_steps or max_rows with kLru. The last step is stored in 32 bits and
//   compared as a signed 32-bit difference, exact while ages stay < 2^31.
// - SetOptimizer resets table_step to 0; every row's and candidate's last
//   step is reset to 0 with it (ages restart).
enum class EvictionKind : int { kLfu = 0, kLru = 1 };

struct PolicyConfig {
  int64_t min_count = 1;     // sightings before an id is stored, >= 1
  int64_t ttl_steps = 0;     // 0: rows never expire
  int64_t max_rows = 0;      // per-shard capacity; 0: unbounded
  EvictionKind eviction = EvictionKind::kLfu;
  int64_t evict_every = 0;   // automatic EvictExpired every N table steps; 0: never
};

struct PolicyStats {
  int64_t admissions = 0;        // ids inserted by pushes
  int64_t evicted_ttl = 0;       // rows dropped as expired
  int64_t evicted_capacity = 0;  // rows dropped to make room (max_rows)
  int64_t rejected = 0;          // ids a full table could not admit
  int64_t candidates = 0;        // ids seen but not admitted yet (now)
};

Status ValidatePolicy(const PolicyConfig& policy);

// What a push's admission decided, as indices j into the push's distinct ids.
struct AdmissionDecision {
  struct Candidate {
    uint32_t count;
    uint32_t last_step;
  };
  std::vector<int64_t> fresh;                  // ids to insert
  std::vector<int64_t> counted;                // candidates counted, not admitted yet
  std::vector<Candidate> counted_before;       // their count and step before this push
  std::vector<int64_t> rejected;               // ids a full table could not admit
  std::vector<int64_t> victims;                // keys (not indices) evicted for room
};

class AdmissionPolicy {
 public:
  using Candidate = AdmissionDecision::Candidate;

  // Sets the policy (validated by ValidatePolicy) and the chunking of its per-row
  // arrays; drops every candidate and count.
  void Configure(const PolicyConfig& policy, int64_t rows_per_chunk_log2);
  const PolicyConfig& config() const { return config_; }

  // Which per-row counters the policy keeps (4 bytes a row each, when it does).
  bool TracksTouches() const { return tracks_touches_; }
  bool TracksLastStep() const { return tracks_last_step_; }
  // Backs rows [0, row] of the kept counters. Throws std::bad_alloc, then
  // changing nothing.
  void EnsureRow(int64_t row) {
    if (tracks_touches_) touches_.EnsureRow(row);
    if (tracks_last_step_) last_step_.EnsureRow(row);
  }
  int64_t GrowthBytes(int64_t row) const {
    return touches_.GrowthBytes(row) + last_step_.GrowthBytes(row);
  }
  void TruncateRows(int64_t rows) {
    touches_.TruncateRows(rows);
    last_step_.TruncateRows(rows);
  }
  // Per-row bytes of the kept counters.
  int64_t RowBytes() const { return 4 * (tracks_touches_ + tracks_last_step_); }
  // Backs rows [begin, end) with memory now (ChunkedRows::Populate).
  bool Populate(int64_t begin, int64_t end) {
    return touches_.Populate(begin, end) && last_step_.Populate(begin, end);
  }
  // Bytes of the counters and the candidates map (an estimate of its nodes).
  int64_t Bytes() const;

  // A row just inserted at table step `step`: no touches yet, last step `step`.
  void InitRow(int64_t row, int64_t step) {
    if (tracks_touches_) *touches_.Row(row) = 0;
    if (tracks_last_step_) *last_step_.Row(row) = static_cast<uint32_t>(step);
  }
  // A row updated by a push at table step `step`.
  void TouchRow(int64_t row, int64_t step) {
    if (tracks_touches_) {
      uint32_t* touches = touches_.Row(row);
      if (*touches < UINT32_MAX) *touches += 1;
    }
    if (tracks_last_step_) *last_step_.Row(row) = static_cast<uint32_t>(step);
  }
  void PrefetchRow(int64_t row) const {
    if (tracks_touches_) PrefetchLine(touches_.Row(row));
    if (tracks_last_step_) PrefetchLine(last_step_.Row(row));
  }
  // saved[0] = touches, saved[1] = last step (0 where not kept), and back.
  void SaveRow(int64_t row, uint32_t* saved) const {
    saved[0] = tracks_touches_ ? *touches_.Row(row) : 0;
    saved[1] = tracks_last_step_ ? *last_step_.Row(row) : 0;
  }
  void RestoreRow(int64_t row, const uint32_t* saved) {
    if (tracks_touches_) *touches_.Row(row) = saved[0];
    if (tracks_last_step_) *last_step_.Row(row) = saved[1];
  }
  // Checkpoints: the row's counters (0 where not kept); Write ignores those not kept.
  void ReadRow(int64_t row, int64_t* touches, int64_t* last_step) const {
    *touches = tracks_touches_ ? static_cast<int64_t>(*touches_.Row(row)) : 0;
    *last_step = tracks_last_step_ ? static_cast<int64_t>(*last_step_.Row(row)) : 0;
  }
  void WriteRow(int64_t row, uint32_t touches, uint32_t last_step) {
    if (tracks_touches_) *touches_.Row(row) = touches;
    if (tracks_last_step_) *last_step_.Row(row) = last_step;
  }
  // The table step restarts at 0 (SetOptimizer): every age restarts with it.
  void ResetSteps(const KeyIndex& index);

  // Decides a push's admission: unique are its distinct ids, rows their rows
  // (-1: not stored), skip the ids left alone; row_count is the rows ever
  // allocated (row slots are below it). Changes nothing; may throw std::bad_alloc.
  void Decide(const std::vector<int64_t>& unique, const std::vector<int64_t>& rows,
              const std::vector<uint8_t>& skip, const KeyIndex& index, int64_t row_count,
              int64_t table_step, AdmissionDecision* decision) const;
  // Commits a decision's candidate counts at push_step: counted ids gain a
  // sighting, admitted and rejected ones are forgotten. On std::bad_alloc, puts
  // back what it changed and rethrows.
  void CountCandidates(const int64_t* unique, const AdmissionDecision& decision,
                       uint32_t push_step);
  // Stored keys not touched for ttl_steps at table step `step` (none without a TTL).
  void ExpiredKeys(const KeyIndex& index, int64_t step, std::vector<int64_t>* keys) const;
  // Drops the candidates not seen for ttl_steps. Allocates nothing.
  void DropExpiredCandidates(int64_t step);

  PolicyStats& stats() { return stats_; }
  // The counts, with the number of candidates now.
  PolicyStats Stats() const;

  // Candidates for checkpoints (EmbeddingTable::ReadCandidates and kin).
  int64_t CandidateCount() const { return static_cast<int64_t>(candidates_.size()); }
  int64_t ReadCandidates(int64_t* keys, int64_t* counts, int64_t* last_steps,
                         int64_t capacity) const;
  // Ids the index stores are skipped; counts must be in [1, 2^32), steps in
  // [0, 2^32): else nothing is written.
  Status WriteCandidates(const KeyIndex& index, const int64_t* keys, const int64_t* counts,
                         const int64_t* last_steps, int64_t n);
  void ClearCandidates() { candidates_.clear(); }

 private:
  // Steps from `last` to `step` (signed 32-bit difference; negative after a step reset).
  static int64_t Age(int64_t step, uint32_t last) {
    return static_cast<int32_t>(static_cast<uint32_t>(step) - last);
  }
  void SelectVictims(int64_t count, const std::vector<uint8_t>& keep_row, const KeyIndex& index,
                     int64_t table_step, std::vector<int64_t>* victims) const;

  PolicyConfig config_;
  bool tracks_touches_ = false;    // max_rows with kLfu
  bool tracks_last_step_ = false;  // ttl_steps, or max_rows with kLru
  ChunkedRows<uint32_t> touches_;
  ChunkedRows<uint32_t> last_step_;
  std::unordered_map<int64_t, Candidate> candidates_;
  PolicyStats stats_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_ADMISSION_POLICY_H_
