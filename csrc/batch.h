// Batch preparation shared by the client (group a batch by shard) and the
// table (sum duplicate gradients): unique ids with their inverse, sums of
// rows by that inverse, and the gather of reply rows into an output array.
//
//   std::vector<int64_t> unique;
//   std::vector<int64_t> inverse(n);
//   kvsparse::UniqueWithInverse(ids, n, &unique, inverse.data());
//   // ids[i] == unique[inverse[i]]
//
//   kvsparse::BatchPlan plan;
//   std::vector<int64_t> slot(n);
//   kvsparse::PlanBatch(ids, n, kvsparse::Partitioner::Hash(3), &plan, slot.data());
//   // plan.keys[plan.offsets[s] .. plan.offsets[s+1]) go to shard s;
//   // ids[i] == plan.keys[slot[i]].
#ifndef KVSPARSE_BATCH_H_
#define KVSPARSE_BATCH_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "status.h"

namespace kvsparse {

// Unique keys in order of first appearance; inverse[i] indexes unique.
void UniqueWithInverse(const int64_t* keys, int64_t n, std::vector<int64_t>* unique,
                       int64_t* inverse);

// out (num_unique * dim) = sum of rows i (n * dim) grouped by index[i] (a
// row no index names is zeros). Returns whether out may hold a NaN or inf:
// false proves it holds none (every input is finite and too small for any
// sum of n of them to overflow), so that the caller's check
//   if (SumRowsByIndex(...) && FirstNonFiniteRow(out, num_unique, dim) >= 0) ...
// costs nothing in the usual case: the inputs are checked as they are added.
bool SumRowsByIndex(const float* rows, const int64_t* index, int64_t n, int64_t dim,
                    int64_t num_unique, float* out);

// Index of the first non-finite element's row, or -1.
int64_t FirstNonFiniteRow(const float* rows, int64_t n, int64_t dim);

// Whether x[0..n) holds no NaN and no inf: a branch-free bit test the
// compiler vectorizes (an exponent of all ones, plus one, carries into the
// sign bit), so a gradient is checked at memory speed.
inline bool AllFiniteFloats(const float* x, int64_t n) {
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    any |= (bits & 0x7F800000u) + 0x00800000u;
  }
  return (any & 0x80000000u) == 0;
}

struct Partitioner {
  int64_t num_shards = 1;
  // Empty: hash partitioning. Otherwise num_shards - 1 ascending boundaries:
  // shard s holds keys in [boundaries[s-1], boundaries[s]).
  std::vector<int64_t> boundaries;

  static Partitioner Hash(int64_t num_shards) {
    Partitioner p;
    p.num_shards = num_shards;
    return p;
  }
  int64_t ShardOf(int64_t key) const;
};

Status ValidatePartitioner(const Partitioner& partitioner);

struct BatchPlan {
  std::vector<int64_t> keys;     // unique keys, grouped by shard
  std::vector<int64_t> offsets;  // num_shards + 1
};

// slot: the caller's n entries, set to each input position's index into
// plan->keys (written in place: the caller's array is the result).
void PlanBatch(const int64_t* ids, int64_t n, const Partitioner& partitioner, BatchPlan* plan,
               int64_t* slot);

// out[i] = rows of shard s at (slot[i] - offsets[s]), where s is the shard of
// slot[i]. shard_rows[s] points at (offsets[s+1] - offsets[s]) * dim floats.
// An out of kStreamOutBytes or more is written around the caches (it would not
// stay in them anyway; see batch.cc).
constexpr int64_t kStreamOutBytes = int64_t{4} << 20;
void GatherFromShards(const float* const* shard_rows, const int64_t* offsets,
                      int64_t num_shards, const int64_t* slot, int64_t n, int64_t dim,
                      float* out);

}  // namespace kvsparse

#endif  // KVSPARSE_BATCH_H_
