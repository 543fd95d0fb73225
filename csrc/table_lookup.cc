// EmbeddingTable: lookups, and the cache of the initial rows they generate for the push
// that follows (table.h).
#include "table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "half.h"
#include "parallel.h"
#include "table_internal.h"
#include "table_tier.h"

namespace kvsparse {

using table_internal::kMinKeysPerThread;
using table_internal::kMinInitFloatsPerThread;

void EmbeddingTable::InitialValues(const int64_t* keys, int64_t n, float* out) const {
  const int64_t dim = config_.dim;
  ParallelFor(n, std::max<int64_t>(1, kMinInitFloatsPerThread / dim),
              [&](int64_t begin, int64_t end) {
                FillInitialRows(config_.initializer, keys + begin, end - begin, dim,
                                out + begin * dim);
                // A 16-bit table's initial value is the rounded one it stores.
                for (int64_t i = begin; i < end && !values_.is_f32(); ++i) {
                  values_.Round(out + i * dim);
                }
              });
}

void EmbeddingTable::LookupRange(const int64_t* keys, int64_t n, float* out,
                                 uint8_t* missing) const {
  if (!values_.is_f32()) return LookupRangeFor<0, true>(keys, n, out, missing);
  // Fixed row sizes copy with inline moves instead of a memcpy call per row
  // (dim 8: 8% of a lookup was libc's memmove).
  switch (config_.dim) {
    case 4:
      return LookupRangeFor<4>(keys, n, out, missing);
    case 8:
      return LookupRangeFor<8>(keys, n, out, missing);
    case 16:
      return LookupRangeFor<16>(keys, n, out, missing);
    case 32:
      return LookupRangeFor<32>(keys, n, out, missing);
    case 64:
      return LookupRangeFor<64>(keys, n, out, missing);
    default:
      return LookupRangeFor<0>(keys, n, out, missing);
  }
}

template <int64_t kRowFloats, bool kHalf>
void EmbeddingTable::LookupRangeFor(const int64_t* keys, int64_t n, float* out,
                                    uint8_t* missing_out) const {
  const int64_t dim = kRowFloats > 0 ? kRowFloats : config_.dim;
  const size_t row_bytes = static_cast<size_t>(values_.row_bytes());
  // A pipeline over the keys: key i's bucket is prefetched kBucketAhead keys
  // before it is probed, and its row (prefetched by the probe) is copied
  // kRowAhead keys after that, so the two dependent cache misses of a key
  // overlap with other keys' misses. Per key, not per block: with blocks of
  // 32 the probe waited on its buckets (53% of a dim-8 lookup).
  constexpr int64_t kBucketAhead = 16;
  // Rows 32 keys ahead of their copy: with 16, the copy still waited on its
  // row (C++ harness, dim 8: 2.52 vs 2.94 ms and 2.22 vs 2.32 ms).
  constexpr int64_t kRowAhead = 32;
  constexpr int64_t kRing = 64;  // >= kBucketAhead + kRowAhead, a power of two
  static_assert(kBucketAhead + kRowAhead <= kRing, "ring too small");
  size_t home[kRing];
  int64_t rows[kRing];
  // Missing keys get their initial rows in one vectorized call per batch.
  constexpr int64_t kMissingBatch = 32;
  int64_t missing_keys[kMissingBatch];
  float* missing_rows[kMissingBatch];
  int64_t missing = 0;
  const int64_t row_lines = std::min<int64_t>(4, (static_cast<int64_t>(row_bytes) + 63) / 64);
  for (int64_t i = 0; i < n + kBucketAhead + kRowAhead; ++i) {
    if (i < n) {
      const size_t line = index_.HomeLine(keys[i]);
      home[i & (kRing - 1)] = line;
      // And the next line (0.60 -> 0.71x np.take's speed, dim 8, one thread).
      index_.PrefetchProbe(line);
    }
    const int64_t p = i - kBucketAhead;
    if (p >= 0 && p < n) {
      const int64_t row = index_.ProbeFrom(home[p & (kRing - 1)], keys[p]);
      rows[p & (kRing - 1)] = row;
      if (row >= 0) {
        const char* values = values_.RowAddress(row);
        for (int64_t line = 0; line < row_lines; ++line) __builtin_prefetch(values + 64 * line);
      }
    }
    const int64_t c = p - kRowAhead;
    if (c >= 0 && c < n) {
      const int64_t row = rows[c & (kRing - 1)];
      float* dst = out + c * dim;
      if (row >= 0) {
        if (kHalf) {
          WidenHalvesSerial(values_.kind(), values_.HalfRow(row), dim, dst);
        } else {
          std::memcpy(dst, values_.F32Row(row),
                      kRowFloats > 0 ? sizeof(float) * kRowFloats : row_bytes);
        }
      } else {
        if (missing_out != nullptr) missing_out[c] = 1;
        missing_keys[missing] = keys[c];
        missing_rows[missing++] = dst;
        if (missing == kMissingBatch) {
          FillInitialRows(config_.initializer, missing_keys, missing, dim, missing_rows);
          if (kHalf) {
            for (int64_t k = 0; k < missing; ++k) values_.Round(missing_rows[k]);
          }
          missing = 0;
        }
      }
    }
  }
  if (missing > 0) {
    FillInitialRows(config_.initializer, missing_keys, missing, dim, missing_rows);
    if (kHalf) {
      for (int64_t k = 0; k < missing; ++k) values_.Round(missing_rows[k]);
    }
  }
}

Status EmbeddingTable::Lookup(const int64_t* keys, int64_t n, float* out) const {
  // Settles when the lookup returns, after it read its rows: settling before
  // could move them out again.
  TierScope scope(this, TierScope::ForLookup{});
  bool promoted = false;
  if (scope.moves_rows() && DiskRowCount() > 0) {
    // A pull of rows on disk brings them back into memory, so that the push
    // that usually follows finds them there (a row is read from disk once,
    // not once per pull and again per push). A pull larger than the budget
    // reads its disk rows through instead, as does a pull that cannot move
    // rows out (a full disk).
    Status s = scope.Prepare(keys, n, /*insert=*/false);
    if (s.code() == StatusCode::kCorruption) return s;
    promoted = s.ok();
  }
  // Which keys missed, to keep their generated rows for the push that
  // usually follows; without room for the flags, the lookup just keeps none.
  std::vector<uint8_t> missing;
  if (CachesInitialRows()) {
    try {
      missing.assign(static_cast<size_t>(n), 0);
    } catch (const std::bad_alloc&) {
      missing.clear();
    }
  }
  uint8_t* flags = missing.empty() ? nullptr : missing.data();
  // Read-only: ranges of the batch can be served by different threads.
  ParallelFor(n, kMinKeysPerThread, [&](int64_t begin, int64_t end) {
    LookupRange(keys + begin, end - begin, out + begin * config_.dim,
                flags == nullptr ? nullptr : flags + begin);
  });
  if (flags != nullptr) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += flags[i];
    if (count > 0) {
      initial_rows_.Reserve(count);
      for (int64_t i = 0; i < n; ++i) {
        if (flags[i]) initial_rows_.Put(keys[i], out + i * config_.dim);
      }
    }
  }
  if (promoted || tier_ == nullptr) return Status::Ok();
  return LookupDisk(keys, n, out);
}

Status EmbeddingTable::PrefetchRows(const int64_t* keys, int64_t n, int64_t* read) {
  if (read != nullptr) *read = 0;
  if (tier_ == nullptr || tier_->config.concurrent_lookups || DiskRowCount() == 0 || n <= 0) {
    return Status::Ok();
  }
  // Settles when it returns, as a lookup that brought its rows in does: the
  // bookkeeping may have taken the shard past its budget (the disk index).
  TierScope scope(this);
  const int64_t before = tier_->stats.rows_read;
  Status s = scope.Prepare(keys, n, /*insert=*/false);
  if (read != nullptr) *read = tier_->stats.rows_read - before;
  return s;
}

void EmbeddingTable::FillInitialRowsCached(const int64_t* keys, int64_t n,
                                           float* const* targets) const {
  const int64_t dim = config_.dim;
  if (!CachesInitialRows()) {
    FillInitialRows(config_.initializer, keys, n, dim, targets);
    return;
  }
  constexpr int64_t kBlock = 128;
  int64_t generate_keys[kBlock];
  float* generate_targets[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t count = std::min(kBlock, n - i);
    int64_t generate = 0;
    for (int64_t k = 0; k < count; ++k) {
      const float* cached = initial_rows_.Find(keys[i + k]);
      if (cached != nullptr) {
        std::memcpy(targets[i + k], cached, sizeof(float) * static_cast<size_t>(dim));
      } else {
        generate_keys[generate] = keys[i + k];
        generate_targets[generate++] = targets[i + k];
      }
    }
    if (generate > 0) {
      FillInitialRows(config_.initializer, generate_keys, generate, dim, generate_targets);
    }
  }
}

Status EmbeddingTable::LookupOrInsert(const int64_t* keys, int64_t n, float* out) {
  TierScope scope(this);
  Status s = scope.Prepare(keys, n, /*insert=*/true);
  if (!s.ok()) return s;
  return LookupOrInsertInMemory(keys, n, out);
}

Status EmbeddingTable::LookupOrInsertInMemory(const int64_t* keys, int64_t n, float* out) {
  const int64_t dim = config_.dim;
  std::vector<int64_t> rows, new_keys, new_rows;
  try {
    rows.resize(static_cast<size_t>(n));
    new_keys.reserve(static_cast<size_t>(n));
    new_rows.reserve(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory inserting rows");
  }
  // Probe first (prefetched), then grow for the missing ids only: growing
  // for the whole batch would over-size the map for batches of known ids.
  index_.FindRows(keys, n, rows.data());
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) missing += rows[i] < 0;
  Status s = index_.Reserve(index_.size() + missing);
  if (!s.ok()) return s;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] >= 0) continue;
    bool inserted;
    s = FindOrInsertRow(keys[i], &rows[i], &inserted);
    if (inserted) {
      new_keys.push_back(keys[i]);
      new_rows.push_back(rows[i]);
    }
    if (!s.ok()) break;
  }
  // Rows inserted before a failure still get their values.
  FillNewRows(new_keys.data(), new_rows.data(), static_cast<int64_t>(new_keys.size()));
  if (!s.ok()) return s;
  for (int64_t i = 0; i < n; ++i) values_.Read(rows[i], out + i * dim);
  return Status::Ok();
}

}  // namespace kvsparse
