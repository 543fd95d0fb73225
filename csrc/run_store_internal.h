// RunStore's parts (run_store.h): the file format, the per-fragment index and
// the class, shared by run_store.cc (reads and writes), run_merge.cc (merges)
// and run_manifest.cc (checkpoints, restore). Not a public header.
//
// A run file: a 64-byte header, then pages of page_bytes each:
//
//   crc32c (uint32, over the rest of the page) | count (uint32) |
//   count entries of key (int64) + record_bytes payload | zero padding
//
// Pages of fragment 0 first, then fragment 1, ...; within a fragment the
// entries are sorted by Mix64(key). A fragment's last page may be partial.
#ifndef KVSPARSE_RUN_STORE_INTERNAL_H_
#define KVSPARSE_RUN_STORE_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hash.h"
#include "read_pool.h"
#include "row_store.h"
#include "run_store.h"
#include "status.h"

namespace kvsparse {
namespace run_store {

constexpr char kMagic[8] = {'K', 'V', 'S', 'R', 'U', 'N', '1', '\0'};
constexpr int64_t kFileHeaderBytes = 64;
constexpr int64_t kPageHeaderBytes = 8;
constexpr int kMaxFragmentBits = 12;
constexpr const char* kManifestName = "MANIFEST";

// The hash that orders a run (and picks the fragment, page and filter bits).
inline uint64_t KeyHash(int64_t key) { return Mix64(static_cast<uint64_t>(key)); }

// A blocked Bloom filter over a fragment's hashes: 512-bit blocks, 7 probes
// in one block. Thread-safety: static functions over the caller's words.
struct Bloom {
  static constexpr int kProbes = 7;
  static uint64_t Block(uint64_t hash, uint64_t blocks) {
    const uint64_t g = Mix64(hash ^ 0xA0761D6478BD642Full);
    return static_cast<uint64_t>((static_cast<unsigned __int128>(g) * blocks) >> 64);
  }
  static uint64_t Probes(uint64_t hash) { return Mix64(hash ^ 0xE7037ED1A0B428DBull); }
  static void Add(std::vector<uint64_t>* words, uint64_t hash) {
    const uint64_t blocks = words->size() / 8;
    uint64_t* block = words->data() + 8 * Block(hash, blocks);
    uint64_t bits = Probes(hash);
    for (int p = 0; p < kProbes; ++p, bits >>= 9) {
      const uint64_t bit = bits & 511;
      block[bit >> 6] |= uint64_t{1} << (bit & 63);
    }
  }
  static bool MayHold(const std::vector<uint64_t>& words, uint64_t hash) {
    const uint64_t blocks = words.size() / 8;
    if (blocks == 0) return false;
    const uint64_t* block = words.data() + 8 * Block(hash, blocks);
    uint64_t bits = Probes(hash);
    for (int p = 0; p < kProbes; ++p, bits >>= 9) {
      const uint64_t bit = bits & 511;
      if ((block[bit >> 6] & (uint64_t{1} << (bit & 63))) == 0) return false;
    }
    return true;
  }
  static int64_t Words(int64_t keys, int64_t bits_per_key) {
    return 8 * std::max<int64_t>(1, (keys * bits_per_key + 511) / 512);
  }
};

// One fragment of a run: its pages and their index. Empty (pages == 0) once a
// merge has moved it into a newer run. Thread-safety: none of its own; the
// RunStore's mutex guards every Fragment, Run and Merge.
struct Fragment {
  int64_t first_page = 0;  // in the run's file
  int64_t pages = 0;
  int64_t records = 0;     // written (live and dead)
  int64_t live = 0;
  std::vector<uint64_t> page_hash;  // first hash of each page
  std::vector<uint64_t> bloom;
  std::vector<uint64_t> live_bits;  // bit page * records_per_page + entry

  int64_t Bytes() const {
    return static_cast<int64_t>(sizeof(Fragment) +
                                8 * (page_hash.capacity() + bloom.capacity() + live_bits.capacity()));
  }
  void Free() {
    *this = Fragment();
  }
  bool Live(int64_t bit) const { return (live_bits[bit >> 6] >> (bit & 63)) & 1; }
  void SetDead(int64_t bit) { live_bits[bit >> 6] &= ~(uint64_t{1} << (bit & 63)); }
};

struct Run {
  uint64_t id = 0;
  std::string name;  // run-<id>.kvr
  int fd = -1;
  int fragment_bits = 0;
  int64_t pages = 0;  // pages in the file (installed fragments' and a merge's partial ones)
  int64_t live = 0;
  int64_t records = 0;  // written into installed fragments
  bool synced = false;
  bool building = false;  // a merge's output, not all fragments written yet
  std::vector<Fragment> fragments;

  int64_t FragmentOf(uint64_t hash) const {
    return fragment_bits == 0 ? 0 : static_cast<int64_t>(hash >> (64 - fragment_bits));
  }
  // The hash range [begin, end) of fragment f; end 0 means 2^64.
  uint64_t FragmentBegin(int64_t f) const {
    return fragment_bits == 0 ? 0 : static_cast<uint64_t>(f) << (64 - fragment_bits);
  }
  int64_t IndexBytes() const {
    int64_t bytes = static_cast<int64_t>(sizeof(Run) + name.capacity());
    for (const Fragment& fragment : fragments) bytes += fragment.Bytes();
    return bytes;
  }
};

// Where a key was found: run position, fragment, page (within the fragment)
// and entry.
struct Location {
  Run* run = nullptr;
  int64_t fragment = 0;
  int64_t page = 0;
  int64_t entry = 0;
};

// A merge in progress (run_merge.cc): the inputs (runs of about one size, not
// necessarily adjacent by age) go into output, placed just after the newest
// of them, one output fragment per step.
struct MergeInput {
  Run* run = nullptr;
  // Where its next record is: fragment, page within it, entry within it.
  int64_t fragment = 0;
  int64_t page = 0;
  int64_t entry = 0;
};

struct Merge {
  std::vector<MergeInput> inputs;
  Run* output = nullptr;
  int64_t next_fragment = 0;
  int64_t live = 0;  // the inputs' live records when it began (to size a step's staging)
  int64_t bloom_bits = 10;  // per key, for every fragment of output (BloomBitsFor)
};

// Thread-safety: every public call takes mutex_; Locate's page reads run on
// pool_'s threads, which only read the files and write their own buffers.
class RunStore final : public RowStore {
 public:
  explicit RunStore(const RunStoreOptions& options);
  ~RunStore() override;

  Status Open();  // a new store, or the one the directory's MANIFEST describes

  Status WriteBatch(const int64_t* keys, int64_t n, const uint8_t* records) override;
  Status ReadBatch(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) override;
  Status Take(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) override;
  Status Erase(const int64_t* keys, int64_t n) override { return Discard(keys, n); }
  Status Discard(const int64_t* keys, int64_t n) override;
  Status Scan(uint64_t* cursor, int64_t max_records, int64_t* keys, uint8_t* records,
              int64_t* count) override;
  Status Contains(const int64_t* keys, int64_t n, uint8_t* found) const override;
  Status MayContain(const int64_t* keys, int64_t n, uint8_t* maybe) const override;
  Status Flush() override { return Status::Ok(); }
  Status Sync() override;
  Status Maintenance(int64_t max_bytes, int64_t* bytes_moved) override;
  Status Checkpoint(const std::string& directory) override;
  Status LinkCheckpoint(const std::string& directory) override;
  Status FinishCheckpoint(const std::string& directory) override;
  RowStoreStats Stats() const override;
  Status Close() override;

 private:
  int64_t EntryBytes() const { return 8 + options_.record_bytes; }
  // Pages per I/O call of merges, scans and run writes, and pages read per
  // round of a batch lookup: options.buffer_bytes bounds both buffers.
  int64_t StreamPages() const { return stream_pages_; }
  int64_t ReadRoundPages() const { return read_round_pages_; }
  // What a merge step stages: its output fragment's records (and their order).
  int64_t MergeStagingBytes() const;
  int64_t PageOffset(int64_t page) const { return kFileHeaderBytes + page * page_bytes_; }
  Status CheckOpen() const;
  Status CheckWritable() const;  // open, and not read_only
  // The page size and what follows from it (records per page, read rounds,
  // fragment size): the options' at first, a MANIFEST's when it is loaded.
  void SetPageBytes(int64_t page_bytes);
  std::string PathOf(const Run& run) const { return options_.directory + "/" + run.name; }
  Status CorruptPage(const Run& run, int64_t page, const std::string& why) const;
  // Verifies a page read into buffer (crc, count); the key looked up, if any,
  // goes into the message.
  Status CheckPage(const Run& run, int64_t file_page, const uint8_t* page) const;
  // The keys a page says it holds, for messages (unverified: it failed its check).
  std::string PageKeys(const uint8_t* page) const;

  // Finds keys (the whole lookup: filters, then rounds of page reads). On
  // success where[i].run is the key's live location or null. Reads the
  // records into out when it is not null. Mutex held.
  Status Locate(const int64_t* keys, int64_t n, std::vector<Location>* where, uint8_t* out) const;
  void MarkDead(const Location& location);

  Status CreateRunFile(Run* run);
  void DropRun(Run* run);  // closes and unlinks
  // Writes sorted (hash, index) entries of records as a new run; n > 0.
  Status WriteRun(const std::vector<std::pair<uint64_t, int64_t>>& order, const int64_t* keys,
                  const uint8_t* records, std::unique_ptr<Run>* out);
  int FragmentBitsFor(int64_t records) const;
  // Filter bits per key for a new run of records among total live records
  // (the run's own included).
  int64_t BloomBitsFor(int64_t records, int64_t total) const;
  int64_t LiveRecords() const;

  // Merges (run_merge.cc).
  bool PickMerge();
  Status MergeFragment(int64_t* moved);
  void FinishMerge();
  // Manifest (run_manifest.cc).
  Status LoadManifest();
  Status WriteManifest(const std::string& directory) const;
  // Checkpoint's halves (mutex_ held): hard links of every run file into an
  // empty directory (copies across file systems only if copy_across); then
  // the runs synced and the MANIFEST of the index as it is now.
  Status LinkRuns(const std::string& directory, bool copy_across);
  Status SyncAndWriteManifest(const std::string& directory);

  const RunStoreOptions options_;
  int64_t page_bytes_ = 0;
  int64_t records_per_page_ = 0;
  int64_t stream_pages_ = 1;
  int64_t min_pages_per_fragment_ = 8;  // fewer for pages of wide records
  int64_t read_round_pages_ = 1;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Run>> runs_;  // oldest first
  uint64_t next_run_id_ = 1;
  bool closed_ = false;
  mutable std::unique_ptr<ReadPool> pool_;
  std::unique_ptr<Merge> merge_;
  mutable RowStoreStats stats_;
};

}  // namespace run_store
}  // namespace kvsparse

#endif  // KVSPARSE_RUN_STORE_INTERNAL_H_
