// What the statistics of a set of heads say about their values: the
// building blocks observers (kernels/observers/) and quantization estimates
// (scale_math.h) compute with.
#ifndef KVCAL_KERNELS_HEAD_VALUES_H_
#define KVCAL_KERNELS_HEAD_VALUES_H_

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "kernels/number_format.h"
#include "kernels/statistics.h"

namespace kvcal {

using HeadSpan = std::span<const HeadStatistics* const>;

// max(|min|, |max|) after clamping min <= 0 <= max.
float ClampedRange(float mn, float mx);

// The clamped range of every finite value the heads saw; 0 when none.
float StaticAbsmax(HeadSpan heads);

// Per-batch extrema reduced over heads, in increasing batch order.
std::map<uint64_t, MinMax> ReducedBatches(HeadSpan heads);

// Finite values seen by the heads together.
uint64_t FiniteCount(HeadSpan heads);

// Values known exactly over a set of heads, descending (docs/observers.md,
// percentile): every kept tail value at or above T, the largest
// 256th-largest value of any head whose tail does not hold all its values.
// Every value above T is kept by its head, so the j-th entry of the result is
// the true j-th largest |x| for every entry >= T; T itself included, which
// makes all 256 kept values of a single head exact.
std::vector<float> ExactTop(HeadSpan heads);

// What the statistics of a set of heads say about their |x| values, for
// evaluating an error sum at any scale: the exactly kept values (every head's
// tail) and the rest of the non-zero values as intervals [lo, hi] with a
// count, spread evenly over each (a histogram bin less the kept values,
// capped at the head's smallest kept value when the head kept only part of
// its values: every value it did not keep is at most that). Values in the
// zero bin carry no error at any scale and are left out.
class ValueModel {
 public:
  ValueModel(HeadSpan heads, uint32_t log2_bins_per_octave);

  float absmax() const { return absmax_; }

  // Sum over all values of |FakeQuantize(x, scale) - x|^norm: exact for the
  // kept values, integrated over each interval (docs/observers.md).
  double Error(float scale, Format format, double norm) const;

  // How many non-zero values lie in (lo, hi) (intervals counted by the
  // share of their length).
  double CountBetween(double lo, double hi) const;

 private:
  struct Point {
    float value;
    double weight;
  };
  struct Interval {
    double lo, hi, count;
  };
  float absmax_ = 0.0f;
  std::vector<Point> points_;
  std::vector<Interval> intervals_;
};

}  // namespace kvcal

#endif  // KVCAL_KERNELS_HEAD_VALUES_H_
