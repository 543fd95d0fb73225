// KeyIndex: the map from an int64 key to the uint32 row slot that holds it, for
// EmbeddingTable. It owns the bucket array (open addressing, linear probing over
// 64-byte lines), its growth and the removal of keys; it owns no row: the table
// allocates rows, and the index only remembers which row a key has.
//
//   kvsparse::KeyIndex index;
//   kvsparse::Status s = index.Reserve(index.size() + 1);  // room first
//   if (s.ok() && index.Find(42) < 0) index.Insert(42, /*row=*/0);
//   int64_t row = index.Find(42);                          // 0; -1 when missing
//   uint32_t freed;
//   index.Erase(42, &freed);                               // freed == 0
//
// Not thread-safe: const members (Find, FindRows, ForEach, the slot cursor) may
// run on several threads at once; anything that changes the index runs alone.
//
// Disk tier (not built yet): an entry holds a row slot of 32 bits, and kEmpty is
// the only value that means "no key". A row that lives on disk will be told by its
// entry: rows then stay below a bound (for instance 2^31) and the remaining values
// name a place on disk. Find's callers are where a row's residency will be tested;
// nothing in the index itself needs to change but that bound in Reserve.
#ifndef KVSPARSE_KEY_INDEX_H_
#define KVSPARSE_KEY_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hash.h"
#include "memory.h"
#include "status.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvsparse {

class KeyIndex {
 public:
  // A free slot's row. Row slots are below it: a shard holds at most
  // 4294967294 rows.
  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;
  // Keys probed per block by FindRows and Rehash: enough independent misses in
  // flight to use the memory system's parallelism (about 10-12 line fill
  // buffers per core).
  static constexpr int64_t kProbeBlock = 32;

  KeyIndex();

  // Keys stored.
  int64_t size() const { return size_; }
  // Bytes of the bucket array.
  int64_t Bytes() const;

  // Row of key, -1 when missing.
  int64_t Find(int64_t key) const { return ProbeFrom(HomeLine(key), key); }
  // Rows of keys[0..n) (-1 when missing), probing a block at a time with
  // prefetches so that the cache misses of different keys overlap.
  void FindRows(const int64_t* keys, int64_t n, int64_t* rows) const;
  // The line a key's probe starts at; ProbeFrom(HomeLine(key), key) == Find(key).
  // For pipelines that prefetch a key's line (PrefetchProbe) well before probing it.
  size_t HomeLine(int64_t key) const {
    // Lemire's multiply-shift: any number of lines, not only powers of two (see Reserve).
    return static_cast<size_t>(
        (static_cast<unsigned __int128>(Mix64(static_cast<uint64_t>(key))) * lines_) >> 64);
  }
  // Prefetches a probe from `home`: the line and the next (about 13% of the keys at
  // load 0.7 live past their home line, a dependent miss each without it).
  void PrefetchProbe(size_t home) const {
    __builtin_prefetch(&buckets_[home]);
    __builtin_prefetch(&buckets_[NextLine(home)]);
  }
  // Prefetches, for writing, the line an Insert of key starts at.
  void PrefetchInsert(int64_t key) const { PrefetchLine(&buckets_[HomeLine(key)]); }
  inline int64_t ProbeFrom(size_t home, int64_t key) const;

  // Makes room for `keys` keys in all without growing again; kCapacity past
  // 4294967294, kOutOfMemory (nothing changed) when the grown array cannot be had.
  Status Reserve(int64_t keys);
  // Adds key -> row; key must be missing, and Reserve(size() + 1) must have
  // succeeded: allocates nothing.
  void Insert(int64_t key, uint32_t row) {
    PlaceFrom(HomeLine(key), key, row);
    ++size_;
  }
  // Removes key; false (and *row unchanged) when missing. Allocates nothing.
  bool Erase(int64_t key, uint32_t* row);

  // Calls fn(key, row) for every stored key, in slot order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (const BucketLine& line : buckets_) {
      for (int s = 0; s < kSlotsPerLine; ++s) {
        if (line.row[s] != kEmpty) fn(line.key[s], line.row[s]);
      }
    }
  }
  // A cursor over the slots, for scans that stop and resume (checkpoints): slot s
  // in [0, SlotCount()) holds a key when SlotRow(s) != kEmpty. Stable while the
  // index does not change.
  int64_t SlotCount() const { return static_cast<int64_t>(lines_) * kSlotsPerLine; }
  int64_t SlotKey(int64_t s) const {
    return buckets_[static_cast<size_t>(s / kSlotsPerLine)].key[s % kSlotsPerLine];
  }
  uint32_t SlotRow(int64_t s) const {
    return buckets_[static_cast<size_t>(s / kSlotsPerLine)].row[s % kSlotsPerLine];
  }
  // Prefetches slot s's line (pipelines over SlotKey/SlotRow of scattered slots).
  void PrefetchSlot(int64_t s) const {
    PrefetchLine(&buckets_[static_cast<size_t>(s / kSlotsPerLine)]);
  }
  // Moves the key in slot s (which holds one) to another row slot.
  void SetSlotRow(int64_t s, uint32_t row) {
    buckets_[static_cast<size_t>(s / kSlotsPerLine)].row[s % kSlotsPerLine] = row;
  }
  // Bytes Reserve(keys) would add (0 when the index has room).
  int64_t GrowthBytes(int64_t keys) const;

 private:
  // Open addressing with linear probing over 64-byte lines of five (key, row)
  // slots, and a key probes its home line first. A lookup of a stored key then
  // reads one cache line of the map: 12-byte buckets probed one by one spilled
  // into a second line (straddling buckets, 2.2 buckets per probe at load 0.7)
  // for about a third of the keys, a dependent cache miss. A line is an
  // unordered set of slots; a key lives in the first line from its home that
  // had a free slot when it was inserted, so a search ends at the first line
  // with a free slot. Keys and rows apart within the line so that one compare
  // tests several keys (SSE2 below). 64 bytes for 5 slots: 6.7% more map bytes
  // than 12-byte buckets.
  static constexpr int kSlotsPerLine = 5;
  struct alignas(64) BucketLine {
    int64_t key[kSlotsPerLine];
    uint32_t row[kSlotsPerLine];  // kEmpty: a free slot (its key is stale)
    uint32_t unused;
  };
  static_assert(sizeof(BucketLine) == 64, "a bucket line is one cache line");

  // ProbeFrom slot by slot (a key not in its home line, or a stale match).
  int64_t ProbeSlowly(size_t line, int64_t key) const;
  // Line and slot of a stored key probing slot by slot from `from` (its home
  // line or a later one); false when missing.
  bool FindSlotFrom(size_t from, int64_t key, size_t* line, int* slot) const;
  // Puts (key, row) into the first free slot from `home`, which must be HomeLine(key).
  void PlaceFrom(size_t home, int64_t key, uint32_t row) {
    while (true) {
      BucketLine& line = buckets_[home];
      for (int s = 0; s < kSlotsPerLine; ++s) {
        if (line.row[s] == kEmpty) {
          line.key[s] = key;
          line.row[s] = row;
          return;
        }
      }
      home = NextLine(home);
    }
  }
  void Rehash(int64_t new_lines);
  size_t NextLine(size_t line) const { return line + 1 == lines_ ? 0 : line + 1; }
  // Probe steps from line `from` forward to line `to` (cyclic).
  size_t Distance(size_t from, size_t to) const {
    return to >= from ? to - from : to + lines_ - from;
  }

  // lines_ = buckets_.size(), any value (HomeLine maps the hash onto it by multiply-shift).
  std::vector<BucketLine, HugePageAllocator<BucketLine>> buckets_;
  uint64_t lines_ = 0;
  int64_t size_ = 0;
};

// Inlined into the lookup's per-key pipeline: GCC made it a call there.
inline __attribute__((always_inline)) int64_t KeyIndex::ProbeFrom(size_t home,
                                                                  int64_t key) const {
  // One compare of the five keys and no branch on where the key sits: with a
  // branch per slot (mispredicted about once a key) and 12-byte buckets, the
  // probe of a dim-8 lookup cost twice the row copy. A matching slot can be
  // free (a removed key's stale copy): the slow path sorts that out.
  const BucketLine& line = buckets_[home];
#if defined(__SSE2__)
  const __m128i wanted = _mm_set1_epi64x(key);
  __m128i low = _mm_cmpeq_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(line.key)), wanted);
  __m128i high =
      _mm_cmpeq_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(line.key + 2)), wanted);
  // A key matches when both of its 32-bit halves do.
  low = _mm_and_si128(low, _mm_shuffle_epi32(low, _MM_SHUFFLE(2, 3, 0, 1)));
  high = _mm_and_si128(high, _mm_shuffle_epi32(high, _MM_SHUFFLE(2, 3, 0, 1)));
  const uint32_t matches = static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(low))) |
                           static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(high))) << 2 |
                           static_cast<uint32_t>(line.key[4] == key) << 4;
#else
  uint32_t matches = 0;
  for (int s = 0; s < kSlotsPerLine; ++s) {
    matches |= static_cast<uint32_t>(line.key[s] == key) << s;
  }
#endif
  if (matches != 0) {
    const uint32_t row = line.row[__builtin_ctz(matches)];
    if (row != kEmpty) return row;
  }
  return ProbeSlowly(home, key);
}

}  // namespace kvsparse

#endif  // KVSPARSE_KEY_INDEX_H_
