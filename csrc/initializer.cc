#include "initializer.h"

#include <cmath>
#include <string>

#include "hash.h"

namespace kvsparse {

namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;
// Counter stride between redraws of a truncated normal element: far beyond
// any dim (<= 4096), so redraw streams never overlap first draws.
constexpr uint64_t kRedrawStride = 1ULL << 32;

// Standard normal from counters (2c, 2c+1) by Box-Muller. u1 is mapped to
// (0, 1] so log() is finite.
double NormalAt(uint64_t seed, int64_t key, uint64_t counter) {
  double u1 = 1.0 - UniformAt(seed, key, 2 * counter);
  double u2 = UniformAt(seed, key, 2 * counter + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

}  // namespace

Status ValidateInitializer(const InitializerConfig& config) {
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

void FillInitialRow(const InitializerConfig& config, int64_t key, int64_t dim,
                    float* out) {
  switch (config.kind) {
    case InitializerKind::kZeros:
      for (int64_t j = 0; j < dim; ++j) out[j] = 0.0f;
      return;
    case InitializerKind::kConstant:
      for (int64_t j = 0; j < dim; ++j) out[j] = static_cast<float>(config.a);
      return;
    case InitializerKind::kUniform:
      for (int64_t j = 0; j < dim; ++j) {
        double u = UniformAt(config.seed, key, static_cast<uint64_t>(j));
        out[j] = static_cast<float>(config.a + (config.b - config.a) * u);
      }
      return;
    case InitializerKind::kNormal:
      for (int64_t j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(config.a +
                                    config.b * NormalAt(config.seed, key, static_cast<uint64_t>(j)));
      }
      return;
    case InitializerKind::kTruncatedNormal:
      for (int64_t j = 0; j < dim; ++j) {
        double z = NormalAt(config.seed, key, static_cast<uint64_t>(j));
        // P(|z| > 2) = 4.6%: the expected number of redraws is tiny, and
        // the counter keeps the result a pure function of (seed, key, j).
        for (uint64_t attempt = 1; std::fabs(z) > 2.0; ++attempt) {
          z = NormalAt(config.seed, key, static_cast<uint64_t>(j) + attempt * kRedrawStride);
        }
        out[j] = static_cast<float>(config.a + config.b * z);
      }
      return;
  }
}

}  // namespace kvsparse
