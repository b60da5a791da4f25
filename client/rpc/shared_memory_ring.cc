#include "client/rpc/shared_memory_ring.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "util/host_port.h"
#include "util/status_macros.h"

namespace kvcal {

bool SharedMemoryFallsBack(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition ||
         status.code() == absl::StatusCode::kUnimplemented ||
         status.code() == absl::StatusCode::kResourceExhausted;
}

absl::StatusOr<std::unique_ptr<SharedMemoryRing>> SharedMemoryRing::Create(
    size_t slots, size_t slot_bytes) {
  if (slots == 0) slots = 1;
  slot_bytes = std::max<size_t>(64, (slot_bytes + 63) / 64 * 64);
  if (slot_bytes > (size_t{1} << 40) / slots) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory ring of ",
                                                   slots, " x ", slot_bytes,
                                                   " bytes is too large"));
  }
  std::unique_ptr<SharedMemoryRing> ring(new SharedMemoryRing());
  ring->slots_ = slots;
  ring->slot_bytes_ = slot_bytes;
  ring->byte_size_ = slots * slot_bytes;
  std::random_device random;
  ring->name_ = absl::StrCat("/kvcal-", getpid(), "-", random(), random());
  ring->fd_ = shm_open(ring->name_.c_str(),
                       O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (ring->fd_ < 0) {
    return absl::InternalError(absl::StrCat("cannot create shared memory '",
                                            ring->name_,
                                            "': ", std::strerror(errno)));
  }
  // posix_fallocate: the pages exist now, so a full /dev/shm is an error
  // here rather than a SIGBUS on a later write.
  if (const int e =
          posix_fallocate(ring->fd_, 0, static_cast<off_t>(ring->byte_size_));
      e != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size shared memory '", ring->name_, "' to ",
                     ring->byte_size_, " bytes: ", std::strerror(e)));
  }
  void* data = mmap(nullptr, ring->byte_size_, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_POPULATE, ring->fd_, 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map shared memory '", ring->name_,
                     "': ", std::strerror(errno)));
  }
  ring->data_ = static_cast<std::byte*>(data);
  return ring;
}

SharedMemoryRing::~SharedMemoryRing() {
  Unregister();
  if (data_ != nullptr) munmap(data_, byte_size_);
  if (fd_ >= 0) {
    close(fd_);
    shm_unlink(name_.c_str());
  }
}

absl::Status SharedMemoryRing::Register(std::shared_ptr<grpc::Channel> channel,
                                        const ConnectionOptions& connection) {
  Unregister();
  connection_ = connection;
  stub_ = v1::Calibration::NewStub(std::move(channel));
  grpc::ClientContext context;
  PrepareContext(context, connection_, absl::Seconds(30));
  v1::RegisterSharedMemoryRequest request;
  request.set_kind(v1::SHARED_MEMORY_KIND_SYSTEM);
  request.set_name(name_);
  request.set_byte_size(byte_size_);
  request.set_host_id(HostBootId());
  v1::SharedMemoryRegion region;
  KVCAL_RETURN_IF_ERROR(
      ToAbslStatus(stub_->RegisterSharedMemory(&context, request, &region),
                   absl::StrCat("registering ", name_, " with the worker")));
  region_id_ = region.region_id();
  return absl::OkStatus();
}

void SharedMemoryRing::Unregister() {
  if (region_id_ == 0 || stub_ == nullptr) return;
  grpc::ClientContext context;
  PrepareContext(context, connection_, absl::Seconds(2));
  v1::UnregisterSharedMemoryRequest request;
  request.set_region_id(region_id_);
  v1::UnregisterSharedMemoryResponse response;
  (void)stub_->UnregisterSharedMemory(&context, request, &response);
  region_id_ = 0;
}

}  // namespace kvcal
