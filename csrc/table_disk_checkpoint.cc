// EmbeddingTable: checkpoints of the disk tier by reference (table.h), and
// DiskCheckpointReader (disk_checkpoint.h), which reads one in place.
//
// A disk record's layout: disk_checkpoint.h (RowRecordBytes).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "disk_checkpoint.h"
#include "run_store.h"
#include "table.h"
#include "table_tier.h"

namespace kvsparse {

namespace {

std::string MiB(int64_t bytes) { return std::to_string((bytes + (1 << 19)) >> 20) + " MiB"; }

}  // namespace

bool EmbeddingTable::HasDiskStore() const { return tier_ != nullptr && tier_->store != nullptr; }

Status EmbeddingTable::LinkDiskCheckpoint(const std::string& directory) {
  if (!HasDiskStore()) {
    return Status(StatusCode::kInvalidArgument, "the table has no disk tier to link");
  }
  return tier_->store->LinkCheckpoint(directory);
}

Status EmbeddingTable::FinishDiskCheckpoint(const std::string& directory, int64_t* rows) const {
  if (!HasDiskStore()) {
    return Status(StatusCode::kInvalidArgument, "the table has no disk tier to checkpoint");
  }
  Status s = tier_->store->FinishCheckpoint(directory);
  if (!s.ok()) return s;
  *rows = tier_->disk_rows;
  return Status::Ok();
}

Status EmbeddingTable::AdoptDiskCheckpoint(const std::string& directory) {
  if (!HasDiskStore()) {
    return Status(StatusCode::kInvalidArgument,
                  "a checkpoint's rows on disk are adopted by a table with a disk tier only");
  }
  if (Size() != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "a checkpoint's rows on disk are adopted by an empty table only");
  }
  std::unique_ptr<RowStore> old = std::move(tier_->store);
  const std::string old_directory = tier_->StoreDirectory();
  ++tier_->generation;
  std::unique_ptr<RowStore> restored;
  Status s = RestoreRunStore(directory, tier_->StoreOptions(RecordBytes()), &restored);
  RowStoreStats stats;
  if (s.ok()) {
    stats = restored->Stats();
    const int64_t limit = tier_->config.budget->limit();
    if (MemoryBytes() + stats.index_bytes > limit) {
      s = Status(StatusCode::kLimitExceeded, "the index of the checkpoint's " +
                                                 std::to_string(stats.live_records) +
                                                 " rows on disk takes " + MiB(stats.index_bytes) +
                                                 ", more than the memory budget of " + MiB(limit) +
                                                 " holds beside the table; raise --memory-budget");
    }
  }
  std::error_code error;
  if (!s.ok()) {
    if (restored != nullptr) restored->Close();
    restored.reset();
    std::filesystem::remove_all(tier_->StoreDirectory(), error);
    --tier_->generation;
    tier_->store = std::move(old);
    return s;
  }
  old->Close();
  old.reset();
  std::filesystem::remove_all(old_directory, error);
  tier_->store = std::move(restored);
  tier_->record_bytes = RecordBytes();
  tier_->disk_rows = stats.live_records;
  ReportMemory();
  return Status::Ok();
}

Status DiskCheckpointReader::Open(const std::string& directory, int64_t dim, int64_t num_slots,
                                  std::unique_ptr<DiskCheckpointReader>* out) {
  if (dim < 1 || num_slots < 0) {
    return Status(StatusCode::kInvalidArgument, "a disk checkpoint's rows need dim >= 1");
  }
  std::unique_ptr<DiskCheckpointReader> reader(new DiskCheckpointReader());
  RunStoreOptions options;
  options.directory = directory;
  options.record_bytes = RowRecordBytes(dim, num_slots);
  options.read_only = true;
  options.read_threads = 1;
  Status s = OpenRunStore(options, &reader->store_);
  if (!s.ok()) return s;
  reader->dim_ = dim;
  reader->num_slots_ = num_slots;
  reader->record_bytes_ = options.record_bytes;
  reader->rows_ = reader->store_->Stats().live_records;
  *out = std::move(reader);
  return Status::Ok();
}

DiskCheckpointReader::~DiskCheckpointReader() {
  if (store_ != nullptr) store_->Close();
}

Status DiskCheckpointReader::Next(int64_t max_rows, int64_t* keys, float* values, float* slots,
                                  int64_t* steps, int64_t* touches, int64_t* last_steps,
                                  int64_t* count) {
  *count = 0;
  if (max_rows <= 0) return Status::Ok();
  records_.resize(static_cast<size_t>(max_rows * record_bytes_));
  int64_t got = 0;
  Status s = store_->Scan(&cursor_, max_rows, keys, records_.data(), &got);
  if (!s.ok()) return s;
  const int64_t slot_floats = dim_ * num_slots_;
  for (int64_t j = 0; j < got; ++j) {
    const uint8_t* record = records_.data() + j * record_bytes_;
    std::memcpy(values + j * dim_, record, sizeof(float) * dim_);
    if (slot_floats > 0) {
      std::memcpy(slots + j * slot_floats, record + 4 * dim_, sizeof(float) * slot_floats);
    }
    uint32_t meta[4];
    std::memcpy(meta, record + 4 * dim_ * (1 + num_slots_), sizeof(meta));
    steps[j] = meta[0];
    touches[j] = meta[2];
    last_steps[j] = meta[3];
  }
  *count = got;
  return Status::Ok();
}

}  // namespace kvsparse
