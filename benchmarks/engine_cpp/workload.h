// The workload's building blocks: record contents that a reader can check
// without a copy (Pattern), and batches of distinct ids drawn uniform or Zipf
// over ranks scattered by a fixed permutation (IdSource).
//
//   engine_bench::IdSource ids(rows, 1.1, /*seed=*/9);
//   std::mt19937_64 rng(7);
//   std::vector<int64_t> batch = ids.Batch("zipf", 4096, rng);   // 4,096 distinct ids
//   engine_bench::Pattern(batch[0], /*version=*/0, 80, record);   // 80 bytes
//
// Thread-safety: an IdSource is used by one thread at a time; Pattern is pure.
#ifndef KVSPARSE_BENCH_ENGINE_CPP_WORKLOAD_H_
#define KVSPARSE_BENCH_ENGINE_CPP_WORKLOAD_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/hash.h"

namespace engine_bench {
// Records: every byte a function of (key, version), so that a record read
// back can be checked without keeping a copy.

using kvsparse::Mix64;  // splitmix64's finalizer, the core's own

inline void Pattern(int64_t key, uint32_t version, int64_t record_bytes, uint8_t* out) {
  const uint64_t seed = Mix64(static_cast<uint64_t>(key)) ^ (uint64_t{version} << 40);
  int64_t offset = 0;
  for (uint64_t word = 0; offset < record_bytes; ++word) {
    const uint64_t value = Mix64(seed + word);
    const int64_t take = std::min<int64_t>(8, record_bytes - offset);
    std::memcpy(out + offset, &value, static_cast<size_t>(take));
    offset += take;
  }
}

// ---------------------------------------------------------------------------
// Ids: uniform, or Zipf by Hormann and Derflinger's rejection-inversion
// (exact for a bounded Zipf law, O(1) per draw).

class ZipfSampler {
 public:
  ZipfSampler(int64_t elements, double exponent) : n_(elements), s_(exponent) {
    h_integral_x1_ = HIntegral(1.5) - 1.0;
    h_integral_n_ = HIntegral(static_cast<double>(n_) + 0.5);
    s_div_ = 2.0 - HIntegralInverse(HIntegral(2.5) - H(2.0));
  }

  // A rank in [0, elements): rank 0 is the most frequent.
  int64_t operator()(std::mt19937_64& rng) const {
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (;;) {
      const double u = h_integral_n_ + uniform(rng) * (h_integral_x1_ - h_integral_n_);
      const double x = HIntegralInverse(u);
      int64_t k = static_cast<int64_t>(x + 0.5);
      k = std::clamp<int64_t>(k, 1, n_);
      if (static_cast<double>(k) - x <= s_div_ ||
          u >= HIntegral(static_cast<double>(k) + 0.5) - H(static_cast<double>(k))) {
        return k - 1;
      }
    }
  }

 private:
  static double Helper1(double x) {
    return std::abs(x) > 1e-8 ? std::log1p(x) / x : 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x));
  }
  static double Helper2(double x) {
    return std::abs(x) > 1e-8 ? std::expm1(x) / x
                              : 1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + 0.25 * x));
  }
  double H(double x) const { return std::exp(-s_ * std::log(x)); }
  double HIntegral(double x) const {
    const double log_x = std::log(x);
    return Helper2((1.0 - s_) * log_x) * log_x;
  }
  double HIntegralInverse(double x) const {
    double t = x * (1.0 - s_);
    if (t < -1.0) t = -1.0;
    return std::exp(Helper1(t) * x);
  }

  int64_t n_;
  double s_;
  double h_integral_x1_, h_integral_n_, s_div_;
};

// Batches of distinct ids in [0, rows): the same for every engine.
class IdSource {
 public:
  IdSource(int64_t rows, double zipf_exponent, uint64_t seed)
      : rows_(rows), zipf_(rows, zipf_exponent), stamp_(static_cast<size_t>(rows), 0) {
    // Ranks scattered over the ids: rank r is id permutation_[r].
    permutation_.resize(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) permutation_[i] = i;
    std::mt19937_64 rng(seed);
    std::shuffle(permutation_.begin(), permutation_.end(), rng);
  }

  std::vector<int64_t> Batch(const std::string& distribution, int64_t size, std::mt19937_64& rng) {
    std::vector<int64_t> ids;
    ids.reserve(static_cast<size_t>(size));
    ++generation_;
    std::uniform_int_distribution<int64_t> uniform(0, rows_ - 1);
    while (static_cast<int64_t>(ids.size()) < size) {
      const int64_t id = distribution == "zipf" ? permutation_[zipf_(rng)] : uniform(rng);
      if (stamp_[id] == generation_) continue;
      stamp_[id] = generation_;
      ids.push_back(id);
    }
    return ids;
  }

 private:
  int64_t rows_;
  ZipfSampler zipf_;
  std::vector<int64_t> permutation_;
  std::vector<uint32_t> stamp_;
  uint32_t generation_ = 0;
};

}  // namespace engine_bench

#endif  // KVSPARSE_BENCH_ENGINE_CPP_WORKLOAD_H_
