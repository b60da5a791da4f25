#include "kernels/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"

namespace kvcal {

absl::StatusOr<BackendChoice> ResolveBackend(BackendKind kind,
                                             const BackendOptions& options) {
  if (kind == BackendKind::kCpu) {
    return BackendChoice{BackendKind::kCpu, "cpu (--backend cpu)"};
  }
  // Why CUDA cannot be used here, or empty when it can.
  std::string why_not;
  if (!CudaBackendCompiled()) {
    why_not = "built without CUDA";
  } else if (const absl::Status health = DeviceHealth(); !health.ok()) {
    if (kind == BackendKind::kCuda) {
      return absl::UnavailableError(
          absl::StrCat("the CUDA device is lost to this process (restart it): ",
                       health.message()));
    }
    why_not = absl::StrCat("the CUDA device is lost: ", health.message());
  } else if (options.device < 0 || options.device >= CudaDeviceCount()) {
    why_not = CudaDeviceDescription(options.device);
  }
  if (why_not.empty()) {
    return BackendChoice{BackendKind::kCuda,
                         absl::StrCat("cuda on device ", options.device, ": ",
                                      CudaDeviceDescription(options.device))};
  }
  if (kind == BackendKind::kCuda) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--backend cuda: no CUDA device ", options.device, " (", why_not, ")"));
  }
  return BackendChoice{BackendKind::kCpu, absl::StrCat("cpu (", why_not, ")")};
}

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateBackend(
    BackendKind kind, const Geometry& geometry, const BackendOptions& options) {
  switch (kind) {
    case BackendKind::kCpu:
      return CreateCpuBackend(geometry, options);
    case BackendKind::kCuda:
      return CreateCudaBackend(geometry, options);
    case BackendKind::kAuto:
      break;
  }
  absl::StatusOr<BackendChoice> choice = ResolveBackend(kind, options);
  if (choice.ok() && choice->kind == BackendKind::kCuda) {
    absl::StatusOr<std::unique_ptr<StatisticsBackend>> cuda =
        CreateCudaBackend(geometry, options);
    // An invalid geometry is the caller's error, whichever the backend.
    if (cuda.ok() || absl::IsInvalidArgument(cuda.status())) return cuda;
  }
  return CreateCpuBackend(geometry, options);
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view text) {
  if (text == "auto") return BackendKind::kAuto;
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", text, "': use auto, cpu or cuda"));
}

}  // namespace kvcal
