// Deterministic row initializers.
//
// A new row's value is a pure function of (seed, key, element index): the
// same id gets the same vector whatever the insertion order or the number of
// shards, so resharding and reruns reproduce.
//
//   kvsparse::InitializerConfig init;
//   init.kind = kvsparse::InitializerKind::kNormal;
//   init.a = 0.0;   // mean
//   init.b = 0.01;  // stddev
//   init.seed = 7;
//   float row[64];
//   kvsparse::FillInitialRow(init, /*key=*/42, /*dim=*/64, row);
#ifndef KVSPARSE_INITIALIZER_H_
#define KVSPARSE_INITIALIZER_H_

#include <cstdint>

#include "status.h"

namespace kvsparse {

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
};

Status ValidateInitializer(const InitializerConfig& config);

// Uniform double in [0, 1) drawn from counter `counter` of the stream of
// (seed, key). 53 random bits.
double UniformAt(uint64_t seed, int64_t key, uint64_t counter);

void FillInitialRow(const InitializerConfig& config, int64_t key, int64_t dim,
                    float* out);

}  // namespace kvsparse

#endif  // KVSPARSE_INITIALIZER_H_
