// The row storage of a table: ChunkedRows (fixed-width rows of T in chunks that
// never move once past the first) and RowArray (float32 rows, or 16-bit rows read
// and written as float32). EmbeddingTable keeps its values, optimizer slots, master
// copies and per-row metadata in them; AdmissionPolicy its per-row counters.
//
//   kvsparse::ChunkedRows<float> rows;
//   rows.Reset(/*width=*/8, /*rows_per_chunk_log2=*/10);
//   rows.EnsureRow(99);          // rows [0, 99] are backed by memory now
//   float* row = rows.Row(42);   // 8 floats
//
// Neither class is thread-safe as a whole: distinct rows may be read and written
// from different threads, but EnsureRow / Reset must run alone.
#ifndef KVSPARSE_CHUNKED_ROWS_H_
#define KVSPARSE_CHUNKED_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "half.h"
#include "memory.h"

namespace kvsparse {

// How a table stores its values, or its optimizer slots; what that means for a
// table (rounding, the float32 master copy) is said in table.h, above TableConfig.
// The 16-bit kinds match HalfKind (half.h).
enum class StorageType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Chunked array of fixed-width rows of T. Rows of chunk 1 and later never
// move once allocated. Chunk 0 starts at kFirstChunkRows rows and doubles up
// to the full chunk size, moving its rows as it grows: a table of a few rows
// then costs a few hundred bytes instead of one full chunk per array (with a
// full chunk each, 200 one-row tables cost 805 MiB). Row() is the same for
// every row, so big tables pay nothing for it. Callers hold row indices, not
// pointers, across EnsureRow.
template <typename T>
class ChunkedRows {
 public:
  static constexpr int64_t kFirstChunkRows = 16;

  void Reset(int64_t width, int64_t rows_per_chunk_log2) {
    width_ = width;
    log2_ = rows_per_chunk_log2;
    chunks_.clear();
    first_rows_ = 0;
  }
  T* Row(int64_t row) {
    return chunks_[row >> log2_].get() + (row & ((int64_t{1} << log2_) - 1)) * width_;
  }
  const T* Row(int64_t row) const {
    return chunks_[row >> log2_].get() + (row & ((int64_t{1} << log2_) - 1)) * width_;
  }
  // Makes sure rows [0, row] are backed by memory. Throws std::bad_alloc and
  // then leaves the rows as they were.
  void EnsureRow(int64_t row) {
    const int64_t full = int64_t{1} << log2_;
    if (row < first_rows_) return;
    if (row < full) {
      int64_t rows = std::max<int64_t>(first_rows_ * 2, kFirstChunkRows);
      while (rows <= row) rows *= 2;
      GrowFirstChunk(std::min(rows, full));
      return;
    }
    if (first_rows_ < full) GrowFirstChunk(full);
    while ((row >> log2_) >= static_cast<int64_t>(chunks_.size())) {
      chunks_.emplace_back(AllocateArray<T>(static_cast<size_t>(ChunkElements())));
    }
  }
  // Backs rows [begin, end) with memory now (PopulateBytes), in chunks 1 and
  // later that are allocated (chunk 0 may still move). False if the kernel
  // refused; the rows hold what they held either way.
  bool Populate(int64_t begin, int64_t end) {
    if (width_ == 0) return true;
    begin = std::max(begin, int64_t{1} << log2_);
    end = std::min(end, static_cast<int64_t>(chunks_.size()) << log2_);
    while (begin < end) {
      const int64_t stop = std::min(end, ((begin >> log2_) + 1) << log2_);
      if (!PopulateBytes(Row(begin), Row(stop - 1) + width_)) return false;
      begin = stop;
    }
    return true;
  }
  int64_t ChunkElements() const { return (int64_t{1} << log2_) * width_; }
  int64_t Bytes() const {
    if (chunks_.empty()) return 0;
    const int64_t elements =
        first_rows_ * width_ + static_cast<int64_t>(chunks_.size() - 1) * ChunkElements();
    return elements * static_cast<int64_t>(sizeof(T));
  }
  int64_t width() const { return width_; }
  // Rows backed by memory now (rows [0, CapacityRows()) need no allocation).
  int64_t CapacityRows() const {
    if (width_ == 0) return INT64_MAX;
    if (chunks_.size() <= 1) return first_rows_;
    return static_cast<int64_t>(chunks_.size()) << log2_;
  }
  // Bytes EnsureRow(row) would allocate (0 when the row is backed).
  int64_t GrowthBytes(int64_t row) const {
    if (width_ == 0 || row < CapacityRows()) return 0;
    const int64_t full = int64_t{1} << log2_;
    int64_t rows;
    if (row < full) {
      rows = std::max<int64_t>(first_rows_ * 2, kFirstChunkRows);
      while (rows <= row) rows *= 2;
      rows = std::min(rows, full);
    } else {
      rows = ((row >> log2_) + 1) << log2_;
    }
    return (rows - std::min<int64_t>(CapacityRows(), rows)) * width_ *
           static_cast<int64_t>(sizeof(T));
  }
  // Frees the chunks past the one holding row rows - 1 (chunk 0 is kept
  // whole): rows [0, rows) keep their values, later rows are gone.
  void TruncateRows(int64_t rows) {
    const size_t keep = static_cast<size_t>(std::max<int64_t>(1, (rows + (int64_t{1} << log2_) - 1) >> log2_));
    if (chunks_.size() > keep) chunks_.resize(keep);
    if (chunks_.size() != 1 || width_ == 0) return;
    // Chunk 0 alone: down to the power of two that holds the rows (the
    // doubling it grew by, in reverse). Without memory for the copy it stays.
    int64_t first = kFirstChunkRows;
    while (first < rows) first *= 2;
    if (first >= first_rows_) return;
    T* smaller = nullptr;
    try {
      smaller = AllocateArray<T>(static_cast<size_t>(first * width_));
    } catch (const std::bad_alloc&) {
      return;
    }
    std::memcpy(smaller, chunks_[0].get(), static_cast<size_t>(first * width_) * sizeof(T));
    chunks_[0].reset(smaller);
    first_rows_ = first;
  }

 private:
  void GrowFirstChunk(int64_t rows) {
    std::unique_ptr<T[], FreeArray> grown(AllocateArray<T>(static_cast<size_t>(rows * width_)));
    if (chunks_.empty()) {
      chunks_.emplace_back(std::move(grown));
    } else {
      std::memcpy(grown.get(), chunks_[0].get(),
                  static_cast<size_t>(first_rows_ * width_) * sizeof(T));
      chunks_[0] = std::move(grown);
    }
    first_rows_ = rows;
  }

  int64_t width_ = 0;
  int64_t log2_ = 10;
  int64_t first_rows_ = 0;  // rows chunk 0 holds (0 when there is no chunk)
  std::vector<std::unique_ptr<T[], FreeArray>> chunks_;
};

// Rows of float32, or of 16-bit values read and written as float32.
// F32Row is for float32 arrays only (the unchanged fast paths); Read and
// Write convert. Not thread-safe beyond ChunkedRows' rules: distinct rows may
// be read and written from different threads.
class RowArray {
 public:
  void Reset(StorageType type, int64_t width, int64_t rows_per_chunk_log2) {
    type_ = type;
    width_ = width;
    f32_.Reset(type == StorageType::kFloat32 ? width : 0, rows_per_chunk_log2);
    // The same rows per chunk as the table's other arrays (1 MiB chunks): a chunk of
    // twice the rows would leave up to twice the unused rows in the last one.
    f16_.Reset(type == StorageType::kFloat32 ? 0 : width, rows_per_chunk_log2);
  }
  void EnsureRow(int64_t row) {
    if (is_f32()) {
      f32_.EnsureRow(row);
    } else {
      f16_.EnsureRow(row);
    }
  }
  bool Populate(int64_t begin, int64_t end) {
    return is_f32() ? f32_.Populate(begin, end) : f16_.Populate(begin, end);
  }
  int64_t CapacityRows() const { return std::min(f32_.CapacityRows(), f16_.CapacityRows()); }
  int64_t GrowthBytes(int64_t row) const { return f32_.GrowthBytes(row) + f16_.GrowthBytes(row); }
  void TruncateRows(int64_t rows) {
    f32_.TruncateRows(rows);
    f16_.TruncateRows(rows);
  }
  bool is_f32() const { return type_ == StorageType::kFloat32; }
  StorageType type() const { return type_; }
  HalfKind kind() const { return static_cast<HalfKind>(static_cast<int>(type_)); }
  int64_t width() const { return width_; }
  int64_t Bytes() const { return f32_.Bytes() + f16_.Bytes(); }
  int64_t row_bytes() const { return width_ * (is_f32() ? 4 : 2); }
  float* F32Row(int64_t row) { return f32_.Row(row); }
  const float* F32Row(int64_t row) const { return f32_.Row(row); }
  uint16_t* HalfRow(int64_t row) { return f16_.Row(row); }
  const uint16_t* HalfRow(int64_t row) const { return f16_.Row(row); }
  const char* RowAddress(int64_t row) const {
    return is_f32() ? reinterpret_cast<const char*>(f32_.Row(row))
                    : reinterpret_cast<const char*>(f16_.Row(row));
  }
  // out[0..width) = the row as float32 (exact).
  void Read(int64_t row, float* out) const {
    if (width_ == 0) return;
    if (is_f32()) {
      std::memcpy(out, f32_.Row(row), sizeof(float) * static_cast<size_t>(width_));
    } else {
      WidenHalvesSerial(kind(), f16_.Row(row), width_, out);
    }
  }
  // The row = values[0..width) (rounded to nearest even when 16-bit).
  void Write(int64_t row, const float* values) {
    if (width_ == 0) return;
    if (is_f32()) {
      std::memcpy(f32_.Row(row), values, sizeof(float) * static_cast<size_t>(width_));
    } else {
      NarrowFloatsSerial(kind(), values, width_, f16_.Row(row));
    }
  }
  // Rounds values[0..width) in place as Write would store them.
  void Round(float* values) const {
    if (is_f32() || width_ == 0) return;
    uint16_t buffer[256];
    for (int64_t i = 0; i < width_; i += 256) {
      const int64_t n = std::min<int64_t>(256, width_ - i);
      NarrowFloatsSerial(kind(), values + i, n, buffer);
      WidenHalvesSerial(kind(), buffer, n, values + i);
    }
  }

 private:
  StorageType type_ = StorageType::kFloat32;
  int64_t width_ = 0;
  ChunkedRows<float> f32_;
  ChunkedRows<uint16_t> f16_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_CHUNKED_ROWS_H_
