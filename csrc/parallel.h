// ParallelFor: splits [0, n) into contiguous ranges over a few threads.
//
// Batch operations use it when a batch is large enough to pay for starting
// threads (tens of microseconds). fn(begin, end) must not throw and must only
// touch data no other range touches.
//
//   kvsparse::ParallelFor(n, /*min_per_thread=*/8192, [&](int64_t b, int64_t e) {
//     for (int64_t i = b; i < e; ++i) out[i] = f(in[i]);
//   });
#ifndef KVSPARSE_PARALLEL_H_
#define KVSPARSE_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

namespace kvsparse {

// Threads a batch may use: KVSPARSE_NUM_THREADS if set, else the cores.
inline int64_t MaxThreads() {
  static const int64_t threads = [] {
    const char* env = std::getenv("KVSPARSE_NUM_THREADS");
    if (env != nullptr) {
      const long v = std::strtol(env, nullptr, 10);
      if (v >= 1) return static_cast<int64_t>(std::min(v, 64L));
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int64_t>(std::max(1u, std::min(hw, 16u)));
  }();
  return threads;
}

template <typename Fn>
void ParallelFor(int64_t n, int64_t min_per_thread, Fn fn) {
  const int64_t threads = std::min(MaxThreads(), std::max<int64_t>(1, n / min_per_thread));
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) {
    workers.emplace_back([=, &fn] { fn(n * t / threads, n * (t + 1) / threads); });
  }
  fn(int64_t{0}, n / threads);
  for (auto& w : workers) w.join();
}

}  // namespace kvsparse

#endif  // KVSPARSE_PARALLEL_H_
