// Helpers shared by the files that implement EmbeddingTable (table.cc,
// table_lookup.cc, table_push.cc, table_checkpoint.cc, table_policy.cc). Not a
// public header: nothing outside those files includes it. Constants and pure
// functions only: safe from any thread.
#ifndef KVSPARSE_TABLE_INTERNAL_H_
#define KVSPARSE_TABLE_INTERNAL_H_

#include <cstdint>
#include <string>

#include "table.h"

namespace kvsparse {
namespace table_internal {

// Below this many keys per thread, starting threads costs more than it saves.
constexpr int64_t kMinKeysPerThread = 16384;
// Initial values generated per thread at least (floats): a thread start costs
// about as much as generating this many normals.
constexpr int64_t kMinInitFloatsPerThread = 1 << 16;
// Values and slots of one row as float32, for tables that store 16-bit rows:
// the most slots an optimizer keeps is 3 (centered RMSProp with momentum).
constexpr int64_t kMaxRowStateFloats = kMaxDim * 4;

// Rows per chunk: about 2 MiB of values per chunk (one huge page, see
// memory.h), at least 64 rows. Untouched pages of the last chunk cost no RSS.
inline int64_t RowsPerChunkLog2(int64_t row_floats) {
  int64_t log2 = 6;
  while (log2 < 20 && (int64_t{1} << (log2 + 1)) * row_floats * 4 <= (1 << 21)) ++log2;
  return log2;
}

inline std::string KeyText(int64_t key) { return std::to_string(key); }

inline const char* StorageName(StorageType type) {
  switch (type) {
    case StorageType::kFloat16:
      return "float16";
    case StorageType::kBFloat16:
      return "bfloat16";
    default:
      return "float32";
  }
}

// multi_precision means something to 16-bit tables only (MXNet: float16 weights).
inline bool KeepsMaster(const OptimizerConfig& optimizer, StorageType value_type) {
  return optimizer.multi_precision && value_type != StorageType::kFloat32;
}

inline bool ValidStorage(StorageType type) {
  return type == StorageType::kFloat32 || type == StorageType::kFloat16 ||
         type == StorageType::kBFloat16;
}

}  // namespace table_internal
}  // namespace kvsparse

#endif  // KVSPARSE_TABLE_INTERNAL_H_
