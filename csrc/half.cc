#include "half.h"

#include <cstring>

#include "parallel.h"

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
  const uint32_t special = shifted | 0x7f800000u;  // inf, NaN with its payload
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

inline float BFloat16BitsToFloat(uint16_t half) { return FloatOf(static_cast<uint32_t>(half) << 16); }

void NarrowRange(HalfKind kind, const float* __restrict values, int64_t n,
                 uint16_t* __restrict out) {
  if (kind == HalfKind::kFloat16) {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalfBits(values[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16Bits(values[i]);
  }
}

void WidenRange(HalfKind kind, const uint16_t* __restrict halves, int64_t n,
                float* __restrict out) {
  if (kind == HalfKind::kFloat16) {
    for (int64_t i = 0; i < n; ++i) out[i] = HalfBitsToFloat(halves[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = BFloat16BitsToFloat(halves[i]);
  }
}

}  // namespace

void NarrowFloats(HalfKind kind, const float* values, int64_t n, uint16_t* out) {
  ParallelFor(n, kValuesPerThread,
              [&](int64_t b, int64_t e) { NarrowRange(kind, values + b, e - b, out + b); });
}

void WidenHalves(HalfKind kind, const uint16_t* halves, int64_t n, float* out) {
  ParallelFor(n, kValuesPerThread,
              [&](int64_t b, int64_t e) { WidenRange(kind, halves + b, e - b, out + b); });
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
