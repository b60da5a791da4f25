#include "kernels/local_statistics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/backend_factory.h"
#include "kernels/nonfinite.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

// "layer 3 K, batch 7": what a chunk is, for messages (the worker names the
// chunk's sequence and producer instead; a local chunk has neither).
std::string Describe(const ChunkView& chunk) {
  const uint32_t role = static_cast<uint32_t>(chunk.role);
  return absl::StrCat("layer ", chunk.layer, " ",
                      role >= 1 && role <= 3 ? RoleName(chunk.role)
                                             : absl::StrCat("role ", role),
                      ", batch ", chunk.batch);
}

absl::Status Prefixed(const absl::Status& status, const ChunkView& chunk) {
  return absl::Status(status.code(),
                      absl::StrCat(Describe(chunk), ": ", status.message()));
}

}  // namespace

LocalStatistics::LocalStatistics(const Geometry& geometry,
                                 bool reject_non_finite,
                                 std::unique_ptr<StatisticsBackend> backend)
    : geometry_(geometry),
      reject_non_finite_(reject_non_finite),
      backend_(std::move(backend)) {}

absl::StatusOr<std::unique_ptr<LocalStatistics>> LocalStatistics::Create(
    const Geometry& geometry, const LocalStatisticsOptions& options) {
  KVCAL_RETURN_IF_ERROR(geometry.Validate());
  KVCAL_ASSIGN_OR_RETURN(
      std::unique_ptr<StatisticsBackend> backend,
      CreateBackend(options.backend, geometry, options.backend_options));
  return std::unique_ptr<LocalStatistics>(new LocalStatistics(
      geometry, options.reject_non_finite, std::move(backend)));
}

absl::StatusOr<ChunkExtent> LocalStatistics::Check(const ChunkView& chunk,
                                                   bool device) {
  absl::StatusOr<ChunkExtent> extent = ValidateChunk(geometry_, chunk);
  if (!extent.ok()) return Prefixed(extent.status(), chunk);
  if (!reject_non_finite_) return extent;
  absl::StatusOr<ChunkNonFinite> found =
      device ? backend_->device_data()->CountNonFiniteDeviceData(chunk)
             : absl::StatusOr<ChunkNonFinite>(CountNonFinite(chunk, *extent));
  if (!found.ok()) return Prefixed(found.status(), chunk);
  if (found->total() == 0) return extent;
  // The worker's words (service/session.cc CheckFinite).
  return absl::InvalidArgumentError(
      absl::StrCat(Describe(chunk), ": ", DescribeNonFinite(chunk, *found),
                   "; the session rejects non-finite values (created with "
                   "reject_non_finite), so nothing of the chunk was applied"));
}

void LocalStatistics::Count(const ChunkView& chunk, const ChunkExtent& extent) {
  chunks_applied_.fetch_add(1, std::memory_order_relaxed);
  values_ingested_.fetch_add(extent.elements(), std::memory_order_relaxed);
  bytes_ingested_.fetch_add(chunk.byte_size(), std::memory_order_relaxed);
}

absl::Status LocalStatistics::Accumulate(const ChunkView& chunk) {
  KVCAL_ASSIGN_OR_RETURN(const ChunkExtent extent, Check(chunk, false));
  if (absl::Status s = backend_->Accumulate(chunk); !s.ok()) {
    return Prefixed(s, chunk);
  }
  Count(chunk, extent);
  return absl::OkStatus();
}

absl::Status LocalStatistics::AccumulateDeviceData(const ChunkView& chunk,
                                                   CUevent_st* ready) {
  DeviceDataSink* const device = backend_->device_data();
  if (device == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        Describe(chunk),
        ": its data is in device memory but these "
        "statistics are on the ",
        backend_->name(), " backend (create them with backend 'cuda')"));
  }
  KVCAL_ASSIGN_OR_RETURN(const ChunkExtent extent, Check(chunk, true));
  if (absl::Status s = device->AccumulateDeviceData(chunk, ready); !s.ok()) {
    return Prefixed(s, chunk);
  }
  if (absl::Status s = device->Synchronize(); !s.ok()) {
    return Prefixed(s, chunk);
  }
  Count(chunk, extent);
  return absl::OkStatus();
}

absl::StatusOr<SessionStatistics> LocalStatistics::Snapshot() {
  return backend_->Snapshot();
}

absl::StatusOr<std::string> LocalStatistics::SerializedStatistics() {
  KVCAL_ASSIGN_OR_RETURN(const SessionStatistics stats, backend_->Snapshot());
  return stats.Serialize();
}

LocalCounters LocalStatistics::counters() const {
  return LocalCounters{chunks_applied_.load(), values_ingested_.load(),
                       bytes_ingested_.load()};
}

absl::Status LocalStatistics::Reset() {
  KVCAL_RETURN_IF_ERROR(backend_->Reset());
  chunks_applied_ = 0;
  values_ingested_ = 0;
  bytes_ingested_ = 0;
  return absl::OkStatus();
}

}  // namespace kvcal
