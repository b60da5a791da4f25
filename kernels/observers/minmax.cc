// minmax (EMA): an exponential moving average of each batch's min and max,
// in batch order (docs/observers.md).
#include "kernels/observers/observer.h"

namespace {

float Range(kvcal::HeadSpan heads, const kvcal::ObserverParameters& p,
            uint32_t) {
  const std::map<uint64_t, kvcal::MinMax> batches =
      kvcal::ReducedBatches(heads);
  if (batches.empty()) return 0.0f;
  // EMA on raw batch extrema; the clamp comes once, at the end.
  auto it = batches.begin();
  float mn = it->second.min;
  float mx = it->second.max;
  // llm-compressor's float32 form, `state * (1 - c) + batch * c` (its
  // helpers.lerp on float32 tensors: 1 - c in double, then rounded to float;
  // two products rounded separately, then the sum). The algebraically equal
  // `state + c * (batch - state)` drifts by ulps over tens of batches.
  const float c = p.averaging_constant;
  const float keep = static_cast<float>(1.0 - static_cast<double>(c));
  for (++it; it != batches.end(); ++it) {
    const float kept_min = mn * keep;
    const float new_min = it->second.min * c;
    mn = kept_min + new_min;
    const float kept_max = mx * keep;
    const float new_max = it->second.max * c;
    mx = kept_max + new_max;
  }
  return kvcal::ClampedRange(mn, mx);
}

}  // namespace

KVCAL_DEFINE_OBSERVER(minmax) = {kvcal::Observer::kMinMaxEma, "minmax", false,
                                 &Range};
