// static_minmax: the largest |x| of every value seen (docs/observers.md).
#include "kernels/observers/observer.h"

namespace {

float Range(kvcal::HeadSpan heads, const kvcal::ObserverParameters&, uint32_t) {
  return kvcal::StaticAbsmax(heads);
}

}  // namespace

KVCAL_DEFINE_OBSERVER(static_minmax) = {kvcal::Observer::kStaticMinMax,
                                        "static_minmax", false, &Range};
