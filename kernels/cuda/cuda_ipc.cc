// CudaIpcMemory with the CUDA runtime (KVCAL_HAVE_CUDA builds).
#include "kernels/cuda_ipc.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/cuda_status.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);

class OpenedCudaIpcMemory final : public CudaIpcMemory {
 public:
  OpenedCudaIpcMemory(void* data, uint64_t byte_size, int device)
      : data_(data), byte_size_(byte_size), device_(device) {}
  ~OpenedCudaIpcMemory() override {
    // Closing needs the device the handle was opened on; a failure leaves
    // nothing anyone can act on.
    absl::StatusOr<cuda::DeviceGuard> guard = cuda::DeviceGuard::Enter(device_);
    if (guard.ok()) cuda::IgnoreCudaError(cudaIpcCloseMemHandle(data_));
  }
  const std::byte* data() const override {
    return static_cast<const std::byte*>(data_);
  }
  uint64_t byte_size() const override { return byte_size_; }
  int device() const override { return device_; }

 private:
  void* data_;
  uint64_t byte_size_;
  int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaIpcMemory>> CudaIpcMemory::Open(
    absl::string_view handle, int device, uint64_t byte_size) {
  KVCAL_RETURN_IF_ERROR(ValidateCudaIpcRequest(handle, device, byte_size));
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC memory of device ", device,
                     ": this process sees ", count, " CUDA devices"));
  }
  KVCAL_ASSIGN_OR_RETURN(cuda::DeviceGuard guard,
                         cuda::DeviceGuard::Enter(device));
  cudaIpcMemHandle_t ipc{};
  std::memcpy(&ipc, handle.data(), sizeof(ipc));
  void* data = nullptr;
  const cudaError_t error =
      cudaIpcOpenMemHandle(&data, ipc, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    absl::Status status =
        cuda::CudaCallFailed(error, "cudaIpcOpenMemHandle", __FILE__, __LINE__);
    if (cuda::IsStickyCudaError(error)) return status;
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA IPC handle cannot be opened on device ", device,
        " (the producer is on another node, exited or freed the memory, or it "
        "is not a cudaIpcMemHandle_t): ",
        status.message()));
  }
  auto memory = std::make_unique<OpenedCudaIpcMemory>(data, byte_size, device);
  if (const auto address_range = cuda::DriverMemGetAddressRange()) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (address_range(&base, &size, reinterpret_cast<CUdeviceptr>(data)) ==
            CUDA_SUCCESS &&
        base + size - reinterpret_cast<CUdeviceptr>(data) < byte_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the CUDA IPC allocation holds ",
          base + size - reinterpret_cast<CUdeviceptr>(data),
          " bytes, fewer than the byte_size ", byte_size, " registered"));
    }
  }
  return memory;
}

}  // namespace kvcal
