// The engines engine_bench compares, behind one small interface: kvsparse's
// RowStore engines (RowStoreEngine), RocksDB through its C++ API (RocksEngine)
// and the disk's own limit (DiskEngine).
//
//   std::unique_ptr<engine_bench::Engine> engine;
//   Status s = engine_bench::RocksEngine::Open(dir, 80, settings, &engine);
//   s = engine->Write(keys, n, records);
//   s = engine->Read(keys, n, out, found);
//
// Thread-safety: an Engine is called by one thread at a time (the benchmark's);
// engines run their own read threads inside Read and Overwrite.
#ifndef KVSPARSE_BENCH_ENGINE_CPP_ENGINES_H_
#define KVSPARSE_BENCH_ENGINE_CPP_ENGINES_H_

#include <fcntl.h>
#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/perf_context.h>
#include <rocksdb/perf_level.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../csrc/read_pool.h"
#include "../../csrc/row_store.h"
#include "../../csrc/status.h"
#include "report_json.h"

namespace engine_bench {

using kvsparse::Status;
using kvsparse::StatusCode;
using Clock = std::chrono::steady_clock;

constexpr int64_t kPage = 4096;

inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline Status IoError(const std::string& what) {
  return Status(StatusCode::kIoError, what + ": " + std::strerror(errno));
}

struct EngineMemory {
  int64_t bytes = 0;            // the engine's RAM that grows with the data
  Json parts = Json::Object();  // where it goes
};

// One engine under test. Ids are 0..rows-1; a batch holds distinct ids.
class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string Name() const = 0;
  // New records (keys the engine does not hold).
  virtual Status Write(const int64_t* keys, int64_t n, const uint8_t* records) = 0;
  // Records of keys the engine holds, replaced.
  virtual Status Overwrite(const int64_t* keys, int64_t n, const uint8_t* records) = 0;
  virtual Status Read(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) = 0;
  // Everything written so far handed to the files (a memtable flushed).
  virtual Status Flush() = 0;
  // Background work the writes so far caused, done (compactions, merges).
  virtual Status Settle() = 0;
  virtual EngineMemory Memory() const = 0;
  // Reads the engine issued or blocks it fetched since it opened, where it
  // counts them (-1: it does not).
  virtual int64_t ReadsIssued() const { return -1; }
  // Bytes the engine itself says it wrote, and of records it was asked to
  // write (0, 0 where it does not count).
  virtual std::pair<int64_t, int64_t> EngineBytesWritten() const { return {0, 0}; }
  // Loaded with new ids in id order (else in the workload's shuffled order).
  virtual bool LoadsInIdOrder() const { return false; }
  virtual Status Close() = 0;
};

// kvsparse's engines through the RowStore interface.
class RowStoreEngine : public Engine {
 public:
  // discard_before_overwrite: the store refuses a write of a key it holds.
  // one_read_per_record: the store does not count its reads (RowStoreStats.reads
  // stays 0) because it issues exactly one pread per record it serves.
  RowStoreEngine(std::string name, std::unique_ptr<kvsparse::RowStore> store,
                 int64_t maintenance_factor, bool discard_before_overwrite,
                 bool one_read_per_record)
      : name_(std::move(name)),
        store_(std::move(store)),
        maintenance_factor_(maintenance_factor),
        discard_before_overwrite_(discard_before_overwrite),
        one_read_per_record_(one_read_per_record) {}

  std::string Name() const override { return name_; }

  Status Write(const int64_t* keys, int64_t n, const uint8_t* records) override {
    Status s = store_->WriteBatch(keys, n, records);
    if (!s.ok()) return s;
    return Maintain(n);
  }

  Status Overwrite(const int64_t* keys, int64_t n, const uint8_t* records) override {
    // RunStore's contract: a key is written only once taken out (a tiered
    // table's Take); Discard is that removal without the read, done in RAM.
    if (discard_before_overwrite_) {
      Status s = store_->Discard(keys, n);
      if (!s.ok()) return s;
    }
    return Write(keys, n, records);
  }

  Status Read(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) override {
    return store_->ReadBatch(keys, n, out, found);
  }

  Status Flush() override { return store_->Flush(); }

  Status Settle() override {
    for (int i = 0; i < 100000; ++i) {
      int64_t moved = 0;
      Status s = store_->Maintenance(int64_t{64} << 20, &moved);
      if (!s.ok() || moved == 0) return s;
    }
    return Status::Ok();
  }

  EngineMemory Memory() const override {
    const kvsparse::RowStoreStats stats = store_->Stats();
    EngineMemory memory;
    memory.bytes = stats.index_bytes;
    memory.parts.Set("index_bytes", stats.index_bytes)
        .Set("live_records", stats.live_records)
        .Set("files", stats.segments);
    return memory;
  }

  int64_t ReadsIssued() const override {
    const kvsparse::RowStoreStats stats = store_->Stats();
    return one_read_per_record_ ? stats.records_read : stats.reads;
  }

  std::pair<int64_t, int64_t> EngineBytesWritten() const override {
    const kvsparse::RowStoreStats stats = store_->Stats();
    return {stats.bytes_written, stats.bytes_updated};
  }

  Status Close() override { return store_->Close(); }

 private:
  Status Maintain(int64_t written) {
    const int64_t credit = maintenance_factor_ * written * store_->Stats().record_bytes;
    if (credit <= 0) return Status::Ok();
    int64_t moved = 0;
    return store_->Maintenance(credit, &moved);
  }

  std::string name_;
  std::unique_ptr<kvsparse::RowStore> store_;
  int64_t maintenance_factor_;
  bool discard_before_overwrite_;
  bool one_read_per_record_;
};

inline Status FromRocks(const rocksdb::Status& status, const std::string& what) {
  if (status.ok()) return Status::Ok();
  return Status(StatusCode::kIoError, "rocksdb " + what + ": " + status.ToString());
}

struct RocksSettings {
  int64_t cache_bytes = 8 << 20;
  int64_t write_buffer_bytes = 64 << 20;
  int64_t read_threads = 16;
};

class RocksEngine : public Engine {
 public:
  static Status Open(const std::string& directory, int64_t record_bytes,
                     const RocksSettings& settings, std::unique_ptr<Engine>* out) {
    rocksdb::Options options;
    options.create_if_missing = true;
    options.compression = rocksdb::kNoCompression;
    options.bottommost_compression = rocksdb::kNoCompression;
    options.write_buffer_size = static_cast<size_t>(settings.write_buffer_bytes);
    options.level_compaction_dynamic_level_bytes = true;
    options.max_open_files = -1;  // every table reader open: no reopen on a lookup
    rocksdb::BlockBasedTableOptions table;
    table.block_size = kPage;
    table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10, /*use_block_based_builder=*/false));
    table.whole_key_filtering = true;
    table.block_cache = rocksdb::NewLRUCache(static_cast<size_t>(settings.cache_bytes));
    // Index and filters stay in the table readers' own memory (not competing
    // with data blocks for the cache): counted by estimate-table-readers-mem.
    table.cache_index_and_filter_blocks = false;
    options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
    rocksdb::DB* db = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(options, directory, &db);
    if (!s.ok()) return FromRocks(s, "open " + directory);
    out->reset(new RocksEngine(db, record_bytes, settings));
    return Status::Ok();
  }

  ~RocksEngine() override { delete db_; }

  std::string Name() const override { return "rocksdb"; }

  Status Write(const int64_t* keys, int64_t n, const uint8_t* records) override {
    rocksdb::WriteBatch batch;
    char key[8];
    for (int64_t i = 0; i < n; ++i) {
      EncodeKey(keys[i], key);
      batch.Put(rocksdb::Slice(key, 8),
                rocksdb::Slice(reinterpret_cast<const char*>(records + i * record_bytes_),
                               static_cast<size_t>(record_bytes_)));
    }
    return FromRocks(db_->Write(write_options_, &batch), "write");
  }

  Status Overwrite(const int64_t* keys, int64_t n, const uint8_t* records) override {
    return Write(keys, n, records);
  }

  Status Read(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) override {
    const int64_t slices = std::min<int64_t>(std::max<int64_t>(1, read_threads_), n);
    std::atomic<int64_t> failed_slice{-1};
    std::vector<std::string> errors(static_cast<size_t>(slices));
    pool_.Run(slices, [&](int64_t slice) {
      const int64_t begin = n * slice / slices;
      const int64_t end = n * (slice + 1) / slices;
      const int64_t m = end - begin;
      std::vector<char> key_bytes(static_cast<size_t>(8 * m));
      std::vector<rocksdb::Slice> key_slices(static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) {
        EncodeKey(keys[begin + i], key_bytes.data() + 8 * i);
        key_slices[i] = rocksdb::Slice(key_bytes.data() + 8 * i, 8);
      }
      std::vector<rocksdb::PinnableSlice> values(static_cast<size_t>(m));
      std::vector<rocksdb::Status> statuses(static_cast<size_t>(m));
      rocksdb::SetPerfLevel(rocksdb::PerfLevel::kEnableCount);
      rocksdb::get_perf_context()->Reset();
      db_->MultiGet(read_options_, db_->DefaultColumnFamily(), static_cast<size_t>(m),
                    key_slices.data(), values.data(), statuses.data());
      blocks_read_ += static_cast<int64_t>(rocksdb::get_perf_context()->block_read_count);
      for (int64_t i = 0; i < m; ++i) {
        uint8_t* record = out + (begin + i) * record_bytes_;
        if (statuses[i].ok() && static_cast<int64_t>(values[i].size()) == record_bytes_) {
          std::memcpy(record, values[i].data(), static_cast<size_t>(record_bytes_));
          found[begin + i] = 1;
        } else {
          std::memset(record, 0, static_cast<size_t>(record_bytes_));
          found[begin + i] = 0;
          if (!statuses[i].ok() && !statuses[i].IsNotFound()) {
            errors[slice] = statuses[i].ToString();
            failed_slice = slice;
          }
        }
      }
    });
    if (failed_slice >= 0) {
      return Status(StatusCode::kIoError, "rocksdb multiget: " + errors[failed_slice]);
    }
    return Status::Ok();
  }

  Status Flush() override {
    rocksdb::FlushOptions options;
    options.wait = true;
    return FromRocks(db_->Flush(options), "flush");
  }

  Status Settle() override {
    // This RocksDB (7.8) has no WaitForCompact: poll its own counters.
    const Clock::time_point start = Clock::now();
    while (SecondsSince(start) < 3600) {
      if (IntProperty("rocksdb.compaction-pending") == 0 &&
          IntProperty("rocksdb.num-running-compactions") == 0 &&
          IntProperty("rocksdb.num-running-flushes") == 0 &&
          IntProperty("rocksdb.mem-table-flush-pending") == 0) {
        return Status::Ok();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return Status(StatusCode::kInternal, "rocksdb compactions still running after an hour");
  }

  EngineMemory Memory() const override {
    EngineMemory memory;
    const int64_t readers = IntProperty("rocksdb.estimate-table-readers-mem");
    const int64_t memtables = IntProperty("rocksdb.cur-size-all-mem-tables");
    const int64_t cache = IntProperty("rocksdb.block-cache-usage");
    memory.bytes = readers + memtables + cache;
    memory.parts.Set("table_readers_bytes", readers)
        .Set("memtables_bytes", memtables)
        .Set("block_cache_bytes", cache)
        .Set("estimate_num_keys", IntProperty("rocksdb.estimate-num-keys"))
        .Set("sst_files", static_cast<int64_t>(LiveFiles()));
    return memory;
  }

  int64_t ReadsIssued() const override { return blocks_read_.load(); }

  Status Close() override {
    rocksdb::Status s = db_->Close();
    return FromRocks(s, "close");
  }

 private:
  RocksEngine(rocksdb::DB* db, int64_t record_bytes, const RocksSettings& settings)
      : db_(db),
        record_bytes_(record_bytes),
        read_threads_(settings.read_threads),
        pool_(std::max<int64_t>(1, settings.read_threads)) {
    write_options_.disableWAL = true;
  }

  // Big-endian, so that RocksDB's byte order is the ids' order.
  static void EncodeKey(int64_t key, char* out) {
    const uint64_t k = static_cast<uint64_t>(key);
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(k >> (56 - 8 * i));
  }

  int64_t IntProperty(const char* name) const {
    uint64_t value = 0;
    return db_->GetIntProperty(name, &value) ? static_cast<int64_t>(value) : -1;
  }

  size_t LiveFiles() const {
    std::vector<rocksdb::LiveFileMetaData> files;
    db_->GetLiveFilesMetaData(&files);
    return files.size();
  }

  rocksdb::DB* db_;
  int64_t record_bytes_;
  int64_t read_threads_;
  kvsparse::ReadPool pool_;
  rocksdb::WriteOptions write_options_;
  rocksdb::ReadOptions read_options_;
  std::atomic<int64_t> blocks_read_{0};
};

// The disk's own limit: records as a dense array of pages, one O_DIRECT read
// of a page per lookup, a page written in place per record written.
class DiskEngine : public Engine {
 public:
  static Status Open(const std::string& directory, int64_t record_bytes, int64_t threads,
                     std::unique_ptr<Engine>* out) {
    if (record_bytes > kPage) {
      return Status(StatusCode::kInvalidArgument, "the disk engine takes records of at most 4 KiB");
    }
    std::filesystem::create_directories(directory);
    const std::string path = directory + "/pages.bin";
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
    if (fd < 0) return IoError("open O_DIRECT " + path + " (a filesystem without O_DIRECT?)");
    out->reset(new DiskEngine(fd, record_bytes, threads));
    return Status::Ok();
  }

  ~DiskEngine() override {
    if (fd_ >= 0) ::close(fd_);
  }

  std::string Name() const override { return "disk"; }

  // The load's limit: records staged into whole pages and written with large
  // sequential writes, so ids come in order (LoadsInIdOrder).
  Status Write(const int64_t* keys, int64_t n, const uint8_t* records) override {
    for (int64_t i = 0; i < n; ++i) {
      if (keys[i] != next_key_) {
        return Status(StatusCode::kInvalidArgument, "the disk engine takes new ids in order");
      }
      const int64_t page = next_key_ / per_page_;
      if (page >= stage_first_page_ + kStagePages) {
        if (Status s = WriteStage(); !s.ok()) return s;
        stage_first_page_ = page;
        std::memset(stage_.data, 0, static_cast<size_t>(kStagePages * kPage));
      }
      std::memcpy(stage_.data + (page - stage_first_page_) * kPage +
                      (next_key_ % per_page_) * record_bytes_,
                  records + i * record_bytes_, static_cast<size_t>(record_bytes_));
      stage_pages_ = page - stage_first_page_ + 1;
      ++next_key_;
    }
    bytes_updated_ += n * record_bytes_;
    return Status::Ok();
  }

  bool LoadsInIdOrder() const override { return true; }

  // In place: each page holding a record of the batch written back whole,
  // at queue depth threads; a page the last Read brought is not read again.
  Status Overwrite(const int64_t* keys, int64_t n, const uint8_t* records) override {
    std::map<int64_t, std::vector<int64_t>> by_page;
    for (int64_t i = 0; i < n; ++i) by_page[keys[i] / per_page_].push_back(i);
    std::vector<std::pair<int64_t, const std::vector<int64_t>*>> pages;
    for (const auto& [page, which] : by_page) pages.emplace_back(page, &which);
    const int64_t count = static_cast<int64_t>(pages.size());
    AlignedBuffer buffers(count * kPage);
    std::atomic<bool> failed{false};
    std::string error;
    pool_.Run(count, [&](int64_t j) {
      const int64_t page = pages[j].first;
      uint8_t* buffer = buffers.data + j * kPage;
      const auto held = last_read_pages_.find(page);
      Status s = Status::Ok();
      if (held != last_read_pages_.end()) {
        std::memcpy(buffer, last_read_.data + held->second * kPage, kPage);
      } else {
        s = ReadAll(buffer, kPage, page * kPage);
      }
      for (int64_t i : *pages[j].second) {
        std::memcpy(buffer + (keys[i] % per_page_) * record_bytes_, records + i * record_bytes_,
                    static_cast<size_t>(record_bytes_));
      }
      if (s.ok()) s = WriteAll(buffer, kPage, page * kPage);
      if (!s.ok() && !failed.exchange(true)) error = s.message();
    });
    bytes_written_ += count * kPage;
    bytes_updated_ += n * record_bytes_;
    last_read_pages_.clear();
    if (failed) return Status(StatusCode::kIoError, error);
    return Status::Ok();
  }

  Status Read(const int64_t* keys, int64_t n, uint8_t* out, uint8_t* found) override {
    if (last_read_capacity_ < n) {
      last_read_ = AlignedBuffer(n * kPage);
      last_read_capacity_ = n;
    }
    last_read_pages_.clear();
    std::atomic<bool> failed{false};
    std::string error;
    pool_.Run(n, [&](int64_t i) {
      const int64_t page = keys[i] / per_page_;
      uint8_t* buffer = last_read_.data + i * kPage;
      Status s = page < pages_written_ ? ReadAll(buffer, kPage, page * kPage)
                                       : Status(StatusCode::kInvalidArgument, "never written");
      if (s.ok()) {
        std::memcpy(out + i * record_bytes_, buffer + (keys[i] % per_page_) * record_bytes_,
                    static_cast<size_t>(record_bytes_));
        found[i] = 1;
      } else {
        std::memset(out + i * record_bytes_, 0, static_cast<size_t>(record_bytes_));
        found[i] = 0;
        if (s.code() != StatusCode::kInvalidArgument && !failed.exchange(true)) {
          error = s.message();
        }
      }
    });
    reads_ += n;
    for (int64_t i = 0; i < n; ++i) last_read_pages_.emplace(keys[i] / per_page_, i);
    if (failed) return Status(StatusCode::kIoError, error);
    return Status::Ok();
  }

  Status Flush() override {
    if (Status s = WriteStage(); !s.ok()) return s;
    return ::fdatasync(fd_) == 0 ? Status::Ok() : IoError("fdatasync");
  }
  Status Settle() override { return Status::Ok(); }

  EngineMemory Memory() const override {
    EngineMemory memory;  // an id is its address: no index
    memory.parts.Set("records_per_page", per_page_);
    return memory;
  }

  int64_t ReadsIssued() const override { return reads_; }

  std::pair<int64_t, int64_t> EngineBytesWritten() const override {
    return {bytes_written_, bytes_updated_};
  }

  Status Close() override {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc == 0 ? Status::Ok() : IoError("close");
  }

 private:
  struct AlignedBuffer {
    AlignedBuffer() = default;
    explicit AlignedBuffer(int64_t bytes) {
      if (bytes > 0 && ::posix_memalign(reinterpret_cast<void**>(&data), kPage,
                                        static_cast<size_t>(bytes)) != 0) {
        data = nullptr;
      }
    }
    AlignedBuffer(AlignedBuffer&& other) noexcept : data(other.data) { other.data = nullptr; }
    AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
      std::swap(data, other.data);
      return *this;
    }
    ~AlignedBuffer() { std::free(data); }
    uint8_t* data = nullptr;
  };

  static constexpr int64_t kStagePages = 256;  // 1 MiB sequential writes

  DiskEngine(int fd, int64_t record_bytes, int64_t threads)
      : fd_(fd),
        record_bytes_(record_bytes),
        per_page_(kPage / record_bytes),
        pool_(std::max<int64_t>(1, threads)),
        stage_(kStagePages * kPage) {
    std::memset(stage_.data, 0, static_cast<size_t>(kStagePages * kPage));
  }

  Status WriteStage() {
    if (stage_pages_ == 0) return Status::Ok();
    Status s = WriteAll(stage_.data, stage_pages_ * kPage, stage_first_page_ * kPage);
    if (!s.ok()) return s;
    bytes_written_ += stage_pages_ * kPage;
    pages_written_ = std::max(pages_written_, stage_first_page_ + stage_pages_);
    stage_pages_ = 0;
    return Status::Ok();
  }

  Status ReadAll(uint8_t* buffer, int64_t bytes, int64_t offset) const {
    const ssize_t got = ::pread(fd_, buffer, static_cast<size_t>(bytes), offset);
    if (got == bytes) return Status::Ok();
    if (got < 0) return IoError("pread O_DIRECT");
    return Status(StatusCode::kIoError, "short pread at " + std::to_string(offset));
  }

  Status WriteAll(const uint8_t* buffer, int64_t bytes, int64_t offset) const {
    const ssize_t put = ::pwrite(fd_, buffer, static_cast<size_t>(bytes), offset);
    if (put == bytes) return Status::Ok();
    if (put < 0) return IoError("pwrite O_DIRECT");
    return Status(StatusCode::kIoError, "short pwrite at " + std::to_string(offset));
  }

  int fd_;
  int64_t record_bytes_;
  int64_t per_page_;
  kvsparse::ReadPool pool_;
  int64_t pages_written_ = 0;  // pages [0, pages_written_) are in the file
  AlignedBuffer stage_;        // pages [stage_first_page_, + stage_pages_) not yet written
  int64_t stage_first_page_ = 0, stage_pages_ = 0;
  int64_t next_key_ = 0;
  int64_t bytes_written_ = 0, bytes_updated_ = 0;
  int64_t reads_ = 0;
  AlignedBuffer last_read_;
  int64_t last_read_capacity_ = 0;
  std::unordered_map<int64_t, int64_t> last_read_pages_;  // page -> slot in last_read_
};

}  // namespace engine_bench

#endif  // KVSPARSE_BENCH_ENGINE_CPP_ENGINES_H_
