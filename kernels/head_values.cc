#include "kernels/head_values.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "kernels/element_math.h"

namespace kvcal {

float ClampedRange(float mn, float mx) {
  mn = std::min(mn, 0.0f);
  mx = std::max(mx, 0.0f);
  return std::max(std::fabs(mn), std::fabs(mx));
}

float StaticAbsmax(HeadSpan heads) {
  float mn = std::numeric_limits<float>::infinity();
  float mx = -std::numeric_limits<float>::infinity();
  for (const HeadStatistics* h : heads) {
    if (h->finite_count == 0) continue;
    mn = std::min(mn, h->min);
    mx = std::max(mx, h->max);
  }
  if (mn > mx) return 0.0f;
  return ClampedRange(mn, mx);
}

std::map<uint64_t, MinMax> ReducedBatches(HeadSpan heads) {
  if (heads.size() == 1) return heads[0]->batches;
  std::map<uint64_t, MinMax> out;
  for (const HeadStatistics* h : heads) {
    for (const auto& [batch, extrema] : h->batches) out[batch].Merge(extrema);
  }
  return out;
}

std::vector<float> ExactTop(HeadSpan heads) {
  float threshold = -1.0f;
  for (const HeadStatistics* h : heads) {
    if (h->finite_count > h->tail.size() && !h->tail.empty()) {
      threshold = std::max(threshold, h->tail.back());
    }
  }
  std::vector<float> out;
  for (const HeadStatistics* h : heads) {
    for (float v : h->tail) {
      if (v >= threshold) out.push_back(v);
    }
  }
  std::sort(out.begin(), out.end(), std::greater<float>());
  return out;
}

uint64_t FiniteCount(HeadSpan heads) {
  uint64_t n = 0;
  for (const HeadStatistics* h : heads) n += h->finite_count;
  return n;
}

namespace {

// F(t) = sign(t) |t|^(n+1) / (n+1), so that F' = |t|^n.
double PowerAntiderivative(double t, double norm) {
  const double magnitude = std::pow(std::fabs(t), norm + 1.0) / (norm + 1.0);
  return t < 0.0 ? -magnitude : magnitude;
}

// Integral over q in [lo, hi] (0 <= lo <= hi) of |q - Q(q)|^norm, where Q
// rounds min(q, qmax) to nearest on the format's grid: the q-space error of
// values spread evenly over the interval. Splits [lo, hi] where Q changes
// (midpoints between grid points, and qmax) and integrates each piece in
// closed form.
double RoundingErrorIntegral(double lo, double hi, double qmax, Format format,
                             double norm) {
  double total = 0.0;
  double pos = lo;
  while (pos < hi) {
    if (pos >= qmax) {  // clamped: Q = qmax
      total += PowerAntiderivative(hi - qmax, norm) -
               PowerAntiderivative(pos - qmax, norm);
      break;
    }
    const double step = GridStep(pos, format);
    const double k = std::floor(pos / step);
    const double mid = (k + 0.5) * step;
    double rounded, end;
    if (pos < mid) {
      rounded = k * step;
      end = mid;
    } else {
      rounded = (k + 1.0) * step;  // a grid point (qmax is one)
      end = rounded;
    }
    end = std::min({end, hi, qmax});
    if (end <= pos) end = std::min(hi, std::nextafter(pos, hi));
    total += PowerAntiderivative(end - rounded, norm) -
             PowerAntiderivative(pos - rounded, norm);
    pos = end;
  }
  return total;
}

}  // namespace

ValueModel::ValueModel(HeadSpan heads, uint32_t log2_bins_per_octave) {
  absmax_ = StaticAbsmax(heads);
  const size_t bins = heads[0]->histogram.size();
  const uint32_t overflow_bin = HistogramBinCount(log2_bins_per_octave) - 1;
  std::vector<int64_t> residual(bins, 0);
  std::vector<int64_t> own(bins, 0);
  for (const HeadStatistics* h : heads) {
    std::fill(own.begin(), own.end(), 0);
    for (uint32_t bin = 0; bin < bins; ++bin) {
      own[bin] = static_cast<int64_t>(h->histogram[bin]);
    }
    for (float v : h->tail) {
      if (v != 0.0f) points_.push_back({v, 1.0});
      --own[HistogramBin(v, log2_bins_per_octave)];
    }
    uint32_t cap_bin = static_cast<uint32_t>(bins);  // none
    if (h->finite_count > h->tail.size() && !h->tail.empty()) {
      cap_bin = HistogramBin(h->tail.back(), log2_bins_per_octave);
    }
    for (uint32_t bin = 0; bin < bins; ++bin) {
      if (own[bin] <= 0) continue;
      if (bin == cap_bin && bin > kUnderflowBin && bin < overflow_bin) {
        intervals_.push_back({HistogramBinLowerEdge(bin, log2_bins_per_octave),
                              std::min<double>(h->tail.back(), absmax_),
                              static_cast<double>(own[bin])});
      } else {
        residual[bin] += own[bin];
      }
    }
  }
  for (uint32_t bin = 1; bin < bins; ++bin) {  // zero bin has no error
    if (residual[bin] <= 0) continue;
    const double count = static_cast<double>(residual[bin]);
    if (bin == kUnderflowBin || bin == overflow_bin) {
      // Below 2^-24 (error ~0 at any scale) or at 2^24 and above: a point.
      const float at =
          bin == overflow_bin
              ? HistogramBinLowerEdge(bin, log2_bins_per_octave)
              : 0.5f * HistogramBinUpperEdge(bin, log2_bins_per_octave);
      points_.push_back({std::min(at, absmax_), count});
      continue;
    }
    intervals_.push_back(
        {HistogramBinLowerEdge(bin, log2_bins_per_octave),
         std::min<double>(HistogramBinUpperEdge(bin, log2_bins_per_octave),
                          absmax_),
         count});
  }
}

double ValueModel::Error(float scale, Format format, double norm) const {
  const double qmax = FormatMax(format);
  double error = 0.0;
  for (const Point& point : points_) {
    const float diff =
        std::fabs(FakeQuantize(point.value, scale, format) - point.value);
    if (diff != 0.0f) error += point.weight * std::pow(double{diff}, norm);
  }
  // Mean error over an interval: (s^(n+1) / (hi - lo)) * the q-space
  // integral over [lo / s, hi / s].
  const double s = scale;
  const double s_power = std::pow(s, norm + 1.0);
  for (const Interval& in : intervals_) {
    if (in.hi <= in.lo) {  // a single value
      const float v = static_cast<float>(in.lo);
      const float diff = std::fabs(FakeQuantize(v, scale, format) - v);
      if (diff != 0.0f) error += in.count * std::pow(double{diff}, norm);
      continue;
    }
    const double integral =
        RoundingErrorIntegral(in.lo / s, in.hi / s, qmax, format, norm);
    error += in.count * s_power * integral / (in.hi - in.lo);
  }
  return error;
}

double ValueModel::CountBetween(double lo, double hi) const {
  double n = 0.0;
  for (const Point& point : points_) {
    if (point.value > lo && point.value < hi) n += point.weight;
  }
  for (const Interval& in : intervals_) {
    if (in.hi <= in.lo) {
      if (in.lo > lo && in.lo < hi) n += in.count;
      continue;
    }
    const double overlap = std::min(hi, in.hi) - std::max(lo, in.lo);
    if (overlap > 0.0) n += in.count * overlap / (in.hi - in.lo);
  }
  return n;
}

}  // namespace kvcal
