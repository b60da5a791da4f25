// Shared helpers of the libFuzzer targets in tests/fuzz/.
#ifndef KVCAL_TESTS_FUZZ_FUZZ_UTIL_H_
#define KVCAL_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "kernels/scale_math.h"
#include "kernels/statistics.h"

// Aborts (a crash libFuzzer reports) when an invariant does not hold.
#define FUZZ_CHECK(cond)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, \
                   __LINE__, #cond);                                  \
      std::abort();                                                   \
    }                                                                 \
  } while (0)

namespace kvcal::fuzz {

// Runs the scale math on `stats` with the observer picked by `selector` and
// checks what a Finalize would return: OK with finite positive scales, or
// FAILED_PRECONDITION (no finite data; missing heads).
inline void CheckScales(const SessionStatistics& stats, unsigned selector) {
  ScaleOptions options;
  options.observer = static_cast<Observer>(1 + selector % 5);
  options.granularity =
      (selector / 5) % 2 ? Granularity::kPerHead : Granularity::kPerTensor;
  options.format = static_cast<Format>(1 + (selector / 10) % 4);
  options.allow_missing = (selector / 40) % 2 == 0;
  options.q_per_kv_group =
      (selector / 80) % 2 == 1 && options.granularity == Granularity::kPerHead;
  FUZZ_CHECK(options.Validate().ok());
  absl::StatusOr<ScaleResult> result = ComputeScales(stats, options);
  if (!result.ok()) {
    FUZZ_CHECK(result.status().code() == absl::StatusCode::kFailedPrecondition);
    return;
  }
  FUZZ_CHECK(result->layers.size() == stats.geometry().num_layers);
  for (const LayerScales& layer : result->layers) {
    for (const auto& role : layer.roles) {
      if (!role.has_value()) continue;
      FUZZ_CHECK(role->scale.size() == role->absmax.size());
      for (float s : role->scale) FUZZ_CHECK(std::isfinite(s) && s > 0.0f);
    }
  }
}

}  // namespace kvcal::fuzz

#endif  // KVCAL_TESTS_FUZZ_FUZZ_UTIL_H_
