// DiskCheckpointReader: reads the rows of a tiered table's checkpoint by
// reference (EmbeddingTable::FinishDiskCheckpoint: hard-linked run files and
// their MANIFEST) in place, without changing a byte of it.
//
// For the readers that cannot adopt the files as a disk tier
// (EmbeddingTable::AdoptDiskCheckpoint): a load onto another shard count, a
// table without a disk tier, a serving replica. Each record is decoded into
// the row's state as the table's checkpoint scans give it.
//
//   std::unique_ptr<kvsparse::DiskCheckpointReader> reader;
//   s = kvsparse::DiskCheckpointReader::Open(dir, /*dim=*/16, /*num_slots=*/1, &reader);
//   int64_t count;
//   do {
//     s = reader->Next(4096, keys, values, slots, steps, touches, last_steps, &count);
//   } while (s.ok() && count > 0);
//
// Thread-safety: not thread-safe (one cursor); one reader per thread.
#ifndef KVSPARSE_DISK_CHECKPOINT_H_
#define KVSPARSE_DISK_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "row_store.h"
#include "status.h"

namespace kvsparse {

// A row on disk (table_tier.cc's EncodeRow, and what this reader decodes):
// values (dim float32) | slots (num_slots * dim float32, the master last) |
// step | change stamp | touches | last step (uint32 each).
constexpr int64_t kRowRecordMetaBytes = 16;
inline int64_t RowRecordBytes(int64_t dim, int64_t num_slots) {
  return 4 * dim * (1 + num_slots) + kRowRecordMetaBytes;
}

class DiskCheckpointReader {
 public:
  // Opens directory's MANIFEST read-only for rows of dim values and num_slots
  // slot rows (the master copy counted, as EmbeddingTable::num_slots does).
  // kInvalidArgument if its records are of another width; kCorruption for a
  // missing or damaged MANIFEST.
  static Status Open(const std::string& directory, int64_t dim, int64_t num_slots,
                     std::unique_ptr<DiskCheckpointReader>* out);
  ~DiskCheckpointReader();

  int64_t rows() const { return rows_; }
  // Copies up to max_rows rows (keys, values dim floats each, slots
  // num_slots * dim floats each, steps, touches, last steps) and sets *count
  // (0 at the end). A page that fails its checksum is a kCorruption error
  // naming the file and page.
  Status Next(int64_t max_rows, int64_t* keys, float* values, float* slots, int64_t* steps,
              int64_t* touches, int64_t* last_steps, int64_t* count);

 private:
  DiskCheckpointReader() = default;
  std::unique_ptr<RowStore> store_;
  int64_t dim_ = 0;
  int64_t num_slots_ = 0;
  int64_t record_bytes_ = 0;
  int64_t rows_ = 0;
  uint64_t cursor_ = 0;
  std::vector<uint8_t> records_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_DISK_CHECKPOINT_H_
