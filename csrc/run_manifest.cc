// RunStore: checkpoints by reference and their restore (run_store.h).
//
// A checkpoint is the run files, hard-linked (copied only across file
// systems), and a MANIFEST: the store's in-memory index as it is at the call
// (each run's fragments: pages, page hashes, filter, live bits), closed by a
// CRC32C. It is written as MANIFEST.tmp, synced and renamed: a checkpoint
// killed before the rename has no MANIFEST and is refused by a restore.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "crc32c.h"
#include "file_io.h"
#include "run_store_internal.h"

namespace kvsparse {
namespace run_store {

namespace {

constexpr char kManifestMagic[8] = {'K', 'V', 'S', 'M', 'A', 'N', '0', '1'};

void Put(std::string* out, uint64_t value) {
  out->append(reinterpret_cast<const char*>(&value), 8);
}

void PutWords(std::string* out, const std::vector<uint64_t>& words) {
  Put(out, words.size());
  out->append(reinterpret_cast<const char*>(words.data()), words.size() * 8);
}

class Reader {
 public:
  Reader(const std::string& data, size_t end) : data_(data), end_(end) {}
  bool Get(uint64_t* value) {
    if (at_ + 8 > end_) return false;
    std::memcpy(value, data_.data() + at_, 8);
    at_ += 8;
    return true;
  }
  bool GetWords(std::vector<uint64_t>* words, uint64_t limit) {
    uint64_t size;
    if (!Get(&size) || size > limit || at_ + size * 8 > end_) return false;
    words->resize(size);
    std::memcpy(words->data(), data_.data() + at_, size * 8);
    at_ += size * 8;
    return true;
  }
  bool AtEnd() const { return at_ == end_; }

 private:
  const std::string& data_;
  size_t end_;
  size_t at_ = 8;
};

Status ReadWholeFile(const std::string& path, std::string* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError("opening", path, errno);
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    return IoError("reading", path, error);
  }
  out->resize(static_cast<size_t>(info.st_size));
  int64_t got = 0;
  const int error = ReadAll(fd, reinterpret_cast<uint8_t*>(&(*out)[0]), info.st_size, 0, &got);
  ::close(fd);
  if (error != 0) return IoError("reading", path, error);
  out->resize(static_cast<size_t>(got));
  return Status::Ok();
}

// Links from into to, or copies it when they are on different file systems.
Status LinkOrCopy(const std::string& from, const std::string& to) {
  if (::link(from.c_str(), to.c_str()) == 0) return Status::Ok();
  if (errno != EXDEV) return IoError("linking", from + " to " + to, errno);
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return IoError("opening", from, errno);
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (out < 0) {
    const int error = errno;
    ::close(in);
    return IoError("creating", to, error);
  }
  std::vector<uint8_t> buffer(1 << 20);
  int64_t offset = 0;
  int error = 0;
  for (;;) {
    int64_t got = 0;
    error = ReadAll(in, buffer.data(), static_cast<int64_t>(buffer.size()), offset, &got);
    if (error != 0 || got == 0) break;
    error = WriteAll(out, buffer.data(), got, offset);
    if (error != 0) break;
    offset += got;
  }
  if (error == 0 && ::fdatasync(out) != 0) error = errno;
  ::close(in);
  ::close(out);
  if (error != 0) return IoError("copying", from + " to " + to, error);
  return Status::Ok();
}

}  // namespace

Status RunStore::WriteManifest(const std::string& directory) const {
  std::string data(kManifestMagic, sizeof(kManifestMagic));
  Put(&data, static_cast<uint64_t>(options_.record_bytes));
  Put(&data, static_cast<uint64_t>(page_bytes_));
  Put(&data, static_cast<uint64_t>(records_per_page_));
  Put(&data, next_run_id_);
  Put(&data, runs_.size());
  for (const auto& run : runs_) {
    Put(&data, run->id);
    Put(&data, static_cast<uint64_t>(run->fragment_bits));
    Put(&data, static_cast<uint64_t>(run->pages));
    for (const Fragment& fragment : run->fragments) {
      Put(&data, static_cast<uint64_t>(fragment.first_page));
      Put(&data, static_cast<uint64_t>(fragment.pages));
      Put(&data, static_cast<uint64_t>(fragment.records));
      Put(&data, static_cast<uint64_t>(fragment.live));
      PutWords(&data, fragment.page_hash);
      PutWords(&data, fragment.bloom);
      PutWords(&data, fragment.live_bits);
    }
  }
  const uint32_t crc = Crc32c(data.data(), data.size());
  data.append(reinterpret_cast<const char*>(&crc), 4);
  const std::string temporary = directory + "/" + kManifestName + ".tmp";
  const std::string path = directory + "/" + kManifestName;
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("creating", temporary, errno);
  int error = WriteAll(fd, reinterpret_cast<const uint8_t*>(data.data()),
                       static_cast<int64_t>(data.size()), 0);
  if (error == 0 && ::fdatasync(fd) != 0) error = errno;
  ::close(fd);
  if (error == 0 && ::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error == 0) error = SyncDirectory(directory);
  if (error != 0) {
    ::unlink(temporary.c_str());
    return IoError("writing the run store manifest", path, error);
  }
  return Status::Ok();
}

Status RunStore::LinkRuns(const std::string& directory, bool copy_across) {
  if (Status s = EmptyDirectory(directory); !s.ok()) return s;
  for (auto& run : runs_) {
    const std::string to = directory + "/" + run->name;
    Status s = copy_across ? LinkOrCopy(PathOf(*run), to) : Status::Ok();
    if (!copy_across && ::link(PathOf(*run).c_str(), to.c_str()) != 0) {
      s = IoError("linking", PathOf(*run) + " to " + to, errno);
    }
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status RunStore::SyncAndWriteManifest(const std::string& directory) {
  for (auto& run : runs_) {
    // Every run the manifest names must be there (LinkCheckpoint linked them).
    struct stat info;
    const std::string linked = directory + "/" + run->name;
    if (::stat(linked.c_str(), &info) != 0) {
      return Status(StatusCode::kIoError, "checkpoint " + directory + " lacks the run file " +
                                              run->name + " (linked before the store changed?)");
    }
    // A spill run's pages may still be in the page cache only.
    if (!run->synced) {
      if (::fdatasync(run->fd) != 0) return IoError("syncing run file", PathOf(*run), errno);
      run->synced = !run->building;
    }
  }
  try {
    return WriteManifest(directory);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory writing the run store manifest");
  }
}

Status RunStore::Checkpoint(const std::string& directory) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckWritable(); !s.ok()) return s;
  if (Status s = LinkRuns(directory, /*copy_across=*/true); !s.ok()) return s;
  return SyncAndWriteManifest(directory);
}

Status RunStore::LinkCheckpoint(const std::string& directory) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckWritable(); !s.ok()) return s;
  return LinkRuns(directory, /*copy_across=*/false);
}

Status RunStore::FinishCheckpoint(const std::string& directory) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  return SyncAndWriteManifest(directory);
}

Status RunStore::LoadManifest() {
  const std::string path = options_.directory + "/" + kManifestName;
  std::string data;
  Status s = ReadWholeFile(path, &data);
  if (!s.ok()) return s;
  auto malformed = [&](const std::string& why) {
    return Status(StatusCode::kCorruption, "run store manifest " + path + " is corrupt: " + why);
  };
  if (data.size() < 12 || std::memcmp(data.data(), kManifestMagic, 8) != 0) {
    return malformed("not a run store manifest");
  }
  uint32_t crc;
  std::memcpy(&crc, data.data() + data.size() - 4, 4);
  if (Crc32c(data.data(), data.size() - 4) != crc) return malformed("checksum mismatch");
  Reader reader(data, data.size() - 4);
  uint64_t record_bytes, page_bytes, records_per_page, next_id, run_count;
  if (!reader.Get(&record_bytes) || !reader.Get(&page_bytes) || !reader.Get(&records_per_page) ||
      !reader.Get(&next_id) || !reader.Get(&run_count)) {
    return malformed("truncated header");
  }
  if (record_bytes != static_cast<uint64_t>(options_.record_bytes)) {
    return Status(StatusCode::kInvalidArgument,
                  "the run store in " + options_.directory + " holds records of " +
                      std::to_string(record_bytes) + " bytes, not " +
                      std::to_string(options_.record_bytes));
  }
  // Its pages keep the size they were written with (a store opened with
  // other buffers, e.g. under another budget, would pick another).
  const uint64_t entry = static_cast<uint64_t>(EntryBytes());
  const uint64_t header = static_cast<uint64_t>(kPageHeaderBytes);
  if (page_bytes < header + entry || page_bytes > (uint64_t{64} << 20) ||
      records_per_page != (page_bytes - header) / entry) {
    return malformed("page size " + std::to_string(page_bytes) + " does not fit its records");
  }
  SetPageBytes(static_cast<int64_t>(page_bytes));
  const uint64_t word_limit = data.size() / 8;
  for (uint64_t r = 0; r < run_count; ++r) {
    std::unique_ptr<Run> run(new Run());
    uint64_t id, bits, pages;
    if (!reader.Get(&id) || !reader.Get(&bits) || !reader.Get(&pages) ||
        bits > static_cast<uint64_t>(kMaxFragmentBits)) {
      return malformed("truncated run " + std::to_string(r));
    }
    run->id = id;
    run->fragment_bits = static_cast<int>(bits);
    run->pages = static_cast<int64_t>(pages);
    run->fragments.resize(size_t{1} << bits);
    for (Fragment& fragment : run->fragments) {
      uint64_t first_page, fragment_pages, records, live;
      if (!reader.Get(&first_page) || !reader.Get(&fragment_pages) || !reader.Get(&records) ||
          !reader.Get(&live) || !reader.GetWords(&fragment.page_hash, word_limit) ||
          !reader.GetWords(&fragment.bloom, word_limit) ||
          !reader.GetWords(&fragment.live_bits, word_limit) ||
          fragment.page_hash.size() != fragment_pages || first_page + fragment_pages > pages ||
          fragment.live_bits.size() * 64 < fragment_pages * records_per_page ||
          (fragment_pages > 0 && fragment.bloom.size() % 8 != 0)) {
        return malformed("truncated or inconsistent fragment of run " + std::to_string(id));
      }
      fragment.first_page = static_cast<int64_t>(first_page);
      fragment.pages = static_cast<int64_t>(fragment_pages);
      fragment.records = static_cast<int64_t>(records);
      fragment.live = static_cast<int64_t>(live);
      run->records += fragment.records;
      run->live += fragment.live;
    }
    char name[32];
    std::snprintf(name, sizeof(name), "run-%08llu.kvr", static_cast<unsigned long long>(id));
    run->name = name;
    const std::string file = PathOf(*run);
    run->fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (run->fd < 0) return IoError("opening run file", file, errno);
    struct stat info;
    if (::fstat(run->fd, &info) != 0 || info.st_size < PageOffset(run->pages)) {
      return Status(StatusCode::kCorruption, "run file " + file + " is shorter than its " +
                                                 std::to_string(run->pages) +
                                                 " pages: the checkpoint is incomplete");
    }
    run->synced = true;
    next_run_id_ = std::max(next_run_id_, id + 1);
    runs_.push_back(std::move(run));
  }
  if (!reader.AtEnd()) return malformed("trailing bytes");
  next_run_id_ = std::max(next_run_id_, next_id);
  return Status::Ok();
}

}  // namespace run_store

Status RestoreRunStore(const std::string& checkpoint_directory, const RunStoreOptions& options,
                       std::unique_ptr<RowStore>* out) {
  const std::string manifest = checkpoint_directory + "/" + run_store::kManifestName;
  struct stat info;
  if (::stat(manifest.c_str(), &info) != 0) {
    return Status(StatusCode::kCorruption,
                  "checkpoint " + checkpoint_directory +
                      " has no MANIFEST: it is incomplete (a checkpoint killed before its end)");
  }
  if (Status s = EmptyDirectory(options.directory); !s.ok()) return s;
  DIR* dir = ::opendir(checkpoint_directory.c_str());
  if (dir == nullptr) return IoError("opening directory", checkpoint_directory, errno);
  std::vector<std::string> names;
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name == run_store::kManifestName ||
        (name.rfind("run-", 0) == 0 && name.size() > 4 &&
         name.compare(name.size() - 4, 4, ".kvr") == 0)) {
      names.push_back(name);
    }
  }
  ::closedir(dir);
  for (const std::string& name : names) {
    Status s = run_store::LinkOrCopy(checkpoint_directory + "/" + name,
                                     options.directory + "/" + name);
    if (!s.ok()) return s;
  }
  return OpenRunStore(options, out);
}

}  // namespace kvsparse
