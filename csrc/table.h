// EmbeddingTable: a growing hash map from any int64 key to a row of `dim`
// float32 values, the optimizer's per-row slots and a per-row step counter.
//
// Rows live in fixed-size chunks, so growing never moves an existing row:
// only the bucket array is rehashed. All batch operations take plain arrays
// and return a Status; none touches Python, so the bridge calls them with the
// GIL released. A table is not thread-safe: one caller at a time (a server
// shard serves its requests in order).
//
//   kvsparse::TableConfig config;
//   config.dim = 64;
//   config.initializer.kind = kvsparse::InitializerKind::kNormal;
//   config.initializer.b = 0.01;
//   config.optimizer.kind = kvsparse::OptimizerKind::kAdagrad;
//   std::unique_ptr<kvsparse::EmbeddingTable> table;
//   kvsparse::Status s = kvsparse::EmbeddingTable::Create(config, &table);
//   s = table->LookupOrInsert(keys, n, out);             // out: n * 64 floats
//   s = table->ApplyGradients(keys, n, grads, kvsparse::NonFinitePolicy::kReject, &applied);
#ifndef KVSPARSE_TABLE_H_
#define KVSPARSE_TABLE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "initializer.h"
#include "optimizer.h"
#include "status.h"

namespace kvsparse {

constexpr int64_t kMaxDim = 4096;

struct TableConfig {
  int64_t dim = 0;
  InitializerConfig initializer;
  OptimizerConfig optimizer;
};

enum class NonFinitePolicy : int {
  kReject = 0,  // the whole batch fails, nothing is applied
  kSkip = 1,    // rows whose gradient has a NaN/inf are left untouched
};

// Chunked array of fixed-width rows of T. Row i never moves once allocated.
template <typename T>
class ChunkedRows {
 public:
  void Reset(int64_t width, int64_t rows_per_chunk_log2) {
    width_ = width;
    log2_ = rows_per_chunk_log2;
    chunks_.clear();
  }
  T* Row(int64_t row) {
    return chunks_[row >> log2_].get() + (row & ((int64_t{1} << log2_) - 1)) * width_;
  }
  const T* Row(int64_t row) const {
    return chunks_[row >> log2_].get() + (row & ((int64_t{1} << log2_) - 1)) * width_;
  }
  // Makes sure row `row` is backed by memory.
  void EnsureRow(int64_t row) {
    while ((row >> log2_) >= static_cast<int64_t>(chunks_.size())) {
      chunks_.emplace_back(new T[ChunkElements()]);
    }
  }
  int64_t ChunkElements() const { return (int64_t{1} << log2_) * width_; }
  int64_t Bytes() const {
    return static_cast<int64_t>(chunks_.size()) * ChunkElements() * static_cast<int64_t>(sizeof(T));
  }
  int64_t width() const { return width_; }

 private:
  int64_t width_ = 0;
  int64_t log2_ = 10;
  std::vector<std::unique_ptr<T[]>> chunks_;
};

class EmbeddingTable {
 public:
  static Status Create(const TableConfig& config, std::unique_ptr<EmbeddingTable>* out);

  int64_t dim() const { return config_.dim; }
  int num_slots() const { return optimizer_.num_slots(); }
  const TableConfig& config() const { return config_; }
  int64_t Size() const { return size_; }
  // Bytes this table holds: buckets, row chunks, slot chunks, step counters.
  int64_t MemoryBytes() const;
  // Step counter of the whole table (pushes applied), for StepMode::kPerTable.
  int64_t table_step() const { return table_step_; }
  void set_table_step(int64_t step) { table_step_ = step; }

  // Replaces the optimizer. Slots of every existing row are reset to the new
  // optimizer's initial values and row step counters to 0.
  Status SetOptimizer(const OptimizerConfig& optimizer);

  // out[i] = row of keys[i]; a missing key gets its initial value and is not
  // inserted. Duplicates allowed.
  Status Lookup(const int64_t* keys, int64_t n, float* out) const;
  // Like Lookup, but missing keys are inserted with their initial value.
  Status LookupOrInsert(const int64_t* keys, int64_t n, float* out);
  // Fills only the initial values (never touches the map).
  void InitialValues(const int64_t* keys, int64_t n, float* out) const;

  // Applies the optimizer to the rows of keys (inserted if missing) with
  // grads (n * dim). Duplicate keys are summed first. Nothing is changed if
  // the batch is rejected. *applied receives the number of distinct rows
  // updated.
  Status ApplyGradients(const int64_t* keys, int64_t n, const float* grads,
                        NonFinitePolicy policy, int64_t* applied);
  // Sets rows to values (n * dim), inserting missing keys; duplicates: last
  // wins. Slots and step counters of the rows are left as they are, except
  // that inserted rows get initial slots.
  Status Assign(const int64_t* keys, int64_t n, const float* values);
  // Removes keys that exist; returns how many were removed.
  int64_t Remove(const int64_t* keys, int64_t n);

  // Full row state for checkpoints: slots are num_slots() * dim floats per
  // row (slot-major within a row), steps one int64 per row.
  Status ReadState(const int64_t* keys, int64_t n, float* values, float* slots,
                   int64_t* steps) const;
  Status WriteState(const int64_t* keys, int64_t n, const float* values, const float* slots,
                    const int64_t* steps);

  // Iteration for checkpoints: copies up to max_rows keys starting at bucket
  // *cursor into keys_out, advancing *cursor; returns the number copied (0 at
  // the end). Rows can then be read with ReadState.
  int64_t NextKeys(int64_t* cursor, int64_t max_rows, int64_t* keys_out) const;

 private:
  explicit EmbeddingTable(const TableConfig& config);

  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;

  // Key and row side by side: one cache miss per probe. Packed to 12 bytes
  // (x86 loads unaligned int64 at full speed) to keep the map small.
#pragma pack(push, 4)
  struct Bucket {
    int64_t key;
    uint32_t row;
  };
#pragma pack(pop)
  static_assert(sizeof(Bucket) == 12, "Bucket must stay 12 bytes");

  int64_t FindRow(int64_t key) const;
  // Rows of keys[0..n) (-1 when missing), probing a block at a time with
  // prefetches so the cache misses of different keys overlap.
  void FindRows(const int64_t* keys, int64_t n, int64_t* rows) const;
  void LookupRange(const int64_t* keys, int64_t n, float* out) const;
  // Returns the row of key, inserting it (initial value, initial slots, step
  // 0) when missing.
  Status FindOrInsertRow(int64_t key, int64_t* row);
  Status Reserve(int64_t rows_needed);
  void Rehash(int64_t new_capacity);
  void InitRow(int64_t row, int64_t key);
  void InitRowSlots(int64_t row);
  size_t HomeBucket(int64_t key) const;

  TableConfig config_;
  Optimizer optimizer_;
  // Open addressing with linear probing.
  std::vector<Bucket> buckets_;
  uint64_t mask_ = 0;
  int64_t size_ = 0;
  int64_t next_row_ = 0;               // rows ever allocated
  std::vector<uint32_t> free_rows_;    // rows released by Remove
  ChunkedRows<float> values_;
  ChunkedRows<float> slots_;
  // 32 bits: 4 billion updates of one row is far beyond any run, and the
  // saved 4 bytes a row matter at small dims (memory target: 1.3x raw).
  ChunkedRows<uint32_t> steps_;
  int64_t table_step_ = 0;
};

}  // namespace kvsparse

#endif  // KVSPARSE_TABLE_H_
