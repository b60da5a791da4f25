// Device memory another process on this node shares through CUDA IPC
// (cudaIpcGetMemHandle there, cudaIpcOpenMemHandle here), for chunks that a
// producer leaves on its GPU (docs/shared_memory.md "CUDA IPC"). No CUDA
// types, so the rest of the tree compiles without nvcc; without the CUDA
// backend Open is FailedPrecondition. The interface lives here, beside
// backend.h, so that the service uses it without including anything of
// kernels/cuda/ (which implements it: cuda_ipc.cc, cuda_ipc_absent.cc).
//
//   KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<CudaIpcMemory> memory,
//                          CudaIpcMemory::Open(handle_bytes, /*device=*/0,
//                                              /*byte_size=*/64 << 20));
//   chunk.data = {memory->data() + offset, n};   // device pointer
//   backend->device_data()->AccumulateDeviceData(chunk, nullptr);
#ifndef KVCAL_KERNELS_CUDA_IPC_H_
#define KVCAL_KERNELS_CUDA_IPC_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcal {

// Bytes of a cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// An opened IPC allocation, mapped into this process on `device`; closed
// (cudaIpcCloseMemHandle) on destruction.
class CudaIpcMemory {
 public:
  // InvalidArgument: the handle is not kCudaIpcHandleBytes bytes, byte_size
  // is 0, or the allocation is smaller than byte_size. FailedPrecondition:
  // this build or process has no CUDA device `device`, or the driver cannot
  // open the handle (the producer is on another node, has exited or freed
  // the memory, or the handle is not one).
  static absl::StatusOr<std::unique_ptr<CudaIpcMemory>> Open(
      absl::string_view handle, int device, uint64_t byte_size);

  virtual ~CudaIpcMemory() = default;
  // Device pointer to the start of the allocation.
  virtual const std::byte* data() const = 0;
  virtual uint64_t byte_size() const = 0;
  virtual int device() const = 0;
};

// Checks what Open checks before it touches the driver (handle size,
// byte_size); shared by the CPU-only build and tests.
absl::Status ValidateCudaIpcRequest(absl::string_view handle, int device,
                                    uint64_t byte_size);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_CUDA_IPC_H_
