// EmbeddingTable: admission and eviction, through its AdmissionPolicy
// (admission_policy.h).
#include "table.h"

#include <cstdint>
#include <new>
#include <vector>

#include "table_internal.h"
#include "table_tier.h"

namespace kvsparse {

using table_internal::KeyText;

void EmbeddingTable::PlanAdmission(PushPlan* plan) const {
  policy_.Decide(plan->unique, plan->rows, plan->skip, index_, next_row_, table_step_, plan);
}

int64_t EmbeddingTable::EvictExpired() {
  if (config_.policy.ttl_steps <= 0) return 0;
  TierScope scope(this);
  std::vector<int64_t> expired;
  policy_.ExpiredKeys(index_, table_step_, &expired);
  // Rows first (Remove may throw std::bad_alloc, then changing nothing);
  // erasing candidates allocates nothing.
  const int64_t removed = Remove(expired.data(), static_cast<int64_t>(expired.size()));
  policy_.DropExpiredCandidates(table_step_);
  policy_.stats().evicted_ttl += removed;
  return removed;
}

void EmbeddingTable::MaybeEvictAutomatically() {
  const PolicyConfig& policy = config_.policy;
  if (policy.ttl_steps > 0 && policy.evict_every > 0 && table_step_ % policy.evict_every == 0) {
    // Runs after a push or step that already happened: out of memory here
    // must not fail it. The expired rows stay until the next automatic or
    // requested eviction.
    try {
      EvictExpired();
    } catch (const std::bad_alloc&) {
    }
  }
}

void EmbeddingTable::AdvanceStep() {
  ++table_step_;
  MaybeEvictAutomatically();
}

PolicyStats EmbeddingTable::policy_stats() const { return policy_.Stats(); }

int64_t EmbeddingTable::CandidateCount() const { return policy_.CandidateCount(); }

int64_t EmbeddingTable::ReadCandidates(int64_t* keys, int64_t* counts, int64_t* last_steps,
                                       int64_t capacity) const {
  return policy_.ReadCandidates(keys, counts, last_steps, capacity);
}

Status EmbeddingTable::WriteCandidates(const int64_t* keys, const int64_t* counts,
                                       const int64_t* last_steps, int64_t n) {
  // The scope reports the candidates' memory to the budget when the call ends
  // (a restore writes them all at once; the next operation was too late).
  TierScope scope(this);
  return policy_.WriteCandidates(index_, keys, counts, last_steps, n);
}

void EmbeddingTable::ClearCandidates() {
  TierScope scope(this);
  policy_.ClearCandidates();
}

Status EmbeddingTable::ReadRowMeta(const int64_t* keys, int64_t n, int64_t* touches,
                                   int64_t* last_steps) const {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  index_.FindRows(keys, n, rows.data());
  std::vector<int64_t> steps;
  if (tier_ != nullptr) {
    // Rows on disk: their counters from their records (step -1: stored nowhere).
    steps.assign(static_cast<size_t>(n), -1);
    Status s = ReadStateFromDisk(keys, n, nullptr, nullptr, steps.data(), touches, last_steps);
    if (!s.ok()) return s;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) {
      if (!steps.empty() && steps[i] >= 0) continue;
      return Status(StatusCode::kInvalidArgument, "id " + KeyText(keys[i]) + " is not stored");
    }
    policy_.ReadRow(rows[i], touches + i, last_steps + i);
  }
  return Status::Ok();
}

Status EmbeddingTable::WriteRowMeta(const int64_t* keys, int64_t n, const int64_t* touches,
                                    const int64_t* last_steps) {
  TierScope scope(this);
  Status prepared = scope.Prepare(keys, n, /*insert=*/false);
  if (!prepared.ok()) return prepared;
  std::vector<int64_t> rows(static_cast<size_t>(n));
  index_.FindRows(keys, n, rows.data());
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) {
      return Status(StatusCode::kInvalidArgument, "id " + KeyText(keys[i]) + " is not stored");
    }
    if (touches[i] < 0 || touches[i] > static_cast<int64_t>(UINT32_MAX) || last_steps[i] < 0 ||
        last_steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument,
                    "touch count or last step of id " + KeyText(keys[i]) + " is out of range");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    policy_.WriteRow(rows[i], static_cast<uint32_t>(touches[i]),
                     static_cast<uint32_t>(last_steps[i]));
  }
  return Status::Ok();
}

}  // namespace kvsparse
