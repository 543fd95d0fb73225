// engine_bench: kvsparse's disk engines against RocksDB's C++ API and against
// the disk's own limit, on the same batches of the same ids in one process.
//
// Engines (--engines, comma separated, run one after another):
//   segment  kvsparse's SegmentStore through the RowStore interface;
//   run      kvsparse's RunStore (built in when csrc/run_store.h exists);
//   rocksdb  RocksDB, DB::MultiGet on each batch (split into --rocksdb-read-threads
//            slices read at once, as FBGEMM's sharded SSD cache does, since this
//            RocksDB has no io_uring and one MultiGet reads its blocks one by one),
//            WriteBatch writes, tuned for point lookups: WAL off, no compression,
//            a 10-bit full bloom filter, 4 KiB blocks, --rocksdb-cache-mib block cache;
//   disk     the disk's own limit: the records as a dense array of 4 KiB pages
//            (no record crosses a page), one O_DIRECT 4 KiB pread per lookup at
//            queue depth --threads, loaded by sequential O_DIRECT writes, updated
//            in place (a page written back per record written).
//
// Phases, each engine in turn (benchmarks/engine_compare.py has the same):
//   load   --rows records in a shuffled id order, --write-batch records a batch,
//          then everything on disk (syncfs) and the engine's own background
//          work done (RocksDB's compactions, kvsparse's merges: "settle");
//   read   batches of --read-batches distinct ids, uniform and Zipf(--zipf)
//          (ranks scattered over the ids by a fixed permutation), --read-keys ids
//          per batch size and distribution, the page cache dropped before each;
//   mixed  --steps steps: read --step-keys distinct ids, write back the first
//          half of them with new contents (what a tiered table does: rows taken
//          into memory, rows evicted back), then syncfs.
// The kvsparse engines get Maintenance(--maintenance-factor x the bytes just
// written) after every write, the credit a tiered table gives them.
//
// --verify checks every record read, of every engine, against the bytes its
// key and version must hold (Pattern, workload.h); any mismatch or missing key
// makes the program exit 1.
//
//   engine_bench --engines segment,rocksdb,disk --rows 2000000 --record-bytes 80
//       --dir /work/tmp/engine_cpp --json out.json --verify
//
// Timings cover the engine calls only (not id generation or verification).
// Adding an engine: a class in engines.h and a branch in OpenEngine below.
#include <fcntl.h>
#include <rocksdb/version.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../../csrc/segment_store.h"
#include "engines.h"
#include "report_json.h"
#include "workload.h"
// RunStore joins when its header exists; build.sh compiles csrc/run_*.cc then.
#if __has_include("../../csrc/run_store.h")
#include "../../csrc/run_store.h"
#define ENGINE_BENCH_HAS_RUN_STORE 1
#else
#define ENGINE_BENCH_HAS_RUN_STORE 0
#endif

namespace engine_bench {

// ---------------------------------------------------------------------------
// What the process did to the disk (/proc/self/io): bytes that reached the
// storage layer, all threads together (RocksDB's compactions included).

struct ProcessIo {
  int64_t read_bytes = 0;
  int64_t write_bytes = 0;  // minus cancelled_write_bytes: dirty pages of files deleted unwritten
};

ProcessIo ReadProcessIo() {
  ProcessIo io;
  std::ifstream file("/proc/self/io");
  std::string name;
  int64_t value = 0;
  int64_t cancelled = 0;
  while (file >> name >> value) {
    if (name == "read_bytes:") io.read_bytes = value;
    if (name == "write_bytes:") io.write_bytes = value;
    if (name == "cancelled_write_bytes:") cancelled = value;
  }
  io.write_bytes -= cancelled;
  return io;
}

Status SyncDirectory(const std::string& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("open " + directory);
  const int rc = ::syncfs(fd);
  ::close(fd);
  return rc == 0 ? Status::Ok() : IoError("syncfs " + directory);
}

// Empties the page cache of directory's files and says how: drop_caches
// (every clean page of the machine, as root) or fadvise_dontneed (this
// engine's files only).
std::string DropPageCache(const std::string& directory) {
  ::sync();
  {
    std::ofstream drop("/proc/sys/vm/drop_caches");
    if (drop && (drop << "3\n") && drop.flush()) return "drop_caches";
  }
  std::error_code error;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(directory, error)) {
    if (!entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  return "fadvise_dontneed";
}

int64_t DirectoryBytes(const std::string& directory) {
  int64_t total = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(directory, error)) {
    if (entry.is_regular_file()) total += static_cast<int64_t>(entry.file_size(error));
  }
  return total;
}

// ---------------------------------------------------------------------------
// Options and the phases.

struct Options {
  std::vector<std::string> engines = {"segment", "rocksdb", "disk"};
  int64_t rows = 200000;
  int64_t record_bytes = 80;
  int64_t write_batch = 65536;
  std::vector<int64_t> read_batches = {4096, 16384};
  int64_t read_keys = 65536;
  int64_t steps = 8;
  int64_t step_keys = 16384;
  int64_t threads = 16;
  int64_t maintenance_factor = 8;
  double zipf = 1.1;
  uint64_t seed = 7;
  RocksSettings rocks;
  std::string directory;
  std::string json_path;
  bool verify = false;
  bool inject_mismatch = false;  // a self-test of --verify: one record per engine counts as wrong
  bool keep = false;
};

const char kUsage[] =
    "usage: engine_bench --dir DIR [--engines segment,rocksdb,disk,run] [--rows N]\n"
    "    [--record-bytes B] [--write-batch N] [--read-batches 4096,16384] [--read-keys N]\n"
    "    [--steps N] [--step-keys N] [--threads N] [--maintenance-factor F] [--zipf S]\n"
    "    [--seed N] [--rocksdb-cache-mib M] [--rocksdb-write-buffer-mib M]\n"
    "    [--rocksdb-read-threads N] [--json PATH] [--verify [--inject-mismatch]] [--keep]\n";

std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

bool ParseOptions(int argc, char** argv, Options* options, std::string* error) {
  bool rocksdb_read_threads_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--verify") {
      options->verify = true;
      continue;
    }
    if (flag == "--inject-mismatch") {
      options->inject_mismatch = true;
      continue;
    }
    if (flag == "--keep") {
      options->keep = true;
      continue;
    }
    if (i + 1 >= argc) {
      *error = "missing value after " + flag;
      return false;
    }
    const std::string value = argv[++i];
    try {
      if (flag == "--engines") {
        options->engines = SplitCommas(value);
      } else if (flag == "--rows") {
        options->rows = std::stoll(value);
      } else if (flag == "--record-bytes") {
        options->record_bytes = std::stoll(value);
      } else if (flag == "--write-batch") {
        options->write_batch = std::stoll(value);
      } else if (flag == "--read-batches") {
        options->read_batches.clear();
        for (const std::string& part : SplitCommas(value)) {
          options->read_batches.push_back(std::stoll(part));
        }
      } else if (flag == "--read-keys") {
        options->read_keys = std::stoll(value);
      } else if (flag == "--steps") {
        options->steps = std::stoll(value);
      } else if (flag == "--step-keys") {
        options->step_keys = std::stoll(value);
      } else if (flag == "--threads") {
        options->threads = std::stoll(value);
      } else if (flag == "--maintenance-factor") {
        options->maintenance_factor = std::stoll(value);
      } else if (flag == "--zipf") {
        options->zipf = std::stod(value);
      } else if (flag == "--seed") {
        options->seed = std::stoull(value);
      } else if (flag == "--rocksdb-cache-mib") {
        options->rocks.cache_bytes = std::stoll(value) << 20;
      } else if (flag == "--rocksdb-write-buffer-mib") {
        options->rocks.write_buffer_bytes = std::stoll(value) << 20;
      } else if (flag == "--rocksdb-read-threads") {
        options->rocks.read_threads = std::stoll(value);
        rocksdb_read_threads_given = true;
      } else if (flag == "--dir") {
        options->directory = value;
      } else if (flag == "--json") {
        options->json_path = value;
      } else {
        *error = "unknown flag " + flag;
        return false;
      }
    } catch (const std::exception&) {
      *error = "bad value for " + flag + ": " + value;
      return false;
    }
  }
  if (!rocksdb_read_threads_given) options->rocks.read_threads = options->threads;
  int64_t largest_batch = options->step_keys;
  for (int64_t b : options->read_batches) largest_batch = std::max(largest_batch, b);
  if (options->directory.empty()) {
    *error = "--dir is required";
  } else if (options->rows < 2 || options->record_bytes < 1 || options->write_batch < 1 ||
             options->threads < 1 || options->steps < 0 || options->read_keys < 1 ||
             options->step_keys < 2 || options->read_batches.empty()) {
    *error = "sizes must be positive (rows >= 2, step-keys >= 2)";
  } else if (largest_batch * 2 > options->rows) {
    *error = "a batch of distinct ids must be at most half of --rows";
  } else if (options->engines.empty()) {
    *error = "no engine named";
  }
  return error->empty();
}

// Every engine gets the same batches: drawn once, before any engine runs.
struct Workload {
  std::vector<int64_t> load_order;  // ids in the order they are loaded
  struct ReadPhase {
    std::string distribution;
    int64_t batch;
    std::vector<std::vector<int64_t>> batches;
  };
  std::vector<ReadPhase> reads;
  struct MixedPhase {
    std::string distribution;
    std::vector<std::vector<int64_t>> steps;
  };
  std::vector<MixedPhase> mixed;
};

Workload MakeWorkload(const Options& options) {
  Workload workload;
  workload.load_order.resize(static_cast<size_t>(options.rows));
  for (int64_t i = 0; i < options.rows; ++i) workload.load_order[i] = i;
  // A disk tier spills rows in no id order.
  std::mt19937_64 load_rng(options.seed + 1);
  std::shuffle(workload.load_order.begin(), workload.load_order.end(), load_rng);

  IdSource ids(options.rows, options.zipf, options.seed + 2);
  std::mt19937_64 rng(options.seed + 3);
  for (const std::string distribution : {"uniform", "zipf"}) {
    for (int64_t batch : options.read_batches) {
      Workload::ReadPhase phase{distribution, batch, {}};
      const int64_t count = std::max<int64_t>(1, options.read_keys / batch);
      for (int64_t b = 0; b < count; ++b) {
        phase.batches.push_back(ids.Batch(distribution, batch, rng));
      }
      workload.reads.push_back(std::move(phase));
    }
  }
  for (const std::string distribution : {"uniform", "zipf"}) {
    Workload::MixedPhase phase{distribution, {}};
    for (int64_t s = 0; s < options.steps; ++s) {
      phase.steps.push_back(ids.Batch(distribution, options.step_keys, rng));
    }
    workload.mixed.push_back(std::move(phase));
  }
  return workload;
}

// The records a run of one engine expects: every key's current version.
class RecordBook {
 public:
  // inject_mismatch: the first record checked is expected with another
  // version, so that a test can see the check fail (--inject-mismatch).
  RecordBook(int64_t rows, int64_t record_bytes, bool verify, bool inject_mismatch)
      : versions_(static_cast<size_t>(rows), 0),
        record_bytes_(record_bytes),
        verify_(verify),
        inject_mismatch_(inject_mismatch),
        expected_(static_cast<size_t>(record_bytes)) {}

  void Fill(const int64_t* keys, int64_t n, uint32_t version, std::vector<uint8_t>* records) {
    records->resize(static_cast<size_t>(n * record_bytes_));
    for (int64_t i = 0; i < n; ++i) {
      versions_[keys[i]] = version;
      Pattern(keys[i], version, record_bytes_, records->data() + i * record_bytes_);
    }
  }

  // Counts keys not found and (with verify) records whose bytes are wrong.
  void Check(const int64_t* keys, int64_t n, const uint8_t* out, const uint8_t* found) {
    for (int64_t i = 0; i < n; ++i) {
      if (!found[i]) {
        Report("key " + std::to_string(keys[i]) + " not found");
        ++missing_;
        continue;
      }
      if (!verify_) continue;
      const uint32_t wrong = inject_mismatch_ && verified_ == 0 ? 1 : 0;
      Pattern(keys[i], versions_[keys[i]] + wrong, record_bytes_, expected_.data());
      if (std::memcmp(expected_.data(), out + i * record_bytes_,
                      static_cast<size_t>(record_bytes_)) != 0) {
        Report("key " + std::to_string(keys[i]) + " read back other bytes than written (version " +
               std::to_string(versions_[keys[i]]) + ")");
        ++mismatches_;
      }
      ++verified_;
    }
  }

  int64_t missing() const { return missing_; }
  int64_t mismatches() const { return mismatches_; }
  int64_t verified() const { return verified_; }

 private:
  void Report(const std::string& message) {
    if (missing_ + mismatches_ < 5) std::fprintf(stderr, "engine_bench: %s\n", message.c_str());
  }

  std::vector<uint32_t> versions_;
  int64_t record_bytes_;
  bool verify_;
  bool inject_mismatch_;
  std::vector<uint8_t> expected_;
  int64_t missing_ = 0, mismatches_ = 0, verified_ = 0;
};

// Runs the phases on one engine; a failed engine call returns its Status.
class EngineRun {
 public:
  EngineRun(const Options& options, const Workload& workload, Engine* engine, std::string directory)
      : options_(options),
        workload_(workload),
        engine_(engine),
        directory_(std::move(directory)),
        book_(options.rows, options.record_bytes, options.verify, options.inject_mismatch) {}

  Status Run(Json* result) {
    *result = Json::Object();
    result->Set("engine", engine_->Name());
    Json load;
    if (Status s = Load(&load); !s.ok()) return s;
    result->Set("load", std::move(load));
    const EngineMemory after_load = engine_->Memory();
    result->Set("disk_bytes_after_load", DirectoryBytes(directory_));

    Json reads = Json::Array();
    for (const Workload::ReadPhase& phase : workload_.reads) {
      Json read;
      if (Status s = Read(phase, &read); !s.ok()) return s;
      reads.Push(std::move(read));
    }
    result->Set("read", std::move(reads));

    Json mixed = Json::Array();
    uint32_t version = 1;
    EngineMemory peak = after_load;
    for (const Workload::MixedPhase& phase : workload_.mixed) {
      Json entry;
      EngineMemory before_flush;
      if (Status s = Mixed(phase, &version, &entry, &before_flush); !s.ok()) return s;
      if (before_flush.bytes > peak.bytes) peak = before_flush;
      mixed.Push(std::move(entry));
    }
    result->Set("mixed", std::move(mixed));
    const EngineMemory at_end = engine_->Memory();
    result->Set("disk_bytes_at_end", DirectoryBytes(directory_));
    const double rows = static_cast<double>(options_.rows);
    Json memory = Json::Object();
    memory.Set("ram_bytes_per_key_after_load", after_load.bytes / rows)
        .Set("ram_bytes_per_key_at_end", at_end.bytes / rows)
        .Set("ram_bytes_per_key_peak", std::max(peak.bytes, at_end.bytes) / rows)
        .Set("after_load", after_load.parts)
        .Set("peak_before_flush", peak.parts)
        .Set("at_end", at_end.parts);
    result->Set("memory", std::move(memory));
    result->Set("records_checked", book_.verified())
        .Set("missing", book_.missing())
        .Set("mismatches", book_.mismatches());
    return Status::Ok();
  }

  const RecordBook& book() const { return book_; }

 private:
  Status Load(Json* out) {
    const ProcessIo io_before = ReadProcessIo();
    const auto engine_before = engine_->EngineBytesWritten();
    std::vector<int64_t> in_id_order;
    const int64_t* order = workload_.load_order.data();
    if (engine_->LoadsInIdOrder()) {
      in_id_order.resize(static_cast<size_t>(options_.rows));
      for (int64_t i = 0; i < options_.rows; ++i) in_id_order[i] = i;
      order = in_id_order.data();
    }
    std::vector<uint8_t> records;
    double seconds = 0;
    for (int64_t begin = 0; begin < options_.rows; begin += options_.write_batch) {
      const int64_t n = std::min(options_.write_batch, options_.rows - begin);
      const int64_t* keys = order + begin;
      book_.Fill(keys, n, 0, &records);
      const Clock::time_point start = Clock::now();
      if (Status s = engine_->Write(keys, n, records.data()); !s.ok()) return s;
      seconds += SecondsSince(start);
    }
    Clock::time_point start = Clock::now();
    if (Status s = engine_->Flush(); !s.ok()) return s;
    if (Status s = SyncDirectory(directory_); !s.ok()) return s;
    seconds += SecondsSince(start);
    start = Clock::now();
    if (Status s = engine_->Settle(); !s.ok()) return s;
    if (Status s = SyncDirectory(directory_); !s.ok()) return s;
    const double settle_seconds = SecondsSince(start);
    const ProcessIo io_after = ReadProcessIo();
    const auto engine_after = engine_->EngineBytesWritten();

    const double count = static_cast<double>(options_.rows);
    const double record_bytes = count * static_cast<double>(options_.record_bytes);
    *out = Json::Object();
    out->Set("records", options_.rows)
        .Set("seconds", seconds)
        .Set("settle_seconds", settle_seconds)
        .Set("records_per_s", count / seconds)
        .Set("records_per_s_with_settle", count / (seconds + settle_seconds))
        .Set("mb_per_s", record_bytes / seconds / 1e6)
        .Set("process_write_bytes", io_after.write_bytes - io_before.write_bytes)
        .Set("write_amplification", (io_after.write_bytes - io_before.write_bytes) / record_bytes);
    AddEngineWriteAmplification(engine_before, engine_after, out);
    return Status::Ok();
  }

  Status Read(const Workload::ReadPhase& phase, Json* out) {
    const std::string drop = DropPageCache(directory_);
    const int64_t engine_reads_before = engine_->ReadsIssued();
    const ProcessIo io_before = ReadProcessIo();
    std::vector<uint8_t> records(static_cast<size_t>(phase.batch * options_.record_bytes));
    std::vector<uint8_t> found(static_cast<size_t>(phase.batch));
    double seconds = 0;
    int64_t lookups = 0;
    for (const std::vector<int64_t>& batch : phase.batches) {
      const int64_t n = static_cast<int64_t>(batch.size());
      const Clock::time_point start = Clock::now();
      if (Status s = engine_->Read(batch.data(), n, records.data(), found.data()); !s.ok()) {
        return s;
      }
      seconds += SecondsSince(start);
      book_.Check(batch.data(), n, records.data(), found.data());
      lookups += n;
    }
    const ProcessIo io_after = ReadProcessIo();
    *out = Json::Object();
    out->Set("distribution", phase.distribution)
        .Set("batch", phase.batch)
        .Set("records", lookups)
        .Set("seconds", seconds)
        .Set("records_per_s", lookups / seconds)
        .Set("mb_per_s", lookups * options_.record_bytes / seconds / 1e6)
        .Set("page_cache", drop)
        .Set("disk_read_bytes_per_lookup",
             static_cast<double>(io_after.read_bytes - io_before.read_bytes) / lookups);
    AddReadsPerLookup(engine_reads_before, lookups, out);
    return Status::Ok();
  }

  Status Mixed(const Workload::MixedPhase& phase, uint32_t* version, Json* out,
               EngineMemory* before_flush) {
    const std::string drop = DropPageCache(directory_);
    const int64_t engine_reads_before = engine_->ReadsIssued();
    const auto engine_before = engine_->EngineBytesWritten();
    const ProcessIo io_before = ReadProcessIo();
    std::vector<uint8_t> out_records(
        static_cast<size_t>(options_.step_keys * options_.record_bytes));
    std::vector<uint8_t> found(static_cast<size_t>(options_.step_keys));
    std::vector<uint8_t> records;
    double seconds = 0;
    int64_t read = 0, written = 0;
    for (const std::vector<int64_t>& step : phase.steps) {
      const int64_t n = static_cast<int64_t>(step.size());
      Clock::time_point start = Clock::now();
      if (Status s = engine_->Read(step.data(), n, out_records.data(), found.data()); !s.ok()) {
        return s;
      }
      seconds += SecondsSince(start);
      book_.Check(step.data(), n, out_records.data(), found.data());
      const int64_t back = n / 2;
      book_.Fill(step.data(), back, (*version)++, &records);
      start = Clock::now();
      if (Status s = engine_->Overwrite(step.data(), back, records.data()); !s.ok()) return s;
      seconds += SecondsSince(start);
      read += n;
      written += back;
    }
    *before_flush = engine_->Memory();
    Clock::time_point start = Clock::now();
    if (Status s = engine_->Flush(); !s.ok()) return s;
    if (Status s = SyncDirectory(directory_); !s.ok()) return s;
    seconds += SecondsSince(start);
    start = Clock::now();
    if (Status s = engine_->Settle(); !s.ok()) return s;
    if (Status s = SyncDirectory(directory_); !s.ok()) return s;
    const double settle_seconds = SecondsSince(start);
    const ProcessIo io_after = ReadProcessIo();
    const auto engine_after = engine_->EngineBytesWritten();

    const double written_bytes = static_cast<double>(written * options_.record_bytes);
    const int64_t process_written = io_after.write_bytes - io_before.write_bytes;
    *out = Json::Object();
    out->Set("distribution", phase.distribution)
        .Set("steps", static_cast<int64_t>(phase.steps.size()))
        .Set("step_keys", options_.step_keys)
        .Set("records_read", read)
        .Set("records_written", written)
        .Set("seconds", seconds)
        .Set("settle_seconds", settle_seconds)
        .Set("records_per_s", (read + written) / seconds)
        .Set("records_per_s_with_settle", (read + written) / (seconds + settle_seconds))
        .Set("steps_per_s", static_cast<double>(phase.steps.size()) / seconds)
        .Set("mb_per_s", (read + written) * options_.record_bytes / seconds / 1e6)
        .Set("page_cache", drop)
        .Set("process_write_bytes", process_written)
        .Set("write_amplification", process_written / written_bytes)
        .Set("disk_read_bytes_per_lookup",
             static_cast<double>(io_after.read_bytes - io_before.read_bytes) / read);
    AddEngineWriteAmplification(engine_before, engine_after, out);
    AddReadsPerLookup(engine_reads_before, read, out);
    return Status::Ok();
  }

  void AddEngineWriteAmplification(std::pair<int64_t, int64_t> before,
                                   std::pair<int64_t, int64_t> after, Json* out) const {
    const int64_t updated = after.second - before.second;
    if (updated > 0) {
      out->Set("engine_write_amplification",
               static_cast<double>(after.first - before.first) / updated);
    }
  }

  void AddReadsPerLookup(int64_t before, int64_t lookups, Json* out) const {
    const int64_t after = engine_->ReadsIssued();
    if (before >= 0 && after >= 0) {
      out->Set("engine_reads_per_lookup", static_cast<double>(after - before) / lookups);
    }
  }

  const Options& options_;
  const Workload& workload_;
  Engine* engine_;
  std::string directory_;
  RecordBook book_;
};

Status OpenEngine(const std::string& name, const Options& options, const std::string& directory,
                  std::unique_ptr<Engine>* out) {
  if (name == "segment") {
    kvsparse::SegmentStoreOptions store_options;
    store_options.directory = directory;
    store_options.record_bytes = options.record_bytes;
    store_options.read_threads = options.threads;
    store_options.durable = false;  // a disk tier's spill; each phase ends with syncfs
    std::unique_ptr<kvsparse::RowStore> store;
    Status s = kvsparse::OpenSegmentStore(store_options, &store);
    if (!s.ok()) return s;
    out->reset(new RowStoreEngine(name, std::move(store), options.maintenance_factor,
                                  /*discard_before_overwrite=*/false,
                                  /*one_read_per_record=*/true));
    return Status::Ok();
  }
  if (name == "run") {
#if ENGINE_BENCH_HAS_RUN_STORE
    kvsparse::RunStoreOptions store_options;
    store_options.directory = directory;
    store_options.record_bytes = options.record_bytes;
    store_options.read_threads = options.threads;
    store_options.durable = false;
    store_options.check_writes = false;  // as a tiered table opens it: it discards first
    std::unique_ptr<kvsparse::RowStore> store;
    Status s = kvsparse::OpenRunStore(store_options, &store);
    if (!s.ok()) return s;
    out->reset(new RowStoreEngine(name, std::move(store), options.maintenance_factor,
                                  /*discard_before_overwrite=*/true,
                                  /*one_read_per_record=*/false));
    return Status::Ok();
#else
    return Status(StatusCode::kInvalidArgument,
                  "engine run: built without csrc/run_store.h (rebuild with build.sh)");
#endif
  }
  if (name == "rocksdb") {
    return RocksEngine::Open(directory, options.record_bytes, options.rocks, out);
  }
  if (name == "disk") {
    return DiskEngine::Open(directory, options.record_bytes, options.threads, out);
  }
  return Status(StatusCode::kInvalidArgument, "unknown engine " + name);
}

std::string CommandLine(int argc, char** argv) {
  std::string line = "engine_bench";
  for (int i = 1; i < argc; ++i) line += std::string(" ") + argv[i];
  return line;
}

int Main(int argc, char** argv) {
  Options options;
  std::string error;
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!ParseOptions(argc, argv, &options, &error)) {
    std::fprintf(stderr, "engine_bench: %s\n%s", error.c_str(), kUsage);
    return 2;
  }
  std::filesystem::create_directories(options.directory);
  const Workload workload = MakeWorkload(options);

  Json engines = Json::Object();
  bool ok = true;
  int64_t mismatches = 0, missing = 0;
  for (const std::string& name : options.engines) {
    const std::string directory = options.directory + "/" + name;
    std::filesystem::remove_all(directory);
    std::fprintf(stderr, "engine_bench: %s, %lld records of %lld bytes ...\n", name.c_str(),
                 static_cast<long long>(options.rows),
                 static_cast<long long>(options.record_bytes));
    std::unique_ptr<Engine> engine;
    Status s = OpenEngine(name, options, directory, &engine);
    Json result;
    if (s.ok()) {
      EngineRun run(options, workload, engine.get(), directory);
      s = run.Run(&result);
      mismatches += run.book().mismatches();
      missing += run.book().missing();
      Status closed = engine->Close();
      if (s.ok()) s = closed;
    }
    engine.reset();
    if (!options.keep) std::filesystem::remove_all(directory);
    if (!s.ok()) {
      std::fprintf(stderr, "engine_bench: %s failed: %s\n", name.c_str(), s.message().c_str());
      result = Json::Object();
      result.Set("engine", name).Set("error", s.message());
      ok = false;
    }
    engines.Set(name, std::move(result));
  }

  Json report = Json::Object();
  Json read_batches = Json::Array();
  for (int64_t b : options.read_batches) read_batches.Push(b);
  Json rocks = Json::Object();
  rocks
      .Set("version", std::to_string(ROCKSDB_MAJOR) + "." + std::to_string(ROCKSDB_MINOR) + "." +
                          std::to_string(ROCKSDB_PATCH))
      .Set("block_cache_bytes", options.rocks.cache_bytes)
      .Set("write_buffer_bytes", options.rocks.write_buffer_bytes)
      .Set("multiget_threads", options.rocks.read_threads)
      .Set("settings",
           "WAL off, no compression, 10-bit full bloom filter, 4 KiB blocks, index and filters "
           "outside the block cache, max_open_files -1, dynamic level bytes");
  report.Set("benchmark", "engine_cpp")
      .Set("command", CommandLine(argc, argv))
      .Set("rows", options.rows)
      .Set("record_bytes", options.record_bytes)
      .Set("write_batch", options.write_batch)
      .Set("read_batches", std::move(read_batches))
      .Set("read_keys", options.read_keys)
      .Set("steps", options.steps)
      .Set("step_keys", options.step_keys)
      .Set("threads", options.threads)
      .Set("maintenance_factor", options.maintenance_factor)
      .Set("zipf", options.zipf)
      .Set("verify", options.verify)
      .Set("run_store_built", static_cast<bool>(ENGINE_BENCH_HAS_RUN_STORE))
      .Set("rocksdb", std::move(rocks))
      .Set("engines", std::move(engines))
      .Set("missing", missing)
      .Set("mismatches", mismatches)
      .Set("ok", ok && missing == 0 && mismatches == 0);
  const std::string text = report.Dump() + "\n";
  if (options.json_path.empty()) {
    std::fputs(text.c_str(), stdout);
  } else {
    std::ofstream file(options.json_path);
    file << text;
    if (!file) {
      std::fprintf(stderr, "engine_bench: cannot write %s\n", options.json_path.c_str());
      return 1;
    }
  }
  if (missing || mismatches) {
    std::fprintf(stderr, "engine_bench: %lld keys missing, %lld records wrong\n",
                 static_cast<long long>(missing), static_cast<long long>(mismatches));
    return 1;
  }
  return ok ? 0 : 1;
}

}  // namespace engine_bench

int main(int argc, char** argv) { return engine_bench::Main(argc, argv); }
