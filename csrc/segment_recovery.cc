// SegmentStore (segment_store.h): checkpoints by hard link, recovery of a
// directory's segments after a crash (torn tails, tombstones, sequences),
// and RestoreSegmentStore.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "crc32c.h"
#include "file_io.h"
#include "segment_store_internal.h"

namespace kvsparse {
namespace segment_store {

Status SegmentStore::Checkpoint(const std::string& directory) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Status s = CheckOpen(); !s.ok()) return s;
  if (Status s = EmptyDirectory(directory); !s.ok()) return s;
  // The active segment would go on growing under its link: seal it, so
  // every linked file is immutable from now on.
  if (Status s = SealActive(); !s.ok()) return s;
  std::string manifest = "kvsparse-segment-store 1\nrecord_bytes " +
                         std::to_string(options_.record_bytes) + "\nlive_records " +
                         std::to_string(index_.size()) + "\nsegments";
  for (const auto& entry : segments_) {
    const std::string name = SegmentName(entry.first);
    const std::string target = directory + "/" + name;
    if (::link(entry.second.path.c_str(), target.c_str()) != 0) {
      return IoError("linking " + entry.second.path + " to", target, errno);
    }
    manifest += " " + name;
  }
  manifest += "\n";
  const std::string path = directory + "/" + kManifestName;
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("creating", temporary, errno);
  int error = WriteAll(fd, reinterpret_cast<const uint8_t*>(manifest.data()),
                       static_cast<int64_t>(manifest.size()), 0);
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  ::close(fd);
  if (error == 0 && ::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error == 0) error = SyncDirectory(directory);
  if (error != 0) return IoError("writing", path, error);
  return Status::Ok();
}

Status SegmentStore::RecoverSegment(uint32_t id, Segment* segment, bool newest,
                                    std::unordered_map<int64_t, uint64_t>* sequences,
                                    bool* torn_file) {
  *torn_file = false;
  if (Status s = OpenSegmentFile(id, false, segment); !s.ok()) return s;
  segment->sealed = true;
  uint8_t header[kFileHeaderBytes];
  int64_t got = 0;
  int error = ReadAll(segment->fd, header, kFileHeaderBytes, 0, &got);
  if (error != 0) return IoError("reading", segment->path, error);
  uint32_t version = 0, crc = 0;
  uint64_t record_bytes = 0;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&record_bytes, header + 16, 8);
  std::memcpy(&crc, header + 60, 4);
  if (got != kFileHeaderBytes && newest) {
    // A crash between creating the newest segment and writing its header.
    *torn_file = true;
    return Status::Ok();
  }
  if (got != kFileHeaderBytes || std::memcmp(header, kMagic, 8) != 0 || crc != Crc32c(header, 60)) {
    return Status(StatusCode::kCorruption,
                  "corrupt segment header in " + segment->path + " at offset 0");
  }
  if (version != kFormatVersion) {
    return Status(StatusCode::kInvalidArgument, segment->path + " has format version " +
                                                    std::to_string(version) + ", expected " +
                                                    std::to_string(kFormatVersion));
  }
  if (record_bytes != static_cast<uint64_t>(options_.record_bytes)) {
    return Status(StatusCode::kInvalidArgument,
                  segment->path + " holds records of " + std::to_string(record_bytes) +
                      " bytes, the store was opened with record_bytes=" +
                      std::to_string(options_.record_bytes));
  }
  struct stat st;
  if (::fstat(segment->fd, &st) != 0) return IoError("reading", segment->path, errno);
  const int64_t slots = (st.st_size - kFileHeaderBytes) / slot_bytes_;
  int64_t first_bad = -1;
  std::vector<uint8_t> chunk;
  for (int64_t begin = 0; begin < slots;) {
    const int64_t count =
        std::min(slots - begin, std::max<int64_t>(1, kScanChunkBytes / slot_bytes_));
    chunk.resize(static_cast<size_t>(count * slot_bytes_));
    error = ReadAll(segment->fd, chunk.data(), count * slot_bytes_,
                    kFileHeaderBytes + begin * slot_bytes_, &got);
    if (error != 0) return IoError("reading", segment->path, error);
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* slot = chunk.data() + j * slot_bytes_;
      int64_t key;
      std::memcpy(&key, slot, 8);
      if (!SlotChecksumOk(slot)) {
        // Only a crash in the middle of the newest segment's last write
        // leaves bad slots, and then nothing good follows them.
        if (!newest) return Corruption(*segment, begin + j, key, "checksum mismatch");
        if (first_bad < 0) first_bad = begin + j;
        continue;
      }
      if (first_bad >= 0) {
        return Corruption(*segment, first_bad, -1,
                          "checksum mismatch before good records (not a torn tail)");
      }
      uint64_t sequence;
      uint32_t flags;
      std::memcpy(&sequence, slot + 8, 8);
      std::memcpy(&flags, slot + 16, 4);
      if (flags & kTombstone) {
        ++segment->tombstones;
        segment->max_tombstone_sequence = std::max(segment->max_tombstone_sequence, sequence);
      } else {
        segment->min_data_sequence = std::min(segment->min_data_sequence, sequence);
      }
      next_sequence_ = std::max(next_sequence_, sequence + 1);
      auto seen = sequences->find(key);
      if (seen != sequences->end() && seen->second > sequence) continue;
      (*sequences)[key] = sequence;
      const uint64_t previous =
          (flags & kTombstone) ? index_.Erase(key) : index_.Assign(key, Location(id, begin + j));
      if (previous != kNoLocation) --segments_[SegmentOf(previous)].live;
      if (!(flags & kTombstone)) ++segment->live;
    }
    begin += count;
  }
  segment->slots = first_bad >= 0 ? first_bad : slots;
  if (segment->slots * slot_bytes_ + kFileHeaderBytes != st.st_size) {
    // Cut the torn tail so the segment ends on whole, good records.
    if (::ftruncate(segment->fd, kFileHeaderBytes + segment->slots * slot_bytes_) != 0) {
      return IoError("truncating the torn tail of", segment->path, errno);
    }
  }
  return Status::Ok();
}

Status SegmentStore::Recover() {
  if (::mkdir(options_.directory.c_str(), 0755) != 0 && errno != EEXIST) {
    return IoError("creating directory", options_.directory, errno);
  }
  DIR* dir = ::opendir(options_.directory.c_str());
  if (dir == nullptr) return IoError("opening directory", options_.directory, errno);
  std::vector<uint32_t> ids;
  while (dirent* entry = ::readdir(dir)) {
    uint32_t id;
    if (ParseSegmentName(entry->d_name, &id)) ids.push_back(id);
  }
  ::closedir(dir);
  std::sort(ids.begin(), ids.end());
  std::unordered_map<int64_t, uint64_t> sequences;
  for (size_t k = 0; k < ids.size(); ++k) {
    // Insert first: RecoverSegment decrements the live count of whichever
    // segment held a key's older record, this one included.
    Segment& segment = segments_[ids[k]];
    bool torn_file = false;
    Status s = RecoverSegment(ids[k], &segment, k + 1 == ids.size(), &sequences, &torn_file);
    if (!s.ok()) return s;
    next_segment_id_ = ids[k] + 1;
    if (torn_file) {
      ::close(segment.fd);
      ::unlink(segment.path.c_str());
      segments_.erase(ids[k]);
    }
  }
  return Status::Ok();
}

}  // namespace segment_store

Status RestoreSegmentStore(const std::string& checkpoint_directory,
                           const SegmentStoreOptions& options, std::unique_ptr<RowStore>* out) {
  using segment_store::kManifestName;
  using segment_store::ParseSegmentName;
  if (Status s = segment_store::ValidateOptions(options); !s.ok()) return s;
  const std::string path = checkpoint_directory + "/" + kManifestName;
  FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return IoError("opening the checkpoint manifest", path, errno);
  std::string text;
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  std::fclose(file);
  const std::string record_line = "record_bytes " + std::to_string(options.record_bytes) + "\n";
  const size_t segments_at = text.find("\nsegments");
  if (text.rfind("kvsparse-segment-store 1\n", 0) != 0 || segments_at == std::string::npos ||
      text.back() != '\n') {
    return Status(StatusCode::kCorruption, "checkpoint manifest " + path + " is malformed");
  }
  if (text.find(record_line) == std::string::npos) {
    return Status(StatusCode::kInvalidArgument,
                  "checkpoint " + checkpoint_directory + " holds records of another size than " +
                      std::to_string(options.record_bytes) + " bytes");
  }
  if (Status s = EmptyDirectory(options.directory); !s.ok()) return s;
  std::string names = text.substr(segments_at + 9);
  size_t at = 0;
  while (at < names.size()) {
    const size_t end = names.find_first_of(" \n", at);
    const std::string name = names.substr(at, end - at);
    at = end + 1;
    if (name.empty()) continue;
    uint32_t id;
    if (!ParseSegmentName(name, &id)) {
      return Status(StatusCode::kCorruption,
                    "checkpoint manifest " + path + " names a file that is no segment: " + name);
    }
    const std::string source = checkpoint_directory + "/" + name;
    const std::string target = options.directory + "/" + name;
    if (::link(source.c_str(), target.c_str()) != 0) {
      return IoError("linking " + source + " to", target, errno);
    }
  }
  return OpenSegmentStore(options, out);
}

}  // namespace kvsparse
