// RAII owners of CUDA runtime resources used by the CUDA backend: device
// buffers, pinned host buffers, streams, events, and a guard that makes a
// device current for the calling thread.
//
//   KVCAL_ASSIGN_OR_RETURN(auto counts, DeviceBuffer<uint64_t>::Allocate(n));
//   KVCAL_ASSIGN_OR_RETURN(auto stream, Stream::Create());
//   KVCAL_CUDA_RETURN_IF_ERROR(
//       cudaMemsetAsync(counts.get(), 0, counts.bytes(), stream.get()));
//
// Destructors release without checking errors: by then nobody can act on one.
#ifndef KVCAL_KERNELS_CUDA_CUDA_RESOURCES_H_
#define KVCAL_KERNELS_CUDA_CUDA_RESOURCES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"

namespace kvcal::cuda {

// `count` elements of T in device memory (uninitialised).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static absl::StatusOr<DeviceBuffer> Allocate(size_t count) {
    DeviceBuffer buffer;
    if (count == 0) return buffer;
    void* ptr = nullptr;
    KVCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, count * sizeof(T)));
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
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
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
    KVCAL_CUDA_RETURN_IF_ERROR(cudaMallocHost(&ptr, bytes));
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
    if (ptr_ != nullptr) (void)cudaFreeHost(ptr_);
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
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
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
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

// Makes `device` current for the calling thread for the guard's lifetime
// (the current device is per host thread, and callers may come from any
// thread), then restores the previous one.
class DeviceGuard {
 public:
  static absl::StatusOr<DeviceGuard> Enter(int device) {
    DeviceGuard guard;
    KVCAL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&guard.previous_));
    if (guard.previous_ != device) {
      KVCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      guard.restore_ = true;
    }
    return guard;
  }
  DeviceGuard(DeviceGuard&& other) noexcept
      : previous_(other.previous_),
        restore_(std::exchange(other.restore_, false)) {}
  DeviceGuard& operator=(DeviceGuard&&) = delete;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  DeviceGuard() = default;
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_CUDA_RESOURCES_H_
