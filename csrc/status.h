// Status: how every fallible kvsparse C++ call reports an error.
//
// The core never throws across its public API and never aborts. A Status is
// checked by the Cython bridge without the GIL and turned into one
// kvsparse.errors class there (CONTRIBUTING.md, "Style").
//
//   kvsparse::Status s = table.ApplyGradients(keys, n, grads, policy);
//   if (!s.ok()) { /* s.code(), s.message() */ }
#ifndef KVSPARSE_STATUS_H_
#define KVSPARSE_STATUS_H_

#include <string>
#include <utility>

namespace kvsparse {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // -> kvsparse.errors.InvalidArgument (ValueError)
  kNonFinite = 2,        // -> kvsparse.errors.NonFiniteGradient (ValueError)
  kOutOfMemory = 3,      // -> MemoryError
  kCapacity = 4,         // -> kvsparse.errors.CapacityError
  kInternal = 5,
  kOverflow = 6,         // -> kvsparse.errors.UpdateOverflow (InvalidArgument, FloatingPointError)
  kCorruption = 7,       // -> kvsparse.errors.CorruptRecord (StorageError, OSError)
  kDiskFull = 8,         // -> kvsparse.errors.DiskFull (StorageError, OSError)
  kIoError = 9,          // -> kvsparse.errors.StorageError (OSError)
  kLimitExceeded = 10,   // -> kvsparse.errors.LimitExceeded (a memory budget; InvalidArgument)
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_STATUS_H_
