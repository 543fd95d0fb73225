#include "philox.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVSPARSE_PHILOX_X86 1
#endif

namespace kvsparse {

namespace {

void PhiloxBlocksScalar(const uint32_t* key0, const uint32_t* key1, const uint32_t* counter0,
                        uint32_t counter1, int64_t begin, int64_t n, uint32_t* x0, uint32_t* x1,
                        uint32_t* x2, uint32_t* x3) {
  for (int64_t b = begin; b < n; ++b) {
    const uint32_t counter[4] = {counter0[b], counter1, 0, 0};
    uint32_t out[4];
    Philox4x32(counter, key0[b], key1[b], out);
    x0[b] = out[0];
    x1[b] = out[1];
    x2[b] = out[2];
    x3[b] = out[3];
  }
}

#ifdef KVSPARSE_PHILOX_X86

// SSE2 (every x86-64): 4 blocks per step. A 32x32->64 multiply of the even
// lanes and one of the odd lanes give the high and low halves of all four.
int64_t PhiloxBlocksSse2(const uint32_t* key0, const uint32_t* key1, const uint32_t* counter0,
                         uint32_t counter1, int64_t begin, int64_t n, uint32_t* x0, uint32_t* x1,
                         uint32_t* x2, uint32_t* x3) {
  const __m128i m0 = _mm_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m128i m1 = _mm_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m128i w0 = _mm_set1_epi32(static_cast<int>(kPhiloxW0));
  const __m128i w1 = _mm_set1_epi32(static_cast<int>(kPhiloxW1));
  const __m128i odd = _mm_set_epi32(-1, 0, -1, 0);
  auto mulhilo = [odd](__m128i a, __m128i m, __m128i* hi, __m128i* lo) {
    const __m128i even = _mm_mul_epu32(a, m);
    const __m128i odd_products = _mm_mul_epu32(_mm_srli_epi64(a, 32), m);
    *hi = _mm_or_si128(_mm_srli_epi64(even, 32), _mm_and_si128(odd_products, odd));
    *lo = _mm_or_si128(_mm_andnot_si128(odd, even), _mm_slli_epi64(odd_products, 32));
  };
  int64_t b = begin;
  for (; b + 4 <= n; b += 4) {
    __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(counter0 + b));
    __m128i c1 = _mm_set1_epi32(static_cast<int>(counter1));
    __m128i c2 = _mm_setzero_si128();
    __m128i c3 = _mm_setzero_si128();
    __m128i k0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key0 + b));
    __m128i k1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key1 + b));
    for (int round = 0; round < kPhiloxRounds; ++round) {
      __m128i hi0, lo0, hi1, lo1;
      mulhilo(c0, m0, &hi0, &lo0);
      mulhilo(c2, m1, &hi1, &lo1);
      c0 = _mm_xor_si128(_mm_xor_si128(hi1, c1), k0);
      c2 = _mm_xor_si128(_mm_xor_si128(hi0, c3), k1);
      c1 = lo1;
      c3 = lo0;
      k0 = _mm_add_epi32(k0, w0);
      k1 = _mm_add_epi32(k1, w1);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x0 + b), c0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x1 + b), c1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x2 + b), c2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x3 + b), c3);
  }
  return b;
}

// AVX2: 8 blocks per step; blends replace the and/or of SSE2.
__attribute__((target("avx2"))) int64_t PhiloxBlocksAvx2(
    const uint32_t* key0, const uint32_t* key1, const uint32_t* counter0, uint32_t counter1,
    int64_t n, uint32_t* x0, uint32_t* x1, uint32_t* x2, uint32_t* x3) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m256i w0 = _mm256_set1_epi32(static_cast<int>(kPhiloxW0));
  const __m256i w1 = _mm256_set1_epi32(static_cast<int>(kPhiloxW1));
  int64_t b = 0;
  for (; b + 8 <= n; b += 8) {
    __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(counter0 + b));
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(counter1));
    __m256i c2 = _mm256_setzero_si256();
    __m256i c3 = _mm256_setzero_si256();
    __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key0 + b));
    __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key1 + b));
    for (int round = 0; round < kPhiloxRounds; ++round) {
      const __m256i even0 = _mm256_mul_epu32(c0, m0);
      const __m256i odd0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
      const __m256i even1 = _mm256_mul_epu32(c2, m1);
      const __m256i odd1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
      const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(even0, 32), odd0, 0xAA);
      const __m256i lo0 = _mm256_blend_epi32(even0, _mm256_slli_epi64(odd0, 32), 0xAA);
      const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(even1, 32), odd1, 0xAA);
      const __m256i lo1 = _mm256_blend_epi32(even1, _mm256_slli_epi64(odd1, 32), 0xAA);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), k0);
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), k1);
      c1 = lo1;
      c3 = lo0;
      k0 = _mm256_add_epi32(k0, w0);
      k1 = _mm256_add_epi32(k1, w1);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x0 + b), c0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x1 + b), c1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x2 + b), c2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x3 + b), c3);
  }
  return b;
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

#endif  // KVSPARSE_PHILOX_X86

}  // namespace

void PhiloxBlocks(const uint32_t* key0, const uint32_t* key1, const uint32_t* counter0,
                  uint32_t counter1, int64_t n, uint32_t* x0, uint32_t* x1, uint32_t* x2,
                  uint32_t* x3) {
  int64_t done = 0;
#ifdef KVSPARSE_PHILOX_X86
  // Groups of 8 with AVX2, then of 4 with SSE2, then one at a time: a batch
  // of 8k + 4 + r blocks runs all three paths (tests/test_initializer.py
  // compares rows generated alone and in batches).
  if (HasAvx2()) done = PhiloxBlocksAvx2(key0, key1, counter0, counter1, n, x0, x1, x2, x3);
  done = PhiloxBlocksSse2(key0, key1, counter0, counter1, done, n, x0, x1, x2, x3);
#endif
  PhiloxBlocksScalar(key0, key1, counter0, counter1, done, n, x0, x1, x2, x3);
}

}  // namespace kvsparse
