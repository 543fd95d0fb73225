// Deterministic row initializers.
//
// A new row's value is a pure function of (seed, key, element index): the
// same id gets the same vector whatever the insertion order, the batch it
// comes in or the number of shards, so resharding and reruns reproduce.
//
//   kvsparse::InitializerConfig init;
//   init.kind = kvsparse::InitializerKind::kNormal;
//   init.a = 0.0;   // mean
//   init.b = 0.01;  // stddev
//   init.seed = 7;
//   float row[64];
//   kvsparse::FillInitialRow(init, /*key=*/42, /*dim=*/64, row);
//   int64_t keys[3] = {1, 2, 3};
//   float rows[3 * 64];
//   kvsparse::FillInitialRows(init, keys, 3, 64, rows);  // same bits, vectorized
//
// Streams (the values each (seed, key, j) gets) are versioned: a checkpoint
// records kInitializerVersion so that a resumed run can tell whether ids it
// never stored get the same initial rows as before.
//
// Version 2 (the default). Per row, h = Mix64(seed ^ Mix64(key)) gives the
// Philox4x32-10 key (low 32 bits, high 32 bits) (philox.h). Elements
// 4b..4b+3 come from the 4 words x0..x3 of counter (b, attempt, 0, 0), with
// attempt 0 for every first draw.
// - Uniform: u = float(x_i >> 8) * 2^-24 in [0, 1); value = float(a) +
//   float(b - a) * u.
// - Normal: Box-Muller on the word pairs (x0, x1) and (x2, x3), both outputs
//   kept: radius sqrt(-2 log u1) with u1 = float(x_even >> 1) * 2^-31 +
//   2^-32 in (0, 1], angle 2 pi x_odd / 2^32 - pi/4; element 4b (or 4b+2)
//   gets the cosine, 4b+1 (or 4b+3) the sine. log, sin and cos are float32
//   polynomials (Cephes' logf, sinf and cosf; about 1e-7 relative error), so
//   the stream is bit-exact on any IEEE float32 machine whatever the vector
//   width. value = float(a) + float(b) * z.
// - TruncatedNormal: an element with |z| > 2 is redrawn from the same lane
//   of counter (b, attempt, 0, 0), attempt = 1, 2, ... until |z| <= 2.
// The arithmetic is exactly the float32 operations written in
// initializer.cc, which turns FP contraction off for itself (no FMA even
// with -march=native) and refuses -ffast-math; tests/reference.py checks
// the bits.
//
// Version 1 (kvsparse 0.1.0, kept to resume its checkpoints exactly): double
// Box-Muller from Mix64 per element, cosine output only. Many times slower.
//
// Thread-safe: every function here is pure.
#ifndef KVSPARSE_INITIALIZER_H_
#define KVSPARSE_INITIALIZER_H_

#include <cstdint>

#include "status.h"

namespace kvsparse {

// The newest stream version, the one InitializerConfig uses by default.
constexpr int kInitializerVersion = 2;

enum class InitializerKind : int {
  kZeros = 0,
  kConstant = 1,         // a = value
  kUniform = 2,          // a = low, b = high
  kNormal = 3,           // a = mean, b = stddev
  kTruncatedNormal = 4,  // a = mean, b = stddev; redrawn beyond 2 stddev (TF)
};

struct InitializerConfig {
  InitializerKind kind = InitializerKind::kZeros;
  double a = 0.0;
  double b = 0.0;
  uint64_t seed = 0;
  int version = kInitializerVersion;  // 1 or 2, see above
};

Status ValidateInitializer(const InitializerConfig& config);

// Uniform double in [0, 1) drawn from counter `counter` of the version-1
// stream of (seed, key). 53 random bits.
double UniformAt(uint64_t seed, int64_t key, uint64_t counter);

// The initial row of one key (dim floats).
void FillInitialRow(const InitializerConfig& config, int64_t key, int64_t dim, float* out);

// The initial rows of keys[0..n): row i at out + i * dim. Generates many
// rows' blocks in one vectorized loop: prefer it to FillInitialRow per key.
// Serial; callers split large batches over threads.
void FillInitialRows(const InitializerConfig& config, const int64_t* keys, int64_t n,
                     int64_t dim, float* out);
// Same, row i written at rows[i] (rows scattered in a table's chunks).
void FillInitialRows(const InitializerConfig& config, const int64_t* keys, int64_t n,
                     int64_t dim, float* const* rows);

}  // namespace kvsparse

#endif  // KVSPARSE_INITIALIZER_H_
