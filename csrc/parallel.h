// ParallelFor: splits [0, n) into contiguous ranges over a few threads.
//
// Batch operations use it when a batch is large enough to pay for starting
// threads (tens of microseconds). fn(begin, end) must only touch data no
// other range touches; it may throw (see ParallelFor).
//
//   kvsparse::ParallelFor(n, /*min_per_thread=*/8192, [&](int64_t b, int64_t e) {
//     for (int64_t i = b; i < e; ++i) out[i] = f(in[i]);
//   });
#ifndef KVSPARSE_PARALLEL_H_
#define KVSPARSE_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
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

// An exception thrown by fn in a worker thread is caught there and rethrown
// on the calling thread once every range has finished (the first one thrown
// wins); an exception escaping a std::thread is std::terminate, the whole
// process. A worker that cannot be started (no memory for its stack, a thread
// limit) leaves its range to the calling thread.
template <typename Fn>
void ParallelFor(int64_t n, int64_t min_per_thread, Fn fn) {
  const int64_t threads = std::min(MaxThreads(), std::max<int64_t>(1, n / min_per_thread));
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::mutex error_mutex;
  std::exception_ptr error;
  auto run = [&](int64_t t) noexcept {
    try {
      fn(n * t / threads, n * (t + 1) / threads);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  int64_t started = 1;  // ranges [1, started) have a worker thread
  try {
    workers.reserve(static_cast<size_t>(threads - 1));
    for (; started < threads; ++started) workers.emplace_back(run, started);
  } catch (...) {
    // std::system_error or std::bad_alloc: the ranges left run inline below.
  }
  run(0);
  for (int64_t t = started; t < threads; ++t) run(t);
  for (auto& w : workers) w.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace kvsparse

#endif  // KVSPARSE_PARALLEL_H_
