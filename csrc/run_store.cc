// RunStore: writes, lookups and scans (run_store.h; merges in run_merge.cc,
// checkpoints in run_manifest.cc).
#include "run_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>
#include <utility>

#include "crc32c.h"
#include "file_io.h"
#include "memory.h"
#include "run_store_internal.h"

namespace kvsparse {
namespace run_store {

namespace {

std::string RunName(uint64_t id) {
  char name[32];
  std::snprintf(name, sizeof(name), "run-%08llu.kvr", static_cast<unsigned long long>(id));
  return name;
}

}  // namespace

RunStore::RunStore(const RunStoreOptions& options) : options_(options) {
  const int64_t entry = EntryBytes();
  int64_t page_bytes = 4096;
  if (entry > (4096 - kPageHeaderBytes) / 16) {
    // A wide record: up to 24 per page keep the page index under ~0.4 B per
    // record; past 16 KiB a page the index is nothing beside the records,
    // and smaller pages keep reads and merges small. A page fits a quarter
    // of the call buffers (a small budget's).
    const int64_t cap = std::max<int64_t>(4096, options.buffer_bytes / 4);
    int64_t per_page = std::max<int64_t>(1, std::min<int64_t>(24, 16384 / entry));
    while (per_page > 1 && kPageHeaderBytes + per_page * entry > cap) --per_page;
    page_bytes = kPageHeaderBytes + per_page * entry;
  }
  SetPageBytes(page_bytes);
  stats_.record_bytes = options.record_bytes;
}

void RunStore::SetPageBytes(int64_t page_bytes) {
  page_bytes_ = page_bytes;
  records_per_page_ = (page_bytes_ - kPageHeaderBytes) / EntryBytes();
  read_round_pages_ = std::max<int64_t>(1, options_.buffer_bytes / page_bytes_);
  // A merge stages up to two fragments' worth of records.
  min_pages_per_fragment_ = std::max<int64_t>(
      1, std::min<int64_t>(64, options_.merge_buffer_bytes / 2 / page_bytes_));
}

RunStore::~RunStore() { Close(); }

Status RunStore::CheckOpen() const {
  if (closed_) return Status(StatusCode::kIoError, "the run store is closed");
  return Status::Ok();
}

Status RunStore::CheckWritable() const {
  if (Status s = CheckOpen(); !s.ok()) return s;
  if (options_.read_only) {
    return Status(StatusCode::kInvalidArgument,
                  "the run store in " + options_.directory + " is open read-only (a checkpoint)");
  }
  return Status::Ok();
}

Status RunStore::Open() {
  if (options_.read_only) {
    // A checkpoint read in place: nothing is created, written or removed.
    pool_.reset(new ReadPool(std::max<int64_t>(1, options_.read_threads)));
    return LoadManifest();
  }
  if (::mkdir(options_.directory.c_str(), 0755) != 0 && errno != EEXIST) {
    return IoError("creating directory", options_.directory, errno);
  }
  pool_.reset(new ReadPool(std::max<int64_t>(1, options_.read_threads)));
  struct stat info;
  const std::string manifest = options_.directory + "/" + kManifestName;
  if (::stat(manifest.c_str(), &info) == 0) return LoadManifest();
  return EmptyDirectory(options_.directory);
}

int64_t RunStore::MergeStagingBytes() const {
  // A fragment holds fewer than 2 * min_pages_per_fragment_ pages until the
  // fragments run out (kMaxFragmentBits); a merge of everything is the largest.
  int64_t live = 0;
  for (const auto& run : runs_) live += run->live;
  const int64_t per_fragment =
      std::max(2 * min_pages_per_fragment_ * records_per_page_, (live >> kMaxFragmentBits) + 1);
  return per_fragment * (EntryBytes() + 16) * 5 / 4;
}

// Monkey's allocation (Dayan, Athanassoulis, Idreos, SIGMOD 2017): the
// false positive rates that minimize their sum for a given memory are
// proportional to the runs' sizes, so a run gets 1.44 more bits per key
// (half the false positives) each time its share of the store halves. A
// lookup of a row on disk passes the runs newer than its own, mostly the
// small ones; only a new id passes the oldest, largest run. Here a run of
// half the store gets bloom_bits_per_key - 2 (~2% false positives at 8), a
// fifth of it bloom_bits_per_key, smaller ones more (at most twice
// bloom_bits_per_key): about 1 bit a key less than bloom_bits_per_key on
// average, with a tenth of the false positives on a missed row's way.
int64_t RunStore::BloomBitsFor(int64_t records, int64_t total) const {
  const int64_t bits = options_.bloom_bits_per_key;
  const int64_t low = std::max<int64_t>(1, bits - 2);
  if (records <= 0 || 2 * records >= total) return low;
  const double share = static_cast<double>(total) / static_cast<double>(records);
  const int64_t want = std::llround(static_cast<double>(bits) - 3.44 + 1.44 * std::log2(share));
  return std::min<int64_t>(2 * bits, std::max<int64_t>(low, want));
}

int64_t RunStore::LiveRecords() const {
  int64_t live = 0;
  for (const auto& run : runs_) live += run->live;
  return live;
}

int RunStore::FragmentBitsFor(int64_t records) const {
  const int64_t pages = (records + records_per_page_ - 1) / records_per_page_;
  int bits = 0;
  while (bits < kMaxFragmentBits && (pages >> (bits + 1)) >= min_pages_per_fragment_) ++bits;
  return bits;
}

Status RunStore::CreateRunFile(Run* run) {
  run->id = next_run_id_++;
  run->name = RunName(run->id);
  const std::string path = PathOf(*run);
  run->fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (run->fd < 0) return IoError("creating run file", path, errno);
  uint8_t header[kFileHeaderBytes] = {0};
  std::memcpy(header, kMagic, sizeof(kMagic));
  const uint64_t fields[3] = {static_cast<uint64_t>(options_.record_bytes),
                              static_cast<uint64_t>(page_bytes_),
                              static_cast<uint64_t>(records_per_page_)};
  std::memcpy(header + 8, fields, sizeof(fields));
  if (int error = WriteAll(run->fd, header, kFileHeaderBytes, 0); error != 0) {
    DropRun(run);
    return IoError("writing run file", path, error);
  }
  stats_.bytes_written += kFileHeaderBytes;
  return Status::Ok();
}

void RunStore::DropRun(Run* run) {
  if (run->fd >= 0) ::close(run->fd);
  run->fd = -1;
  ::unlink(PathOf(*run).c_str());
}

Status RunStore::CorruptPage(const Run& run, int64_t page, const std::string& why) const {
  return Status(StatusCode::kCorruption,
                "corrupt page " + std::to_string(page) + " of " + PathOf(run) + " at offset " +
                    std::to_string(PageOffset(page)) + ": " + why +
                    "; its records are not served");
}

std::string RunStore::PageKeys(const uint8_t* page) const {
  uint32_t count;
  std::memcpy(&count, page + 4, 4);
  const int64_t shown = std::min<int64_t>({count, records_per_page_, 8});
  std::string text;
  for (int64_t e = 0; e < shown; ++e) {
    int64_t key;
    std::memcpy(&key, page + kPageHeaderBytes + e * EntryBytes(), 8);
    text += (e > 0 ? ", key " : "key ") + std::to_string(key);
  }
  if (count > shown) text += ", ...";
  return text.empty() ? "no records" : text;
}

Status RunStore::CheckPage(const Run& run, int64_t file_page, const uint8_t* page) const {
  uint32_t crc, count;
  std::memcpy(&crc, page, 4);
  std::memcpy(&count, page + 4, 4);
  if (count == 0 || count > static_cast<uint64_t>(records_per_page_)) {
    return CorruptPage(run, file_page, "it says it holds " + std::to_string(count) + " records");
  }
  if (Crc32c(page + 4, static_cast<size_t>(page_bytes_ - 4)) != crc) {
    return CorruptPage(run, file_page, "checksum mismatch");
  }
  return Status::Ok();
}

Status RunStore::WriteRun(const std::vector<std::pair<uint64_t, int64_t>>& order,
                          const int64_t* keys, const uint8_t* records, std::unique_ptr<Run>* out) {
  std::unique_ptr<Run> run(new Run());
  Status s = CreateRunFile(run.get());
  if (!s.ok()) return s;
  const int64_t n = static_cast<int64_t>(order.size());
  run->fragment_bits = FragmentBitsFor(n);
  const int64_t bloom_bits = BloomBitsFor(n, LiveRecords() + n);
  run->fragments.resize(size_t{1} << run->fragment_bits);
  const int64_t entry_bytes = EntryBytes();
  std::vector<uint8_t> buffer;
  int64_t buffered_from = 0;  // file page of buffer's first page
  int64_t buffered = 0;
  auto flush = [&]() -> int {
    if (buffered == 0) return 0;
    const int error = WriteAll(run->fd, buffer.data(), buffered * page_bytes_,
                               PageOffset(buffered_from));
    stats_.bytes_written += buffered * page_bytes_;
    buffered_from += buffered;
    buffered = 0;
    return error;
  };
  buffer.resize(static_cast<size_t>(StreamPages() * page_bytes_));
  int64_t i = 0;
  for (int64_t f = 0; f < static_cast<int64_t>(run->fragments.size()); ++f) {
    Fragment& fragment = run->fragments[f];
    int64_t end = i;
    while (end < n && run->FragmentOf(order[end].first) == f) ++end;
    const int64_t count = end - i;
    fragment.first_page = run->pages;
    if (count == 0) continue;
    fragment.records = fragment.live = count;
    fragment.pages = (count + records_per_page_ - 1) / records_per_page_;
    fragment.page_hash.resize(static_cast<size_t>(fragment.pages));
    fragment.bloom.assign(static_cast<size_t>(Bloom::Words(count, bloom_bits)), 0);
    fragment.live_bits.assign(static_cast<size_t>((fragment.pages * records_per_page_ + 63) / 64), 0);
    for (int64_t p = 0; p < fragment.pages; ++p) {
      if (buffered == StreamPages()) {
        if (int error = flush(); error != 0) {
          DropRun(run.get());
          return IoError("writing run file", PathOf(*run), error);
        }
      }
      uint8_t* page = buffer.data() + buffered * page_bytes_;
      std::memset(page, 0, static_cast<size_t>(page_bytes_));
      const int64_t first = i + p * records_per_page_;
      const int64_t last = std::min(end, first + records_per_page_);
      const uint32_t in_page = static_cast<uint32_t>(last - first);
      std::memcpy(page + 4, &in_page, 4);
      fragment.page_hash[p] = order[first].first;
      for (int64_t j = first; j < last; ++j) {
        uint8_t* at = page + kPageHeaderBytes + (j - first) * entry_bytes;
        const int64_t source = order[j].second;
        std::memcpy(at, &keys[source], 8);
        std::memcpy(at + 8, records + source * options_.record_bytes,
                    static_cast<size_t>(options_.record_bytes));
        Bloom::Add(&fragment.bloom, order[j].first);
        const int64_t bit = p * records_per_page_ + (j - first);
        fragment.live_bits[bit >> 6] |= uint64_t{1} << (bit & 63);
      }
      const uint32_t crc = Crc32c(page + 4, static_cast<size_t>(page_bytes_ - 4));
      std::memcpy(page, &crc, 4);
      ++buffered;
      ++run->pages;
    }
    i = end;
  }
  int error = flush();
  if (error == 0 && options_.durable && ::fdatasync(run->fd) != 0) error = errno;
  if (error != 0) {
    DropRun(run.get());
    return IoError("writing run file", PathOf(*run), error);
  }
  run->synced = options_.durable;
  run->records = run->live = n;
  *out = std::move(run);
  return Status::Ok();
}

Status RunStore::WriteBatch(const int64_t* keys, int64_t n, const uint8_t* records) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckWritable(); !s.ok()) return s;
  if (n <= 0) return Status::Ok();
  try {
    // Sorted by hash; a key given twice keeps its last record.
    std::vector<std::pair<uint64_t, int64_t>> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = {KeyHash(keys[i]), i};
    std::sort(order.begin(), order.end());
    size_t kept = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      if (kept > 0 && order[kept - 1].first == order[i].first) {
        order[kept - 1] = order[i];
      } else {
        order[kept++] = order[i];
      }
    }
    order.resize(kept);
    if (options_.check_writes && !runs_.empty()) {
      std::vector<int64_t> unique(order.size());
      for (size_t i = 0; i < order.size(); ++i) unique[i] = keys[order[i].second];
      std::vector<Location> where;
      Status s = Locate(unique.data(), static_cast<int64_t>(unique.size()), &where, nullptr);
      if (!s.ok()) return s;
      for (size_t i = 0; i < where.size(); ++i) {
        if (where[i].run != nullptr) {
          return Status(StatusCode::kInvalidArgument,
                        "key " + std::to_string(unique[i]) +
                            " is already in the run store (take it out before writing it "
                            "again); nothing of the batch was written");
        }
      }
    }
    std::unique_ptr<Run> run;
    Status s = WriteRun(order, keys, records, &run);
    if (!s.ok()) return s;
    stats_.bytes_updated += static_cast<int64_t>(order.size()) * options_.record_bytes;
    runs_.push_back(std::move(run));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory writing a run (nothing written)");
  }
  return Status::Ok();
}

Status RunStore::Locate(const int64_t* keys, int64_t n, std::vector<Location>* where,
                        uint8_t* out) const {
  where->assign(static_cast<size_t>(n), Location());
  if (out != nullptr) std::memset(out, 0, static_cast<size_t>(n * options_.record_bytes));
  if (runs_.empty() || n == 0) return Status::Ok();
  struct Probe {
    int64_t index;
    uint64_t hash;
    int64_t position;  // the run to try next (runs_ index), going to older ones
    int64_t fragment = 0;
    int64_t page = 0;       // within the fragment
    int64_t file_page = 0;  // within the run's file
  };
  // Moves a probe to the next run whose filter and page index admit its key;
  // false when none is left.
  auto advance = [this](Probe* probe) {
    for (; probe->position >= 0; --probe->position) {
      const Run& run = *runs_[probe->position];
      const int64_t f = run.FragmentOf(probe->hash);
      const Fragment& fragment = run.fragments[f];
      if (fragment.pages == 0 || probe->hash < fragment.page_hash[0]) continue;
      if (!Bloom::MayHold(fragment.bloom, probe->hash)) continue;
      probe->fragment = f;
      probe->page = std::upper_bound(fragment.page_hash.begin(), fragment.page_hash.end(),
                                     probe->hash) - fragment.page_hash.begin() - 1;
      probe->file_page = fragment.first_page + probe->page;
      return true;
    }
    return false;
  };
  std::vector<Probe> waiting;
  waiting.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    Probe probe{i, KeyHash(keys[i]), static_cast<int64_t>(runs_.size()) - 1};
    if (advance(&probe)) waiting.push_back(probe);  // else held nowhere
  }
  const int64_t entry_bytes = EntryBytes();
  std::vector<uint8_t> buffer;
  std::vector<std::pair<int64_t, int64_t>> reads;  // (runs_ index, file page)
  std::vector<std::pair<Probe, int64_t>> round;    // (probe, its page in reads)
  std::vector<Status> errors;
  // Each pass sorts the probes by the page they want next and reads those
  // pages in rounds of at most ReadRoundPages() distinct ones, in that order:
  // a batch of any size costs O(n log n) per pass, and a pass per run a
  // filter's false positive sends a probe on to.
  while (!waiting.empty()) {
    std::sort(waiting.begin(), waiting.end(), [](const Probe& a, const Probe& b) {
      return a.position != b.position ? a.position > b.position : a.file_page < b.file_page;
    });
    std::vector<Probe> next;
    for (size_t begin = 0; begin < waiting.size();) {
      reads.clear();
      round.clear();
      size_t end = begin;
      for (; end < waiting.size(); ++end) {
        const std::pair<int64_t, int64_t> page{waiting[end].position, waiting[end].file_page};
        if (reads.empty() || reads.back() != page) {
          if (static_cast<int64_t>(reads.size()) >= ReadRoundPages()) break;
          reads.push_back(page);
        }
        round.push_back({waiting[end], static_cast<int64_t>(reads.size()) - 1});
      }
      begin = end;
      buffer.resize(reads.size() * static_cast<size_t>(page_bytes_));
      errors.assign(reads.size(), Status::Ok());
      pool_->Run(static_cast<int64_t>(reads.size()), [&](int64_t r) {
        const Run& run = *runs_[reads[r].first];
        uint8_t* page = buffer.data() + r * page_bytes_;
        int64_t got = 0;
        const int error = ReadAll(run.fd, page, page_bytes_, PageOffset(reads[r].second), &got);
        if (error != 0) {
          errors[r] = IoError("reading run file", PathOf(run), error);
        } else if (got != page_bytes_) {
          errors[r] = CorruptPage(run, reads[r].second, "the file ends inside it");
        } else {
          errors[r] = CheckPage(run, reads[r].second, page);
        }
      });
      stats_.reads += static_cast<int64_t>(reads.size());
      stats_.bytes_read += static_cast<int64_t>(reads.size()) * page_bytes_;
      for (const auto& [probe, slot] : round) {
        if (errors[slot].ok()) continue;
        return Status(errors[slot].code(), errors[slot].message() + " (looking up key " +
                                               std::to_string(keys[probe.index]) + ")");
      }
      for (auto& [probe, slot] : round) {
        const uint8_t* page = buffer.data() + slot * page_bytes_;
        uint32_t count;
        std::memcpy(&count, page + 4, 4);
        const int64_t key = keys[probe.index];
        int64_t entry = -1;
        for (int64_t e = 0; e < count; ++e) {
          int64_t stored;
          std::memcpy(&stored, page + kPageHeaderBytes + e * entry_bytes, 8);
          if (stored == key) {
            entry = e;
            break;
          }
        }
        if (entry < 0) {  // a filter's false positive: older runs next
          --probe.position;
          if (advance(&probe)) next.push_back(probe);
          continue;
        }
        Run* run = runs_[probe.position].get();
        const Fragment& fragment = run->fragments[probe.fragment];
        // The newest copy decides: dead there means held nowhere.
        if (!fragment.Live(probe.page * records_per_page_ + entry)) continue;
        (*where)[probe.index] = {run, probe.fragment, probe.page, entry};
        if (out != nullptr) {
          std::memcpy(out + probe.index * options_.record_bytes,
                      page + kPageHeaderBytes + entry * entry_bytes + 8,
                      static_cast<size_t>(options_.record_bytes));
        }
      }
    }
    waiting.swap(next);
  }
  return Status::Ok();
}

void RunStore::MarkDead(const Location& location) {
  Fragment& fragment = location.run->fragments[location.fragment];
  const int64_t bit = location.page * records_per_page_ + location.entry;
  if (!fragment.Live(bit)) return;  // a key given twice in one call
  fragment.SetDead(bit);
  --fragment.live;
  --location.run->live;
}

Status RunStore::ReadBatch(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  try {
    std::vector<Location> where;
    Status s = Locate(keys, n, &where, out);
    if (!s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      found[i] = where[i].run != nullptr;
      stats_.records_read += found[i];
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory reading rows from disk");
  }
  return Status::Ok();
}

Status RunStore::Take(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckWritable(); !s.ok()) return s;
  try {
    std::vector<Location> where;
    Status s = Locate(keys, n, &where, out);
    if (!s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      found[i] = where[i].run != nullptr;
      if (found[i]) {
        MarkDead(where[i]);
        ++stats_.records_read;
      }
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory reading rows from disk");
  }
  return Status::Ok();
}

Status RunStore::Discard(const int64_t* keys, int64_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckWritable(); !s.ok()) return s;
  try {
    std::vector<Location> where;
    Status s = Locate(keys, n, &where, nullptr);
    if (!s.ok()) return s;
    for (const Location& location : where) {
      if (location.run != nullptr) MarkDead(location);
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory removing rows from disk");
  }
  return Status::Ok();
}

Status RunStore::Contains(const int64_t* keys, int64_t n, uint8_t* found) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  try {
    std::vector<Location> where;
    Status s = Locate(keys, n, &where, nullptr);
    if (!s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) found[i] = where[i].run != nullptr;
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory looking rows up on disk");
  }
  return Status::Ok();
}

Status RunStore::MayContain(const int64_t* keys, int64_t n, uint8_t* maybe) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  try {
    // Run by run, newest first, over the keys no filter has let through yet.
    // A key's fragment, then its first page hash and filter block, are
    // prefetched kAhead keys ahead: three dependent cache misses a key and run
    // otherwise (12% of a fill's CPU at 20 runs).
    constexpr int64_t kAhead = 8;
    std::vector<uint64_t> hashes(static_cast<size_t>(n));
    std::vector<int64_t> pending(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      hashes[i] = KeyHash(keys[i]);
      pending[i] = i;
      maybe[i] = 0;
    }
    for (auto it = runs_.rbegin(); it != runs_.rend() && !pending.empty(); ++it) {
      const Run& run = **it;
      const int64_t count = static_cast<int64_t>(pending.size());
      int64_t kept = 0;
      for (int64_t j = 0; j < count; ++j) {
        if (j + 2 * kAhead < count) {
          const Fragment* ahead = &run.fragments[run.FragmentOf(hashes[pending[j + 2 * kAhead]])];
          PrefetchLine(ahead);
          PrefetchLine(reinterpret_cast<const char*>(ahead) + sizeof(Fragment) - 1);
        }
        if (j + kAhead < count) {
          const uint64_t hash = hashes[pending[j + kAhead]];
          const Fragment& ahead = run.fragments[run.FragmentOf(hash)];
          if (ahead.pages > 0) {
            PrefetchLine(ahead.page_hash.data());
            PrefetchLine(ahead.bloom.data() + 8 * Bloom::Block(hash, ahead.bloom.size() / 8));
          }
        }
        const int64_t i = pending[j];
        const uint64_t hash = hashes[i];
        const Fragment& fragment = run.fragments[run.FragmentOf(hash)];
        if (fragment.pages > 0 && hash >= fragment.page_hash[0] &&
            Bloom::MayHold(fragment.bloom, hash)) {
          maybe[i] = 1;
        } else {
          pending[kept++] = i;
        }
      }
      pending.resize(static_cast<size_t>(kept));
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory looking keys up in the disk filters");
  }
  return Status::Ok();
}

// The scan cursor: run (14 bits) | fragment (12) | page in fragment (28) | entry (10).
namespace {
constexpr int kCursorEntryBits = 10, kCursorPageBits = 28, kCursorFragmentBits = 12;
uint64_t PackCursor(uint64_t run, uint64_t fragment, uint64_t page, uint64_t entry) {
  return (((run << kCursorFragmentBits | fragment) << kCursorPageBits | page)
          << kCursorEntryBits) | entry;
}
}  // namespace

Status RunStore::Scan(uint64_t* cursor, int64_t max_records, int64_t* keys, uint8_t* records,
                      int64_t* count) {
  std::lock_guard<std::mutex> lock(mutex_);
  *count = 0;
  if (Status s = CheckOpen(); !s.ok()) return s;
  uint64_t entry = *cursor & ((1u << kCursorEntryBits) - 1);
  uint64_t page = (*cursor >> kCursorEntryBits) & ((uint64_t{1} << kCursorPageBits) - 1);
  uint64_t fragment_index =
      (*cursor >> (kCursorEntryBits + kCursorPageBits)) & ((1u << kCursorFragmentBits) - 1);
  uint64_t run_index = *cursor >> (kCursorEntryBits + kCursorPageBits + kCursorFragmentBits);
  const int64_t entry_bytes = EntryBytes();
  try {
    std::vector<uint8_t> buffer;
    while (*count < max_records && run_index < runs_.size()) {
      const Run& run = *runs_[run_index];
      if (fragment_index >= run.fragments.size()) {
        ++run_index;
        fragment_index = page = entry = 0;
        continue;
      }
      const Fragment& fragment = run.fragments[fragment_index];
      if (static_cast<int64_t>(page) >= fragment.pages) {
        ++fragment_index;
        page = entry = 0;
        continue;
      }
      const int64_t chunk = std::min<int64_t>(StreamPages(), fragment.pages - page);
      buffer.resize(static_cast<size_t>(chunk * page_bytes_));
      int64_t got = 0;
      const int64_t first = fragment.first_page + static_cast<int64_t>(page);
      const int error = ReadAll(run.fd, buffer.data(), chunk * page_bytes_, PageOffset(first), &got);
      if (error != 0) return IoError("reading run file", PathOf(run), error);
      ++stats_.reads;
      stats_.bytes_read += got;
      if (got != chunk * page_bytes_) {
        return CorruptPage(run, first + got / page_bytes_, "the file ends inside it");
      }
      for (int64_t p = 0; p < chunk && *count < max_records; ++p) {
        const uint8_t* data = buffer.data() + p * page_bytes_;
        if (Status s = CheckPage(run, first + p, data); !s.ok()) {
          return Status(s.code(), s.message() + " (it says it holds " + PageKeys(data) + ")");
        }
        uint32_t in_page;
        std::memcpy(&in_page, data + 4, 4);
        for (; entry < in_page && *count < max_records; ++entry) {
          if (!fragment.Live(static_cast<int64_t>(page) * records_per_page_ +
                             static_cast<int64_t>(entry))) {
            continue;
          }
          const uint8_t* at = data + kPageHeaderBytes + entry * entry_bytes;
          std::memcpy(&keys[*count], at, 8);
          std::memcpy(records + *count * options_.record_bytes, at + 8,
                      static_cast<size_t>(options_.record_bytes));
          ++*count;
        }
        if (entry >= in_page) {
          ++page;
          entry = 0;
        }
      }
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory scanning the run store");
  }
  *cursor = PackCursor(run_index, fragment_index, page, entry);
  return Status::Ok();
}

Status RunStore::Sync() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  for (auto& run : runs_) {
    if (run->synced) continue;
    if (::fdatasync(run->fd) != 0) return IoError("syncing run file", PathOf(*run), errno);
    run->synced = true;
  }
  return Status::Ok();
}

Status RunStore::Maintenance(int64_t max_bytes, int64_t* bytes_moved) {
  std::lock_guard<std::mutex> lock(mutex_);
  *bytes_moved = 0;
  if (Status s = CheckWritable(); !s.ok()) return s;
  try {
    while (*bytes_moved < max_bytes) {
      if (merge_ == nullptr && !PickMerge()) break;
      int64_t moved = 0;
      Status s = MergeFragment(&moved);
      if (!s.ok()) return s;
      *bytes_moved += moved;
      if (merge_->next_fragment == static_cast<int64_t>(merge_->output->fragments.size())) {
        FinishMerge();
      }
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory merging runs (the store is as it was)");
  }
  return Status::Ok();
}

RowStoreStats RunStore::Stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  RowStoreStats stats = stats_;
  stats.live_records = 0;
  stats.index_bytes = static_cast<int64_t>(sizeof(RunStore) + runs_.capacity() * sizeof(void*));
  stats.disk_bytes = 0;
  stats.segments = static_cast<int64_t>(runs_.size());
  for (const auto& run : runs_) {
    stats.live_records += run->live;
    stats.index_bytes += run->IndexBytes();
    stats.disk_bytes += PageOffset(run->pages);
  }
  // Filter bits, a live bit, the page index's share and a fragment's fixed
  // part (its struct and three small arrays) spread over its records.
  const int64_t fragment_fixed = static_cast<int64_t>(sizeof(Fragment)) + 64 + 3 * 32;
  const double per_record = options_.bloom_bits_per_key / 8.0 + 1.0 / 8 +
                            8.0 / records_per_page_ +
                            static_cast<double>(fragment_fixed) /
                                static_cast<double>(records_per_page_ * min_pages_per_fragment_);
  stats.index_bytes_per_record = static_cast<int64_t>(per_record) + 1;
  // A lookup round's pages, or a new run's page buffer and fixed part; a
  // merge step's read chunk and staged fragment.
  stats.read_unit_bytes = page_bytes_;
  stats.working_bytes = std::max(ReadRoundPages(), StreamPages()) * page_bytes_ +
                        static_cast<int64_t>(sizeof(Run)) + fragment_fixed + 64;
  stats.maintenance_bytes = StreamPages() * page_bytes_ + MergeStagingBytes() +
                            static_cast<int64_t>(sizeof(Run)) + fragment_fixed + 64;
  return stats;
}

Status RunStore::Close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return Status::Ok();
  Status result;
  for (auto& run : runs_) {
    if (run->fd < 0) continue;
    if (options_.durable && !run->synced && ::fdatasync(run->fd) != 0 && result.ok()) {
      result = IoError("syncing run file", PathOf(*run), errno);
    }
    ::close(run->fd);
    run->fd = -1;
  }
  closed_ = true;
  return result;
}

}  // namespace run_store

namespace {

Status ValidateRunOptions(const RunStoreOptions& options) {
  if (options.directory.empty()) {
    return Status(StatusCode::kInvalidArgument, "a run store needs a directory");
  }
  if (options.record_bytes < 1 || options.record_bytes > (64 << 20)) {
    return Status(StatusCode::kInvalidArgument,
                  "record_bytes must be between 1 and 64 MiB, got " +
                      std::to_string(options.record_bytes));
  }
  if (options.bloom_bits_per_key < 1 || options.bloom_bits_per_key > 64) {
    return Status(StatusCode::kInvalidArgument, "bloom_bits_per_key must be between 1 and 64");
  }
  if (options.merge_fan_in < 2) {
    return Status(StatusCode::kInvalidArgument, "merge_fan_in must be at least 2");
  }
  return Status::Ok();
}

}  // namespace

Status OpenRunStore(const RunStoreOptions& options, std::unique_ptr<RowStore>* out) {
  if (Status s = ValidateRunOptions(options); !s.ok()) return s;
  std::unique_ptr<run_store::RunStore> store;
  try {
    store.reset(new run_store::RunStore(options));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory opening a run store");
  }
  Status s = store->Open();
  if (!s.ok()) return s;
  *out = std::move(store);
  return Status::Ok();
}

}  // namespace kvsparse
