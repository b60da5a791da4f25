// Stand-in for builds without the CUDA backend.
#include "absl/strings/str_cat.h"
#include "kernels/cuda_ipc.h"
#include "util/status_macros.h"

namespace kvcal {

absl::StatusOr<std::unique_ptr<CudaIpcMemory>> CudaIpcMemory::Open(
    absl::string_view handle, int device, uint64_t byte_size) {
  KVCAL_RETURN_IF_ERROR(ValidateCudaIpcRequest(handle, device, byte_size));
  return absl::FailedPreconditionError(
      "CUDA IPC memory needs the CUDA backend, which this build does not "
      "have (KVCAL_CUDA=OFF or no nvcc at build time)");
}

}  // namespace kvcal
