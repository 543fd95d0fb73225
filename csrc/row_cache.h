// InitialRowCache: the initial rows a table generated recently for ids it
// does not store, so that a push of those ids copies them instead of
// generating them a second time (a W1 step pulls a batch, then pushes it;
// about half of its ids are new, and each new row was generated twice, once
// for the pull's reply and once for the push).
//
// An initial row is a pure function of (initializer, table seed, id), so an
// entry never goes stale: the cache can only miss, never be wrong. It is
// direct-mapped (one slot per hash of the id; a newer id overwrites an older
// one in its slot): no index to maintain, and a push finds 80-90% of the rows
// its pull generated when the cache holds 2-4x a pull's new ids. It grows
// with the largest lookup that missed, up to kMaxBytes, and is counted in the
// table's memory (ScratchBytes). Not thread-safe: one writer at a time (the
// table's single caller); Find may run from several threads while no Put does.
//
//   InitialRowCache cache;
//   cache.Configure(dim);
//   cache.Reserve(missing_count);               // may grow; never throws
//   cache.Put(key, row);                        // row: dim floats
//   if (const float* row = cache.Find(key)) ...  // nullptr when not held
#ifndef KVSPARSE_ROW_CACHE_H_
#define KVSPARSE_ROW_CACHE_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#include "hash.h"
#include "memory.h"

namespace kvsparse {

class InitialRowCache {
 public:
  // 16 MiB: room for 2-4x the new ids of a 65,536-id pull on one shard at dim 64.
  static constexpr int64_t kMaxBytes = int64_t{16} << 20;
  static constexpr int64_t kMinSlots = 16;

  void Configure(int64_t dim) {
    dim_ = dim;
    slots_ = 0;
    keys_.reset();
    full_.reset();
    rows_.reset();
  }

  // Grows (never shrinks) to hold about 2x `missing` rows, within kMaxBytes.
  // Out of memory keeps the cache as it was: it is only a shortcut.
  void Reserve(int64_t missing) {
    const int64_t slot_bytes = SlotBytes();
    int64_t want = kMinSlots;
    while (want < 2 * missing && (want * 2) * slot_bytes <= kMaxBytes) want *= 2;
    if (want <= slots_) return;
    try {
      std::unique_ptr<int64_t[], FreeArray> keys(AllocateArray<int64_t>(static_cast<size_t>(want)));
      std::unique_ptr<uint8_t[], FreeArray> full(AllocateArray<uint8_t>(static_cast<size_t>(want)));
      std::unique_ptr<float[], FreeArray> rows(
          AllocateArray<float>(static_cast<size_t>(want * dim_)));
      std::memset(full.get(), 0, static_cast<size_t>(want));
      keys_ = std::move(keys);
      full_ = std::move(full);
      rows_ = std::move(rows);
      slots_ = want;
    } catch (const std::bad_alloc&) {
    }
  }

  void Put(int64_t key, const float* row) {
    if (slots_ == 0) return;
    const int64_t slot = SlotOf(key);
    keys_[slot] = key;
    full_[slot] = 1;
    std::memcpy(rows_.get() + slot * dim_, row, sizeof(float) * static_cast<size_t>(dim_));
  }

  const float* Find(int64_t key) const {
    if (slots_ == 0) return nullptr;
    const int64_t slot = SlotOf(key);
    if (!full_[slot] || keys_[slot] != key) return nullptr;
    return rows_.get() + slot * dim_;
  }

  int64_t Bytes() const { return slots_ * SlotBytes(); }

 private:
  int64_t SlotBytes() const {
    return static_cast<int64_t>(sizeof(int64_t) + 1 + sizeof(float) * static_cast<size_t>(dim_));
  }
  int64_t SlotOf(int64_t key) const {
    return static_cast<int64_t>(Mix64(static_cast<uint64_t>(key)) & static_cast<uint64_t>(slots_ - 1));
  }

  int64_t dim_ = 0;
  int64_t slots_ = 0;  // a power of two, or 0 before the first Reserve
  std::unique_ptr<int64_t[], FreeArray> keys_;
  std::unique_ptr<uint8_t[], FreeArray> full_;
  std::unique_ptr<float[], FreeArray> rows_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_ROW_CACHE_H_
