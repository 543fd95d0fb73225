// ReadPool: a fixed pool of threads that run fn(0..count) together with the
// caller, each index once: the preads of one batch of a disk tier's reads
// issued together (queue depth = threads), not one by one.
//
//   kvsparse::ReadPool pool(16);
//   pool.Run(n, [&](int64_t i) { ReadOne(i); });   // returns when all n ran
//
// Thread-safety: Run is called by one thread at a time (its engine's lock);
// the workers only run the function it hands them. In a forked child (a
// server's checkpoint writer) the workers do not exist and Run reads alone.
#ifndef KVSPARSE_READ_POOL_H_
#define KVSPARSE_READ_POOL_H_

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvsparse {

class ReadPool {
 public:
  explicit ReadPool(int64_t threads) : owner_(::getpid()) {
    for (int64_t t = 1; t < threads; ++t) {
      try {
        workers_.emplace_back([this] { Work(); });
      } catch (const std::exception&) {
        break;  // fewer threads only lowers the queue depth
      }
    }
  }

  ~ReadPool() {
    if (::getpid() != owner_) {
      for (std::thread& t : workers_) t.detach();  // they live in the parent only
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  void Run(int64_t count, const std::function<void(int64_t)>& fn) {
    if (count <= 0) return;
    if (::getpid() != owner_) {
      // A forked child (a server's checkpoint writer) has none of the
      // workers: the caller reads alone.
      for (int64_t i = 0; i < count; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      count_ = count;
      next_.store(0);
      active_ = static_cast<int64_t>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    Drain(fn, count);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void Drain(const std::function<void(int64_t)>& fn, int64_t count) {
    for (int64_t i = next_.fetch_add(1); i < count; i = next_.fetch_add(1)) fn(i);
  }

  void Work() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* fn;
      int64_t count;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        fn = fn_;
        count = count_;
      }
      Drain(*fn, count);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --active_;
      }
      done_.notify_all();
    }
  }

  const pid_t owner_;  // the process whose threads workers_ are
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
  int64_t active_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace kvsparse

#endif  // KVSPARSE_READ_POOL_H_
