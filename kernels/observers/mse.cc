// mse: the shrunk range p * absmax (p = 1, 1 - 1/grid, ... above
// 1 - max_shrink) with the least sum of |FakeQuantize(x) - x|^norm, the
// error evaluated on each head's exactly kept largest values plus the
// histogram less those values, each bin's error integrated over the bin
// (docs/observers.md: why kvcal has no raw values to search on, and why
// every step of the grid).
#include <cmath>
#include <limits>

#include "kernels/observers/observer.h"

namespace {

float Range(kvcal::HeadSpan heads, const kvcal::ObserverParameters& p,
            uint32_t log2_bins_per_octave) {
  const float absmax = kvcal::StaticAbsmax(heads);
  const int steps = static_cast<int>(
      std::floor(static_cast<double>(p.mse_max_shrink) * p.mse_grid));
  if (steps <= 0 || absmax == 0.0f) return absmax;
  const kvcal::ValueModel model(heads, log2_bins_per_octave);
  double best = std::numeric_limits<double>::max();
  float best_range = absmax;
  for (int i = 0; i < steps; ++i) {
    const float shrink = static_cast<float>(
        1.0 - static_cast<double>(i) / static_cast<double>(p.mse_grid));
    const float range = shrink * absmax;
    const float scale = kvcal::ScaleFromRange(range, 1.0f, p.format);
    const double error = model.Error(scale, p.format, p.mse_norm);
    // Every step of the grid, no early stop (mse_patience is validated but
    // not used here): llm-compressor stops after `patience` steps without
    // improvement because each of its evaluations is a pass over a batch;
    // this estimate costs microseconds per step, and on real activations the
    // raw error curve is jagged (FP8 grid alignment), so an early stop on
    // either curve can end before a minimum several steps further down
    // (SmolLM2 layer 7 k head 0: flat or rising for 4 steps from p = 1,
    // the minimum at p = 0.82, 12% less error). Ties keep the larger range.
    if (error < best) {
      best = error;
      best_range = range;
    }
  }
  return best_range;
}

}  // namespace

KVCAL_DEFINE_OBSERVER(mse) = {kvcal::Observer::kMse, "mse", true, &Range};
