// EmbeddingTable: the push transaction. A push plans and computes aside, updates its
// stored rows in place (each saved first), then commits or puts every row back: a push
// that fails changes nothing (table.h, BeginPush).
#include "table.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "batch.h"
#include "half.h"
#include "parallel.h"
#include "table_internal.h"
#include "table_tier.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvsparse {

using table_internal::kMinKeysPerThread;
using table_internal::kMinInitFloatsPerThread;
using table_internal::kMaxRowStateFloats;
using table_internal::RowsPerChunkLog2;
using table_internal::KeyText;
using table_internal::StorageName;

Status EmbeddingTable::ApplyGradients(const int64_t* keys, int64_t n, const float* grads,
                                      NonFinitePolicy policy, int64_t* applied) {
  *applied = 0;
  if (pending_push_ != nullptr) {
    return Status(StatusCode::kInvalidArgument, "a push of this table is begun and not finished");
  }
  // Three steps, so that a push that fails changes nothing: (1) plan and
  // compute what can be computed aside, and allocate everything the commit
  // needs; (2) update the stored rows in place, each saved first, checking
  // every result; (3) commit, which cannot fail but for the candidates' map,
  // which it puts back on failure. The scope settles after any of them (a
  // refused push grew its scratch too).
  TierScope scope(this);
  Status s = scope.Prepare(keys, n, /*insert=*/true);
  if (!s.ok()) return s;
  PushPlan plan;
  const int64_t saved_table_step = table_step_;
  s = BeginPlan(keys, n, grads, policy, &plan);
  if (s.ok()) s = FinishPlan(plan, saved_table_step, applied);
  return s;
}

Status EmbeddingTable::BeginPush(const int64_t* keys, int64_t n, const float* grads,
                                 NonFinitePolicy policy) {
  if (pending_push_ != nullptr) {
    return Status(StatusCode::kInvalidArgument, "a push of this table is begun and not finished");
  }
  // Settles if the push fails; once it is begun, FinishPush or CancelPush does.
  TierScope scope(this);
  Status prepared = scope.Prepare(keys, n, /*insert=*/true);
  if (!prepared.ok()) return prepared;
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
  TierScope scope(this);
  std::unique_ptr<PushPlan> plan = std::move(pending_push_);
  return FinishPlan(*plan, pending_table_step_, applied);
}

void EmbeddingTable::CancelPush() {
  if (pending_push_ == nullptr) return;
  TierScope scope(this);
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
    policy_.CountCandidates(plan.unique.data(), plan, static_cast<uint32_t>(table_step_));
  } catch (const std::bad_alloc&) {
    RestoreExistingRows(plan);
    table_step_ = saved_table_step;
    return Status(StatusCode::kOutOfMemory, "out of memory counting candidates (nothing applied)");
  }
  // Nothing below allocates: PreparePush sized the map, the row arrays, the
  // free list and the removal log.
  if (!plan.victims.empty()) {
    policy_.stats().evicted_capacity +=
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
    index_.PrefetchInsert(plan.fresh_keys[k]);
  }
  for (int64_t k = 0; k < fresh; ++k) {
    if (k + kKeysAhead < fresh) {
      index_.PrefetchInsert(plan.fresh_keys[k + kKeysAhead]);
    }
    // Its slots are written below: not initialized first.
    const int64_t row = InsertReservedRow(plan.fresh_keys[k], /*init_slots=*/false);
    const float* state = plan.fresh_state + k * stride;
    values_.Write(row, state);  // rounded already (ComputeFreshRows): exact
    slots_.Write(row, state + dim);
    if (has_master()) {
      std::memcpy(master_.Row(row), state + dim + slot_floats, sizeof(float) * dim);
    }
    policy_.TouchRow(row, table_step_);
    *StepOf(row) = 1;
  }
  if (fresh > 0) {
    const int64_t chunk_rows = int64_t{1} << RowsPerChunkLog2(dim);
    prefault_target_ = std::min(next_row_ + 2 * fresh, next_row_ + chunk_rows);
  }
  int64_t updated = 0;
  for (const uint8_t overflowed : plan.overflows) updated += !overflowed;
  policy_.stats().admissions += fresh;
  policy_.stats().rejected += static_cast<int64_t>(plan.rejected.size());
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
  index_.FindRows(p.unique.data(), u, p.rows.data());
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
  Status s = index_.Reserve(index_.size() + fresh);
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
  policy_.PrefetchRow(row);
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
  // them.
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
      policy_.SaveRow(row, meta + 2);  // touches, last step
      policy_.TouchRow(row, table_step_);
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
  policy_.RestoreRow(row, meta + 2);
}

void EmbeddingTable::RestoreExistingRows(const PushPlan& p) {
  const int64_t stride = RowStateFloats();
  for (size_t e = 0; e < p.existing.size(); ++e) {
    if (p.overflows[e]) continue;  // put back already
    RestoreRow(p.rows[p.existing[e]], p.saved_state + e * stride, p.saved_meta + e * 4);
  }
}

}  // namespace kvsparse
