// percentile: the p-th percentile of |x| over the heads, nearest rank; exact
// within the kept tails, else the upper edge of the histogram bin that holds
// it (docs/observers.md).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/element_math.h"
#include "kernels/observers/observer.h"

namespace {

float Range(kvcal::HeadSpan heads, const kvcal::ObserverParameters& p,
            uint32_t log2_bins_per_octave) {
  const uint64_t n = kvcal::FiniteCount(heads);
  if (n == 0) return 0.0f;
  double x = p.percentile / 100.0 * static_cast<double>(n);
  const double nearest = std::round(x);
  if (std::fabs(x - nearest) <= 1e-9 * std::max(1.0, x)) x = nearest;
  uint64_t k = static_cast<uint64_t>(std::ceil(x));
  k = std::clamp<uint64_t>(k, 1, n);
  const uint64_t rank_from_top = n - k + 1;
  const std::vector<float> exact = kvcal::ExactTop(heads);
  if (rank_from_top <= exact.size()) return exact[rank_from_top - 1];
  const float absmax = kvcal::StaticAbsmax(heads);
  const size_t bins = heads[0]->histogram.size();
  uint64_t cumulative = 0;
  for (uint32_t bin = 0; bin < bins; ++bin) {
    for (const kvcal::HeadStatistics* h : heads) {
      cumulative += h->histogram[bin];
    }
    if (cumulative >= k) {
      return std::min(kvcal::HistogramBinUpperEdge(bin, log2_bins_per_octave),
                      absmax);
    }
  }
  return absmax;
}

}  // namespace

KVCAL_DEFINE_OBSERVER(percentile) = {kvcal::Observer::kPercentile, "percentile",
                                     true, &Range};
