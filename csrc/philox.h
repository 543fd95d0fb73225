// Philox4x32-10, the counter-based generator of Salmon et al., "Parallel
// random numbers: as easy as 1, 2, 3" (SC 2011), as in Random123, cuRAND,
// JAX and NumPy's Philox: 128 random bits from a 128-bit counter and a
// 64-bit key, with no state carried between calls. It passes BigCrush.
//
// Part of the initializer stream contract (initializer.h,
// kInitializerVersion): tests/reference.py re-implements it and checks
// Random123's known-answer vectors (tests/kat_vectors, "philox4x32 10").
//
//   uint32_t counter[4] = {block, attempt, 0, 0};
//   uint32_t bits[4];
//   kvsparse::Philox4x32(counter, /*key0=*/k0, /*key1=*/k1, bits);
//
//   // Many blocks at once, SIMD (same bits): words i of block b into x[i][b].
//   kvsparse::PhiloxBlocks(key0, key1, counter0, /*counter1=*/0, n, x0, x1, x2, x3);
//
// Thread-safe: pure functions.
#ifndef KVSPARSE_PHILOX_H_
#define KVSPARSE_PHILOX_H_

#include <cstdint>

namespace kvsparse {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kPhiloxRounds = 10;

inline void Philox4x32(const uint32_t counter[4], uint32_t key0, uint32_t key1, uint32_t out[4]) {
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ key0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ key1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// Philox4x32-10 of n counters (counter0[b], counter1, 0, 0) under keys
// (key0[b], key1[b]): word i of block b into x<i>[b]. AVX2 or SSE2 where the
// CPU has them (the compiler does not vectorize the 32x32->64 multiplies
// well: 3x slower), else Philox4x32 per block; the bits are the same.
void PhiloxBlocks(const uint32_t* key0, const uint32_t* key1, const uint32_t* counter0,
                  uint32_t counter1, int64_t n, uint32_t* x0, uint32_t* x1, uint32_t* x2,
                  uint32_t* x3);

}  // namespace kvsparse

#endif  // KVSPARSE_PHILOX_H_
