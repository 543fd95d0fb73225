#include "half.h"

#include <atomic>
#include <cstring>

#include "parallel.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVSPARSE_HALF_X86 1
#include <immintrin.h>
#endif

namespace kvsparse {
namespace {

// Conversions are memory-bound (~1 ns per value scalar): threads pay off
// only for arrays of a few hundred thousand values.
constexpr int64_t kValuesPerThread = int64_t{1} << 18;

inline uint32_t BitsOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float FloatOf(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Every case is computed and one selected, so the loops have no branches.
inline uint16_t FloatToHalfBits(float value) {
  const uint32_t bits = BitsOf(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t x = bits & 0x7fffffffu;
  // Normal halves: rebias the exponent by (15 - 127) and round the 13 dropped
  // bits to nearest even; a carry out of 0x7bff gives 0x7c00, inf (65520 up).
  const uint32_t normal = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
  // Below 2^-14 (subnormal halves): adding 0.5f puts the half's spacing, 2^-24,
  // at the float's last place, so the float adder does the even rounding.
  const uint32_t subnormal = BitsOf(FloatOf(x) + 0.5f) - 0x3f000000u;
  uint32_t result = x < 0x38800000u ? subnormal : normal;
  result = x >= 0x47800000u ? 0x7c00u : result;  // 65536 and up, and inf
  result = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : result;  // quiet NaN
  return static_cast<uint16_t>(result | sign);
}

inline float HalfBitsToFloat(uint16_t half) {
  const uint32_t h = half;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t shifted = (h & 0x7fffu) << 13;
  const uint32_t exponent = shifted & 0x0f800000u;
  const uint32_t normal = shifted + 0x38000000u;  // exponent + (127 - 15)
  // inf; a NaN keeps its payload and comes out quiet (IEEE conversions, and F16C, quiet a
  // signaling NaN), so both kernels below give the same bits.
  const uint32_t special = shifted | (shifted > 0x0f800000u ? 0x7fc00000u : 0x7f800000u);
  // Subnormal halves m * 2^-24: (1 + m/1024) * 2^-14 - 2^-14, exact in float.
  const uint32_t subnormal = BitsOf(FloatOf(shifted + 0x38800000u) - FloatOf(0x38800000u));
  uint32_t result = exponent == 0 ? subnormal : normal;
  result = exponent == 0x0f800000u ? special : result;
  return FloatOf(result | sign);
}

inline uint16_t FloatToBFloat16Bits(float value) {
  const uint32_t bits = BitsOf(value);
  // Round the 16 dropped bits to nearest even; a carry out of the largest
  // finite bfloat16 gives inf, as IEEE rounding does.
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x0040u;  // quiet bit set, sign and payload top kept
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float BFloat16BitsToFloat(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  // A NaN comes out quiet, as from float16 (a bfloat16 is a float32's top half).
  return FloatOf((bits & 0x7fffffffu) > 0x7f800000u ? bits | 0x00400000u : bits);
}

// One conversion of n values; the kernels below implement each one.
using NarrowFn = void (*)(const float*, int64_t, uint16_t*);
using WidenFn = void (*)(const uint16_t*, int64_t, float*);

struct Kernels {
  NarrowFn narrow_half, narrow_bfloat16;
  WidenFn widen_half, widen_bfloat16;
};

// Portable kernels: branch-free loops the compiler vectorizes (SSE2 on x86-64: about
// 1.5 ns a value for float16, 0.7 ns for bfloat16, measured on one benchmark machine).
void NarrowHalfPortable(const float* __restrict values, int64_t n, uint16_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalfBits(values[i]);
}
void NarrowBFloat16Portable(const float* __restrict values, int64_t n,
                            uint16_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16Bits(values[i]);
}
void WidenHalfPortable(const uint16_t* __restrict halves, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = HalfBitsToFloat(halves[i]);
}
void WidenBFloat16Portable(const uint16_t* __restrict halves, int64_t n,
                           float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = BFloat16BitsToFloat(halves[i]);
}

constexpr Kernels kPortable = {NarrowHalfPortable, NarrowBFloat16Portable, WidenHalfPortable,
                               WidenBFloat16Portable};

#ifdef KVSPARSE_HALF_X86
// x86 kernels, chosen at run time where the CPU has F16C and AVX2 (the build targets
// plain x86-64): float16 is ~10x the portable loops (0.14 ns a value against 1.5), the
// hardware rounds to nearest even and quiets NaNs as the portable code does (same bits
// over 16M random patterns). Tails go through the portable element functions.
constexpr int kRounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

__attribute__((target("avx,f16c"))) void NarrowHalfF16c(const float* values, int64_t n,
                                                        uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(values + i), kRounding);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half);
  }
  for (; i < n; ++i) out[i] = FloatToHalfBits(values[i]);
}

__attribute__((target("avx,f16c"))) void WidenHalfF16c(const uint16_t* halves, int64_t n,
                                                       float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(half));
  }
  for (; i < n; ++i) out[i] = HalfBitsToFloat(halves[i]);
}

__attribute__((target("avx2"))) void NarrowBFloat16Avx2(const float* values, int64_t n,
                                                        uint16_t* out) {
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i packed[2];
    for (int part = 0; part < 2; ++part) {
      const __m256i bits =
          _mm256_castps_si256(_mm256_loadu_ps(values + i + 8 * static_cast<int64_t>(part)));
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
      const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(bias, odd));
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
      const __m256i chosen = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, quiet), nan);
      packed[part] = _mm256_srli_epi32(chosen, 16);
    }
    // packus works within 128-bit lanes: put the 16 results back in order.
    const __m256i both = _mm256_packus_epi32(packed[0], packed[1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_permute4x64_epi64(both, 0xd8));
  }
  for (; i < n; ++i) out[i] = FloatToBFloat16Bits(values[i]);
}

__attribute__((target("avx2"))) void WidenBFloat16Avx2(const uint16_t* halves, int64_t n,
                                                       float* out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i));
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
    const __m256i value = _mm256_or_si256(bits, _mm256_and_si256(nan, quiet));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(value));
  }
  for (; i < n; ++i) out[i] = BFloat16BitsToFloat(halves[i]);
}

constexpr Kernels kX86 = {NarrowHalfF16c, NarrowBFloat16Avx2, WidenHalfF16c, WidenBFloat16Avx2};

bool HasX86Kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#else
bool HasX86Kernels() { return false; }
#endif

const Kernels* BestKernels() {
#ifdef KVSPARSE_HALF_X86
  if (HasX86Kernels()) return &kX86;
#endif
  return &kPortable;
}

std::atomic<const Kernels*> g_kernels{BestKernels()};

void NarrowRange(HalfKind kind, const float* values, int64_t n, uint16_t* out) {
  const Kernels* kernels = g_kernels.load(std::memory_order_relaxed);
  (kind == HalfKind::kFloat16 ? kernels->narrow_half : kernels->narrow_bfloat16)(values, n, out);
}

void WidenRange(HalfKind kind, const uint16_t* halves, int64_t n, float* out) {
  const Kernels* kernels = g_kernels.load(std::memory_order_relaxed);
  (kind == HalfKind::kFloat16 ? kernels->widen_half : kernels->widen_bfloat16)(halves, n, out);
}

}  // namespace

bool UseHalfHardware(bool enable) {
  const bool available = HasX86Kernels();
#ifdef KVSPARSE_HALF_X86
  g_kernels.store(enable && available ? &kX86 : &kPortable);
#else
  g_kernels.store(&kPortable);
#endif
  return enable && available;
}

void NarrowFloats(HalfKind kind, const float* values, int64_t n, uint16_t* out) {
  ParallelFor(n, kValuesPerThread,
              [&](int64_t b, int64_t e) { NarrowRange(kind, values + b, e - b, out + b); });
}

void WidenHalves(HalfKind kind, const uint16_t* halves, int64_t n, float* out) {
  ParallelFor(n, kValuesPerThread,
              [&](int64_t b, int64_t e) { WidenRange(kind, halves + b, e - b, out + b); });
}

void NarrowFloatsSerial(HalfKind kind, const float* values, int64_t n, uint16_t* out) {
  NarrowRange(kind, values, n, out);
}

void WidenHalvesSerial(HalfKind kind, const uint16_t* halves, int64_t n, float* out) {
  WidenRange(kind, halves, n, out);
}

int64_t FirstNonFiniteHalfRow(HalfKind kind, const uint16_t* rows, int64_t n, int64_t dim) {
  // An all-ones exponent is inf or NaN.
  const uint16_t exponent = kind == HalfKind::kFloat16 ? 0x7c00u : 0x7f80u;
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* row = rows + r * dim;
    uint32_t bad = 0;  // an integer reduction, which the compiler vectorizes (a bool is not)
    for (int64_t j = 0; j < dim; ++j) bad |= (row[j] & exponent) == exponent ? 1u : 0u;
    if (bad != 0) return r;
  }
  return -1;
}

void GatherWidenFromShards(HalfKind kind, const uint16_t* const* shard_rows,
                           const int64_t* offsets, int64_t num_shards, const int64_t* slot,
                           int64_t n, int64_t dim, float* out) {
  ParallelFor(n, kValuesPerThread / (dim > 0 ? dim : 1) + 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t k = slot[i];
      // Shards are few (<= a few dozen): a short scan beats a binary search.
      int64_t s = 0;
      while (s + 1 < num_shards && k >= offsets[s + 1]) ++s;
      WidenRange(kind, shard_rows[s] + (k - offsets[s]) * dim, dim, out + i * dim);
    }
  });
}

}  // namespace kvsparse
