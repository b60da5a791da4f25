// absl::Status for CUDA runtime errors, and the macro that wraps every CUDA
// runtime call of the CUDA backend:
//
//   KVCAL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bytes, stream));
//   KVCAL_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, args...));
//
// A failed runtime call also leaves its error in the calling thread's
// last-error slot, where a later cudaGetLastError() would report it against
// an unrelated call; the macro clears it once the error is handed on as a
// status. Launches are checked through their own return value
// (cudaLaunchKernelEx), never through cudaGetLastError().
//
// Host code only (it includes Abseil); kernels never see it.
#ifndef KVCAL_KERNELS_CUDA_CUDA_STATUS_H_
#define KVCAL_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/device_health.h"

namespace kvcal::cuda {

// True for the errors after which the process cannot use the device any more
// (the CUDA context is corrupt: every later call returns the same error until
// the process restarts).
constexpr bool IsStickyCudaError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

// OK for cudaSuccess; otherwise a status naming the failed call and the
// error:
//   - allocation failures: RESOURCE_EXHAUSTED (the session stays usable);
//   - no driver, no device, a device that is busy (exclusive process) or
//     lost for good (IsStickyCudaError): UNAVAILABLE;
//   - everything else: INTERNAL.
// Pure: no side effects (see CudaCallFailed).
inline absl::Status CudaStatus(cudaError_t error, const char* call,
                               const char* file, int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  std::string message = absl::StrCat("CUDA error ", cudaGetErrorName(error),
                                     " (", cudaGetErrorString(error), ") from ",
                                     call, " at ", file, ":", line);
  if (IsStickyCudaError(error)) {
    return absl::UnavailableError(absl::StrCat(
        message,
        "; the GPU is unusable in this process until it restarts (its "
        "statistics on the device are lost)"));
  }
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::UnavailableError(std::move(message));
    default:
      return absl::InternalError(std::move(message));
  }
}

// Hands on the error of a failed runtime call: clears it from the thread's
// last-error slot, reports a sticky one as a device loss (DeviceHealth), and
// returns CudaStatus.
inline absl::Status CudaCallFailed(cudaError_t error, const char* call,
                                   const char* file, int line) {
  (void)cudaGetLastError();
  absl::Status status = CudaStatus(error, call, file, line);
  if (IsStickyCudaError(error)) ReportDeviceLost(status);
  return status;
}

// For calls whose failure nobody can act on (releases in destructors): the
// error must still not linger in the thread's last-error slot.
inline void IgnoreCudaError(cudaError_t error) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  if (IsStickyCudaError(error)) {
    ReportDeviceLost(CudaStatus(error, "a release", __FILE__, __LINE__));
  }
}

}  // namespace kvcal::cuda

// Evaluates a CUDA runtime call and returns its error as an absl::Status
// (CudaCallFailed).
#define KVCAL_CUDA_RETURN_IF_ERROR(call)                                       \
  do {                                                                         \
    const cudaError_t kvcal_cuda_error_ = (call);                              \
    if (kvcal_cuda_error_ != cudaSuccess) {                                    \
      return ::kvcal::cuda::CudaCallFailed(kvcal_cuda_error_, #call, __FILE__, \
                                           __LINE__);                          \
    }                                                                          \
  } while (false)

#endif  // KVCAL_KERNELS_CUDA_CUDA_STATUS_H_
