// RowStore: the one interface a disk tier talks to.
//
// A RowStore keeps fixed-size records keyed by int64 row id. One record holds
// everything a row needs to come back from disk: its value bytes, its
// optimizer slots and its small metadata (step, counters), so that one read
// brings back one row whole. Every record of a store has the same size
// (record_bytes, fixed when the store is created).
//
// Errors are returned as a Status; nothing throws across this interface and
// nothing aborts. Disk-level failures use two codes of their own:
//   kDiskFull   (ENOSPC/EFBIG while writing): the batch is not applied, the
//               store is as it was before the call, the caller keeps its rows;
//   kCorruption (a record whose checksum or key does not match): the message
//               names the file, the offset and the key; the record is never
//               served.
//
//   std::unique_ptr<kvsparse::RowStore> store;
//   kvsparse::SegmentStoreOptions options;
//   options.directory = "/ssd/spill/table0";
//   options.record_bytes = 520;
//   kvsparse::Status s = kvsparse::OpenSegmentStore(options, &store);
//   s = store->WriteBatch(keys, n, records);            // n * 520 bytes
//   s = store->ReadBatch(keys, n, out, found);          // found[i] = 0 or 1
//   s = store->Maintenance(64 << 20, &moved);           // rate-limited GC
//   s = store->Checkpoint("/ssd/ckpt/step100/table0");  // hard links
//
// Thread-safety: every implementation must be safe to call from several
// threads at once (calls may serialize on an internal lock).
#ifndef KVSPARSE_ROW_STORE_H_
#define KVSPARSE_ROW_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace kvsparse {

// What a store holds and has done since it was opened.
struct RowStoreStats {
  int64_t record_bytes = 0;      // payload bytes of one record
  int64_t live_records = 0;      // keys the store holds
  int64_t segments = 0;          // files on disk
  int64_t disk_bytes = 0;        // bytes of those files
  int64_t index_bytes = 0;       // RAM of the in-memory index
  int64_t bytes_written = 0;     // everything written to disk (records, GC copies, tombstones)
  int64_t bytes_updated = 0;     // payload bytes the callers asked to write
  int64_t bytes_read = 0;        // bytes read from disk by ReadBatch and GC
  int64_t records_read = 0;      // records served by ReadBatch
  int64_t gc_segments_freed = 0;  // segments removed by Maintenance
  int64_t gc_records_moved = 0;  // live records Maintenance copied forward
  int64_t gc_bytes_moved = 0;    // bytes Maintenance read and wrote
  int64_t reads = 0;             // read calls (preads) ReadBatch, Take and Contains issued
  // RAM one more record costs the index on average (planning: a caller that
  // moves n rows out keeps n times this free); the most RAM a read or write
  // call holds beyond index_bytes while it runs; and what a Maintenance call
  // holds (a caller may run it only when that much is free).
  int64_t index_bytes_per_record = 0;
  int64_t working_bytes = 0;
  int64_t maintenance_bytes = 0;
  int64_t read_unit_bytes = 0;  // bytes one read of a lookup brings (a page)
};

class RowStore {
 public:
  virtual ~RowStore() = default;

  // Writes n records (n * record_bytes bytes, record i for keys[i]) all or
  // nothing: on any error the store serves exactly what it served before.
  // A key given twice in one batch keeps its last record.
  virtual Status WriteBatch(const int64_t* keys, int64_t n, const uint8_t* records) = 0;

  // Reads the records of n keys into out (n * record_bytes bytes); found[i]
  // is 1 where the store holds keys[i], else 0 and out's record i is zeroed.
  // The reads of one batch are issued together (queue depth), not one by one.
  virtual Status ReadBatch(const int64_t* keys, int64_t n, uint8_t* out,
                           uint8_t* found) = 0;

  // ReadBatch, then the found keys removed as by Discard, all or nothing: on
  // an error nothing is removed. For a caller moving rows back into memory.
  virtual Status Take(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) {
    Status s = ReadBatch(keys, n, out, found);
    if (!s.ok()) return s;
    std::vector<int64_t> held;
    for (int64_t i = 0; i < n; ++i) {
      if (found[i]) held.push_back(keys[i]);
    }
    return Discard(held.data(), static_cast<int64_t>(held.size()));
  }

  // Removes n keys (absent ones are ignored); all or nothing like WriteBatch.
  virtual Status Erase(const int64_t* keys, int64_t n) = 0;

  // Removes n keys from the in-memory index only: no tombstone is written, so
  // a reopen of the directory may bring their old records back. For stores
  // that are never reopened (a disk tier that spills rows of a running table
  // and starts empty): it costs no I/O, and the records become stale for
  // garbage collection at once.
  virtual Status Discard(const int64_t* keys, int64_t n) = 0;

  // The live records in file order, for scans of the whole store: copies up to
  // max_records of them (keys and records) starting at *cursor (0 at first),
  // advances *cursor and sets *count (0 at the end). Reads sequentially; a
  // record whose checksum fails is a kCorruption error. The cursor stays valid
  // while the store is not written to.
  virtual Status Scan(uint64_t* cursor, int64_t max_records, int64_t* keys, uint8_t* records,
                      int64_t* count) = 0;

  // found[i] = 1 where the store holds keys[i]. SegmentStore answers from its
  // index; RunStore may read (a filter's positives are checked on disk).
  virtual Status Contains(const int64_t* keys, int64_t n, uint8_t* found) const = 0;

  // maybe[i] = 0 where the store surely does not hold keys[i], else 1 (it
  // may). No I/O. A caller sizes what may come back with it.
  virtual Status MayContain(const int64_t* keys, int64_t n, uint8_t* maybe) const {
    return Contains(keys, n, maybe);
  }

  // Hands buffered writes to the operating system (visible to a reopen after
  // the process ends); Sync also makes them durable (fdatasync).
  virtual Status Flush() = 0;
  virtual Status Sync() = 0;

  // Garbage collection of mostly stale files, at most about max_bytes read
  // plus written per call so that a training step is never stalled for long.
  // *bytes_moved gets what this call read and wrote.
  virtual Status Maintenance(int64_t max_bytes, int64_t* bytes_moved) = 0;

  // Makes directory (which must not exist or be empty) a consistent copy of
  // the store as of this call: immutable files enter it by hard link, plus a
  // small manifest. OpenSegmentStore on a copy of it (RestoreSegmentStore)
  // brings the rows back.
  virtual Status Checkpoint(const std::string& directory) = 0;

  // Checkpoint in two halves, for a checkpoint written by a snapshot of the
  // process (a fork) while the store goes on changing: LinkCheckpoint in the
  // owner, right before the snapshot, hard-links the files (never copies:
  // an error across file systems), and FinishCheckpoint in the snapshot
  // makes them durable and writes the manifest of the store as it was then.
  // A store whose files are not immutable cannot split it (the defaults).
  virtual Status LinkCheckpoint(const std::string& directory) {
    (void)directory;
    return Status(StatusCode::kInvalidArgument, "this store cannot link a checkpoint ahead");
  }
  virtual Status FinishCheckpoint(const std::string& directory) { return Checkpoint(directory); }

  virtual RowStoreStats Stats() const = 0;

  // Syncs and closes the files; any later call returns an error.
  virtual Status Close() = 0;
};

}  // namespace kvsparse

#endif  // KVSPARSE_ROW_STORE_H_
