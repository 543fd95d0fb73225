#include "table.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <new>
#include <string>
#include <utility>

#include "batch.h"
#include "half.h"
#include "hash.h"
#include "parallel.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvsparse {

namespace {

// Keys probed per block: enough independent misses in flight to use the
// memory system's parallelism (about 10-12 line fill buffers per core).
constexpr int64_t kProbeBlock = 32;
constexpr int64_t kMinLines = 4;  // 20 buckets
// Below this many keys per thread, starting threads costs more than it saves.
constexpr int64_t kMinKeysPerThread = 16384;
// Initial values generated per thread at least (floats): a thread start costs
// about as much as generating this many normals.
constexpr int64_t kMinInitFloatsPerThread = 1 << 16;
// Rows per chunk: about 2 MiB of values per chunk (one huge page, see
// memory.h), at least 64 rows. Untouched pages of the last chunk cost no RSS.
int64_t RowsPerChunkLog2(int64_t row_floats) {
  int64_t log2 = 6;
  while (log2 < 20 && (int64_t{1} << (log2 + 1)) * row_floats * 4 <= (1 << 21)) ++log2;
  return log2;
}

std::string KeyText(int64_t key) { return std::to_string(key); }

// Values and slots of one row as float32, for tables that store 16-bit rows:
// the most slots an optimizer keeps is 3 (centered RMSProp with momentum).
constexpr int64_t kMaxRowStateFloats = kMaxDim * 4;

const char* StorageName(StorageType type) {
  switch (type) {
    case StorageType::kFloat16:
      return "float16";
    case StorageType::kBFloat16:
      return "bfloat16";
    default:
      return "float32";
  }
}

// multi_precision means something to 16-bit tables only (MXNet: float16 weights).
bool KeepsMaster(const OptimizerConfig& optimizer, StorageType value_type) {
  return optimizer.multi_precision && value_type != StorageType::kFloat32;
}

bool ValidStorage(StorageType type) {
  return type == StorageType::kFloat32 || type == StorageType::kFloat16 ||
         type == StorageType::kBFloat16;
}

}  // namespace

EmbeddingTable::EmbeddingTable(const TableConfig& config)
    : config_(config), optimizer_(config.optimizer) {
  const int64_t log2 = RowsPerChunkLog2(config.dim);
  values_.Reset(config.value_type, config.dim, log2);
  slots_.Reset(config.slot_type, config.dim * optimizer_.num_slots(), log2);
  master_.Reset(KeepsMaster(config.optimizer, config.value_type) ? config.dim : 0, log2);
  half_ = !values_.is_f32() || !slots_.is_f32();
  row_meta_.Reset(2, log2);
  touches_.Reset(TracksTouches() ? 1 : 0, log2);
  last_step_.Reset(TracksLastStep() ? 1 : 0, log2);
  initial_rows_.Configure(config.dim);
  Rehash(kMinLines);
}

Status EmbeddingTable::Create(const TableConfig& config, std::unique_ptr<EmbeddingTable>* out) {
  if (config.dim < 1 || config.dim > kMaxDim) {
    return Status(StatusCode::kInvalidArgument,
                  "dim must be in [1, 4096], got " + std::to_string(config.dim));
  }
  Status s = ValidateInitializer(config.initializer);
  if (!s.ok()) return s;
  s = ValidateOptimizer(config.optimizer);
  if (!s.ok()) return s;
  s = ValidatePolicy(config.policy);
  if (!s.ok()) return s;
  if (!ValidStorage(config.value_type) || !ValidStorage(config.slot_type)) {
    return Status(StatusCode::kInvalidArgument,
                  "a table stores float32, float16 or bfloat16 values and slots");
  }
  try {
    out->reset(new EmbeddingTable(config));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory creating a table");
  }
  return Status::Ok();
}

int64_t EmbeddingTable::MemoryBytes() const {
  return static_cast<int64_t>(buckets_.capacity() * sizeof(BucketLine) +
                              free_rows_.capacity() * sizeof(uint32_t)) +
         values_.Bytes() + slots_.Bytes() + master_.Bytes() + row_meta_.Bytes() +
         static_cast<int64_t>(removed_.capacity() * sizeof(removed_[0])) +
         touches_.Bytes() + last_step_.Bytes() + CandidateBytes() + ScratchBytes() +
         static_cast<int64_t>(sizeof(EmbeddingTable));
}

int64_t EmbeddingTable::ScratchBytes() const {
  return static_cast<int64_t>(push_fresh_state_.bytes() + push_saved_state_.bytes() +
                              push_saved_meta_.bytes()) +
         initial_rows_.Bytes();
}

size_t EmbeddingTable::HomeLine(int64_t key) const {
  // Lemire's multiply-shift: any number of lines, not only powers of two (see Reserve).
  return static_cast<size_t>(
      (static_cast<unsigned __int128>(Mix64(static_cast<uint64_t>(key))) * lines_) >> 64);
}

// Inlined into the lookup's per-key pipeline: GCC made it a call there.
inline __attribute__((always_inline)) int64_t EmbeddingTable::ProbeRow(size_t l,
                                                                       int64_t key) const {
  // One compare of the five keys and no branch on where the key sits: with a
  // branch per slot (mispredicted about once a key) and 12-byte buckets, the
  // probe of a dim-8 lookup cost twice the row copy. A matching slot can be
  // free (a removed key's stale copy): the slow path sorts that out.
  const BucketLine& line = buckets_[l];
#if defined(__SSE2__)
  const __m128i wanted = _mm_set1_epi64x(key);
  __m128i low = _mm_cmpeq_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(line.key)), wanted);
  __m128i high =
      _mm_cmpeq_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(line.key + 2)), wanted);
  // A key matches when both of its 32-bit halves do.
  low = _mm_and_si128(low, _mm_shuffle_epi32(low, _MM_SHUFFLE(2, 3, 0, 1)));
  high = _mm_and_si128(high, _mm_shuffle_epi32(high, _MM_SHUFFLE(2, 3, 0, 1)));
  const uint32_t matches = static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(low))) |
                           static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(high))) << 2 |
                           static_cast<uint32_t>(line.key[4] == key) << 4;
#else
  uint32_t matches = 0;
  for (int s = 0; s < kSlotsPerLine; ++s) {
    matches |= static_cast<uint32_t>(line.key[s] == key) << s;
  }
#endif
  if (matches != 0) {
    const uint32_t row = line.row[__builtin_ctz(matches)];
    if (row != kEmpty) return row;
  }
  return ProbeRowSlowly(l, key);
}

int64_t EmbeddingTable::ProbeRowSlowly(size_t l, int64_t key) const {
  int slot;
  if (!FindSlotFrom(l, key, &l, &slot)) return -1;
  return buckets_[l].row[slot];
}

int64_t EmbeddingTable::FindRow(int64_t key) const { return ProbeRow(HomeLine(key), key); }

bool EmbeddingTable::FindSlot(int64_t key, size_t* line_out, int* slot_out) const {
  return FindSlotFrom(HomeLine(key), key, line_out, slot_out);
}

bool EmbeddingTable::FindSlotFrom(size_t l, int64_t key, size_t* line_out,
                                  int* slot_out) const {
  while (true) {
    const BucketLine& line = buckets_[l];
    bool has_free = false;
    for (int s = 0; s < kSlotsPerLine; ++s) {
      if (line.row[s] == kEmpty) {
        has_free = true;
      } else if (line.key[s] == key) {
        *line_out = l;
        *slot_out = s;
        return true;
      }
    }
    if (has_free) return false;
    l = NextLine(l);
  }
}

void EmbeddingTable::PlaceBucketFrom(size_t l, int64_t key, uint32_t row) {
  while (true) {
    BucketLine& line = buckets_[l];
    for (int s = 0; s < kSlotsPerLine; ++s) {
      if (line.row[s] == kEmpty) {
        line.key[s] = key;
        line.row[s] = row;
        return;
      }
    }
    l = NextLine(l);
  }
}

void EmbeddingTable::FindRows(const int64_t* keys, int64_t n, int64_t* rows) const {
  size_t home[kProbeBlock];
  for (int64_t start = 0; start < n; start += kProbeBlock) {
    const int64_t count = std::min(kProbeBlock, n - start);
    for (int64_t i = 0; i < count; ++i) {
      home[i] = HomeLine(keys[start + i]);
      __builtin_prefetch(&buckets_[home[i]]);
      __builtin_prefetch(&buckets_[NextLine(home[i])]);  // see LookupRangeFor
    }
    for (int64_t i = 0; i < count; ++i) rows[start + i] = ProbeRow(home[i], keys[start + i]);
  }
}

void EmbeddingTable::Rehash(int64_t new_lines) {
  std::vector<BucketLine, HugePageAllocator<BucketLine>> old;
  old.swap(buckets_);
  BucketLine empty;
  for (int s = 0; s < kSlotsPerLine; ++s) {
    empty.key[s] = 0;
    empty.row[s] = kEmpty;
  }
  empty.unused = 0;
  buckets_.assign(static_cast<size_t>(new_lines), empty);
  lines_ = static_cast<uint64_t>(new_lines);
  // Each key lands on a random line of the new array: its home line is
  // prefetched a block ahead, so that the misses overlap (as FindRows does).
  // Rehashes were 6% of a cold W1 server's time, nearly all waiting on them.
  int64_t keys[kProbeBlock];
  uint32_t rows[kProbeBlock];
  size_t home[kProbeBlock];
  int64_t count = 0;
  auto place_block = [&]() {
    for (int64_t i = 0; i < count; ++i) PlaceBucketFrom(home[i], keys[i], rows[i]);
    count = 0;
  };
  for (const BucketLine& line : old) {
    for (int s = 0; s < kSlotsPerLine; ++s) {
      if (line.row[s] == kEmpty) continue;
      keys[count] = line.key[s];
      rows[count] = line.row[s];
      home[count] = HomeLine(line.key[s]);
      PrefetchLine(&buckets_[home[count]]);
      if (++count == kProbeBlock) place_block();
    }
  }
  place_block();
}

Status EmbeddingTable::Reserve(int64_t rows_needed) {
  if (rows_needed >= static_cast<int64_t>(kEmpty)) {
    return Status(StatusCode::kCapacity,
                  "a shard holds at most 4294967294 rows; add servers to grow further");
  }
  // Load factor <= 3/4 keeps linear probing short. Growing to a load of 0.7
  // (at least 4/3x) rather than doubling: the average load over sizes is
  // 0.66 instead of 0.53, 18% fewer bucket bytes (1M rows: 16 MB instead of
  // 25 MB), for about 3 moves per row in rehashes instead of 1.
  const int64_t capacity = SlotCount();
  if (rows_needed * 4 <= capacity * 3) return Status::Ok();
  const int64_t grown = std::max(capacity + capacity / 3, rows_needed * 10 / 7 + 1);
  try {
    Rehash((grown + kSlotsPerLine - 1) / kSlotsPerLine);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory growing the table");
  }
  return Status::Ok();
}

void EmbeddingTable::InitRowSlots(int64_t row) {
  if (optimizer_.num_slots() > 0) {
    if (slots_.is_f32()) {
      optimizer_.InitSlots(slots_.F32Row(row), config_.dim);
    } else {
      float initial[kMaxRowStateFloats];
      optimizer_.InitSlots(initial, config_.dim);
      slots_.Write(row, initial);
    }
  }
  *StepOf(row) = 0;
  *StampOf(row) = change_epoch_;
}

void EmbeddingTable::FillNewRows(const int64_t* keys, const int64_t* rows, int64_t n) {
  if (n <= 0) return;
  const int64_t dim = config_.dim;
  // Distinct rows: ranges never overlap.
  ParallelFor(n, std::max<int64_t>(1, kMinInitFloatsPerThread / dim),
              [&](int64_t begin, int64_t end) {
                constexpr int64_t kRowsPerCall = 128;
                float* targets[kRowsPerCall];
                if (!values_.is_f32()) {
                  // Generated in float32, then rounded into the 16-bit rows.
                  float generated[kMaxDim];
                  for (int64_t i = begin; i < end; ++i) {
                    float* target = generated;
                    FillInitialRows(config_.initializer, keys + i, 1, dim, &target);
                    if (has_master()) {
                      std::memcpy(master_.Row(rows[i]), generated, sizeof(float) * dim);
                    }
                    values_.Write(rows[i], generated);
                  }
                  return;
                }
                for (int64_t i = begin; i < end; i += kRowsPerCall) {
                  const int64_t count = std::min(kRowsPerCall, end - i);
                  for (int64_t k = 0; k < count; ++k) targets[k] = values_.F32Row(rows[i + k]);
                  FillInitialRows(config_.initializer, keys + i, count, dim, targets);
                }
              });
}

Status EmbeddingTable::FindOrInsertRow(int64_t key, int64_t* row_out, bool* inserted) {
  *inserted = false;
  const int64_t found = FindRow(key);
  if (found >= 0) {
    *row_out = found;
    return Status::Ok();
  }
  // Callers Reserve() first, so the load factor holds after this insert.
  if (free_rows_.empty()) {
    try {
      EnsureRowsUpTo(next_row_);
    } catch (const std::bad_alloc&) {
      return Status(StatusCode::kOutOfMemory, "out of memory adding rows");
    }
  }
  *row_out = InsertReservedRow(key);
  *inserted = true;
  return Status::Ok();
}

bool EmbeddingTable::PrefaultAhead(int64_t max_bytes) {
  const int64_t chunk_rows = int64_t{1} << RowsPerChunkLog2(config_.dim);
  // Not while chunk 0 holds every row: it grows by moving them, doubling, so
  // that a small table stays small; a table that small has nothing to gain.
  if (!prefault_works_ || next_row_ < chunk_rows) return false;
  const int64_t begin = std::max(prefaulted_, next_row_);
  if (begin >= prefault_target_) return false;
  const int64_t row_bytes =
      values_.row_bytes() + slots_.row_bytes() + master_.width() * 4 + 8 + 8;
  const int64_t end = std::min(prefault_target_, begin + std::max<int64_t>(1, max_bytes / row_bytes));
  try {
    EnsureRowsUpTo(end - 1);
  } catch (const std::bad_alloc&) {
    prefault_target_ = 0;  // the next push allocates (and reports) what it needs
    return false;
  }
  prefault_works_ = values_.Populate(begin, end) && slots_.Populate(begin, end) &&
                    master_.Populate(begin, end) && row_meta_.Populate(begin, end) &&
                    touches_.Populate(begin, end) && last_step_.Populate(begin, end);
  prefaulted_ = end;
  return prefault_works_;
}

void EmbeddingTable::EnsureRowsUpTo(int64_t row) {
  values_.EnsureRow(row);
  slots_.EnsureRow(row);
  if (has_master()) master_.EnsureRow(row);
  row_meta_.EnsureRow(row);
  if (TracksTouches()) touches_.EnsureRow(row);
  if (TracksLastStep()) last_step_.EnsureRow(row);
}

int64_t EmbeddingTable::InsertReservedRow(int64_t key, bool init_slots) {
  int64_t row;
  if (!free_rows_.empty()) {
    row = free_rows_.back();
    free_rows_.pop_back();
  } else {
    row = next_row_++;
  }
  PlaceBucket(key, static_cast<uint32_t>(row));
  ++size_;
  if (init_slots) {
    InitRowSlots(row);
  } else {
    *StepOf(row) = 0;
    *StampOf(row) = change_epoch_;
  }
  InitRowMeta(row);
  return row;
}

Status EmbeddingTable::SetOptimizer(const OptimizerConfig& optimizer) {
  Status s = ValidateOptimizer(optimizer);
  if (!s.ok()) return s;
  Optimizer next(optimizer);
  const int64_t log2 = RowsPerChunkLog2(config_.dim);
  RowArray slots;
  slots.Reset(config_.slot_type, config_.dim * next.num_slots(), log2);
  const bool keep_master = KeepsMaster(optimizer, config_.value_type);
  const bool new_master = keep_master && !has_master();
  ChunkedRows<float> master;
  master.Reset(new_master ? config_.dim : 0, log2);
  try {
    if (next_row_ > 0) slots.EnsureRow(next_row_ - 1);
    if (next_row_ > 0 && new_master) master.EnsureRow(next_row_ - 1);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory resizing optimizer slots");
  }
  config_.optimizer = optimizer;
  optimizer_ = next;
  slots_ = std::move(slots);
  if (!keep_master || new_master) master_ = std::move(master);
  if (new_master) {
    ForEachStored([&](int64_t, uint32_t row) { values_.Read(row, master_.Row(row)); });
  }
  table_step_ = 0;
  ForEachStored([&](int64_t, uint32_t row) { InitRowSlots(row); });
  // Ages count from the table step, which restarts at 0.
  if (TracksLastStep()) {
    ForEachStored([&](int64_t, uint32_t row) { *last_step_.Row(row) = 0; });
  }
  for (auto& entry : candidates_) entry.second.last_step = 0;
  return Status::Ok();
}

Status EmbeddingTable::SetLearningRate(double learning_rate) {
  OptimizerConfig next = config_.optimizer;
  next.learning_rate = learning_rate;
  Status s = ValidateOptimizer(next);
  if (!s.ok()) return s;
  config_.optimizer = next;
  optimizer_ = Optimizer(next);
  return Status::Ok();
}

void EmbeddingTable::InitialValues(const int64_t* keys, int64_t n, float* out) const {
  const int64_t dim = config_.dim;
  ParallelFor(n, std::max<int64_t>(1, kMinInitFloatsPerThread / dim),
              [&](int64_t begin, int64_t end) {
                FillInitialRows(config_.initializer, keys + begin, end - begin, dim,
                                out + begin * dim);
                // A 16-bit table's initial value is the rounded one it stores.
                for (int64_t i = begin; i < end && !values_.is_f32(); ++i) {
                  values_.Round(out + i * dim);
                }
              });
}

void EmbeddingTable::LookupRange(const int64_t* keys, int64_t n, float* out,
                                 uint8_t* missing) const {
  if (!values_.is_f32()) return LookupRangeFor<0, true>(keys, n, out, missing);
  // Fixed row sizes copy with inline moves instead of a memcpy call per row
  // (dim 8: 8% of a lookup was libc's memmove).
  switch (config_.dim) {
    case 4:
      return LookupRangeFor<4>(keys, n, out, missing);
    case 8:
      return LookupRangeFor<8>(keys, n, out, missing);
    case 16:
      return LookupRangeFor<16>(keys, n, out, missing);
    case 32:
      return LookupRangeFor<32>(keys, n, out, missing);
    case 64:
      return LookupRangeFor<64>(keys, n, out, missing);
    default:
      return LookupRangeFor<0>(keys, n, out, missing);
  }
}

template <int64_t kRowFloats, bool kHalf>
void EmbeddingTable::LookupRangeFor(const int64_t* keys, int64_t n, float* out,
                                    uint8_t* missing_out) const {
  const int64_t dim = kRowFloats > 0 ? kRowFloats : config_.dim;
  const size_t row_bytes = static_cast<size_t>(values_.row_bytes());
  // A pipeline over the keys: key i's bucket is prefetched kBucketAhead keys
  // before it is probed, and its row (prefetched by the probe) is copied
  // kRowAhead keys after that, so the two dependent cache misses of a key
  // overlap with other keys' misses. Per key, not per block: with blocks of
  // 32 the probe waited on its buckets (53% of a dim-8 lookup).
  constexpr int64_t kBucketAhead = 16;
  // Rows 32 keys ahead of their copy: with 16, the copy still waited on its
  // row (C++ harness, dim 8: 2.52 vs 2.94 ms and 2.22 vs 2.32 ms).
  constexpr int64_t kRowAhead = 32;
  constexpr int64_t kRing = 64;  // >= kBucketAhead + kRowAhead, a power of two
  static_assert(kBucketAhead + kRowAhead <= kRing, "ring too small");
  size_t home[kRing];
  int64_t rows[kRing];
  // Missing keys get their initial rows in one vectorized call per batch.
  constexpr int64_t kMissingBatch = 32;
  int64_t missing_keys[kMissingBatch];
  float* missing_rows[kMissingBatch];
  int64_t missing = 0;
  const int64_t row_lines = std::min<int64_t>(4, (static_cast<int64_t>(row_bytes) + 63) / 64);
  for (int64_t i = 0; i < n + kBucketAhead + kRowAhead; ++i) {
    if (i < n) {
      const size_t line = HomeLine(keys[i]);
      home[i & (kRing - 1)] = line;
      // And the next line: about 13% of the keys at load 0.7 live past
      // their home line, a dependent miss each without it (0.60 -> 0.71x
      // np.take's speed, dim 8, one thread).
      __builtin_prefetch(&buckets_[line]);
      __builtin_prefetch(&buckets_[NextLine(line)]);
    }
    const int64_t p = i - kBucketAhead;
    if (p >= 0 && p < n) {
      const int64_t row = ProbeRow(home[p & (kRing - 1)], keys[p]);
      rows[p & (kRing - 1)] = row;
      if (row >= 0) {
        const char* values = values_.RowAddress(row);
        for (int64_t line = 0; line < row_lines; ++line) __builtin_prefetch(values + 64 * line);
      }
    }
    const int64_t c = p - kRowAhead;
    if (c >= 0 && c < n) {
      const int64_t row = rows[c & (kRing - 1)];
      float* dst = out + c * dim;
      if (row >= 0) {
        if (kHalf) {
          WidenHalvesSerial(values_.kind(), values_.HalfRow(row), dim, dst);
        } else {
          std::memcpy(dst, values_.F32Row(row),
                      kRowFloats > 0 ? sizeof(float) * kRowFloats : row_bytes);
        }
      } else {
        if (missing_out != nullptr) missing_out[c] = 1;
        missing_keys[missing] = keys[c];
        missing_rows[missing++] = dst;
        if (missing == kMissingBatch) {
          FillInitialRows(config_.initializer, missing_keys, missing, dim, missing_rows);
          if (kHalf) {
            for (int64_t k = 0; k < missing; ++k) values_.Round(missing_rows[k]);
          }
          missing = 0;
        }
      }
    }
  }
  if (missing > 0) {
    FillInitialRows(config_.initializer, missing_keys, missing, dim, missing_rows);
    if (kHalf) {
      for (int64_t k = 0; k < missing; ++k) values_.Round(missing_rows[k]);
    }
  }
}

Status EmbeddingTable::Lookup(const int64_t* keys, int64_t n, float* out) const {
  // Which keys missed, to keep their generated rows for the push that
  // usually follows; without room for the flags, the lookup just keeps none.
  std::vector<uint8_t> missing;
  if (CachesInitialRows()) {
    try {
      missing.assign(static_cast<size_t>(n), 0);
    } catch (const std::bad_alloc&) {
      missing.clear();
    }
  }
  uint8_t* flags = missing.empty() ? nullptr : missing.data();
  // Read-only: ranges of the batch can be served by different threads.
  ParallelFor(n, kMinKeysPerThread, [&](int64_t begin, int64_t end) {
    LookupRange(keys + begin, end - begin, out + begin * config_.dim,
                flags == nullptr ? nullptr : flags + begin);
  });
  if (flags != nullptr) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += flags[i];
    if (count > 0) {
      initial_rows_.Reserve(count);
      for (int64_t i = 0; i < n; ++i) {
        if (flags[i]) initial_rows_.Put(keys[i], out + i * config_.dim);
      }
    }
  }
  return Status::Ok();
}

void EmbeddingTable::FillInitialRowsCached(const int64_t* keys, int64_t n,
                                           float* const* targets) const {
  const int64_t dim = config_.dim;
  if (!CachesInitialRows()) {
    FillInitialRows(config_.initializer, keys, n, dim, targets);
    return;
  }
  constexpr int64_t kBlock = 128;
  int64_t generate_keys[kBlock];
  float* generate_targets[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t count = std::min(kBlock, n - i);
    int64_t generate = 0;
    for (int64_t k = 0; k < count; ++k) {
      const float* cached = initial_rows_.Find(keys[i + k]);
      if (cached != nullptr) {
        std::memcpy(targets[i + k], cached, sizeof(float) * static_cast<size_t>(dim));
      } else {
        generate_keys[generate] = keys[i + k];
        generate_targets[generate++] = targets[i + k];
      }
    }
    if (generate > 0) {
      FillInitialRows(config_.initializer, generate_keys, generate, dim, generate_targets);
    }
  }
}

Status EmbeddingTable::LookupOrInsert(const int64_t* keys, int64_t n, float* out) {
  const int64_t dim = config_.dim;
  std::vector<int64_t> rows, new_keys, new_rows;
  try {
    rows.resize(static_cast<size_t>(n));
    new_keys.reserve(static_cast<size_t>(n));
    new_rows.reserve(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory inserting rows");
  }
  // Probe first (prefetched), then grow for the missing ids only: growing
  // for the whole batch would over-size the map for batches of known ids.
  FindRows(keys, n, rows.data());
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) missing += rows[i] < 0;
  Status s = Reserve(size_ + missing);
  if (!s.ok()) return s;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] >= 0) continue;
    bool inserted;
    s = FindOrInsertRow(keys[i], &rows[i], &inserted);
    if (inserted) {
      new_keys.push_back(keys[i]);
      new_rows.push_back(rows[i]);
    }
    if (!s.ok()) break;
  }
  // Rows inserted before a failure still get their values.
  FillNewRows(new_keys.data(), new_rows.data(), static_cast<int64_t>(new_keys.size()));
  if (!s.ok()) return s;
  for (int64_t i = 0; i < n; ++i) values_.Read(rows[i], out + i * dim);
  return Status::Ok();
}

Status EmbeddingTable::ApplyGradients(const int64_t* keys, int64_t n, const float* grads,
                                      NonFinitePolicy policy, int64_t* applied) {
  *applied = 0;
  if (pending_push_ != nullptr) {
    return Status(StatusCode::kInvalidArgument, "a push of this table is begun and not finished");
  }
  // Three steps, so that a push that fails changes nothing (issue 11, defects
  // 4 and 8): (1) plan and compute what can be computed aside, and allocate
  // everything the commit needs; (2) update the stored rows in place, each
  // saved first, checking every result; (3) commit, which cannot fail but
  // for the candidates' map, which it puts back on failure.
  PushPlan plan;
  const int64_t saved_table_step = table_step_;
  Status s = BeginPlan(keys, n, grads, policy, &plan);
  if (!s.ok()) return s;
  return FinishPlan(plan, saved_table_step, applied);
}

Status EmbeddingTable::BeginPush(const int64_t* keys, int64_t n, const float* grads,
                                 NonFinitePolicy policy) {
  if (pending_push_ != nullptr) {
    return Status(StatusCode::kInvalidArgument, "a push of this table is begun and not finished");
  }
  std::unique_ptr<PushPlan> plan;
  try {
    plan.reset(new PushPlan());
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory preparing a push (nothing applied)");
  }
  const int64_t saved_table_step = table_step_;
  Status s = BeginPlan(keys, n, grads, policy, plan.get());
  if (!s.ok()) return s;
  // Commit reads no gradient: the caller's array may go.
  plan->grads = nullptr;
  plan->summed.clear();
  pending_push_ = std::move(plan);
  pending_table_step_ = saved_table_step;
  return Status::Ok();
}

Status EmbeddingTable::FinishPush(int64_t* applied) {
  *applied = 0;
  if (pending_push_ == nullptr) {
    return Status(StatusCode::kInvalidArgument, "no push of this table is begun");
  }
  std::unique_ptr<PushPlan> plan = std::move(pending_push_);
  return FinishPlan(*plan, pending_table_step_, applied);
}

void EmbeddingTable::CancelPush() {
  if (pending_push_ == nullptr) return;
  std::unique_ptr<PushPlan> plan = std::move(pending_push_);
  RestoreExistingRows(*plan);
  table_step_ = pending_table_step_;
}

Status EmbeddingTable::BeginPlan(const int64_t* keys, int64_t n, const float* grads,
                                 NonFinitePolicy policy, PushPlan* plan) {
  try {
    Status s = PreparePush(keys, n, grads, policy, plan);
    if (!s.ok()) return s;
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory preparing a push (nothing applied)");
  }
  const int64_t saved_table_step = table_step_;
  ++table_step_;  // the step of this push: Adam's per-table step, rows' last step
  if (UpdateExistingRows(plan)) {
    int64_t first = 0;
    while (!plan->overflows[first]) ++first;
    if (policy == NonFinitePolicy::kReject) {
      RestoreExistingRows(*plan);
      table_step_ = saved_table_step;
      if (FirstNonFiniteRow(plan->grads, static_cast<int64_t>(plan->unique.size()),
                            config_.dim) >= 0) {
        return NonFiniteStatus(*plan);
      }
      return OverflowStatus(plan->unique[plan->existing[first]]);
    }
    // kSkip: the rows that overflowed are back as they were, those with a
    // non-finite gradient untouched; the rest stays.
  }
  return Status::Ok();
}

Status EmbeddingTable::FinishPlan(const PushPlan& plan, int64_t saved_table_step,
                                  int64_t* applied) {
  try {
    CommitCandidates(plan, static_cast<uint32_t>(table_step_));
  } catch (const std::bad_alloc&) {
    RestoreExistingRows(plan);
    table_step_ = saved_table_step;
    return Status(StatusCode::kOutOfMemory, "out of memory counting candidates (nothing applied)");
  }
  // Nothing below allocates: PreparePush sized the map, the row arrays, the
  // free list and the removal log.
  if (!plan.victims.empty()) {
    policy_stats_.evicted_capacity +=
        Remove(plan.victims.data(), static_cast<int64_t>(plan.victims.size()));
  }
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  const int64_t stride = RowStateFloats();
  const int64_t fresh = static_cast<int64_t>(plan.fresh.size());
  // The fresh keys' bucket lines are random: prefetched a few keys ahead (PlaceBucket
  // waited on them for a third of this loop in a cold W1 push).
  constexpr int64_t kKeysAhead = 8;
  for (int64_t k = 0; k < std::min(fresh, kKeysAhead); ++k) {
    PrefetchLine(&buckets_[HomeLine(plan.fresh_keys[k])]);
  }
  for (int64_t k = 0; k < fresh; ++k) {
    if (k + kKeysAhead < fresh) {
      PrefetchLine(&buckets_[HomeLine(plan.fresh_keys[k + kKeysAhead])]);
    }
    // Its slots are written below: not initialized first.
    const int64_t row = InsertReservedRow(plan.fresh_keys[k], /*init_slots=*/false);
    const float* state = plan.fresh_state + k * stride;
    values_.Write(row, state);  // rounded already (ComputeFreshRows): exact
    slots_.Write(row, state + dim);
    if (has_master()) {
      std::memcpy(master_.Row(row), state + dim + slot_floats, sizeof(float) * dim);
    }
    TouchRow(row);
    *StepOf(row) = 1;
  }
  if (fresh > 0) {
    const int64_t chunk_rows = int64_t{1} << RowsPerChunkLog2(dim);
    prefault_target_ = std::min(next_row_ + 2 * fresh, next_row_ + chunk_rows);
  }
  int64_t updated = 0;
  for (const uint8_t overflowed : plan.overflows) updated += !overflowed;
  policy_stats_.admissions += fresh;
  policy_stats_.rejected += static_cast<int64_t>(plan.rejected.size());
  *applied = updated + fresh;
  MaybeEvictAutomatically();
  return Status::Ok();
}

Status EmbeddingTable::OverflowStatus(int64_t key) const {
  return Status(StatusCode::kOverflow,
                "the update of id " + KeyText(key) + " overflows " +
                    StorageName(values_.is_f32() ? slots_.type() : values_.type()) + " (its gradient and row are finite; the result is inf "
                    "or NaN): nothing of this push was applied; lower the learning rate or "
                    "clip the gradients");
}

Status EmbeddingTable::NonFiniteStatus(const PushPlan& p) const {
  const int64_t bad =
      FirstNonFiniteRow(p.grads, static_cast<int64_t>(p.unique.size()), config_.dim);
  return Status(StatusCode::kNonFinite,
                "gradient for id " + KeyText(p.unique[bad]) + " has a NaN or inf value");
}

Status EmbeddingTable::PreparePush(const int64_t* keys, int64_t n, const float* grads,
                                   NonFinitePolicy policy, PushPlan* plan) {
  PushPlan& p = *plan;
  const int64_t dim = config_.dim;
  const bool skipping = policy == NonFinitePolicy::kSkip;
  bool may_be_nonfinite = true;
  {
    std::vector<int64_t> inverse(static_cast<size_t>(n));
    UniqueWithInverse(keys, n, &p.unique, inverse.data());
    p.grads = grads;
    if (static_cast<int64_t>(p.unique.size()) != n) {
      p.summed.resize(p.unique.size() * static_cast<size_t>(dim));
      may_be_nonfinite = SumRowsByIndex(grads, inverse.data(), n, dim,
                                        static_cast<int64_t>(p.unique.size()), p.summed.data());
      p.grads = p.summed.data();
    }
  }
  const int64_t u = static_cast<int64_t>(p.unique.size());
  p.skip.assign(static_cast<size_t>(u), 0);
  p.rows.resize(static_cast<size_t>(u));
  FindRows(p.unique.data(), u, p.rows.data());
  // The one check of a push's gradients on a server (the fast path leaves it
  // here). A stored row's gradient is checked as the row is updated
  // (UpdateExistingRows: the gradient is in cache then; a pass of its own
  // over them was 11% of a warm W1 push). The others are checked now, before
  // admission counts their ids.
  p.may_be_nonfinite = may_be_nonfinite;
  if (may_be_nonfinite) {
    for (int64_t j = 0; j < u; ++j) {
      if (p.rows[j] >= 0 || AllFiniteFloats(p.grads + j * dim, dim)) continue;
      if (!skipping) return NonFiniteStatus(p);
      p.skip[j] = 1;
    }
  }
  // With kSkip, an id whose new row overflows is dropped like a non-finite
  // gradient (not seen, not inserted), and admission is decided again: the
  // room it leaves may go to another id. Each round drops at least one id.
  while (true) {
    PlanAdmission(&p);
    const int64_t first = ComputeFreshRows(&p, skipping);
    if (first < 0) break;
    if (!skipping) {
      // A non-finite gradient is named first, as if checked before anything.
      if (FirstNonFiniteRow(p.grads, u, dim) >= 0) return NonFiniteStatus(p);
      return OverflowStatus(p.fresh_keys[first]);
    }
  }
  // Room for the commit, so that it cannot fail halfway.
  const int64_t fresh = static_cast<int64_t>(p.fresh.size());
  const int64_t victims = static_cast<int64_t>(p.victims.size());
  Status s = Reserve(size_ + fresh);
  if (!s.ok()) return s;
  const int64_t from_new_rows = fresh - static_cast<int64_t>(free_rows_.size()) - victims;
  if (from_new_rows > 0) EnsureRowsUpTo(next_row_ + from_new_rows - 1);
  free_rows_.reserve(free_rows_.size() + static_cast<size_t>(victims));
  if (change_epoch_ > 1) removed_.reserve(removed_.size() + static_cast<size_t>(victims));
  // The stored rows to update, and room to save them.
  p.existing.reserve(static_cast<size_t>(u));
  for (int64_t j = 0; j < u; ++j) {
    if (p.rows[j] >= 0 && !p.skip[j]) p.existing.push_back(j);
  }
  const size_t existing = p.existing.size();
  const size_t stride = static_cast<size_t>(RowStateFloats());
  p.saved_state = push_saved_state_.Get(existing * stride);
  p.saved_meta = push_saved_meta_.Get(existing * 4);
  p.overflows.assign(existing, 0);
  return Status::Ok();
}

void EmbeddingTable::PlanAdmission(PushPlan* plan) const {
  PushPlan& p = *plan;
  const PolicyConfig& policy = config_.policy;
  const int64_t u = static_cast<int64_t>(p.unique.size());
  p.fresh.clear();
  p.counted.clear();
  p.counted_before.clear();
  p.rejected.clear();
  p.victims.clear();
  for (int64_t j = 0; j < u; ++j) {
    if (p.rows[j] >= 0 || p.skip[j]) continue;
    if (policy.min_count > 1) {
      const auto it = candidates_.find(p.unique[j]);
      const Candidate before = it == candidates_.end() ? Candidate{0, 0} : it->second;
      const uint32_t count = before.count < UINT32_MAX ? before.count + 1 : before.count;
      if (static_cast<int64_t>(count) < policy.min_count) {
        p.counted.push_back(j);
        p.counted_before.push_back(before);
        continue;
      }
    }
    p.fresh.push_back(j);
  }
  const int64_t new_rows = static_cast<int64_t>(p.fresh.size());
  if (policy.max_rows > 0 && size_ + new_rows > policy.max_rows) {
    // Rows of this push's ids are never evicted by it.
    std::vector<uint8_t> keep_row(static_cast<size_t>(next_row_), 0);
    int64_t kept = 0;
    for (int64_t j = 0; j < u; ++j) {
      if (p.rows[j] >= 0) {
        keep_row[p.rows[j]] = 1;
        ++kept;
      }
    }
    const int64_t need = size_ + new_rows - policy.max_rows;
    SelectVictims(std::min(need, size_ - kept), keep_row, &p.victims);
    const int64_t room =
        std::max<int64_t>(0, policy.max_rows - size_ + static_cast<int64_t>(p.victims.size()));
    if (new_rows > room) {
      // Deterministic: the lowest keys get the room that is left.
      const int64_t* unique = p.unique.data();
      std::sort(p.fresh.begin(), p.fresh.end(),
                [unique](int64_t a, int64_t b) { return unique[a] < unique[b]; });
      p.rejected.assign(p.fresh.begin() + room, p.fresh.end());
      p.fresh.resize(static_cast<size_t>(room));
    }
  }
}

void EmbeddingTable::SelectVictims(int64_t count, const std::vector<uint8_t>& keep_row,
                                   std::vector<int64_t>* victims) const {
  victims->clear();
  if (count <= 0) return;
  const bool lfu = config_.policy.eviction == EvictionKind::kLfu;
  // (score, key): the `count` smallest pairs go. LFU: fewest touches; LRU:
  // largest age first, so the score is minus the age.
  std::vector<std::pair<int64_t, int64_t>> scored;
  scored.reserve(static_cast<size_t>(size_));
  ForEachStored([&](int64_t key, uint32_t row) {
    if (keep_row[row]) return;
    const int64_t score =
        lfu ? static_cast<int64_t>(*touches_.Row(row)) : -AgeOf(*last_step_.Row(row));
    scored.emplace_back(score, key);
  });
  count = std::min<int64_t>(count, static_cast<int64_t>(scored.size()));
  if (count <= 0) return;
  if (count < static_cast<int64_t>(scored.size())) {
    std::nth_element(scored.begin(), scored.begin() + count, scored.end());
  }
  victims->resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) (*victims)[i] = scored[i].second;
}

int64_t EmbeddingTable::ComputeFreshRows(PushPlan* plan, bool skipping) {
  PushPlan& p = *plan;
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  const int64_t stride = RowStateFloats();
  const bool master = has_master();
  const int64_t count = static_cast<int64_t>(p.fresh.size());
  p.fresh_keys.resize(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) p.fresh_keys[k] = p.unique[p.fresh[k]];
  p.fresh_state = push_fresh_state_.Get(static_cast<size_t>(count * stride));
  p.fresh_overflows.assign(static_cast<size_t>(count), 0);
  // The step of a row's first update: 1, or this push's table step.
  const int64_t step =
      config_.optimizer.step_mode == StepMode::kPerTable ? table_step_ + 1 : int64_t{1};
  float* state = p.fresh_state;
  ParallelFor(count, std::max<int64_t>(1, kMinInitFloatsPerThread / dim),
              [&](int64_t begin, int64_t end) {
                float scratch[kMaxDim];
                constexpr int64_t kRowsPerCall = 128;
                float* targets[kRowsPerCall];
                for (int64_t i = begin; i < end; i += kRowsPerCall) {
                  const int64_t rows = std::min(kRowsPerCall, end - i);
                  for (int64_t k = 0; k < rows; ++k) targets[k] = state + (i + k) * stride;
                  FillInitialRowsCached(p.fresh_keys.data() + i, rows, targets);
                  for (int64_t k = 0; k < rows; ++k) {
                    float* w = targets[k];
                    optimizer_.InitSlots(w + dim, dim);
                    if (half_) {  // the stored start: rounded value (or the master) and slots
                      if (!master) values_.Round(w);
                      slots_.Round(w + dim);
                    }
                    optimizer_.Update(w, w + dim, p.grads + p.fresh[i + k] * dim, dim, step,
                                      scratch);
                    if (half_) {  // one rounding per write (table.h, StorageType)
                      if (master) std::memcpy(w + dim + slot_floats, w, sizeof(float) * dim);
                      values_.Round(w);
                      slots_.Round(w + dim);
                    }
                    p.fresh_overflows[i + k] = !AllFiniteFloats(w, stride);
                  }
                }
              });
  int64_t first = -1;
  for (int64_t k = 0; k < count; ++k) {
    if (!p.fresh_overflows[k]) continue;
    if (first < 0) first = k;
    if (skipping) p.skip[p.fresh[k]] = 1;
  }
  return first;
}

void EmbeddingTable::PrefetchRowState(int64_t row) const {
  const char* values = values_.RowAddress(row);
  for (int64_t b = 0; b < values_.row_bytes(); b += 64) PrefetchLine(values + b);
  if (slots_.row_bytes() > 0) {  // SGD keeps no slots
    const char* slots = slots_.RowAddress(row);
    for (int64_t b = 0; b < slots_.row_bytes(); b += 64) PrefetchLine(slots + b);
  }
  if (has_master()) {
    const char* master = reinterpret_cast<const char*>(master_.Row(row));
    for (int64_t b = 0; b < config_.dim * 4; b += 64) PrefetchLine(master + b);
  }
  PrefetchLine(row_meta_.Row(row));  // the step and the stamp
  if (TracksTouches()) PrefetchLine(touches_.Row(row));
  if (TracksLastStep()) PrefetchLine(last_step_.Row(row));
}

namespace {

// Copies n floats of a row's state into a push's save area around the caches
// (streaming stores; dst 16-byte aligned, n a multiple of 4). A save is read
// back only when a push fails, and plain stores first read each line they
// write: a warm W1 push saves 5.6 MB a server, twice the memory traffic.
inline void StreamFloats(float* __restrict dst, const float* __restrict src, int64_t n) {
#if defined(__SSE2__)
  for (int64_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
#endif
}

inline void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace

bool EmbeddingTable::UpdateExistingRows(PushPlan* plan) {
  PushPlan& p = *plan;
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  const int64_t stride = RowStateFloats();
  const bool keeps_master = has_master();
  const int64_t count = static_cast<int64_t>(p.existing.size());
  const bool per_table = config_.optimizer.step_mode == StepMode::kPerTable;
  const int64_t table_step = table_step_;
  std::atomic<bool> any_overflow{false};
  // Rows are scattered: every line a row's update touches (value, slots,
  // master, step, stamp, policy metadata) is prefetched kRowsAhead rows
  // before, so that the misses of different rows overlap. With 4 rows ahead
  // and the step and stamp not prefetched, 85% of a dim-8 update waited on
  // them (issue 10).
  constexpr int64_t kRowsAhead = 16;
  // Saves streamed where each fills whole cache lines (a dim-64 Adagrad row:
  // 8 lines); a master copy is saved with plain stores (it is written with them).
  const bool stream = !keeps_master && stride % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.saved_state) % 64 == 0;
  // Distinct rows: ranges never overlap.
  ParallelFor(count, kMinKeysPerThread / 4, [&](int64_t begin, int64_t end) {
    float scratch[kMaxDim];
    float row_state[kMaxRowStateFloats];
    bool overflowed = false;
    for (int64_t e = begin; e < std::min(end, begin + kRowsAhead); ++e) {
      PrefetchRowState(p.rows[p.existing[e]]);
    }
    for (int64_t e = begin; e < end; ++e) {
      if (e + kRowsAhead < end) PrefetchRowState(p.rows[p.existing[e + kRowsAhead]]);
      const int64_t j = p.existing[e];
      const int64_t row = p.rows[j];
      if (p.may_be_nonfinite && !AllFiniteFloats(p.grads + j * dim, dim)) {
        p.overflows[e] = 1;  // left as it is: nothing written to it
        overflowed = true;
        continue;
      }
      float* w;
      float* slots;
      float* master = keeps_master ? master_.Row(row) : nullptr;
      float* saved = p.saved_state + e * stride;
      if (half_) {  // updated in float32 (row_state), written back rounded
        w = row_state;
        slots = row_state + dim;
        values_.Read(row, w);
        slots_.Read(row, slots);
      } else {
        w = values_.F32Row(row);
        slots = slots_.F32Row(row);
      }
      // Plain loops: a libc memmove call per small row cost 15% of a dim-8 push.
      if (stream) {
        StreamFloats(saved, w, dim);
        StreamFloats(saved + dim, slots, slot_floats);
      } else {
        for (int64_t i = 0; i < dim; ++i) saved[i] = w[i];
        for (int64_t i = 0; i < slot_floats; ++i) saved[dim + i] = slots[i];
      }
      if (master != nullptr) {  // the optimizer starts from the master, not the rounded value
        for (int64_t i = 0; i < dim; ++i) saved[dim + slot_floats + i] = w[i] = master[i];
      }
      uint32_t* step = StepOf(row);
      uint32_t* meta = p.saved_meta + e * 4;
      meta[0] = *step;
      meta[1] = *StampOf(row);
      meta[2] = TracksTouches() ? *touches_.Row(row) : 0;
      meta[3] = TracksLastStep() ? *last_step_.Row(row) : 0;
      TouchRow(row);
      if (*step < UINT32_MAX) *step += 1;  // saturate: a wrap to 0 would break Adam
      *StampOf(row) = change_epoch_;
      optimizer_.Update(w, slots, p.grads + j * dim, dim,
                        per_table ? table_step : static_cast<int64_t>(*step), scratch);
      if (half_) {
        // The master written now: RestoreRow puts it back if the rounded result overflows.
        if (master != nullptr) std::memcpy(master, w, sizeof(float) * dim);
        values_.Round(w);
        slots_.Round(slots);
      }
      if (!AllFiniteFloats(w, dim) || !AllFiniteFloats(slots, slot_floats)) {
        if (stream) StreamFence();
        RestoreRow(row, saved, meta);
        p.overflows[e] = 1;
        overflowed = true;
      } else if (half_) {
        values_.Write(row, w);
        slots_.Write(row, slots);
      }
    }
    // The saves are seen by any thread that restores them (RestoreExistingRows).
    if (stream) StreamFence();
    if (overflowed) any_overflow.store(true, std::memory_order_relaxed);
  });
  return any_overflow.load();
}

void EmbeddingTable::RestoreRow(int64_t row, const float* saved, const uint32_t* meta) {
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  values_.Write(row, saved);  // saved in float32 from the stored row: exact
  if (slot_floats > 0) slots_.Write(row, saved + dim);
  if (has_master()) {
    std::memcpy(master_.Row(row), saved + dim + slot_floats, sizeof(float) * dim);
  }
  *StepOf(row) = meta[0];
  *StampOf(row) = meta[1];
  if (TracksTouches()) *touches_.Row(row) = meta[2];
  if (TracksLastStep()) *last_step_.Row(row) = meta[3];
}

void EmbeddingTable::RestoreExistingRows(const PushPlan& p) {
  const int64_t stride = RowStateFloats();
  for (size_t e = 0; e < p.existing.size(); ++e) {
    if (p.overflows[e]) continue;  // put back already
    RestoreRow(p.rows[p.existing[e]], p.saved_state + e * stride, p.saved_meta + e * 4);
  }
}

void EmbeddingTable::CommitCandidates(const PushPlan& p, uint32_t push_step) {
  if (config_.policy.min_count <= 1) return;  // no candidates are kept
  size_t done = 0;
  try {
    // The only step of a commit that allocates (a node per new candidate).
    for (; done < p.counted.size(); ++done) {
      const Candidate& before = p.counted_before[done];
      candidates_[p.unique[p.counted[done]]] =
          Candidate{before.count < UINT32_MAX ? before.count + 1 : before.count, push_step};
    }
  } catch (...) {
    for (size_t i = 0; i < done; ++i) {
      const auto it = candidates_.find(p.unique[p.counted[i]]);
      if (p.counted_before[i].count == 0) {
        candidates_.erase(it);
      } else {
        it->second = p.counted_before[i];
      }
    }
    throw;
  }
  // Admitted ids stop being candidates; rejected ones keep no count.
  for (const int64_t j : p.fresh) candidates_.erase(p.unique[j]);
  for (const int64_t j : p.rejected) candidates_.erase(p.unique[j]);
}

Status EmbeddingTable::Assign(const int64_t* keys, int64_t n, const float* values) {
  Status s = Reserve(size_ + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  for (int64_t i = 0; i < n; ++i) {
    // The value is overwritten at once: no initial value to generate.
    int64_t row = -1;
    bool inserted;
    s = FindOrInsertRow(keys[i], &row, &inserted);
    if (!s.ok()) return s;
    values_.Write(row, values + i * dim);
    if (has_master()) std::memcpy(master_.Row(row), values + i * dim, sizeof(float) * dim);
    *StampOf(row) = change_epoch_;
  }
  return Status::Ok();
}

int64_t EmbeddingTable::Remove(const int64_t* keys, int64_t n) {
  // Room for the free list and the removal log first: std::bad_alloc then
  // leaves the table as it was, never a row both free and stored.
  int64_t present = 0;
  for (int64_t i = 0; i < n; ++i) present += FindRow(keys[i]) >= 0;
  if (present == 0) return 0;
  free_rows_.reserve(free_rows_.size() + static_cast<size_t>(present));
  if (change_epoch_ > 1) removed_.reserve(removed_.size() + static_cast<size_t>(present));
  int64_t removed = 0;
  for (int64_t i = 0; i < n; ++i) {
    size_t hole;
    int hole_slot;
    if (!FindSlot(keys[i], &hole, &hole_slot)) continue;
    free_rows_.push_back(buckets_[hole].row[hole_slot]);
    // Epoch 1 means no checkpoint was saved or loaded yet: no delta can need
    // the removal, and a store that never checkpoints keeps no such list.
    if (change_epoch_ > 1) removed_.emplace_back(keys[i], change_epoch_);
    buckets_[hole].row[hole_slot] = kEmpty;
    --size_;
    ++removed;
    // Backward-shift deletion keeps every remaining key reachable from its
    // home line without tombstones: a key in line j with home h needs lines
    // h..j-1 full. Only a line that was full before can have broken that;
    // then the first key further on whose home is at or before the hole
    // moves into it, and its old slot is the next hole.
    int free_slots = 0;
    for (const uint32_t row : buckets_[hole].row) free_slots += row == kEmpty;
    if (free_slots > 1) continue;
    for (size_t j = NextLine(hole);; j = NextLine(j)) {
      BucketLine& line = buckets_[j];
      bool full = true;
      int move = -1;
      for (int s = 0; s < kSlotsPerLine; ++s) {
        if (line.row[s] == kEmpty) {
          full = false;
        } else if (move < 0 && Distance(HomeLine(line.key[s]), j) >= Distance(hole, j)) {
          move = s;
        }
      }
      if (move >= 0) {
        buckets_[hole].key[hole_slot] = line.key[move];
        buckets_[hole].row[hole_slot] = line.row[move];
        line.row[move] = kEmpty;
        hole = j;
        hole_slot = move;
      }
      // A line with a free slot ends every probe that reaches it.
      if (!full) break;
    }
  }
  return removed;
}

void EmbeddingTable::ReadRowState(int64_t row, float* values, float* slots,
                                  int64_t* step) const {
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  values_.Read(row, values);
  if (slot_floats > 0) slots_.Read(row, slots);
  if (has_master()) {
    std::memcpy(slots + slot_floats, master_.Row(row), sizeof(float) * dim);
  }
  *step = static_cast<int64_t>(*StepOf(row));
}

Status EmbeddingTable::ReadState(const int64_t* keys, int64_t n, float* values, float* slots,
                                 int64_t* steps) const {
  const int64_t dim = config_.dim;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = FindRow(keys[i]);
    if (row < 0) {
      return Status(StatusCode::kInvalidArgument, "id " + KeyText(keys[i]) + " is not in the table");
    }
    ReadRowState(row, values + i * dim, slots + i * dim * num_slots(), steps + i);
  }
  return Status::Ok();
}

Status EmbeddingTable::WriteState(const int64_t* keys, int64_t n, const float* values,
                                  const float* slots, const int64_t* steps) {
  for (int64_t i = 0; i < n; ++i) {
    if (steps[i] < 0 || steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument,
                    "step counter of id " + KeyText(keys[i]) + " is out of range");
    }
  }
  Status s = Reserve(size_ + n);
  if (!s.ok()) return s;
  const int64_t dim = config_.dim;
  const int64_t slot_floats = dim * optimizer_.num_slots();
  const int64_t row_slot_floats = dim * num_slots();  // the master last, if kept
  for (int64_t i = 0; i < n; ++i) {
    // Values, slots and step are all overwritten: no initial value to generate.
    int64_t row = -1;
    bool inserted;
    s = FindOrInsertRow(keys[i], &row, &inserted);
    if (!s.ok()) return s;
    values_.Write(row, values + i * dim);
    const float* row_slots = slots + i * row_slot_floats;
    if (slot_floats > 0) slots_.Write(row, row_slots);
    if (has_master()) {
      std::memcpy(master_.Row(row), row_slots + slot_floats, sizeof(float) * dim);
    }
    *StepOf(row) = static_cast<uint32_t>(steps[i]);
    *StampOf(row) = change_epoch_;
  }
  return Status::Ok();
}

int64_t EmbeddingTable::NextKeys(int64_t* cursor, int64_t max_rows, int64_t* keys_out) const {
  int64_t count = 0;
  const int64_t capacity = SlotCount();
  int64_t b = *cursor;
  for (; b < capacity && count < max_rows; ++b) {
    if (SlotRow(b) != kEmpty) keys_out[count++] = SlotKey(b);
  }
  *cursor = b;
  return count;
}

int64_t EmbeddingTable::NextChangedKeys(int64_t* cursor, int64_t max_rows, uint32_t since,
                                        int64_t* keys_out) const {
  int64_t count = 0;
  const int64_t capacity = SlotCount();
  int64_t b = *cursor;
  for (; b < capacity && count < max_rows; ++b) {
    const uint32_t row = SlotRow(b);
    if (row != kEmpty && *StampOf(row) > since) keys_out[count++] = SlotKey(b);
  }
  *cursor = b;
  return count;
}

int64_t EmbeddingTable::NextChangedRows(int64_t* cursor, int64_t max_rows, uint32_t since,
                                        int64_t* keys_out, float* values, float* slots,
                                        int64_t* steps) const {
  const int64_t dim = config_.dim;
  int64_t count = 0;
  const int64_t capacity = SlotCount();
  int64_t b = *cursor;
  for (; b < capacity && count < max_rows; ++b) {
    const uint32_t row = SlotRow(b);
    if (row == kEmpty || *StampOf(row) <= since) continue;
    keys_out[count] = SlotKey(b);
    ReadRowState(row, values + count * dim, slots + count * dim * num_slots(), steps + count);
    ++count;
  }
  *cursor = b;
  return count;
}

int64_t EmbeddingTable::RemovedSince(uint32_t since, int64_t* keys_out, int64_t capacity) const {
  int64_t count = 0;
  for (const auto& entry : removed_) {
    if (entry.second <= since) continue;
    if (count < capacity) keys_out[count] = entry.first;
    ++count;
  }
  return count;
}

void EmbeddingTable::PruneRemoved(uint32_t through) {
  removed_.erase(std::remove_if(removed_.begin(), removed_.end(),
                                [through](const std::pair<int64_t, uint32_t>& entry) {
                                  return entry.second <= through;
                                }),
                 removed_.end());
}

// ---- Admission and eviction (issue 5) ---------------------------------------

Status ValidatePolicy(const PolicyConfig& policy) {
  if (policy.min_count < 1 || policy.min_count > static_cast<int64_t>(UINT32_MAX)) {
    return Status(StatusCode::kInvalidArgument,
                  "min_count must be in [1, 4294967295], got " + std::to_string(policy.min_count));
  }
  // Ages are signed 32-bit differences of steps.
  if (policy.ttl_steps < 0 || policy.ttl_steps > INT32_MAX) {
    return Status(StatusCode::kInvalidArgument,
                  "ttl_steps must be in [1, 2147483647] (0: none), got " +
                      std::to_string(policy.ttl_steps));
  }
  if (policy.max_rows < 0 || policy.max_rows >= static_cast<int64_t>(UINT32_MAX)) {
    return Status(StatusCode::kInvalidArgument,
                  "max_rows must be positive (0: unbounded), got " +
                      std::to_string(policy.max_rows));
  }
  if (policy.evict_every < 0) {
    return Status(StatusCode::kInvalidArgument,
                  "evict_every must be >= 0, got " + std::to_string(policy.evict_every));
  }
  if (policy.eviction != EvictionKind::kLfu && policy.eviction != EvictionKind::kLru) {
    return Status(StatusCode::kInvalidArgument, "eviction must be LFU or LRU");
  }
  return Status::Ok();
}

void EmbeddingTable::InitRowMeta(int64_t row) {
  if (TracksTouches()) *touches_.Row(row) = 0;
  if (TracksLastStep()) *last_step_.Row(row) = static_cast<uint32_t>(table_step_);
}

void EmbeddingTable::TouchRow(int64_t row) {
  if (TracksTouches()) {
    uint32_t* touches = touches_.Row(row);
    if (*touches < UINT32_MAX) *touches += 1;
  }
  if (TracksLastStep()) *last_step_.Row(row) = static_cast<uint32_t>(table_step_);
}

int64_t EmbeddingTable::EvictExpired() {
  const int64_t ttl = config_.policy.ttl_steps;
  if (ttl <= 0) return 0;
  std::vector<int64_t> expired;
  ForEachStored([&](int64_t key, uint32_t row) {
    if (AgeOf(*last_step_.Row(row)) >= ttl) expired.push_back(key);
  });
  // Rows first (Remove may throw std::bad_alloc, then changing nothing);
  // erasing candidates allocates nothing.
  const int64_t removed = Remove(expired.data(), static_cast<int64_t>(expired.size()));
  for (auto it = candidates_.begin(); it != candidates_.end();) {
    it = AgeOf(it->second.last_step) >= ttl ? candidates_.erase(it) : std::next(it);
  }
  policy_stats_.evicted_ttl += removed;
  return removed;
}

void EmbeddingTable::MaybeEvictAutomatically() {
  const PolicyConfig& policy = config_.policy;
  if (policy.ttl_steps > 0 && policy.evict_every > 0 && table_step_ % policy.evict_every == 0) {
    // Runs after a push or step that already happened: out of memory here
    // must not fail it. The expired rows stay until the next automatic or
    // requested eviction.
    try {
      EvictExpired();
    } catch (const std::bad_alloc&) {
    }
  }
}

void EmbeddingTable::AdvanceStep() {
  ++table_step_;
  MaybeEvictAutomatically();
}

PolicyStats EmbeddingTable::policy_stats() const {
  PolicyStats stats = policy_stats_;
  stats.candidates = static_cast<int64_t>(candidates_.size());
  return stats;
}

int64_t EmbeddingTable::CandidateBytes() const {
  // libstdc++: a bucket pointer each, plus a heap node (next pointer, key,
  // value) of 24 bytes that malloc rounds to 32.
  return static_cast<int64_t>(candidates_.bucket_count() * sizeof(void*) +
                              candidates_.size() * 32);
}

int64_t EmbeddingTable::CandidateCount() const {
  return static_cast<int64_t>(candidates_.size());
}

int64_t EmbeddingTable::ReadCandidates(int64_t* keys, int64_t* counts, int64_t* last_steps,
                                       int64_t capacity) const {
  int64_t copied = 0;
  for (const auto& entry : candidates_) {
    if (copied >= capacity) break;
    keys[copied] = entry.first;
    counts[copied] = entry.second.count;
    last_steps[copied] = entry.second.last_step;
    ++copied;
  }
  return copied;
}

Status EmbeddingTable::WriteCandidates(const int64_t* keys, const int64_t* counts,
                                       const int64_t* last_steps, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (counts[i] < 1 || counts[i] > static_cast<int64_t>(UINT32_MAX) || last_steps[i] < 0 ||
        last_steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument,
                    "candidate count or step of id " + KeyText(keys[i]) + " is out of range");
    }
  }
  try {
    candidates_.reserve(candidates_.size() + static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (FindRow(keys[i]) >= 0) continue;
      candidates_[keys[i]] = Candidate{static_cast<uint32_t>(counts[i]),
                                       static_cast<uint32_t>(last_steps[i])};
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "out of memory restoring admission candidates");
  }
  return Status::Ok();
}

void EmbeddingTable::ClearCandidates() { candidates_.clear(); }

Status EmbeddingTable::ReadRowMeta(const int64_t* keys, int64_t n, int64_t* touches,
                                   int64_t* last_steps) const {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  FindRows(keys, n, rows.data());
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) {
      return Status(StatusCode::kInvalidArgument, "id " + KeyText(keys[i]) + " is not stored");
    }
    touches[i] = TracksTouches() ? static_cast<int64_t>(*touches_.Row(rows[i])) : 0;
    last_steps[i] = TracksLastStep() ? static_cast<int64_t>(*last_step_.Row(rows[i])) : 0;
  }
  return Status::Ok();
}

Status EmbeddingTable::WriteRowMeta(const int64_t* keys, int64_t n, const int64_t* touches,
                                    const int64_t* last_steps) {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  FindRows(keys, n, rows.data());
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) {
      return Status(StatusCode::kInvalidArgument, "id " + KeyText(keys[i]) + " is not stored");
    }
    if (touches[i] < 0 || touches[i] > static_cast<int64_t>(UINT32_MAX) || last_steps[i] < 0 ||
        last_steps[i] > static_cast<int64_t>(UINT32_MAX)) {
      return Status(StatusCode::kInvalidArgument,
                    "touch count or last step of id " + KeyText(keys[i]) + " is out of range");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (TracksTouches()) *touches_.Row(rows[i]) = static_cast<uint32_t>(touches[i]);
    if (TracksLastStep()) *last_step_.Row(rows[i]) = static_cast<uint32_t>(last_steps[i]);
  }
  return Status::Ok();
}

}  // namespace kvsparse
