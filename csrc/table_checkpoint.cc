// EmbeddingTable: full row state for checkpoints, the scans over stored and changed rows,
// and the log of removals (table.h).
#include "table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "table_internal.h"
#include "table_tier.h"

namespace kvsparse {

using table_internal::KeyText;

void EmbeddingTable::ReadRowState(int64_t row, float* values, float* slots,
                                  int64_t* step) const {
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  values_.Read(row, values);
  if (slot_floats > 0) slots_.Read(row, slots);
  if (has_master()) {
    std::memcpy(slots + slot_floats, master_.Row(row), sizeof(float) * dim);
  }
  *step = static_cast<int64_t>(*StepOf(row));
}

Status EmbeddingTable::ReadState(const int64_t* keys, int64_t n, float* values, float* slots,
                                 int64_t* steps) const {
  const int64_t dim = config_.dim;
  std::vector<int64_t> missing;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = index_.Find(keys[i]);
    if (row < 0) {
      if (tier_ == nullptr) return NotStored(keys[i]);
      missing.push_back(i);
      continue;
    }
    ReadRowState(row, values + i * dim, slots + i * dim * num_slots(), steps + i);
  }
  if (missing.empty()) return Status::Ok();
  // Rows on disk: read through, in one batch.
  const int64_t m = static_cast<int64_t>(missing.size());
  const int64_t slot_floats = dim * num_slots();
  std::vector<int64_t> disk_keys(static_cast<size_t>(m)), disk_steps(static_cast<size_t>(m), -1);
  std::vector<float> disk_values(static_cast<size_t>(m * dim)),
      disk_slots(static_cast<size_t>(m * slot_floats));
  for (int64_t j = 0; j < m; ++j) disk_keys[j] = keys[missing[j]];
  Status s = ReadStateFromDisk(disk_keys.data(), m, disk_values.data(), disk_slots.data(),
                               disk_steps.data(), nullptr, nullptr);
  if (!s.ok()) return s;
  for (int64_t j = 0; j < m; ++j) {
    if (disk_steps[j] < 0) return NotStored(disk_keys[j]);
    const int64_t i = missing[j];
    std::memcpy(values + i * dim, disk_values.data() + j * dim, sizeof(float) * dim);
    if (slot_floats > 0) {
      std::memcpy(slots + i * slot_floats, disk_slots.data() + j * slot_floats,
                  sizeof(float) * slot_floats);
    }
    steps[i] = disk_steps[j];
  }
  return Status::Ok();
}

Status EmbeddingTable::NotStored(int64_t key) const {
  return Status(StatusCode::kInvalidArgument, "id " + KeyText(key) + " is not in the table");
}

Status EmbeddingTable::WriteState(const int64_t* keys, int64_t n, const float* values,
                                  const float* slots, const int64_t* steps) {
  for (int64_t i = 0; i < n; ++i) {
    if (steps[i] < 0 || steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument,
                    "step counter of id " + KeyText(keys[i]) + " is out of range");
    }
  }
  // A tiered table takes a large batch (a checkpoint's block) piece by piece,
  // each with its scope: the budget is settled between them.
  const int64_t piece = TierBatchRows();
  if (n > piece) {
    const int64_t row_slot_floats = config_.dim * num_slots();
    for (int64_t begin = 0; begin < n; begin += piece) {
      const int64_t count = std::min(piece, n - begin);
      Status s = WriteState(keys + begin, count, values + begin * config_.dim,
                            slots + begin * row_slot_floats, steps + begin);
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }
  TierScope scope(this);
  Status s = scope.Prepare(keys, n, /*insert=*/true);
  if (!s.ok()) return s;
  s = index_.Reserve(index_.size() + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  const int64_t row_slot_floats = dim * num_slots();  // the master last, if kept
  for (int64_t i = 0; i < n; ++i) {
    // Values, slots and step are all overwritten: no initial value to generate.
    int64_t row = -1;
    bool inserted;
    s = FindOrInsertRow(keys[i], &row, &inserted);
    if (!s.ok()) return s;
    values_.Write(row, values + i * dim);
    const float* row_slots = slots + i * row_slot_floats;
    if (slot_floats > 0) slots_.Write(row, row_slots);
    if (has_master()) {
      std::memcpy(master_.Row(row), row_slots + slot_floats, sizeof(float) * dim);
    }
    *StepOf(row) = static_cast<uint32_t>(steps[i]);
    *StampOf(row) = change_epoch_;
  }
  return Status::Ok();
}

// The scans run over the memory slots (cursor >= 0) and then over the disk
// tier (NextDiskRows: cursor < 0).
int64_t EmbeddingTable::NextKeys(int64_t* cursor, int64_t max_rows, int64_t* keys_out) const {
  int64_t count = 0;
  const int64_t capacity = index_.SlotCount();
  int64_t b = *cursor;
  for (; b >= 0 && b < capacity && count < max_rows; ++b) {
    if (index_.SlotRow(b) != KeyIndex::kEmpty) keys_out[count++] = index_.SlotKey(b);
  }
  *cursor = b;
  if (count < max_rows && tier_ != nullptr) {
    count += NextDiskRows(cursor, max_rows - count, false, 0, keys_out + count, nullptr, nullptr,
                          nullptr);
  }
  return count;
}

int64_t EmbeddingTable::NextChangedKeys(int64_t* cursor, int64_t max_rows, uint32_t since,
                                        int64_t* keys_out) const {
  int64_t count = 0;
  const int64_t capacity = index_.SlotCount();
  int64_t b = *cursor;
  for (; b >= 0 && b < capacity && count < max_rows; ++b) {
    const uint32_t row = index_.SlotRow(b);
    if (row != KeyIndex::kEmpty && *StampOf(row) > since) keys_out[count++] = index_.SlotKey(b);
  }
  *cursor = b;
  if (count < max_rows && tier_ != nullptr) {
    count += NextDiskRows(cursor, max_rows - count, true, since, keys_out + count, nullptr,
                          nullptr, nullptr);
  }
  return count;
}

int64_t EmbeddingTable::NextChangedRows(int64_t* cursor, int64_t max_rows, uint32_t since,
                                        int64_t* keys_out, float* values, float* slots,
                                        int64_t* steps, bool memory_only) const {
  const int64_t dim = config_.dim;
  int64_t count = 0;
  const int64_t capacity = index_.SlotCount();
  int64_t b = *cursor;
  for (; b >= 0 && b < capacity && count < max_rows; ++b) {
    const uint32_t row = index_.SlotRow(b);
    if (row == KeyIndex::kEmpty || *StampOf(row) <= since) continue;
    keys_out[count] = index_.SlotKey(b);
    ReadRowState(row, values + count * dim, slots + count * dim * num_slots(), steps + count);
    ++count;
  }
  *cursor = b;
  if (count < max_rows && tier_ != nullptr && !memory_only) {
    count += NextDiskRows(cursor, max_rows - count, true, since, keys_out + count,
                          values + count * dim, slots + count * dim * num_slots(), steps + count);
  }
  return count;
}

int64_t EmbeddingTable::RemovedSince(uint32_t since, int64_t* keys_out, int64_t capacity) const {
  int64_t count = 0;
  for (const auto& entry : removed_) {
    if (entry.second <= since) continue;
    if (count < capacity) keys_out[count] = entry.first;
    ++count;
  }
  return count;
}

void EmbeddingTable::PruneRemoved(uint32_t through) {
  removed_.erase(std::remove_if(removed_.begin(), removed_.end(),
                                [through](const std::pair<int64_t, uint32_t>& entry) {
                                  return entry.second <= through;
                                }),
                 removed_.end());
}

}  // namespace kvsparse
