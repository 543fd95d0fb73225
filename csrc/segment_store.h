// SegmentStore: kvsparse's log-structured RowStore (see row_store.h).
//
// Layout on disk: a directory of append-only segment files
// `segment-<id>.kvs` (64 MiB by default), each a 64-byte file header and
// then fixed-size slots of one record each:
//
//   key (int64) | sequence (uint64) | flags (uint32: 1 = tombstone) |
//   crc32c (uint32, over the 20 bytes before it and the payload) | payload
//
// so a slot is 24 + record_bytes bytes. Writes append whole batches with one
// pwrite per batch and segment (never a write per update) and never modify a
// file once it is sealed; a sealed file only disappears when garbage
// collection has copied its live records forward. That is what lets a
// checkpoint take sealed files by hard link.
//
// In RAM: an open-addressing index of 16-byte entries (key, location) kept
// at most 80% full (growing by doubling), so 16 B / load = 20 to 40 B per
// key (about 27 on average over sizes); the table's own hash map can hold
// the 8-byte location instead once the disk tier is plugged in (8 B per key).
// Per segment: a few counters.
//
// Every read verifies the record's checksum and key; a mismatch is a
// kCorruption error naming the file, the offset and the key, and the record
// is not served. Recovery (OpenSegmentStore on an existing directory) scans
// the segments, the highest sequence number of a key wins and a tombstone
// erases; a torn tail (a crash in the middle of a write) of the newest
// segment is cut off; any other bad record fails the open with kCorruption.
//
// Thread-safety: SegmentStore is safe to call from several threads at once;
// calls serialize on one internal mutex. ReadBatch issues a batch's reads
// from a small pool of its own threads (options.read_threads = queue depth).
#ifndef KVSPARSE_SEGMENT_STORE_H_
#define KVSPARSE_SEGMENT_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "row_store.h"
#include "status.h"

namespace kvsparse {

struct SegmentStoreOptions {
  std::string directory;             // created if missing
  int64_t record_bytes = 0;          // payload bytes of each record, >= 1
  int64_t segment_bytes = 64 << 20;  // size at which a segment is sealed
  // A sealed segment whose fraction of stale (overwritten or erased) slots
  // reaches this is rewritten by Maintenance (DeepRec uses a third).
  double gc_stale_fraction = 1.0 / 3.0;
  int64_t read_threads = 16;  // preads in flight per ReadBatch
  // false: no fdatasync (sealing a file, Sync, garbage collection, Close), for
  // a store that is never reopened after a crash (a disk tier's spill files:
  // a restarted server restores from its checkpoint). Flushing 64 MiB at each
  // sealed file stalled the training step that sealed it.
  bool durable = true;
};

// Opens (creating or recovering) the store in options.directory.
Status OpenSegmentStore(const SegmentStoreOptions& options, std::unique_ptr<RowStore>* out);

// Fills options.directory (missing or empty) with hard links of the segments
// a Checkpoint wrote to checkpoint_directory and opens it. The checkpoint is
// left as it is and can be restored again.
Status RestoreSegmentStore(const std::string& checkpoint_directory,
                           const SegmentStoreOptions& options, std::unique_ptr<RowStore>* out);

}  // namespace kvsparse

#endif  // KVSPARSE_SEGMENT_STORE_H_
