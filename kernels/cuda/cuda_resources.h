// RAII owners of CUDA runtime resources used by the CUDA backend: device
// buffers, pinned host buffers, streams, events, and a guard that makes a
// device current for the calling thread; plus the test seam that makes the
// n-th allocation fail.
//
//   KVCAL_ASSIGN_OR_RETURN(auto counts, DeviceBuffer<uint64_t>::Allocate(n));
//   KVCAL_ASSIGN_OR_RETURN(auto stream, Stream::Create());
//   KVCAL_CUDA_RETURN_IF_ERROR(
//       cudaMemsetAsync(counts.get(), 0, counts.bytes(), stream.get()));
//
// Destructors release without checking errors: by then nobody can act on one.
#ifndef KVCAL_KERNELS_CUDA_CUDA_RESOURCES_H_
#define KVCAL_KERNELS_CUDA_CUDA_RESOURCES_H_

#include <cuda.h>  // driver types only; no libcuda at link time
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"

namespace kvcal::cuda {

// Test seam (FailNthCudaAllocationForTesting): allocations still to go
// before the one that fails; 0 = none fails.
inline std::atomic<int>& AllocationFailureCountdown() {
  static std::atomic<int> countdown{0};
  return countdown;
}

// The byte count to request: `bytes`, or, for the allocation the test seam
// picked, one no device or host can satisfy, so that the runtime fails the
// way a real out-of-memory does (same error, same last-error state).
inline size_t BytesToRequest(size_t bytes) {
  std::atomic<int>& countdown = AllocationFailureCountdown();
  int n = countdown.load(std::memory_order_relaxed);
  while (n > 0 && !countdown.compare_exchange_weak(n, n - 1)) {
  }
  return n == 1 ? (size_t{1} << 62) : bytes;
}

// `count` elements of T in device memory (uninitialised).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static absl::StatusOr<DeviceBuffer> Allocate(size_t count) {
    DeviceBuffer buffer;
    if (count == 0) return buffer;
    void* ptr = nullptr;
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&ptr, BytesToRequest(count * sizeof(T))));
    buffer.ptr_ = static_cast<T*>(ptr);
    buffer.count_ = count;
    return buffer;
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)),
        count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Release(); }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  void Release() {
    if (ptr_ != nullptr) IgnoreCudaError(cudaFree(ptr_));
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// `bytes` of page-locked host memory, so that copies from it are truly
// asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static absl::StatusOr<PinnedBuffer> Allocate(size_t bytes) {
    PinnedBuffer buffer;
    void* ptr = nullptr;
    KVCAL_CUDA_RETURN_IF_ERROR(cudaMallocHost(&ptr, BytesToRequest(bytes)));
    buffer.ptr_ = ptr;
    buffer.bytes_ = bytes;
    return buffer;
  }
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Release(); }

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void Release() {
    if (ptr_ != nullptr) IgnoreCudaError(cudaFreeHost(ptr_));
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking stream (it does not synchronise with the legacy default
// stream).
class Stream {
 public:
  Stream() = default;
  static absl::StatusOr<Stream> Create() {
    Stream stream;
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream.stream_, cudaStreamNonBlocking));
    return stream;
  }
  Stream(Stream&& other) noexcept
      : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      Release();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { Release(); }

  cudaStream_t get() const { return stream_; }

 private:
  void Release() {
    if (stream_ != nullptr) IgnoreCudaError(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

// An event without timing (cheaper to record and wait on), or with timing
// for benchmarks.
class Event {
 public:
  Event() = default;
  static absl::StatusOr<Event> Create(bool timing = false) {
    Event event;
    KVCAL_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(
        &event.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return event;
  }
  Event(Event&& other) noexcept
      : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      Release();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { Release(); }

  cudaEvent_t get() const { return event_; }

 private:
  void Release() {
    if (event_ != nullptr) IgnoreCudaError(cudaEventDestroy(event_));
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

// A driver function looked up through the runtime (so binaries need no
// link-time libcuda), or null when the driver does not have it.
inline void* DriverFunction(const char* name) {
  void* symbol = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &symbol, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return symbol;
}
inline PFN_cuCtxGetCurrent_v4000 DriverCtxGetCurrent() {
  static const auto fn = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(
      DriverFunction("cuCtxGetCurrent"));
  return fn;
}
inline PFN_cuMemGetAddressRange_v3020 DriverMemGetAddressRange() {
  static const auto fn = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(
      DriverFunction("cuMemGetAddressRange"));
  return fn;
}

// Makes `device` current for the calling thread (the current device is per
// host thread, and callers come from any gRPC or executor thread). It is set
// on every entry. On exit the guard restores the previous device only when
// the thread had one, that is a current CUDA context (an in-process caller
// working on another GPU): a fresh thread reports device 0 without having
// it, and "restoring" that would create a context on GPU 0 (hundreds of MiB
// on a GPU an inference engine may own, or an error on an exclusive-process
// GPU).
class DeviceGuard {
 public:
  static absl::StatusOr<DeviceGuard> Enter(int device) {
    DeviceGuard guard;
    CUcontext current = nullptr;
    const PFN_cuCtxGetCurrent_v4000 ctx_get_current = DriverCtxGetCurrent();
    if (ctx_get_current != nullptr &&
        ctx_get_current(&current) == CUDA_SUCCESS && current != nullptr) {
      KVCAL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&guard.previous_));
      guard.restore_ = guard.previous_ != device;
    }
    KVCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    return guard;
  }
  DeviceGuard(DeviceGuard&& other) noexcept
      : previous_(other.previous_),
        restore_(std::exchange(other.restore_, false)) {}
  DeviceGuard& operator=(DeviceGuard&&) = delete;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_) IgnoreCudaError(cudaSetDevice(previous_));
  }

 private:
  DeviceGuard() = default;
  int previous_ = 0;
  bool restore_ = false;  // the thread had device previous_ current
};

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_CUDA_RESOURCES_H_
