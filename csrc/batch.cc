#include "batch.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "hash.h"

namespace kvsparse {

void UniqueWithInverse(const int64_t* keys, int64_t n, std::vector<int64_t>* unique,
                       int64_t* inverse) {
  unique->clear();
  if (n == 0) return;
  // Scratch open-addressing set sized to a load factor <= 0.5.
  uint64_t capacity = 16;
  while (capacity < static_cast<uint64_t>(n) * 2) capacity <<= 1;
  const uint64_t mask = capacity - 1;
  std::vector<int64_t> slot_index(capacity, -1);
  unique->reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = keys[i];
    uint64_t b = Mix64(static_cast<uint64_t>(key)) & mask;
    while (true) {
      const int64_t u = slot_index[b];
      if (u < 0) {
        slot_index[b] = static_cast<int64_t>(unique->size());
        inverse[i] = static_cast<int64_t>(unique->size());
        unique->push_back(key);
        break;
      }
      if ((*unique)[u] == key) {
        inverse[i] = u;
        break;
      }
      b = (b + 1) & mask;
    }
  }
}

void SumRowsByIndex(const float* rows, const int64_t* index, int64_t n, int64_t dim,
                    int64_t num_unique, float* out) {
  std::memset(out, 0, sizeof(float) * static_cast<size_t>(num_unique * dim));
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + index[i] * dim;
    const float* src = rows + i * dim;
    for (int64_t j = 0; j < dim; ++j) dst[j] += src[j];
  }
}

int64_t FirstNonFiniteRow(const float* rows, int64_t n, int64_t dim) {
  // A block of rows at a time in one vectorized pass; rows are looked at one
  // by one only in a block that has a bad value. (A per-row sum of x * 0 was
  // a chain of dependent adds: 3x slower than the memory, and it ran three
  // times per push, once on the worker and twice on the server.)
  constexpr int64_t kBlockFloats = 4096;
  const int64_t block_rows = std::max<int64_t>(1, kBlockFloats / std::max<int64_t>(dim, 1));
  for (int64_t i = 0; i < n; i += block_rows) {
    const int64_t rows_here = std::min(block_rows, n - i);
    if (AllFiniteFloats(rows + i * dim, rows_here * dim)) continue;
    for (int64_t k = i; k < i + rows_here; ++k) {
      if (!AllFiniteFloats(rows + k * dim, dim)) return k;
    }
  }
  return -1;
}

int64_t Partitioner::ShardOf(int64_t key) const {
  if (boundaries.empty()) return HashShardOf(key, num_shards);
  return static_cast<int64_t>(std::upper_bound(boundaries.begin(), boundaries.end(), key) -
                              boundaries.begin());
}

Status ValidatePartitioner(const Partitioner& p) {
  if (p.num_shards < 1) return Status(StatusCode::kInvalidArgument, "num_shards must be >= 1");
  if (!p.boundaries.empty()) {
    if (static_cast<int64_t>(p.boundaries.size()) != p.num_shards - 1) {
      return Status(StatusCode::kInvalidArgument,
                    "a range partitioner needs num_shards - 1 boundaries");
    }
    for (size_t i = 1; i < p.boundaries.size(); ++i) {
      if (p.boundaries[i - 1] >= p.boundaries[i]) {
        return Status(StatusCode::kInvalidArgument,
                      "range partitioner boundaries must be strictly ascending");
      }
    }
  }
  return Status::Ok();
}

void PlanBatch(const int64_t* ids, int64_t n, const Partitioner& partitioner, BatchPlan* plan) {
  const int64_t num_shards = partitioner.num_shards;
  std::vector<int64_t> unique;
  plan->slot.resize(static_cast<size_t>(n));
  UniqueWithInverse(ids, n, &unique, plan->slot.data());
  const int64_t u = static_cast<int64_t>(unique.size());
  plan->offsets.assign(static_cast<size_t>(num_shards + 1), 0);
  plan->keys.resize(static_cast<size_t>(u));
  if (num_shards == 1) {
    plan->keys.swap(unique);
    plan->offsets[1] = u;
    return;
  }
  // Counting sort of unique keys by shard; position[j] = new index of unique j.
  std::vector<int64_t> shard(static_cast<size_t>(u));
  for (int64_t j = 0; j < u; ++j) {
    shard[j] = partitioner.ShardOf(unique[j]);
    ++plan->offsets[shard[j] + 1];
  }
  for (int64_t s = 0; s < num_shards; ++s) plan->offsets[s + 1] += plan->offsets[s];
  std::vector<int64_t> cursor(plan->offsets.begin(), plan->offsets.end() - 1);
  std::vector<int64_t> position(static_cast<size_t>(u));
  for (int64_t j = 0; j < u; ++j) {
    const int64_t p = cursor[shard[j]]++;
    position[j] = p;
    plan->keys[p] = unique[j];
  }
  for (int64_t i = 0; i < n; ++i) plan->slot[i] = position[plan->slot[i]];
}

void GatherFromShards(const float* const* shard_rows, const int64_t* offsets,
                      int64_t num_shards, const int64_t* slot, int64_t n, int64_t dim,
                      float* out) {
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(dim);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = slot[i];
    // Shards are few (<= a few dozen): a short scan beats a binary search.
    int64_t s = 0;
    while (s + 1 < num_shards && k >= offsets[s + 1]) ++s;
    std::memcpy(out + i * dim, shard_rows[s] + (k - offsets[s]) * dim, row_bytes);
  }
}

}  // namespace kvsparse
