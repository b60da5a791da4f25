// The statistics engine's backend interface: one per calibration session.
// Backends are made by the factory (kernels/backend_factory.h):
//
//   KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<kvcal::StatisticsBackend> backend,
//                          kvcal::CreateBackend(kvcal::BackendKind::kAuto, geometry));
//   KVCAL_RETURN_IF_ERROR(backend->Accumulate(chunk));   // many times
//   KVCAL_ASSIGN_OR_RETURN(kvcal::SessionStatistics stats, backend->Snapshot());
//   KVCAL_ASSIGN_OR_RETURN(kvcal::ScaleResult scales,
//                          kvcal::ComputeScales(stats, options));
//
// Accumulate validates the chunk first (ValidateChunk); an invalid chunk
// changes nothing. A valid chunk is applied whole. Backends are thread-safe:
// several streams may accumulate into one backend concurrently.
#ifndef KVCAL_KERNELS_BACKEND_H_
#define KVCAL_KERNELS_BACKEND_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/device_health.h"
#include "kernels/nonfinite.h"
#include "kernels/statistics.h"
#include "kernels/types.h"

// cudaEvent_t is `CUevent_st*`; declared here so that this header needs no
// CUDA headers.
struct CUevent_st;

namespace kvcal {

// What a backend whose statistics live in device memory accepts besides host
// chunks: chunks already in its device's memory (a producer's CUDA IPC
// region). StatisticsBackend::device_data() hands it out; the service asks
// for the capability, never for a backend by name.
class DeviceDataSink {
 public:
  virtual ~DeviceDataSink() = default;

  // Like Accumulate, but chunk.data points to memory of this backend's
  // device; nothing is copied, and the memory must stay valid and unchanged
  // until Synchronize() or Snapshot() returns. `ready`: an event the producer
  // recorded after writing the data (null: the data is complete). Each
  // refusal (chunk, alignment, memory not of this device) is
  // INVALID_ARGUMENT with nothing applied.
  [[nodiscard]] virtual absl::Status AccumulateDeviceData(
      const ChunkView& chunk, CUevent_st* ready) = 0;

  // The NaN and Inf values per head of such a chunk, counted before anything
  // of it is applied (for sessions that refuse non-finite values). Changes
  // no state.
  [[nodiscard]] virtual absl::StatusOr<ChunkNonFinite> CountNonFiniteDeviceData(
      const ChunkView& chunk) = 0;

  // Waits until everything enqueued has finished; the first device error.
  [[nodiscard]] virtual absl::Status Synchronize() = 0;
};

class StatisticsBackend {
 public:
  virtual ~StatisticsBackend() = default;

  // "cpu" or "cuda".
  virtual absl::string_view name() const = 0;
  virtual const Geometry& geometry() const = 0;

  // Validates and adds one chunk. The CUDA backend may return before the
  // device finished; a device error then surfaces from a later call.
  [[nodiscard]] virtual absl::Status Accumulate(const ChunkView& chunk) = 0;

  // A host copy of everything accumulated so far (waits for the device).
  [[nodiscard]] virtual absl::StatusOr<SessionStatistics> Snapshot() = 0;

  // Adds `other` (same geometry, else InvalidArgument and nothing changes).
  [[nodiscard]] virtual absl::Status Merge(const SessionStatistics& other) = 0;

  // Forgets everything accumulated.
  [[nodiscard]] virtual absl::Status Reset() = 0;

  // Bytes of state memory this backend holds (device memory for CUDA).
  virtual size_t StateBytes() const = 0;

  // Device-resident chunks, for a backend that keeps its state on a device
  // (the CUDA backend); null for one that does not (the CPU backend).
  virtual DeviceDataSink* device_data() { return nullptr; }
};

enum class BackendKind { kAuto, kCpu, kCuda };

struct BackendOptions {
  // CUDA device ordinal.
  int device = 0;
  // CPU backend: worker threads for large chunks (0 = hardware concurrency).
  int cpu_threads = 0;
};

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateCpuBackend(
    const Geometry& geometry, const BackendOptions& options = {});

}  // namespace kvcal

#endif  // KVCAL_KERNELS_BACKEND_H_
