#include "kernels/scale_math.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/element_math.h"
#include "kernels/thread_pool.h"
#include "util/status_macros.h"

namespace kvcal {

float FormatMax(Format format) {
  switch (format) {
    case Format::kFp8E4m3fn:
      return 448.0f;
    case Format::kFp8E4m3fnuz:
      return 240.0f;
    case Format::kFp8E5m2:
      return 57344.0f;
    case Format::kInt8:
      return 127.0f;
  }
  return 448.0f;
}

float FormatMinNormal(Format format) {
  switch (format) {
    case Format::kFp8E4m3fn:
      return 0x1p-6f;
    case Format::kFp8E4m3fnuz:
      return 0x1p-7f;
    case Format::kFp8E5m2:
      return 0x1p-14f;
    case Format::kInt8:
      return 0.0f;
  }
  return 0x1p-6f;
}

float RoundToFormat(float q, Format format) {
  if (format == Format::kInt8) return std::nearbyint(q);
  int mantissa_bits = 3;
  int min_exponent = -6;  // smallest normal exponent
  if (format == Format::kFp8E4m3fnuz) min_exponent = -7;
  if (format == Format::kFp8E5m2) {
    mantissa_bits = 2;
    min_exponent = -14;
  }
  const float a = std::fabs(q);
  if (a == 0.0f || !std::isfinite(a)) return q;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, min_exponent);
  const float ulp = std::ldexp(1.0f, exponent - mantissa_bits);
  const float r = std::nearbyint(a / ulp) * ulp;  // a / ulp is exact
  return std::copysign(r, q);
}

float FakeQuantize(float x, float scale, Format format) {
  const float qmax = FormatMax(format);
  const float q = std::clamp(x / scale, -qmax, qmax);
  return RoundToFormat(q, format) * scale;
}

float ScaleFromRange(float range, float margin, Format format) {
  const float scale = (range * margin) / FormatMax(format);
  if (!(scale > 0.0f) || !std::isfinite(scale)) {
    return scale > 0.0f ? std::numeric_limits<float>::max() : FLT_EPSILON;
  }
  return scale;
}

absl::Status ScaleOptions::Validate() const {
  const uint32_t o = static_cast<uint32_t>(observer);
  if (o < 1 || o > 5) {
    return absl::InvalidArgumentError(absl::StrCat("unknown observer ", o));
  }
  const uint32_t g = static_cast<uint32_t>(granularity);
  if (g < 1 || g > 2) {
    return absl::InvalidArgumentError(absl::StrCat("unknown granularity ", g));
  }
  const uint32_t f = static_cast<uint32_t>(format);
  if (f < 1 || f > 4) {
    return absl::InvalidArgumentError(absl::StrCat("unknown format ", f));
  }
  if (!(averaging_constant > 0.0f && averaging_constant <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "averaging_constant must be in (0, 1], got ", averaging_constant));
  }
  if (!(percentile > 0.0 && percentile <= 100.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("percentile must be in (0, 100], got ", percentile));
  }
  if (!(std::isfinite(margin) && margin > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("margin must be finite and > 0, got ", margin));
  }
  if (mse_grid == 0) {
    return absl::InvalidArgumentError("mse_grid must be >= 1");
  }
  if (!(mse_max_shrink > 0.0f && mse_max_shrink < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mse_max_shrink must be in (0, 1), got ", mse_max_shrink));
  }
  if (!(mse_norm > 0.0f) || !std::isfinite(mse_norm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mse_norm must be finite and > 0, got ", mse_norm));
  }
  if (mse_patience == 0) {
    return absl::InvalidArgumentError("mse_patience must be >= 1");
  }
  return absl::OkStatus();
}

namespace {

float ClampedRange(float mn, float mx) {
  mn = std::min(mn, 0.0f);
  mx = std::max(mx, 0.0f);
  return std::max(std::fabs(mn), std::fabs(mx));
}

float StaticAbsmax(std::span<const HeadStatistics* const> heads) {
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

// Per-batch extrema reduced over heads, in increasing batch order.
std::map<uint64_t, MinMax> ReducedBatches(
    std::span<const HeadStatistics* const> heads) {
  if (heads.size() == 1) return heads[0]->batches;
  std::map<uint64_t, MinMax> out;
  for (const HeadStatistics* h : heads) {
    for (const auto& [batch, extrema] : h->batches) out[batch].Merge(extrema);
  }
  return out;
}

}  // namespace

float MinMaxRange(std::span<const HeadStatistics* const> heads,
                  Observer observer, float averaging_constant) {
  if (observer == Observer::kStaticMinMax) return StaticAbsmax(heads);
  const std::map<uint64_t, MinMax> batches = ReducedBatches(heads);
  if (batches.empty()) return 0.0f;
  if (observer == Observer::kMemorylessMinMax) {
    const MinMax& last = batches.rbegin()->second;
    return ClampedRange(last.min, last.max);
  }
  // EMA on raw batch extrema; the clamp comes once, at the end.
  auto it = batches.begin();
  float mn = it->second.min;
  float mx = it->second.max;
  // llm-compressor's float32 form, `state * (1 - c) + batch * c` (its
  // helpers.lerp on float32 tensors: 1 - c in double, then rounded to float;
  // two products rounded separately, then the sum). The algebraically equal
  // `state + c * (batch - state)` drifts by ulps over tens of batches.
  const float keep =
      static_cast<float>(1.0 - static_cast<double>(averaging_constant));
  for (++it; it != batches.end(); ++it) {
    const float kept_min = mn * keep;
    const float new_min = it->second.min * averaging_constant;
    mn = kept_min + new_min;
    const float kept_max = mx * keep;
    const float new_max = it->second.max * averaging_constant;
    mx = kept_max + new_max;
  }
  return ClampedRange(mn, mx);
}

namespace {

// Values known exactly over a set of heads, descending (docs/formats.md
// "Observers", percentile): every kept tail value at or above T, the largest
// 256th-largest value of any head whose tail does not hold all its values.
// Every value above T is kept by its head, so the j-th entry of the result is
// the true j-th largest |x| for every entry >= T; T itself included, which
// makes all 256 kept values of a single head exact.
std::vector<float> ExactTop(std::span<const HeadStatistics* const> heads) {
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

uint64_t FiniteCount(std::span<const HeadStatistics* const> heads) {
  uint64_t n = 0;
  for (const HeadStatistics* h : heads) n += h->finite_count;
  return n;
}

}  // namespace

float PercentileRange(std::span<const HeadStatistics* const> heads,
                      double percentile, uint32_t log2_bins_per_octave) {
  const uint64_t n = FiniteCount(heads);
  if (n == 0) return 0.0f;
  double x = percentile / 100.0 * static_cast<double>(n);
  const double nearest = std::round(x);
  if (std::fabs(x - nearest) <= 1e-9 * std::max(1.0, x)) x = nearest;
  uint64_t k = static_cast<uint64_t>(std::ceil(x));
  k = std::clamp<uint64_t>(k, 1, n);
  const uint64_t rank_from_top = n - k + 1;
  const std::vector<float> exact = ExactTop(heads);
  if (rank_from_top <= exact.size()) return exact[rank_from_top - 1];
  const float absmax = StaticAbsmax(heads);
  const size_t bins = heads[0]->histogram.size();
  uint64_t cumulative = 0;
  for (uint32_t bin = 0; bin < bins; ++bin) {
    for (const HeadStatistics* h : heads) cumulative += h->histogram[bin];
    if (cumulative >= k) {
      return std::min(HistogramBinUpperEdge(bin, log2_bins_per_octave), absmax);
    }
  }
  return absmax;
}

namespace {

// The spacing of `format`'s grid at |q| (q >= 0, below the format's max).
double GridStep(double q, Format format) {
  if (format == Format::kInt8) return 1.0;
  int mantissa_bits = 3;
  int min_exponent = -6;
  if (format == Format::kFp8E4m3fnuz) min_exponent = -7;
  if (format == Format::kFp8E5m2) {
    mantissa_bits = 2;
    min_exponent = -14;
  }
  int e;
  std::frexp(q, &e);  // q = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0, std::max(e - 1, min_exponent) - mantissa_bits);
}

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

namespace {

// What the statistics of a set of heads say about their |x| values, for
// evaluating an error sum at any scale: the exactly kept values (every head's
// tail) and the rest of the non-zero values as intervals [lo, hi] with a
// count, spread evenly over each (a histogram bin less the kept values,
// capped at the head's smallest kept value when the head kept only part of
// its values: every value it did not keep is at most that). Values in the
// zero bin carry no error at any scale and are left out.
class ValueModel {
 public:
  ValueModel(std::span<const HeadStatistics* const> heads,
             uint32_t log2_bins_per_octave) {
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
          intervals_.push_back(
              {HistogramBinLowerEdge(bin, log2_bins_per_octave),
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

  float absmax() const { return absmax_; }

  // Sum over all values of |FakeQuantize(x, scale) - x|^norm: exact for the
  // kept values, integrated over each interval (docs/observers.md).
  double Error(float scale, Format format, double norm) const {
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

  // How many non-zero values lie in (lo, hi) (intervals counted by the
  // share of their length).
  double CountBetween(double lo, double hi) const {
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

}  // namespace

float MseRange(std::span<const HeadStatistics* const> heads,
               const ScaleOptions& options, uint32_t log2_bins_per_octave) {
  const float absmax = StaticAbsmax(heads);
  const int steps = static_cast<int>(std::floor(
      static_cast<double>(options.mse_max_shrink) * options.mse_grid));
  if (steps <= 0 || absmax == 0.0f) return absmax;
  const ValueModel model(heads, log2_bins_per_octave);
  double best = std::numeric_limits<double>::max();
  float best_range = absmax;
  for (int i = 0; i < steps; ++i) {
    const float p = static_cast<float>(
        1.0 - static_cast<double>(i) / static_cast<double>(options.mse_grid));
    const float range = p * absmax;
    const float scale = ScaleFromRange(range, 1.0f, options.format);
    const double error = model.Error(scale, options.format, options.mse_norm);
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

QuantizationEstimate EstimateQuantization(
    std::span<const HeadStatistics* const> heads, float scale, Format format,
    uint32_t log2_bins_per_octave) {
  QuantizationEstimate out;
  uint64_t finite = 0;
  double sum_squares = 0.0;
  for (const HeadStatistics* h : heads) {
    finite += h->finite_count;
    sum_squares += h->sum_squares;
  }
  if (finite == 0 || heads[0]->histogram.empty()) return out;
  const ValueModel model(heads, log2_bins_per_octave);
  const double n = static_cast<double>(finite);
  const double error = model.Error(scale, format, 2.0);
  out.relative_rms_error =
      sum_squares > 0.0 ? std::sqrt(error / sum_squares) : 0.0;
  // A static scale's own absmax divides to a ulp above the format's max:
  // only beyond float32's rounding of the division counts (as evaluate()).
  const double clip =
      static_cast<double>(scale) * FormatMax(format) * (1.0 + 0x1p-20);
  out.saturated_share =
      model.CountBetween(clip, std::numeric_limits<double>::infinity()) / n;
  out.subnormal_share = model.CountBetween(0.0, static_cast<double>(scale) *
                                                    FormatMinNormal(format)) /
                        n;
  return out;
}

namespace {

std::string TripleName(uint32_t layer, Role role, uint32_t head) {
  return absl::StrCat("(", layer, ", ", RoleName(role), ", ", head, ")");
}

float ObserverRange(std::span<const HeadStatistics* const> heads,
                    const ScaleOptions& options, uint32_t log2_bins) {
  switch (options.observer) {
    case Observer::kMse:
      return MseRange(heads, options, log2_bins);
    case Observer::kPercentile:
      return PercentileRange(heads, options.percentile, log2_bins);
    default:
      return MinMaxRange(heads, options.observer, options.averaging_constant);
  }
}

// options.layers sorted and deduplicated (every layer when empty); an
// error when one is out of range.
absl::StatusOr<std::vector<uint32_t>> SelectLayers(
    const Geometry& g, const std::vector<uint32_t>& layers) {
  std::vector<uint32_t> selected;
  if (layers.empty()) {
    for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
      selected.push_back(layer);
    }
    return selected;
  }
  selected = layers;
  std::sort(selected.begin(), selected.end());
  selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
  if (selected.back() >= g.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", selected.back(), " is out of range: the session has ",
        g.num_layers, " layers"));
  }
  return selected;
}

// FAILED_PRECONDITION naming the (layer, role, head) triples of `selected`
// without data, unless there are none or allow_missing.
absl::Status CheckMissing(const SessionStatistics& stats,
                          const std::vector<uint32_t>& selected,
                          bool allow_missing) {
  const Geometry& g = stats.geometry();
  std::vector<std::string> missing;
  uint64_t missing_count = 0;
  // Of those, the ones that saw values, all NaN or Inf.
  uint64_t nonfinite_only = 0;
  std::string first_nonfinite;
  for (uint32_t layer : selected) {
    for (Role role : g.roles()) {
      for (uint32_t head = 0; head < g.heads(role); ++head) {
        const HeadStatistics& h = stats.head(layer, role, head);
        if (h.finite_count != 0) continue;
        ++missing_count;
        if (missing.size() < 20)
          missing.push_back(TripleName(layer, role, head));
        if (h.nonfinite_count() != 0 && nonfinite_only++ == 0) {
          first_nonfinite =
              absl::StrCat(TripleName(layer, role, head), ": ", h.nan_count,
                           " NaN, ", h.inf_count, " Inf");
        }
      }
    }
  }
  if (missing_count == 0 || allow_missing) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      missing_count, " (layer, role, head) triples have no data: ",
      absl::StrJoin(missing, ", "),
      missing_count > missing.size() ? ", ..." : "",
      nonfinite_only == 0
          ? ""
          : absl::StrCat("; ", nonfinite_only,
                         " of them saw only non-finite values (first ",
                         first_nonfinite, ")"),
      " (set allow_missing to finalize the rest)"));
}

// The scales of one (layer, role): per tensor, per head, or per head then
// the largest of each KV group's query heads; empty when a head has no data.
RoleScales ScalesOfRole(const SessionStatistics& stats,
                        const ScaleOptions& options, uint32_t layer,
                        Role role) {
  const Geometry& g = stats.geometry();
  const uint32_t log2_bins = g.log2_bins_per_octave();
  const uint32_t heads = g.heads(role);
  std::vector<const HeadStatistics*> all(heads);
  RoleScales out;
  bool any_missing = false;
  for (uint32_t h = 0; h < heads; ++h) {
    all[h] = &stats.head(layer, role, h);
    out.count += all[h]->finite_count;
    out.nonfinite += all[h]->nonfinite_count();
    any_missing |= all[h]->finite_count == 0;
  }
  if (any_missing) return out;
  if (options.granularity == Granularity::kPerTensor) {
    const float range = ObserverRange(all, options, log2_bins);
    out.scale.push_back(ScaleFromRange(range, options.margin, options.format));
    out.absmax.push_back(StaticAbsmax(all));
    return out;
  }
  for (uint32_t h = 0; h < heads; ++h) {
    std::span<const HeadStatistics* const> one(&all[h], 1);
    const float range = ObserverRange(one, options, log2_bins);
    out.scale.push_back(ScaleFromRange(range, options.margin, options.format));
    out.absmax.push_back(StaticAbsmax(one));
  }
  if (role == Role::kQ && options.q_per_kv_group) {
    const uint32_t group = g.num_attention_heads / g.num_key_value_heads;
    std::vector<float> scale(g.num_key_value_heads, 0.0f);
    std::vector<float> absmax(g.num_key_value_heads, 0.0f);
    for (uint32_t h = 0; h < heads; ++h) {
      scale[h / group] = std::max(scale[h / group], out.scale[h]);
      absmax[h / group] = std::max(absmax[h / group], out.absmax[h]);
    }
    out.scale = std::move(scale);
    out.absmax = std::move(absmax);
  }
  return out;
}

}  // namespace

absl::StatusOr<ScaleResult> ComputeScales(const SessionStatistics& stats,
                                          const ScaleOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  const Geometry& g = stats.geometry();
  if ((options.observer == Observer::kMse ||
       options.observer == Observer::kPercentile) &&
      !g.has_histograms()) {
    return absl::FailedPreconditionError(
        "the mse and percentile observers need histograms; this session was "
        "created with histogram_bins_per_octave = 0");
  }
  if (stats.finite_values() == 0) {
    const uint64_t nonfinite = stats.nonfinite_values();
    return absl::FailedPreconditionError(
        absl::StrCat("the session has no finite values: nothing to calibrate",
                     nonfinite == 0 ? ""
                                    : absl::StrCat(" (it saw only ", nonfinite,
                                                   " NaN or Inf values)")));
  }
  KVCAL_ASSIGN_OR_RETURN(const std::vector<uint32_t> selected,
                         SelectLayers(g, options.layers));
  KVCAL_RETURN_IF_ERROR(CheckMissing(stats, selected, options.allow_missing));

  ScaleResult result;
  result.layers.resize(selected.size());
  struct Job {
    size_t slot;  // index into result.layers
    uint32_t layer;
    Role role;
  };
  std::vector<Job> jobs;
  for (size_t slot = 0; slot < selected.size(); ++slot) {
    result.layers[slot].layer = selected[slot];
    for (Role role : g.roles()) jobs.push_back({slot, selected[slot], role});
  }
  auto run_job = [&](size_t index) {
    const Job& job = jobs[index];
    result.layers[job.slot].roles[RoleIndex(job.role)] =
        ScalesOfRole(stats, options, job.layer, job.role);
  };
  if (options.observer == Observer::kMse ||
      options.observer == Observer::kPercentile) {
    ThreadPool::Shared().ParallelFor(jobs.size(), run_job);
  } else {
    for (size_t i = 0; i < jobs.size(); ++i) run_job(i);
  }
  return result;
}

}  // namespace kvcal
