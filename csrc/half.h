// Half-precision rows on the wire: float32 <-> float16 / bfloat16 conversions.
//
// Tables stay float32; a table whose wire dtype is float16 or bfloat16 sends
// pulled rows and pushed gradients as 16-bit values. Narrowing rounds to
// nearest, ties to even, as an IEEE conversion does: a float16 overflows to inf
// above 65504 (from 65520 up), inf stays inf, and a NaN stays a NaN of the same
// sign with its quiet bit set and the top of its payload kept. Widening is
// exact (every 16-bit value is a float32); a NaN keeps its sign and payload
// and comes out quiet, as IEEE conversions make it. On x86-64 CPUs with F16C
// and AVX2 the conversions use them (chosen at run time); the portable loops
// elsewhere are branch-free so that the compiler vectorizes them, and give the
// same bits. Large arrays are split over threads.
//
//   std::vector<uint16_t> wire(n);
//   kvsparse::NarrowFloats(kvsparse::HalfKind::kFloat16, rows, n, wire.data());
//   kvsparse::WidenHalves(kvsparse::HalfKind::kFloat16, wire.data(), n, rows_again);
//
// Every function is pure over its arguments: safe to call from several
// threads at once on arrays that do not overlap.
#ifndef KVSPARSE_HALF_H_
#define KVSPARSE_HALF_H_

#include <cstdint>

namespace kvsparse {

// The 16-bit formats (the values match the wire's item dtype codes).
enum class HalfKind : int { kFloat16 = 1, kBFloat16 = 2 };

// out[i] = values[i] rounded to kind (bit patterns), i < n.
void NarrowFloats(HalfKind kind, const float* values, int64_t n, uint16_t* out);

// out[i] = the float32 value of the 16-bit pattern halves[i] (exact), i < n.
void WidenHalves(HalfKind kind, const uint16_t* halves, int64_t n, float* out);

// NarrowFloats / WidenHalves on the calling thread only: for one table row at
// a time (half-precision tables convert a row per read or write).
void NarrowFloatsSerial(HalfKind kind, const float* values, int64_t n, uint16_t* out);
void WidenHalvesSerial(HalfKind kind, const uint16_t* halves, int64_t n, float* out);

// Index of the first row (n rows of dim values) holding an inf or NaN, or -1.
int64_t FirstNonFiniteHalfRow(HalfKind kind, const uint16_t* rows, int64_t n, int64_t dim);

// Chooses the x86 F16C/AVX2 kernels (enable, where the CPU has them) or the portable
// ones for every later conversion; returns whether the x86 ones are now in use. For
// tests and benchmarks comparing the two: not to be called while conversions run.
bool UseHalfHardware(bool enable);

// GatherFromShards (batch.h) over 16-bit replies, widened into float32 out:
// out[i] = the widened row of shard s at (slot[i] - offsets[s]).
void GatherWidenFromShards(HalfKind kind, const uint16_t* const* shard_rows,
                           const int64_t* offsets, int64_t num_shards, const int64_t* slot,
                           int64_t n, int64_t dim, float* out);

}  // namespace kvsparse

#endif  // KVSPARSE_HALF_H_
