#include "serving_apply.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace kvsparse {

namespace {
// Rows widened per Assign: the scratch (4,096 x (dim + 1) floats, 528 KiB at
// dim 32) stays in L2 while Assign reads it back.
constexpr int64_t kMarkedChunkRows = 4096;
}  // namespace

Status AssignMarkedRows(EmbeddingTable* table, const int64_t* keys, int64_t n,
                        const float* values, int64_t dim, float marker) {
  if (dim < 0 || table->dim() != dim + 1) {
    return Status(StatusCode::kInvalidArgument,
                  "rows are " + std::to_string(dim) + " wide, the serving table holds " +
                      std::to_string(table->dim()) + " (dim + 1 expected)");
  }
  if (n <= 0) return Status::Ok();
  const int64_t width = dim + 1;
  std::vector<float> scratch;
  try {
    scratch.resize(static_cast<size_t>(std::min(n, kMarkedChunkRows) * width));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "no memory for the rows being assigned");
  }
  for (int64_t start = 0; start < n; start += kMarkedChunkRows) {
    const int64_t rows = std::min(kMarkedChunkRows, n - start);
    for (int64_t i = 0; i < rows; ++i) {
      float* out = scratch.data() + i * width;
      std::memcpy(out, values + (start + i) * dim, sizeof(float) * static_cast<size_t>(dim));
      out[dim] = marker;
    }
    Status s = table->Assign(keys + start, rows, scratch.data());
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace kvsparse
