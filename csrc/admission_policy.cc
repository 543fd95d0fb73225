#include "admission_policy.h"

#include <algorithm>
#include <iterator>
#include <new>
#include <string>
#include <utility>

namespace kvsparse {

Status ValidatePolicy(const PolicyConfig& policy) {
  if (policy.min_count < 1 || policy.min_count > static_cast<int64_t>(UINT32_MAX)) {
    return Status(StatusCode::kInvalidArgument,
                  "min_count must be in [1, 4294967295], got " + std::to_string(policy.min_count));
  }
  // Ages are signed 32-bit differences of steps.
  if (policy.ttl_steps < 0 || policy.ttl_steps > INT32_MAX) {
    return Status(StatusCode::kInvalidArgument,
                  "ttl_steps must be in [1, 2147483647] (0: none), got " +
                      std::to_string(policy.ttl_steps));
  }
  if (policy.max_rows < 0 || policy.max_rows >= static_cast<int64_t>(UINT32_MAX)) {
    return Status(StatusCode::kInvalidArgument,
                  "max_rows must be positive (0: unbounded), got " +
                      std::to_string(policy.max_rows));
  }
  if (policy.evict_every < 0) {
    return Status(StatusCode::kInvalidArgument,
                  "evict_every must be >= 0, got " + std::to_string(policy.evict_every));
  }
  if (policy.eviction != EvictionKind::kLfu && policy.eviction != EvictionKind::kLru) {
    return Status(StatusCode::kInvalidArgument, "eviction must be LFU or LRU");
  }
  return Status::Ok();
}

void AdmissionPolicy::Configure(const PolicyConfig& policy, int64_t rows_per_chunk_log2) {
  config_ = policy;
  tracks_touches_ = policy.max_rows > 0 && policy.eviction == EvictionKind::kLfu;
  tracks_last_step_ =
      policy.ttl_steps > 0 || (policy.max_rows > 0 && policy.eviction == EvictionKind::kLru);
  touches_.Reset(tracks_touches_ ? 1 : 0, rows_per_chunk_log2);
  last_step_.Reset(tracks_last_step_ ? 1 : 0, rows_per_chunk_log2);
  candidates_.clear();
  stats_ = PolicyStats();
}

int64_t AdmissionPolicy::Bytes() const {
  // libstdc++: a bucket pointer each, plus a heap node (next pointer, key,
  // value) of 24 bytes that malloc rounds to 32.
  const int64_t candidate_bytes = static_cast<int64_t>(
      candidates_.bucket_count() * sizeof(void*) + candidates_.size() * 32);
  return touches_.Bytes() + last_step_.Bytes() + candidate_bytes;
}

void AdmissionPolicy::ResetSteps(const KeyIndex& index) {
  if (tracks_last_step_) {
    index.ForEach([&](int64_t, uint32_t row) { *last_step_.Row(row) = 0; });
  }
  for (auto& entry : candidates_) entry.second.last_step = 0;
}

void AdmissionPolicy::Decide(const std::vector<int64_t>& unique, const std::vector<int64_t>& rows,
                             const std::vector<uint8_t>& skip, const KeyIndex& index,
                             int64_t row_count, int64_t table_step,
                             AdmissionDecision* decision) const {
  AdmissionDecision& d = *decision;
  const int64_t u = static_cast<int64_t>(unique.size());
  const int64_t size = index.size();
  d.fresh.clear();
  d.counted.clear();
  d.counted_before.clear();
  d.rejected.clear();
  d.victims.clear();
  for (int64_t j = 0; j < u; ++j) {
    if (rows[j] >= 0 || skip[j]) continue;
    if (config_.min_count > 1) {
      const auto it = candidates_.find(unique[j]);
      const Candidate before = it == candidates_.end() ? Candidate{0, 0} : it->second;
      const uint32_t count = before.count < UINT32_MAX ? before.count + 1 : before.count;
      if (static_cast<int64_t>(count) < config_.min_count) {
        d.counted.push_back(j);
        d.counted_before.push_back(before);
        continue;
      }
    }
    d.fresh.push_back(j);
  }
  const int64_t new_rows = static_cast<int64_t>(d.fresh.size());
  if (config_.max_rows > 0 && size + new_rows > config_.max_rows) {
    // Rows of this push's ids are never evicted by it.
    std::vector<uint8_t> keep_row(static_cast<size_t>(row_count), 0);
    int64_t kept = 0;
    for (int64_t j = 0; j < u; ++j) {
      if (rows[j] >= 0) {
        keep_row[rows[j]] = 1;
        ++kept;
      }
    }
    const int64_t need = size + new_rows - config_.max_rows;
    SelectVictims(std::min(need, size - kept), keep_row, index, table_step, &d.victims);
    const int64_t room =
        std::max<int64_t>(0, config_.max_rows - size + static_cast<int64_t>(d.victims.size()));
    if (new_rows > room) {
      // Deterministic: the lowest keys get the room that is left.
      const int64_t* ids = unique.data();
      std::sort(d.fresh.begin(), d.fresh.end(),
                [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      d.rejected.assign(d.fresh.begin() + room, d.fresh.end());
      d.fresh.resize(static_cast<size_t>(room));
    }
  }
}

void AdmissionPolicy::SelectVictims(int64_t count, const std::vector<uint8_t>& keep_row,
                                    const KeyIndex& index, int64_t table_step,
                                    std::vector<int64_t>* victims) const {
  victims->clear();
  if (count <= 0) return;
  const bool lfu = config_.eviction == EvictionKind::kLfu;
  // (score, key): the `count` smallest pairs go. LFU: fewest touches; LRU:
  // largest age first, so the score is minus the age.
  std::vector<std::pair<int64_t, int64_t>> scored;
  scored.reserve(static_cast<size_t>(index.size()));
  index.ForEach([&](int64_t key, uint32_t row) {
    if (keep_row[row]) return;
    const int64_t score = lfu ? static_cast<int64_t>(*touches_.Row(row))
                              : -Age(table_step, *last_step_.Row(row));
    scored.emplace_back(score, key);
  });
  count = std::min<int64_t>(count, static_cast<int64_t>(scored.size()));
  if (count <= 0) return;
  if (count < static_cast<int64_t>(scored.size())) {
    std::nth_element(scored.begin(), scored.begin() + count, scored.end());
  }
  victims->resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) (*victims)[i] = scored[i].second;
}

void AdmissionPolicy::CountCandidates(const int64_t* unique, const AdmissionDecision& d,
                                      uint32_t push_step) {
  if (config_.min_count <= 1) return;  // no candidates are kept
  size_t done = 0;
  try {
    // The only step of a push's commit that allocates (a node per new candidate).
    for (; done < d.counted.size(); ++done) {
      const Candidate& before = d.counted_before[done];
      candidates_[unique[d.counted[done]]] =
          Candidate{before.count < UINT32_MAX ? before.count + 1 : before.count, push_step};
    }
  } catch (...) {
    for (size_t i = 0; i < done; ++i) {
      const auto it = candidates_.find(unique[d.counted[i]]);
      if (d.counted_before[i].count == 0) {
        candidates_.erase(it);
      } else {
        it->second = d.counted_before[i];
      }
    }
    throw;
  }
  // Admitted ids stop being candidates; rejected ones keep no count.
  for (const int64_t j : d.fresh) candidates_.erase(unique[j]);
  for (const int64_t j : d.rejected) candidates_.erase(unique[j]);
}

void AdmissionPolicy::ExpiredKeys(const KeyIndex& index, int64_t step,
                                  std::vector<int64_t>* keys) const {
  const int64_t ttl = config_.ttl_steps;
  if (ttl <= 0) return;
  index.ForEach([&](int64_t key, uint32_t row) {
    if (Age(step, *last_step_.Row(row)) >= ttl) keys->push_back(key);
  });
}

void AdmissionPolicy::DropExpiredCandidates(int64_t step) {
  const int64_t ttl = config_.ttl_steps;
  if (ttl <= 0) return;
  for (auto it = candidates_.begin(); it != candidates_.end();) {
    it = Age(step, it->second.last_step) >= ttl ? candidates_.erase(it) : std::next(it);
  }
}

PolicyStats AdmissionPolicy::Stats() const {
  PolicyStats stats = stats_;
  stats.candidates = static_cast<int64_t>(candidates_.size());
  return stats;
}

int64_t AdmissionPolicy::ReadCandidates(int64_t* keys, int64_t* counts, int64_t* last_steps,
                                        int64_t capacity) const {
  int64_t copied = 0;
  for (const auto& entry : candidates_) {
    if (copied >= capacity) break;
    keys[copied] = entry.first;
    counts[copied] = entry.second.count;
    last_steps[copied] = entry.second.last_step;
    ++copied;
  }
  return copied;
}

Status AdmissionPolicy::WriteCandidates(const KeyIndex& index, const int64_t* keys,
                                        const int64_t* counts, const int64_t* last_steps,
                                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (counts[i] < 1 || counts[i] > static_cast<int64_t>(UINT32_MAX) || last_steps[i] < 0 ||
        last_steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument, "candidate count or step of id " +
                                                      std::to_string(keys[i]) +
                                                      " is out of range");
    }
  }
  try {
    candidates_.reserve(candidates_.size() + static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (index.Find(keys[i]) >= 0) continue;
      candidates_[keys[i]] = Candidate{static_cast<uint32_t>(counts[i]),
                                       static_cast<uint32_t>(last_steps[i])};
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory restoring admission candidates");
  }
  return Status::Ok();
}

}  // namespace kvsparse
