// The CUDA statistics backend. This header has no CUDA types, so the rest of
// the tree compiles without nvcc; in a build without CUDA the functions below
// report that the backend is absent.
//
//   if (kvcal::CudaDeviceCount() > 0) {
//     KVCAL_ASSIGN_OR_RETURN(auto backend,
//                            kvcal::CreateCudaBackend(geometry, {.device = 0}));
//   }
#ifndef KVCAL_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVCAL_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

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

}  // namespace kvcal

#endif  // KVCAL_KERNELS_CUDA_CUDA_BACKEND_H_
