// PullCache: initial rows a lookup generated for ids the table does not
// hold, kept for the push that usually follows the pull, so that its insert
// copies the row instead of generating it again.
//
// Bounded: at most capacity() rows; when full, the oldest entry goes (FIFO).
// A cached row is always the id's exact initial value (initializers are pure
// functions of (seed, id)), so an entry never goes stale; the cache changes
// no result, only the work. Not thread-safe: its table's caller serializes.
//
//   kvsparse::PullCache cache(/*dim=*/64, /*capacity=*/1 << 16);
//   cache.Put(keys, rows, n);         // rows[i]: the generated row of keys[i]
//   if (cache.Take(key, dst)) { ... } // copied into dst and forgotten
#ifndef KVSPARSE_PULL_CACHE_H_
#define KVSPARSE_PULL_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "memory.h"

namespace kvsparse {

class PullCache {
 public:
  PullCache(int64_t dim, int64_t capacity);

  int64_t capacity() const { return capacity_; }
  int64_t size() const { return size_; }
  // Bytes held (row storage is allocated at the first Put).
  int64_t MemoryBytes() const;

  // Remembers rows[i] (dim floats) as the row of keys[i]; ids already cached
  // are skipped. Throws std::bad_alloc only at the first Put (allocation).
  void Put(const int64_t* keys, const float* const* rows, int64_t n);
  // Copies the row of key into dst and forgets it; false if not cached.
  bool Take(int64_t key, float* dst);
  void Clear();

 private:
  static constexpr int32_t kEmpty = -1;
  struct Entry {
    int64_t key;
    int32_t slot;  // kEmpty: free
  };
  size_t Home(int64_t key) const;
  // Index position of key, or of the empty entry where it would go.
  size_t Find(int64_t key) const;
  void EraseAt(size_t position);

  int64_t dim_;
  int64_t capacity_;
  int64_t size_ = 0;
  int64_t next_slot_ = 0;  // FIFO: the slot the next Put overwrites
  std::vector<Entry> index_;
  uint64_t mask_ = 0;
  std::vector<int64_t> slot_keys_;
  std::vector<uint8_t> slot_used_;
  std::unique_ptr<float[], FreeArray> rows_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_PULL_CACHE_H_
