#include "service/shared_memory.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "util/status_macros.h"
#include "util/strings.h"

namespace kvcal::service {

// A registered region: owner, description and what the worker holds of it.
struct SharedMemoryLease::Region {
  std::string tenant;
  SharedMemoryRegionInfo info;
  std::unique_ptr<SystemMapping> mapping;        // kSystem
  std::unique_ptr<CudaIpcMemory> device_memory;  // kCudaIpc
  std::mutex mu;
  std::map<uint64_t, uint64_t>
      in_use;  // offset -> end, disjoint; guarded by mu
};

namespace {

constexpr absl::string_view kNamePrefix = "/kvcal";
constexpr size_t kMaxNameSuffix = 200;

absl::Status ValidateName(const std::string& name) {
  const bool prefixed =
      absl::string_view(name).substr(0, kNamePrefix.size()) == kNamePrefix;
  const size_t suffix = prefixed ? name.size() - kNamePrefix.size() : 0;
  const bool ok = prefixed && suffix >= 1 && suffix <= kMaxNameSuffix &&
                  FirstNonIdentifierChar(absl::string_view(name).substr(
                      kNamePrefix.size())) == absl::string_view::npos;
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory name '", absl::CEscape(name.substr(0, 256)),
                     "' is not \"/kvcal\" followed by 1 to ", kMaxNameSuffix,
                     " of [A-Za-z0-9._-] (the worker opens no other names)"));
  }
  return absl::OkStatus();
}

std::string RegionName(const SharedMemoryRegionInfo& info) {
  return info.kind == SharedMemoryKind::kSystem
             ? absl::StrCat("shared memory region ", info.id, " ('", info.name,
                            "', ", info.byte_size, " bytes)")
             : absl::StrCat("shared memory region ", info.id, " (CUDA IPC, ",
                            info.byte_size, " bytes on device ", info.device,
                            ")");
}

}  // namespace

absl::StatusOr<std::unique_ptr<SystemMapping>> SystemMapping::Open(
    const std::string& name, uint64_t byte_size) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (byte_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory '", name, "': byte_size is 0; a region has >= 1 byte"));
  }
  const int fd = shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT || error == EACCES) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared memory '", name, "' cannot be opened by the worker (",
          std::strerror(error), "): ", kNotOnProducerHost,
          " (or does not share its /dev/shm); send the chunks in-band"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory '", name, "' cannot be opened: ", std::strerror(error)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory '", name, "' is not a shared-memory object"));
  }
  if (static_cast<uint64_t>(st.st_size) < byte_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory '", name, "' is ", st.st_size,
        " bytes, smaller than the byte_size ", byte_size, " registered"));
  }
  if (byte_size > static_cast<uint64_t>(SIZE_MAX)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory '", name, "': byte_size ", byte_size, " is too large"));
  }
  // No MAP_POPULATE: a producer's ring is mostly pages its chunks never use
  // (the Python producer allocates a slot's pages as its chunks need them),
  // and populating would allocate and map all of them at registration (~30
  // ms for a 64 MiB ring). A page faults in once, when a chunk first reads
  // it.
  void* data = mmap(nullptr, static_cast<size_t>(byte_size), PROT_READ,
                    MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory '", name, "' (", byte_size,
                     " bytes) cannot be mapped: ", std::strerror(error)));
  }
  return std::unique_ptr<SystemMapping>(new SystemMapping(
      name, fd, static_cast<const std::byte*>(data), byte_size));
}

SystemMapping::~SystemMapping() {
  munmap(const_cast<std::byte*>(data_), static_cast<size_t>(byte_size_));
  close(fd_);
}

absl::Status SystemMapping::CheckStillMapped() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < byte_size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory '", name_, "' shrank below the ", byte_size_,
        " bytes registered; unregister and register "
        "it again"));
  }
  return absl::OkStatus();
}

SharedMemoryLease::SharedMemoryLease(SharedMemoryLease&& other) noexcept
    : region_(std::move(other.region_)),
      offset_(other.offset_),
      bytes_(other.bytes_),
      device_(other.device_) {
  other.region_.reset();
  other.bytes_ = {};
}

SharedMemoryLease& SharedMemoryLease::operator=(
    SharedMemoryLease&& other) noexcept {
  if (this != &other) {
    Release();
    region_ = std::move(other.region_);
    offset_ = other.offset_;
    bytes_ = other.bytes_;
    device_ = other.device_;
    other.region_.reset();
    other.bytes_ = {};
  }
  return *this;
}

SharedMemoryLease::~SharedMemoryLease() { Release(); }

void SharedMemoryLease::Release() {
  if (region_ == nullptr) return;
  if (!bytes_.empty()) {
    std::lock_guard<std::mutex> lock(region_->mu);
    region_->in_use.erase(offset_);
  }
  region_.reset();
  bytes_ = {};
}

SharedMemoryRegistry::SharedMemoryRegistry(SharedMemoryOptions options)
    : options_(std::move(options)) {
  // Ids start at a random point so that a producer holding an id from
  // before a worker restart cannot hit a region registered since.
  std::random_device random;
  next_id_ = ((uint64_t{random()} << 32 | random()) >> 2) + 1;
}

SharedMemoryRegistry::~SharedMemoryRegistry() = default;

absl::Status SharedMemoryRegistry::CheckRegistration(
    const SharedMemoryRegistration& request) const {
  if (!options_.enabled) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory is disabled on this worker "
                     "(--shared-memory=false): treat it as if ",
                     kNotOnProducerHost, " and send chunks in-band"));
  }
  if (request.kind != SharedMemoryKind::kSystem &&
      request.kind != SharedMemoryKind::kCudaIpc) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory kind ", static_cast<uint32_t>(request.kind),
                     " is not SYSTEM or CUDA_IPC"));
  }
  if (!request.host_id.empty() && !options_.host_id.empty() &&
      request.host_id != options_.host_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the producer's host id (boot id ", request.host_id.substr(0, 64),
        ") is not the worker's: ", kNotOnProducerHost));
  }
  if (request.kind != SharedMemoryKind::kCudaIpc) return absl::OkStatus();
  if (request.device > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", request.device, " is not a device ordinal"));
  }
  KVCAL_RETURN_IF_ERROR(ValidateCudaIpcRequest(request.cuda_ipc_handle,
                                               static_cast<int>(request.device),
                                               request.byte_size));
  if (!options_.open_cuda_ipc) {
    return absl::FailedPreconditionError(
        "CUDA IPC shared memory needs the CUDA backend, and this worker's "
        "sessions use the CPU backend (--backend cpu, no CUDA device, or "
        "a build without CUDA); register a SYSTEM region or send the "
        "chunks in-band");
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::CheckTenantLimitsLocked(
    absl::string_view tenant, uint64_t byte_size) const {
  uint64_t count = 0, bytes = 0;
  for (const auto& [id, region] : regions_) {
    if (region->tenant != tenant) continue;
    ++count;
    bytes += region->info.byte_size;
  }
  if (options_.max_regions_per_tenant != 0 &&
      count + 1 > options_.max_regions_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", tenant, "' already has ", count,
        " shared memory regions, the most this worker allows (",
        options_.max_regions_per_tenant, "); unregister one first"));
  }
  if (options_.max_bytes_per_tenant != 0 &&
      (byte_size > options_.max_bytes_per_tenant ||
       bytes > options_.max_bytes_per_tenant - byte_size)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory region of ", byte_size, " bytes: tenant '", tenant,
        "' has ", bytes, " bytes registered and may have at most ",
        options_.max_bytes_per_tenant));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegistry::Region>>
SharedMemoryRegistry::OpenRegion(
    absl::string_view tenant, const SharedMemoryRegistration& request) const {
  auto region = std::make_shared<Region>();
  region->tenant = std::string(tenant);
  region->info.kind = request.kind;
  region->info.byte_size = request.byte_size;
  if (request.kind == SharedMemoryKind::kCudaIpc) {
    KVCAL_ASSIGN_OR_RETURN(
        region->device_memory,
        options_.open_cuda_ipc(request.cuda_ipc_handle,
                               static_cast<int>(request.device),
                               request.byte_size));
    region->info.device = request.device;
  } else {
    KVCAL_ASSIGN_OR_RETURN(
        region->mapping, SystemMapping::Open(request.name, request.byte_size));
    region->info.name = request.name;
  }
  return region;
}

absl::StatusOr<SharedMemoryRegionInfo> SharedMemoryRegistry::Register(
    absl::string_view tenant, const SharedMemoryRegistration& request) {
  KVCAL_RETURN_IF_ERROR(CheckRegistration(request));
  // Limits before the (slow, fallible) open; checked again when adding.
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(CheckTenantLimitsLocked(tenant, request.byte_size));
  }
  KVCAL_ASSIGN_OR_RETURN(std::shared_ptr<Region> region,
                         OpenRegion(tenant, request));
  std::lock_guard<std::mutex> lock(mu_);
  KVCAL_RETURN_IF_ERROR(CheckTenantLimitsLocked(tenant, request.byte_size));
  region->info.id = next_id_++;
  regions_[region->info.id] = region;
  return region->info;
}

absl::Status SharedMemoryRegistry::Unregister(absl::string_view tenant,
                                              uint64_t id) {
  std::shared_ptr<Region> region;  // unmapped outside mu_ if last
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second->tenant != tenant) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region ", id, " not found"));
  }
  region = std::move(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

std::vector<SharedMemoryRegionInfo> SharedMemoryRegistry::List(
    absl::string_view tenant) {
  std::vector<SharedMemoryRegionInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, region] : regions_) {
    if (region->tenant == tenant) out.push_back(region->info);
  }
  return out;
}

absl::StatusOr<SharedMemoryLease> SharedMemoryRegistry::Acquire(
    absl::string_view tenant, uint64_t id, uint64_t offset,
    uint64_t byte_size) {
  std::shared_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it != regions_.end() && it->second->tenant == tenant) {
      region = it->second;
    }
  }
  if (region == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "shared memory region ", id,
        " not found (never registered by this tenant, or unregistered)"));
  }
  const uint64_t size = region->info.byte_size;
  if (offset > size || byte_size > size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory reference [", offset, ", ", offset, " + ",
                     byte_size, ") is outside ", RegionName(region->info)));
  }
  if (region->mapping != nullptr) {
    if (absl::Status s = region->mapping->CheckStillMapped(); !s.ok()) {
      return s;
    }
  }
  SharedMemoryLease lease;
  if (byte_size > 0) {
    std::lock_guard<std::mutex> lock(region->mu);
    const uint64_t end = offset + byte_size;
    auto next = region->in_use.lower_bound(end);
    if (next != region->in_use.begin()) {
      auto prev = std::prev(next);
      if (prev->second > offset) {
        return absl::AbortedError(absl::StrCat(
            "shared memory reference [", offset, ", ", end, ") of ",
            RegionName(region->info), " overlaps [", prev->first, ", ",
            prev->second,
            "), which a chunk the worker is still reading uses (reuse bytes "
            "only after their chunk's response)"));
      }
    }
    region->in_use.emplace(offset, end);
  }
  const std::byte* base = region->mapping != nullptr
                              ? region->mapping->data()
                              : region->device_memory->data();
  lease.device_ = region->device_memory != nullptr;
  lease.region_ = std::move(region);
  lease.offset_ = offset;
  lease.bytes_ =
      absl::MakeConstSpan(base + offset, static_cast<size_t>(byte_size));
  return lease;
}

size_t SharedMemoryRegistry::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

}  // namespace kvcal::service
