// Process-wide health of the accelerator the statistics backends use.
//
// Some device errors cannot be recovered inside the process (a sticky CUDA
// error: illegal address, uncorrectable ECC, a GPU that fell off the bus):
// every later call on that device fails the same way. The backend that sees
// one reports it here; from then on
//   - DeviceHealth() returns it (UNAVAILABLE),
//   - BackendKind::kAuto resolves to the CPU backend (ResolveBackend), and
//   - the worker reports NOT_SERVING so that it is restarted.
//
//   if (!kvcal::DeviceHealth().ok()) { /* stop routing work to the GPU */ }
#ifndef KVCAL_KERNELS_DEVICE_HEALTH_H_
#define KVCAL_KERNELS_DEVICE_HEALTH_H_

#include "absl/status/status.h"

namespace kvcal {

// OK until a device loss was reported, then the first reported error.
absl::Status DeviceHealth();

// Records `status` (not OK) as a device loss; the first report wins.
void ReportDeviceLost(const absl::Status& status);

// Tests only: forgets a reported loss.
void ResetDeviceHealthForTesting();

}  // namespace kvcal

#endif  // KVCAL_KERNELS_DEVICE_HEALTH_H_
