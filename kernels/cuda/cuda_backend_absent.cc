// Stand-in for builds without the CUDA backend (KVCAL_CUDA=OFF or no nvcc).
#include "absl/status/status.h"
#include "kernels/cuda/cuda_backend.h"

namespace kvcal {

bool CudaBackendCompiled() { return false; }
int CudaDeviceCount() { return 0; }
std::string CudaDeviceDescription(int /*device*/) {
  return "this build has no CUDA backend (built with KVCAL_CUDA=OFF or "
         "without nvcc)";
}

void FailNthCudaAllocationForTesting(int /*n*/) {}

absl::StatusOr<std::unique_ptr<CudaStatisticsBackend>>
CreateCudaStatisticsBackend(const Geometry& /*geometry*/,
                            const BackendOptions& /*options*/) {
  return absl::UnavailableError(
      "the CUDA backend is not compiled into this build (KVCAL_CUDA=OFF or "
      "no nvcc at build time)");
}

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateCudaBackend(
    const Geometry& /*geometry*/, const BackendOptions& /*options*/) {
  return absl::UnavailableError(
      "the CUDA backend is not compiled into this build (KVCAL_CUDA=OFF or "
      "no nvcc at build time)");
}

}  // namespace kvcal
