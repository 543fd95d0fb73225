#include "pull_cache.h"

#include <cstring>

#include "hash.h"

namespace kvsparse {

PullCache::PullCache(int64_t dim, int64_t capacity) : dim_(dim), capacity_(capacity) {}

int64_t PullCache::MemoryBytes() const {
  return static_cast<int64_t>(index_.capacity() * sizeof(Entry) +
                              slot_keys_.capacity() * sizeof(int64_t) + slot_used_.capacity()) +
         (rows_ ? capacity_ * dim_ * static_cast<int64_t>(sizeof(float)) : 0);
}

size_t PullCache::Home(int64_t key) const {
  // Salted apart from the table's bucket hash.
  return static_cast<size_t>(Mix64(static_cast<uint64_t>(key) ^ 0x2545F4914F6CDD1DULL) & mask_);
}

size_t PullCache::Find(int64_t key) const {
  size_t p = Home(key);
  while (index_[p].slot != kEmpty && index_[p].key != key) p = (p + 1) & mask_;
  return p;
}

void PullCache::EraseAt(size_t position) {
  index_[position].slot = kEmpty;
  // Backward-shift deletion, as EmbeddingTable::Remove.
  size_t hole = position;
  size_t j = (position + 1) & mask_;
  while (index_[j].slot != kEmpty) {
    const size_t home = Home(index_[j].key);
    if (!(((j - home) & mask_) < ((j - hole) & mask_))) {
      index_[hole] = index_[j];
      index_[j].slot = kEmpty;
      hole = j;
    }
    j = (j + 1) & mask_;
  }
}

void PullCache::Put(const int64_t* keys, const float* const* rows, int64_t n) {
  if (capacity_ <= 0 || n <= 0) return;
  if (!rows_) {
    size_t entries = 16;
    while (entries < static_cast<size_t>(2 * capacity_)) entries *= 2;  // load <= 1/2
    index_.assign(entries, Entry{0, kEmpty});
    mask_ = entries - 1;
    slot_keys_.assign(static_cast<size_t>(capacity_), 0);
    slot_used_.assign(static_cast<size_t>(capacity_), 0);
    rows_.reset(AllocateArray<float>(static_cast<size_t>(capacity_ * dim_)));
  }
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(dim_);
  for (int64_t i = 0; i < n; ++i) {
    size_t p = Find(keys[i]);
    if (index_[p].slot != kEmpty) continue;
    const int64_t slot = next_slot_;
    next_slot_ = next_slot_ + 1 == capacity_ ? 0 : next_slot_ + 1;
    if (slot_used_[slot]) {
      EraseAt(Find(slot_keys_[slot]));
      --size_;
      p = Find(keys[i]);
    }
    index_[p] = Entry{keys[i], static_cast<int32_t>(slot)};
    slot_keys_[slot] = keys[i];
    slot_used_[slot] = 1;
    ++size_;
    std::memcpy(rows_.get() + slot * dim_, rows[i], row_bytes);
  }
}

bool PullCache::Take(int64_t key, float* dst) {
  if (size_ == 0) return false;
  const size_t p = Find(key);
  const int32_t slot = index_[p].slot;
  if (slot == kEmpty) return false;
  std::memcpy(dst, rows_.get() + static_cast<int64_t>(slot) * dim_,
              sizeof(float) * static_cast<size_t>(dim_));
  slot_used_[slot] = 0;
  EraseAt(p);
  --size_;
  return true;
}

void PullCache::Clear() {
  for (Entry& e : index_) e.slot = kEmpty;
  for (uint8_t& used : slot_used_) used = 0;
  size_ = 0;
}

}  // namespace kvsparse
