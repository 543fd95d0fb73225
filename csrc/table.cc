// EmbeddingTable: creation, memory, inserting / assigning / removing rows and the
// optimizer (table.h).
#include "table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "parallel.h"
#include "table_internal.h"
#include "table_tier.h"

namespace kvsparse {

using table_internal::kMinInitFloatsPerThread;
using table_internal::kMaxRowStateFloats;
using table_internal::RowsPerChunkLog2;
using table_internal::KeepsMaster;
using table_internal::ValidStorage;

EmbeddingTable::EmbeddingTable(const TableConfig& config)
    : config_(config), optimizer_(config.optimizer) {
  const int64_t log2 = RowsPerChunkLog2(config.dim);
  values_.Reset(config.value_type, config.dim, log2);
  slots_.Reset(config.slot_type, config.dim * optimizer_.num_slots(), log2);
  master_.Reset(KeepsMaster(config.optimizer, config.value_type) ? config.dim : 0, log2);
  half_ = !values_.is_f32() || !slots_.is_f32();
  row_meta_.Reset(2, log2);
  policy_.Configure(config.policy, log2);
  initial_rows_.Configure(config.dim);
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
  s = ValidatePolicy(config.policy);
  if (!s.ok()) return s;
  if (!ValidStorage(config.value_type) || !ValidStorage(config.slot_type)) {
    return Status(StatusCode::kInvalidArgument,
                  "a table stores float32, float16 or bfloat16 values and slots");
  }
  try {
    out->reset(new EmbeddingTable(config));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory creating a table");
  }
  return Status::Ok();
}

int64_t EmbeddingTable::MemoryBytes() const {
  return index_.Bytes() + static_cast<int64_t>(free_rows_.capacity() * sizeof(uint32_t)) +
         values_.Bytes() + slots_.Bytes() + master_.Bytes() + row_meta_.Bytes() +
         static_cast<int64_t>(removed_.capacity() * sizeof(removed_[0])) + policy_.Bytes() +
         ScratchBytes() + static_cast<int64_t>(sizeof(EmbeddingTable));
}

int64_t EmbeddingTable::ScratchBytes() const {
  return static_cast<int64_t>(push_fresh_state_.bytes() + push_saved_state_.bytes() +
                              push_saved_meta_.bytes()) +
         initial_rows_.Bytes();
}

void EmbeddingTable::InitRowSlots(int64_t row) {
  if (optimizer_.num_slots() > 0) {
    if (slots_.is_f32()) {
      optimizer_.InitSlots(slots_.F32Row(row), config_.dim);
    } else {
      float initial[kMaxRowStateFloats];
      optimizer_.InitSlots(initial, config_.dim);
      slots_.Write(row, initial);
    }
  }
  *StepOf(row) = 0;
  *StampOf(row) = change_epoch_;
}

void EmbeddingTable::FillNewRows(const int64_t* keys, const int64_t* rows, int64_t n) {
  if (n <= 0) return;
  const int64_t dim = config_.dim;
  // Distinct rows: ranges never overlap.
  ParallelFor(n, std::max<int64_t>(1, kMinInitFloatsPerThread / dim),
              [&](int64_t begin, int64_t end) {
                constexpr int64_t kRowsPerCall = 128;
                float* targets[kRowsPerCall];
                if (!values_.is_f32()) {
                  // Generated in float32, then rounded into the 16-bit rows.
                  float generated[kMaxDim];
                  for (int64_t i = begin; i < end; ++i) {
                    float* target = generated;
                    FillInitialRows(config_.initializer, keys + i, 1, dim, &target);
                    if (has_master()) {
                      std::memcpy(master_.Row(rows[i]), generated, sizeof(float) * dim);
                    }
                    values_.Write(rows[i], generated);
                  }
                  return;
                }
                for (int64_t i = begin; i < end; i += kRowsPerCall) {
                  const int64_t count = std::min(kRowsPerCall, end - i);
                  for (int64_t k = 0; k < count; ++k) targets[k] = values_.F32Row(rows[i + k]);
                  FillInitialRows(config_.initializer, keys + i, count, dim, targets);
                }
              });
}

Status EmbeddingTable::FindOrInsertRow(int64_t key, int64_t* row_out, bool* inserted) {
  *inserted = false;
  const int64_t found = index_.Find(key);
  if (found >= 0) {
    *row_out = found;
    return Status::Ok();
  }
  // Callers index_.Reserve() first, so the load factor holds after this insert.
  if (free_rows_.empty()) {
    try {
      EnsureRowsUpTo(next_row_);
    } catch (const std::bad_alloc&) {
      return Status(StatusCode::kOutOfMemory, "out of memory adding rows");
    }
  }
  *row_out = InsertReservedRow(key);
  *inserted = true;
  return Status::Ok();
}

bool EmbeddingTable::PrefaultAhead(int64_t max_bytes) {
  if (tier_ != nullptr) return false;  // a budgeted table grows only as the budget allows
  const int64_t chunk_rows = int64_t{1} << RowsPerChunkLog2(config_.dim);
  // Not while chunk 0 holds every row: it grows by moving them, doubling, so
  // that a small table stays small; a table that small has nothing to gain.
  if (!prefault_works_ || next_row_ < chunk_rows) return false;
  const int64_t begin = std::max(prefaulted_, next_row_);
  if (begin >= prefault_target_) return false;
  const int64_t row_bytes =
      values_.row_bytes() + slots_.row_bytes() + master_.width() * 4 + 8 + 8;
  const int64_t end = std::min(prefault_target_, begin + std::max<int64_t>(1, max_bytes / row_bytes));
  try {
    EnsureRowsUpTo(end - 1);
  } catch (const std::bad_alloc&) {
    prefault_target_ = 0;  // the next push allocates (and reports) what it needs
    return false;
  }
  prefault_works_ = values_.Populate(begin, end) && slots_.Populate(begin, end) &&
                    master_.Populate(begin, end) && row_meta_.Populate(begin, end) &&
                    policy_.Populate(begin, end);
  prefaulted_ = end;
  return prefault_works_;
}

void EmbeddingTable::EnsureRowsUpTo(int64_t row) {
  values_.EnsureRow(row);
  slots_.EnsureRow(row);
  if (has_master()) master_.EnsureRow(row);
  row_meta_.EnsureRow(row);
  policy_.EnsureRow(row);
}

int64_t EmbeddingTable::InsertReservedRow(int64_t key, bool init_slots) {
  int64_t row;
  if (!free_rows_.empty()) {
    row = free_rows_.back();
    free_rows_.pop_back();
  } else {
    row = next_row_++;
  }
  index_.Insert(key, static_cast<uint32_t>(row));
  if (init_slots) {
    InitRowSlots(row);
  } else {
    *StepOf(row) = 0;
    *StampOf(row) = change_epoch_;
  }
  policy_.InitRow(row, table_step_);
  return row;
}

Status EmbeddingTable::SetOptimizer(const OptimizerConfig& optimizer) {
  Status s = ValidateOptimizer(optimizer);
  if (!s.ok()) return s;
  // Every row gets wider: the scope moves rows out to fit when it closes.
  TierScope scope(this);
  const int old_slots = optimizer_.num_slots();
  const bool old_master = has_master();
  Optimizer next(optimizer);
  const int64_t log2 = RowsPerChunkLog2(config_.dim);
  RowArray slots;
  slots.Reset(config_.slot_type, config_.dim * next.num_slots(), log2);
  const bool keep_master = KeepsMaster(optimizer, config_.value_type);
  const bool new_master = keep_master && !has_master();
  ChunkedRows<float> master;
  master.Reset(new_master ? config_.dim : 0, log2);
  try {
    if (next_row_ > 0) slots.EnsureRow(next_row_ - 1);
    if (next_row_ > 0 && new_master) master.EnsureRow(next_row_ - 1);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory resizing optimizer slots");
  }
  config_.optimizer = optimizer;
  optimizer_ = next;
  slots_ = std::move(slots);
  if (!keep_master || new_master) master_ = std::move(master);
  if (new_master) {
    index_.ForEach([&](int64_t, uint32_t row) { values_.Read(row, master_.Row(row)); });
  }
  table_step_ = 0;
  index_.ForEach([&](int64_t, uint32_t row) { InitRowSlots(row); });
  // Ages count from the table step, which restarts at 0.
  policy_.ResetSteps(index_);
  return MigrateDiskRows(old_slots, old_master);
}

Status EmbeddingTable::SetLearningRate(double learning_rate) {
  OptimizerConfig next = config_.optimizer;
  next.learning_rate = learning_rate;
  Status s = ValidateOptimizer(next);
  if (!s.ok()) return s;
  config_.optimizer = next;
  optimizer_ = Optimizer(next);
  return Status::Ok();
}

Status EmbeddingTable::Assign(const int64_t* keys, int64_t n, const float* values) {
  // A tiered table takes a batch larger than its budget could hold at once
  // (a serving replica's load) piece by piece, in order (the last of a
  // duplicated id still wins); a disk error then leaves the pieces before it.
  // Each piece has its scope: the budget is settled between them.
  const int64_t piece = TierBatchRows();
  if (n > piece) {
    for (int64_t begin = 0; begin < n; begin += piece) {
      Status s = Assign(keys + begin, std::min(piece, n - begin), values + begin * config_.dim);
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }
  TierScope scope(this);
  Status s = scope.Prepare(keys, n, /*insert=*/true);
  if (!s.ok()) return s;
  return AssignInMemory(keys, n, values);
}

Status EmbeddingTable::AssignInMemory(const int64_t* keys, int64_t n, const float* values) {
  Status s = index_.Reserve(index_.size() + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  for (int64_t i = 0; i < n; ++i) {
    // The value is overwritten at once: no initial value to generate.
    int64_t row = -1;
    bool inserted;
    s = FindOrInsertRow(keys[i], &row, &inserted);
    if (!s.ok()) return s;
    values_.Write(row, values + i * dim);
    if (has_master()) std::memcpy(master_.Row(row), values + i * dim, sizeof(float) * dim);
    *StampOf(row) = change_epoch_;
  }
  return Status::Ok();
}

int64_t EmbeddingTable::Remove(const int64_t* keys, int64_t n) {
  TierScope scope(this);
  // Room for the free list and the removal log first: std::bad_alloc then
  // leaves the table as it was, never a row both free and stored.
  int64_t present = 0;
  for (int64_t i = 0; i < n; ++i) present += index_.Find(keys[i]) >= 0;
  if (present == 0) return RemoveFromDisk(keys, n);
  free_rows_.reserve(free_rows_.size() + static_cast<size_t>(present));
  if (change_epoch_ > 1) removed_.reserve(removed_.size() + static_cast<size_t>(present));
  int64_t removed = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t row;
    if (!index_.Erase(keys[i], &row)) continue;
    free_rows_.push_back(row);
    // Epoch 1 means no checkpoint was saved or loaded yet: no delta can need
    // the removal, and a store that never checkpoints keeps no such list.
    if (change_epoch_ > 1) removed_.emplace_back(keys[i], change_epoch_);
    ++removed;
  }
  return removed + RemoveFromDisk(keys, n);
}

}  // namespace kvsparse
