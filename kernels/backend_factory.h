// The backend factory: what BackendKind::kAuto means on this machine, and
// the backend it chooses, made. The one file that knows every backend
// (kernels/backend.h is the interface they implement):
//
//   KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<kvcal::StatisticsBackend> backend,
//                          kvcal::CreateBackend(kvcal::BackendKind::kAuto, geometry));
#ifndef KVCAL_KERNELS_BACKEND_FACTORY_H_
#define KVCAL_KERNELS_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace kvcal {

// What a BackendKind means on this machine now. The one place that decides
// what kAuto means: kCuda when this build has the CUDA backend, device
// `options.device` exists and no device loss was reported (DeviceHealth);
// else kCpu. kCpu resolves to itself; kCuda resolves to itself when the
// device exists and is healthy, else FAILED_PRECONDITION (or UNAVAILABLE
// after a device loss) saying why.
struct BackendChoice {
  BackendKind kind = BackendKind::kCpu;  // kCpu or kCuda, never kAuto
  // For the log: "cuda on NVIDIA H200, sm_90, ..." or "cpu (no CUDA device
  // present)".
  std::string description;
};
absl::StatusOr<BackendChoice> ResolveBackend(
    BackendKind kind, const BackendOptions& options = {});

// Creates the backend ResolveBackend(kind) chooses. With kAuto, a CUDA
// backend that cannot be created (out of device memory, a device lost
// meanwhile, ...) falls back to the CPU backend: the session works either
// way, and name() says which one it got.
absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateBackend(
    BackendKind kind, const Geometry& geometry,
    const BackendOptions& options = {});

// Parses "auto", "cpu" or "cuda".
absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view text);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_BACKEND_FACTORY_H_
