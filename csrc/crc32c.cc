#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvsparse {
namespace {

// Reflected Castagnoli polynomial.
constexpr uint32_t kPolynomial = 0x82F63B78u;

struct Table {
  uint32_t entries[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
      entries[i] = c;
    }
  }
};

uint32_t ExtendPortable(uint32_t crc, const uint8_t* p, size_t size) {
  static const Table table;
  for (size_t i = 0; i < size; ++i) crc = table.entries[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// Compiled for SSE4.2 only here, so the rest of the build keeps the baseline
// instruction set and runs on any x86-64.
__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc, const uint8_t* p,
                                                          size_t size) {
  uint64_t c = crc;
  while (size >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    size -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (size > 0) {
    c32 = _mm_crc32_u8(c32, *p++);
    --size;
  }
  return c32;
}

bool DetectHardware() { return __builtin_cpu_supports("sse4.2"); }
#endif

}  // namespace

bool Crc32cHardware() {
#if defined(__x86_64__)
  static const bool hardware = DetectHardware();
  return hardware;
#else
  return false;
#endif
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (Crc32cHardware()) return ~ExtendHardware(crc, p, size);
#endif
  return ~ExtendPortable(crc, p, size);
}

}  // namespace kvsparse
