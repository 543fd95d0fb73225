#include "batch.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "hash.h"
#include "memory.h"

namespace kvsparse {

namespace {

// A slot of UniqueWithInverse's scratch set: the key beside its index, so a
// probe is one cache line (the index alone sent every probe on to the unique
// array: a second, dependent miss). A slot is empty unless its generation is
// the current call's, so the set is never cleared between calls.
struct UniqueSlot {
  int64_t key;
  uint32_t index;
  uint32_t generation;
};

struct UniqueScratch {
  std::vector<UniqueSlot> slots;
  uint32_t generation = 0;
};

}  // namespace

void UniqueWithInverse(const int64_t* keys, int64_t n, std::vector<int64_t>* unique,
                       int64_t* inverse) {
  unique->clear();
  if (n == 0) return;
  // Open addressing at a load factor <= 0.5, in a per-thread scratch kept
  // between calls (a W1 batch of 65,536 ids: 2 MB that no call allocates or
  // clears). A larger batch's set is its own, freed on return, so that one
  // huge batch does not pin its memory for the thread's life. Indices are
  // 32-bit: a batch holds fewer than 2^32 ids.
  constexpr uint64_t kKeptSlots = uint64_t{1} << 20;  // 16 MB
  thread_local UniqueScratch kept;
  UniqueScratch own;
  uint64_t capacity = 16;
  while (capacity < static_cast<uint64_t>(n) * 2) capacity <<= 1;
  UniqueScratch& scratch = capacity <= kKeptSlots ? kept : own;
  if (scratch.slots.size() < capacity) {
    scratch.slots.assign(capacity, UniqueSlot{0, 0, 0});
    scratch.generation = 0;
  }
  if (++scratch.generation == 0) {  // wrapped: stale slots could look current
    for (UniqueSlot& slot : scratch.slots) slot.generation = 0;
    scratch.generation = 1;
  }
  const uint32_t generation = scratch.generation;
  UniqueSlot* slots = scratch.slots.data();
  const uint64_t mask = capacity - 1;
  unique->reserve(static_cast<size_t>(n));
  // A pipeline: key i's home slot is hashed and prefetched kAhead keys before
  // it is probed, so the misses of different keys overlap.
  constexpr int64_t kAhead = 16;
  uint64_t home[kAhead];
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) {
    home[i] = Mix64(static_cast<uint64_t>(keys[i])) & mask;
    __builtin_prefetch(&slots[home[i]]);
  }
  for (int64_t i = 0; i < n; ++i) {
    uint64_t b = home[i % kAhead];
    if (i + kAhead < n) {
      const uint64_t next = Mix64(static_cast<uint64_t>(keys[i + kAhead])) & mask;
      home[i % kAhead] = next;
      __builtin_prefetch(&slots[next]);
    }
    const int64_t key = keys[i];
    while (true) {
      UniqueSlot& slot = slots[b];
      if (slot.generation != generation) {
        const uint32_t index = static_cast<uint32_t>(unique->size());
        slot = UniqueSlot{key, index, generation};
        inverse[i] = index;
        unique->push_back(key);
        break;
      }
      if (slot.key == key) {
        inverse[i] = slot.index;
        break;
      }
      b = (b + 1) & mask;
    }
  }
}

namespace {

// Runtime dispatch to an AVX2 copy where the CPU has it; not under
// ThreadSanitizer (see Optimizer::Update).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define KVSPARSE_BATCH_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVSPARSE_BATCH_CLONES
#endif

// dst = src (first) or dst += src, and the inputs' finiteness and largest
// exponent on the way (the bit test of AllFiniteFloats; integer ops only, so
// the loop vectorizes without -ffast-math).
inline __attribute__((always_inline)) void AddRowChecked(float* __restrict dst,
                                                          const float* __restrict src,
                                                          int64_t dim, bool first,
                                                          uint32_t* any, uint32_t* top) {
  uint32_t a = 0;
  uint32_t t = 0;
  if (first) {
    for (int64_t j = 0; j < dim; ++j) {
      uint32_t bits;
      std::memcpy(&bits, src + j, sizeof(bits));
      dst[j] = 0.0f + src[j];  // as zeros plus the rows: -0.0 sums to +0.0
      a |= (bits & 0x7F800000u) + 0x00800000u;
      t = std::max(t, bits & 0x7F800000u);
    }
  } else {
    for (int64_t j = 0; j < dim; ++j) {
      uint32_t bits;
      std::memcpy(&bits, src + j, sizeof(bits));
      dst[j] += src[j];
      a |= (bits & 0x7F800000u) + 0x00800000u;
      t = std::max(t, bits & 0x7F800000u);
    }
  }
  *any |= a;
  *top = std::max(*top, t);
}

}  // namespace

// Each output row is copied from its first input row and added to after: no
// memset of the output first, which cost a quarter of a W1 push's sum (5.8 MB
// zeroed, then read again), and the non-finite check of the sums (another
// pass over them) is proven unneeded from the inputs.
KVSPARSE_BATCH_CLONES
bool SumRowsByIndex(const float* rows, const int64_t* index, int64_t n, int64_t dim,
                    int64_t num_unique, float* out) {
  std::vector<uint8_t> seen(static_cast<size_t>(num_unique), 0);
  uint32_t any = 0;  // sign bit set: some input is NaN or inf
  uint32_t top = 0;  // the largest biased exponent of an input, in place
  // The output rows are read and written in the batch's random order: each is
  // prefetched kAhead inputs before its add (the inputs stream in order).
  constexpr int64_t kAhead = 8;
  const int64_t lines = std::min<int64_t>(8, (dim * 4 + 63) / 64);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const char* next = reinterpret_cast<const char*>(out + index[i + kAhead] * dim);
      for (int64_t l = 0; l < lines; ++l) PrefetchLine(next + 64 * l);
    }
    const int64_t u = index[i];
    AddRowChecked(out + u * dim, rows + i * dim, dim, !seen[u], &any, &top);
    seen[u] = 1;
  }
  for (int64_t u = 0; u < num_unique; ++u) {
    if (!seen[u]) std::memset(out + u * dim, 0, sizeof(float) * static_cast<size_t>(dim));
  }
  if (any & 0x80000000u) return true;
  // Every input is below 2^(e - 126), e the largest biased exponent, and a
  // row sums at most n of them, each add rounding by at most 2^-24: below
  // n * 2^(e - 126) * (1 + n * 2^-24) < 2^(e - 126 + bits(n) + 1) for n <
  // 2^24 (bits(n): n's bit length). Finite when that is at most 2^127
  // (FLT_MAX is just below 2^128); one more bit of margin.
  const int64_t e = static_cast<int64_t>(top >> 23);
  const int64_t bits = 64 - __builtin_clzll(static_cast<unsigned long long>(n) | 1);
  return n >= (int64_t{1} << 24) || e - 126 + bits + 2 > 127;
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

void PlanBatch(const int64_t* ids, int64_t n, const Partitioner& partitioner, BatchPlan* plan,
               int64_t* slot) {
  const int64_t num_shards = partitioner.num_shards;
  std::vector<int64_t> unique;
  UniqueWithInverse(ids, n, &unique, slot);
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
  for (int64_t i = 0; i < n; ++i) slot[i] = position[slot[i]];
}

void GatherFromShards(const float* const* shard_rows, const int64_t* offsets,
                      int64_t num_shards, const int64_t* slot, int64_t n, int64_t dim,
                      float* out) {
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(dim);
#if defined(__SSE2__)
  // A large out goes around the caches: it does not fit them, and a plain
  // store first reads each line it writes. W1's pull (65,536 x 64 floats,
  // 16 MB) gathered in 1.8 ms instead of 2.8.
  if (n * static_cast<int64_t>(row_bytes) >= kStreamOutBytes && dim % 4 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = slot[i];
      int64_t s = 0;
      while (s + 1 < num_shards && k >= offsets[s + 1]) ++s;
      const float* src = shard_rows[s] + (k - offsets[s]) * dim;
      float* dst = out + i * dim;
      for (int64_t j = 0; j < dim; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
    }
    _mm_sfence();  // the streamed stores are seen before anything after the gather
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = slot[i];
    // Shards are few (<= a few dozen): a short scan beats a binary search.
    int64_t s = 0;
    while (s + 1 < num_shards && k >= offsets[s + 1]) ++s;
    std::memcpy(out + i * dim, shard_rows[s] + (k - offsets[s]) * dim, row_bytes);
  }
}

}  // namespace kvsparse
