// The streams are defined by the float32 operations below in their written
// order: no fused multiply-add (GCC contracts a * b + c in C++ whenever FMA
// is enabled, -march=native say, whatever -std), no reassociation.
#if defined(__FAST_MATH__)
#error "csrc/initializer.cc must not be built with -ffast-math: the initializer streams would change"
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "initializer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "hash.h"
#include "philox.h"

// Runtime dispatch to an AVX2 copy of the block kernels where the CPU has it
// (GCC and Clang on x86-64 Linux). AVX2 only, never FMA: the bits must not
// depend on the machine.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    !defined(KVSPARSE_NO_TARGET_CLONES)
#define KVSPARSE_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVSPARSE_VECTOR_CLONES
#endif

namespace kvsparse {

namespace {

// ---- Version 1 (double, per element) ----------------------------------------

constexpr double kTwoPi = 6.283185307179586476925286766559;
// Counter stride between redraws of a truncated normal element: far beyond
// any dim (<= 4096), so redraw streams never overlap first draws.
constexpr uint64_t kRedrawStride = 1ULL << 32;

// Standard normal from counters (2c, 2c+1) by Box-Muller. u1 is mapped to
// (0, 1] so log() is finite.
double NormalAtV1(uint64_t seed, int64_t key, uint64_t counter) {
  double u1 = 1.0 - UniformAt(seed, key, 2 * counter);
  double u2 = UniformAt(seed, key, 2 * counter + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

void FillInitialRowV1(const InitializerConfig& config, int64_t key, int64_t dim, float* out) {
  switch (config.kind) {
    case InitializerKind::kZeros:
    case InitializerKind::kConstant:
      break;  // version-independent, FillInitialRow does them
    case InitializerKind::kUniform:
      for (int64_t j = 0; j < dim; ++j) {
        double u = UniformAt(config.seed, key, static_cast<uint64_t>(j));
        out[j] = static_cast<float>(config.a + (config.b - config.a) * u);
      }
      return;
    case InitializerKind::kNormal:
      for (int64_t j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(
            config.a + config.b * NormalAtV1(config.seed, key, static_cast<uint64_t>(j)));
      }
      return;
    case InitializerKind::kTruncatedNormal:
      for (int64_t j = 0; j < dim; ++j) {
        double z = NormalAtV1(config.seed, key, static_cast<uint64_t>(j));
        for (uint64_t attempt = 1; std::fabs(z) > 2.0; ++attempt) {
          z = NormalAtV1(config.seed, key, static_cast<uint64_t>(j) + attempt * kRedrawStride);
        }
        out[j] = static_cast<float>(config.a + config.b * z);
      }
      return;
  }
}

// ---- Version 2 (Philox, float32, vectorized) --------------------------------
//
// Every function below is written so that GCC vectorizes a loop over blocks
// (no branches, no calls, bit casts through memcpy). The operation order is
// the stream's definition: tests/reference.py repeats it in NumPy float32.

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Natural log of a positive normal float: Cephes logf. The mantissa is
// reduced to [sqrt(1/2), sqrt(2)) with integer arithmetic (as musl does), so
// there is no branch.
inline float LogPositive(float x) {
  uint32_t ix = FloatToBits(x) + (0x3F800000u - 0x3F3504F3u);
  const float e = static_cast<float>(static_cast<int32_t>(ix >> 23) - 0x7F);
  ix = (ix & 0x007FFFFFu) + 0x3F3504F3u;
  const float f = BitsToFloat(ix) - 1.0f;
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y = y + -2.12194440e-4f * e;  // ln 2 = 0.693359375 - 2.12194440e-4
  y = y - 0.5f * z;
  const float r = f + y;
  return r + 0.693359375f * e;
}

// Box-Muller on two words: *z_cos, *z_sin standard normals.
inline void BoxMuller(uint32_t radius_bits, uint32_t angle_bits, float* z_cos, float* z_sin) {
  // u1 in [2^-32, 1]: 31 bits, exact near 0, so the tail reaches 6.66 sigma.
  const float u1 = static_cast<float>(static_cast<int32_t>(radius_bits >> 1)) * 0x1p-31f + 0x1p-32f;
  const float radius = std::sqrt(std::max(-2.0f * LogPositive(u1), 0.0f));
  // Angle = quadrant * pi/2 + t, t in [-pi/4, pi/4]: exact range reduction
  // from the integer, then Cephes' sinf / cosf polynomials on t.
  const uint32_t quadrant = angle_bits >> 30;
  const float t =
      static_cast<float>(static_cast<int32_t>(angle_bits << 2)) * (0x1p-32f * 1.5707963268f);
  const float t2 = t * t;
  float s = -1.9515295891e-4f;
  s = s * t2 + 8.3321608736e-3f;
  s = s * t2 - 1.6666654611e-1f;
  s = s * t2 * t + t;
  float c = 2.443315711809948e-5f;
  c = c * t2 - 1.388731625493765e-3f;
  c = c * t2 + 4.166664568298827e-2f;
  c = c * t2 * t2 - 0.5f * t2 + 1.0f;
  // Rotate by the quadrant: odd quadrants swap sine and cosine; the cosine
  // is negative in quadrants 1 and 2, the sine in 2 and 3.
  const uint32_t swap = 0u - (quadrant & 1u);
  const uint32_t s_bits = FloatToBits(s), c_bits = FloatToBits(c);
  const uint32_t cos_bits = ((s_bits & swap) | (c_bits & ~swap)) ^ (((quadrant + 1u) & 2u) << 30);
  const uint32_t sin_bits = ((c_bits & swap) | (s_bits & ~swap)) ^ ((quadrant & 2u) << 30);
  *z_cos = radius * BitsToFloat(cos_bits);
  *z_sin = radius * BitsToFloat(sin_bits);
}

// Standard normals of n blocks from their Philox words: block b's elements
// 0, 1, 2, 3 into z0[b], z1[b], z2[b], z3[b].
KVSPARSE_VECTOR_CLONES
void BoxMullerBlocks(const uint32_t* __restrict x0, const uint32_t* __restrict x1,
                     const uint32_t* __restrict x2, const uint32_t* __restrict x3, int64_t n,
                     float* __restrict z0, float* __restrict z1, float* __restrict z2,
                     float* __restrict z3) {
  for (int64_t b = 0; b < n; ++b) {
    BoxMuller(x0[b], x1[b], &z0[b], &z1[b]);
    BoxMuller(x2[b], x3[b], &z2[b], &z3[b]);
  }
}

// Uniforms in [0, 1) of n words: 24 bits each.
KVSPARSE_VECTOR_CLONES
void UniformWords(const uint32_t* __restrict x, int64_t n, float* __restrict u) {
  for (int64_t i = 0; i < n; ++i) {
    u[i] = static_cast<float>(static_cast<int32_t>(x[i] >> 8)) * 0x1p-24f;
  }
}

// dst[4k + i] = offset + scale * z<i>[k] for the `elements` first elements.
KVSPARSE_VECTOR_CLONES
void InterleaveAffine(const float* __restrict z0, const float* __restrict z1,
                      const float* __restrict z2, const float* __restrict z3, int64_t elements,
                      float offset, float scale, float* __restrict dst) {
  const int64_t whole = elements / 4;
  for (int64_t k = 0; k < whole; ++k) {
    dst[4 * k + 0] = offset + scale * z0[k];
    dst[4 * k + 1] = offset + scale * z1[k];
    dst[4 * k + 2] = offset + scale * z2[k];
    dst[4 * k + 3] = offset + scale * z3[k];
  }
  const float* tail[4] = {z0 + whole, z1 + whole, z2 + whole, z3 + whole};
  for (int64_t i = 0; i < elements - 4 * whole; ++i) dst[4 * whole + i] = offset + scale * *tail[i];
}

// Blocks generated per kernel call: inputs, words and outputs (15 KB) stay
// in L1.
constexpr int64_t kChunkBlocks = 256;

// One chunk's working arrays (structure of arrays: every kernel loop is
// vertical, no shuffles).
struct Chunk {
  alignas(64) uint32_t key0[kChunkBlocks];
  alignas(64) uint32_t key1[kChunkBlocks];
  alignas(64) uint32_t block[kChunkBlocks];
  alignas(64) uint32_t x[4][kChunkBlocks];
  alignas(64) float z[4][kChunkBlocks];
};

// Truncated normal: redraws every element of the chunk with |z| > 2 from
// attempt 1, 2, ... of its block's counter until it lies within 2 stddev.
// The redraws of the chunk run as one batch per attempt.
void RedrawTruncated(Chunk* c, int64_t count) {
  alignas(64) uint32_t key0[4 * kChunkBlocks];
  alignas(64) uint32_t key1[4 * kChunkBlocks];
  alignas(64) uint32_t block[4 * kChunkBlocks];
  int32_t position[4 * kChunkBlocks];  // 4 * chunk block + lane
  int64_t pending = 0;
  for (int lane = 0; lane < 4; ++lane) {
    for (int64_t k = 0; k < count; ++k) {
      if (!(std::fabs(c->z[lane][k]) > 2.0f)) continue;
      key0[pending] = c->key0[k];
      key1[pending] = c->key1[k];
      block[pending] = c->block[k];
      position[pending++] = static_cast<int32_t>(4 * k + lane);
    }
  }
  alignas(64) uint32_t x[4][4 * kChunkBlocks];
  alignas(64) float z[4][4 * kChunkBlocks];
  for (uint32_t attempt = 1; pending > 0; ++attempt) {
    PhiloxBlocks(key0, key1, block, attempt, pending, x[0], x[1], x[2], x[3]);
    BoxMullerBlocks(x[0], x[1], x[2], x[3], pending, z[0], z[1], z[2], z[3]);
    int64_t still = 0;
    for (int64_t i = 0; i < pending; ++i) {
      const int32_t k = position[i] / 4, lane = position[i] % 4;
      const float redraw = z[lane][i];
      c->z[lane][k] = redraw;
      if (std::fabs(redraw) > 2.0f) {
        key0[still] = key0[i];
        key1[still] = key1[i];
        block[still] = block[i];
        position[still++] = position[i];
      }
    }
    pending = still;
  }
}

// Version-2 rows of keys[0..n) into row_of(i) (dim floats each).
template <typename RowOf>
void FillRowsV2(const InitializerConfig& config, const int64_t* keys, int64_t n, int64_t dim,
                RowOf row_of) {
  Chunk c;
  const bool uniform = config.kind == InitializerKind::kUniform;
  const bool truncated = config.kind == InitializerKind::kTruncatedNormal;
  const float offset = static_cast<float>(config.a);
  const float scale = static_cast<float>(uniform ? config.b - config.a : config.b);
  const int64_t blocks_per_row = (dim + 3) / 4;
  // The batch as one sequence of (row, block) pairs, cut into chunks.
  int64_t row = 0, row_block = 0;
  while (row < n) {
    const int64_t chunk_row = row, chunk_row_block = row_block;
    int64_t count = 0;
    for (int64_t r = row; count < kChunkBlocks && r < n; ++r) {
      const uint64_t h = Mix64(config.seed ^ Mix64(static_cast<uint64_t>(keys[r])));
      const uint32_t k0 = static_cast<uint32_t>(h), k1 = static_cast<uint32_t>(h >> 32);
      const int64_t first = r == row ? row_block : 0;
      const int64_t blocks = std::min(blocks_per_row - first, kChunkBlocks - count);
      for (int64_t b = 0; b < blocks; ++b) {
        c.key0[count + b] = k0;
        c.key1[count + b] = k1;
        c.block[count + b] = static_cast<uint32_t>(first + b);
      }
      count += blocks;
    }
    PhiloxBlocks(c.key0, c.key1, c.block, 0, count, c.x[0], c.x[1], c.x[2], c.x[3]);
    if (uniform) {
      for (int lane = 0; lane < 4; ++lane) UniformWords(c.x[lane], count, c.z[lane]);
    } else {
      BoxMullerBlocks(c.x[0], c.x[1], c.x[2], c.x[3], count, c.z[0], c.z[1], c.z[2], c.z[3]);
      if (truncated) RedrawTruncated(&c, count);
    }
    // Scatter the chunk into its rows, applying the affine map.
    int64_t at = 0;
    row = chunk_row;
    row_block = chunk_row_block;
    auto advance = [&](int64_t blocks) {
      row_block += blocks;
      if (row_block == blocks_per_row) {
        ++row;
        row_block = 0;
      }
    };
    while (at < count) {
      float* dst = row_of(row) + 4 * row_block;
      int64_t blocks = std::min(blocks_per_row - row_block, count - at);
      int64_t elements = std::min(4 * blocks, dim - 4 * row_block);
      advance(blocks);
      // Rows right after this one in memory (a contiguous batch, or rows a
      // table allocated one after the other) go in the same call: one call
      // per row cost 30% at dim 8.
      while (dim % 4 == 0 && row_block == 0 && row < n && at + blocks < count &&
             row_of(row) == dst + elements) {
        const int64_t more = std::min(blocks_per_row, count - at - blocks);
        blocks += more;
        elements += 4 * more;
        advance(more);
      }
      InterleaveAffine(c.z[0] + at, c.z[1] + at, c.z[2] + at, c.z[3] + at, elements, offset,
                       scale, dst);
      at += blocks;
    }
  }
}

template <typename RowOf>
void FillRows(const InitializerConfig& config, const int64_t* keys, int64_t n, int64_t dim,
              RowOf row_of) {
  switch (config.kind) {
    case InitializerKind::kZeros:
    case InitializerKind::kConstant: {
      const float value = config.kind == InitializerKind::kZeros ? 0.0f
                                                                   : static_cast<float>(config.a);
      for (int64_t i = 0; i < n; ++i) std::fill_n(row_of(i), dim, value);
      return;
    }
    case InitializerKind::kUniform:
    case InitializerKind::kNormal:
    case InitializerKind::kTruncatedNormal:
      if (config.version == 1) {
        for (int64_t i = 0; i < n; ++i) FillInitialRowV1(config, keys[i], dim, row_of(i));
      } else {
        FillRowsV2(config, keys, n, dim, row_of);
      }
      return;
  }
}

}  // namespace

Status ValidateInitializer(const InitializerConfig& config) {
  if (config.version != 1 && config.version != kInitializerVersion) {
    return Status(StatusCode::kInvalidArgument,
                  "initializer stream version must be 1 or " +
                      std::to_string(kInitializerVersion) + ", got " +
                      std::to_string(config.version));
  }
  switch (config.kind) {
    case InitializerKind::kZeros:
    case InitializerKind::kConstant:
      return Status::Ok();
    case InitializerKind::kUniform:
      if (!(config.a <= config.b)) {
        return Status(StatusCode::kInvalidArgument,
                      "uniform initializer needs low <= high, got low=" +
                          std::to_string(config.a) + " high=" + std::to_string(config.b));
      }
      return Status::Ok();
    case InitializerKind::kNormal:
    case InitializerKind::kTruncatedNormal:
      if (!(config.b >= 0.0)) {
        return Status(StatusCode::kInvalidArgument,
                      "normal initializer needs stddev >= 0, got " + std::to_string(config.b));
      }
      return Status::Ok();
  }
  return Status(StatusCode::kInvalidArgument, "unknown initializer kind");
}

double UniformAt(uint64_t seed, int64_t key, uint64_t counter) {
  uint64_t stream = Mix64(seed ^ Mix64(static_cast<uint64_t>(key)));
  uint64_t bits = Mix64(stream + counter * 0xD1B54A32D192ED03ULL);
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

void FillInitialRow(const InitializerConfig& config, int64_t key, int64_t dim, float* out) {
  FillRows(config, &key, 1, dim, [out](int64_t) { return out; });
}

void FillInitialRows(const InitializerConfig& config, const int64_t* keys, int64_t n,
                     int64_t dim, float* out) {
  FillRows(config, keys, n, dim, [out, dim](int64_t i) { return out + i * dim; });
}

void FillInitialRows(const InitializerConfig& config, const int64_t* keys, int64_t n,
                     int64_t dim, float* const* rows) {
  FillRows(config, keys, n, dim, [rows](int64_t i) { return rows[i]; });
}

}  // namespace kvsparse
