#include "absl/strings/str_cat.h"
#include "kernels/cuda_ipc.h"

namespace kvcal {

absl::Status ValidateCudaIpcRequest(absl::string_view handle, int device,
                                    uint64_t byte_size) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA IPC handle is ", handle.size(), " bytes; a ",
                     "cudaIpcMemHandle_t is ", kCudaIpcHandleBytes));
  }
  if (device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " is not a device ordinal"));
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        "CUDA IPC region: byte_size is 0; a region has >= 1 byte");
  }
  return absl::OkStatus();
}

}  // namespace kvcal
