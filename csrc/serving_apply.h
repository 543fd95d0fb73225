// Writing checkpoint rows into a serving replica's tables.
//
// A serving replica (kvsparse/serving/state.py) stores each table one column
// wider than its rows: the last column is a marker (1.0 for a stored id), so
// that a lookup tells stored ids from unseen ones in the same batch. The rows
// of a checkpoint block are `dim` wide; AssignMarkedRows widens them while it
// assigns them, in one call the bridge makes without the GIL, so that the
// follower applying a delta does not stall the lookup threads (the widening
// copy made in NumPy held the GIL for 2-4 ms per 65,536-row block).
//
// Not thread-safe for a given table (EmbeddingTable is not): one caller at a
// time, while no lookup reads that table.
//
//   // table: dim + 1 wide; values: n * dim floats, row-major.
//   kvsparse::Status s = kvsparse::AssignMarkedRows(table, keys, n, values, dim, 1.0f);
#ifndef KVSPARSE_SERVING_APPLY_H_
#define KVSPARSE_SERVING_APPLY_H_

#include <cstdint>

#include "status.h"
#include "table.h"

namespace kvsparse {

// Sets the rows of keys to values (n * dim floats) followed by one column of
// marker, inserting missing ids (EmbeddingTable::Assign: duplicates, last
// wins). The table's dim must be dim + 1. Fails with kInvalidArgument (a
// width mismatch) or kOutOfMemory; rows before the failing chunk may have been
// written already (the replica rebuilds a copy an update failed on).
Status AssignMarkedRows(EmbeddingTable* table, const int64_t* keys, int64_t n,
                        const float* values, int64_t dim, float marker);

}  // namespace kvsparse

#endif  // KVSPARSE_SERVING_APPLY_H_
