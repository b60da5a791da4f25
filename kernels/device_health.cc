#include "kernels/device_health.h"

#include <atomic>
#include <mutex>

namespace kvcal {
namespace {

struct HealthState {
  std::atomic<bool> lost{false};  // fast path for DeviceHealth()
  std::mutex mu;
  absl::Status error;  // guarded by mu
};

HealthState& State() {
  static HealthState* state = new HealthState();  // never destroyed
  return *state;
}

}  // namespace

absl::Status DeviceHealth() {
  HealthState& state = State();
  if (!state.lost.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(state.mu);
  return state.error;
}

void ReportDeviceLost(const absl::Status& status) {
  if (status.ok()) return;
  HealthState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  if (!state.error.ok()) return;
  state.error = absl::UnavailableError(status.message());
  state.lost.store(true, std::memory_order_release);
}

void ResetDeviceHealthForTesting() {
  HealthState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  state.error = absl::OkStatus();
  state.lost.store(false, std::memory_order_release);
}

}  // namespace kvcal
