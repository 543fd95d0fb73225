// Fixed 64-bit mixing used for bucket placement, shard placement and the
// deterministic initializers. These functions are part of the on-disk and
// on-wire contract: changing them moves keys between shards and changes the
// initial value of every row. tests/reference.py re-implements them in NumPy.
#ifndef KVSPARSE_HASH_H_
#define KVSPARSE_HASH_H_

#include <cstdint>

namespace kvsparse {

// splitmix64's finalizer (Steele, Lea, Flood 2014): a bijection on 64 bits
// whose output bits each depend on every input bit, so sequential ids and
// ids that differ only in high bits spread evenly.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Shard of a key under hash partitioning. Salted differently from the bucket
// hash so that a shard's keys still spread over its own buckets.
inline int64_t HashShardOf(int64_t key, int64_t num_shards) {
  uint64_t h = Mix64(static_cast<uint64_t>(key) ^ 0x5851F42D4C957F2DULL);
  // Lemire's multiply-shift range reduction: unbiased enough, no division.
  return static_cast<int64_t>(
      (static_cast<unsigned __int128>(h) * static_cast<uint64_t>(num_shards)) >> 64);
}

}  // namespace kvsparse

#endif  // KVSPARSE_HASH_H_
