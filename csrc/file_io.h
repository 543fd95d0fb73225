// File helpers shared by the disk tier's storage engines (segment_store.cc,
// run_store.cc): whole-buffer pread/pwrite with EINTR and short transfers
// retried, errno turned into a Status, directory sync and emptiness checks.
//
//   int error = kvsparse::WriteAll(fd, data, size, offset);   // 0 or an errno
//   if (error != 0) return kvsparse::IoError("writing", path, error);
//
// Thread-safety: pure functions over file descriptors; safe from any thread.
#ifndef KVSPARSE_FILE_IO_H_
#define KVSPARSE_FILE_IO_H_

#include <cstdint>
#include <string>

#include "status.h"

namespace kvsparse {

// Writes all of size bytes at offset; returns 0 or the errno that stopped it.
int WriteAll(int fd, const uint8_t* data, int64_t size, int64_t offset);

// Reads up to size bytes at offset; *got is what the file had. 0 or an errno.
int ReadAll(int fd, uint8_t* data, int64_t size, int64_t offset, int64_t* got);

// fsync of a directory (its entries); 0 or an errno.
int SyncDirectory(const std::string& directory);

// ENOSPC, EFBIG and EDQUOT become kDiskFull ("nothing of the batch was
// applied": the callers' contract), anything else kIoError. The message is
// "<what> <path>: <strerror>".
Status IoError(const std::string& what, const std::string& path, int error);

// Creates directory (one level) unless it exists; kInvalidArgument if it
// holds anything (a checkpoint or a restore needs an empty one).
Status EmptyDirectory(const std::string& directory);

}  // namespace kvsparse

#endif  // KVSPARSE_FILE_IO_H_
