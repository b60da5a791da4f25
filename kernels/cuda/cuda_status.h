// absl::Status for CUDA runtime errors, and the macro that wraps every CUDA
// runtime call of the CUDA backend:
//
//   KVCAL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bytes, stream));
//   KVCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());  // after a launch
//
// Host code only (it includes Abseil); kernels never see it.
#ifndef KVCAL_KERNELS_CUDA_CUDA_STATUS_H_
#define KVCAL_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvcal::cuda {

// OK for cudaSuccess; otherwise a status naming the failed call and the
// error. Allocation failures map to RESOURCE_EXHAUSTED, a missing driver or
// device to UNAVAILABLE, everything else to INTERNAL.
inline absl::Status CudaStatus(cudaError_t error, const char* call,
                               const char* file, int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  std::string message = absl::StrCat("CUDA error ", cudaGetErrorName(error),
                                     " (", cudaGetErrorString(error), ") from ",
                                     call, " at ", file, ":", line);
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::UnavailableError(std::move(message));
    default:
      return absl::InternalError(std::move(message));
  }
}

}  // namespace kvcal::cuda

// Evaluates a CUDA runtime call and returns its error as an absl::Status.
#define KVCAL_CUDA_RETURN_IF_ERROR(call)                                   \
  do {                                                                     \
    const cudaError_t kvcal_cuda_error_ = (call);                          \
    if (kvcal_cuda_error_ != cudaSuccess) {                                \
      return ::kvcal::cuda::CudaStatus(kvcal_cuda_error_, #call, __FILE__, \
                                       __LINE__);                          \
    }                                                                      \
  } while (false)

#endif  // KVCAL_KERNELS_CUDA_CUDA_STATUS_H_
