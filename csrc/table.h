// EmbeddingTable: a growing hash map from any int64 key to a row of `dim`
// float32 values, the optimizer's per-row slots and a per-row step counter.
//
// Rows live in chunks, so growing moves no row past the first chunk (which
// starts small, see ChunkedRows): only the bucket array is rehashed. All batch operations take plain arrays
// and return a Status; none touches Python, so the bridge calls them with the
// GIL released. A table is not thread-safe: one caller at a time (a server
// shard serves its requests in order).
//
//   kvsparse::TableConfig config;
//   config.dim = 64;
//   config.initializer.kind = kvsparse::InitializerKind::kNormal;
//   config.initializer.b = 0.01;
//   config.optimizer.kind = kvsparse::OptimizerKind::kAdagrad;
//   std::unique_ptr<kvsparse::EmbeddingTable> table;
//   kvsparse::Status s = kvsparse::EmbeddingTable::Create(config, &table);
//   s = table->LookupOrInsert(keys, n, out);             // out: n * 64 floats
//   s = table->ApplyGradients(keys, n, grads, kvsparse::NonFinitePolicy::kReject, &applied);
#ifndef KVSPARSE_TABLE_H_
#define KVSPARSE_TABLE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "half.h"
#include "initializer.h"
#include "memory.h"
#include "optimizer.h"
#include "row_cache.h"
#include "status.h"

namespace kvsparse {

constexpr int64_t kMaxDim = 4096;

// ---- Admission and eviction policy (issue 5) -------------------------------
//
// Semantics (mirrored by tests/reference.py's ReferencePolicyTable):
// - "Seen": an id is seen once per push (ApplyGradients) that contains it,
//   after in-batch dedup; ids whose gradient is skipped as non-finite are not
//   seen. Lookups never insert and never count, nor touch a row.
// - min_count = k: an id not stored yet is a candidate; an exact side map
//   holds its sighting count (and last step). At its k-th sighting it is
//   admitted: inserted with its initial value and that push's gradient is
//   applied. Before that, pulls return its initial value and its gradients
//   are dropped. Candidate memory: about 40-60 bytes each (node + buckets of a
//   std::unordered_map; MemoryBytes counts that estimate); the map is bounded
//   only by TTL (candidates unseen for ttl_steps are dropped with the rows).
// - A "step" is the table's push counter table_step(): every push of the
//   table bumps it, on every shard (a shard that got none of the push's ids
//   bumps it through AdvanceStep), so steps agree across shards.
// - ttl_steps = t: a row last touched (updated by a push) at step L is
//   expired at step S when S - L >= t; EvictExpired() drops expired rows and
//   candidates. It runs on request (kv.evict()) and automatically at the end
//   of the push (or AdvanceStep) whose table_step is a multiple of
//   evict_every (0: never automatically).
// - max_rows = m is the capacity of ONE shard's table (a table over s servers
//   holds up to s * m rows). When the ids a push admits would make the table
//   exceed m, rows are evicted first, picked among rows that this push does
//   not touch: kLfu evicts the fewest touches (pushes that updated the row
//   since it was inserted), kLru the oldest last-touched step; ties go to the
//   lower key. If even evicting every untouched row leaves too little room,
//   the push admits its new ids in ascending key order up to the capacity and
//   drops the rest (counted as rejected; they keep no candidate count).
//   Rows written by Assign/LookupOrInsert/WriteState bypass admission and
//   capacity (they may exceed m until a later push evicts).
// - An evicted row loses its slot, optimizer slots and step: if its id comes
//   back it restarts from its initial value (and, with min_count > 1, must be
//   seen k times again). Eviction goes through Remove, so incremental
//   checkpoints record it.
// - Per-row metadata costs memory only when a policy needs it: 4 bytes/row of
//   touch count when max_rows with kLfu, 4 bytes/row of last step when
//   ttl_steps or max_rows with kLru. The last step is stored in 32 bits and
//   compared as a signed 32-bit difference, exact while ages stay < 2^31.
// - SetOptimizer resets table_step to 0; every row's and candidate's last
//   step is reset to 0 with it (ages restart).
enum class EvictionKind : int { kLfu = 0, kLru = 1 };

struct PolicyConfig {
  int64_t min_count = 1;     // sightings before an id is stored, >= 1
  int64_t ttl_steps = 0;     // 0: rows never expire
  int64_t max_rows = 0;      // per-shard capacity; 0: unbounded
  EvictionKind eviction = EvictionKind::kLfu;
  int64_t evict_every = 0;   // automatic EvictExpired every N table steps; 0: never
};

struct PolicyStats {
  int64_t admissions = 0;        // ids inserted by pushes
  int64_t evicted_ttl = 0;       // rows dropped as expired
  int64_t evicted_capacity = 0;  // rows dropped to make room (max_rows)
  int64_t rejected = 0;          // ids a full table could not admit
  int64_t candidates = 0;        // ids seen but not admitted yet (now)
};

Status ValidatePolicy(const PolicyConfig& policy);

// How a table stores its values, or its optimizer slots (issue 12). The
// 16-bit kinds match HalfKind (half.h). The table's interface stays float32:
// a 16-bit row is widened exactly when read, the optimizer works in float32,
// and the result is rounded to nearest, ties to even, once when it is written
// (a push, an assign, a state write, a new row's initial value). A result
// that rounds to inf (float16 beyond 65504) is an overflow, as a float32 inf.
//
// multi_precision (OptimizerConfig; MXNet's, for float16 row_sparse weights):
// a table of 16-bit values then also keeps a float32 master copy of each row.
// The optimizer updates the master and the stored value is the master rounded
// once, so updates below half an ulp add up instead of rounding away. The
// master is one more float32 slot in the state interface (num_slots(),
// ReadState, WriteState), after the optimizer's. It is set to: a new row's
// float32 initial value; an assigned row's given values; the widened stored
// values when SetOptimizer turns multi_precision on (a master already kept
// stays: it is the value, not optimizer state). Memory: 4 more bytes a value.
enum class StorageType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct TableConfig {
  int64_t dim = 0;
  InitializerConfig initializer;
  OptimizerConfig optimizer;
  PolicyConfig policy;
  StorageType value_type = StorageType::kFloat32;
  StorageType slot_type = StorageType::kFloat32;
};

enum class NonFinitePolicy : int {
  kReject = 0,  // the whole batch fails, nothing is applied
  kSkip = 1,    // rows whose gradient has a NaN/inf are left untouched
};

// Chunked array of fixed-width rows of T. Rows of chunk 1 and later never
// move once allocated. Chunk 0 starts at kFirstChunkRows rows and doubles up
// to the full chunk size, moving its rows as it grows: a table of a few rows
// then costs a few hundred bytes instead of one full chunk per array (issue
// 11, defect 17: 200 one-row tables cost 805 MiB). Row() is the same for
// every row, so big tables pay nothing for it. Callers hold row indices, not
// pointers, across EnsureRow.
template <typename T>
class ChunkedRows {
 public:
  static constexpr int64_t kFirstChunkRows = 16;

  void Reset(int64_t width, int64_t rows_per_chunk_log2) {
    width_ = width;
    log2_ = rows_per_chunk_log2;
    chunks_.clear();
    first_rows_ = 0;
  }
  T* Row(int64_t row) {
    return chunks_[row >> log2_].get() + (row & ((int64_t{1} << log2_) - 1)) * width_;
  }
  const T* Row(int64_t row) const {
    return chunks_[row >> log2_].get() + (row & ((int64_t{1} << log2_) - 1)) * width_;
  }
  // Makes sure rows [0, row] are backed by memory. Throws std::bad_alloc and
  // then leaves the rows as they were.
  void EnsureRow(int64_t row) {
    const int64_t full = int64_t{1} << log2_;
    if (row < first_rows_) return;
    if (row < full) {
      int64_t rows = std::max<int64_t>(first_rows_ * 2, kFirstChunkRows);
      while (rows <= row) rows *= 2;
      GrowFirstChunk(std::min(rows, full));
      return;
    }
    if (first_rows_ < full) GrowFirstChunk(full);
    while ((row >> log2_) >= static_cast<int64_t>(chunks_.size())) {
      chunks_.emplace_back(AllocateArray<T>(static_cast<size_t>(ChunkElements())));
    }
  }
  // Backs rows [begin, end) with memory now (PopulateBytes), in chunks 1 and
  // later that are allocated (chunk 0 may still move). False if the kernel
  // refused; the rows hold what they held either way.
  bool Populate(int64_t begin, int64_t end) {
    if (width_ == 0) return true;
    begin = std::max(begin, int64_t{1} << log2_);
    end = std::min(end, static_cast<int64_t>(chunks_.size()) << log2_);
    while (begin < end) {
      const int64_t stop = std::min(end, ((begin >> log2_) + 1) << log2_);
      if (!PopulateBytes(Row(begin), Row(stop - 1) + width_)) return false;
      begin = stop;
    }
    return true;
  }
  int64_t ChunkElements() const { return (int64_t{1} << log2_) * width_; }
  int64_t Bytes() const {
    if (chunks_.empty()) return 0;
    const int64_t elements =
        first_rows_ * width_ + static_cast<int64_t>(chunks_.size() - 1) * ChunkElements();
    return elements * static_cast<int64_t>(sizeof(T));
  }
  int64_t width() const { return width_; }

 private:
  void GrowFirstChunk(int64_t rows) {
    std::unique_ptr<T[], FreeArray> grown(AllocateArray<T>(static_cast<size_t>(rows * width_)));
    if (chunks_.empty()) {
      chunks_.emplace_back(std::move(grown));
    } else {
      std::memcpy(grown.get(), chunks_[0].get(),
                  static_cast<size_t>(first_rows_ * width_) * sizeof(T));
      chunks_[0] = std::move(grown);
    }
    first_rows_ = rows;
  }

  int64_t width_ = 0;
  int64_t log2_ = 10;
  int64_t first_rows_ = 0;  // rows chunk 0 holds (0 when there is no chunk)
  std::vector<std::unique_ptr<T[], FreeArray>> chunks_;
};

// Rows of float32, or of 16-bit values read and written as float32 (issue
// 12). F32Row is for float32 arrays only (the unchanged fast paths); Read and
// Write convert. Not thread-safe beyond ChunkedRows' rules: distinct rows may
// be read and written from different threads.
class RowArray {
 public:
  void Reset(StorageType type, int64_t width, int64_t rows_per_chunk_log2) {
    type_ = type;
    width_ = width;
    f32_.Reset(type == StorageType::kFloat32 ? width : 0, rows_per_chunk_log2);
    // The same rows per chunk as the table's other arrays (1 MiB chunks): a chunk of
    // twice the rows would leave up to twice the unused rows in the last one.
    f16_.Reset(type == StorageType::kFloat32 ? 0 : width, rows_per_chunk_log2);
  }
  void EnsureRow(int64_t row) {
    if (is_f32()) {
      f32_.EnsureRow(row);
    } else {
      f16_.EnsureRow(row);
    }
  }
  bool Populate(int64_t begin, int64_t end) {
    return is_f32() ? f32_.Populate(begin, end) : f16_.Populate(begin, end);
  }
  bool is_f32() const { return type_ == StorageType::kFloat32; }
  StorageType type() const { return type_; }
  HalfKind kind() const { return static_cast<HalfKind>(static_cast<int>(type_)); }
  int64_t width() const { return width_; }
  int64_t Bytes() const { return f32_.Bytes() + f16_.Bytes(); }
  int64_t row_bytes() const { return width_ * (is_f32() ? 4 : 2); }
  float* F32Row(int64_t row) { return f32_.Row(row); }
  const float* F32Row(int64_t row) const { return f32_.Row(row); }
  uint16_t* HalfRow(int64_t row) { return f16_.Row(row); }
  const uint16_t* HalfRow(int64_t row) const { return f16_.Row(row); }
  const char* RowAddress(int64_t row) const {
    return is_f32() ? reinterpret_cast<const char*>(f32_.Row(row))
                    : reinterpret_cast<const char*>(f16_.Row(row));
  }
  // out[0..width) = the row as float32 (exact).
  void Read(int64_t row, float* out) const {
    if (width_ == 0) return;
    if (is_f32()) {
      std::memcpy(out, f32_.Row(row), sizeof(float) * static_cast<size_t>(width_));
    } else {
      WidenHalvesSerial(kind(), f16_.Row(row), width_, out);
    }
  }
  // The row = values[0..width) (rounded to nearest even when 16-bit).
  void Write(int64_t row, const float* values) {
    if (width_ == 0) return;
    if (is_f32()) {
      std::memcpy(f32_.Row(row), values, sizeof(float) * static_cast<size_t>(width_));
    } else {
      NarrowFloatsSerial(kind(), values, width_, f16_.Row(row));
    }
  }
  // Rounds values[0..width) in place as Write would store them.
  void Round(float* values) const {
    if (is_f32() || width_ == 0) return;
    uint16_t buffer[256];
    for (int64_t i = 0; i < width_; i += 256) {
      const int64_t n = std::min<int64_t>(256, width_ - i);
      NarrowFloatsSerial(kind(), values + i, n, buffer);
      WidenHalvesSerial(kind(), buffer, n, values + i);
    }
  }

 private:
  StorageType type_ = StorageType::kFloat32;
  int64_t width_ = 0;
  ChunkedRows<float> f32_;
  ChunkedRows<uint16_t> f16_;
};

class EmbeddingTable {
 public:
  static Status Create(const TableConfig& config, std::unique_ptr<EmbeddingTable>* out);

  int64_t dim() const { return config_.dim; }
  // Slots per row in ReadState / WriteState: the optimizer's, and the float32
  // master copy last when the table keeps one (multi_precision, see StorageType).
  int num_slots() const { return optimizer_.num_slots() + (has_master() ? 1 : 0); }
  // Whether rows keep a float32 master copy (multi_precision on a 16-bit table).
  bool has_master() const { return master_.width() > 0; }
  const TableConfig& config() const { return config_; }
  int64_t Size() const { return size_; }
  // Bytes this table holds: buckets, row chunks, slot chunks, step counters.
  int64_t MemoryBytes() const;
  // The part of MemoryBytes that is push scratch (kept for the next push).
  int64_t ScratchBytes() const;
  // Idle-time work, for a server between requests: backs with memory up to
  // max_bytes of the rows the next inserts will write (the last push's count
  // of new rows, twice, at most one chunk past the end), so that the kernel's
  // zeroing of fresh pages happens now rather than inside the next push.
  // Returns whether it did any (call again until it returns false). Changes
  // no row; may allocate the next chunk of each row array early.
  bool PrefaultAhead(int64_t max_bytes);
  // Step counter of the whole table (pushes applied), for StepMode::kPerTable.
  int64_t table_step() const { return table_step_; }
  void set_table_step(int64_t step) { table_step_ = step; }

  // Replaces the optimizer. Slots of every existing row are reset to the new
  // optimizer's initial values and row step counters to 0. A master copy is
  // made (from the stored values) or dropped as multi_precision says.
  Status SetOptimizer(const OptimizerConfig& optimizer);
  // Changes only the optimizer's learning rate (a learning-rate schedule):
  // every row's slots and step counters, the master copies and the table step
  // stay. InvalidArgument for a rate the optimizer refuses (ValidateOptimizer);
  // the table is then unchanged.
  Status SetLearningRate(double learning_rate);

  // out[i] = row of keys[i]; a missing key gets its initial value and is not
  // inserted. Duplicates allowed.
  Status Lookup(const int64_t* keys, int64_t n, float* out) const;
  // Like Lookup, but missing keys are inserted with their initial value.
  Status LookupOrInsert(const int64_t* keys, int64_t n, float* out);
  // Fills only the initial values (never touches the map).
  void InitialValues(const int64_t* keys, int64_t n, float* out) const;

  // Applies the optimizer to the rows of keys (inserted if missing) with
  // grads (n * dim). Duplicate keys are summed first. Nothing is changed if
  // the batch is rejected. *applied receives the number of distinct rows
  // updated.
  Status ApplyGradients(const int64_t* keys, int64_t n, const float* grads,
                        NonFinitePolicy policy, int64_t* applied);
  // ApplyGradients in two steps, so that one request's pushes to several
  // tables are applied all or nothing (issue 11): BeginPush checks, plans and
  // updates the stored rows in place (each saved first), and fails changing
  // nothing; then either FinishPush applies the rest (new rows, candidates,
  // evictions) or CancelPush puts every row back. Nothing else may run on the
  // table in between (grads need not stay alive after BeginPush).
  //   for (t : tables) if (!(s = t->BeginPush(...)).ok()) { cancel the begun; return s; }
  //   for (t : tables) t->FinishPush(&applied);
  // FinishPush fails only for lack of memory (counting candidates), and then
  // changed nothing of this table.
  Status BeginPush(const int64_t* keys, int64_t n, const float* grads, NonFinitePolicy policy);
  Status FinishPush(int64_t* applied);
  void CancelPush();
  bool push_pending() const { return pending_push_ != nullptr; }
  // Sets rows to values (n * dim), inserting missing keys; duplicates: last
  // wins. Slots and step counters of the rows are left as they are, except
  // that inserted rows get initial slots; a master copy becomes the values.
  Status Assign(const int64_t* keys, int64_t n, const float* values);
  // Removes keys that exist; returns how many were removed.
  int64_t Remove(const int64_t* keys, int64_t n);

  // Full row state for checkpoints: slots are num_slots() * dim floats per
  // row (slot-major within a row; the master copy last), steps one int64 per row.
  Status ReadState(const int64_t* keys, int64_t n, float* values, float* slots,
                   int64_t* steps) const;
  Status WriteState(const int64_t* keys, int64_t n, const float* values, const float* slots,
                    const int64_t* steps);

  // Iteration for checkpoints: copies up to max_rows keys starting at bucket
  // *cursor into keys_out, advancing *cursor; returns the number copied (0 at
  // the end). Rows can then be read with ReadState.
  int64_t NextKeys(int64_t* cursor, int64_t max_rows, int64_t* keys_out) const;

  // Change tracking for incremental checkpoints (issue 5). Every write to a
  // row (insert, gradient, assign, state write, optimizer reset) stamps it
  // with the current change epoch; Remove records (key, epoch) once the
  // epoch is past 1 (a save or load happened). A checkpoint
  // bumps the epoch and later writes only rows stamped after the last save.
  //   uint32_t saved = table->change_epoch();
  //   table->set_change_epoch(saved + 1);
  //   n = table->NextChangedKeys(&cursor, 4096, saved_before, keys);  // stamp > saved_before
  uint32_t change_epoch() const { return change_epoch_; }
  void set_change_epoch(uint32_t epoch) { change_epoch_ = epoch; }
  // Like NextKeys, but only rows whose stamp is greater than `since`.
  int64_t NextChangedKeys(int64_t* cursor, int64_t max_rows, uint32_t since,
                          int64_t* keys_out) const;
  // Keys removed with an epoch greater than `since`: copies up to capacity of
  // them into keys_out and returns how many there are in all.
  int64_t RemovedSince(uint32_t since, int64_t* keys_out, int64_t capacity) const;
  // Forgets removals recorded at epochs <= through (already in a checkpoint).
  void PruneRemoved(uint32_t through);
  // Grows the map for `rows` rows at once. A load inserts rows in the saved
  // table's bucket order; growing step by step meanwhile makes linear
  // probing cluster (quadratic: 5M rows took minutes instead of a second).
  Status ReserveRows(int64_t rows) { return Reserve(rows); }
  // Like NextChangedKeys, but also copies each row's state (as ReadState
  // does) straight from the scan, without a second hash probe per key.
  int64_t NextChangedRows(int64_t* cursor, int64_t max_rows, uint32_t since, int64_t* keys_out,
                          float* values, float* slots, int64_t* steps) const;

  // Admission and eviction (issue 5; semantics above PolicyConfig).
  // Drops rows (and candidates) not touched for ttl_steps; returns the rows
  // dropped (0 without a TTL).
  int64_t EvictExpired();
  // Counts a push of the table that brought this shard no ids (a step).
  void AdvanceStep();
  PolicyStats policy_stats() const;

  // Admission candidates for checkpoints (issue 11, defect 12): the ids seen
  // fewer than min_count times, with their sighting count and last step. A
  // restarted server that lost them would drop the push that admits an id.
  //   std::vector<int64_t> keys(n), counts(n), steps(n);  // n = CandidateCount()
  //   n = table->ReadCandidates(keys.data(), counts.data(), steps.data(), n);
  //   other->ClearCandidates();
  //   s = other->WriteCandidates(keys.data(), counts.data(), steps.data(), n);
  // Per-row policy metadata for checkpoints (issue 11): the touch count
  // (kLfu with max_rows) and last step (TTL, kLru) of stored ids, so that a
  // restarted server evicts the rows it would have evicted. An array the
  // policy does not keep reads as zeros and is ignored on write.
  //   s = table->ReadRowMeta(keys, n, touches, last_steps);  // every key stored
  //   s = other->WriteRowMeta(keys, n, touches, last_steps);
  bool TracksRowMeta() const { return TracksTouches() || TracksLastStep(); }
  Status ReadRowMeta(const int64_t* keys, int64_t n, int64_t* touches, int64_t* last_steps) const;
  // Values must be in [0, 2^32) and every key stored: else nothing is written.
  Status WriteRowMeta(const int64_t* keys, int64_t n, const int64_t* touches,
                      const int64_t* last_steps);

  int64_t CandidateCount() const;
  // Copies up to capacity candidates (in map order); returns how many it copied.
  int64_t ReadCandidates(int64_t* keys, int64_t* counts, int64_t* last_steps,
                         int64_t capacity) const;
  // Sets the count and last step of each id (overwriting one it holds); ids
  // stored as rows are skipped. Counts must be in [1, 2^32), steps in
  // [0, 2^32): else nothing is written.
  Status WriteCandidates(const int64_t* keys, const int64_t* counts, const int64_t* last_steps,
                         int64_t n);
  void ClearCandidates();

 private:
  explicit EmbeddingTable(const TableConfig& config);

  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;

  // The map: open addressing with linear probing over 64-byte lines of five
  // (key, row) slots, and a key probes its home line first (issue 10). A
  // lookup of a stored key then reads one cache line of the map: 12-byte
  // buckets probed one by one spilled into a second line (straddling buckets,
  // 2.2 buckets per probe at load 0.7) for about a third of the keys, a
  // dependent cache miss. A line is an unordered set of slots; a key lives in
  // the first line from its home that had a free slot when it was inserted,
  // so a search ends at the first line with a free slot. Keys and rows apart
  // within the line so that one compare tests several keys (SSE2 below).
  // 64 bytes for 5 slots: 6.7% more map bytes than 12-byte buckets.
  static constexpr int kSlotsPerLine = 5;
  struct alignas(64) BucketLine {
    int64_t key[kSlotsPerLine];
    uint32_t row[kSlotsPerLine];  // kEmpty: a free slot (its key is stale)
    uint32_t unused;
  };
  static_assert(sizeof(BucketLine) == 64, "a bucket line is one cache line");

  int64_t FindRow(int64_t key) const;
  // Row of key probing from its home line `line` (-1 when missing).
  int64_t ProbeRow(size_t line, int64_t key) const;
  // ProbeRow slot by slot (a key not in its home line, or a stale match).
  int64_t ProbeRowSlowly(size_t line, int64_t key) const;
  // Line and slot of a stored key; false when missing.
  bool FindSlot(int64_t key, size_t* line, int* slot) const;
  // FindSlot probing slot by slot from `from` (a key's home line or a later one).
  bool FindSlotFrom(size_t from, int64_t key, size_t* line, int* slot) const;
  // Puts (key, row) into the first free slot from key's home line (or from
  // `home`, which must be HomeLine(key)).
  void PlaceBucket(int64_t key, uint32_t row) { PlaceBucketFrom(HomeLine(key), key, row); }
  void PlaceBucketFrom(size_t home, int64_t key, uint32_t row);
  // Calls fn(key, row) for every stored row, in slot order.
  template <typename Fn>
  void ForEachStored(Fn fn) const {
    for (const BucketLine& line : buckets_) {
      for (int s = 0; s < kSlotsPerLine; ++s) {
        if (line.row[s] != kEmpty) fn(line.key[s], line.row[s]);
      }
    }
  }
  // Slot s is line s / 5, position s % 5: the cursor of NextKeys and its kin.
  int64_t SlotKey(int64_t s) const {
    return buckets_[static_cast<size_t>(s / kSlotsPerLine)].key[s % kSlotsPerLine];
  }
  uint32_t SlotRow(int64_t s) const {
    return buckets_[static_cast<size_t>(s / kSlotsPerLine)].row[s % kSlotsPerLine];
  }
  int64_t SlotCount() const { return static_cast<int64_t>(lines_) * kSlotsPerLine; }
  // Rows of keys[0..n) (-1 when missing), probing a block at a time with
  // prefetches so the cache misses of different keys overlap.
  void FindRows(const int64_t* keys, int64_t n, int64_t* rows) const;
  // missing (nullable): set to 1 for the keys the table does not store.
  void LookupRange(const int64_t* keys, int64_t n, float* out, uint8_t* missing) const;
  // LookupRange for rows of kRowFloats floats (0: config_.dim, any).
  template <int64_t kRowFloats, bool kHalf = false>
  void LookupRangeFor(const int64_t* keys, int64_t n, float* out, uint8_t* missing) const;
  // Initial rows of keys[0..n) into targets[i]: copied from initial_rows_
  // where it holds them, generated otherwise (the same bits either way).
  void FillInitialRowsCached(const int64_t* keys, int64_t n, float* const* targets) const;
  // Whether initial rows are worth caching (float32 tables with a random
  // initializer: Zeros/Constant rows cost less to write than to copy, and a
  // 16-bit table's lookup returns the rounded initial value, which a push
  // must not start from).
  bool CachesInitialRows() const {
    return values_.is_f32() && config_.initializer.kind != InitializerKind::kZeros &&
           config_.initializer.kind != InitializerKind::kConstant;
  }
  // Returns the row of key, inserting it (initial slots, step 0, policy
  // metadata) when missing; *inserted tells. The value of an inserted row is
  // NOT set: the caller writes it or calls FillNewRows for the batch's new
  // rows, so generation runs vectorized (and in parallel) once per batch.
  Status FindOrInsertRow(int64_t key, int64_t* row, bool* inserted);
  // Initial values of rows[i] (just inserted) for keys[i].
  void FillNewRows(const int64_t* keys, const int64_t* rows, int64_t n);
  Status Reserve(int64_t rows_needed);
  void Rehash(int64_t new_lines);
  void InitRowSlots(int64_t row);
  // One stored row's state as ReadState gives it (slots: num_slots() * dim floats).
  void ReadRowState(int64_t row, float* values, float* slots, int64_t* step) const;
  // Floats of one row's state in push scratch: value, optimizer slots, master.
  int64_t RowStateFloats() const {
    return config_.dim * (1 + optimizer_.num_slots() + (has_master() ? 1 : 0));
  }
  size_t HomeLine(int64_t key) const;
  size_t NextLine(size_t line) const { return line + 1 == lines_ ? 0 : line + 1; }
  // Probe steps from line `from` forward to line `to` (cyclic).
  size_t Distance(size_t from, size_t to) const {
    return to >= from ? to - from : to + lines_ - from;
  }

  TableConfig config_;
  Optimizer optimizer_;
  // Open addressing with linear probing over lines of buckets; lines_ =
  // buckets_.size(), any value (HomeLine maps the hash onto it by multiply-shift).
  std::vector<BucketLine, HugePageAllocator<BucketLine>> buckets_;
  uint64_t lines_ = 0;
  int64_t size_ = 0;
  int64_t next_row_ = 0;               // rows ever allocated
  std::vector<uint32_t> free_rows_;    // rows released by Remove
  // float32, or 16-bit (config_.value_type / slot_type; issue 12).
  RowArray values_;
  RowArray slots_;
  // float32 master copies of 16-bit rows under multi_precision (width dim), or
  // none (width 0). See StorageType.
  ChunkedRows<float> master_;
  bool half_ = false;  // values or slots are 16-bit: the converting paths
  // Per row, side by side: its step (the updates it had; 32 bits: 4 billion
  // updates of one row is far beyond any run, and the saved 4 bytes a row
  // matter at small dims, memory target 1.3x raw) and its change epoch stamp.
  // An update writes both: one cache line a row instead of two (a warm W1
  // push is bound by memory traffic; issue 10).
  ChunkedRows<uint32_t> row_meta_;
  uint32_t* StepOf(int64_t row) { return row_meta_.Row(row); }
  const uint32_t* StepOf(int64_t row) const { return row_meta_.Row(row); }
  uint32_t* StampOf(int64_t row) { return row_meta_.Row(row) + 1; }
  const uint32_t* StampOf(int64_t row) const { return row_meta_.Row(row) + 1; }
  int64_t table_step_ = 0;
  // The current change epoch, and the removals not yet checkpointed.
  uint32_t change_epoch_ = 1;
  std::vector<std::pair<int64_t, uint32_t>> removed_;

  // ---- Admission and eviction (issue 5) ----
  struct Candidate {
    uint32_t count;
    uint32_t last_step;
  };
  bool TracksTouches() const {
    return config_.policy.max_rows > 0 && config_.policy.eviction == EvictionKind::kLfu;
  }
  bool TracksLastStep() const {
    return config_.policy.ttl_steps > 0 ||
           (config_.policy.max_rows > 0 && config_.policy.eviction == EvictionKind::kLru);
  }
  // Steps since `last` (signed 32-bit difference; negative after a step reset).
  int64_t AgeOf(uint32_t last) const {
    return static_cast<int32_t>(static_cast<uint32_t>(table_step_) - last);
  }
  void InitRowMeta(int64_t row);
  void TouchRow(int64_t row);
  // Everything a push decided and computed before it changes the table
  // (issue 11, defects 4 and 8: a push that fails changes nothing). j indexes
  // the push's distinct ids.
  struct PushPlan {
    std::vector<int64_t> unique;    // distinct ids, in order of first appearance
    std::vector<float> summed;      // their summed gradients when ids repeat
    const float* grads = nullptr;   // u * dim: the gradient of unique[j]
    std::vector<int64_t> rows;      // row of unique[j], -1 when not stored
    std::vector<uint8_t> skip;      // 1: unique[j] is left alone (kSkip)
    // False: every gradient is known finite (the push's own sum said so).
    bool may_be_nonfinite = true;
    // Admission: ids to insert, candidates counted (with their count before)
    // or forgotten, rows evicted for room.
    std::vector<int64_t> fresh;
    std::vector<int64_t> counted;
    std::vector<Candidate> counted_before;
    std::vector<int64_t> rejected;
    std::vector<int64_t> victims;   // keys
    // Per fresh id: its updated row, dim values, the slot floats, the master (RowStateFloats).
    float* fresh_state = nullptr;   // in the table's push scratch
    std::vector<uint8_t> fresh_overflows;
    std::vector<int64_t> fresh_keys;
    // j of the stored rows updated in place, and what they held before.
    std::vector<int64_t> existing;
    float* saved_state = nullptr;     // in the table's push scratch
    uint32_t* saved_meta = nullptr;   // step, stamp, touches, last step
    std::vector<uint8_t> overflows;    // per existing row
  };
  // Builds the plan: sums, checks, admission, the fresh rows' new state; sizes
  // every array the commit writes. Changes nothing the table holds (it may
  // grow the map and row arrays); may throw std::bad_alloc.
  Status PreparePush(const int64_t* keys, int64_t n, const float* grads, NonFinitePolicy policy,
                     PushPlan* plan);
  // kNonFinite naming the first id (in plan.unique's order) whose gradient holds NaN or inf.
  Status NonFiniteStatus(const PushPlan& plan) const;
  // Decides which ids get a row: candidate counts, capacity victims, rejects.
  void PlanAdmission(PushPlan* plan) const;
  void SelectVictims(int64_t count, const std::vector<uint8_t>& keep_row,
                     std::vector<int64_t>* victims) const;
  // Computes the fresh rows' new state; returns the index (in plan->fresh)
  // of the first one that overflows, or -1; with skipping, marks them skipped.
  int64_t ComputeFreshRows(PushPlan* plan, bool skipping);
  // Updates the plan's stored rows in place; a row whose result is not
  // finite is put back at once and flagged, as is (untouched) a row whose
  // gradient is not finite. Returns whether any was.
  bool UpdateExistingRows(PushPlan* plan);
  // Prefetches (for writing) every line the update of a stored row touches.
  void PrefetchRowState(int64_t row) const;
  void RestoreExistingRows(const PushPlan& plan);
  // Puts back a row's values, slots and metadata (step, stamp, touches, last step).
  void RestoreRow(int64_t row, const float* saved, const uint32_t* meta);
  Status OverflowStatus(int64_t key) const;
  // Counts and forgets the plan's candidates. On std::bad_alloc, puts back
  // what it changed and rethrows.
  void CommitCandidates(const PushPlan& plan, uint32_t push_step);
  // Inserts key into a free bucket on an already reserved row: allocates
  // nothing. init_slots false: the caller writes the row's slots itself.
  int64_t InsertReservedRow(int64_t key, bool init_slots = true);
  // Backs rows [0, row] in every per-row array.
  void EnsureRowsUpTo(int64_t row);
  // PrefaultAhead's range: rows [max(prefaulted_, next_row_), prefault_target_);
  // off for good once the kernel refuses (before Linux 5.14).
  int64_t prefault_target_ = 0;
  int64_t prefaulted_ = 0;
  bool prefault_works_ = true;
  void MaybeEvictAutomatically();
  int64_t CandidateBytes() const;
  // The two halves of ApplyGradients (see BeginPush): on failure nothing of
  // the table changed.
  Status BeginPlan(const int64_t* keys, int64_t n, const float* grads, NonFinitePolicy policy,
                   PushPlan* plan);
  Status FinishPlan(const PushPlan& plan, int64_t saved_table_step, int64_t* applied);
  ChunkedRows<uint32_t> touches_;
  ChunkedRows<uint32_t> last_step_;
  // Reused by every push (ApplyGradients): the fresh rows' new state, and the
  // stored rows' state saved before their in-place update.
  ScratchArray<float> push_fresh_state_;
  ScratchArray<float> push_saved_state_;
  ScratchArray<uint32_t> push_saved_meta_;
  // Initial rows that lookups generated for ids the table does not store,
  // for the push that usually follows (issue 10: never generate a row twice).
  // Lookup is const to its callers; the cache changes no result.
  mutable InitialRowCache initial_rows_;
  std::unordered_map<int64_t, Candidate> candidates_;
  PolicyStats policy_stats_;
  // The push begun by BeginPush and not finished or cancelled yet.
  std::unique_ptr<PushPlan> pending_push_;
  int64_t pending_table_step_ = 0;  // table_step_ before it
};

}  // namespace kvsparse

#endif  // KVSPARSE_TABLE_H_
