// The CPU statistics backend: the reference implementation, and fast.
//
// State is a SessionStatistics guarded by one mutex per (layer, role). A
// chunk is validated, then processed under its (layer, role) lock straight
// into the heads' statistics; heads of a large chunk are spread over the
// shared thread pool (each head is touched by one thread only).
#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/run_kernels.h"
#include "kernels/element_math.h"
#include "kernels/status_macros.h"
#include "kernels/thread_pool.h"

namespace kvcal {
namespace {

// Below this many values per chunk the thread hand-off costs more than it
// saves.
constexpr uint64_t kParallelThreshold = 1 << 16;

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

  absl::Status Accumulate(const ChunkView& chunk) override {
    KVCAL_ASSIGN_OR_RETURN(ChunkExtent extent,
                           ValidateChunk(stats_.geometry(), chunk));
    if (extent.elements() == 0) return absl::OkStatus();
    const cpu::RunFn run = cpu::BestRunFn(chunk.dtype);
    const size_t element_size = DTypeSize(chunk.dtype);
    const Geometry& g = stats_.geometry();
    const uint32_t log2_bins = g.log2_bins_per_octave();
    const bool histograms = g.has_histograms();

    // One head's running sums for this chunk, folded into its statistics
    // once at the end.
    struct HeadWork {
      std::optional<cpu::TailKeeper> tail;
      cpu::RunAccumulator acc;
    };
    auto begin_head = [&](size_t h, HeadWork& work) {
      if (!histograms) return;
      HeadStatistics& head =
          stats_.head(chunk.layer, chunk.role,
                      chunk.head_offset + static_cast<uint32_t>(h));
      work.tail.emplace(head.tail);
      work.acc.histogram = head.histogram.data();
      work.acc.log2_bins_per_octave = log2_bins;
      work.acc.tail = &*work.tail;
    };
    // Element (o, h, i) sits at (o * heads + h) * inner + i: one run of
    // `inner` values per outer index, `heads * inner` elements apart.
    auto run_rows = [&](size_t h, uint64_t first, uint64_t count,
                        HeadWork& work) {
      run(chunk.data.data() +
              ((first * extent.heads + h) * extent.inner) * element_size,
          count, extent.inner, extent.heads * extent.inner, work.acc);
    };
    auto finish_head = [&](size_t h, HeadWork& work) {
      HeadStatistics& head =
          stats_.head(chunk.layer, chunk.role,
                      chunk.head_offset + static_cast<uint32_t>(h));
      const cpu::RunAccumulator& acc = work.acc;
      head.finite_count += acc.finite;
      head.nan_count += acc.nan;
      head.inf_count += acc.inf;
      head.sum += acc.sum;
      head.sum_squares += acc.sum_squares;
      if (acc.finite > 0) {
        head.min = std::min(head.min, acc.min);
        head.max = std::max(head.max, acc.max);
        head.batches[chunk.batch].Merge(MinMax{acc.min, acc.max});
      }
      if (work.tail) work.tail->StoreSortedDescending(&head.tail);
    };

    std::lock_guard<std::mutex> lock(
        locks_[chunk.layer * 3 + static_cast<size_t>(RoleIndex(chunk.role))]);
    if (!single_thread_ && extent.heads > 1 &&
        extent.elements() >= kParallelThreshold) {
      // Heads over threads; each head is touched by one thread only.
      ThreadPool& pool = pool_ ? *pool_ : ThreadPool::Shared();
      pool.ParallelFor(extent.heads, [&](size_t h) {
        HeadWork work;
        begin_head(h, work);
        run_rows(h, 0, extent.outer, work);
        finish_head(h, work);
      });
    } else {
      // One call per head covers all its rows: the kernel prefetches the
      // strided runs and the sub-histograms are flushed once per head.
      // (Walking the chunk in blocks of rows, all heads per block, was no
      // faster with the prefetch and made every call flush its histogram.)
      for (size_t h = 0; h < extent.heads; ++h) {
        HeadWork work;
        begin_head(h, work);
        run_rows(h, 0, extent.outer, work);
        finish_head(h, work);
      }
    }
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

size_t EstimateStateBytes(const Geometry& geometry) {
  const size_t per_head =
      sizeof(HeadStatistics) +
      static_cast<size_t>(geometry.histogram_bins()) * sizeof(uint64_t) +
      (geometry.has_histograms() ? kTailCapacity * sizeof(float) : 0);
  return per_head * geometry.total_heads();
}

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateCpuBackend(
    const Geometry& geometry, const BackendOptions& options) {
  KVCAL_RETURN_IF_ERROR(geometry.Validate());
  return std::unique_ptr<StatisticsBackend>(
      std::make_unique<CpuBackend>(geometry, options));
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view text) {
  if (text == "auto") return BackendKind::kAuto;
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", text, "': use auto, cpu or cuda"));
}

}  // namespace kvcal
