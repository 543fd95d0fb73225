// RunStore: the disk tier's RowStore (row_store.h) with ~1.5-2 bytes of RAM
// per record on disk and no index that doubles.
//
// Records live in immutable runs: files written once, by one WriteBatch or
// by one merge, never modified after. A run holds its records sorted by
// Mix64(key) (a bijection, so every key has its own place), in pages of a
// fixed size (4 KiB, or a few records of a wide row), each page checksummed
// as a whole. The hash space is cut into a run's fragments (up to 4,096,
// each at least 16 pages), and per fragment RAM holds:
//
//   - the first hash of each page (8 bytes per page: ~0.2 B per record at
//     dim 16, ~0.4 B at dim 64 with Adagrad);
//   - a blocked Bloom filter (10 bits per record by default: ~1% false
//     positives, 64-byte blocks so that one probe touches one cache line);
//   - a bit per record saying whether it is still live (a record taken back
//     into memory, or replaced, is dead; its bytes stay until a merge).
//
// A lookup goes from the newest run to the oldest, skipping runs whose
// filter says no, and reads the one page the page index names. A key is live
// in at most one run, and that run is the newest holding any copy of it
// (dead copies are older), so the first page that has the key ends the
// search: reads per lookup are 1 plus the filters' false positives of the
// runs newer than the key's own.
//
// Merges keep the runs few: merge_fan_in runs of about one size (within a
// factor of 2 by live records; any age) merge into one, placed where the
// newest of them was, and a run that is mostly dead is rewritten alone. A
// merge proceeds a fragment at a time, in Maintenance calls paced by the
// caller: its new fragment's index is built and the inputs' fragments
// it covered are freed before the next one starts, so the RAM a merge adds
// at any moment is one fragment's, never a second copy of the index.
//
// Checkpoint hard-links the run files (a merge only appends to its output
// file, past what any manifest names) and writes a MANIFEST holding the
// in-memory index (page hashes, filters, live bits: ~1.5% of the data);
// RestoreRunStore links them back and loads the index without reading a row.
//
//   kvsparse::RunStoreOptions options;
//   options.directory = "/ssd/spill/table0/rows-0";
//   options.record_bytes = 80;                    // dim 16 float32 + 16 bytes
//   std::unique_ptr<kvsparse::RowStore> store;
//   kvsparse::Status s = kvsparse::OpenRunStore(options, &store);
//   s = store->WriteBatch(keys, n, records);      // keys it does not hold
//   s = store->Take(keys, n, out, found);         // read and remove
//   s = store->Maintenance(32 << 20, &moved);     // merges, paced
//
// Thread-safety: safe to call from several threads at once; calls serialize
// on one internal mutex, and a batch's reads run on the store's read pool.
#ifndef KVSPARSE_RUN_STORE_H_
#define KVSPARSE_RUN_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "row_store.h"
#include "status.h"

namespace kvsparse {

struct RunStoreOptions {
  std::string directory;   // created if missing; must be empty unless it holds a MANIFEST
  int64_t record_bytes = 0;  // payload bytes of each record, >= 1
  int64_t read_threads = 16;  // preads in flight per batch
  int64_t bloom_bits_per_key = 10;  // 1% false positives at 10
  int64_t merge_fan_in = 4;
  // The I/O buffers of a call (a batch's page reads, a merge's reads and
  // writes) stay about this size; a disk tier sets a share of its budget.
  int64_t buffer_bytes = 4 << 20;
  // What one merge step stages (a fragment of records, at most about this):
  // larger fragments cost less RAM per record (a fragment's fixed ~250 B).
  int64_t merge_buffer_bytes = 8 << 20;
  // WriteBatch refuses (kInvalidArgument) a key the store holds: it reads the
  // pages of the keys the filters cannot rule out. A caller that never
  // writes a key it has not taken back (a disk tier) turns it off.
  bool check_writes = true;
  // false: no fdatasync of run files when written (a disk tier's spill: a
  // restarted server restores from its checkpoint). Checkpoint syncs the
  // files it links either way.
  bool durable = true;
  // Opens the store a MANIFEST in directory describes (a checkpoint) in
  // place, for reads and scans only: nothing there is created, written,
  // merged or removed; writes, takes and Maintenance are refused.
  bool read_only = false;
};

// Opens the store in options.directory: a new one in a missing or empty
// directory, or the one a MANIFEST there describes.
Status OpenRunStore(const RunStoreOptions& options, std::unique_ptr<RowStore>* out);

// Fills options.directory (missing or empty) with hard links of the run
// files a Checkpoint wrote to checkpoint_directory, plus its MANIFEST, and
// opens it. The checkpoint stays as it is and can be restored again.
Status RestoreRunStore(const std::string& checkpoint_directory, const RunStoreOptions& options,
                       std::unique_ptr<RowStore>* out);

}  // namespace kvsparse

#endif  // KVSPARSE_RUN_STORE_H_
