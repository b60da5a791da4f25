// The CUDA statistics backend. This header has no CUDA types, so the rest of
// the tree compiles without nvcc; in a build without CUDA the functions below
// report that the backend is absent.
//
//   if (kvcal::CudaDeviceCount() > 0) {
//     KVCAL_ASSIGN_OR_RETURN(auto backend,
//                            kvcal::CreateCudaBackend(geometry, {.device = 0}));
//   }
//
// Every call makes the backend's device current on the calling thread and
// never creates a context on another GPU. A device error the process cannot
// recover from (IsStickyCudaError) comes back as UNAVAILABLE and is reported
// to DeviceHealth(); out-of-memory is RESOURCE_EXHAUSTED and leaves the
// session usable.
//
// State lives in device memory. Accumulate copies the chunk into a pinned
// host staging ring and enqueues the copy and the kernels on CUDA streams, so
// it returns before the device has finished (and the copy of the next chunk
// overlaps the kernels of this one); a device error surfaces from a later
// call, and from then on every call reports it. Snapshot waits for the device.
#ifndef KVCAL_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVCAL_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/nonfinite.h"

namespace kvcal {

// True when this build contains the CUDA backend.
bool CudaBackendCompiled();

// Number of usable CUDA devices (0 without the backend, a driver or a GPU).
int CudaDeviceCount();

// A one-line description of device `device` ("NVIDIA H200, sm_90, 139 GiB"),
// or why there is none.
std::string CudaDeviceDescription(int device);

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateCudaBackend(
    const Geometry& geometry, const BackendOptions& options = {});

// Test seam: the n-th CUDA device or pinned allocation from now on (n >= 1)
// fails as a real out-of-memory does (a real request no device can satisfy);
// 0 cancels. Process-wide.
void FailNthCudaAllocationForTesting(int n);

// The CUDA backend with two extra entry points, for benchmarks and for
// producers whose activations already lie in device memory.
class CudaStatisticsBackend : public StatisticsBackend, public DeviceDataSink {
 public:
  DeviceDataSink* device_data() override { return this; }

  // Like Accumulate, but chunk.data points to device memory of this
  // backend's device (chunk.data.size() is still the byte count). Nothing is
  // copied: the memory must stay valid and unchanged until Synchronize() or
  // Snapshot() returns.
  //
  // Checked before anything is enqueued, each failure INVALID_ARGUMENT with
  // nothing applied: the chunk itself (ValidateChunk, the same messages as
  // Accumulate), data aligned to its element size, and every byte of it in
  // one allocation of device (or managed) memory of this backend's device
  // (cudaPointerGetAttributes). A host or foreign pointer is refused instead
  // of faulting the kernel, which would end every session in the process.
  //
  // `ready` (a cudaEvent_t, or null): an event the producer recorded on its
  // own stream after writing the data, before this call. The backend's
  // stream waits for it on the device, so the read is ordered after the
  // producer's writes without blocking the host. Null means the data is
  // complete already (the producer synchronized).
  [[nodiscard]] absl::Status AccumulateDeviceData(
      const ChunkView& chunk, CUevent_st* ready) override = 0;

  // The NaN and Inf values per head of a chunk in device memory, for a
  // session that refuses non-finite values before anything is applied. The
  // checks of AccumulateDeviceData come first (INVALID_ARGUMENT, nothing
  // read); then the bytes are copied to host memory 8 MiB at a time and
  // counted there (kernels/nonfinite.h, the code that counts in-band
  // chunks), before this returns. Changes no state; the data must be
  // complete (the producer synchronized).
  [[nodiscard]] absl::StatusOr<ChunkNonFinite> CountNonFiniteDeviceData(
      const ChunkView& chunk) override = 0;

  // Waits until everything enqueued has finished; returns the first device
  // error, if any.
  [[nodiscard]] absl::Status Synchronize() override = 0;
};

absl::StatusOr<std::unique_ptr<CudaStatisticsBackend>>
CreateCudaStatisticsBackend(const Geometry& geometry,
                            const BackendOptions& options = {});

}  // namespace kvcal

#endif  // KVCAL_KERNELS_CUDA_CUDA_BACKEND_H_
