// The statistics engine as a producer runs it: one backend, the geometry and
// non-finite rule of a worker's session, and the checks the worker's ingest
// applies to each chunk, so that what it accumulates is what the worker
// would have accumulated from the same chunks (the Python extension
// kvcal._engine wraps it; python/ext/).
//
//   KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<kvcal::LocalStatistics> local,
//                          kvcal::LocalStatistics::Create(geometry, {}));
//   KVCAL_RETURN_IF_ERROR(local->Accumulate(chunk));    // many times
//   KVCAL_ASSIGN_OR_RETURN(std::string bytes, local->SerializedStatistics());
//   // bytes: SessionStatistics::Serialize(), what a worker's ExportState
//   // carries in SessionState.statistics and ImportState merges.
//
// Accumulate, as the worker's Session::Ingest does for a chunk it applies:
// ValidateChunk, then with reject_non_finite a count of NaN and Inf values
// (refused, naming each head, before anything is applied), then the
// backend. A refused chunk changes nothing, counters included. There are no
// sequences here: exactly-once delivery of what is accumulated is the
// caller's (docs/local-statistics.md).
//
// Thread-safe: several threads may accumulate at once.
#ifndef KVCAL_KERNELS_LOCAL_STATISTICS_H_
#define KVCAL_KERNELS_LOCAL_STATISTICS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/statistics.h"
#include "kernels/types.h"

namespace kvcal {

struct LocalStatisticsOptions {
  // CreateSession's reject_non_finite: a chunk holding NaN or Inf is
  // refused (InvalidArgument) instead of counted.
  bool reject_non_finite = false;
  BackendKind backend = BackendKind::kCpu;
  BackendOptions backend_options;
};

// What the worker's session counters would say for the same chunks.
struct LocalCounters {
  uint64_t chunks_applied = 0;
  uint64_t values_ingested = 0;
  uint64_t bytes_ingested = 0;
};

class LocalStatistics {
 public:
  static absl::StatusOr<std::unique_ptr<LocalStatistics>> Create(
      const Geometry& geometry, const LocalStatisticsOptions& options);

  const Geometry& geometry() const { return geometry_; }
  bool reject_non_finite() const { return reject_non_finite_; }
  // "cpu" or "cuda".
  absl::string_view backend_name() const { return backend_->name(); }
  // True when the backend takes chunks in its device's memory
  // (AccumulateDeviceData).
  bool accepts_device_data() const {
    return backend_->device_data() != nullptr;
  }

  // One chunk in host memory (chunk.data; pieces are accepted too).
  // InvalidArgument naming what was wrong, nothing applied.
  [[nodiscard]] absl::Status Accumulate(const ChunkView& chunk);

  // One chunk in memory of the CUDA backend's device, read in place after
  // `ready` (an event recorded on the producer's stream after the data was
  // written; null: the data is complete). Finished on the device before
  // this returns, so the caller may reuse the memory. FailedPrecondition on
  // a backend without device data (the CPU backend); the backend's own
  // refusals (alignment, memory not of its device) are InvalidArgument with
  // nothing applied.
  [[nodiscard]] absl::Status AccumulateDeviceData(const ChunkView& chunk,
                                                  CUevent_st* ready);

  // Everything accumulated (waits for the device).
  [[nodiscard]] absl::StatusOr<SessionStatistics> Snapshot();
  // Snapshot().Serialize(): SessionState.statistics.
  [[nodiscard]] absl::StatusOr<std::string> SerializedStatistics();

  LocalCounters counters() const;

  // Forgets everything accumulated (after a flush of the state elsewhere).
  [[nodiscard]] absl::Status Reset();

 private:
  LocalStatistics(const Geometry& geometry, bool reject_non_finite,
                  std::unique_ptr<StatisticsBackend> backend);
  // ValidateChunk and, with reject_non_finite, the non-finite count; the
  // message prefixed with what the chunk is.
  absl::StatusOr<ChunkExtent> Check(const ChunkView& chunk, bool device);
  void Count(const ChunkView& chunk, const ChunkExtent& extent);

  const Geometry geometry_;
  const bool reject_non_finite_;
  std::unique_ptr<StatisticsBackend> backend_;
  std::atomic<uint64_t> chunks_applied_{0};
  std::atomic<uint64_t> values_ingested_{0};
  std::atomic<uint64_t> bytes_ingested_{0};
};

}  // namespace kvcal

#endif  // KVCAL_KERNELS_LOCAL_STATISTICS_H_
