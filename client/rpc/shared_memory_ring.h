// The producer's side of same-host shared memory (docs/shared_memory.md): a
// POSIX shared-memory object this process creates, cut into equal slots
// that chunks are written into before they are sent by reference, and its
// registration with one worker.
//
//   KVCAL_ASSIGN_OR_RETURN(auto ring, SharedMemoryRing::Create(16, 4 << 20));
//   KVCAL_RETURN_IF_ERROR(ring->Register(channel, connection));
//   // FailedPrecondition (another host) / Unimplemented: send in-band.
//   std::memcpy(ring->slot(seq % 16), bytes, n);
//   request.mutable_shared_memory()->set_region_id(ring->region_id());
//
// The object is created 0600 under "/kvcal-<pid>-<random>" and unlinked
// (and unregistered, best effort) on destruction.
#ifndef KVCAL_CLIENT_RPC_SHARED_MEMORY_RING_H_
#define KVCAL_CLIENT_RPC_SHARED_MEMORY_RING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/rpc/connection.h"
#include "kvcal/v1/calibration.grpc.pb.h"

namespace kvcal {

// True for a RegisterSharedMemory error after which a producer sends its
// chunks in-band instead: the worker is on another host or cannot read the
// object (FailedPrecondition), is older than shared memory
// (Unimplemented), or has no room for the region (ResourceExhausted).
bool SharedMemoryFallsBack(const absl::Status& status);

class SharedMemoryRing {
 public:
  // `slots` slots of `slot_bytes` (rounded up to 64) each. Internal or
  // ResourceExhausted naming the object when it cannot be created.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRing>> Create(
      size_t slots, size_t slot_bytes);
  ~SharedMemoryRing();
  SharedMemoryRing(const SharedMemoryRing&) = delete;
  SharedMemoryRing& operator=(const SharedMemoryRing&) = delete;

  // Registers the object with the worker behind `channel` (unregistering an
  // earlier registration first, best effort): after a reconnect the worker
  // may be a restarted one that never heard of it, or another one.
  [[nodiscard]] absl::Status Register(std::shared_ptr<grpc::Channel> channel,
                                      const ConnectionOptions& connection);
  // Forgets the registration (best effort; the destructor does it too).
  void Unregister();

  const std::string& name() const { return name_; }
  size_t slots() const { return slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  uint64_t region_id() const { return region_id_; }
  std::byte* slot(size_t i) { return data_ + i * slot_bytes_; }
  uint64_t slot_offset(size_t i) const { return i * slot_bytes_; }

 private:
  SharedMemoryRing() = default;
  std::string name_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  size_t slots_ = 0;
  size_t slot_bytes_ = 0;
  size_t byte_size_ = 0;
  uint64_t region_id_ = 0;                       // 0: not registered
  std::unique_ptr<v1::Calibration::Stub> stub_;  // of the registration
  ConnectionOptions connection_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_SHARED_MEMORY_RING_H_
