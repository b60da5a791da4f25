#include "kernels/backend.h"

#include "kernels/cuda/cuda_backend.h"

namespace kvcal {

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateBackend(
    BackendKind kind, const Geometry& geometry, const BackendOptions& options) {
  switch (kind) {
    case BackendKind::kCpu:
      return CreateCpuBackend(geometry, options);
    case BackendKind::kCuda:
      return CreateCudaBackend(geometry, options);
    case BackendKind::kAuto:
      if (CudaDeviceCount() > 0) return CreateCudaBackend(geometry, options);
      return CreateCpuBackend(geometry, options);
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

}  // namespace kvcal
