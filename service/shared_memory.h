// Same-host shared memory (docs/shared_memory.md): regions producers on the
// worker's host register, and the chunk references into them that Ingest
// accepts instead of in-band bytes. Free of gRPC types.
//
//   SharedMemoryRegistry registry({.max_regions_per_tenant = 16});
//   KVCAL_ASSIGN_OR_RETURN(SharedMemoryRegionInfo region,
//       registry.Register("team-a", {.kind = SharedMemoryKind::kSystem,
//                                    .name = "/kvcal-rank0",
//                                    .byte_size = 64 << 20}));
//   // per chunk, while it is applied:
//   KVCAL_ASSIGN_OR_RETURN(SharedMemoryLease lease,
//       registry.Acquire("team-a", region.id, offset, byte_size));
//   chunk.data = lease.bytes();   // read-only view into the mapping
//
// A system region is the POSIX shared-memory object `name`, opened O_RDONLY
// and mapped PROT_READ (the worker never writes a producer's memory). The
// mapping is reference counted: Unregister forgets the id at once, and the
// mapping goes away when the last lease of a chunk being applied ends. A
// lease also marks its byte range in use: a second reference overlapping it
// while it is held is refused (a producer reusing bytes before their
// chunk's response came back).
#ifndef KVCAL_SERVICE_SHARED_MEMORY_H_
#define KVCAL_SERVICE_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/cuda_ipc.h"

namespace kvcal::service {

// Numbers match kvcal.v1.SharedMemoryKind.
enum class SharedMemoryKind : uint32_t { kSystem = 1, kCudaIpc = 2 };

// The phrase clients key their fallback to in-band chunks on (with
// FAILED_PRECONDITION): the worker cannot reach the producer's memory.
inline constexpr absl::string_view kNotOnProducerHost =
    "the worker is not on the producer's host";

struct SharedMemoryOptions {
  // Per tenant; 0 = unlimited. Past them Register is ResourceExhausted.
  uint64_t max_regions_per_tenant = 64;
  uint64_t max_bytes_per_tenant = 0;
  // False: Register is FailedPrecondition (the clients fall back).
  bool enabled = true;
  // This host's /proc/sys/kernel/random/boot_id (empty: not compared).
  std::string host_id;
  // Opens CUDA IPC memory (CudaIpcMemory::Open); set by a worker whose
  // backend is CUDA. Null: CUDA_IPC regions are FailedPrecondition.
  std::function<absl::StatusOr<std::unique_ptr<CudaIpcMemory>>(
      absl::string_view handle, int device, uint64_t byte_size)>
      open_cuda_ipc;
};

struct SharedMemoryRegistration {
  SharedMemoryKind kind = SharedMemoryKind::kSystem;
  std::string name;             // kSystem
  std::string cuda_ipc_handle;  // kCudaIpc: cudaIpcMemHandle_t's bytes
  uint32_t device = 0;          // kCudaIpc
  uint64_t byte_size = 0;
  std::string host_id;  // the producer's boot id; empty = not checked
};

struct SharedMemoryRegionInfo {
  uint64_t id = 0;
  SharedMemoryKind kind = SharedMemoryKind::kSystem;
  std::string name;
  uint32_t device = 0;
  uint64_t byte_size = 0;
};

// A read-only mapping of one POSIX shared-memory object; unmapped (and its
// descriptor closed) on destruction.
class SystemMapping {
 public:
  // FailedPrecondition naming `name` (and kNotOnProducerHost) when it does
  // not exist here; InvalidArgument for a bad name or an object smaller
  // than byte_size.
  static absl::StatusOr<std::unique_ptr<SystemMapping>> Open(
      const std::string& name, uint64_t byte_size);
  ~SystemMapping();
  SystemMapping(const SystemMapping&) = delete;
  SystemMapping& operator=(const SystemMapping&) = delete;

  const std::byte* data() const { return data_; }
  uint64_t byte_size() const { return byte_size_; }
  // FailedPrecondition when the producer shrank the object below the
  // registered size (reading it would fault).
  absl::Status CheckStillMapped() const;

 private:
  SystemMapping(std::string name, int fd, const std::byte* data,
                uint64_t byte_size)
      : name_(std::move(name)), fd_(fd), data_(data), byte_size_(byte_size) {}
  std::string name_;
  int fd_ = -1;
  const std::byte* data_ = nullptr;
  uint64_t byte_size_ = 0;
};

class SharedMemoryRegistry;

// One chunk's hold on a range of a region, from acquisition until the chunk
// is applied. Move-only; releases the range (and its reference to the
// mapping) on destruction.
class SharedMemoryLease {
 public:
  SharedMemoryLease() = default;
  SharedMemoryLease(SharedMemoryLease&& other) noexcept;
  SharedMemoryLease& operator=(SharedMemoryLease&& other) noexcept;
  ~SharedMemoryLease();

  // Host memory of the mapping, or, when device() is true, device memory
  // of the region's CUDA device (a CUDA IPC region).
  absl::Span<const std::byte> bytes() const { return bytes_; }
  bool device() const { return device_; }

 private:
  friend class SharedMemoryRegistry;
  struct Region;
  void Release();
  std::shared_ptr<Region> region_;
  uint64_t offset_ = 0;
  absl::Span<const std::byte> bytes_;
  bool device_ = false;
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryOptions options);
  ~SharedMemoryRegistry();

  absl::StatusOr<SharedMemoryRegionInfo> Register(
      absl::string_view tenant, const SharedMemoryRegistration& request);
  // NotFound for an unknown id or another tenant's.
  absl::Status Unregister(absl::string_view tenant, uint64_t id);
  std::vector<SharedMemoryRegionInfo> List(absl::string_view tenant);

  // Resolves a chunk reference: NotFound for an unknown region or another
  // tenant's; InvalidArgument for a range outside the region (computed
  // without overflow); Aborted for a range overlapping one another lease
  // holds (a concurrency conflict: nothing is applied, and the producer may
  // resend from its watermark once the earlier chunk is answered);
  // FailedPrecondition for a system object shrunk below its registered
  // size. A CUDA IPC region's lease holds device memory (device()).
  // Messages name the region and the range; callers prefix the chunk.
  absl::StatusOr<SharedMemoryLease> Acquire(absl::string_view tenant,
                                            uint64_t id, uint64_t offset,
                                            uint64_t byte_size);

  size_t size();

 private:
  using Region = SharedMemoryLease::Region;
  // What Register checks before it opens anything: the worker allows the
  // kind, the producer is on this host, the CUDA IPC request is well formed.
  absl::Status CheckRegistration(const SharedMemoryRegistration& request) const;
  // The tenant's region count and bytes leave room for `byte_size` more.
  absl::Status CheckTenantLimitsLocked(absl::string_view tenant,
                                       uint64_t byte_size) const;
  // Maps (SYSTEM) or opens (CUDA IPC) the region; no id yet.
  absl::StatusOr<std::shared_ptr<Region>> OpenRegion(
      absl::string_view tenant, const SharedMemoryRegistration& request) const;

  const SharedMemoryOptions options_;
  std::mutex mu_;
  uint64_t next_id_ = 1;                                 // guarded by mu_
  std::map<uint64_t, std::shared_ptr<Region>> regions_;  // guarded by mu_
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_SHARED_MEMORY_H_
