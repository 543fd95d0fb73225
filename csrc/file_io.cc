#include "file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvsparse {

int WriteAll(int fd, const uint8_t* data, int64_t size, int64_t offset) {
  while (size > 0) {
    const ssize_t written = ::pwrite(fd, data, static_cast<size_t>(size), offset);
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    data += written;
    size -= written;
    offset += written;
  }
  return 0;
}

int ReadAll(int fd, uint8_t* data, int64_t size, int64_t offset, int64_t* got) {
  *got = 0;
  while (size > 0) {
    const ssize_t read = ::pread(fd, data, static_cast<size_t>(size), offset);
    if (read < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (read == 0) break;
    data += read;
    size -= read;
    offset += read;
    *got += read;
  }
  return 0;
}

int SyncDirectory(const std::string& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  const int rc = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  return rc;
}

Status IoError(const std::string& what, const std::string& path, int error) {
  const std::string text = std::strerror(error);
  if (error == ENOSPC || error == EFBIG || error == EDQUOT) {
    return Status(StatusCode::kDiskFull, "disk full while " + what + " " + path + ": " + text +
                                             "; nothing of the batch was applied");
  }
  return Status(StatusCode::kIoError, what + " " + path + ": " + text);
}

Status EmptyDirectory(const std::string& directory) {
  if (::mkdir(directory.c_str(), 0755) != 0 && errno != EEXIST) {
    return IoError("creating directory", directory, errno);
  }
  DIR* dir = ::opendir(directory.c_str());
  if (dir == nullptr) return IoError("opening directory", directory, errno);
  bool empty = true;
  while (dirent* entry = ::readdir(dir)) {
    if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) {
      empty = false;
    }
  }
  ::closedir(dir);
  if (!empty) {
    return Status(StatusCode::kInvalidArgument,
                  "directory " + directory + " is not empty: a checkpoint or restore needs an "
                                             "empty or missing directory");
  }
  return Status::Ok();
}

}  // namespace kvsparse
