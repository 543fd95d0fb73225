#include "table.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <string>

#include "batch.h"
#include "hash.h"
#include "parallel.h"

namespace kvsparse {

namespace {

// Keys probed per block: enough independent misses in flight to use the
// memory system's parallelism (about 10-12 line fill buffers per core).
constexpr int64_t kProbeBlock = 32;
constexpr int64_t kMinCapacity = 16;
// Below this many keys per thread, starting threads costs more than it saves.
constexpr int64_t kMinKeysPerThread = 16384;
// Rows per chunk: about 1 MiB of values per chunk, at least 64 rows, so the
// slack of the last chunk stays small next to the table.
int64_t RowsPerChunkLog2(int64_t row_floats) {
  int64_t log2 = 6;
  while (log2 < 20 && (int64_t{1} << (log2 + 1)) * row_floats * 4 <= (1 << 20)) ++log2;
  return log2;
}

std::string KeyText(int64_t key) { return std::to_string(key); }

}  // namespace

EmbeddingTable::EmbeddingTable(const TableConfig& config)
    : config_(config), optimizer_(config.optimizer) {
  const int64_t log2 = RowsPerChunkLog2(config.dim);
  values_.Reset(config.dim, log2);
  slots_.Reset(config.dim * optimizer_.num_slots(), log2);
  steps_.Reset(1, log2);
  Rehash(kMinCapacity);
}

Status EmbeddingTable::Create(const TableConfig& config, std::unique_ptr<EmbeddingTable>* out) {
  if (config.dim < 1 || config.dim > kMaxDim) {
    return Status(StatusCode::kInvalidArgument,
                  "dim must be in [1, 4096], got " + std::to_string(config.dim));
  }
  Status s = ValidateInitializer(config.initializer);
  if (!s.ok()) return s;
  s = ValidateOptimizer(config.optimizer);
  if (!s.ok()) return s;
  try {
    out->reset(new EmbeddingTable(config));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory creating a table");
  }
  return Status::Ok();
}

int64_t EmbeddingTable::MemoryBytes() const {
  return static_cast<int64_t>(buckets_.capacity() * sizeof(Bucket) +
                              free_rows_.capacity() * sizeof(uint32_t)) +
         values_.Bytes() + slots_.Bytes() + steps_.Bytes() +
         static_cast<int64_t>(sizeof(EmbeddingTable));
}

size_t EmbeddingTable::HomeBucket(int64_t key) const {
  return static_cast<size_t>(Mix64(static_cast<uint64_t>(key)) & mask_);
}

int64_t EmbeddingTable::FindRow(int64_t key) const {
  size_t b = HomeBucket(key);
  while (true) {
    const Bucket& bucket = buckets_[b];
    if (bucket.row == kEmpty) return -1;
    if (bucket.key == key) return bucket.row;
    b = (b + 1) & mask_;
  }
}

void EmbeddingTable::FindRows(const int64_t* keys, int64_t n, int64_t* rows) const {
  size_t home[kProbeBlock];
  for (int64_t start = 0; start < n; start += kProbeBlock) {
    const int64_t count = std::min(kProbeBlock, n - start);
    for (int64_t i = 0; i < count; ++i) {
      home[i] = HomeBucket(keys[start + i]);
      __builtin_prefetch(&buckets_[home[i]]);
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t key = keys[start + i];
      size_t b = home[i];
      int64_t row = -1;
      while (buckets_[b].row != kEmpty) {
        if (buckets_[b].key == key) {
          row = buckets_[b].row;
          break;
        }
        b = (b + 1) & mask_;
      }
      rows[start + i] = row;
    }
  }
}

void EmbeddingTable::Rehash(int64_t new_capacity) {
  std::vector<Bucket> old;
  old.swap(buckets_);
  buckets_.assign(static_cast<size_t>(new_capacity), Bucket{0, kEmpty});
  mask_ = static_cast<uint64_t>(new_capacity - 1);
  for (const Bucket& bucket : old) {
    if (bucket.row == kEmpty) continue;
    size_t b = HomeBucket(bucket.key);
    while (buckets_[b].row != kEmpty) b = (b + 1) & mask_;
    buckets_[b] = bucket;
  }
}

Status EmbeddingTable::Reserve(int64_t rows_needed) {
  if (rows_needed >= static_cast<int64_t>(kEmpty)) {
    return Status(StatusCode::kCapacity,
                  "a shard holds at most 4294967294 rows; add servers to grow further");
  }
  // Load factor <= 3/4 keeps linear probing short.
  int64_t capacity = static_cast<int64_t>(buckets_.size());
  if (rows_needed * 4 <= capacity * 3) return Status::Ok();
  while (rows_needed * 4 > capacity * 3) capacity *= 2;
  try {
    Rehash(capacity);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory growing the table");
  }
  return Status::Ok();
}

void EmbeddingTable::InitRowSlots(int64_t row) {
  if (optimizer_.num_slots() > 0) optimizer_.InitSlots(slots_.Row(row), config_.dim);
  *steps_.Row(row) = 0;
}

void EmbeddingTable::InitRow(int64_t row, int64_t key) {
  FillInitialRow(config_.initializer, key, config_.dim, values_.Row(row));
  InitRowSlots(row);
}

Status EmbeddingTable::FindOrInsertRow(int64_t key, int64_t* row_out) {
  size_t b = HomeBucket(key);
  while (true) {
    const Bucket& bucket = buckets_[b];
    if (bucket.row == kEmpty) break;
    if (bucket.key == key) {
      *row_out = bucket.row;
      return Status::Ok();
    }
    b = (b + 1) & mask_;
  }
  // Callers Reserve() first, so the load factor holds after this insert.
  int64_t row;
  if (!free_rows_.empty()) {
    row = free_rows_.back();
    free_rows_.pop_back();
  } else {
    row = next_row_;
    try {
      values_.EnsureRow(row);
      slots_.EnsureRow(row);
      steps_.EnsureRow(row);
    } catch (const std::bad_alloc&) {
      return Status(StatusCode::kOutOfMemory, "out of memory adding rows");
    }
    ++next_row_;
  }
  buckets_[b] = Bucket{key, static_cast<uint32_t>(row)};
  ++size_;
  InitRow(row, key);
  *row_out = row;
  return Status::Ok();
}

Status EmbeddingTable::SetOptimizer(const OptimizerConfig& optimizer) {
  Status s = ValidateOptimizer(optimizer);
  if (!s.ok()) return s;
  Optimizer next(optimizer);
  ChunkedRows<float> slots;
  slots.Reset(config_.dim * next.num_slots(), RowsPerChunkLog2(config_.dim));
  try {
    if (next_row_ > 0) slots.EnsureRow(next_row_ - 1);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory resizing optimizer slots");
  }
  config_.optimizer = optimizer;
  optimizer_ = next;
  slots_ = std::move(slots);
  table_step_ = 0;
  for (const Bucket& bucket : buckets_) {
    if (bucket.row != kEmpty) InitRowSlots(bucket.row);
  }
  return Status::Ok();
}

void EmbeddingTable::InitialValues(const int64_t* keys, int64_t n, float* out) const {
  for (int64_t i = 0; i < n; ++i) {
    FillInitialRow(config_.initializer, keys[i], config_.dim, out + i * config_.dim);
  }
}

void EmbeddingTable::LookupRange(const int64_t* keys, int64_t n, float* out) const {
  const int64_t dim = config_.dim;
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(dim);
  int64_t rows[kProbeBlock];
  for (int64_t start = 0; start < n; start += kProbeBlock) {
    const int64_t count = std::min(kProbeBlock, n - start);
    FindRows(keys + start, count, rows);
    for (int64_t i = 0; i < count; ++i) {
      if (rows[i] >= 0) __builtin_prefetch(values_.Row(rows[i]));
    }
    for (int64_t i = 0; i < count; ++i) {
      float* dst = out + (start + i) * dim;
      if (rows[i] >= 0) {
        std::memcpy(dst, values_.Row(rows[i]), row_bytes);
      } else {
        FillInitialRow(config_.initializer, keys[start + i], dim, dst);
      }
    }
  }
}

Status EmbeddingTable::Lookup(const int64_t* keys, int64_t n, float* out) const {
  // Read-only: ranges of the batch can be served by different threads.
  ParallelFor(n, kMinKeysPerThread, [&](int64_t begin, int64_t end) {
    LookupRange(keys + begin, end - begin, out + begin * config_.dim);
  });
  return Status::Ok();
}

Status EmbeddingTable::LookupOrInsert(const int64_t* keys, int64_t n, float* out) {
  Status s = Reserve(size_ + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(dim);
  for (int64_t i = 0; i < n; ++i) {
    int64_t row;
    s = FindOrInsertRow(keys[i], &row);
    if (!s.ok()) return s;
    std::memcpy(out + i * dim, values_.Row(row), row_bytes);
  }
  return Status::Ok();
}

Status EmbeddingTable::ApplyGradients(const int64_t* keys, int64_t n, const float* grads,
                                      NonFinitePolicy policy, int64_t* applied) {
  *applied = 0;
  const int64_t dim = config_.dim;
  std::vector<int64_t> unique;
  std::vector<int64_t> inverse(static_cast<size_t>(n));
  std::vector<float> summed;
  try {
    UniqueWithInverse(keys, n, &unique, inverse.data());
    summed.resize(unique.size() * static_cast<size_t>(dim));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory summing gradients");
  }
  const int64_t u = static_cast<int64_t>(unique.size());
  const float* g = grads;
  if (u != n) {
    SumRowsByIndex(grads, inverse.data(), n, dim, u, summed.data());
    g = summed.data();
  }
  // Validate everything before the first write: a rejected batch changes nothing.
  const int64_t bad = FirstNonFiniteRow(g, u, dim);
  if (bad >= 0 && policy == NonFinitePolicy::kReject) {
    return Status(StatusCode::kNonFinite,
                  "gradient for id " + KeyText(unique[bad]) + " has a NaN or inf value");
  }
  Status s = Reserve(size_ + u);
  if (!s.ok()) return s;
  // Pass 1 (serial: it may insert): the row of every distinct key.
  std::vector<int64_t> rows(static_cast<size_t>(u));
  FindRows(unique.data(), u, rows.data());
  for (int64_t j = 0; j < u; ++j) {
    if (rows[j] >= 0) continue;
    if (bad >= 0 && FirstNonFiniteRow(g + j * dim, 1, dim) >= 0) continue;  // never inserted
    s = FindOrInsertRow(unique[j], &rows[j]);
    if (!s.ok()) return s;
  }
  // Pass 2 (parallel: distinct rows never overlap): the optimizer.
  ++table_step_;
  const bool per_table = config_.optimizer.step_mode == StepMode::kPerTable;
  const int64_t table_step = table_step_;
  std::atomic<int64_t> applied_total{0};
  ParallelFor(u, kMinKeysPerThread / 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(dim));
    int64_t count = 0;
    for (int64_t j = begin; j < end; ++j) {
      const float* gj = g + j * dim;
      if (bad >= 0 && FirstNonFiniteRow(gj, 1, dim) >= 0) continue;
      const int64_t row = rows[j];
      uint32_t* step = steps_.Row(row);
      if (*step < UINT32_MAX) *step += 1;  // saturate: a wrap to 0 would break Adam
      optimizer_.Update(values_.Row(row), slots_.Row(row), gj, dim,
                        per_table ? table_step : static_cast<int64_t>(*step), scratch.data());
      ++count;
    }
    applied_total += count;
  });
  *applied = applied_total.load();
  return Status::Ok();
}

Status EmbeddingTable::Assign(const int64_t* keys, int64_t n, const float* values) {
  Status s = Reserve(size_ + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(dim);
  for (int64_t i = 0; i < n; ++i) {
    int64_t row;
    s = FindOrInsertRow(keys[i], &row);
    if (!s.ok()) return s;
    std::memcpy(values_.Row(row), values + i * dim, row_bytes);
  }
  return Status::Ok();
}

int64_t EmbeddingTable::Remove(const int64_t* keys, int64_t n) {
  int64_t removed = 0;
  for (int64_t i = 0; i < n; ++i) {
    size_t b = HomeBucket(keys[i]);
    while (buckets_[b].row != kEmpty && buckets_[b].key != keys[i]) b = (b + 1) & mask_;
    if (buckets_[b].row == kEmpty) continue;
    free_rows_.push_back(buckets_[b].row);
    buckets_[b].row = kEmpty;
    --size_;
    ++removed;
    // Backward-shift deletion keeps every remaining key reachable from its
    // home bucket without tombstones.
    size_t hole = b;
    size_t j = (b + 1) & mask_;
    while (buckets_[j].row != kEmpty) {
      const size_t home = HomeBucket(buckets_[j].key);
      // Move j into the hole unless its home lies cyclically in (hole, j].
      const bool home_after_hole = ((j - home) & mask_) < ((j - hole) & mask_);
      if (!home_after_hole) {
        buckets_[hole] = buckets_[j];
        buckets_[j].row = kEmpty;
        hole = j;
      }
      j = (j + 1) & mask_;
    }
  }
  return removed;
}

Status EmbeddingTable::ReadState(const int64_t* keys, int64_t n, float* values, float* slots,
                                 int64_t* steps) const {
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = FindRow(keys[i]);
    if (row < 0) {
      return Status(StatusCode::kInvalidArgument, "id " + KeyText(keys[i]) + " is not in the table");
    }
    std::memcpy(values + i * dim, values_.Row(row), sizeof(float) * dim);
    if (slot_floats > 0) {
      std::memcpy(slots + i * slot_floats, slots_.Row(row), sizeof(float) * slot_floats);
    }
    steps[i] = static_cast<int64_t>(*steps_.Row(row));
  }
  return Status::Ok();
}

Status EmbeddingTable::WriteState(const int64_t* keys, int64_t n, const float* values,
                                  const float* slots, const int64_t* steps) {
  for (int64_t i = 0; i < n; ++i) {
    if (steps[i] < 0 || steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument,
                    "step counter of id " + KeyText(keys[i]) + " is out of range");
    }
  }
  Status s = Reserve(size_ + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  for (int64_t i = 0; i < n; ++i) {
    int64_t row;
    s = FindOrInsertRow(keys[i], &row);
    if (!s.ok()) return s;
    std::memcpy(values_.Row(row), values + i * dim, sizeof(float) * dim);
    if (slot_floats > 0) {
      std::memcpy(slots_.Row(row), slots + i * slot_floats, sizeof(float) * slot_floats);
    }
    *steps_.Row(row) = static_cast<uint32_t>(steps[i]);
  }
  return Status::Ok();
}

int64_t EmbeddingTable::NextKeys(int64_t* cursor, int64_t max_rows, int64_t* keys_out) const {
  int64_t count = 0;
  const int64_t capacity = static_cast<int64_t>(buckets_.size());
  int64_t b = *cursor;
  for (; b < capacity && count < max_rows; ++b) {
    if (buckets_[b].row != kEmpty) keys_out[count++] = buckets_[b].key;
  }
  *cursor = b;
  return count;
}

}  // namespace kvsparse
