// EmbeddingTable: a growing hash map from any int64 key to a row of `dim`
// float32 values, the optimizer's per-row slots and a per-row step counter.
//
// Rows live in chunks (chunked_rows.h), so growing moves no row past the first
// chunk (which starts small): only the key index is rehashed. All batch
// operations take plain arrays and return a Status; none touches Python, so the
// bridge calls them with the GIL released. A table is not thread-safe: one
// caller at a time (a server shard serves its requests in order); inside one
// call it may split a batch over threads (parallel.h).
//
// What it owns: its rows (values, slots, master copies, step and change stamp
// per row), the free rows and the change log, and two parts of its own:
// KeyIndex index_ (key_index.h: key -> row slot) and AdmissionPolicy policy_
// (admission_policy.h: candidates, per-row counters, victims). Its code is
// split by concern, one file each:
//   table.cc             creation, memory, rows (insert, assign, remove), optimizer
//   table_lookup.cc      lookups and the cache of the initial rows they generate
//   table_push.cc        the push transaction (plan, update in place, commit or undo)
//   table_checkpoint.cc  state reads and writes, scans, the change log
//   table_policy.cc      admission and eviction, through policy_
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

#include "admission_policy.h"
#include "chunked_rows.h"
#include "disk_tier.h"
#include "half.h"
#include "initializer.h"
#include "key_index.h"
#include "memory.h"
#include "optimizer.h"
#include "row_cache.h"
#include "status.h"

namespace kvsparse {

constexpr int64_t kMaxDim = 4096;

// StorageType (chunked_rows.h): how a table stores its values, or its
// optimizer slots. The table's interface stays float32:
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

class EmbeddingTable {
 public:
  static Status Create(const TableConfig& config, std::unique_ptr<EmbeddingTable>* out);
  ~EmbeddingTable();

  // A memory budget shared with the shard's other tables and, with a spill
  // directory, a disk tier for the rows that do not fit (disk_tier.h,
  // table_tier.cc). Before the first row. Every operation below keeps its
  // meaning: rows on disk are read back when a request names them.
  Status EnableTier(const TierConfig& tier);
  bool tiered() const { return tier_ != nullptr; }
  TierStats tier_stats() const;
  // Ok, or the disk error that ended the last scan (NextKeys, NextChangedKeys,
  // NextChangedRows return counts only: a caller checks this at the end).
  Status scan_status() const;

  int64_t dim() const { return config_.dim; }
  // Slots per row in ReadState / WriteState: the optimizer's, and the float32
  // master copy last when the table keeps one (multi_precision, see StorageType).
  int num_slots() const { return optimizer_.num_slots() + (has_master() ? 1 : 0); }
  // Whether rows keep a float32 master copy (multi_precision on a 16-bit table).
  bool has_master() const { return master_.width() > 0; }
  const TableConfig& config() const { return config_; }
  // Rows stored, in memory and on disk.
  int64_t Size() const { return index_.size() + DiskRowCount(); }
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
  // Idle-time work of the disk tier, for a server between requests: one step
  // (about max_bytes, at least one merge fragment) of the merges that the
  // rows moved out have earned, in room the budget has. Returns whether it
  // did any (call again until it returns false). While a server keeps calling
  // it, the operations that earn merges leave them to it (they still run them
  // when the runs fall far behind, or when no call came for a while).
  // max_bytes 0 only says that the server is idle, and does nothing.
  bool IdleMaintenance(int64_t max_bytes);
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
  // Brings the rows of keys that are on disk into memory now (making room as
  // a pull does: the coldest other rows move to disk), so that a pull or push
  // naming them later finds them there: a worker sends the next batch's ids
  // ahead and the disk reads overlap its compute. Changes no row's value,
  // slots, step or stamp; ids stored nowhere are not inserted. Ok and does
  // nothing on a table without rows on disk, or with concurrent lookups (a
  // serving replica). *read: the rows brought in (nullable). LimitExceeded
  // (nothing moved) when they do not fit the budget; other statuses as a
  // lookup's (Corruption, IoError).
  //   s = table->PrefetchRows(next_keys, n, &read);   // later: Lookup finds them in memory
  Status PrefetchRows(const int64_t* keys, int64_t n, int64_t* read);
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
  // tables are applied all or nothing: BeginPush checks, plans and
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

  // Change tracking for incremental checkpoints. Every write to a
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
  // A tiered table grows as the budget allows instead.
  Status ReserveRows(int64_t rows) { return tier_ != nullptr ? Status::Ok() : index_.Reserve(rows); }
  // Like NextChangedKeys, but also copies each row's state (as ReadState
  // does) straight from the scan, without a second hash probe per key.
  // memory_only: the rows in memory alone (a checkpoint that takes the disk
  // tier's rows by reference, below).
  int64_t NextChangedRows(int64_t* cursor, int64_t max_rows, uint32_t since, int64_t* keys_out,
                          float* values, float* slots, int64_t* steps,
                          bool memory_only = false) const;

  // Checkpoints by reference (table_disk_checkpoint.cc): a full checkpoint
  // takes the rows on disk as hard links of the disk tier's immutable run
  // files plus a MANIFEST of their index (~2% of their bytes), not as copies.
  // LinkDiskCheckpoint runs in the process that owns the table, right before
  // the snapshot (fork) whose FinishDiskCheckpoint syncs the files and writes
  // the MANIFEST as of the snapshot; *rows gets the rows it holds. Errors:
  // kInvalidArgument without a disk tier; the store's I/O errors (a link
  // across file systems among them).
  bool HasDiskStore() const;
  Status LinkDiskCheckpoint(const std::string& directory);
  Status FinishDiskCheckpoint(const std::string& directory, int64_t* rows) const;
  // Makes such a checkpoint this table's disk tier: its files are linked into
  // the tier's own directory and its index loaded; no row is read. The table
  // must be empty, with a disk tier, and its rows the checkpoint's width
  // (dim, optimizer slots); kLimitExceeded if the index alone passes the
  // budget. On error the table is as it was.
  Status AdoptDiskCheckpoint(const std::string& directory);

  // Admission and eviction (semantics in admission_policy.h, above PolicyConfig).
  // Drops rows (and candidates) not touched for ttl_steps; returns the rows
  // dropped (0 without a TTL).
  int64_t EvictExpired();
  // Counts a push of the table that brought this shard no ids (a step).
  void AdvanceStep();
  PolicyStats policy_stats() const;

  // Admission candidates for checkpoints: the ids seen
  // fewer than min_count times, with their sighting count and last step. A
  // restarted server that lost them would drop the push that admits an id.
  //   std::vector<int64_t> keys(n), counts(n), steps(n);  // n = CandidateCount()
  //   n = table->ReadCandidates(keys.data(), counts.data(), steps.data(), n);
  //   other->ClearCandidates();
  //   s = other->WriteCandidates(keys.data(), counts.data(), steps.data(), n);
  // Per-row policy metadata for checkpoints: the touch count
  // (kLfu with max_rows) and last step (TTL, kLru) of stored ids, so that a
  // restarted server evicts the rows it would have evicted. An array the
  // policy does not keep reads as zeros and is ignored on write.
  //   s = table->ReadRowMeta(keys, n, touches, last_steps);  // every key stored
  //   s = other->WriteRowMeta(keys, n, touches, last_steps);
  bool TracksRowMeta() const { return policy_.TracksTouches() || policy_.TracksLastStep(); }
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
  // Not on a budgeted table: the cache (up to 16 MiB) would take rows' memory.
  bool CachesInitialRows() const {
    return tier_ == nullptr && values_.is_f32() && config_.initializer.kind != InitializerKind::kZeros &&
           config_.initializer.kind != InitializerKind::kConstant;
  }
  // Returns the row of key, inserting it (initial slots, step 0, policy
  // metadata) when missing; *inserted tells. The value of an inserted row is
  // NOT set: the caller writes it or calls FillNewRows for the batch's new
  // rows, so generation runs vectorized (and in parallel) once per batch.
  Status FindOrInsertRow(int64_t key, int64_t* row, bool* inserted);
  // Initial values of rows[i] (just inserted) for keys[i].
  void FillNewRows(const int64_t* keys, const int64_t* rows, int64_t n);
  void InitRowSlots(int64_t row);
  // One stored row's state as ReadState gives it (slots: num_slots() * dim floats).
  void ReadRowState(int64_t row, float* values, float* slots, int64_t* step) const;
  // Floats of one row's state in push scratch: value, optimizer slots, master.
  int64_t RowStateFloats() const {
    return config_.dim * (1 + optimizer_.num_slots() + (has_master() ? 1 : 0));
  }
  Status NotStored(int64_t key) const;
  Status LookupOrInsertInMemory(const int64_t* keys, int64_t n, float* out);
  Status AssignInMemory(const int64_t* keys, int64_t n, const float* values);
  // Inserts key into a free bucket on an already reserved row: allocates
  // nothing. init_slots false: the caller writes the row's slots itself.
  int64_t InsertReservedRow(int64_t key, bool init_slots = true);
  // Backs rows [0, row] in every per-row array.
  void EnsureRowsUpTo(int64_t row);

  // Everything a push decided and computed before it changes the table (a
  // push that fails changes nothing): the admission's decision (fresh,
  // counted, rejected, victims) and the rest. j indexes the push's distinct ids.
  struct PushPlan : AdmissionDecision {
    std::vector<int64_t> unique;    // distinct ids, in order of first appearance
    std::vector<float> summed;      // their summed gradients when ids repeat
    const float* grads = nullptr;   // u * dim: the gradient of unique[j]
    std::vector<int64_t> rows;      // row of unique[j], -1 when not stored
    std::vector<uint8_t> skip;      // 1: unique[j] is left alone (kSkip)
    // False: every gradient is known finite (the push's own sum said so).
    bool may_be_nonfinite = true;
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
  // The two halves of ApplyGradients (see BeginPush): on failure nothing of
  // the table changed.
  Status BeginPlan(const int64_t* keys, int64_t n, const float* grads, NonFinitePolicy policy,
                   PushPlan* plan);
  Status FinishPlan(const PushPlan& plan, int64_t saved_table_step, int64_t* applied);
  void MaybeEvictAutomatically();

  // The disk tier (table_tier.cc), and the scope every operation on rows
  // opens: it prepares the rows and settles the budget (table_tier.h).
  struct Tier;
  class TierScope;
  int64_t RecordBytes() const;
  Status OpenTierStore();
  // MemoryBytes and the disk tier's index: what the table reports to the budget.
  int64_t TierBytes() const;
  void ReportMemory();
  // The disk tier's merges, paced by the rows moved out, in room the budget has
  // (as an operation ends; left to IdleMaintenance while a server calls it).
  void RunMaintenance();
  // One step of up to max_bytes of the merges in room the budget has; returns
  // the bytes it moved (0: nothing to merge, no room, or a failed step).
  int64_t MaintenanceStep(int64_t max_bytes);
  int64_t BackedRows() const;
  int64_t RowGrowthBytes(int64_t last_row) const;
  int64_t BytesPerRow() const;
  void EncodeRow(int64_t row, uint8_t* record) const;
  void DecodeRow(const uint8_t* record, int64_t row);
  uint64_t ColdScore(int64_t row) const;
  void PrefetchColdScore(int64_t row) const;  // the line ColdScore(row) reads
  Status LimitStatus(int64_t incoming, int64_t needed) const;
  // Moves count rows (none of keep, which is sorted) to disk.
  Status EvictRows(int64_t count, const std::vector<int64_t>& keep);
  // Gives whole chunks of the row arrays back (rows moved into free slots).
  void CompactRows();
  // Room for incoming more rows in memory within the budget (keep: the
  // request's ids, sorted; resident_kept of them are in memory).
  // The request's scratch (a push's saved and new row states: fresh of the
  // keep ids are new) is counted too.
  Status MakeRoom(int64_t incoming, const std::vector<int64_t>& keep, int64_t resident_kept,
                  int64_t fresh);
  // Moves rows to disk and gives memory back until the shard is within its
  // budget (as a TierScope closes: SetOptimizer made every row wider, the
  // disk index grew).
  void ShrinkToBudget();
  // Frees about bytes (push scratch, then cold rows to disk and the row
  // arrays shrunk); returns what it freed. Another table of the shard asks.
  int64_t ReleaseMemory(int64_t bytes);
  // Frees the push scratch (not while a push is begun); whether it held any.
  bool ReleaseScratch();
  // Rows per piece when a tiered table writes a large batch piece by piece
  // (WriteState, Assign: a checkpoint's block can be larger than the budget).
  int64_t TierBatchRows() const;
  // Brings keys' disk rows into memory after making room for them and, with
  // insert, for the keys stored nowhere. Changes no row's state. Through
  // TierScope::Prepare only, so that the budget is settled after it.
  Status PrepareRows(const int64_t* keys, int64_t n, bool insert);
  // Records of the keys not in memory that are on disk: which[j] is the
  // index in keys of record j.
  Status ReadDiskRows(const int64_t* keys, int64_t n, std::vector<int64_t>* which,
                      std::vector<uint8_t>* records) const;
  // Lookup's second half: the rows on disk (read, not moved) and the counts.
  Status LookupDisk(const int64_t* keys, int64_t n, float* out) const;
  // ReadState / ReadRowMeta of the keys on disk (the others left as they are).
  Status ReadStateFromDisk(const int64_t* keys, int64_t n, float* values, float* slots,
                           int64_t* steps, int64_t* touches, int64_t* last_steps) const;
  int64_t DiskRowCount() const;
  int64_t RemoveFromDisk(const int64_t* keys, int64_t n);
  // The disk part of the scans (NextKeys and kin), after the memory slots.
  int64_t NextDiskRows(int64_t* cursor, int64_t max_rows, bool changed_only, uint32_t since,
                       int64_t* keys_out, float* values, float* slots, int64_t* steps) const;
  Status MigrateDiskRows(int old_slots, bool old_master);
  std::unique_ptr<Tier> tier_;

  TableConfig config_;
  Optimizer optimizer_;
  KeyIndex index_;
  AdmissionPolicy policy_;
  int64_t next_row_ = 0;               // rows ever allocated
  std::vector<uint32_t> free_rows_;    // rows released by Remove
  // float32, or 16-bit (config_.value_type / slot_type).
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
  // push is bound by memory traffic).
  ChunkedRows<uint32_t> row_meta_;
  uint32_t* StepOf(int64_t row) { return row_meta_.Row(row); }
  const uint32_t* StepOf(int64_t row) const { return row_meta_.Row(row); }
  uint32_t* StampOf(int64_t row) { return row_meta_.Row(row) + 1; }
  const uint32_t* StampOf(int64_t row) const { return row_meta_.Row(row) + 1; }
  int64_t table_step_ = 0;
  // The current change epoch, and the removals not yet checkpointed.
  uint32_t change_epoch_ = 1;
  std::vector<std::pair<int64_t, uint32_t>> removed_;
  // PrefaultAhead's range: rows [max(prefaulted_, next_row_), prefault_target_);
  // off for good once the kernel refuses (before Linux 5.14).
  int64_t prefault_target_ = 0;
  int64_t prefaulted_ = 0;
  bool prefault_works_ = true;
  // Reused by every push (ApplyGradients): the fresh rows' new state, and the
  // stored rows' state saved before their in-place update.
  ScratchArray<float> push_fresh_state_;
  ScratchArray<float> push_saved_state_;
  ScratchArray<uint32_t> push_saved_meta_;
  // Initial rows that lookups generated for ids the table does not store,
  // for the push that usually follows (never generate a row twice).
  // Lookup is const to its callers; the cache changes no result.
  mutable InitialRowCache initial_rows_;
  // The push begun by BeginPush and not finished or cancelled yet.
  std::unique_ptr<PushPlan> pending_push_;
  int64_t pending_table_step_ = 0;  // table_step_ before it
};

}  // namespace kvsparse

#endif  // KVSPARSE_TABLE_H_
