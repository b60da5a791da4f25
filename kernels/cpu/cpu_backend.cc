// The CPU statistics backend: the reference implementation, and fast.
//
// State is a SessionStatistics guarded by one mutex per (layer, role). A
// chunk is validated, then processed under its (layer, role) lock into the
// heads' statistics. The kernels walk the chunk in memory order (rows of
// head runs, run_kernels.h); a large chunk is split over the thread pool by
// rows (per-task partial histograms and tails, merged exactly at the end)
// or, when those partials would be large, by groups of heads. A chunk that
// arrived in pieces (ChunkView::pieces) is walked in place by one thread.
#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/run_kernels.h"
#include "kernels/cpu/run_kernels_internal.h"
#include "kernels/element_math.h"
#include "kernels/thread_pool.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

// A thread gets at least this many values of a chunk: below, the hand-off
// costs more than it saves.
constexpr uint64_t kMinValuesPerTask = 1 << 15;
// Rows are split over threads only while each task's partial histograms
// (heads x bins x 8 bytes) stay this small; beyond, heads are.
constexpr size_t kMaxPartialHistogramBytes = size_t{1} << 20;

// Turns a chunk that arrived in pieces into spans for one SpansFn call,
// reading the pieces in place, so that the spans' blocks are exactly those
// of the chunk read in one piece: every span starts at a block boundary of
// its run (kBlockValues, run_kernels_internal.h) and ends at one or at the
// run's end. A block cut by a piece boundary (and a value split between two
// pieces) is put together in a small buffer. The statistics then do not
// depend on where the receive buffers were cut.
class PieceWalker {
 public:
  PieceWalker(const ChunkExtent& extent, size_t element_size)
      : extent_(extent), element_size_(element_size) {}

  void Add(const std::vector<absl::Span<const std::byte>>& pieces) {
    for (const absl::Span<const std::byte>& piece : pieces) {
      const std::byte* p = piece.data();
      size_t left = piece.size();
      if (carried_ != 0) {
        const size_t take = std::min(left, element_size_ - carried_);
        std::memcpy(carry_ + carried_, p, take);
        carried_ += take;
        p += take;
        left -= take;
        if (carried_ < element_size_) continue;
        Range(carry_, 1);
        carried_ = 0;
      }
      const uint64_t whole = left / element_size_;
      Range(p, whole);
      p += whole * element_size_;
      left -= whole * element_size_;
      std::memcpy(carry_, p, left);
      carried_ = left;
    }
  }

  const std::vector<cpu::RowSpan>& spans() const { return spans_; }

 private:
  static constexpr uint64_t kBlock = cpu::internal::kBlockValues;

  // `count` contiguous values at p: the chunk's values [next_, next_ +
  // count).
  void Range(const std::byte* p, uint64_t count) {
    const uint64_t run = extent_.inner;
    const uint64_t row = extent_.heads * run;
    while (count > 0) {
      const uint64_t h = (next_ / run) % extent_.heads;
      const uint64_t i = next_ % run;
      const uint64_t block_begin = i - i % kBlock;
      const uint64_t block_end = std::min(block_begin + kBlock, run);
      uint64_t n = 0;
      if (i != block_begin || count < block_end - i) {
        // Part of a block: gathered until the block is complete.
        if (i == block_begin) pending_ = &blocks_.emplace_back();
        n = std::min(count, block_end - i);
        std::memcpy(pending_->data() + (i - block_begin) * element_size_, p,
                    n * element_size_);
        if (i + n == block_end) {
          spans_.push_back(
              {pending_->data(), 1, 0, h, 1, block_end - block_begin});
        }
      } else if (i != 0 || count < run) {
        // Whole blocks of one run (up to its end, or a block boundary).
        n = count >= run - i ? run - i : count - count % kBlock;
        spans_.push_back({p, 1, 0, h, 1, n});
      } else if (h != 0 || count < row) {
        const uint64_t runs =
            std::min<uint64_t>(extent_.heads - h, count / run);
        n = runs * run;
        spans_.push_back({p, 1, 0, h, runs, run});
      } else {
        const uint64_t rows = count / row;
        n = rows * row;
        spans_.push_back({p, rows, row, 0, extent_.heads, run});
      }
      p += n * element_size_;
      next_ += n;
      count -= n;
    }
  }

  const ChunkExtent extent_;
  const size_t element_size_;
  uint64_t next_ = 0;  // flat index of the next value
  std::vector<cpu::RowSpan> spans_;
  // Blocks put together from several pieces (stable addresses).
  std::deque<std::array<std::byte, kBlock * 4>> blocks_;
  std::array<std::byte, kBlock* 4>* pending_ = nullptr;
  std::byte carry_[8];
  size_t carried_ = 0;
};

// One task walks rows [row_begin, row_end) of heads [head_begin, head_end)
// of a chunk in memory order. A task that owns its heads' rows entirely (or
// is the first of a row split) counts straight into the heads' histograms
// and tails; the others of a row split count into their own, merged at the
// end.
struct ChunkTask {
  uint64_t row_begin = 0, row_end = 0;
  size_t head_begin = 0, head_end = 0;
  bool partial = false;
  std::vector<cpu::RunAccumulator> accs;
  std::vector<std::optional<cpu::TailKeeper>> tails;
  std::vector<uint64_t> histograms;  // heads x bins, when partial
};

class CpuBackend final : public StatisticsBackend {
 public:
  CpuBackend(const Geometry& geometry, const BackendOptions& options)
      : stats_(geometry),
        locks_(static_cast<size_t>(geometry.num_layers) * 3),
        // ThreadPool(0) means "hardware concurrency - 1" workers, so one
        // thread (cpu_threads == 1) must not construct a pool at all.
        pool_(options.cpu_threads > 1
                  ? std::make_unique<ThreadPool>(options.cpu_threads - 1)
                  : nullptr),
        single_thread_(options.cpu_threads == 1) {}

  absl::string_view name() const override { return "cpu"; }
  const Geometry& geometry() const override { return stats_.geometry(); }

  absl::Status Accumulate(const ChunkView& in) override {
    // f32 in pieces is gathered (one copy): its loops keep no state across
    // calls, so in place its sums would depend on where the pieces were cut.
    ChunkView gathered;
    // For overwrite: not zeroed first, as a std::vector's resize() would be.
    std::unique_ptr<std::byte[]> gathered_bytes;
    if (in.dtype == DType::kF32 && !in.pieces.empty()) {
      gathered = in;
      gathered.pieces.clear();
      const size_t size = in.byte_size();
      gathered_bytes = std::make_unique_for_overwrite<std::byte[]>(size);
      in.CopyBytes(0, size, gathered_bytes.get());
      gathered.data = absl::MakeConstSpan(gathered_bytes.get(), size);
    }
    const ChunkView& chunk = gathered_bytes == nullptr ? in : gathered;
    KVCAL_ASSIGN_OR_RETURN(ChunkExtent extent,
                           ValidateChunk(stats_.geometry(), chunk));
    if (extent.elements() == 0) return absl::OkStatus();

    std::lock_guard<std::mutex> lock(
        locks_[chunk.layer * 3 + static_cast<size_t>(RoleIndex(chunk.role))]);
    std::vector<ChunkTask> tasks = PrepareTasks(chunk, extent);
    RunTasks(chunk, extent, tasks);
    FoldTasks(chunk, extent, tasks);
    return absl::OkStatus();
  }

  absl::StatusOr<SessionStatistics> Snapshot() override {
    auto locks = LockAll();
    return stats_;
  }

  absl::Status Merge(const SessionStatistics& other) override {
    auto locks = LockAll();
    return stats_.Merge(other);
  }

  absl::Status Reset() override {
    auto locks = LockAll();
    stats_.Reset();
    return absl::OkStatus();
  }

  size_t StateBytes() const override {
    return EstimateStateBytes(stats_.geometry());
  }

  HeadStatistics& HeadOf(const ChunkView& chunk, size_t h) {
    return stats_.head(chunk.layer, chunk.role,
                       chunk.head_offset + static_cast<uint32_t>(h));
  }

  // The chunk's tasks (Plan; one task for a chunk in pieces, which one
  // thread walks piece by piece, in place), each with its accumulators wired
  // to the heads' histograms and tails (or, for a partial task, its own).
  std::vector<ChunkTask> PrepareTasks(const ChunkView& chunk,
                                      const ChunkExtent& extent) {
    const Geometry& g = stats_.geometry();
    const size_t bins = g.histogram_bins();
    std::vector<ChunkTask> tasks =
        chunk.pieces.empty() ? Plan(extent, bins) : std::vector<ChunkTask>(1);
    if (!chunk.pieces.empty()) {
      tasks[0].row_end = extent.outer;
      tasks[0].head_end = extent.heads;
    }
    for (ChunkTask& task : tasks) {
      const size_t n = task.head_end - task.head_begin;
      task.accs.resize(n);
      if (!g.has_histograms()) continue;
      task.tails.resize(n);
      if (task.partial) task.histograms.assign(n * bins, 0);
      for (size_t i = 0; i < n; ++i) {
        HeadStatistics& head = HeadOf(chunk, task.head_begin + i);
        cpu::RunAccumulator& acc = task.accs[i];
        task.tails[i].emplace(task.partial ? std::vector<float>() : head.tail);
        acc.histogram = task.partial ? task.histograms.data() + i * bins
                                     : head.histogram.data();
        acc.log2_bins_per_octave = g.log2_bins_per_octave();
        acc.tail = &*task.tails[i];
      }
    }
    return tasks;
  }

  // Runs the inner loops of every task (in parallel when there are several).
  void RunTasks(const ChunkView& chunk, const ChunkExtent& extent,
                std::vector<ChunkTask>& tasks) {
    if (!chunk.pieces.empty()) {
      PieceWalker walker(extent, DTypeSize(chunk.dtype));
      walker.Add(chunk.pieces);
      cpu::BestLoops(chunk.dtype)
          .spans(walker.spans().data(), walker.spans().size(), extent.heads,
                 tasks[0].accs.data());
      return;
    }
    const cpu::RowsFn rows_fn = cpu::BestLoops(chunk.dtype).rows;
    const size_t element_size = DTypeSize(chunk.dtype);
    const size_t row_stride = extent.heads * extent.inner;
    auto run = [&](ChunkTask& task) {
      rows_fn(chunk.data.data() + (task.row_begin * row_stride +
                                   task.head_begin * extent.inner) *
                                      element_size,
              task.row_end - task.row_begin, row_stride,
              task.head_end - task.head_begin, extent.inner, task.accs.data());
    };
    if (tasks.size() == 1) {
      run(tasks[0]);
    } else {
      ThreadPool& pool = pool_ ? *pool_ : ThreadPool::Shared();
      pool.ParallelFor(tasks.size(), [&](size_t t) { run(tasks[t]); });
    }
  }

  // Folds every task's sums into the heads' statistics, tasks in order.
  void FoldTasks(const ChunkView& chunk, const ChunkExtent& extent,
                 std::vector<ChunkTask>& tasks) {
    const bool histograms = stats_.geometry().has_histograms();
    const size_t bins = stats_.geometry().histogram_bins();
    std::vector<float> tail_values;
    for (size_t h = 0; h < extent.heads; ++h) {
      HeadStatistics& head = HeadOf(chunk, h);
      MinMax extrema;
      for (ChunkTask& task : tasks) {
        if (h < task.head_begin || h >= task.head_end) continue;
        const size_t i = h - task.head_begin;
        const cpu::RunAccumulator& acc = task.accs[i];
        head.finite_count += acc.finite;
        head.nan_count += acc.nan;
        head.inf_count += acc.inf;
        head.sum += acc.sum;
        head.sum_squares += acc.sum_squares;
        if (acc.finite > 0) extrema.Merge(MinMax{acc.min, acc.max});
        if (!histograms) continue;
        if (!task.partial) {
          task.tails[i]->StoreSortedDescending(&head.tail);
          continue;
        }
        const uint64_t* partial = task.histograms.data() + i * bins;
        for (size_t b = 0; b < bins; ++b) head.histogram[b] += partial[b];
        task.tails[i]->StoreSortedDescending(&tail_values);
        head.MergeTail(tail_values.data(), tail_values.size());
      }
      if (extrema.min <= extrema.max) {
        head.min = std::min(head.min, extrema.min);
        head.max = std::max(head.max, extrema.max);
        head.batches[chunk.batch].Merge(extrema);
      }
    }
  }

  // How a chunk is spread over threads. Small chunks, and one thread, get
  // one task. Otherwise, when the per-task partial histograms are small,
  // the rows are split (every task reads whole rows, in order; the first
  // task of the split counts straight into the statistics); else the heads
  // are split into groups (each task owns its heads).
  std::vector<ChunkTask> Plan(const ChunkExtent& extent, size_t bins) const {
    std::vector<ChunkTask> tasks;
    const size_t threads =
        single_thread_
            ? 1
            : static_cast<size_t>(
                  (pool_ ? *pool_ : ThreadPool::Shared()).workers()) +
                  1;
    const uint64_t max_tasks =
        std::min<uint64_t>(threads, extent.elements() / kMinValuesPerTask);
    const size_t partial_bytes = extent.heads * bins * sizeof(uint64_t);
    if (max_tasks >= 2 && extent.outer >= 2 &&
        partial_bytes <= kMaxPartialHistogramBytes) {
      const uint64_t n = std::min<uint64_t>(max_tasks, extent.outer);
      for (uint64_t t = 0; t < n; ++t) {
        ChunkTask& task = tasks.emplace_back();
        task.row_begin = extent.outer * t / n;
        task.row_end = extent.outer * (t + 1) / n;
        task.head_end = extent.heads;
        task.partial = t != 0;
      }
    } else if (max_tasks >= 2 && extent.heads >= 2) {
      const uint64_t n = std::min<uint64_t>(max_tasks, extent.heads);
      for (uint64_t t = 0; t < n; ++t) {
        ChunkTask& task = tasks.emplace_back();
        task.row_end = extent.outer;
        task.head_begin = static_cast<size_t>(extent.heads * t / n);
        task.head_end = static_cast<size_t>(extent.heads * (t + 1) / n);
      }
    } else {
      ChunkTask& task = tasks.emplace_back();
      task.row_end = extent.outer;
      task.head_end = extent.heads;
    }
    return tasks;
  }

 private:
  std::vector<std::unique_lock<std::mutex>> LockAll() {
    std::vector<std::unique_lock<std::mutex>> held;
    held.reserve(locks_.size());
    for (std::mutex& mu : locks_) held.emplace_back(mu);
    return held;
  }

  SessionStatistics stats_;
  std::vector<std::mutex> locks_;
  std::unique_ptr<ThreadPool> pool_;
  bool single_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateCpuBackend(
    const Geometry& geometry, const BackendOptions& options) {
  KVCAL_RETURN_IF_ERROR(geometry.Validate());
  return std::unique_ptr<StatisticsBackend>(
      std::make_unique<CpuBackend>(geometry, options));
}

}  // namespace kvcal
