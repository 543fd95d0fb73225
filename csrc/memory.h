// Allocation for the big arrays of a table (bucket array, row chunks).
//
// Arrays of 2 MiB and more are 2 MiB-aligned and madvise()d for transparent
// huge pages. Lookups touch the bucket array and the rows at random: with 4
// KiB pages nearly every probe also misses the TLB, and page walks overlap
// poorly. NumPy does the same for its large arrays, which is why np.take
// over a 64 MB array does not pay that cost (measured here: 60 ns/key for a
// 1M-row dim-8 lookup before, vs 10 ns/key for np.take).
//
//   std::vector<Bucket, kvsparse::HugePageAllocator<Bucket>> buckets(n);
//   T* chunk = kvsparse::AllocateArray<T>(count);  // free with FreeArray
#ifndef KVSPARSE_MEMORY_H_
#define KVSPARSE_MEMORY_H_

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvsparse {

constexpr size_t kHugePageBytes = size_t{1} << 21;

// alignment: a power of two, at most kHugePageBytes; arrays below 2 MiB get
// it from posix_memalign when malloc's 16 bytes are not enough (a bucket
// array of 64-byte lines, see table.h).
inline void* AllocateBytes(size_t bytes, size_t alignment = alignof(std::max_align_t)) {
  if (bytes >= kHugePageBytes) {
    const size_t rounded = (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
    void* p = nullptr;
    if (posix_memalign(&p, kHugePageBytes, rounded) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure only costs speed
#endif
    return p;
  }
  if (alignment > alignof(std::max_align_t)) {
    void* p = nullptr;
    if (posix_memalign(&p, alignment, bytes == 0 ? alignment : bytes) != 0) {
      throw std::bad_alloc();
    }
    return p;
  }
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// Asks the kernel to back the whole pages inside [from, to) with memory now
// (MADV_POPULATE_WRITE, Linux 5.14+), as a first write would, without writing:
// their contents stay what they are. Returns false where the kernel refuses.
// A cold W1 server spent a third of its push zeroing fresh pages on first
// write (clear_page_erms); done ahead, in idle time, that leaves the push.
inline bool PopulateBytes(void* from, void* to) {
#if defined(__linux__)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  constexpr uintptr_t kPage = 4096;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(from) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(to) & ~(kPage - 1);
  if (end <= begin) return true;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
#else
  (void)from;
  (void)to;
  return false;
#endif
}

template <typename T>
T* AllocateArray(size_t count) {
  return static_cast<T*>(AllocateBytes(count * sizeof(T), alignof(T)));
}

struct FreeArray {
  void operator()(void* p) const { std::free(p); }
};

// A buffer reused from call to call: grows (never shrinks), by at least half
// its size, to hold the largest size asked for. Per-push scratch of a table
// was a fresh huge-page mapping each time, whose page faults and kernel
// zeroing cost ~20% of a warm Adagrad push; growing to the exact size still
// remapped on most pushes while a table filled up (each push updates a few
// more stored rows than the last). Not thread-safe: one owner at a time.
//
// Example:
//   ScratchArray<float> scratch;
//   float* saved = scratch.Get(rows * stride);  // valid until the next Get
template <typename T>
class ScratchArray {
 public:
  // At least count elements, uninitialized; may throw std::bad_alloc (the old
  // buffer is kept then).
  T* Get(size_t count) {
    if (count > capacity_) {
      const size_t grown_count = std::max(count, capacity_ + capacity_ / 2);
      T* grown = AllocateArray<T>(grown_count);
      std::free(data_);
      data_ = grown;
      capacity_ = grown_count;
    }
    return data_;
  }
  size_t bytes() const { return capacity_ * sizeof(T); }
  // Gives the memory back (a table over its memory budget); the next Get allocates.
  void Release() {
    std::free(data_);
    data_ = nullptr;
    capacity_ = 0;
  }
  ScratchArray() = default;
  ScratchArray(const ScratchArray&) = delete;
  ScratchArray& operator=(const ScratchArray&) = delete;
  ~ScratchArray() { std::free(data_); }

 private:
  T* data_ = nullptr;
  size_t capacity_ = 0;
};

// Prefetches the cache line of p (into every cache level) in a way the
// compiler keeps. GCC 12 -O1..-O3 deleted every __builtin_prefetch of
// EmbeddingTable::UpdateExistingRows, calls to a helper with only prefetches
// in it included (it counts as a pure function whose result goes unused): a
// push prefetched nothing (found in the disassembly).
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: allocator rebind
  T* allocate(size_t n) { return AllocateArray<T>(n); }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const {
    return false;
  }
};

}  // namespace kvsparse

#endif  // KVSPARSE_MEMORY_H_
