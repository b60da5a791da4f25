// memoryless_minmax: the range of the last batch alone (docs/observers.md).
#include "kernels/observers/observer.h"

namespace {

float Range(kvcal::HeadSpan heads, const kvcal::ObserverParameters&, uint32_t) {
  const std::map<uint64_t, kvcal::MinMax> batches =
      kvcal::ReducedBatches(heads);
  if (batches.empty()) return 0.0f;
  const kvcal::MinMax& last = batches.rbegin()->second;
  return kvcal::ClampedRange(last.min, last.max);
}

}  // namespace

KVCAL_DEFINE_OBSERVER(memoryless_minmax) = {kvcal::Observer::kMemorylessMinMax,
                                            "memoryless_minmax", false, &Range};
