// CRC32C (Castagnoli), the checksum of every record a RowStore writes.
//
// Uses the SSE4.2 crc32 instruction where the CPU has it (checked once at
// run time) and a table-driven loop elsewhere; both give the same value.
//
//   uint32_t c = kvsparse::Crc32c(data, size);             // one buffer
//   c = kvsparse::Crc32cExtend(c, more, more_size);         // continued
//
// Thread-safe (pure functions).
#ifndef KVSPARSE_CRC32C_H_
#define KVSPARSE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kvsparse {

// Extends crc (the value returned for the bytes before) over size more bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

// True when the hardware instruction is used.
bool Crc32cHardware();

}  // namespace kvsparse

#endif  // KVSPARSE_CRC32C_H_
