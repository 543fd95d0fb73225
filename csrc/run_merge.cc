// RunStore: merges (run_store.h, "Merges keep the runs few").
//
// A merge of some runs (PickMerge) writes one output run placed just after the
// newest of them, one output fragment per step. A step copies the live
// records of the fragment's hash range from every input, marks them dead
// there and frees the input fragments it has passed; lookups go newest run
// first, so at every moment each key is found in the output (range merged)
// or in its input (range not yet merged), and the RAM added is one fragment's.
// A step that fails (a full disk) leaves everything as it was before it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "crc32c.h"
#include "file_io.h"
#include "run_store_internal.h"

namespace kvsparse {
namespace run_store {

namespace {

constexpr int64_t kMaxRuns = 24;
// A merge takes at most this many runs of one size (more at once: fewer rewrites).
constexpr int64_t kMaxMergeWidth = 8;
// Runs under this many bytes are all alike: cheap to rewrite, and their sizes
// (what one eviction or one rows-out to make room wrote) vary the most.
constexpr int64_t kSmallRunBytes = 1 << 20;

}  // namespace

bool RunStore::PickMerge() {
  // Runs with nothing live go at once: no I/O.
  for (size_t i = 0; i < runs_.size();) {
    if (runs_[i]->live == 0 && !runs_[i]->building) {
      DropRun(runs_[i].get());
      runs_.erase(runs_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
  const int64_t m = static_cast<int64_t>(runs_.size());
  if (m == 0) return false;
  const int64_t fan_in = options_.merge_fan_in;
  // Size-tiered, by buckets of similar size, not by age: the runs sorted by
  // live records, a bucket is the runs at most twice its smallest (runs under
  // kSmallRunBytes count as that size), and the smallest bucket with fan_in
  // runs merges (up to kMaxMergeWidth of them, the smallest). Each merge
  // multiplies a record's run size by fan_in or more: a record is rewritten
  // about log_fan_in(table / one write) times.
  //
  // Runs need not be adjacent in age: the output goes where the newest input
  // was. A key live in an input is in no newer run (its live copy is in the
  // newest run holding any copy), so no run between the inputs holds it, and
  // its dead copies stay older than the output. (The size classes this
  // replaced, fixed powers of fan_in among runs adjacent by age, broke down
  // when writes hovered at a class boundary, as 16,384-row pushes do at 4^7:
  // runs of two classes alternated, none lined up, and past kMaxRuns a merge
  // took any 4 in a row. A 1 GiB fill wrote 35 bytes per byte of rows.)
  std::vector<int64_t> by_size(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) by_size[i] = i;
  std::stable_sort(by_size.begin(), by_size.end(), [&](int64_t a, int64_t b) {
    return runs_[a]->live < runs_[b]->live;
  });
  // (PickMerge runs only with no merge in progress: no run is being built.)
  const int64_t small_records = std::max<int64_t>(1, kSmallRunBytes / EntryBytes());
  std::vector<int64_t> chosen;
  for (int64_t begin = 0; begin < m && chosen.empty();) {
    const int64_t base = std::max(runs_[by_size[begin]]->live, small_records);
    int64_t end = begin;
    while (end < m && runs_[by_size[end]]->live <= 2 * base) ++end;
    if (end - begin >= fan_in) {
      chosen.assign(by_size.begin() + begin,
                    by_size.begin() + std::min(end, begin + kMaxMergeWidth));
    }
    begin = end;
  }
  // Too many runs (sizes that never line up): the fan_in smallest.
  if (chosen.empty() && m > kMaxRuns) {
    chosen.assign(by_size.begin(), by_size.begin() + std::min<int64_t>(m, fan_in));
  }
  // A run mostly dead (rows taken back into memory) is rewritten alone: its
  // index costs RAM per record written, live or not.
  if (chosen.empty()) {
    int64_t most_dead = 0;
    for (int64_t i = 0; i < m; ++i) {
      const Run& run = *runs_[i];
      const int64_t dead = run.records - run.live;
      if (run.records >= 4 * records_per_page_ && 2 * run.live < run.records &&
          dead > most_dead) {
        most_dead = dead;
        chosen.assign(1, i);
      }
    }
  }
  if (chosen.empty()) return false;
  std::sort(chosen.begin(), chosen.end());  // oldest first
  const int64_t last = chosen.back();
  std::unique_ptr<Run> output(new Run());
  if (!CreateRunFile(output.get()).ok()) return false;  // tried again at the next call
  int64_t live = 0;
  std::unique_ptr<Merge> merge(new Merge());
  for (int64_t i : chosen) {
    live += runs_[i]->live;
    MergeInput input;
    input.run = runs_[i].get();
    merge->inputs.push_back(input);
  }
  merge->live = live;
  output->fragment_bits = FragmentBitsFor(live);
  merge->bloom_bits = BloomBitsFor(live, LiveRecords());
  output->fragments.resize(size_t{1} << output->fragment_bits);
  output->building = true;
  merge->output = output.get();
  runs_.insert(runs_.begin() + last + 1, std::move(output));
  merge_ = std::move(merge);
  return true;
}

Status RunStore::MergeFragment(int64_t* moved) {
  Merge& merge = *merge_;
  Run& output = *merge.output;
  const int64_t g = merge.next_fragment;
  const bool last_fragment = g + 1 == static_cast<int64_t>(output.fragments.size());
  const uint64_t end = last_fragment ? 0 : output.FragmentBegin(g + 1);
  auto before_end = [&](uint64_t hash) { return last_fragment || hash < end; };
  const int64_t entry_bytes = EntryBytes();

  // Stage the range's live records of every input: (hash, offset in staged).
  std::vector<std::pair<uint64_t, int64_t>> order;
  std::vector<uint8_t> staged;
  struct Copied {
    Fragment* fragment;
    int64_t bit;
  };
  std::vector<Copied> copied;
  std::vector<MergeInput> positions = merge.inputs;  // moved on only if the step succeeds
  std::vector<Fragment*> passed;                     // input fragments wholly merged
  // Sized once for the fragment's share of the records (growing them as they
  // filled cost page faults on fresh memory: ~10% of a fill's CPU), and the
  // I/O buffer left unset (pages are read into it or zeroed as built).
  const int64_t expected =
      merge.live / static_cast<int64_t>(output.fragments.size()) * 9 / 8 + records_per_page_;
  order.reserve(static_cast<size_t>(expected));
  staged.reserve(static_cast<size_t>(expected * entry_bytes));
  copied.reserve(static_cast<size_t>(expected));
  std::unique_ptr<uint8_t[]> io(new uint8_t[static_cast<size_t>(StreamPages() * page_bytes_)]);
  uint8_t* const buffer = io.get();
  int64_t bytes_read = 0;
  for (MergeInput& input : positions) {
    const Run& run = *input.run;
    bool done = false;
    while (!done && input.fragment < static_cast<int64_t>(run.fragments.size())) {
      Fragment& fragment = input.run->fragments[input.fragment];
      if (input.page >= fragment.pages) {
        if (fragment.pages > 0) passed.push_back(&fragment);
        ++input.fragment;
        input.page = input.entry = 0;
        continue;
      }
      if (!before_end(run.FragmentBegin(input.fragment)) && input.page == 0 && input.entry == 0) {
        break;  // this input's next fragment starts past the range
      }
      const int64_t chunk = std::min<int64_t>(StreamPages(), fragment.pages - input.page);
      const int64_t first = fragment.first_page + input.page;
      int64_t got = 0;
      const int error =
          ReadAll(run.fd, buffer, chunk * page_bytes_, PageOffset(first), &got);
      if (error != 0) return IoError("reading run file", PathOf(run), error);
      bytes_read += got;
      if (got != chunk * page_bytes_) {
        return CorruptPage(run, first + got / page_bytes_, "the file ends inside it");
      }
      for (int64_t p = 0; p < chunk && !done; ++p) {
        const uint8_t* page = buffer + p * page_bytes_;
        if (Status s = CheckPage(run, first + p, page); !s.ok()) {
          return Status(s.code(), s.message() + " (it says it holds " + PageKeys(page) + ")");
        }
        uint32_t count;
        std::memcpy(&count, page + 4, 4);
        for (; input.entry < count; ++input.entry) {
          const uint8_t* at = page + kPageHeaderBytes + input.entry * entry_bytes;
          int64_t key;
          std::memcpy(&key, at, 8);
          const uint64_t hash = KeyHash(key);
          if (!before_end(hash)) {
            done = true;
            break;
          }
          const int64_t bit = input.page * records_per_page_ + input.entry;
          if (!fragment.Live(bit)) continue;
          order.push_back({hash, static_cast<int64_t>(staged.size())});
          staged.insert(staged.end(), at, at + entry_bytes);
          copied.push_back({&fragment, bit});
        }
        if (!done) {
          ++input.page;
          input.entry = 0;
        }
      }
    }
  }

  // Write the output fragment.
  std::sort(order.begin(), order.end());
  Fragment built;
  const int64_t count = static_cast<int64_t>(order.size());
  built.first_page = output.pages;
  int64_t bytes_written = 0;
  if (count > 0) {
    built.records = built.live = count;
    built.pages = (count + records_per_page_ - 1) / records_per_page_;
    built.page_hash.resize(static_cast<size_t>(built.pages));
    built.bloom.assign(static_cast<size_t>(Bloom::Words(count, merge_->bloom_bits)), 0);
    built.live_bits.assign(static_cast<size_t>((built.pages * records_per_page_ + 63) / 64), 0);
    int64_t buffered = 0, flushed = 0;
    for (int64_t p = 0; p < built.pages; ++p) {
      uint8_t* page = buffer + buffered * page_bytes_;
      std::memset(page, 0, static_cast<size_t>(page_bytes_));
      const int64_t from = p * records_per_page_;
      const int64_t to = std::min(count, from + records_per_page_);
      const uint32_t in_page = static_cast<uint32_t>(to - from);
      std::memcpy(page + 4, &in_page, 4);
      built.page_hash[p] = order[from].first;
      for (int64_t j = from; j < to; ++j) {
        std::memcpy(page + kPageHeaderBytes + (j - from) * entry_bytes,
                    staged.data() + order[j].second, static_cast<size_t>(entry_bytes));
        Bloom::Add(&built.bloom, order[j].first);
        const int64_t bit = p * records_per_page_ + (j - from);
        built.live_bits[bit >> 6] |= uint64_t{1} << (bit & 63);
      }
      const uint32_t crc = Crc32c(page + 4, static_cast<size_t>(page_bytes_ - 4));
      std::memcpy(page, &crc, 4);
      if (++buffered == StreamPages() || p + 1 == built.pages) {
        const int error = WriteAll(output.fd, buffer, buffered * page_bytes_,
                                   PageOffset(built.first_page + flushed));
        if (error != 0) return IoError("writing run file", PathOf(output), error);
        bytes_written += buffered * page_bytes_;
        flushed += buffered;
        buffered = 0;
      }
    }
  }

  // Commit: the output fragment in, the copied records dead in the inputs,
  // the passed input fragments freed.
  output.fragments[g] = std::move(built);
  output.pages += output.fragments[g].pages;
  output.records += count;
  output.live += count;
  output.synced = false;
  for (const Copied& copy : copied) copy.fragment->SetDead(copy.bit);
  // Live counts: each copied record leaves its input fragment and run.
  for (const Copied& copy : copied) --copy.fragment->live;
  for (MergeInput& input : positions) {
    int64_t live = 0, records = 0;
    // The passed fragments' pages go back to the file system now, not when the
    // merge ends: a merge of the largest runs would otherwise hold its inputs and
    // its output on disk at once (twice the store). Only while no checkpoint links
    // the file (its pages are the checkpoint's too); best effort.
    struct stat file {};
    const bool punch = ::fstat(input.run->fd, &file) == 0 && file.st_nlink == 1;
    for (Fragment& fragment : input.run->fragments) {
      for (Fragment* gone : passed) {
        if (gone != &fragment) continue;
        if (punch) {
          (void)::fallocate(input.run->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                            PageOffset(fragment.first_page), fragment.pages * page_bytes_);
        }
        fragment.Free();
      }
      live += fragment.live;
      records += fragment.records;
    }
    input.run->live = live;
    input.run->records = records;
  }
  merge.inputs = positions;
  merge.next_fragment = g + 1;
  stats_.bytes_read += bytes_read;
  stats_.bytes_written += bytes_written;
  stats_.gc_bytes_moved += bytes_read + bytes_written;
  stats_.gc_records_moved += count;
  *moved = std::max<int64_t>(1, bytes_read + bytes_written);
  return Status::Ok();
}

void RunStore::FinishMerge() {
  Merge& merge = *merge_;
  merge.output->building = false;
  for (const MergeInput& input : merge.inputs) {
    for (size_t i = 0; i < runs_.size(); ++i) {
      if (runs_[i].get() == input.run) {
        DropRun(runs_[i].get());
        runs_.erase(runs_.begin() + static_cast<long>(i));
        ++stats_.gc_segments_freed;
        break;
      }
    }
  }
  merge_.reset();
}

}  // namespace run_store
}  // namespace kvsparse
